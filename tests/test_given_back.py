"""A task message the broker gives back to the worker that ran it (its connection dropped):
what the worker remembers of its runs (worker/runs.py), over the model of the scripts. The
copy that comes while the run goes on is tested on a real broker (tests/test_pools.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from orchestrator import limits
from orchestrator.delivery import FAILURES
from orchestrator.keys import Keys, Names
from orchestrator.messages import (
    KeyLimit,
    Slot,
    TaskMessage,
    bundle,
    decode_shard_message,
    decode_task,
    encode,
)
from orchestrator.plans import Plans
from orchestrator.settings import Settings
from orchestrator.transitions import Transitions
from router.client import Router
from tests.test_carry import Bus, Counting, Delivery
from worker import runs
from worker.pool import Worker
from worker.registry import Registry
from worker.runs import run_key

ONE = {"steps": [{"task": "work", "retry": {"max_attempts": 3, "backoff_s": 0}}]}


class _Bus(Bus):
    """The recorder, with the queue names a worker reads, and the messages sent again by the
    delivery policy (`requeued`); `fail_reports` makes that many report publishes fail."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.names = Names(prefix)
        self.requeued: list[tuple[bytes, Any]] = []
        self.fail_reports = 0

    async def publish_to_shard(
        self, owner: int, body: bytes, priority: int = 1, most: int = 1
    ) -> None:
        if self.fail_reports:
            self.fail_reports -= 1
            raise ConnectionError("its channel closed (a test)")
        await super().publish_to_shard(owner, body, priority, most)

    async def requeue(self, queue: str, body: bytes, headers: Any, priority: Any, **_: Any) -> None:
        self.requeued.append((body, headers))


class _Store(Counting):
    """The model, whose state read yields to the loop as a Redis read does."""

    async def state(self, wf: str) -> dict[str, str]:
        await asyncio.sleep(0)
        return await super().state(wf)


class _Cluster:
    """An owner and one worker over the model; `gate`, while set up, holds every handler."""

    def __init__(self, prefix: str, concurrency: int = 1) -> None:
        self.store = _Store(Keys(prefix))
        self.bus = _Bus(prefix)
        self.transitions = Transitions(self.store, self.bus, Plans(self.store, 8))
        self.router = Router(Settings(prefix=prefix), store=self.store, bus=self.bus)
        self.ran: list[str] = []
        self.gate: asyncio.Event | None = None
        self.fails = 0  # the next runs that fail
        registry = Registry({"work": self._work})
        self.worker = Worker(
            Settings(),
            registry,
            pool="parallel",
            store=self.store,
            bus=self.bus,  # type: ignore[arg-type]
            concurrency=concurrency,
        )

    async def _work(self, ctx: Any) -> str:
        self.ran.append(f"{ctx.workflow_id}#{ctx.attempt}")
        if self.gate is not None:
            await self.gate.wait()
        if self.fails:
            self.fails -= 1
            raise RuntimeError("it failed")
        return "done"

    def another_worker(self) -> Worker:
        """A worker that knows nothing of this one's runs."""
        registry = Registry({"work": self._work})
        return Worker(Settings(), registry, pool="parallel", store=self.store, bus=self.bus)  # type: ignore[arg-type]

    async def deliver_reports(self, owner: int) -> None:
        """Every report, to the owner, in order."""
        while self.bus.shard:
            report = decode_shard_message(self.bus.shard.pop(0))
            await self.transitions.apply(report, redelivered=False, shard=owner)

    async def start(self, wf: str) -> bytes:
        """Submit ONE as `wf`, its start applied: its task message."""
        owner = (await self.router.submit(ONE, None, wf)).shard
        start = decode_shard_message(self.bus.shard.pop())
        assert await self.transitions.apply(start, redelivered=False, shard=owner) == "applied"
        return self.bus.tasks.pop()

    def reports(self) -> list[Any]:
        return [decode_shard_message(body) for body in self.bus.shard]


async def test_a_copy_given_back_after_its_run_ended_is_acked_and_not_run() -> None:
    """The run reported and its ack was lost with the channel: the copy is the same task."""
    cluster = _Cluster("given-back")
    body = await cluster.start("w1")
    await cluster.worker.handle(Delivery(body, {}), "q")
    assert cluster.ran == ["w1#0"] and len(cluster.bus.shard) == 1
    copy = Delivery(body, {}, redelivered=True)
    await cluster.worker.handle(copy, "q")
    assert copy.acked and cluster.ran == ["w1#0"] and len(cluster.bus.shard) == 1
    assert cluster.worker.counts["ran here already"] == 1
    # Another attempt of the task (a retry) is no copy: it goes a run's way, and finds its
    # step recorded (the owner has not read the report yet), so it reports that, unrun.
    retry = encode(decode_task(body).model_copy(update={"attempt": 1}))
    await cluster.worker.handle(Delivery(retry, {}, redelivered=True), "q")
    assert cluster.ran == ["w1#0"] and len(cluster.bus.shard) == 2
    assert cluster.worker.counts["ran here already"] == 1
    assert cluster.worker.counts["recorded already"] == 1


async def test_a_copy_runs_when_the_run_here_withheld_the_report_it_owes() -> None:
    """A delivery records the step and loses its report (the channel closed); a duplicate of
    it (an owner's replay) then runs here unflagged, finds the step recorded (`again`) and
    reports nothing, as a first delivery does. The first delivery, back flagged, owes the
    `next`: it is no copy of a run that reported, and must run and report."""
    cluster = _Cluster("given-back-withheld")
    body = await cluster.start("w1")
    cluster.bus.fail_reports = 1
    await cluster.worker.handle(Delivery(body, {}), "q")  # recorded; its report failed
    assert cluster.ran == ["w1#0"] and cluster.reports() == []
    await cluster.worker.handle(Delivery(body, {}), "q")  # the duplicate: `again`, no report
    assert cluster.ran == ["w1#0", "w1#0"] and cluster.reports() == []
    [(again, headers)] = cluster.bus.requeued  # the delivery policy sent the first on again
    assert FAILURES in headers
    await cluster.worker.handle(Delivery(again, headers), "q")
    assert [(r.kind, r.path) for r in cluster.reports()] == [("next", "0")]
    assert cluster.worker.counts["ran here already"] == 0


async def test_a_copy_waiting_for_a_run_that_withheld_its_report_runs_after_it() -> None:
    """As above, the duplicate's run under way as the flagged copy comes: the copy waits for
    it, then goes a run's way and reports what that run withheld (unrun: its step is
    recorded)."""
    cluster = _Cluster("given-back-withheld-running", concurrency=2)
    body = await cluster.start("w1")
    cluster.gate = asyncio.Event()
    duplicate = asyncio.create_task(cluster.worker.handle(Delivery(body, {}), "q"))
    await _until(lambda: cluster.ran == ["w1#0"])
    # Meanwhile another worker recorded the step and died before its report.
    task = decode_task(body)
    recorded = await cluster.store.record(task.wf, task.path, 1, {None: '"done"'}, task.epoch)
    assert recorded.verdict == "fire"
    copy = asyncio.create_task(cluster.worker.handle(Delivery(body, {}, redelivered=True), "q"))
    await asyncio.sleep(0.05)
    assert cluster.ran == ["w1#0"]  # the copy waits
    cluster.gate.set()
    await asyncio.gather(duplicate, copy)
    assert cluster.ran == ["w1#0"] and cluster.worker.counts["recorded already"] == 1
    assert [(r.kind, r.path) for r in cluster.reports()] == [("next", "0")]


async def test_a_copy_runs_when_the_run_here_failed() -> None:
    """This worker's run failed (its failure reported); the broker had given the message to
    another worker meanwhile, which recorded the step and died before its `next`. Its
    delivery, back flagged at this worker, owes that `next`: it is no copy of a run that
    reported all."""
    cluster = _Cluster("given-back-failed")
    body = await cluster.start("w1")
    owner = decode_task(body).owner
    cluster.fails = 1
    await cluster.worker.handle(Delivery(body, {}), "q")
    assert [r.kind for r in cluster.reports()] == ["failed"]
    task = decode_task(body)
    recorded = await cluster.store.record(task.wf, task.path, 1, {None: '"done"'}, task.epoch)
    assert recorded.verdict == "fire"  # the other worker's, which then died
    await cluster.worker.handle(Delivery(body, {}, redelivered=True), "q")
    assert [r.kind for r in cluster.reports()] == ["failed", "next"]  # its own, unrun
    assert cluster.ran == ["w1#0"] and cluster.worker.counts["ran here already"] == 0
    await cluster.deliver_reports(owner)  # the failure (a retry), then the `next`
    await cluster.another_worker().handle(Delivery(cluster.bus.tasks.pop(), {}), "q")
    await cluster.deliver_reports(owner)
    assert (await cluster.store.state("w1"))["status"] == "completed"


async def test_a_task_whose_step_is_recorded_reports_it_unrun_when_redelivered_or_retried() -> None:
    """A delivery recorded the step and died before its `next`. Its copy, back flagged, ran
    the handler again, and a handler that failed a second run ("already exists") failed the
    program, its output recorded; its retry, not redelivered, found the step recorded
    (`again`) and reported nothing, so the program waited for good. Both now report the
    recorded step, and run no handler."""
    cluster = _Cluster("given-back-recorded")
    body = await cluster.start("w1")
    task, owner = decode_task(body), decode_task(body).owner
    recorded = await cluster.store.record(task.wf, task.path, 1, {None: '"done"'}, task.epoch)
    assert recorded.verdict == "fire"
    cluster.fails = 1  # a run would fail
    await cluster.worker.handle(Delivery(body, {}, redelivered=True), "q")
    assert cluster.ran == [] and [r.kind for r in cluster.reports()] == ["next"]
    await cluster.deliver_reports(owner)
    assert (await cluster.store.state("w1"))["status"] == "completed"
    # A retry (its failure reported by another delivery) whose step is recorded meanwhile.
    body = await cluster.start("w2")
    task = decode_task(body).model_copy(update={"attempt": 1})
    recorded = await cluster.store.record(task.wf, task.path, 1, {None: '"done"'}, task.epoch)
    await cluster.another_worker().handle(Delivery(encode(task), {}), "q")
    assert cluster.ran == [] and [r.kind for r in cluster.reports()] == ["next"]
    await cluster.deliver_reports(task.owner)
    assert (await cluster.store.state("w2"))["status"] == "completed"


async def test_a_workflow_id_submitted_again_runs_its_task() -> None:
    """The program ended and was purged; its id is submitted again, and the new program's
    task, the same message, comes flagged (sent on again after a blip): it must run."""
    cluster = _Cluster("given-back-reused")
    old = await cluster.start("order-1")
    await cluster.worker.handle(Delivery(old, {}), "q")
    [next_] = [decode_shard_message(body) for body in cluster.bus.shard]
    cluster.bus.shard.clear()
    await cluster.transitions.apply(next_, redelivered=False, shard=decode_task(old).owner)
    assert (await cluster.store.state("order-1"))["status"] == "completed"
    assert await cluster.store.purge("order-1", "completed", 10**15) == "purged"
    await asyncio.sleep(0.002)  # a new created_ms (whole ms)
    new = await cluster.start("order-1")
    assert new == old
    await cluster.worker.handle(Delivery(new, {FAILURES: 0}), "q")
    assert cluster.ran == ["order-1#0", "order-1#0"]
    assert [(r.kind, r.path) for r in cluster.reports()] == [("next", "0")]


async def test_a_copy_of_a_reused_ids_task_waits_for_its_run_under_way() -> None:
    """The old program's run is remembered; the new one's copy still waits for the run under
    way rather than run beside it."""
    cluster = _Cluster("given-back-reused-running", concurrency=2)
    old = await cluster.start("order-1")
    await cluster.worker.handle(Delivery(old, {}), "q")
    await cluster.deliver_reports(decode_task(old).owner)
    assert await cluster.store.purge("order-1", "completed", 10**15) == "purged"
    await asyncio.sleep(0.002)  # a new created_ms (whole ms)
    new = await cluster.start("order-1")
    cluster.gate = asyncio.Event()
    # Its duplicate comes with it (a publisher's retry), and both look for a run here at once.
    first = asyncio.create_task(cluster.worker.handle(Delivery(new, {}), "q"))
    duplicate = asyncio.create_task(cluster.worker.handle(Delivery(new, {}), "q"))
    await _until(lambda: len(cluster.ran) == 2)
    copy = asyncio.create_task(cluster.worker.handle(Delivery(new, {}, redelivered=True), "q"))
    await asyncio.sleep(0.05)
    assert len(cluster.ran) == 2  # the duplicate and the copy wait
    cluster.gate.set()
    await asyncio.gather(first, duplicate, copy)
    assert cluster.ran == ["order-1#0", "order-1#0"]
    assert cluster.worker.counts["ran here already"] == 2


async def test_a_bundle_given_back_runs_each_task_once_here() -> None:
    """Given back while its tasks run, a bundle is split at once: a task of it that had not
    started in the first try ran from its own copy, then again from the first try."""
    cluster = _Cluster("given-back-bundle", concurrency=2)
    bodies = [await cluster.start(f"p{n}") for n in range(3)]
    cluster.gate = asyncio.Event()
    whole = bundle(bodies)
    first = asyncio.create_task(cluster.worker.handle(Delivery(whole, {}), "q"))
    await _until(lambda: len(cluster.ran) == 2)  # two side by side, the third waits its turn
    await cluster.worker.handle(Delivery(whole, {}, redelivered=True), "q")  # split
    copies = [
        asyncio.create_task(cluster.worker.handle(Delivery(body, headers), "q"))
        for body, headers in cluster.bus.requeued
    ]
    await asyncio.sleep(0.05)
    cluster.gate.set()
    await asyncio.gather(first, *copies)
    assert sorted(cluster.ran) == ["p0#0", "p1#0", "p2#0"]
    assert len(cluster.reports()) == 3 and cluster.worker.counts["ran here already"] == 3


async def test_a_task_sent_back_to_wait_for_a_slot_is_not_taken_for_one_that_ran() -> None:
    """Its waits tell a wait's message from the one before, but stop counting at MAX_WAITS:
    a message back from such a wait, flagged redelivered, must still run."""
    cluster = _Cluster("given-back-wait")
    task = decode_task(await cluster.start("w1"))
    capped = KeyLimit(key="k", max=1, waits=limits.MAX_WAITS)
    body = encode(task.model_copy(update={"limit": capped}))
    assert (await cluster.store.acquire("k", "someone", 1, 30_000)).verdict == "acquired"
    await cluster.worker.handle(Delivery(body, {}, redelivered=True), "parallel")
    back = decode_task(cluster.bus.tasks[-1])
    assert cluster.ran == [] and back.limit is not None and back.limit.waits == limits.MAX_WAITS
    await cluster.store.release("k", "someone")
    again = Delivery(cluster.bus.tasks[-1], {}, redelivered=True)
    await cluster.worker.handle(again, "parallel")
    assert again.acked and cluster.ran == ["w1#0"], cluster.worker.counts
    assert cluster.worker.counts["ran here already"] == 0


async def test_the_memory_of_runs_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runs, "RUNS_KEPT", 2)
    cluster = _Cluster("given-back-bounded")
    bodies = [await cluster.start(f"w{n}") for n in range(3)]
    for body in bodies:
        await cluster.worker.handle(Delivery(body, {}), "q")
    # The first run is forgotten: its copy goes a run's way (its step recorded: unrun), the
    # last one's is known.
    for body in (bodies[0], bodies[2]):
        await cluster.worker.handle(Delivery(body, {}, redelivered=True), "q")
    assert cluster.worker.counts["ran here already"] == 1
    assert cluster.worker.counts["recorded already"] == 1


async def _until(done: Any) -> None:
    for _ in range(200):
        if done():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("never came")


def test_a_run_key_tells_apart_every_message_that_must_run_on_its_own() -> None:
    """A retry, a redrive's run, a loop's iteration, another bag member or chunk, another
    step, another program, a wait for a slot: each is another run. The same message is not."""
    base = TaskMessage(wf="w", path="0", task="t", owner=0, index=0, size=4)
    chunk = base.model_copy(update={"batch": [Slot(index=1, task="t")]})
    limited = TaskMessage(wf="w", path="1", task="t", owner=0, limit=KeyLimit(key="k", max=1))
    others = [
        base.model_copy(update=change)
        for change in (
            {"wf": "v"},
            {"epoch": 1},
            {"path": "1"},
            {"iteration": 1},
            {"attempt": 1},
            {"index": 2},
        )
    ]
    others += [
        chunk,
        chunk.model_copy(update={"batch": [Slot(index=2, task="t")]}),
        limited,
        limited.model_copy(update={"limit": KeyLimit(key="k", max=1, waits=1)}),
    ]
    keys = [run_key(message) for message in [base, *others]]
    assert len(set(keys)) == len(keys), keys
    assert run_key(decode_task(encode(chunk))) == run_key(chunk)


async def test_a_chunk_recorded_in_part_runs_its_members() -> None:
    """A redelivered chunk runs only its members whose output is not recorded: one recorded
    is not run again (a second run that failed would fail the program, its output recorded)."""
    cluster = _Cluster("given-back-chunk")
    program = {"steps": [{"bag": [{"task": "work"}] * 3, "chunk": 3}]}
    owner = (await cluster.router.submit(program, None, "w1")).shard
    start = decode_shard_message(cluster.bus.shard.pop())
    assert await cluster.transitions.apply(start, redelivered=False, shard=owner) == "applied"
    [body] = cluster.bus.tasks
    task = decode_task(body)
    assert len(task.split()) == 3
    recorded = await cluster.store.record(task.wf, task.path, 3, {0: '"done"'}, task.epoch)
    assert recorded.verdict == "wait"
    cluster.fails = 1  # a second run of member 0 would fail ("already exists")
    await cluster.worker.handle(Delivery(body, {}, redelivered=True), "q")
    assert cluster.ran == ["w1#0"] * 2 and cluster.worker.counts["recorded already"] == 1
    assert [r.kind for r in cluster.reports()] == ["failed"]  # member 1's, which ran first
    cluster.bus.shard.clear()
    await cluster.worker.handle(Delivery(body, {}, redelivered=True), "q")  # its next try
    assert [r.kind for r in cluster.reports()] == ["next"]


async def test_a_limited_task_whose_step_is_recorded_reports_it_without_a_slot() -> None:
    """A redelivered limited task whose output is recorded needs no slot to report it: it
    waited in the delay ladder while every slot was held, its `next` late by the backoff."""
    cluster = _Cluster("given-back-limited")
    task = decode_task(await cluster.start("w1"))
    limited = task.model_copy(update={"limit": KeyLimit(key="k", max=1)})
    assert (await cluster.store.acquire("k", "someone", 1, 30_000)).verdict == "acquired"
    recorded = await cluster.store.record(task.wf, task.path, 1, {None: '"done"'}, task.epoch)
    assert recorded.verdict == "fire"
    await cluster.worker.handle(Delivery(encode(limited), {}, redelivered=True), "parallel")
    assert cluster.ran == [] and [r.kind for r in cluster.reports()] == ["next"]
    assert cluster.worker.counts["waited for a slot"] == 0
