"""A task message the broker gives back to the worker that ran it (its connection dropped):
what the worker remembers of its runs (Worker._ran_here), over the model of the scripts. The
copy that comes while the run goes on is tested on a real broker (tests/test_pools.py)."""

from __future__ import annotations

from typing import Any

from orchestrator import limits
from orchestrator.keys import Names
from orchestrator.messages import KeyLimit, decode_task, encode
from orchestrator.settings import Settings
from tests.test_carry import Bus, Delivery, _started
from worker.pool import Worker
from worker.registry import Registry


class _Bus(Bus):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.names = Names(prefix)


async def _worker(prefix: str) -> tuple[Any, _Bus, Worker, list[int]]:
    store, recorder, _, _ = await _started(prefix)
    bus = _Bus(prefix)
    bus.tasks = recorder.tasks
    ran: list[int] = []

    async def work(ctx: Any) -> str:
        ran.append(ctx.attempt)
        return "done"

    worker = Worker(Settings(), Registry({"work": work}), pool="parallel", store=store, bus=bus)  # type: ignore[arg-type]
    return store, bus, worker, ran


async def test_a_copy_given_back_after_its_run_ended_is_acked_and_not_run() -> None:
    """The run reported and its ack was lost with the channel: the copy is the same task."""
    _, bus, worker, ran = await _worker("given-back")
    body = bus.tasks[0]
    await worker.handle(Delivery(body, {}), "q")
    assert ran == [0] and len(bus.shard) == 1
    copy = Delivery(body, {}, redelivered=True)
    await worker.handle(copy, "q")
    assert copy.acked and ran == [0] and len(bus.shard) == 1
    assert worker.counts["ran here already"] == 1
    # Another attempt of the task (a retry) is another run: the step is still current, as
    # its owner has not read the report yet.
    retry = encode(decode_task(body).model_copy(update={"attempt": 1}))
    await worker.handle(Delivery(retry, {}, redelivered=True), "q")
    assert ran == [0, 1] and worker.counts["ran here already"] == 1


async def test_a_task_sent_back_to_wait_for_a_slot_is_not_taken_for_one_that_ran() -> None:
    """Its waits tell a wait's message from the one before, but stop counting at MAX_WAITS:
    a message back from such a wait, flagged redelivered, must still run."""
    store, bus, worker, ran = await _worker("given-back-wait")
    task = decode_task(bus.tasks[0])
    capped = KeyLimit(key="k", max=1, waits=limits.MAX_WAITS)
    body = encode(task.model_copy(update={"limit": capped}))
    assert (await store.acquire("k", "someone", 1, 30_000)).verdict == "acquired"
    await worker.handle(Delivery(body, {}, redelivered=True), "parallel")
    assert ran == [] and decode_task(bus.tasks[-1]).limit.waits == limits.MAX_WAITS  # type: ignore[union-attr]
    await store.release("k", "someone")
    back = Delivery(bus.tasks[-1], {}, redelivered=True)
    await worker.handle(back, "parallel")
    assert back.acked and ran == [0], worker.counts
    assert worker.counts["ran here already"] == 0
