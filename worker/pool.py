"""A worker: consumes one pool's task queue, runs handlers, records outputs, reports back."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import json
import logging
import math
import re
import time
from collections import Counter, deque
from collections.abc import Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pydantic import ValidationError

from orchestrator import limits, logs, metrics
from orchestrator.bus import CONTROL_REBIND_S, GOING_ON, Transport, Unroutable
from orchestrator.consuming import Deliveries, Incoming
from orchestrator.delivery import (
    Delivery,
    Part,
    Poison,
    fault,
    process,
    redelivered,
    split,
    waits_for_services,
)
from orchestrator.documents import MAX_DEPTH, deeper_than, printable
from orchestrator.lifecycle import Service, end_tasks, format_counts, raise_if_cancelled
from orchestrator.marks import Marks
from orchestrator.messages import (
    CARRY,
    CARRYING,
    INLINE_BYTES,
    MAX_BUNDLE,
    MAX_ERROR,
    Cancelled,
    Failed,
    Next,
    Start,
    TaskMessage,
    decode_task,
    decode_tasks,
    encode,
)
from orchestrator.paths import is_saga, live_status
from orchestrator.program import check_pool_name, is_lane
from orchestrator.settings import Settings
from orchestrator.shares import share_pools
from orchestrator.store import TERMINAL, Completion, Store
from worker.context import TaskContext
from worker.fair import FairSlots
from worker.registry import Registry, UnknownTask
from worker.runs import Runs, note_created, note_withheld, run_key
from worker.threads import HandlerThreads

log = logging.getLogger(__name__)

# While Redis refuses writes or is away, a step's outputs are kept and their record tried
# again, with pauses from RECORD_PAUSE_S doubling to RECORD_PAUSE_MAX_S, this long at most (well
# inside RabbitMQ's consumer_timeout); then the message goes back to its queue, uncounted.
RECORD_WAIT_S = 600.0
RECORD_PAUSE_S = 0.5
RECORD_PAUSE_MAX_S = 5.0
LOGGED_ERROR = 500  # characters of a task's error in its log line (the report keeps 16 KiB)
# In an output's JSON text: an escaped backslash (skipped whole), an escaped surrogate pair, or
# a lone escaped surrogate (LONE_ESCAPE characters: the one match of that length).
_ESCAPES = re.compile(r"\\\\|\\ud[89ab][0-9a-f]{2}\\ud[c-f][0-9a-f]{2}|\\ud[89a-f][0-9a-f]{2}")
LONE_ESCAPE = 6
# An output's JSON text longer than this has its depth walked on the worker's own thread
# (_check_depth): about 4 ms at this size, 40-70 ms at SHARDFLOW_MAX_OUTPUT_BYTES's default,
# that would hold the event loop and every other slot's work.
CHECKED_ON_LOOP = 64 * 1024
# Of an exception group, the exceptions named in a task's error, and the groups nested in it.
MAX_HELD = 5
MAX_GROUP_DEPTH = 3
# How often a worker reads whether its running tasks' programs were cancelled, besides the
# broker's notice (`_watch_cancels`).
CANCEL_CHECK_S = 10.0
# A slot not given back within this is left to run out with its lease.
RELEASE_WAIT_S = 5.0
# A report no shard queue takes is tried again this often, this far apart, before it is
# parked: an owner declares its queue again about a second after it was deleted.
REPORT_TRIES = 6
REPORT_RETRY_S = 1.0

# A Start to a compensating program's owner: a late report, its compensations may begin.
Report = Next | Failed | Start


# How long a cancelled handler (timed out, its slot lost, its worker stopping) is waited for;
# one that catches its cancel and runs on is left running, counted, and its task failed.
HANDLER_END_S = 5.0


class Worker(Service):
    """Runs up to `concurrency` tasks at once from one pool (a serial lane: exactly one):
    serial, parallel, a named pool (its queue declared here if new), or a named lane
    (`serial-<name>`)."""

    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        *,
        pool: str,
        store: Store,
        bus: Transport,
        concurrency: int | None = None,
    ) -> None:
        super().__init__(settings.grace_s)
        check_pool_name(pool)
        if is_lane(pool):
            concurrency = 1  # one lane for the whole cluster
        self.name = f"worker[{pool}]"
        self.settings = settings
        self.registry = registry
        self.pool = pool
        self.concurrency = concurrency or settings.parallel_concurrency
        # A share of the pool (a kind of program) holds at most this many slots at once.
        self.share = max(1, math.ceil(self.concurrency * settings.fair_share))
        self.slots = FairSlots(self.concurrency)
        self.threads = HandlerThreads(self.concurrency, f"{pool}-handler")
        self.store = store
        self.bus = bus
        self.counts: Counter[str] = Counter()
        self.marks = Marks(store)  # who holds the serial lane, for `explain`
        self.lease_ms = round(settings.key_lease_s * 1000)
        self._running: dict[str, set[asyncio.Task[Any]]] = {}
        # Programs this worker holds a task message of (running or not yet started), and of
        # those, each that a notice found ended (its status and run) before its handler
        # started: a notice between a task's check and its handler's start would be lost.
        self._in_hand: Counter[str] = Counter()
        self._ended: dict[str, tuple[str, int]] = {}
        # Handlers a cancel of a compensating program keeps: compensations and undoable tasks.
        self._kept: set[asyncio.Task[Any]] = set()
        self._left: set[asyncio.Task[Any]] = set()  # handlers that ran on past their cancel
        # Its own thread for large outputs' checks: asyncio's default one is user code's too,
        # where a handler's call that timed out holds a thread for as long as it runs.
        self._checks = ThreadPoolExecutor(1, thread_name_prefix=f"{pool}-output-check")
        # Each running handler's: done when its program ended (cancel_program).
        self._stops: dict[asyncio.Task[Any], asyncio.Future[None]] = {}
        self._control: Deliveries | None = None  # the control consumer started last
        self.runs = Runs(self._created, self.name)  # copies given back are not run twice

    async def run(self) -> None:
        metrics.WORKER_SLOTS.labels(self.pool).set(self.concurrency)
        left = metrics.HANDLERS_LEFT.labels(self.pool)
        left.set_function(lambda: len(self._left) + self.threads.left_behind)
        try:
            await super().run()
        finally:
            self.threads.shutdown()
            self._checks.shutdown(wait=False, cancel_futures=True)
            left.set_function(lambda: 0)  # keeps no reference to this pool

    def summary(self) -> str:
        return format_counts(self.counts)

    async def _start(self) -> list[Coroutine[Any, Any, None]]:
        pools = share_pools(self.pool)
        log.info(
            "%s: consuming %d queue(s) with concurrency %d, at most %d per share",
            self.name, len(pools), self.concurrency, self.share,
        )  # fmt: skip
        return [
            *(self._consume(pool) for pool in pools),
            self._listen(),
            self._rebind(),
            self._watch_cancels(),
        ]

    async def _listen(self) -> None:
        """Stop the running tasks of programs that were cancelled or ran out of time."""

        async def start() -> Deliveries:
            self._control = await self.bus.consume_control()
            return self._control

        async for message in self._messages(start, self.bus.stop_consuming):
            try:
                wf = Cancelled.model_validate_json(message.body).wf
            except ValidationError:
                log.warning("%s: ignored a control message: %r", self.name, message.body[:200])
                continue
            await self.stop_ended(wf)

    async def _rebind(self) -> None:
        """Bind the control queue again every CONTROL_REBIND_S: a deleted `<prefix>.control`
        took its binding along, and nothing tells a consumer (orchestrator/bus.py)."""
        while True:
            await asyncio.sleep(CONTROL_REBIND_S)
            # Blocked by an alarm, the broker reads no declare: the call's timeout then closed
            # the control consumer's own channel, and cancels went unheard until the alarm ended.
            if self._control is None or self.bus.publishing_blocked:
                continue
            try:
                await self.bus.bind_control(self._control)
            except Exception as exc:  # its channel lost: the consumer starts again, bound
                raise_if_cancelled()
                log.warning("%s: binding the control queue again failed: %r", self.name, exc)

    async def _watch_cancels(self) -> None:
        """Every CANCEL_CHECK_S, stop the running tasks of programs that were cancelled, read
        from Redis: the broker's notice is a publish, which a memory alarm held back (and the
        control consumer may be away a while), so such a program's handlers ran to their end."""
        while True:
            await asyncio.sleep(CANCEL_CHECK_S)
            running = list(self._running)  # at most the worker's concurrency
            if not running:
                continue
            try:
                found = await self.store.ends(running)
            except Exception as exc:  # Redis away: the next check, or the notice, will do
                raise_if_cancelled()
                log.debug("%s: could not read its programs' ends: %r", self.name, exc)
                continue
            for wf, (status, _) in zip(running, found, strict=True):
                if status == "cancelled" and wf in self._running:
                    self.cancel_program(wf)

    async def stop_ended(self, wf: str) -> int:
        """A program was cancelled (or ran out of time): stop this worker's running tasks of
        it; how many. Anyone on the vhost can publish that notice: only a program that really
        ended stops, and one that now runs its compensations stops every task but those and
        the tasks of the step it failed at that name compensations (they run to the end, to be
        undone: lua/begin.lua). Kept for its tasks in hand that have not started yet."""
        if wf not in self._in_hand:
            return 0
        state = await self.store.state(wf)
        status = state.get("status")
        if wf in self._in_hand and (status in TERMINAL or status == "compensating"):
            self._ended[wf] = (status or "", int(state.get("epoch") or 0))
        if status in TERMINAL:
            return self.cancel_program(wf)
        if status == "compensating":
            return self.cancel_program(wf, keep=self._kept)
        log.warning("%s: ignored a cancel of %s, which has not ended", self.name, wf)
        return 0

    def cancel_program(self, wf: str, keep: set[asyncio.Task[Any]] | None = None) -> int:
        """Cancel this worker's running handlers of a program (but those in `keep`); how many
        there were."""
        handlers = self._running.get(wf, set()) - (keep or set())
        for handler in handlers:
            handler.cancel()
            stop = self._stops.get(handler)  # so it is waited for a while only (_output)
            if stop is not None and not stop.done():
                stop.set_result(None)
        if handlers:
            log.info("%s: %s cancelled: stopped %d running task(s)", self.name, wf, len(handlers))
        return len(handlers)

    async def _consume(self, pool: str) -> None:
        """Consume one of the pool's queues (one share of it): each holds at most its share of
        the slots (the prefetch), and all take the free ones in turn."""
        queue = self.bus.names.task_queue(pool)
        share = self.concurrency if is_lane(pool) else self.share
        log.debug("%s: consuming %s, at most %d at once", self.name, queue, share)
        messages = self._messages(
            lambda: self.bus.consume_pool(pool, share), self.bus.stop_consuming
        )
        async for message in messages:
            await self.slots.acquire(pool, message.priority or 0)
            task = self._spawn(self.handle(message, queue))
            task.add_done_callback(lambda _: self.slots.release())

    async def handle(self, delivery: Delivery, source: str) -> None:
        """Run one task message (or a bundle of them); ack only after the reports to the
        owners are confirmed. On a lane, only while its delivery is held (`_held`)."""
        if is_lane(self.pool) and isinstance(delivery, Incoming):
            await self._held(self._handle(delivery, source), delivery.gone(), delivery.body)
        else:
            await self._handle(delivery, source)

    async def _held(
        self, work: Coroutine[Any, Any, None], gone: asyncio.Future[Any], body: bytes
    ) -> None:
        """A lane's task stops when its delivery's channel closes (the connection dropped, the
        broker restarted, its consumer_timeout ran out): the broker hands the task to the
        standby, and two of the lane's tasks must never run at once. It reports nothing; its
        next delivery runs it again. (A plain function's thread cannot be stopped: it runs to
        its end, beside the standby's run.)"""
        running = asyncio.ensure_future(work)
        try:
            await asyncio.wait({running, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            closed = gone.done()  # else a stop's cancel (SIGTERM's grace ran out) got here
            gone.cancel()  # an observer: its callback on the channel goes with it
            if not running.done():
                running.cancel()
                await asyncio.gather(running, return_exceptions=True)
                if closed:
                    self.counts["let go"] += 1
                    log.warning(
                        "%s: stopped a lane's task: its delivery's channel closed, and the "
                        "broker hands it on (%r)", self.name, body[:200],
                    )  # fmt: skip
        if not running.cancelled():
            running.result()

    async def _handle(self, delivery: Delivery, source: str) -> None:
        logs.scope()  # nothing of the last message's: this one's fields come once decoded
        async with process(delivery, self.bus, source, limit=self.settings.delivery_limit):
            tasks = decode_tasks(delivery.body)
            if tasks is not None:
                await self._bundle(delivery, source, tasks)
            else:
                await self._run_message(decode_task(delivery.body), delivery, source)

    async def _bundle(self, delivery: Delivery, source: str, tasks: list[TaskMessage]) -> None:
        """A bundle's tasks (several programs', orchestrator/bundling.py), each settled by the
        delivery policy on its own: its poison parked alone, its failure sent again alone. Like
        a chunked bag's message it takes one slot, and runs its tasks side by side, at most the
        worker's concurrency of them at once (one at a time on a worker of 1). Acked once every
        one is settled."""
        if is_lane(self.pool):
            raise Poison("a bundle of tasks on a lane, which runs one task at a time")
        if redelivered(delivery):
            # A try was cut short (maybe by one of its handlers killing the worker) or failed:
            # each goes on alone, so such a task takes no other program's with it again.
            await split(delivery, self.bus, source, [encode(task) for task in tasks])
            return
        pending = deque((Part(delivery, functools.partial(encode, task)), task) for task in tasks)
        parts = list(pending)
        limit = self.settings.delivery_limit

        async def run() -> None:
            while pending:
                part, task = pending.popleft()
                async with process(part, self.bus, source, limit=limit):
                    await self._run_message(task, part, source)

        side_by_side = min(len(tasks), self.concurrency)
        # Every run ends before one's error is raised: none is left running unwatched.
        outcomes = await asyncio.gather(
            *(run() for _ in range(side_by_side)), return_exceptions=True
        )
        errors = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
        for error in errors[1:]:
            log.warning("a bundle's task also failed: %r", error)
        if errors:
            raise errors[0]
        if any(part.handed_back for part, _ in parts):
            # The broker went away as one was settled: the bundle comes back whole.
            raise ConnectionError("a bundle's task could not be settled")

    async def _run_message(self, task: TaskMessage, delivery: Delivery, source: str) -> None:
        """Run one task message's tasks and publish their reports."""
        # Its lines (parked, stale, requeued) name it, not a bundle's task before it.
        logs.scope(workflow_id=task.wf, step=task.path, task=task.task)
        # A lane's hold cut short (its channel closed) left a handler running: this task waits
        # for it before anything (is its program still here? a slot?), never beside it.
        if self._lane_busy():
            await self._hold_lane(task, before=True)
        with self._holding(task.wf):
            key = run_key(task)
            if await self.runs.ran_here(key, task.wf):
                self.counts["ran here already"] += 1
                metrics.DUPLICATES.labels("worker").inc()
                log.info("%s: task for %r ran here already: not run again", task.wf, task.path)
                return
            await self.runs.once(key, functools.partial(self._run_held, task, delivery, source))

    @contextlib.contextmanager
    def _holding(self, wf: str) -> Iterator[None]:
        """While a message of `wf` is in hand, a notice of its end is kept (_ended_before)."""
        self._in_hand[wf] += 1
        try:
            yield
        finally:
            self._in_hand[wf] -= 1
            if not self._in_hand[wf]:
                del self._in_hand[wf]
                self._ended.pop(wf, None)

    def _ended_before(self, task: TaskMessage) -> bool:
        """Whether a notice found the task's program (this run of it) ended, or compensating
        and the task not one that runs on then, before its handler started."""
        status, epoch = self._ended.get(task.wf, ("", -1))
        if epoch != task.epoch:  # no notice, or one of a run before a redrive
            return False
        return status != "compensating" or not (is_saga(task.path) or task.undoable)

    async def _run_held(self, task: TaskMessage, delivery: Delivery, source: str) -> bool:
        """_run_message's work, its program's notices kept meanwhile; False when the task went
        back to wait for a slot of its key."""
        again = redelivered(delivery)
        # Its owner records a single task's output with its advance (messages.CARRY).
        carry = (delivery.headers or {}).get(CARRY) == 1
        if task.limit is not None:  # never batched: one task, one slot
            # Back to the queue it came from when it waits: its share of the pool.
            tasks_prefix = self.bus.names.task_queue("")
            pool = (
                source.removeprefix(tasks_prefix) if source.startswith(tasks_prefix) else self.pool
            )
            limited = await self._limited(
                task, pool, redelivered=again, priority=delivery.priority, carry=carry
            )
            if limited is None:
                return False
            reports = limited
        else:
            reports = await self.run_tasks(task.split(), redelivered=again, carry=carry)
        # A bundle's reports to one shard, sent in one turn, go as one (bundling.py).
        most = MAX_BUNDLE if isinstance(delivery, Part) else 1
        for report in reports:
            # A start (a compensating program's, after a late task) is no task's report: alone.
            await self._report(task, encode(report), 1 if isinstance(report, Start) else most)
        return True

    async def _report(self, task: TaskMessage, body: bytes, most: int = 1) -> None:
        """Publish a report to the owner shard. Unroutable, a shard of the ring is tried again
        for a few seconds (its queue deleted, and not yet declared again), then parked, as a
        shard outside the ring at once: the message handled again would run the handler
        again."""
        tries = REPORT_TRIES if task.owner < self.settings.shards else 1
        for attempt in range(1, tries + 1):
            try:
                await self.bus.publish_to_shard(task.owner, body, most=most)
                return
            except Unroutable as exc:
                if attempt == tries:
                    raise Poison(f"{task.wf}: its report: {exc}") from None
                log.warning("%s: its report returned by shard %d", task.wf, task.owner)
                await asyncio.sleep(REPORT_RETRY_S)

    async def _created(self, wf: str) -> str | None:
        """The program's created_ms now (runs.Runs tells a reused id's program by it)."""
        return (await self.store.state(wf)).get("created_ms")

    async def _current(
        self, tasks: list[TaskMessage], *, redelivered: bool = False
    ) -> list[TaskMessage]:
        """The tasks to run (see _still_current); a lane marks the one it runs, once it is
        known to be current, so a forged task of no program marks nothing."""
        current = await self._still_current(tasks, redelivered=redelivered)
        if current and is_lane(self.pool):
            first = current[0]
            await self.marks.lane(first.wf, first.path, first.task, self.pool, first.attempt)
        return current

    async def _still_current(
        self, tasks: list[TaskMessage], *, redelivered: bool = False
    ) -> list[TaskMessage]:
        """The tasks to run: all when the program is still at their step, in their run, else
        none. A step its program has left (a late copy from a replay, or a redelivery after a
        crash past the report) is not run again: nothing it could record would count."""
        if tasks[0].undoable:
            return await self._begin(tasks, redelivered=redelivered)
        # In a parallel branch, the branch's own cursor says where it is.
        state = await self.store.at(tasks[0].wf, tasks[0].path)
        if not state:  # never run a handler for a program nobody submitted
            return await self._gone(tasks)
        if (
            state.get("status") != live_status(tasks[0].path)
            or state.get("cursor") != tasks[0].path
            or int(state.get("epoch") or 0) != tasks[0].epoch  # a run before a redrive
        ):
            self._count_stale(len(tasks))
            log.info("%s: task for %r ignored (stale)", tasks[0].wf, tasks[0].path)
            return []
        if state.get("owner") != str(tasks[0].owner):  # its report would reach no owner
            raise Poison(
                f"{tasks[0].wf}: reports to shard {tasks[0].owner}, but its owner is shard "
                f"{state.get('owner')}"
            )
        note_created(state.get("created_ms"))
        return tasks

    async def _gone(self, tasks: list[TaskMessage]) -> list[TaskMessage]:
        """Nothing to run for a program that does not exist: a task that waited in the delay
        ladder (a retry, or a wait for a slot) outlived its program, which ended meanwhile and
        expired or was purged (a retry may wait 27 h), and is dropped as a timer is; any other
        is parked: never run a handler for a program nobody submitted. So is one this Redis
        knows no program of the prefix at all for (a worker given another Redis, or database):
        parked, it can be sent back once the worker is mended."""
        first = tasks[0]
        if first.attempt == 0 and (first.limit is None or first.limit.waits == 0):
            raise Poison(f"{first.wf}: no such program")
        if not await self.store.shards_used():
            raise Poison(f"{first.wf}: no such program, nor any of this prefix in this Redis")
        self._count_gone(len(tasks))
        log.info("%s: task for %r waited past its program's end, ignored", first.wf, first.path)
        return []

    def _count_stale(self, tasks: int) -> None:
        """Tasks of a step their program left (a late copy, a retry of an earlier run)."""
        self.counts["stale"] += tasks
        metrics.DUPLICATES.labels("worker").inc(tasks)

    def _count_gone(self, tasks: int) -> None:
        self.counts["gone"] += tasks
        metrics.GONE.labels("worker").inc(tasks)

    async def _begin(self, tasks: list[TaskMessage], *, redelivered: bool) -> list[TaskMessage]:
        """`_current` for tasks of a step that names compensations: noted as started, or, once
        the program compensates from that step, those started before (lua/begin.lua)."""
        first = tasks[0]
        indexes = [task.index or 0 for task in tasks]
        reply = await self.store.begin(first.wf, first.path, indexes, first.epoch, first.attempt)
        if reply.verdict == "missing":
            return await self._gone(tasks)
        if reply.verdict == "invalid":
            raise Poison(f"{first.wf}: {', '.join(reply.outputs) or 'no such program'}")
        if reply.verdict == "go":
            going = set(reply.outputs)
            return [task for task in tasks if str(task.index or 0) in going]
        self._count_stale(len(tasks))
        if redelivered and reply.outputs[:1] == ["compensating"]:
            # A late report whose Start a crash cut short (see run_tasks): sent again, as
            # the start is idempotent.
            await self.bus.publish_to_shard(first.owner, encode(Start(wf=first.wf)))
        return []

    async def _limited(
        self,
        task: TaskMessage,
        pool: str,
        *,
        redelivered: bool,
        priority: int | None = None,
        carry: bool = False,
    ) -> list[Report] | None:
        """Run a task with a per-key limit while holding a slot of its key. No free slot: the
        message goes back to its pool through the delay ladder (doubling waits), None, and this
        worker is free at once. The slot is a lease renewed while the handler runs and given
        back however it ends; if it cannot be renewed in time (it was lost), the handler is
        stopped and the attempt fails, as on a timeout."""
        limit = task.limit
        assert limit is not None
        # A message back from a wait is a new one to the broker: its flag travels with it.
        redelivered = redelivered or limit.redelivered
        if not await self._current([task], redelivered=redelivered):
            return []
        known = await self._recorded([task], _owed(task, redelivered))
        if known[0] is not None:  # recorded already: reported unrun, no slot needed for that
            return await self.run_tasks(
                [task], redelivered=redelivered, checked=True, carry=carry, known=known
            )
        holder = limits.holder(task.wf, task.path, task.index)
        since = time.monotonic()  # the lease runs out a lease after this, at the earliest
        slot = await self.store.acquire(limit.key, holder, limit.max, self.lease_ms)
        if slot.verdict == "busy":
            await self._wait_for_slot(
                task, pool, slot.held, slot.left_ms, priority, redelivered, carry
            )
            return None
        if limit.waits:
            await self.marks.slot_taken(task.wf, task.path, task.index)
        lost, done = asyncio.Event(), asyncio.Event()
        renewing = asyncio.create_task(self._renew(limit.key, holder, lost, done, since))
        try:
            return await self.run_tasks(
                [task], redelivered=redelivered, lost=lost, checked=True, carry=carry
            )
        finally:
            # Stopped between two renewals, never inside one: a Redis call cut short could
            # leave its connection mid-reply.
            done.set()
            await asyncio.gather(renewing, return_exceptions=True)
            try:
                await asyncio.wait_for(self.store.release(limit.key, holder), RELEASE_WAIT_S)
            except Exception as exc:  # its lease runs out instead
                log.warning("%s: could not release a slot of %r: %r", self.name, limit.key, exc)

    async def _wait_for_slot(
        self,
        task: TaskMessage,
        pool: str,
        held: int,
        left_ms: int | None,
        priority: int | None,
        redelivered: bool,
        carry: bool = False,
    ) -> None:
        """Send the task back to its pool after a backoff (never past the first lease's end,
        so a dead holder's slot is taken up soon after it runs out). A redelivered task stays
        flagged: a run of it may have recorded and died before reporting, and only a
        redelivered task reports a step already complete (see run_tasks)."""
        assert task.limit is not None
        waits = task.limit.waits
        left_s = None if left_ms is None else left_ms / 1000
        later = task.limit.model_copy(
            update={"waits": min(waits + 1, limits.MAX_WAITS), "redelivered": redelivered}
        )
        body = encode(task.model_copy(update={"limit": later}))
        # It keeps its priority (the program's level) while it waits.
        level = GOING_ON if priority is None else priority
        headers = CARRYING if carry else None  # what its owner promised, kept
        await self.bus.publish_later(pool, body, limits.backoff_s(waits, left_s), level, headers)
        await self.marks.slot_wait(task.wf, task.path, task.index, task.limit, held)
        self.counts["waited for a slot"] += 1
        metrics.SLOT_WAITS.labels(metrics.pool_label(self.pool)).inc()

    async def _renew(
        self, key: str, holder: str, lost: asyncio.Event, done: asyncio.Event, since: float
    ) -> None:
        """Renew a lease every third of it until `done`; set `lost` when it was dropped, or
        when no renewal was answered before it ran out by this worker's own clock (from
        `since`, when the call that set it was sent): Redis unreachable, or a dead socket
        that never answers, and another worker may hold the slot now."""
        lease_s = self.settings.key_lease_s
        expires = since + lease_s
        while True:
            wait_s = min(lease_s / 3, max(0.0, expires - time.monotonic()))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), wait_s)
            if done.is_set():
                return
            sent = time.monotonic()
            if sent >= expires:
                log.warning("%s: a slot of %r ran out unrenewed", self.name, key)
                lost.set()
                return
            # Never cut short (a Redis call cancelled mid-reply); left to end on its own.
            call = asyncio.ensure_future(self.store.renew(key, holder, self.lease_ms))
            answered, _ = await asyncio.wait({call}, timeout=expires - sent)
            if not answered:
                call.add_done_callback(_retrieved)
                log.warning("%s: a slot of %r ran out unrenewed (no answer)", self.name, key)
                lost.set()
                return
            try:
                slot = call.result()
            except Exception as exc:  # unreachable, read-only after a failover: the next
                # try may still be in time, and the clock above bounds them all
                log.warning("%s: could not renew a slot of %r: %r", self.name, key, exc)
                continue
            if slot.verdict == "lost":
                log.warning("%s: lost a slot of %r: its lease ran out", self.name, key)
                lost.set()
                return
            expires = sent + lease_s

    async def run_tasks(
        self,
        tasks: list[TaskMessage],
        *,
        redelivered: bool,
        lost: asyncio.Event | None = None,
        checked: bool = False,
        carry: bool = False,
        known: list[str | None] | None = None,
    ) -> list[Report]:
        """Run one message's tasks side by side and record their outputs in one call; the
        reports for the owner: failures, and `next` when this completed the step. `lost`: set
        when the slot a limited task holds is lost; `checked`: the step is known current;
        `carry`: the owner records a single task's output with its advance (messages.CARRY),
        so it goes in `next` unrecorded; `known`: the tasks' recorded outputs, read already."""
        if not checked:
            tasks = await self._current(tasks, redelivered=redelivered)
            if not tasks:
                return []
        owed = _owed(tasks[0], redelivered)
        # A task whose output is recorded already is not run again: its text goes on.
        if known is None:
            known = await self._recorded(tasks, owed)
        outcomes: list[str | Failed | None] = list(known)
        todo = [task for task, text in zip(tasks, known, strict=True) if text is None]
        if todo:
            values = await self._values(todo[0])  # a message's tasks share input and prev
            items = await self._items(todo)
            if len(todo) == 1:  # the common case, without gather's extra task
                ran = [await self._attempt(todo[0], *values, items[0], lost)]
            else:
                ran = await asyncio.gather(
                    *(
                        self._attempt(task, *values, item)
                        for task, item in zip(todo, items, strict=True)
                    )
                )
            done = iter(ran)
            outcomes = [next(done) if text is None else text for text in known]
        reports: list[Report] = [outcome for outcome in outcomes if isinstance(outcome, Failed)]
        # A failed run leaves a copy its own try: another delivery of the task may have
        # recorded the step and died before its report, which the copy owes.
        note_withheld(bool(reports))
        outputs = {
            t.index: out for t, out in zip(tasks, outcomes, strict=True) if isinstance(out, str)
        }
        if not outputs:
            return reports
        task = tasks[0]  # a message's tasks share program, step and bag
        if carry and _carried(task, outputs):
            self.counts["carried"] += len(outputs)
            output = json.loads(outputs[None])
            reports.append(Next(wf=task.wf, path=task.path, output=output, epoch=task.epoch))
            return reports
        completion = await self._record(task, outputs)
        if completion.verdict == "missing":  # it was there when the handler began: purged since
            self._count_gone(len(outputs))
            log.info("%s: task %r ended after its program was deleted", task.wf, task.path)
            return reports
        if completion.verdict == "invalid":
            raise Poison(f"{task.wf}: {', '.join(completion.outputs) or 'no such program'}")
        self.counts[completion.verdict] += len(outputs)
        metrics.recorded(completion.verdict, redelivered=owed)
        if completion.verdict == "late":  # its compensations may begin now (lua/begin.lua)
            reports.append(Start(wf=task.wf))
            return reports
        # Only an owed delivery (_owed) reports a step complete already.
        note_withheld(completion.verdict == "again" and not owed)
        if completion.verdict == "fire" or (completion.verdict == "again" and owed):
            if not completion.outputs:  # too large to carry: the owner reads them in Redis
                reports.append(Next(wf=task.wf, path=task.path, stored=True, epoch=task.epoch))
                return reports
            joined = [json.loads(out) for out in completion.outputs]
            output = joined if task.index is not None else joined[0]
            reports.append(Next(wf=task.wf, path=task.path, output=output, epoch=task.epoch))
        return reports

    async def _recorded(self, tasks: list[TaskMessage], owed: bool) -> list[str | None]:
        """Each task's output where a redelivered or retried (`owed`) message's is recorded
        already (a delivery recorded it and died before its report), else None: such a task is
        not run again, and the report goes as a run's would (a handler that failed a second
        run failed the program). Not for compensations and tasks of a step that names them:
        their record is the saga's (lua/begin.lua)."""
        first = tasks[0]
        if not owed or first.undoable or is_saga(first.path):
            return [None] * len(tasks)
        found = await self.store.leaf_outputs(first.wf, [(t.path, t.index) for t in tasks])
        known = sum(text is not None for text in found)
        if known:
            self.counts["recorded already"] += known
            log.info("%s: %d task(s) of %r recorded already: unrun", first.wf, known, first.path)
        return found

    async def _record(self, task: TaskMessage, outputs: dict[int | None, str]) -> Completion:
        """Record a step's outputs; while Redis refuses writes (full) or is away, keep them and
        try again, up to RECORD_WAIT_S: sent back to the queue, the message's handlers ran
        again at every try (20 times a member, under a full Redis)."""
        pause, deadline = RECORD_PAUSE_S, time.monotonic() + RECORD_WAIT_S
        while True:
            try:
                return await self.store.record(task.wf, task.path, task.size, outputs, task.epoch)
            except Exception as exc:
                given_up = self._stop.is_set() or time.monotonic() + pause > deadline
                if given_up or not waits_for_services(exc):
                    raise
                if pause == RECORD_PAUSE_S:
                    log.warning(
                        "%s: %s: its outputs wait for Redis to take them (%s)",
                        self.name, task.wf, fault(exc),
                    )  # fmt: skip
                await asyncio.sleep(pause)
                pause = min(2 * pause, RECORD_PAUSE_MAX_S)

    async def _values(self, task: TaskMessage) -> tuple[Any, Any]:
        """The task's input and prev: carried, or read once from where the owner kept them."""
        names = ["input"] * task.input_ref + [task.path] * task.prev_ref
        found: dict[str, Any] = {}
        for name, text in zip(names, await self.store.blobs(task.wf, names), strict=True):
            if text is None:
                raise Poison(f"{task.wf}: {name} is no longer stored (did the program end?)")
            found[name] = json.loads(text)
        input = found["input"] if task.input_ref else task.input
        prev = found[task.path] if task.prev_ref else task.prev
        return input, prev

    async def _items(self, tasks: list[TaskMessage]) -> list[Any]:
        """Each task's item: carried, or read where its `item_from` says (one read for all)."""
        items = [task.item for task in tasks]
        read = [(n, task.item_from) for n, task in enumerate(tasks) if task.item_from]
        if not read:
            return items
        leaves = [(str(where.step), where.index) for _, where in read]
        found = await self.store.leaf_outputs(tasks[0].wf, leaves)
        for (n, _), (step, index), text in zip(read, leaves, found, strict=True):
            if text is None:
                member = "" if index is None else f"/bag:{index}"
                raise Poison(f"{tasks[0].wf}: no output of step {step}{member} for its item")
            items[n] = json.loads(text)
        return items

    async def _attempt(
        self,
        task: TaskMessage,
        input: Any,
        prev: Any,
        item: Any,
        lost: asyncio.Event | None = None,
    ) -> str | Failed | None:
        """Run one handler: its output as JSON, its failure, or None when it was cancelled."""
        ctx = TaskContext(  # its own values: a change a handler makes reaches no other
            input=input if task.input_ref else _own(input),
            args=task.args,
            prev=prev if task.prev_ref else _own(prev),
            workflow_id=task.wf,
            step=task.path,
            iteration=task.iteration,
            index=task.index,
            attempt=task.attempt,
            item=_own(item) if task.item_from is None else item,  # one read is its own
        )
        logs.bind(workflow_id=task.wf, step=task.path, task=task.task, attempt=task.attempt)
        started = time.monotonic()
        try:
            output = await self._output(task, ctx, lost)
            metrics.task_ended(self.pool, task.task, self.registry.handlers, "completed", started)
            return output
        except asyncio.CancelledError:
            raise
        except _ProgramCancelled:
            self.counts["cancelled"] += 1
            metrics.task_ended(self.pool, task.task, self.registry.handlers, "cancelled", started)
            return None
        except Exception as exc:
            self.counts["failed"] += 1
            metrics.task_ended(self.pool, task.task, self.registry.handlers, "failed", started)
            plain = isinstance(exc, _TaskError | UnknownTask)
            error = _cut(_said(exc) if plain else f"{type(exc).__name__}: {_said(exc)}")
            # Said here too: in Redis alone, it went with the program's keys.
            # With the handler's traceback: in the status and the report, its text alone.
            log.warning(
                "%s: task %r of step %s%s failed (attempt %d): %s",
                task.wf, task.task, task.path, "" if task.index is None else f" #{task.index}",
                task.attempt, printable(error[:LOGGED_ERROR]), exc_info=None if plain else exc,
            )  # fmt: skip
            return Failed(
                wf=task.wf,
                path=task.path,
                index=task.index,
                attempt=task.attempt,
                task=task.task,
                error=error,
                prev=task.prev,
                prev_ref=task.prev_ref,
                iteration=task.iteration,
                item=task.item,
                epoch=task.epoch,
            )

    async def _output(
        self, task: TaskMessage, ctx: TaskContext, lost: asyncio.Event | None = None
    ) -> str:
        if self._ended_before(task):
            raise _ProgramCancelled  # its notice came after its check, before this
        # The handler runs in a task of its own, so a cancelled program can stop just it.
        handler = asyncio.create_task(_guarded(self.registry.run(task.task, ctx, self.threads)))
        running = self._running.setdefault(task.wf, set())
        running.add(handler)
        if is_saga(task.path) or task.undoable:
            self._kept.add(handler)
        metrics.TASKS_RUNNING.labels(self.pool).inc()
        watch = asyncio.create_task(lost.wait()) if lost is not None else None
        stop = self._stops[handler] = asyncio.get_running_loop().create_future()
        try:
            waits = {handler, stop} if watch is None else {handler, stop, watch}
            done, _ = await asyncio.wait(
                waits, timeout=task.timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            del self._stops[handler]
            stop.cancel()
            if watch is not None:
                watch.cancel()
            if not handler.done():  # timed out, lost its slot, or this worker is stopping
                # Waited for a while only: a handler that catches its cancel would hold its
                # slot (and a key's lease) for as long as it likes.
                what = f"{self.name}: a handler of {task.task!r} ({task.wf} {task.path})"
                if not await end_tasks([handler], what, HANDLER_END_S):
                    self._left.add(handler)  # held until it ends: the loop keeps only a weak one
                    handler.add_done_callback(self._left.discard)
                    handler.add_done_callback(_retrieved)
                    self.counts["handler left running"] += 1
            running.discard(handler)
            self._kept.discard(handler)
            metrics.TASKS_RUNNING.labels(self.pool).dec()
            if not running:
                del self._running[task.wf]
        if self._lane_busy():
            await self._hold_lane(task, before=False)
        if stop in done:
            raise _ProgramCancelled  # its program ended (cancel_program)
        if handler in done and handler.cancelled():  # not by us: its own code raised it
            said = _cancel_said(handler)
            raise _TaskError(
                f"CancelledError{': ' + said if said else ''} (raised by the handler's own code: "
                "an inner task it awaited was cancelled, say; not a cancel of its program)"
            )
        if handler not in done and watch is not None and watch in done:
            key = task.limit.key if task.limit else ""
            raise _TaskError(f"stopped: its slot of key {key!r} was lost (the lease ran out)")
        if handler not in done:
            raise _TaskError(f"timed out after {task.timeout_s}s")
        output = handler.result()
        try:
            text = json.dumps(output, allow_nan=False)  # NaN is not JSON: the owner refuses it
        except (TypeError, ValueError) as exc:
            raise _TaskError(f"output is not JSON: {exc}") from None
        if len(text) > self.settings.max_output_bytes:  # first: it bounds the checks' work
            raise _TaskError(
                f"output of {len(text)} bytes is over the limit of "
                f"{self.settings.max_output_bytes} (SHARDFLOW_MAX_OUTPUT_BYTES)"
            )
        _check_text(text)
        if _may_be_deep(text):  # a walk, off the event loop when long
            if len(text) > CHECKED_ON_LOOP:
                await asyncio.get_running_loop().run_in_executor(self._checks, _check_depth, output)
            else:
                _check_depth(output)
        return text

    def _lane_busy(self) -> bool:
        """Whether a lane's handler runs on past its task's end."""
        return is_lane(self.pool) and bool(self._left or self.threads.left_behind)

    async def _hold_lane(self, task: TaskMessage, *, before: bool) -> None:
        """A lane's handler runs on past its task's end (a plain function's thread after a
        timeout or a cancel, an `async def` that catches its cancel): the task's report and
        the lane's next task wait until it returns, or two of the lane's would run at once.
        `before`: this task has not started, and the handler is an earlier task's."""
        whose = "an earlier task's, before this one starts" if before else f"task {task.task}'s"
        log.warning(
            "%s: %s %s: the lane waits for a handler that runs on past its task's end (%s)",
            self.name, task.wf, task.path, whose,
        )  # fmt: skip
        if self._left:
            await asyncio.wait(set(self._left))
        await self.threads.settled()
        log.info("%s: %s %s: the handler returned; the lane goes on", self.name, task.wf, task.path)


def _owed(task: TaskMessage, redelivered: bool) -> bool:
    """Whether this delivery may owe its step's report: a redelivered one may be the one whose
    report a crash cut short; so may a retry (a delivery of an earlier attempt recorded the
    step and died before its report, and its owner heard only of another's failure)."""
    return redelivered or task.attempt > 0


def _retrieved(call: asyncio.Future[Any]) -> None:
    """Take a left call's outcome, so asyncio reports no exception never retrieved."""
    if not call.cancelled():
        call.exception()


async def _guarded(run: Coroutine[Any, Any, Any]) -> Any:
    """A handler's outcome, where any exception but cancellation fails the task: SystemExit or
    KeyboardInterrupt raised by a handler must not stop the worker (asyncio would re-raise them
    out of the event loop)."""
    try:
        return await run
    except (asyncio.CancelledError, Exception):
        raise
    except BaseException as exc:
        raise _TaskError(f"{type(exc).__name__}: {_said(exc)}") from None


def _cancel_said(handler: asyncio.Task[Any]) -> str:
    """The text of the CancelledError a handler's own code raised (an inner task it awaited
    was cancelled elsewhere, say)."""
    try:
        handler.result()
    except asyncio.CancelledError as exc:
        return _said(exc)
    return ""


def _own(value: Any) -> Any:
    """A copy of a JSON value the message carried (at most INLINE_BYTES) for one handler: the
    message's own is shared by the tasks of a chunk, and is what a failure reports (its retry
    is built from it). A value read by reference is not copied (it can be MiBs, for each
    member of a chunk of hundreds): members of a chunk share it, and a retry reads it again."""
    return copy.deepcopy(value) if isinstance(value, dict | list) else value


def _said(exc: BaseException, depth: int = 0) -> str:
    """str(exc); a handler's own exception class may fail at it (a __str__ that parses a body
    it did not get), which must fail the task, not its delivery. An exception group (a
    TaskGroup's) says which it holds: its own text names only how many."""
    try:
        text = str(exc)
    except Exception as failure:
        return f"<str() raised {type(failure).__name__}>"
    if isinstance(exc, BaseExceptionGroup) and depth < MAX_GROUP_DEPTH:
        held = [f"{type(e).__name__}: {_said(e, depth + 1)}" for e in exc.exceptions[:MAX_HELD]]
        more = len(exc.exceptions) - MAX_HELD
        text += f": {'; '.join(held)}{f'; and {more} more' if more > 0 else ''}"
    return text


def _carried(task: TaskMessage, outputs: dict[int | None, str]) -> bool:
    """Whether a task's output may go to its owner unrecorded (when the owner records it): a
    single task of a program's step, not one whose step names compensations (its start was
    noted: complete.lua takes the note out), and small enough to carry."""
    if task.index is not None or task.undoable or is_saga(task.path):
        return False
    return None in outputs and len(outputs[None]) <= INLINE_BYTES


def _check_text(text: str) -> None:
    """Refuse an output whose JSON text holds a lone surrogate (a file name os.listdir decoded
    with surrogateescape): its report failed to encode at every one of 20 tries, running the
    handler each time, and the program ran for good. The text is what travels, decoded again
    where it is carried: an escaped pair is a character, not a fault."""
    if "\\ud" in text:  # every character beyond the BMP escapes so too: the scan is exact
        for escape in _ESCAPES.finditer(text):
            if len(escape.group()) == LONE_ESCAPE:
                raise _TaskError(f"output: not UTF-8 text: a lone surrogate '{escape.group()}'")


def _may_be_deep(text: str) -> bool:
    """Whether the text has brackets enough for nesting deeper than MAX_DEPTH."""
    return text.count("[") + text.count("{") > MAX_DEPTH


def _check_depth(output: Any) -> None:
    """Refuse an output nested deeper than MAX_DEPTH (the bound of inputs): the owner parked a
    report holding one about 200 deep, and the program ran for good."""
    if deeper_than(output, MAX_DEPTH):
        raise _TaskError(f"output: nested deeper than {MAX_DEPTH} levels")


def _cut(error: str) -> str:
    """An error text short enough for the failure report (and Redis), and one it can encode:
    a lone surrogate in it (a file name, say) is written as its escape."""
    try:
        error.encode()
    except UnicodeEncodeError:
        error = error.encode(errors="backslashreplace").decode()
    return error if len(error) <= MAX_ERROR else error[: MAX_ERROR - 20] + " ... (cut)"


class _TaskError(Exception):
    """A task failure whose message is already the whole story."""


class _ProgramCancelled(Exception):
    """The program was cancelled while this task ran: nothing to report."""
