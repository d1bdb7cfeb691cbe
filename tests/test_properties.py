"""Ordering you can trust: the real transitions, in a real Redis, under a hostile transport.

The state machine plays RabbitMQ. Its rules deliver the messages the system produced in any
order, deliver them twice, deliver old ones again, and crash a process between writing state
and publishing (after any number of its publishes). Delayed messages (retries, deadlines) are
held until a rule lets time pass for one of them, at any later point: time is abstract, a delay
orders nothing. Programs have tasks that fail or time out on some attempts, retry policies and
deadlines, and steps that read earlier ones' outputs by id (their task messages must carry the
args the model computes); a rule cancels a program through the router at any time (or while one
of its tasks runs: the control message reaches the worker mid-task), and another holds a task's
handlers while other messages are handled (a copy of the same task on a second worker moves the
program on before the first records). The orchestrator, router and worker code that handles
each message is the real one (`handle_shard_message`, `Router.cancel`, `Worker.handle`) and so
are the Lua scripts; only the transport is simulated. A small model (tests/model.py) says what
must happen; invariants are checked after every rule, and at the end every message left is
delivered (delayed ones too) so that every program must have ended, as the model says or as its
cancel or deadline says, and a cancel after the end must change nothing.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import pytest
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from redis.asyncio import Redis

from orchestrator.keys import Keys, Names
from orchestrator.machine import leaf_at
from orchestrator.memory_store import MemoryStore
from orchestrator.messages import Cancelled, Start, TaskMessage, decode_task
from orchestrator.owner import handle_shard_message
from orchestrator.paths import is_saga, live_status, parent_of
from orchestrator.plans import Plans
from orchestrator.program import Program, parse_program, pool_of
from orchestrator.redis_store import RedisStore
from orchestrator.settings import Settings
from orchestrator.shares import share_of, share_pool
from orchestrator.store import TERMINAL, Completion, Ended, Slot, Store, Verdict
from orchestrator.transitions import Transitions
from router.client import Router
from router.redriving import RedriveError
from tests.model import (
    SIGNAL,
    SLEEP_S,
    Expected,
    compensations,
    expect,
    input_of,
    output_of,
    programs,
    saga_plan,
    signal_data,
    with_compensations,
    with_limits,
)
from worker.context import TaskContext
from worker.pool import Worker
from worker.registry import Registry
from worker.runs import run_key

MAX_IN_FLIGHT = 300
LIVE = ("pending", "running", "compensating")


class Crash(BaseException):
    """A process dies here: nothing after this point of its work happens."""


@dataclass(frozen=True)
class Envelope:
    kind: str  # "shard", "task" or "control"
    body: bytes
    redelivered: bool = False
    shard: int = -1  # the queue a shard message was published to
    wf: str = ""
    timed: bool = False  # a task message with a timeout: its handler may wait real time
    pool: str = ""  # the pool (its share's queue) a task message was published to
    headers: tuple[tuple[str, Any], ...] = ()  # a task message's (messages.CARRY)


def _is_wake(envelope: Envelope) -> bool:
    return envelope.kind == "shard" and json.loads(envelope.body).get("kind") == "wake"


class FakeDelivery:
    def __init__(self, envelope: Envelope) -> None:
        self.body = envelope.body
        self.redelivered = envelope.redelivered
        self.headers: dict[str, Any] = dict(envelope.headers)
        self.priority = None
        self.acked = False
        self.nacked = False

    async def ack(self) -> None:
        self.acked = True

    async def nack(self, *, requeue: bool = True) -> None:
        self.nacked = True


class Transport:
    """Plays the broker: keeps what was published (delayed messages apart, until time passes
    for them); may crash the publisher after N publishes."""

    def __init__(self, on_task: Any) -> None:
        self.in_flight: list[Envelope] = []
        self.later: list[Envelope] = []  # delayed: a retry (task) or a deadline (shard)
        self.published: list[Envelope] = []  # everything, in order
        self.crash_after: int | None = None
        self.redelivered = False  # the flag of the message being handled
        self.dead: list[str] = []
        self._on_task = on_task
        self.names = Names("")  # the worker names the queue a waiting task goes back to

    def _count(self) -> None:
        if self.crash_after is not None:
            if self.crash_after == 0:
                raise Crash
            self.crash_after -= 1

    def _task(
        self, body: bytes, *, retry: bool, pool: str, headers: dict[str, Any] | None
    ) -> Envelope:
        task = decode_task(body)
        self._on_task(task, retry=retry, pool=pool)
        timed = any(t.timeout_s is not None for t in task.split())
        kept = tuple(sorted((headers or {}).items()))
        return Envelope("task", body, wf=task.wf, timed=timed, pool=pool, headers=kept)

    def _keep(self, envelope: Envelope, *, delayed: bool = False) -> None:
        (self.later if delayed else self.in_flight).append(envelope)
        self.published.append(envelope)

    async def publish_to_shard(
        self, owner: int, body: bytes, priority: int = 1, most: int = 1
    ) -> None:
        # Each report alone, as a lone task's; bundles' transport is tested on a real broker.
        self._count()
        self._keep(Envelope("shard", body, shard=owner, wf=json.loads(body)["wf"]))

    async def publish_all(
        self,
        pool: str,
        bodies: list[bytes],
        priority: int = 1,
        headers: Any = None,
        most: int = 1,
    ) -> None:
        for body in bodies:
            self._count()
            self._keep(self._task(body, retry=False, pool=pool, headers=headers))

    async def publish_later(
        self, pool: str, body: bytes, delay_s: float, priority: int = 1, headers: Any = None
    ) -> None:
        assert delay_s >= 0, delay_s
        self._count()
        self._keep(self._task(body, retry=True, pool=pool, headers=headers), delayed=True)

    async def publish_to_shard_later(self, owner: int, body: bytes, delay_s: float) -> None:
        assert delay_s > 0, delay_s
        self._count()
        envelope = Envelope("shard", body, shard=owner, wf=json.loads(body)["wf"])
        self._keep(envelope, delayed=True)

    async def publish_control(self, body: bytes) -> None:
        self._count()
        self._keep(Envelope("control", body, wf=Cancelled.model_validate_json(body).wf))

    async def dead_letter(self, body: bytes, *, reason: str, source: str, **_: Any) -> None:
        self.dead.append(f"{source}: {reason}")

    async def requeue(self, queue: str, body: bytes, headers: Any, priority: Any, **_: Any) -> None:
        raise AssertionError(f"a handler failed on a good message: {headers}")


@dataclass(frozen=True)
class Lease:
    key: str
    expiry: int  # on RecordingStore.clock_ms
    released: bool = False


class RecordingStore:
    """A store (the real Lua in Redis, or its model), noting what each transition decided."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.keys = inner.keys
        self.recorded: dict[tuple[str, str], set[int]] = defaultdict(set)
        self.fired: Counter[tuple[str, str]] = Counter()
        self.ended: Counter[str] = Counter()
        self.final: dict[str, dict[str, str]] = {}  # each program's state as it ended
        self.cancelled: dict[str, tuple[str, str]] = {}  # ended by cancel: (status, reason)
        self.compensating: set[str] = set()  # programs that began compensating (this run)
        self.stopped: dict[str, str] = {}  # compensations stopped by a cancel: its reason
        self.violations: list[str] = []
        self._limits_init()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def record(
        self, wf: str, path: str, size: int, outputs: Mapping[int | None, str], epoch: int = 0
    ) -> Completion:
        self._dies()  # a worker dying before it records (see die_holding_slot)
        before = await self.inner.at(wf, path)  # in a branch: the branch's cursor
        completion = await self.inner.record(wf, path, size, outputs, epoch)
        if completion.verdict in ("fire", "again", "wait") and (
            before.get("status") != live_status(path) or before.get("cursor") != path
        ):
            self.violations.append(
                f"{wf} {path}: {completion.verdict} while the program was "
                f"{before.get('status')} at {before.get('cursor')!r}"
            )
        run = int(before.get("epoch") or 0)
        if completion.verdict in ("fire", "again", "wait") and epoch != run:
            self.violations.append(f"{wf} {path}: a task of run {epoch} recorded in run {run}")
        if completion.verdict != "stale":
            self.recorded[(wf, path)].update(index or 0 for index in outputs)
        if completion.verdict == "fire":
            self.fired[(wf, path)] += 1
            # A member that never finished has no output (JSON text is never empty).
            if len(completion.outputs) != size or not all(completion.outputs):
                self.violations.append(f"{wf} {path}: barrier fired before all {size} finished")
        return completion

    # --- per-key limits: a clock the machine moves, and who holds which slot -------------

    def _limits_init(self) -> None:
        # The leases' clock (ms), passed to every acquire and renew: only the machine moves it
        # (leases_run_out), so a replay sees the same leases run out.
        self.clock_ms = 1_000_000_000
        self.leases: dict[str, Lease] = {}  # holder -> its slot, until released
        self.dead: set[str] = set()  # holders whose worker died holding the slot
        self.dying = False  # while set, the worker dies at its next record or release
        self.waiting = ""  # the task (`wf path member`) an acquire just found busy
        self.busy = 0  # acquires that found every slot held

    def _dies(self) -> None:
        if self.dying:
            raise Crash

    def alive(self, key: str) -> list[str]:
        """Holders of a slot of `key` now: not released, their lease not run out."""
        return [
            holder
            for holder, lease in self.leases.items()
            if lease.key == key and not lease.released and lease.expiry > self.clock_ms
        ]

    def dead_alive(self, key: str | None = None) -> list[str]:
        """Slots held by dead workers whose leases have not run out yet."""
        keys = {lease.key for lease in self.leases.values()} if key is None else {key}
        return [holder for k in keys for holder in self.alive(k) if holder in self.dead]

    async def acquire(
        self, key: str, holder: str, most: int, lease_ms: int, now_ms: int | None = None
    ) -> Slot:
        slot = await self.inner.acquire(key, holder, most, lease_ms, self.clock_ms)
        if slot.verdict in ("acquired", "held"):
            self.leases[holder] = Lease(key, self.clock_ms + lease_ms)
        else:
            self.busy += 1
            self.waiting = holder.rsplit(" ", 1)[0]
        held = len(self.alive(key))
        if held > most:
            self.violations.append(f"{holder}: {held} hold a slot of {key!r} (max {most})")
        if slot.held != held:
            self.violations.append(
                f"acquire({key!r}) by {holder}: {slot.verdict} with {slot.held} holding, "
                f"but {held} hold a live lease"
            )
        if slot.verdict == "busy" and held < most:
            self.violations.append(f"{holder}: busy while {held} of {most} hold {key!r}")
        return slot

    async def renew(self, key: str, holder: str, lease_ms: int, now_ms: int | None = None) -> Slot:
        slot = await self.inner.renew(key, holder, lease_ms, self.clock_ms)
        if slot.verdict == "renewed" and holder in self.leases:
            self.leases[holder] = Lease(key, self.clock_ms + lease_ms)
        return slot

    async def release(self, key: str, holder: str) -> Slot:
        self._dies()
        slot = await self.inner.release(key, holder)
        lease = self.leases.get(holder)
        if lease is None or lease.released:
            self.violations.append(f"{holder}: released {key!r} it never acquired (or twice)")
        elif slot.verdict == "gone" and lease.expiry > self.clock_ms:
            self.violations.append(f"{holder}: its slot of {key!r} gone before its lease ran out")
        if lease is not None:
            self.leases[holder] = replace(lease, released=True)
        return slot

    async def stored_leases(self, key: str) -> dict[str, int]:
        """The holders the store keeps for `key` (run-out ones not dropped yet too)."""
        name = self.keys.limit(key)
        if isinstance(self.inner, MemoryStore):
            found = self.inner.data.get(name) or {}
            assert isinstance(found, dict)
            return {holder: int(expiry) for holder, expiry in found.items()}
        assert isinstance(self.inner, RedisStore)
        pairs = await self.inner.client.zrange(name, 0, -1, withscores=True)
        return {holder: int(expiry) for holder, expiry in pairs}

    async def signals_left(self, wf: str, name: str) -> int:
        """Signals of `name` kept and never taken (the model's list, or the Redis list)."""
        key = self.keys.signals(wf, name)
        if isinstance(self.inner, MemoryStore):
            return len(self.inner.data.get(key) or [])
        assert isinstance(self.inner, RedisStore)
        return int(await self.inner.client.llen(key))

    async def take(self, wf: str, path: str, name: str, epoch: int | None = None) -> str:
        verdict = await self.inner.take(wf, path, name, epoch)
        if verdict == "taken":  # each signal step takes its own signal, once
            stored = (await self.inner.outputs(wf, path, None, 1 << 20)).values
            if stored != [json.dumps(signal_data(path))]:
                self.violations.append(f"{wf} {path}: took {stored}, not its own signal")
            self.recorded[(wf, path)].add(0)
        return verdict

    async def advance(
        self, wf: str, expected: str, cursor: str, status: str, *args: str, **kwargs: str
    ) -> Verdict:
        verdict = await self.inner.advance(wf, expected, cursor, status, *args, **kwargs)
        if verdict.verdict == "applied" and kwargs.get("output") is not None:
            self.recorded[(wf, expected)].add(0)  # a single task's output, carried to its owner
        if verdict.verdict == "applied" and status in TERMINAL:
            await self._ended(wf)
        scope = str(kwargs.get("scope", ""))
        if verdict.verdict == "applied" and status == "compensating" and scope != "saga":
            self.compensating.add(wf)
        if verdict.verdict == "applied" and scope and not cursor and status == "running":
            parent = parent_of(scope)  # a branch ended: its member of the bag is recorded
            assert parent is not None, scope
            self.recorded[(wf, parent[0])].add(parent[1])
            if verdict.joined:  # and it was the bag's last: the barrier fired
                self.fired[(wf, parent[0])] += 1
        return verdict

    async def cancel(
        self,
        wf: str,
        status: str,
        reason: str,
        epoch: int | None = None,
        compensates: bool = False,
        stop: bool = False,
    ) -> Ended | None:
        ended = await self.inner.cancel(wf, status, reason, epoch, compensates, stop)
        if ended is not None and ended.now:
            if ended.status == "compensation_failed":  # a cancel stopped the compensations
                self.stopped[wf] = reason
                await self._ended(wf)
                return ended
            self.cancelled.setdefault(wf, (status, reason))
            if ended.status == "compensating":  # its compensations run first
                self.compensating.add(wf)
            else:
                await self._ended(wf)
        return ended

    async def _ended(self, wf: str) -> None:
        self.ended[wf] += 1
        self.final.setdefault(wf, await self.inner.state(wf))

    def new_run(self, wf: str, roots: list[str]) -> None:
        """A redrive opened a new run: it ends once more, and the steps at or under `roots`
        record (and their barriers fire) again."""
        self.ended[wf] = 0
        self.final.pop(wf, None)
        self.cancelled.pop(wf, None)
        self.compensating.discard(wf)
        self.stopped.pop(wf, None)
        for key in [key for key in self.recorded if key[0] == wf]:
            if any(key[1] == root or key[1].startswith(root + "/") for root in roots):
                del self.recorded[key]
                self.fired.pop(key, None)


class Cluster(RuleBasedStateMachine):
    """One or two drawn programs run by the real transition code over a hostile transport."""

    redis_url = ""
    prefix = ""
    store_kind = "redis"  # or "memory": the model of the scripts (orchestrator/memory_store.py)

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        keys = Keys(f"{self.prefix}-{uuid.uuid4().hex[:6]}")
        inner: Store
        if self.store_kind == "redis":
            inner = RedisStore(Redis.from_url(self.redis_url, decode_responses=True), keys)
        else:
            inner = MemoryStore(keys)
        self.store = RecordingStore(inner)
        self.transport = Transport(self._check_dispatch)
        self.transitions = Transitions(self.store, self.transport, Plans(self.store, 64))
        settings = Settings(prefix=keys.prefix)
        handlers = {"work": self._work, "boom": self._boom, "flaky": self._flaky}
        registry = Registry({name: self._in_slot(run) for name, run in handlers.items()})
        self.worker = Worker(
            settings, registry, pool="parallel", store=self.store, bus=self.transport
        )
        # Another worker: it handles the copies of a task delivered while the first holds
        # that task's handlers (_while_running). At the first, a copy would wait for the run
        # it holds (worker/runs.py), which waits for this machine to go on.
        self.second = Worker(
            settings, registry, pool="parallel", store=self.store, bus=self.transport
        )
        self.holding: tuple[Any, ...] | None = None  # run_key of the task held
        self.router = Router(settings, store=self.store, bus=self.transport)
        self.expected: dict[str, Expected] = {}
        self.programs: dict[str, Program] = {}
        self.drawn: dict[str, dict[str, Any]] = {}  # each program as drawn
        # per program, the positions (in the model's list) of the leaves dispatched so far
        self.dispatched: dict[str, set[int]] = {}
        # (wf, path, index, attempt, run) -> retries of it published by a first delivery
        self.retried: Counter[tuple[str, str, int | None, int, int]] = Counter()
        self.epochs: dict[str, int] = {}  # per program, its run (0 until redriven)
        self.redrives_left = 0
        self.history: list[Envelope] = []
        self.cancels_left = 0
        self.interleavings_left = 0
        self.signals: dict[str, list[str]] = {}  # per program, the signal steps not sent yet
        self.saga_dispatched: dict[str, set[int]] = {}  # per program, compensation groups sent
        self.sent: Counter[str] = Counter()
        self.gate: asyncio.Event | None = None  # while set up, every handler waits on it
        self.held = 0
        self.all_held = asyncio.Event()  # set when `expect_held` handlers wait at the gate
        self.expect_held = 0
        self.running_keys: Counter[str] = Counter()  # handlers running per limit key
        # (wf, run, path) -> members whose handler returned an output: of a step that names
        # compensations, each must be recorded (and so undone) if the program compensates
        self.returned: dict[tuple[str, int, str], set[int]] = defaultdict(set)

    # --- the tasks: `work` and `flaky` as tests/model.py describes them --------------------

    async def _hold(self) -> None:
        gate = self.gate  # handlers started later (by another delivery meanwhile) run freely
        if gate is not None:
            self.held += 1
            if self.held == self.expect_held:
                self.all_held.set()
            await gate.wait()

    def _in_slot(self, handler: Any) -> Any:
        """A handler that checks, as it starts, that a limited task holds a slot of its key
        (the key the model computes), and that its key's running handlers and dead workers'
        live slots are at most its max."""

        async def run(ctx: TaskContext) -> Any:
            found = self.expected[ctx.workflow_id].keys.get((ctx.step, ctx.index))
            if found is None:
                return await handler(ctx)
            key, most = found
            member = "-" if ctx.index is None else str(ctx.index)
            mine = f"{ctx.workflow_id} {ctx.step} {member} "
            if not any(h.startswith(mine) for h in self.store.alive(key)):
                self.store.violations.append(f"{mine}ran without a slot of {key!r}")
            self.running_keys[key] += 1
            try:
                running = self.running_keys[key] + len(self.store.dead_alive(key))
                if running > most:
                    self.store.violations.append(
                        f"{mine}runs with {running} holding {key!r} (max {most})"
                    )
                return await handler(ctx)
            finally:
                self.running_keys[key] -= 1

        return run

    async def _work(self, ctx: TaskContext) -> dict[str, Any]:
        await self._hold()
        return self._returns(ctx)

    def _returns(self, ctx: TaskContext) -> dict[str, Any]:
        wf = ctx.workflow_id
        self.returned[(wf, self.epochs.get(wf, 0), ctx.step)].add(ctx.index or 0)
        return output_of(ctx.step, ctx.index)

    async def _boom(self, ctx: TaskContext) -> None:
        await self._hold()
        raise RuntimeError("boom")

    async def _flaky(self, ctx: TaskContext) -> dict[str, Any]:
        await self._hold()
        fails = ctx.args["fails"]
        if ctx.attempt < len(fails):
            if fails[ctx.attempt] == "timeout":
                await asyncio.sleep(30)  # the worker cuts it off after its timeout_s
                raise AssertionError("a task outlived its timeout")
            raise RuntimeError(f"attempt {ctx.attempt} fails")  # see attempt_error
        return self._returns(ctx)

    def run(self, coroutine: Any) -> Any:
        return self.loop.run_until_complete(coroutine)

    def teardown(self) -> None:
        try:
            # Every slot still held now is a dead worker's (no handler runs between rules):
            # their leases run out, so the waiting tasks get slots.
            self.store.clock_ms += self.worker.lease_ms + 1
            self._drain()
            for wf, expected in self.expected.items():
                self._check_end(wf, expected)
            self._no_slot_leaked()
            # A cancel after the end changes nothing (a redelivered cancel, a late user).
            for wf in self.expected:
                self._cancel(wf, "too late")
            self.programs_never_change_after_they_ended()
            self.programs_end_at_most_once_and_as_the_model_says()
        finally:
            self.run(self.store.close())
            self.loop.close()

    # --- what must always hold -------------------------------------------------------

    def _check_dispatch(self, task: TaskMessage, *, retry: bool, pool: str) -> None:
        """Called as each task message is published: every earlier step must be complete,
        the program still live, a retry within the member's attempts and scheduled once,
        every task it carries sent to its own pool (the member's, the bag's, the task's; the
        program's share of it) and
        with the args the model computes (those read from earlier steps by id too)."""
        violations = self.store.violations
        expected = self.expected[task.wf]
        paths = [path for path, _ in expected.leaves]
        if self.store.ended[task.wf]:
            violations.append(f"{task.wf}: {task.path} dispatched after the program ended")
        if task.epoch != self.epochs.get(task.wf, 0):
            violations.append(
                f"{task.wf}: {task.path} of run {task.epoch} dispatched in run "
                f"{self.epochs.get(task.wf, 0)}"
            )
        if is_saga(task.path):
            self._check_compensation(task, retry=retry, pool=pool)
            return
        # A task started before its program compensates runs to its end (lua/begin.lua),
        # going back to wait while every slot of its key is held.
        waits = task.undoable and task.limit is not None and task.limit.waits > 0
        if task.wf in self.store.compensating and not waits:
            violations.append(f"{task.wf}: {task.path} dispatched while it compensates")
        if task.path not in paths:
            violations.append(f"{task.wf}: dispatched {task.path}, not in {paths}")
            return
        step = leaf_at(self.programs[task.wf], task.path)
        share = share_of(self.programs[task.wf])  # the program's kind picks the pool's queue
        pools = {share_pool(pool_of(step, one.index), share) for one in task.split()}
        if pools != {pool}:
            violations.append(f"{task.wf} {task.path}: tasks of pools {pools} sent to {pool}")
        for one in task.split():  # a limited one carries the key (and max) the model says
            want = expected.keys.get((task.path, one.index))
            got = None if task.limit is None else (task.limit.key, task.limit.max)
            if got != want:
                violations.append(f"{task.wf} {task.path}/{one.index}: limit {got}, not {want}")
        for one in task.split():  # args_from read the outputs the model says (steps.<id>)
            args = expected.args.get((task.path, one.index))
            if args is not None and one.args != args:
                violations.append(
                    f"{task.wf} {task.path}/{one.index}: args {one.args}, expected {args}"
                )
        position = paths.index(task.path)
        for path, size in expected.leaves[:position]:
            if expected.side_by_side(path, task.path):  # parallel branches: either order
                continue
            if len(self.store.recorded[(task.wf, path)]) < size:
                violations.append(f"{task.wf}: {task.path} dispatched before {path} completed")
        dispatched = self.dispatched.setdefault(task.wf, set())
        for later in sorted(p for p in dispatched if p > position):
            if not expected.side_by_side(task.path, paths[later]):
                violations.append(
                    f"{task.wf}: {task.path} dispatched again after {paths[later]} was"
                )
                break
        dispatched.add(position)
        if retry and task.limit is not None and task.limit.waits:
            # Sent back by a worker that found every slot held: the same attempt, no retry.
            member = "-" if task.index is None else str(task.index)
            if self.store.waiting != f"{task.wf} {task.path} {member}":
                violations.append(f"{task.wf} {task.path}/{task.index}: waits, never found busy")
            self.store.waiting = ""
            event("a task waited for a slot")
            return
        if not retry:
            if task.attempt != 0:
                violations.append(f"{task.wf} {task.path}: a first run as attempt {task.attempt}")
            return
        most = expected.attempts.get((task.path, task.index), 1)
        if not 0 < task.attempt < most:
            violations.append(
                f"{task.wf} {task.path}/{task.index}: retried as attempt {task.attempt} "
                f"of {most}: more than max_attempts-1 retries"
            )
        # A report delivered for the first time schedules its retry once; only a redelivered
        # one (its handler may have died before publishing) may schedule it again.
        if not self.transport.redelivered:
            key = (task.wf, task.path, task.index, task.attempt, task.epoch)
            self.retried[key] += 1
            if self.retried[key] > 1:
                violations.append(
                    f"{task.wf} {task.path}/{task.index}: attempt {task.attempt} scheduled "
                    "again by a report that was not redelivered"
                )

    def _completed(self, wf: str) -> dict[str, set[int]]:
        """The members of the program's own steps recorded (0: a single task's output)."""
        return {
            path: set(done)
            for (w, path), done in self.store.recorded.items()
            if w == wf and not is_saga(path)
        }

    def _check_compensation(self, task: TaskMessage, *, retry: bool, pool: str) -> None:
        """A compensation's task message: sent only once its program failed or was cancelled,
        only for steps that completed, each member the compensation of the member it undoes
        with that member's output as its item, on its pool, in the order of the plan (a group
        only once every group before it completed; never one again after a later one), and
        retried within its own policy."""
        violations = self.store.violations
        wf = task.wf
        if wf not in self.store.compensating:
            violations.append(f"{wf}: {task.path} dispatched before the program failed")
        plan = saga_plan(self.drawn[wf], self._completed(wf))
        paths = [path for path, _ in plan]
        if task.path not in paths:
            violations.append(f"{wf}: compensation {task.path} dispatched, plan is {paths}")
            return
        position = paths.index(task.path)
        step = task.path.removeprefix("saga:")
        members = plan[position][1]
        for one in task.split():
            if one.index is None or not 0 <= one.index < len(members):
                violations.append(f"{wf} {task.path}: member {one.index} of {len(members)}")
                continue
            member, name = members[one.index]
            if (one.task, one.item) != (name, output_of(step, member)):
                violations.append(
                    f"{wf} {task.path}/{one.index}: {one.task} with item {one.item}, expected "
                    f"{name} undoing {output_of(step, member)}"
                )
        if pool != share_pool("parallel", share_of(self.programs[wf])):
            violations.append(f"{wf} {task.path}: a compensation sent to {pool}")
        for path, size in plan[:position]:
            if len(self.store.recorded[(wf, path)]) < len(size):
                violations.append(f"{wf}: {task.path} dispatched before {path} completed")
        dispatched = self.saga_dispatched.setdefault(wf, set())
        if any(later > position for later in dispatched):
            violations.append(f"{wf}: {task.path} dispatched again after a later group")
        dispatched.add(position)
        most = 2 if any(name == "flaky" for _, name in members) else 1
        if retry and not 0 < task.attempt < most:
            violations.append(f"{wf} {task.path}: retried as attempt {task.attempt} of {most}")
        event("a compensation ran")

    @invariant()
    def nothing_out_of_order(self) -> None:
        assert not self.store.violations, self.store.violations

    @invariant()
    def nothing_dead_lettered(self) -> None:
        assert not self.transport.dead, self.transport.dead

    @invariant()
    def barriers_fire_at_most_once(self) -> None:
        assert all(count == 1 for count in self.store.fired.values()), self.store.fired

    @invariant()
    def programs_end_at_most_once_and_as_the_model_says(self) -> None:
        assert all(count <= 1 for count in self.store.ended.values()), self.store.ended
        for wf, count in self.store.ended.items():
            if count:
                self._check_end(wf, self.expected[wf])

    @invariant()
    def programs_never_change_after_they_ended(self) -> None:
        for wf, final in self.store.final.items():
            now = self.run(self.store.state(wf))
            assert now == final, f"{wf} changed after it ended: {final} -> {now}"

    def _check_end(self, wf: str, expected: Expected) -> None:
        status = self.run(self.router.status(wf))
        assert status is not None and status["status"] in TERMINAL, (
            f"{wf} never ended: lost a message ({status})"
        )
        assert self.store.ended[wf] == 1
        if compensations(self.drawn[wf]) and status["status"] != "completed":
            # Whatever ends a program that names compensations goes through compensating.
            assert wf in self.store.compensating, f"{wf} ended {status} without compensating"
        if wf in self.store.compensating:
            self._check_saga_end(wf, expected, status)
            return
        if wf in self.store.cancelled:  # by a cancel or its deadline, before its own end
            assert (status["status"], status["error"]) == self.store.cancelled[wf], status
            return
        assert status["status"] == expected.status, (status, expected)
        if expected.status == "completed":
            assert status["result"] == expected.result
            # It took as many signals as were sent (each once): a resend was never kept.
            left = self.run(self.store.signals_left(wf, SIGNAL)) if self.sent[wf] else 0
            assert left == 0, f"{wf}: {left} signal(s) kept after it completed"
        else:
            # Every attempt's error, in order; a bag's from whichever member ended it.
            assert status["error"] in expected.errors, (status, expected)
        dispatched = {path for (w, path), done in self.store.recorded.items() if w == wf and done}
        finished = {path for path, size in expected.leaves if size}  # an empty map runs none
        if expected.status == "completed":
            # Every leaf ran, so loops ran exactly as many iterations as the model says.
            assert dispatched == finished, (dispatched, finished)

    def _check_saga_end(self, wf: str, expected: Expected, status: dict[str, Any]) -> None:
        """A program that failed or was cancelled with compensations to its name: it keeps the
        error that caused it; with nothing completed to undo it ends as its cause; else every
        group of the plan ran and it ended compensated, or a compensation that always fails
        (`boom`) ended it compensation_failed and no group after that one ran; a cancel while
        compensating ends it compensation_failed naming its reason."""
        if wf in self.store.cancelled:  # a cancel or a deadline caused it
            cause, reason = self.store.cancelled[wf]
            errors = [reason]
        else:
            assert expected.status == "failed", (status, expected)
            cause, errors = "failed", expected.errors
        assert status["error"] in errors, (status, errors)
        plan = saga_plan(self.drawn[wf], self._completed(wf))
        saga = status.get("compensations") or {}
        if wf in self.store.stopped:
            assert status["status"] == "compensation_failed", status
            reason = self.store.stopped[wf]
            assert saga["error"] == f"compensations stopped by a cancel: {reason}", saga
            return
        # A task that ended with an output is undone, even one that was still running when
        # its program failed or was cancelled (lua/begin.lua): it was recorded.
        completed = self._completed(wf)
        run = self.epochs.get(wf, 0)
        for n, members in compensations(self.drawn[wf]):
            ran = self.returned.get((wf, run, str(n)), set())
            for member, _ in members:
                assert (member or 0) not in ran or (member or 0) in completed.get(str(n), ()), (
                    f"{wf}: step {n} member {member} ended with an output that was never "
                    f"recorded, so never undone (recorded {completed.get(str(n))})"
                )
        if not plan:
            assert status["status"] == cause, (status, plan)
            return
        assert saga["cause"] == cause, saga
        failing = [n for n, (_, members) in enumerate(plan) if any(t == "boom" for _, t in members)]
        if failing:
            assert status["status"] == "compensation_failed", (status, plan)
            assert "task 'boom'" in saga["error"], saga
            for path, _ in plan[failing[0] + 1 :]:
                assert not self.store.recorded.get((wf, path)), f"{wf}: {path} ran after a failure"
        else:
            assert status["status"] == "compensated", (status, plan)
            for path, members in plan:
                assert len(self.store.recorded[(wf, path)]) == len(members), (path, members)
        event(f"a program ended {status['status']}")

    # --- the transport's moves ---------------------------------------------------------

    # what `submit` draws programs from
    grammar = with_compensations(with_limits(programs(faults=True)))
    # how many cancels a run may make (the saga machine makes more: a cancel mid-task)
    cancel_budget = st.sampled_from([0, 0, 0, 1, 2])
    # how often handlers are held while other messages go (the saga machine: more often)
    interleave_budget = st.integers(0, 3)

    @initialize(
        drawn=st.runner().flatmap(
            lambda cluster: st.lists(cluster.grammar, min_size=1, max_size=2)
        ),
        cancels=st.runner().flatmap(lambda cluster: cluster.cancel_budget),
        interleavings=st.runner().flatmap(lambda cluster: cluster.interleave_budget),
        early=st.booleans(),
        redrives=st.sampled_from([0, 1, 2, 3]),
    )
    def submit(
        self,
        drawn: list[dict[str, Any]],
        cancels: int,
        interleavings: int,
        early: bool,
        redrives: int,
    ) -> None:
        # Budgets for the rarer moves, so that the core ones (deliver, crash, duplicate,
        # stale) keep most of the steps and programs get far before a cancel ends them.
        self.cancels_left = cancels
        self.interleavings_left = interleavings
        self.redrives_left = redrives
        for program in drawn:
            wf = f"w{uuid.uuid4().hex[:8]}"
            self.expected[wf] = expect(program)
            self.signals[wf] = list(self.expected[wf].signals)
            self.programs[wf] = parse_program(program)
            self.drawn[wf] = program
            self.run(self.router.submit(program, input_of(program), wf))
            while early and self.signals[wf]:  # every signal kept before any step waits
                self._signal(wf, self.sent[wf], signal_data(self.signals[wf].pop(0)))
                self.sent[wf] += 1

    def _deliver(self, index: int, crash_after: int | None = None) -> None:
        self.run(self._handle(self.transport.in_flight.pop(index), crash_after))

    async def _handle(self, envelope: Envelope, crash_after: int | None = None) -> None:
        """Hand one message to the process that consumes it; it may die after `crash_after`
        of its publishes."""
        if envelope.kind == "control":  # no ack: the worker's exclusive queue is no-ack
            await self.worker.stop_ended(Cancelled.model_validate_json(envelope.body).wf)
            self.history.append(envelope)
            return
        delivery = FakeDelivery(envelope)
        kind = json.loads(envelope.body)["kind"] if envelope.kind == "shard" else None
        deadline = kind == "deadline"
        before = await self.store.state(envelope.wf) if deadline else {}
        if kind in ("deadline", "start") and self.drawn[envelope.wf].get("deadline_s", 60) < 1:
            # A 1 ms deadline is due whenever it comes, not early by a hair (the stamps are
            # whole ms): which rules can run next must not depend on the machine's speed. So
            # is a program's first start past it (it ends there, running no step).
            await asyncio.sleep(0.002)
        later = len(self.transport.later)
        self.transport.crash_after = crash_after
        self.transport.redelivered = envelope.redelivered
        holding = set(self.store.leases)
        try:
            if envelope.kind == "shard":
                await handle_shard_message(
                    delivery, self.transitions, self.transport, envelope.shard, "s"
                )
            else:
                copy = (
                    self.holding is not None and run_key(decode_task(envelope.body)) == self.holding
                )
                worker = self.second if copy else self.worker
                await worker.handle(delivery, self.transport.names.task_queue(envelope.pool))
        except Crash:  # a slot it took and never gave back is a dead worker's
            taken = set(self.store.leases) - holding
            self.store.dead.update(h for h in taken if not self.store.leases[h].released)
        finally:
            self.transport.crash_after = None
        assert not delivery.nacked, "a handler raised: see the log"
        if delivery.acked:
            self.history.append(envelope)
            run = json.loads(envelope.body).get("epoch", 0) if deadline else 0
            live = before.get("status") in ("pending", "running")
            if deadline and live and run == int(before.get("epoch") or 0):
                await self._check_deadline(envelope, before, later)
        else:  # the process died holding it: the broker delivers it again, flagged
            self.transport.in_flight.append(replace(envelope, redelivered=True))

    async def _check_deadline(self, envelope: Envelope, before: dict[str, str], later: int) -> None:
        """A deadline for a live program's run ends it only once the program's own deadline has
        passed since its run began (the message's `deadline_s` is only a hint); while early, it
        changes nothing and is sent on, delayed."""
        wf = envelope.wf
        deadline_s = self.drawn[wf]["deadline_s"]
        after = await self.store.state(wf)
        if not int(before.get("epoch") or 0):
            since_ms = int(before["created_ms"])
        elif before["status"] == "running":
            since_ms = int(before["started_ms"])
        else:  # a redriven run not started yet: its deadline has not begun
            since_ms = int(time.time() * 1000)
        if after == before:  # early: nothing changed, and the deadline waits on
            assert later == len(self.transport.later) - 1, "an early deadline was dropped"
            sent = json.loads(self.transport.later[-1].body)
            assert (sent["kind"], sent["wf"], sent["deadline_s"]) == ("deadline", wf, deadline_s)
            return
        assert time.time() * 1000 >= since_ms + deadline_s * 1000, "ended before its deadline"
        reason = f"deadline of {deadline_s}s exceeded"
        ends = "compensating" if compensations(self.drawn[wf]) else "failed"
        assert (after["status"], after["error"]) == (ends, reason), after

    def _pick(self, data: st.DataObject, items: list[Envelope]) -> int:
        return data.draw(st.integers(0, len(items) - 1), label="message")

    @precondition(lambda self: self.transport.in_flight)
    @rule(data=st.data())
    def deliver(self, data: st.DataObject) -> None:
        self._deliver(self._pick(data, self.transport.in_flight))

    @precondition(lambda self: self.transport.in_flight)
    @rule(data=st.data(), crash_after=st.integers(-1, 3))
    def crash(self, data: st.DataObject, crash_after: int) -> None:
        """The process dies after `crash_after` of its publishes (state already written),
        or with -1 before doing anything: the message comes back flagged as redelivered."""
        index = self._pick(data, self.transport.in_flight)
        if crash_after >= 0:
            self._deliver(index, crash_after)
        else:
            envelope = self.transport.in_flight.pop(index)
            self.transport.in_flight.append(replace(envelope, redelivered=True))

    @precondition(lambda self: 0 < len(self.transport.in_flight) < MAX_IN_FLIGHT)
    @rule(data=st.data(), older=st.booleans())
    def duplicate(self, data: st.DataObject, older: bool) -> None:
        """A publisher retried after a lost confirm: the same message twice. `older`: the copy
        is handled as by a worker from before messages.CARRY (it records the output itself),
        so both ways of reporting a task meet in one program."""
        original = self.transport.in_flight[self._pick(data, self.transport.in_flight)]
        copy = replace(original, redelivered=False)
        self.transport.in_flight.append(replace(copy, headers=()) if older else copy)

    @precondition(lambda self: self.history and len(self.transport.in_flight) < MAX_IN_FLIGHT)
    @rule(data=st.data(), redelivered=st.booleans(), older=st.booleans())
    def stale(self, data: st.DataObject, redelivered: bool, older: bool) -> None:
        """An old message, already handled (from an earlier step or iteration), comes back
        (`older`: to a worker from before messages.CARRY)."""
        old = replace(self.history[self._pick(data, self.history)], redelivered=redelivered)
        self.transport.in_flight.append(replace(old, headers=()) if older else old)

    @precondition(lambda self: self.transport.later)
    @rule(data=st.data())
    def time_passes(self, data: st.DataObject) -> None:
        """A delayed message (a retry, a deadline) is due: any one, at any time."""
        self.transport.in_flight.append(
            self.transport.later.pop(self._pick(data, self.transport.later))
        )

    @precondition(lambda self: self.cancels_left > 0)
    @rule(data=st.data(), dies=st.booleans(), mid_task=st.booleans())
    def cancel(self, data: st.DataObject, dies: bool, mid_task: bool) -> None:
        """A user cancels a program, at any point of its life; the router may die after
        ending it and before telling the workers. With `mid_task`, while one of its tasks
        runs: the control message reaches the worker mid-task, and the task reports nothing."""
        self.cancels_left -= 1
        if mid_task and self._untimed_tasks():
            self._cancel_while_running(data)
            return
        wf = data.draw(st.sampled_from(list(self.expected)), label="program")  # in submit order
        stop = data.draw(st.booleans(), label="stop_compensations")
        self._cancel(wf, "cancelled by a rule", dies=dies, stop=stop)

    def _cancel(self, wf: str, reason: str, *, dies: bool = False, stop: bool = False) -> None:
        """The real cancel path; a live program ends cancelled, an ended one stays as it was,
        a compensating one too unless `stop`."""
        was = self.run(self.store.state(wf))
        self.transport.crash_after = 0 if dies else None
        try:
            self.run(self.router.cancel(wf, reason, stop_compensations=stop))
        except Crash:
            pass
        finally:
            self.transport.crash_after = None
        now = self.run(self.store.state(wf))
        if was["status"] in ("pending", "running"):
            ends = "compensating" if compensations(self.drawn[wf]) else "cancelled"
            assert (now["status"], now["error"]) == (ends, reason), now
        elif was["status"] == "compensating" and stop:  # it stops the compensations
            stopped = f"compensations stopped by a cancel: {reason}"
            assert (now["status"], now["saga_error"]) == ("compensation_failed", stopped), now
        else:
            assert now == was, f"a cancel changed an ended program: {was} -> {now}"

    def _redrivable(self) -> list[str]:
        return [
            wf
            for wf in self._without_signals()
            if self.run(self.store.state(wf)).get("status") in ("failed", "cancelled")
        ]

    def _without_signals(self) -> list[str]:
        """Programs with no signal step: a rerun signal step waits for a new signal, which
        this machine's model of who takes which signal does not follow (not drawn)."""
        return [wf for wf, expected in self.expected.items() if not expected.signals]

    @precondition(lambda self: self.redrives_left > 0 and self._redrivable())
    @rule(data=st.data(), from_start=st.booleans())
    def redrive(self, data: st.DataObject, from_start: bool) -> None:
        """A user redrives a program (`shardflow redrive`, or `--from 0`), at any point of its
        life: a failed or cancelled one runs again from where it stopped (or from its first
        step), every message of its earlier run stale; any other is refused, unchanged."""
        self.redrives_left -= 1
        # Mostly a program it can redrive; now and then any (a live or completed one: refused).
        mostly = self._redrivable() if data.draw(st.integers(0, 3), label="refusable") else []
        wf = data.draw(st.sampled_from(mostly or self._without_signals()), label="program")
        was = self.run(self.store.state(wf))
        try:
            self.run(self.router.redrive(wf, "0" if from_start else None))
        except RedriveError:
            now = self.run(self.store.state(wf))
            assert was["status"] not in ("failed", "cancelled") or "prior" not in was, was
            assert now == was, f"a refused redrive changed the program: {was} -> {now}"
            return
        assert was["status"] in ("failed", "cancelled"), was
        self._new_run(wf, was, from_start)

    def _new_run(self, wf: str, was: dict[str, str], from_start: bool) -> None:
        """What the checks expect once `wf` (in state `was`) was redriven."""
        stopped = was.get("from", "")
        steps = [str(k) for k in range(len(self.programs[wf].steps))]
        if from_start or not stopped:
            roots, position = steps, -1
        else:
            roots = [stopped]
            position = self.expected[wf].position(stopped) - 1
        self.epochs[wf] = int(was.get("epoch") or 0) + 1
        self.store.new_run(wf, roots)
        self.dispatched[wf] = {p for p in self.dispatched.get(wf, set()) if p <= position}

    def _current_tasks(self) -> list[int]:
        """Untimed task messages of a running program's current step, in its current run."""
        found = []
        for i in self._untimed_tasks():
            task = decode_task(self.transport.in_flight[i].body)
            state = self.run(self.store.state(task.wf))
            now = (state.get("status"), state.get("cursor"), int(state.get("epoch") or 0))
            # A program that compensates turns compensating when cancelled: no redrive then.
            if now == ("running", task.path, task.epoch) and not compensations(self.drawn[task.wf]):
                found.append(i)
        return found

    @precondition(lambda self: self.redrives_left > 0 and self._current_tasks())
    @rule(data=st.data())
    def redrive_while_running(self, data: st.DataObject) -> None:
        """While a task runs, its program is cancelled (the router dies before telling the
        workers, so the task goes on) and redriven from that very step, and the new run
        starts: the old task's output, recorded after that, belongs to no run."""
        self.redrives_left -= 1
        index = data.draw(st.sampled_from(self._current_tasks()), label="task")
        envelope = self.transport.in_flight.pop(index)
        wf = envelope.wf

        async def meanwhile() -> None:
            self.transport.crash_after = 0
            try:
                await self.router.cancel(wf, "cancelled to redrive")
            except Crash:
                pass
            finally:
                self.transport.crash_after = None
            was = await self.store.state(wf)
            mark = len(self.transport.published)
            await self.router.redrive(wf)
            self._new_run(wf, was, from_start=False)
            for start in self.transport.published[mark:]:  # the new run's start
                if start in self.transport.in_flight:
                    self.transport.in_flight.remove(start)
                    await self._handle(start)

        self.run(self._while_running(envelope, meanwhile))

    def _untimed_tasks(self) -> list[int]:
        in_flight = self.transport.in_flight
        return [i for i, e in enumerate(in_flight) if e.kind == "task" and not e.timed]

    @precondition(lambda self: self.interleavings_left > 0 and self._untimed_tasks())
    @rule(data=st.data(), race=st.booleans(), older=st.booleans())
    def interleave(self, data: st.DataObject, race: bool, older: bool) -> None:
        """Workers and owners run side by side: while a task's handlers run, one to three
        other messages are handled, each perhaps one the one before published (a bag member
        fails, its report fails the program, the start of its compensations). With `race`, a
        second worker runs a copy of the same task (a publisher's retry) and its report moves
        the program on before the first one records (`older`: the second worker is from
        before messages.CARRY, so one records the output and the other carries it)."""
        self.interleavings_left -= 1
        in_flight = self.transport.in_flight
        candidates = self._untimed_tasks()
        if race:  # copies of a program's current step where there are any: the race that matters
            cursors = {wf: self.run(self.store.state(wf)).get("cursor") for wf in self.expected}
            current = [
                i
                for i in candidates
                if decode_task(in_flight[i].body).path == cursors[in_flight[i].wf]
            ]
            candidates = current or candidates
        envelope = in_flight.pop(data.draw(st.sampled_from(candidates), label="task"))
        # Drawn before the handlers run: a draw inside the event loop could end the example
        # with a handler left pending.
        picks = [] if race else data.draw(st.lists(st.integers(0, 99), min_size=1, max_size=3))

        async def meanwhile() -> None:
            for pick in picks:
                if not in_flight:
                    break
                await self._handle(in_flight.pop(pick % len(in_flight)))
            if race:
                mark = len(self.transport.published)
                copy = replace(envelope, redelivered=False)
                await self._handle(replace(copy, headers=()) if older else copy)
                for report in self.transport.published[mark:]:
                    if report.kind == "shard" and report in in_flight:
                        in_flight.remove(report)
                        await self._handle(report)

        self.run(self._while_running(envelope, meanwhile))

    def _cancel_while_running(self, data: st.DataObject) -> None:
        index = data.draw(st.sampled_from(self._untimed_tasks()), label="task")
        envelope = self.transport.in_flight.pop(index)
        told: list[Envelope] = []

        async def meanwhile() -> None:
            await self.router.cancel(envelope.wf, "cancelled while running")
            told.extend(e for e in self.transport.in_flight if e.kind == "control")
            for control in told:
                self.transport.in_flight.remove(control)
                await self._handle(control)

        mark = self.run(self._while_running(envelope, meanwhile))
        # A task that names a compensation runs to its end (lua/begin.lua): it reports.
        if any(control.wf == envelope.wf for control in told):
            reports = [e for e in self.transport.published[mark:] if e.wf == envelope.wf]
            task = decode_task(envelope.body)
            kept = task.undoable or is_saga(task.path)  # a compensation is never stopped
            assert kept or not reports, f"a task cancelled while it ran reported {reports}"

    async def _while_running(self, envelope: Envelope, meanwhile: Any) -> int:
        """Deliver a task message, hold its handlers, run `meanwhile`, release them; returns
        where the publishing log stood when they were released."""
        task = decode_task(envelope.body)
        running = len(task.split())
        if task.undoable:  # once its program compensates, only members started before run
            indexes = [one.index or 0 for one in task.split()]
            # the same call the worker makes next (begin.lua): its mark is idempotent
            found = await self.store.inner.begin(
                task.wf, task.path, indexes, task.epoch, task.attempt
            )
            running = len(found.outputs) if found.verdict == "go" else running
        delivery = FakeDelivery(envelope)
        gate = asyncio.Event()
        counts = self.worker.counts
        busy, ran = self.store.busy, counts["ran here already"] + counts["recorded already"]
        self.gate, self.held, self.expect_held = gate, 0, running
        self.all_held.clear()
        try:
            handling = asyncio.ensure_future(
                self.worker.handle(delivery, self.transport.names.task_queue(envelope.pool))
            )
            held = asyncio.ensure_future(self.all_held.wait())
            await asyncio.wait({handling, held}, return_when=asyncio.FIRST_COMPLETED)
            held.cancel()
        finally:
            self.gate = None
        if handling.done():
            handling.result()  # raises what ended it early, if anything did
            # Not run at all: only a step its program has left (or its run: a redrive since)
            # may be skipped, a task that found every slot of its key held (it waits), a copy
            # given back by the broker of a message this worker ran to its end, or one whose
            # outputs are recorded already (reported unrun).
            state = await self.store.at(task.wf, task.path)
            now = (state["status"], state["cursor"], int(state.get("epoch") or 0))
            unrun = counts["ran here already"] + counts["recorded already"] > ran
            copy = unrun and self._reported(task)
            assert now != ("running", task.path, task.epoch) or self.store.busy > busy or copy, (
                state
            )
        else:
            assert self.held == running, f"{self.held} of {running} handlers started"
        self.holding = run_key(task)
        try:
            await meanwhile()
        finally:
            self.holding = None
        mark = len(self.transport.published)
        gate.set()
        self.transport.redelivered = envelope.redelivered
        await handling
        assert delivery.acked and not delivery.nacked
        self.history.append(envelope)
        return mark

    def _reported(self, task: TaskMessage) -> bool:
        """Whether a copy acked unrun left nothing owed: a bag's members recorded (its barrier
        owes the report, or fired it), or a single task's `next` published, in its run."""
        if task.index is not None:
            members = {one.index or 0 for one in task.split()}
            return members <= self.store.recorded[(task.wf, task.path)]
        for envelope in self.transport.published:
            if envelope.kind == "shard" and envelope.wf == task.wf:
                report = json.loads(envelope.body)
                mine = (report.get("path"), int(report.get("epoch") or 0))
                if report.get("kind") == "next" and mine == (task.path, task.epoch):
                    return True
        return False

    @precondition(lambda self: any(self.signals.values()))
    @rule(data=st.data(), resend=st.booleans())
    def signal(self, data: st.DataObject, resend: bool) -> None:
        """Send a program its next signal (before or after it waits for it), or send the last
        one again under its id, with other data: that must be no second signal."""
        # In submission order: ids are random, and a replay must draw the same program.
        waiting = [wf for wf, left in self.signals.items() if left]
        wf = data.draw(st.sampled_from(waiting), label="program")
        if resend and self.sent[wf]:
            self._signal(wf, self.sent[wf] - 1, {"signal": "sent again"})
        else:
            self._signal(wf, self.sent[wf], signal_data(self.signals[wf].pop(0)))
            self.sent[wf] += 1

    def _signal(self, wf: str, n: int, data: Any) -> None:
        try:
            self.run(self.router.signal(wf, SIGNAL, data, signal_id=f"{wf}:{n}"))
        except ValueError as exc:  # it ended (failed, cancelled), or compensates, before
            assert "has ended" in str(exc) or "is compensating" in str(exc), exc

    # --- per-key limits: workers that die holding a slot, leases that run out -------------

    def _limited_tasks(self) -> list[int]:
        in_flight = self.transport.in_flight
        return [
            i
            for i, e in enumerate(in_flight)
            if e.kind == "task" and decode_task(e.body).limit is not None
        ]

    @precondition(lambda self: self._limited_tasks())
    @rule(data=st.data())
    def die_holding_slot(self, data: st.DataObject) -> None:
        """A worker takes a slot of a task's key and dies (kill -9) after its handler, before
        it records or gives the slot back: the slot stays held until its lease runs out, and
        the message comes back flagged."""
        index = data.draw(st.sampled_from(self._limited_tasks()), label="task")
        self.store.dying = True
        try:
            self._deliver(index)
        finally:
            self.store.dying = False
        if self.store.dead_alive():
            event("a worker died holding a slot")

    @precondition(lambda self: self.store.dead_alive())
    @rule(whole=st.booleans())
    def leases_run_out(self, whole: bool) -> None:
        """Time passes for the leases (no handler runs between rules, so only dead workers'
        slots are held): a whole lease, and their slots are free; half of one, and not yet."""
        lease = self.worker.lease_ms
        self.store.clock_ms += lease + 1 if whole else lease // 2

    def _no_slot_leaked(self) -> None:
        """Once every program ended: every slot taken was given back, but dead workers',
        whose leases have run out; and the store holds no live lease."""
        store = self.store
        for holder, lease in store.leases.items():
            assert lease.released or holder in store.dead, f"{holder}: never gave back {lease}"
            assert lease.released or lease.expiry <= store.clock_ms, f"{holder}: {lease} live"
        for key in {lease.key for lease in store.leases.values()}:
            kept = self.run(store.stored_leases(key))
            live = {h: expiry for h, expiry in kept.items() if expiry > store.clock_ms}
            assert not live, f"{key!r}: slots still held after every program ended: {live}"
            assert set(kept) <= store.dead, f"{key!r}: kept holders that gave theirs back: {kept}"

    def _sweep(self) -> None:
        """What the owner's sweep does once a shard's queue is empty: start the compensations
        of a program whose `start` was lost (the router died after its cancel)."""
        for wf in self.expected:
            state = self.run(self.store.at(wf, "saga:0"))
            if state.get("status") == "compensating" and not state.get("cursor"):
                body = Start(wf=wf).model_dump_json().encode()
                self.run(self.transport.publish_to_shard(int(state["owner"]), body))

    def _drain(self) -> None:
        for wf, left in self.signals.items():  # every signal the programs wait for
            while left:
                self._signal(wf, self.sent[wf], signal_data(left.pop(0)))
                self.sent[wf] += 1
        # A correct system needs about one delivery per message it still owes; allow plenty.
        owed = sum(
            2 * sum(expected.attempts.values()) + len(expected.leaves) + 2
            for expected in self.expected.values()
        ) + 4 * sum(len(compensations(program)) for program in self.drawn.values())
        transport = self.transport
        for _ in range(4 * (owed + len(transport.in_flight) + len(transport.later)) + 100):
            kinds = [e.kind for e in transport.later]
            wakes = [i for i, e in enumerate(transport.later) if _is_wake(e)]
            if not transport.in_flight and not ("task" in kinds or wakes):
                # as the owner's sweep, which runs now and then: not before what is due
                self._sweep()
            if transport.in_flight:
                self._deliver(0)
            elif "task" in kinds:  # retries and sleeps fall due before deadlines
                transport.in_flight.append(transport.later.pop(kinds.index("task")))
            elif wakes:  # (an early wake is sent again: real time has to pass for a sleep)
                transport.in_flight.append(transport.later.pop(wakes[0]))
            elif transport.later:
                # Only deadlines are left: every program must have ended by now, or a lost
                # message would go unseen behind its deadline.
                for wf in self.expected:
                    status = self.run(self.store.state(wf)).get("status")
                    assert status not in LIVE, f"{wf} never ended: lost a message ({status})"
                transport.in_flight.append(transport.later.pop(0))
            else:
                return
            self.nothing_out_of_order()
            self.nothing_dead_lettered()
        raise AssertionError("the system kept producing messages: a loop that never ends")


@pytest.mark.parametrize("store_kind", ["redis", "memory"])
def test_transitions_keep_order_under_duplicates_reordering_and_crashes(
    keyspace: tuple[str, str], store_kind: str
) -> None:
    Cluster.redis_url, Cluster.prefix = keyspace
    Cluster.store_kind = store_kind
    run_state_machine_as_test(Cluster)


def test_maps_sleeps_and_waits_keep_order_under_duplicates_reordering_and_crashes(
    keyspace: tuple[str, str],
) -> None:
    """The same machine over programs made mostly of the newer step kinds, on the real Lua."""
    Cluster.redis_url, Cluster.prefix = keyspace
    Cluster.store_kind = "redis"
    Cluster.grammar = with_limits(programs(faults=True, newer=True))
    try:
        run_state_machine_as_test(Cluster)
    finally:
        Cluster.grammar = with_compensations(with_limits(programs(faults=True)))


def test_branches_keep_order_under_duplicates_reordering_and_crashes(
    keyspace: tuple[str, str],
) -> None:
    """The same machine over programs made mostly of bags of parallel branches (nested ones,
    loops and sleeps inside), on the real Lua."""
    Cluster.redis_url, Cluster.prefix = keyspace
    Cluster.store_kind = "redis"
    Cluster.grammar = programs(faults=True, branchy=True)
    try:
        run_state_machine_as_test(Cluster)
    finally:
        Cluster.grammar = with_compensations(with_limits(programs(faults=True)))


def test_sagas_keep_order_under_duplicates_reordering_and_crashes(
    keyspace: tuple[str, str],
) -> None:
    """The same machine over programs that fail more often and name compensations on most of
    their top-level tasks and bag members (so sagas of several groups are common), on the
    real Lua."""
    Cluster.redis_url, Cluster.prefix = keyspace
    Cluster.store_kind = "redis"
    Cluster.grammar = with_compensations(programs(faults=True, fail_rate=6), often=True)
    Cluster.cancel_budget = st.sampled_from([0, 1, 2, 3])
    Cluster.interleave_budget = st.integers(2, 6)
    try:
        run_state_machine_as_test(Cluster)
    finally:
        Cluster.grammar = with_compensations(with_limits(programs(faults=True)))
        Cluster.cancel_budget = st.sampled_from([0, 0, 0, 1, 2])
        Cluster.interleave_budget = st.integers(0, 3)


def test_the_model_runs_branches_side_by_side() -> None:
    program = {
        "steps": [
            {"task": "work"},
            {
                "bag": [
                    {"task": "boom"},
                    {"steps": [{"task": "work"}, {"sleep_s": SLEEP_S}, {"task": "work"}]},
                ]
            },
        ]
    }
    expected = expect(program)
    assert expected.leaves == [("0", 1), ("1", 2), ("1/branch:1/0", 1), ("1/branch:1/1", 0),
                               ("1/branch:1/2", 1)]  # fmt: skip
    assert expected.side_by_side("1", "1/branch:1/0")  # the task member beside the branch
    assert not expected.side_by_side("1/branch:1/0", "1/branch:1/2")
    assert not expected.side_by_side("0", "1/branch:1/0")
    assert expected.errors == ["step 1/bag:0: task 'boom': RuntimeError: boom"]
    program["steps"][1]["bag"][0] = {"task": "work"}  # type: ignore[index]
    expected = expect(program)
    assert expected.result == [output_of("1", 0), output_of("1/branch:1/2", None)]


@pytest.mark.parametrize("seed", [0])
def test_the_model_agrees_with_a_hand_worked_program(seed: int) -> None:
    program = {
        "steps": [
            {"task": "work"},
            {
                "until": "iteration >= 1",
                "max_iterations": 3,
                "steps": [{"bag": [{"task": "work"}] * 2}],
            },
        ]
    }
    expected = expect(program)
    assert expected.leaves == [("0", 1), ("1/iter:0/0", 2), ("1/iter:1/0", 2)]
    assert expected.result == [output_of("1/iter:1/0", 0), output_of("1/iter:1/0", 1)]


def test_the_model_lists_every_attempts_error_when_retries_run_out() -> None:
    flaky = {"task": "flaky", "args": {"fails": ["error", "timeout"]}, "timeout_s": 0.001}
    program = {
        "steps": [
            {**flaky, "retry": {"max_attempts": 3}},  # the third attempt succeeds
            {"bag": [{"task": "work"}, {**flaky, "retry": {"max_attempts": 2}}]},
        ]
    }
    expected = expect(program)
    assert expected.leaves == [("0", 1), ("1", 2)]
    assert expected.attempts == {("0", None): 3, ("1", 0): 1, ("1", 1): 2}
    assert (expected.status, expected.errors) == (
        "failed",
        [
            "step 1/bag:1: task 'flaky' failed 2 attempts: "
            "#1: RuntimeError: attempt 0 fails; #2: timed out after 0.001s"
        ],
    )


def test_the_model_runs_a_map_per_iteration_and_fails_one_over_its_bound() -> None:
    mapped = {"task": "work", "map": "[0, 1, 2, 3, 4].filter(x, x < iteration + 0)", "max_items": 1}
    program = {"steps": [{"until": "iteration >= 2", "max_iterations": 3, "steps": [mapped]}]}
    expected = expect(program)
    assert expected.leaves == [("0/iter:0/0", 0), ("0/iter:1/0", 1)]
    assert expected.errors == [
        "step 0/iter:2/0: map '[0, 1, 2, 3, 4].filter(x, x < iteration + 0)': gave 2 items, "
        "more than max_items=1"
    ]
