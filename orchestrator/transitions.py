"""What an orchestrator does with one shard message: decide, compare-and-advance, publish.

No program state is kept here between messages: plans are immutable and only cached
(orchestrator/plans.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from orchestrator import limits, machine, metrics, saga
from orchestrator.backlog import Backlog
from orchestrator.bus import GOING_ON, NEW, Publisher, ladder_floor_ms, task_priority
from orchestrator.clock import RedisClock
from orchestrator.delivery import Poison
from orchestrator.ending import end_program
from orchestrator.marks import Marks
from orchestrator.messages import (
    CARRYING,
    INLINE_BYTES,
    MAX_ITEM_BYTES,
    Deadline,
    Failed,
    ItemFrom,
    KeyLimit,
    Next,
    Signalled,
    Slot,
    Start,
    TaskMessage,
    Wake,
    encode,
)
from orchestrator.paths import SAGA, is_saga, parent_of, scope_of
from orchestrator.plans import Plan, Plans
from orchestrator.program import (
    MAX_PROGRAM_BRANCHES,
    Bag,
    Branch,
    Compensate,
    Map,
    Member,
    Retry,
    Signal,
    Sleep,
    Task,
    is_lane,
    pool_of,
)
from orchestrator.shares import pool_of_share, share_pool
from orchestrator.store import TERMINAL, Store

log = logging.getLogger(__name__)
# Messages that may outlive their program (ended, then expired or purged): a deadline, a
# sleep's or a signal timeout's wake, up to 30 days ahead, and a signal's hint. Acked as
# `gone`: parked, they filled the dead letters with each long timer of a program that ended.
TIMERS = (Deadline, Wake, Signalled)


def _task_output(message: Next, plan: Plan) -> str | None:
    """The output a `next` reports for a single task of a program's step, as the owner records
    it with its advance (the worker may have left that to it: messages.CARRY); None for any
    other leaf (a bag's members are recorded by their workers), a compensation, or an output
    too large to carry (its worker recorded it)."""
    if message.stored or is_saga(message.path):
        return None
    if not isinstance(machine.leaf_at(plan.program, message.path), Task):
        return None
    return json.dumps(message.output)


def task_messages(
    wf: str,
    plan: Plan,
    leaf: machine.Leaf,
    attempt: int = 0,
    only: int | None = None,
    *,
    prev_ref: bool = False,
    chunk_for: Callable[[str], int] | None = None,
    epoch: int = 0,
) -> dict[str, list[bytes]]:
    """The task messages that run one leaf (or only its member `only`), by pool (the program's
    share of it: `shares.share_pool`). A bag's
    members go out in chunks of members of the same pool: its `chunk`, or when it names none
    `chunk_for(pool)` (the pool's backlog decides; without it, one member per message). A
    large input is referred to (the plan says so), and the prev when `prev_ref`: both must be
    stashed first (`Transitions._stash`)."""
    step = leaf.step
    assert not isinstance(step, Sleep | Signal), "a sleep or a signal runs no task"
    # A bag's branches run their own steps (opened with the bag): no task message here.
    members: dict[int, Member] = (
        dict(step.tasks()) if isinstance(step, Bag) else dict.fromkeys(range(leaf.size or 1), step)
    )
    size = len(step.bag) if isinstance(step, Bag) else len(members)
    items = leaf.items or ()
    indices = list(members) if only is None else [only]
    by_pool: dict[str, list[int]] = {}
    for i in indices:
        pool = share_pool(pool_of(step, i if isinstance(step, Bag) else None), plan.share)
        by_pool.setdefault(pool, []).append(i)
    messages: dict[str, list[bytes]] = {}

    def args(i: int) -> dict[str, Any]:  # a member's args, with what args_from gave
        if not leaf.args:
            return members[i].args
        return {**members[i].args, **leaf.args[i if isinstance(step, Bag) else 0]}

    def limit(i: int) -> KeyLimit | None:  # the slot a member must hold, its key evaluated
        key = leaf.limits[i] if leaf.limits else None
        found = members[i].limit
        return None if key is None or found is None else KeyLimit(key=key, max=found.max)

    undoable = leaf.path in plan.undoable  # once a leaf, not once a message
    for pool, ours in by_pool.items():
        bodies = messages[pool] = []
        chunk = 1
        if not isinstance(step, Task) and len(ours) > 1:
            chunk = step.chunk or (chunk_for(pool) if chunk_for else 1)
        # A member with a limit travels alone: its worker holds one slot for one task.
        groups = [[i] for i in ours if limit(i) is not None]
        free = [i for i in ours if limit(i) is None]
        groups += [free[start : start + chunk] for start in range(0, len(free), chunk)]
        for group in groups:
            first, *rest = group
            message = TaskMessage(
                wf=wf,
                path=leaf.path,
                index=None if leaf.size is None else first,
                size=size,
                task=members[first].task,
                args=args(first),
                item=_carried(items, first),
                item_from=_read_from(items, first),
                input=None if plan.big_input else plan.input,
                prev=None if prev_ref else leaf.prev,
                input_ref=plan.big_input is not None,
                prev_ref=prev_ref,
                iteration=leaf.iteration,
                attempt=attempt,
                owner=plan.owner,
                timeout_s=members[first].timeout_s,
                batch=[
                    Slot(
                        index=i,
                        task=members[i].task,
                        args=args(i),
                        timeout_s=members[i].timeout_s,
                        item=_carried(items, i),
                        item_from=_read_from(items, i),
                    )
                    for i in rest
                ],
                epoch=epoch,
                limit=limit(first),
                undoable=undoable,
            )
            bodies.append(encode(message))
    return messages


def _timed(plan: Plan, path: str) -> tuple[str, str] | None:
    """The pool and kind of the leaf at `path`, for the step timings (a bag: the bag's pool);
    None for a start ("") or a path that is no leaf of the program."""
    if path == "":
        return None
    try:
        step = machine.leaf_at(plan.program, path)
    except machine.PathError:
        return None
    kind = type(step).__name__.lower()
    if isinstance(step, Sleep | Signal):
        return "timer", kind
    return pool_of(step), kind


def _carried(items: tuple[Any, ...], i: int) -> Any:
    """Member `i`'s item when its message carries it."""
    return None if not items or isinstance(items[i], ItemFrom) else items[i]


def _read_from(items: tuple[Any, ...], i: int) -> ItemFrom | None:
    """Where member `i`'s worker reads its item, when its message does not carry it."""
    return items[i] if items and isinstance(items[i], ItemFrom) else None


def _group_leaf(group: saga.Group) -> machine.Leaf:
    """A group of compensations as the leaf that runs it: a bag of their tasks (on their
    pools, else parallel), each member's item the output (JSON) of what it undoes: carried,
    or over MAX_ITEM_BYTES read by the worker where it was recorded (it stays there while
    the program compensates)."""
    members: list[Member | Branch] = [_member(undo.compensate) for undo in group.undo]
    items = tuple(
        ItemFrom(step=group.step, index=undo.index)
        if len(undo.output) > MAX_ITEM_BYTES
        else json.loads(undo.output)
        for undo in group.undo
    )
    return machine.Leaf(group.path, Bag(bag=members), None, 0, items=items)


def _member(compensate: Compensate) -> Member:
    return Member(
        task=compensate.task,
        args=compensate.args,
        retry=compensate.retry,
        timeout_s=compensate.timeout_s,
        pool=compensate.pool,
    )


def _failure(message: Failed, errors: list[str]) -> machine.Failed:
    where = message.path if message.index is None else f"{message.path}/bag:{message.index}"
    if len(errors) == 1:
        return machine.Failed(f"step {where}: task {message.task!r}: {errors[0]}")
    tries = "; ".join(f"#{n}: {error}" for n, error in enumerate(errors, 1))
    return machine.Failed(
        f"step {where}: task {message.task!r} failed {len(errors)} attempts: {tries}"
    )


class Transitions:
    """Applies start / next / failed messages of the shards this process owns."""

    def __init__(
        self,
        store: Store,
        bus: Publisher,
        plans: Plans,
        max_join_bytes: int = 64 << 20,
        backlog: Backlog | None = None,
        bundles: bool = True,
    ) -> None:
        self.store = store
        self.bus = bus
        self.plans = plans
        self.clock = RedisClock(store)  # timers compare "now" with the stamps Redis wrote
        self.max_join_bytes = max_join_bytes
        # Pool depths for bags and maps that name no chunk; None: one member per message.
        self.chunk_for = backlog.chunk if backlog else None
        # The same for single tasks of several programs (bundling.py); None: never bundled.
        self.bundle_for = backlog.bundle if backlog and bundles else None
        self.counts: Counter[str] = Counter()
        self.marks = Marks(store)  # what `explain` and `status` show of failed attempts

    def _gone(self, message: Deadline | Wake | Signalled) -> str:
        self.counts["gone"] += 1
        metrics.GONE.labels("orchestrator").inc()
        log.info("%s: %s for a program that is gone, ignored", message.wf, message.kind)
        return "gone"

    async def apply(
        self,
        message: Start | Next | Failed | Deadline | Wake | Signalled,
        *,
        redelivered: bool,
        shard: int,
    ) -> str:
        """Apply one message that arrived on `shard`; return the verdict (applied, replay,
        stale, ...). Raises Poison for a message no retry can help: an unknown program, one
        that another shard owns, a report that does not fit the program."""
        plan = await self.plans.get(message.wf, fresh=isinstance(message, Start))
        if plan is None:
            # Gone only when its state is too: a state without a plan (an evicted key) is a
            # fault to see, in the dead letters.
            if isinstance(message, TIMERS) and not await self.store.state(message.wf):
                return self._gone(message)
            raise Poison(f"{message.wf}: no such program")
        if plan.owner != shard:
            raise Poison(f"{message.wf}: owned by shard {plan.owner}, not by shard {shard}")
        if isinstance(message, Deadline):
            return await self._deadline(message, plan)
        if isinstance(message, Signalled):
            verdict = await self._signalled(message, plan)
            if verdict != "gone":  # counted there
                self.counts[verdict] += 1
            return verdict
        epoch: int | None = None  # a start belongs to whatever run the program is in...
        state: dict[str, str] = {}  # read by a start only (its run, and when it was created)
        output: str | None = None  # a finished single task's, recorded with the advance
        if isinstance(message, Next | Failed) and is_saga(message.path):
            verdict = await self._compensation(message, plan, redelivered=redelivered)
            self.counts[verdict] += 1
            return verdict
        if isinstance(message, Start):
            expected = ""
            state = await self.store.state(message.wf)
            # ...as read here: its advance applies to that run only, so an owner that stalled
            # between this read and the advance cannot move a run redriven meanwhile.
            epoch = run = int(state.get("epoch") or 0)
            if state.get("status") == "compensating":  # the compensations start
                verdict = await self._compensate(
                    message.wf, plan, "", None, run, state, redelivered=redelivered
                )
                self.counts[verdict] += 1
                return verdict
            if await self._past_deadline(state, plan, run):  # its first step never runs
                deadline = Deadline(wf=message.wf, deadline_s=plan.program.deadline_s or 1)
                return await self._deadline(deadline, plan)
            if run:  # redriven (lua/redrive.lua): run again from where it stopped
                started = await self._redriven(message.wf, plan, state)
                if isinstance(started, str):
                    self.counts[started] += 1
                    return started
                outcome = started
            elif plan.evaluates:  # a map first: its items come from CEL (see _following)
                outcome = await asyncio.to_thread(machine.first, plan.program, plan.input)
            else:
                outcome = machine.first(plan.program, plan.input)
        elif isinstance(message, Next | Wake):
            epoch = run = message.epoch
            expected = message.path
            steps = await self._refs(message.wf, plan)
            if isinstance(message, Next):
                following = await self._following(message, plan, steps)
                output = _task_output(message, plan)
            else:
                following = await self._woken(message, plan, steps)
            if isinstance(following, str):  # a step long gone, a sleep not yet due, a signal
                self.counts[following] += 1
                if following == "stale":
                    _ignored(message, following)
                return following
            outcome = following
        else:
            failure = await self._record_failure(message, plan, redelivered=redelivered)
            if isinstance(failure, str):  # retried, or a stale report
                self.counts[failure] += 1
                metrics.failure_verdict(failure)
                if failure == "stale":
                    _ignored(message, failure)
                return failure
            expected, outcome = message.path, failure
            epoch = run = message.epoch
        verdict = await self._advance(message.wf, plan, expected, outcome, epoch, output)
        if verdict.verdict == "missing":
            if isinstance(message, TIMERS):
                return self._gone(message)
            raise Poison(f"{message.wf}: no such program")
        # stale: a duplicate or late message, acked and ignored
        self.counts[verdict.verdict] += 1
        # The step's pool and kind are looked up only for a step that was timed (applied).
        timed = _timed(plan, expected) if verdict.elapsed_ms is not None else None
        metrics.advanced(expected, timed, verdict, redelivered=redelivered)
        ended = verdict.status in TERMINAL
        # A redelivered message may be the one whose publishing a crash cut short; once the
        # program ended (a cancel answers `replay` to its cursor's report) nothing is owed.
        if verdict.verdict == "applied" or (
            verdict.verdict == "replay" and redelivered and not ended
        ):
            if verdict.verdict == "replay" and isinstance(message, Next) and output is not None:
                outcome = await self._as_recorded(message, plan, steps, output, outcome)
            if isinstance(message, Start) and plan.program.deadline_s is not None:
                await self._publish_deadline(message.wf, plan, run, state)
            priority = NEW if expected == "" else GOING_ON
            if verdict.status == "compensating":  # failed: its owner runs the compensations
                await self.bus.publish_to_shard(plan.owner, encode(Start(wf=message.wf)), NEW)
            elif isinstance(outcome, machine.Joined):
                if verdict.joined:  # this branch was its bag's last member: the bag is done
                    await self._joined(message.wf, plan, outcome, run)
            else:
                replay = verdict.verdict == "replay"
                await self._publish(message.wf, plan, outcome, priority, run, replay=replay)
            if verdict.verdict == "replay":
                self.counts["republished"] += 1
                log.info("%s: %s redelivered after a crash: published again", message.wf, expected)
            elif ended:
                why = outcome.error if isinstance(outcome, machine.Failed) else ""
                log.info("%s: ended %s%s", message.wf, verdict.status, why and f": {why[:500]!r}")
        else:
            _ignored(message, verdict.verdict)
        if ended:
            self.plans.forget(message.wf)
            await self.store.untrack(message.wf, plan.owner)
        return verdict.verdict

    async def _as_recorded(
        self,
        message: Next,
        plan: Plan,
        steps: dict[str, Any],
        output: str,
        outcome: machine.Outcome,
    ) -> machine.Outcome:
        """What followed the task when its advance applied: computed from the output recorded
        then (of any size: a run that recorded it itself may have stored a large one), not
        this report's, which may be another run's of the same task (its worker carried it:
        nothing recorded it before the advance that chose the winner). Nothing recorded (an
        owner from before messages.CARRY applied it): this report's is all there is."""
        read = await self.store.outputs(message.wf, message.path, None, self.max_join_bytes)
        if read.values is None and not read.total:
            return outcome
        if read.values is not None and read.values[0] == output:
            return outcome
        stored = Next(wf=message.wf, path=message.path, stored=True, epoch=message.epoch)
        following = await self._following(stored, plan, steps)  # reads it, within the limit
        return outcome if isinstance(following, str) else following

    async def _refs(self, wf: str, plan: Plan) -> dict[str, Any]:
        """The recorded outputs of the steps the program reads by id (one read; none when it
        reads none). Those still to finish are missing, and the machine adds them on the way."""
        if not plan.program.referenced:
            return {}
        found = await self.store.refs(wf, sorted(plan.program.referenced))
        return {name: json.loads(text) for name, text in found.items()}

    async def _following(
        self, message: Next, plan: Plan, steps: dict[str, Any]
    ) -> machine.Outcome | str:
        """What follows a finished leaf; "stale" when its output was left in Redis (too large
        to carry) and the step is no longer the program's (gone with its loop iteration)."""
        output = message.output
        if message.stored:
            step = machine.leaf_at(plan.program, message.path)
            size = len(step.bag) if isinstance(step, Bag) else None
            if isinstance(step, Map):  # its size was decided when it started
                size = await self._map_size(message.wf, message.path)
            limit = self.max_join_bytes
            read = await self.store.outputs(message.wf, message.path, size, limit)
            if read.values is None and read.total > limit:
                return machine.Failed(
                    f"step {message.path}: its output of {read.total} bytes is over the limit "
                    f"of {limit} (SHARDFLOW_MAX_JOIN_BYTES)"
                )
            if read.values is None:
                state = await self.store.at(message.wf, message.path)
                if (
                    state.get("status") != "running"
                    or state.get("cursor") != message.path
                    or int(state.get("epoch") or 0) != message.epoch
                ):
                    return "stale"
                raise Poison(f"{message.wf}: step {message.path} has no recorded output to read")
            values = [json.loads(value) for value in read.values]
            output = values if size is not None else values[0]
        args = (plan.program, message.path, output, plan.input, steps)
        # `after` may evaluate an `until` or a map's list (up to its time budget): wait in a
        # thread, which only waits on the evaluator's pipe, so the shard keeps serving.
        if plan.evaluates:
            return await asyncio.to_thread(machine.after, *args)
        return machine.after(*args)

    async def _woken(
        self, message: Wake, plan: Plan, steps: dict[str, Any]
    ) -> machine.Outcome | str:
        """What follows a sleep that is due; "waiting" (sent again, delayed) while it is early,
        "stale" once the program is elsewhere. The wake is only a hint: when the step began
        and what it passes on are read from Redis, so a forged or early wake changes nothing."""
        step = machine.leaf_at(plan.program, message.path)
        if isinstance(step, Signal):
            return await self._timed_out(message, plan, step)
        if not isinstance(step, Sleep):
            raise Poison(f"{message.wf}: step {message.path} is not a sleep")
        state = await self.store.at(message.wf, message.path)
        if int(state.get("epoch") or 0) != message.epoch:
            return "stale"  # a wake of an earlier run (before a redrive)
        if state.get("status") == "running" and state.get("cursor") == message.path:
            began_ms = int(state.get("updated_ms") or 0)
            delay_ms = ladder_floor_ms(began_ms / 1000 + step.sleep_s - await self.clock.now())
            if delay_ms > 0:
                body = encode(message)
                await self.bus.publish_to_shard_later(plan.owner, body, delay_ms / 1000)
                return "waiting"
        # Due, or past: a redelivered wake may owe what its step published (advance says).
        [kept] = await self.store.blobs(message.wf, [message.path])
        if kept is None:
            return "stale"  # ended (and expired) meanwhile
        args = (plan.program, message.path, json.loads(kept), plan.input, steps)
        if plan.evaluates:
            return await asyncio.to_thread(machine.after, *args)
        return machine.after(*args)

    async def _deadline(self, message: Deadline, plan: Plan) -> str:
        """End the program if its run is past its deadline; "waiting" (sent again, delayed)
        while early. The message is only a hint, as a wake is: the deadline is the program's
        own, counted from the stamps Redis keeps (submission; a redriven run's start), so a forged
        deadline, or one an operator's message-ttl policy let out early, ends nothing early."""
        deadline_s = plan.program.deadline_s
        if deadline_s is None:
            raise Poison(f"{message.wf}: a deadline, but its program names none")
        state = await self.store.state(message.wf)
        if not state:  # expired or purged since (its plan still cached)
            return self._gone(message)
        status = state.get("status")
        if status in ("pending", "running") and int(state.get("epoch") or 0) == message.epoch:
            now = await self.clock.now()
            if not message.epoch:
                since_ms = int(state.get("created_ms") or 0)
            elif status == "running":
                since_ms = int(state.get("started_ms") or 0)
            else:  # a redriven run not started yet: its deadline has not begun
                since_ms = int(now * 1000)
            left_s = since_ms / 1000 + deadline_s - now
            if left_s > 0:  # under a ladder step left (even 1 ms): sent on for 1 ms
                delay_ms = max(1, ladder_floor_ms(left_s))
                body = encode(Deadline(wf=message.wf, deadline_s=deadline_s, epoch=message.epoch))
                await self.bus.publish_to_shard_later(plan.owner, body, delay_ms / 1000)
                return "waiting"
        return await end_program(
            self.store,
            self.bus,
            message.wf,
            "failed",
            f"deadline of {deadline_s}s exceeded",
            epoch=message.epoch,
            compensates=bool(plan.program.compensations),
        )

    async def _signalled(self, message: Signalled, plan: Plan) -> str:
        """A signal was kept for the program: the step at the cursor takes it if it waits for
        that name ("taken"); else it stays kept for the step that will ("kept")."""
        state = await self.store.state(message.wf)
        if not state:  # expired or purged since (its plan still cached)
            return self._gone(message)
        if state.get("status") != "running":
            return "kept"
        epoch = int(state.get("epoch") or 0)
        # The program's cursor, and those of the branches open under it (bounded by
        # MAX_PROGRAM_BRANCHES): the first waiting for this name takes it.
        cursors = [(state.get("cursor", ""), state.get("leaf", ""))]
        for _ in range(MAX_PROGRAM_BRANCHES + 1):
            if not cursors:
                break
            cursor, leaf = cursors.pop(0)
            if not cursor:
                continue
            step = machine.leaf_at(plan.program, cursor)
            if leaf == "signal" and isinstance(step, Signal) and step.signal == message.name:
                return await self._take(message.wf, plan, cursor, step, epoch)
            if isinstance(step, Bag) and leaf.startswith("bag:"):
                for i, _ in step.branches():
                    mine = await self.store.at(message.wf, f"{cursor}/branch:{i}/")
                    cursors.append((mine.get("cursor", ""), mine.get("leaf", "")))
        return "kept"

    async def _take(self, wf: str, plan: Plan, path: str, step: Signal, epoch: int) -> str:
        """The signal step at `path` takes its signal, if one is kept: its data is then the
        step's output in Redis, and the owner tells itself the step is done (a `next` it reads
        from Redis, so a crash anywhere replays the same data and never takes a second)."""
        verdict = await self.store.take(wf, path, step.signal, epoch)
        if verdict == "taken":
            body = encode(Next(wf=wf, path=path, stored=True, epoch=epoch))
            await self.bus.publish_to_shard(plan.owner, body)
        return verdict

    async def _timed_out(self, message: Wake, plan: Plan, step: Signal) -> machine.Outcome | str:
        """A signal step's timer: early, it is sent on for what is left; due, the step takes a
        signal kept meanwhile, or fails the program."""
        state = await self.store.at(message.wf, message.path)
        if int(state.get("epoch") or 0) != message.epoch:
            return "stale"  # a timer of an earlier run (before a redrive)
        if state.get("status") != "running" or state.get("cursor") != message.path:
            return "stale"
        if step.timeout_s is None:  # no owner sets one: a forged or mistaken message
            raise Poison(f"{message.wf}: step {message.path} is a signal without a timeout")
        began_ms = int(state.get("updated_ms") or 0)
        delay_ms = ladder_floor_ms(began_ms / 1000 + step.timeout_s - await self.clock.now())
        if delay_ms > 0:
            await self.bus.publish_to_shard_later(plan.owner, encode(message), delay_ms / 1000)
            return "waiting"
        verdict = await self._take(message.wf, plan, message.path, step, message.epoch)
        if verdict != "waiting":
            return verdict  # taken just in time (or the program moved on)
        return machine.Failed(
            f"step {message.path}: signal {step.signal!r} not received within {step.timeout_s}s"
        )

    async def _map_size(self, wf: str, path: str) -> int:
        """A map's number of items, as advance.lua recorded its leaf (`bag:<size>`); 0 when
        the program is not at `path` any more."""
        state = await self.store.at(wf, path)
        leaf = state.get("leaf", "")
        if state.get("cursor") != path or not leaf.startswith("bag:"):
            return 0  # not the program's step any more: nothing will be read
        return int(leaf.removeprefix("bag:"))

    async def _stash(self, wf: str, plan: Plan, leaf: machine.Leaf) -> bool | None:
        """Keep what the leaf's task messages refer to; whether the prev is referred to, or
        None when the program has ended (nothing to run)."""
        blobs = {"input": plan.big_input} if plan.big_input else {}
        text = json.dumps(leaf.prev)
        if len(text) > INLINE_BYTES:
            blobs[leaf.path] = text
        if blobs and not await self.store.stash(wf, blobs):
            return None
        return leaf.path in blobs

    async def _past_deadline(self, state: dict[str, str], plan: Plan, run: int) -> bool:
        """Whether a program waiting for its start is past its deadline already (after an
        outage, or a backlog on its shard's queue): it fails there, and its first step's
        handlers never run. A redriven run's deadline begins at its start."""
        deadline_s = plan.program.deadline_s
        created_ms = int(state.get("created_ms") or 0)
        if deadline_s is None or run or state.get("status") != "pending" or not created_ms:
            return False
        return await self.clock.now() - created_ms / 1000 >= deadline_s

    async def _publish_deadline(
        self, wf: str, plan: Plan, epoch: int, state: dict[str, str]
    ) -> None:
        """The deadline counts from submission (`created_ms` of the state the start read):
        what is left of it when the program starts. A redriven run gets the whole deadline
        again, from its start."""
        deadline_s = plan.program.deadline_s
        assert deadline_s is not None
        created_ms = int(state.get("created_ms") or 0)
        elapsed_s = max(0.0, await self.clock.now() - created_ms / 1000) if created_ms else 0.0
        if epoch:
            elapsed_s = 0.0
        body = encode(Deadline(wf=wf, deadline_s=deadline_s, epoch=epoch))
        # Rounded down, as the sends that follow it are: rounded up, it ended programs late.
        delay_ms = max(1, ladder_floor_ms(deadline_s - elapsed_s))
        await self.bus.publish_to_shard_later(plan.owner, body, delay_ms / 1000)

    async def _record_failure(
        self, message: Failed, plan: Plan, *, redelivered: bool
    ) -> str | machine.Failed:
        """Apply the retry policy: a verdict when the task is tried again (or the report is
        stale), else the program's failure, with every attempt's error."""
        step = machine.leaf_at(plan.program, message.path)
        if isinstance(step, Sleep | Signal):
            kind = type(step).__name__.lower()
            raise Poison(f"{message.wf}: step {message.path} is a {kind}: no task to fail")
        if isinstance(step, Bag):
            if message.index is None or not 0 <= message.index < len(step.bag):
                raise machine.PathError(f"{message.path}: no bag member {message.index}")
            found = step.bag[message.index]
            if isinstance(found, Branch):  # a branch's tasks report at their own paths
                raise machine.PathError(f"{message.path}: bag member {message.index} is a branch")
            member: Member = found
        elif isinstance(step, Map):  # fail.lua checks the index against the map's size
            if message.index is None or not 0 <= message.index < step.max_items:
                raise machine.PathError(f"{message.path}: no map member {message.index}")
            # The item a retry sends again comes back in the report: held to the map's bound.
            size = len(json.dumps(message.item, ensure_ascii=False).encode())
            if size > MAX_ITEM_BYTES:
                raise Poison(f"{message.wf}: an item of {size} bytes, over a map item's limit")
            member = step
        else:
            member = step
        policy = member.retry
        attempts = policy.max_attempts if policy else 1
        if message.attempt >= attempts:
            raise Poison(f"{message.wf}: attempt {message.attempt} of a task tried {attempts}x")
        reply = await self.store.fail(
            message.wf,
            message.path,
            message.index,
            message.attempt,
            message.error,
            attempts,
            message.epoch,
        )
        if reply.verdict in ("missing", "invalid"):
            raise Poison(f"{message.wf}: {', '.join(reply.outputs) or 'no such program'}")
        if reply.verdict == "late":  # its compensations may begin now (lua/begin.lua)
            await self.bus.publish_to_shard(plan.owner, encode(Start(wf=message.wf)), NEW)
            return "late"
        if reply.verdict == "stale":
            if redelivered and plan.program.compensations:
                await self._start_owed(message.wf, plan, message.epoch)
            return "stale"
        if policy is None or message.attempt + 1 >= attempts:
            await self.marks.failed(message, None)
            return _failure(message, reply.outputs or [message.error])
        # A redelivered report may be the one whose retry a crash cut short.
        if reply.verdict == "retry" or redelivered:
            items = None
            if isinstance(step, Map):  # only member `index` is sent again, with its item
                size = await self._map_size(message.wf, message.path)
                if message.index is None or message.index >= size:
                    return "stale"
                items = tuple(message.item if i == message.index else None for i in range(size))
            leaf = machine.Leaf(message.path, step, message.prev, message.iteration, items)
            prev_ref = message.prev_ref  # stashed when the first attempt was sent
            computed = await self._arguments(message, plan, leaf)
            if isinstance(computed, machine.Failed):
                return computed
            leaf = replace(leaf, args=computed)
            call = (step, leaf.path, plan.input, computed, items, message.index)
            keys = await asyncio.to_thread(limits.keys_of, *call)  # CEL, as _arguments
            if isinstance(keys, str):
                return machine.Failed(keys)
            leaf = replace(leaf, limits=keys)
            if not prev_ref and (await self._stash(message.wf, plan, leaf)) is None:
                return "stale"
            by_pool = task_messages(
                message.wf,
                plan,
                leaf,
                attempt=message.attempt + 1,
                only=message.index,
                prev_ref=prev_ref,
                epoch=message.epoch,
            )
            return await self._retry_later(message, plan, policy, by_pool)
        return "stale"

    async def _start_owed(self, wf: str, plan: Plan, epoch: int) -> None:
        """A redelivered report that fail.lua refuses may be the one that made the program
        compensating, its saga's start cut short by a crash (the sweep would wait for an
        empty queue): while the saga has not moved yet, send the start again. It is
        idempotent: its compare-and-advance from "" applies once."""
        state = await self.store.at(wf, f"{SAGA}:0")  # with the saga's cursor
        if state.get("status") != "compensating" or state.get("cursor"):
            return
        if int(state.get("epoch") or 0) != epoch:
            return
        await self.bus.publish_to_shard(plan.owner, encode(Start(wf=wf)), NEW)
        self.counts["republished"] += 1
        log.info("%s: redelivered failure: the start of its compensations sent again", wf)

    async def _arguments(
        self, message: Failed, plan: Plan, leaf: machine.Leaf
    ) -> tuple[dict[str, Any], ...] | machine.Failed:
        """A retried leaf's `args_from`, computed again as when it started: the program is
        still at this leaf, so the outputs it reads are the ones it read then."""
        step = leaf.step
        if isinstance(step, Sleep | Signal):
            return ()
        members = [m for _, m in step.tasks()] if isinstance(step, Bag) else [step]
        if not any(member.args_from for member in members):
            return ()
        prev = leaf.prev
        if message.prev_ref:
            [kept] = await self.store.blobs(message.wf, [message.path])
            if kept is None:
                return machine.Failed(f"step {message.path}: its prev is gone")
            prev = json.loads(kept)
        steps = await self._refs(message.wf, plan)
        call = (step, leaf.path, prev, leaf.iteration, plan.input, steps)
        return await asyncio.to_thread(machine.arguments, *call)

    async def _advance(
        self,
        wf: str,
        plan: Plan,
        expected: str,
        outcome: machine.Outcome,
        epoch: int | None,
        output: str | None = None,
    ) -> Any:
        """Compare-and-advance from `expected` to what follows it; `output`: the finished
        single task's, recorded (as what this transition used) only if the advance applies."""
        # The cursor that moves: the program's, or that of the branch `expected` runs in.
        scope = scope_of(expected)
        if isinstance(outcome, machine.Leaf):
            drop = machine.dropped(plan.program, expected, outcome.path)
            return await self.store.advance(
                wf,
                expected,
                outcome.path,
                "running",
                leaf=outcome.shape,
                drop=drop,
                refs=outcome.refs,
                epoch=epoch,
                scope=scope,
                opened=outcome.opened(),
                output=output,
            )
        if isinstance(outcome, machine.Joined):  # the branch is over: a member of its bag
            joined = json.dumps(outcome.output)
            return await self.store.advance(
                wf, expected, "", "running", "", joined, refs=outcome.refs, epoch=epoch,
                scope=scope, output=output,
            )  # fmt: skip
        if isinstance(outcome, machine.Done):
            result = json.dumps(outcome.result)
            return await self.store.advance(
                wf, expected, "", "completed", "result", result, epoch=epoch, output=output
            )
        # A program that names compensations runs them first (see _compensate).
        status = "compensating" if plan.program.compensations else "failed"
        return await self.store.advance(
            wf, expected, "", status, "error", outcome.error, epoch=epoch, scope=scope,
            output=output,
        )  # fmt: skip

    async def _groups(self, wf: str, plan: Plan) -> list[saga.Group]:
        """The program's compensations to run (orchestrator/saga.py): one read of the outputs
        its compensated steps recorded, which no longer change once it left running."""
        found = await self.store.leaf_outputs(wf, saga.leaves(plan.program))
        return saga.plan(plan.program, found)

    async def _compensate(
        self,
        wf: str,
        plan: Plan,
        expected: str,
        epoch: int | None,
        run: int,
        state: dict[str, str] | None = None,
        *,
        redelivered: bool,
        failure: str | None = None,
        groups: list[saga.Group] | None = None,
    ) -> str:
        """Move the saga's cursor on from `expected` ("": the start, sent when the program
        became compensating; else the group that just finished) with compare-and-advance in
        the scope `saga`: to the next group, whose tasks go out, or to the end: compensated,
        compensation_failed (`failure`: a compensation ran out of tries), or, with nothing to
        undo, the status that caused it (failed or cancelled), so that it can be redriven.
        `groups`: the plan when the caller read it already (it no longer changes)."""
        if not expected:
            if state is None:
                state = await self.store.state(wf)
            waiting = await self._still_running(wf, plan, state)
            if waiting:  # each one's end (a late report) sends the start again
                log.info("%s: compensations wait for %d started task(s)", wf, waiting)
                return "waiting"
        if groups is None:
            groups = await self._groups(wf, plan)
        following = None if failure is not None else saga.following(groups, expected)
        status, field, payload = saga.COMPENSATION_FAILED, "saga_error", failure or ""
        if following is not None:
            status, field = "compensating", ""
        elif failure is None and expected:
            status, field = saga.COMPENSATED, ""
        elif failure is None:  # nothing completed that names a compensation
            if state is None:
                state = await self.store.state(wf)
            status, field = state.get("cause") or "failed", ""
        cursor = following.path if following is not None else ""
        shape = f"bag:{len(following.undo)}" if following is not None else ""
        verdict = await self.store.advance(
            wf, expected, cursor, status, field, payload, leaf=shape, epoch=epoch, scope=SAGA
        )
        if verdict.verdict == "missing":
            raise Poison(f"{wf}: no such program")
        ended = verdict.status in TERMINAL
        owed = verdict.verdict == "applied" or (verdict.verdict == "replay" and redelivered)
        if owed and following is not None and not ended:
            # A replay publishes again only while the saga still stands at that group: a
            # group that finished since must not undo twice.
            at = await self.store.at(wf, following.path)
            if verdict.verdict == "applied" or at.get("cursor") == following.path:
                await self._publish_group(wf, plan, following, run)
        if verdict.verdict == "applied":
            log.info("%s: compensation %r -> %r (%s)", wf, expected, cursor, verdict.status)
        if ended:
            if verdict.verdict == "applied":
                metrics.program_ended(verdict.status)
            self.plans.forget(wf)
            await self.store.untrack(wf, plan.owner)
        return verdict.verdict

    async def _still_running(self, wf: str, plan: Plan, state: dict[str, str]) -> int:
        """How many tasks of the step a compensating program failed or was cancelled at still
        run (started before, lua/begin.lua): its compensations start once they ended, so
        that what they did is undone too."""
        at = state.get("from") or ""
        if state.get("status") != "compensating" or at not in plan.undoable:
            return 0
        return await self.store.started(wf, at)

    async def _publish_group(
        self, wf: str, plan: Plan, group: saga.Group, epoch: int, only: int | None = None
    ) -> None:
        """Send a group's compensations (or only member `only`, a retry's, delayed by the
        caller), each with the output it undoes as its item."""
        leaf = _group_leaf(group)
        if plan.big_input and not await self.store.stash(wf, {"input": plan.big_input}):
            return  # ended meanwhile
        by_pool = task_messages(wf, plan, leaf, only=only, chunk_for=self.chunk_for, epoch=epoch)
        level = task_priority(plan.priority, going_on=True)
        for pool, bodies in by_pool.items():
            await self.bus.publish_all(pool, bodies, level)

    async def _compensation(self, message: Next | Failed, plan: Plan, *, redelivered: bool) -> str:
        """A report of a compensation's leaf (`saga:<step>`): its group finished (next), or
        one of its tasks failed: tried again by its own retry policy, or, out of tries, the
        program ends compensation_failed."""
        groups = await self._groups(message.wf, plan)
        if isinstance(message, Next):
            # Trusted only once every member of its group is recorded (a forged or misrouted
            # `next` would skip the rest of the group, or end the saga compensated early).
            group = saga.group_at(groups, message.path)
            if group is None or await self.store.members(message.wf, message.path) < len(
                group.undo
            ):
                return "stale"
            return await self._compensate(
                message.wf, plan, message.path, message.epoch, message.epoch,
                redelivered=redelivered, groups=groups,
            )  # fmt: skip
        group = saga.group_at(groups, message.path)
        if group is None or message.index is None or not 0 <= message.index < len(group.undo):
            raise Poison(f"{message.wf}: no compensation {message.path} member {message.index}")
        policy = group.undo[message.index].compensate.retry
        attempts = policy.max_attempts if policy else 1
        if message.attempt >= attempts:
            raise Poison(f"{message.wf}: attempt {message.attempt} of a task tried {attempts}x")
        reply = await self.store.fail(
            message.wf, message.path, message.index, message.attempt, message.error, attempts,
            message.epoch,
        )  # fmt: skip
        if reply.verdict in ("missing", "invalid"):
            raise Poison(f"{message.wf}: {', '.join(reply.outputs) or 'no such program'}")
        if reply.verdict == "stale":
            return "stale"
        if policy is None or message.attempt + 1 >= attempts:
            await self.marks.failed(message, None)
            failure = _failure(message, reply.outputs or [message.error]).error
            return await self._compensate(
                message.wf, plan, message.path, message.epoch, message.epoch,
                redelivered=redelivered, failure=f"compensation {failure}", groups=groups,
            )  # fmt: skip
        if reply.verdict != "retry" and not redelivered:
            return "stale"
        leaf = _group_leaf(group)
        by_pool = task_messages(
            message.wf, plan, leaf, attempt=message.attempt + 1, only=message.index,
            epoch=message.epoch,
        )  # fmt: skip
        return await self._retry_later(message, plan, policy, by_pool)

    async def _retry_later(
        self, message: Failed, plan: Plan, policy: Retry, by_pool: dict[str, list[bytes]]
    ) -> str:
        """Send a failed task's next attempt after its backoff (a step's or a compensation's)."""
        delay_s = policy.delay_s(message.attempt)
        await self.marks.failed(message, delay_s)
        level = task_priority(plan.priority, going_on=True)
        for pool, bodies in by_pool.items():  # one member: one pool, one message
            await self.bus.publish_later(pool, bodies[0], delay_s, level, CARRYING)
        return "retried"

    async def _redriven(self, wf: str, plan: Plan, state: dict[str, str]) -> machine.Outcome | str:
        """Where a redriven program starts again (`rerun`, recorded by lua/redrive.lua), with
        the output of `prior` as its prev; "stale" when that output is gone because the
        program moved on (a late start)."""
        rerun, prior = state.get("rerun", ""), state.get("prior", "")
        prev: Any = None
        if prior:
            step = machine.leaf_at(plan.program, prior)
            if isinstance(step, Sleep):  # a sleep passes its prev on: kept at its path
                [kept] = await self.store.blobs(wf, [prior])
                found = None if kept is None else [kept]
                total = 0
            else:
                size = len(step.bag) if isinstance(step, Bag) else None
                if isinstance(step, Map):  # every member finished: the barrier is its size
                    size = await self.store.members(wf, prior)
                read = await self.store.outputs(wf, prior, size, self.max_join_bytes)
                found, total = read.values, read.total
            if found is None:
                if state.get("status") != "pending" or state.get("cursor"):
                    return "stale"
                if total > self.max_join_bytes:
                    return machine.Failed(
                        f"redrive: the output of step {prior} ({total} bytes) is over the "
                        f"limit of {self.max_join_bytes} (SHARDFLOW_MAX_JOIN_BYTES)"
                    )
                return machine.Failed(f"redrive: the output of step {prior} is gone")
            values = [json.loads(value) for value in found]
            single = isinstance(step, Task | Sleep | Signal)  # a signal's data: out:<path>
            prev = values[0] if single else values
        args = (plan.program, rerun, prev, plan.input, await self._refs(wf, plan))
        if plan.evaluates:
            return await asyncio.to_thread(machine.resume, *args)
        return machine.resume(*args)

    async def _publish(
        self,
        wf: str,
        plan: Plan,
        outcome: machine.Outcome,
        priority: int,
        epoch: int,
        *,
        replay: bool = False,
    ) -> None:
        """Run a leaf: its tasks, its timer, and the first leaves of a bag's branches (on a
        replay, only those of branches that are still at their first leaf: the others moved
        on, and what they owe their own transitions republish)."""
        if isinstance(outcome, machine.Leaf):
            moved = replay and scope_of(outcome.path)
            if moved and (await self.store.at(wf, outcome.path)).get("cursor") != outcome.path:
                return
            if isinstance(outcome.step, Sleep):
                await self._sleep(wf, plan, outcome, epoch)
                return
            if isinstance(outcome.step, Signal):
                await self._await_signal(wf, plan, outcome, outcome.step, epoch)
                return
            if outcome.size == 0:  # a map over no items: done at once, by its owner
                body = encode(Next(wf=wf, path=outcome.path, output=[], epoch=epoch))
                await self.bus.publish_to_shard(plan.owner, body, priority)
                return
            for _, first in outcome.branches:  # a bag's branches start beside its tasks
                await self._publish(wf, plan, first, priority, epoch, replay=replay)
            if isinstance(outcome.step, Bag) and not outcome.step.tasks():
                return  # branches only
            prev_ref = await self._stash(wf, plan, outcome)
            if prev_ref is None:
                return  # ended meanwhile (cancelled): nothing to run
            # One pool after the other: a failure leaves no publish running unawaited.
            by_pool = task_messages(
                wf, plan, outcome, prev_ref=prev_ref, chunk_for=self.chunk_for, epoch=epoch
            )
            level = task_priority(plan.priority, going_on=priority == GOING_ON)
            for pool, bodies in by_pool.items():
                most = self._bundle_most(outcome.step, pool)
                await self.bus.publish_all(pool, bodies, level, CARRYING, most)
                # Its steps are timed under its own name (while labels are left): the pool's,
                # not its share's queue's.
                metrics.pool_label(pool_of_share(pool))

    def _bundle_most(self, step: object, pool: str) -> int:
        """How many programs' tasks a task of `step` may share a message with: while `pool`
        has a backlog, a single task (a chain's step) with no limit goes in a bundle
        (orchestrator/bundling.py); a lane runs one task at a time, so never there."""
        if self.bundle_for is None or not isinstance(step, Task) or step.limit is not None:
            return 1
        return 1 if is_lane(pool) else self.bundle_for(pool)

    async def _joined(self, wf: str, plan: Plan, outcome: machine.Joined, epoch: int) -> None:
        """Every member of a branch's bag finished: the owner tells itself the bag is done, as
        a worker does when its task fills the barrier (the outputs are read from Redis)."""
        parent = parent_of(outcome.scope)
        assert parent is not None, outcome.scope
        body = encode(Next(wf=wf, path=parent[0], stored=True, epoch=epoch))
        await self.bus.publish_to_shard(plan.owner, body, GOING_ON)

    async def _await_signal(
        self, wf: str, plan: Plan, leaf: machine.Leaf, step: Signal, epoch: int
    ) -> None:
        """Start waiting for a signal: one kept already is taken now; else its timer is set."""
        verdict = await self._take(wf, plan, leaf.path, step, epoch)
        if verdict == "waiting" and step.timeout_s is not None:
            delay_s = max(ladder_floor_ms(step.timeout_s), 1) / 1000
            body = encode(Wake(wf=wf, path=leaf.path, epoch=epoch))
            await self.bus.publish_to_shard_later(plan.owner, body, delay_s)

    async def _sleep(self, wf: str, plan: Plan, leaf: machine.Leaf, epoch: int) -> None:
        """Start a sleep: keep what it passes on in Redis, and send its wake, delayed. The
        timer lives in the broker's delay queues, so it survives any restart."""
        assert isinstance(leaf.step, Sleep)
        if not await self.store.stash(wf, {leaf.path: json.dumps(leaf.prev)}):
            return  # ended meanwhile (cancelled)
        delay_s = max(ladder_floor_ms(leaf.step.sleep_s), 1) / 1000
        body = encode(Wake(wf=wf, path=leaf.path, epoch=epoch))
        await self.bus.publish_to_shard_later(plan.owner, body, delay_s)


def _ignored(message: Start | Next | Failed | Wake, verdict: str) -> None:
    """Say so when a message changes nothing: a duplicate, a late one, or a forged one."""
    path = getattr(message, "path", "")
    log.info("%s: %s message for %r ignored (%s)", message.wf, message.kind, path, verdict)
