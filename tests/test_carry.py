"""A single task's output carried to its owner (messages.CARRY): the worker sends it in `next`
unrecorded, the owner records it with the advance that uses it. Over the model of the
scripts, step by step, and on a real cluster."""

from __future__ import annotations

import json
from typing import Any

from orchestrator.keys import Keys
from orchestrator.memory_store import MemoryStore
from orchestrator.messages import (
    CARRY,
    CARRYING,
    INLINE_BYTES,
    KeyLimit,
    Next,
    decode_shard_message,
    decode_task,
)
from orchestrator.plans import Plans
from orchestrator.settings import Settings
from orchestrator.transitions import Transitions
from router.client import Router
from tests.test_owner_steps import Recorder
from worker.pool import Worker
from worker.registry import Registry

TWO = {"steps": [{"task": "work"}, {"task": "work"}]}


class Counting(MemoryStore):
    """The model, counting the workers' record calls (lua/complete.lua)."""

    def __init__(self, keys: Keys) -> None:
        super().__init__(keys)
        self.records = 0

    async def record(self, *args: Any, **kwargs: Any) -> Any:
        self.records += 1
        return await super().record(*args, **kwargs)


class Delivery:
    def __init__(self, body: bytes, headers: dict[str, Any], redelivered: bool = False) -> None:
        self.body, self.headers, self.redelivered = body, headers, redelivered
        self.priority = None
        self.acked = False

    async def ack(self) -> None:
        self.acked = True

    async def nack(self, *, requeue: bool = True) -> None:
        raise AssertionError("nacked")


class Bus(Recorder):
    """The owner's and the worker's publishes, with the headers task messages carry and the
    bundle size each task publish allowed."""

    def __init__(self) -> None:
        super().__init__()
        self.headers: list[Any] = []
        self.most: list[int] = []
        self.reports_most: list[int] = []  # the bundle size each report publish allowed

    async def publish_to_shard(
        self, owner: int, body: bytes, priority: int = 1, most: int = 1
    ) -> None:
        await super().publish_to_shard(owner, body, priority)
        self.reports_most.append(most)

    async def publish_all(
        self,
        pool: str,
        bodies: list[bytes],
        priority: int = 1,
        headers: Any = None,
        most: int = 1,
    ) -> None:
        await super().publish_all(pool, bodies, priority)
        self.headers += [headers] * len(bodies)
        self.most.append(most)

    async def publish_later(
        self, pool: str, body: bytes, delay_s: float, priority: int = 1, headers: Any = None
    ) -> None:
        await super().publish_later(pool, body, delay_s, priority)
        self.headers.append(headers)


async def _started(
    prefix: str, program: dict[str, Any] = TWO, store: MemoryStore | None = None
) -> tuple[Any, ...]:
    """A program submitted and started over the model (`store`: a counting one when None)."""
    store = store if store is not None else Counting(Keys(prefix))
    bus = Bus()
    transitions = Transitions(store, bus, Plans(store, 8))
    owner = (await Router(Settings(prefix=prefix), store=store, bus=bus).submit(program)).shard
    start = decode_shard_message(bus.shard.pop())
    assert await transitions.apply(start, redelivered=False, shard=owner) == "applied"
    return store, bus, transitions, owner


def _worker(store: MemoryStore, bus: Bus, output: Any = "done") -> Worker:
    registry = Registry()

    async def work(ctx: Any) -> Any:
        return output

    registry.add("work", work)
    return Worker(Settings(), registry, pool="parallel", store=store, bus=bus)  # type: ignore[arg-type]


async def test_the_owner_records_a_carried_output_with_the_advance_that_used_it() -> None:
    store, bus, transitions, owner = await _started("carry")
    [first] = [decode_task(body) for body in bus.tasks]
    assert bus.headers == [CARRYING]  # its worker may leave the output to the owner
    wf = first.wf
    report = Next(wf=wf, path="0", output={"n": 1})
    assert await transitions.apply(report, redelivered=False, shard=owner) == "applied"
    assert store.data[store.keys.output(wf, "0")] == '{"n": 1}'
    assert decode_task(bus.tasks[-1]).prev == {"n": 1}
    # A copy of the task ran too, with another output: its report changes nothing.
    other = Next(wf=wf, path="0", output={"n": 2})
    assert await transitions.apply(other, redelivered=False, shard=owner) == "replay"
    assert store.data[store.keys.output(wf, "0")] == '{"n": 1}' and len(bus.tasks) == 2
    # The same copy's report redelivered (an owner died handling it): what is published
    # again is what the advance used, the recorded output, not this report's.
    assert await transitions.apply(other, redelivered=True, shard=owner) == "replay"
    assert len(bus.tasks) == 3 and decode_task(bus.tasks[-1]).prev == {"n": 1}


async def test_a_replay_follows_a_large_recorded_output_not_a_carried_copy() -> None:
    """One run of the task recorded an output over 64 KiB itself (stored); another run's
    small output was carried. Redelivered, the carried report republishes from the stored."""
    store, bus, transitions, owner = await _started("carry-large")
    wf = decode_task(bus.tasks[0]).wf
    large = "x" * INLINE_BYTES
    assert (await store.record(wf, "0", 1, {None: json.dumps(large)})).verdict == "fire"
    stored = Next(wf=wf, path="0", stored=True)
    assert await transitions.apply(stored, redelivered=False, shard=owner) == "applied"
    assert decode_task(bus.tasks[-1]).prev_ref  # too large to carry: read where it is kept
    carried = Next(wf=wf, path="0", output="small")
    assert await transitions.apply(carried, redelivered=True, shard=owner) == "replay"
    again = decode_task(bus.tasks[-1])
    assert len(bus.tasks) == 3 and again.prev_ref and again.prev is None


async def test_a_worker_carries_the_output_only_when_the_owner_records_it() -> None:
    store, bus, _, _ = await _started("carry-worker")
    body = bus.tasks[0]
    worker = _worker(store, bus)
    await worker.handle(Delivery(body, {CARRY: 1}), "q")
    assert store.records == 0  # no Redis call to record: the owner will
    wf = decode_task(body).wf
    expected = {"kind": "next", "wf": wf, "path": "0", "output": "done", "stored": False}
    assert json.loads(bus.shard[-1]) == expected
    assert store.keys.output(decode_task(body).wf, "0") not in store.data
    # From an owner before the header (or a forged value): the worker records it first. (At
    # other workers: this one acks a copy of a message it ran unrun, tests/test_given_back.py.)
    for headers in ({}, {CARRY: "yes"}):
        await _worker(store, bus).handle(Delivery(body, headers), "q")
    assert store.records == 2
    assert store.data[store.keys.output(decode_task(body).wf, "0")] == '"done"'


async def test_bag_members_undoable_tasks_and_large_outputs_are_recorded_by_the_worker() -> None:
    bag = {"steps": [{"bag": [{"task": "work"}, {"task": "work"}]}]}
    store, bus, _, _ = await _started("carry-bag", bag)
    worker = _worker(store, bus)
    for body in bus.tasks:
        await worker.handle(Delivery(body, {CARRY: 1}), "q")
    assert store.records == 2
    undoable = {"steps": [{"task": "work", "compensate": {"task": "work"}}]}
    store, bus, _, _ = await _started("carry-undo", undoable)
    assert decode_task(bus.tasks[0]).undoable
    await _worker(store, bus).handle(Delivery(bus.tasks[0], {CARRY: 1}), "q")
    assert store.records == 1
    store, bus, _, _ = await _started("carry-big")
    large = "x" * INLINE_BYTES
    await _worker(store, bus, large).handle(Delivery(bus.tasks[0], {CARRY: 1}), "q")
    assert store.records == 1 and json.loads(bus.shard[-1])["stored"] is True


async def test_a_limited_task_that_waits_keeps_its_owners_promise() -> None:
    store, bus, _, _ = await _started("carry-limit")
    task = decode_task(bus.tasks[0])
    limited = task.model_copy(update={"limit": KeyLimit(key="k", max=1)})
    assert (await store.acquire("k", "someone", 1, 30_000)).verdict == "acquired"
    worker = _worker(store, bus)
    assert await worker._limited(limited, "parallel", redelivered=False, carry=True) is None
    assert bus.headers[-1] == {CARRY: 1}  # it goes back to wait, header and all
    assert await worker._limited(limited, "parallel", redelivered=False) is None
    assert bus.headers[-1] is None
    await store.release("k", "someone")
    [report] = await worker._limited(limited, "parallel", redelivered=False, carry=True)
    assert report == Next(wf=task.wf, path="0", output="done") and store.records == 0


async def test_a_chain_on_a_real_cluster_keeps_every_steps_output(cluster: Router) -> None:
    program = {"steps": [{"task": "add", "args": {"n": n}} for n in range(1, 5)]}
    submitted = await cluster.submit(program, None)
    status = await cluster.wait(submitted.workflow_id, timeout_s=30)
    assert status["status"] == "completed" and status["result"] == 10, status
    store = cluster.store
    found = await store.outputs(submitted.workflow_id, "2", None, INLINE_BYTES)
    assert found.values == ["6"]  # recorded by the owner, from the worker's `next`
