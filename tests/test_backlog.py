"""Adaptive chunks: a bag or map that names no chunk goes out one member per message while its
pool keeps up, and several per message while the pool's queue, or the owner's own shard
queues, have a backlog."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest

from orchestrator.backlog import AUTO_STEP, MAX_UPSTREAM, Backlog, auto_chunk
from orchestrator.bus import Bus
from orchestrator.connections import connected
from orchestrator.owner import Orchestrator
from orchestrator.program import parse_program
from orchestrator.settings import Settings
from orchestrator.shares import share_of, share_pool
from router.client import Router
from tests.polling import until
from worker.pool import Worker
from worker.registry import Registry


@pytest.mark.parametrize(
    ("ready", "limit", "chunk"),
    [(0, 10, 1), (AUTO_STEP - 1, 10, 1), (AUTO_STEP, 10, 2), (100, 10, 10), (100, 3, 3)],
)
def test_the_chunk_grows_with_the_backlog_up_to_its_limit(
    ready: int, limit: int, chunk: int
) -> None:
    assert auto_chunk(ready, limit) == chunk


async def test_samples_are_taken_in_the_background_and_go_stale() -> None:
    asked: list[str] = []
    depth = {"parallel": 1000}

    async def sample(pool: str) -> tuple[int, int] | None:
        asked.append(pool)
        if pool == "broken":
            raise ConnectionError("broker gone")
        return (depth[pool], 2) if pool in depth else None

    backlog = Backlog(sample, limit=10, every_s=0.05)
    assert backlog.chunk("parallel") == 1  # nothing known yet: spread
    await until(lambda: _answer(backlog.chunk("parallel")), lambda found: found["chunk"] == 10, 5)
    assert backlog.chunk("gone") == 1 and backlog.chunk("broken") == 1
    await asyncio.sleep(0.01)  # both samples answered: no such queue, and an error
    calls = len(asked)
    assert backlog.chunk("gone") == 1 and backlog.chunk("broken") == 1  # no backlog ...
    await asyncio.sleep(0.01)
    assert len(asked) == calls  # ... and not asked again before `every_s`
    assert Backlog(sample, limit=1).chunk("parallel") == 1  # a limit of 1 turns it off
    await backlog.close()


async def test_messages_waiting_for_the_owner_count_as_a_backlog() -> None:
    """Work on its way (the owner's shard queues) counts with the pool's own queue; each
    queue is sampled once per interval, and at most MAX_UPSTREAM shard queues."""
    depth = {"tasks.parallel": 0, "shard.0": 20, "shard.1": 20, "shard.2": 0}
    asked: list[str] = []

    async def sample(queue: str) -> tuple[int, int] | None:
        asked.append(queue)
        return depth.get(queue, 0), 1

    shards = [f"shard.{n}" for n in range(MAX_UPSTREAM + 5)]
    backlog = Backlog(sample, 10, queue_of=lambda pool: f"tasks.{pool}", upstream=shards)
    await until(lambda: _answer(backlog.chunk("parallel")), lambda found: found["chunk"] == 10)
    assert backlog.ready("parallel") == 0  # the pool itself keeps up
    assert sorted(set(asked)) == sorted(["tasks.parallel", *shards[:MAX_UPSTREAM]])
    depth.update({"shard.0": 0, "shard.1": 4})  # the owner caught up: spread again
    await until(lambda: _answer(backlog.chunk("parallel")), lambda found: found["chunk"] == 2)
    quiet = Backlog(sample, 10, queue_of=lambda pool: f"tasks.{pool}", upstream=["shard.2"])
    asked.clear()
    assert quiet.chunk("parallel") == 1  # nothing known yet
    await until(lambda: _answer(len(set(asked))), lambda found: found["chunk"] == 2)
    assert quiet.chunk("parallel") == 1  # both sampled, nothing waits: spread
    await backlog.close()
    await quiet.close()


async def test_a_bundle_follows_the_pools_own_backlog_only() -> None:
    """Single tasks are bundled while the pool's own queue has a backlog: submits waiting in
    the shard queues say nothing of whether its workers are busy (orchestrator/bundling.py)."""
    depth = {"tasks.parallel": 0, "shard.0": 40}

    async def sample(queue: str) -> tuple[int, int] | None:
        return depth.get(queue, 0), 1

    backlog = Backlog(sample, 10, queue_of=lambda pool: f"tasks.{pool}", upstream=["shard.0"])
    await until(lambda: _answer(backlog.chunk("parallel")), lambda found: found["chunk"] == 10)
    assert backlog.bundle("parallel") == 1  # the owner is behind, the pool keeps up
    depth["tasks.parallel"] = 3 * AUTO_STEP
    await until(lambda: _answer(backlog.bundle("parallel")), lambda found: found["chunk"] == 4)
    off = Backlog(sample, 1, queue_of=lambda pool: f"tasks.{pool}")
    assert off.bundle("parallel") == 1  # SHARDFLOW_AUTO_CHUNK=1: never
    await backlog.close()
    await off.close()


async def _answer(chunk: int) -> dict[str, int]:
    return {"chunk": chunk}


def _bag(name: str, chunk: int | None = None, size: int = 100) -> dict[str, object]:
    bag: dict[str, object] = {"bag": [{"task": "add", "args": {"n": i}} for i in range(size)]}
    if chunk is not None:
        bag["chunk"] = chunk
    return {"name": name, "steps": [bag]}


async def test_a_backlog_sends_bags_in_chunks_unless_they_name_theirs(
    settings: Settings, registry: Registry
) -> None:
    """Orchestrators with no worker: the first bag's 100 members wait one per message; then
    the pool has a backlog, so the next bag goes out 10 members per message (the limit);
    a bag that names chunk 1 keeps it. A worker then runs all three to the right results."""
    # The three share a name, so a queue: the backlog that counts is their share's of the pool.
    pool = share_pool("parallel", share_of(parse_program(_bag("bags"))))
    queue = f"{settings.prefix}.tasks.{pool}"
    async with connected(settings) as (store, bus):
        orchestrator = Orchestrator(settings, range(settings.shards), store=store, bus=bus)
        running = asyncio.create_task(orchestrator.run())
        try:
            router = Router(settings, store=store, bus=bus)
            first = (await router.submit(_bag("bags"))).workflow_id
            await until(lambda: _depth(bus, queue), lambda found: found["ready"] == 100)
            await until(
                lambda: _answer(orchestrator.backlog.ready(pool)),
                lambda found: found["chunk"] == 100,
            )
            second = (await router.submit(_bag("bags"))).workflow_id
            await until(lambda: _depth(bus, queue), lambda found: found["ready"] >= 110)
            third = (await router.submit(_bag("bags", chunk=1))).workflow_id
            found = await until(lambda: _depth(bus, queue), lambda found: found["ready"] >= 210)
            assert found["ready"] == 210  # 100 + 100 / 10 + 100
            statuses = await _run_all(settings, registry, store, bus, [first, second, third])
        finally:
            orchestrator.shutdown()
            await running
    assert [s["status"] for s in statuses] == ["completed"] * 3
    assert all(s["result"] == list(range(100)) for s in statuses)


async def _run_all(
    settings: Settings, registry: Registry, store: Any, bus: Any, ids: list[str]
) -> list[dict[str, Any]]:
    """A worker runs the programs to their ends: their final statuses, in order."""
    worker = Worker(settings, registry, pool="parallel", store=store, bus=bus)
    working = asyncio.create_task(worker.run())
    try:
        router = Router(settings, store=store, bus=bus)
        return [await router.wait(wf, timeout_s=60) for wf in ids]
    finally:
        worker.shutdown()
        await working


async def _depth(bus: object, queue: str) -> dict[str, int] | None:
    state = await bus.queue_state(queue)  # type: ignore[attr-defined]
    return None if state is None else {"ready": state[0]}


async def test_programs_waiting_for_their_owner_go_out_in_chunks(
    settings: Settings, registry: Registry
) -> None:
    """Programs submitted before their owner runs wait in its shard queue; the pool's queue is
    empty, yet the owner sees the backlog and sends each bag of 10 as one message (with the
    pool's queue alone it sent the first one member per message). A worker then runs them all
    to the right results."""
    settings = settings.model_copy(update={"shards": 1})
    program = _bag("waiting", size=10)
    pool = share_pool("parallel", share_of(parse_program(program)))
    queue = f"{settings.prefix}.tasks.{pool}"
    async with connected(settings) as (store, bus):
        orchestrator = Orchestrator(settings, [0], store=store, bus=bus)
        router = Router(settings, store=store, bus=bus)
        # 80: with 16 in the owner's hands, 64 or more wait in the shard or the pool: chunk 10.
        ids = [(await router.submit(program)).workflow_id for _ in range(80)]
        await until(
            lambda: _answer(orchestrator.backlog.chunk(pool)),
            lambda found: found["chunk"] == 10,
        )
        assert orchestrator.backlog.ready(pool) == 0
        running = asyncio.create_task(orchestrator.run())
        try:
            await until(lambda: _running(router, ids), lambda found: found["running"] == 80)
            await until(lambda: _depth(bus, queue), lambda found: found["ready"] >= 80)
            await asyncio.sleep(0.2)  # any more would have been sent by now
            assert await _depth(bus, queue) == {"ready": 80}  # one message a bag
            statuses = await _run_all(settings, registry, store, bus, ids)
        finally:
            orchestrator.shutdown()
            await running
    assert [s["status"] for s in statuses] == ["completed"] * 80
    assert all(s["result"] == list(range(10)) for s in statuses)


async def _running(router: Router, ids: list[str]) -> dict[str, int]:
    states = [await router.store.state(wf) for wf in ids]
    return {"running": sum(state.get("status") == "running" for state in states)}


def _channels_opened() -> int:
    """aio-pika objects of which each channel ever opened leaves one behind (aio-pika 10.2
    over aiormq 7.2: see Bus.queue_state)."""
    from aio_pika.tools import OneShotCallback

    gc.collect()
    return sum(isinstance(o, OneShotCallback) for o in gc.get_objects())


async def test_sampling_a_queue_opens_no_channel_per_sample(settings: Settings) -> None:
    """An owner samples queues several times a second: on one probe channel kept open, with the
    right answers before and after a missing queue closes it, and no channel left behind a
    sample (a channel each cost 4.5 KB of RSS that never came back). A probe the broker closed
    (404) stays closed: a robust one reopened itself behind our close, and each missing queue
    sampled left one more channel open on the broker, until the connection had none left."""
    async with connected(settings) as (_, bus):
        for _ in range(3):
            await bus.publish_to_shard(0, b"{}")
        await until(lambda: _depth(bus, bus.names.shard_queue(0)), lambda s: s["ready"] == 3)
        before, open_before = _channels_opened(), _open_channels(bus)
        for round_ in range(100):
            assert await bus.shard_queue_state(0) == (3, 0)
            if round_ % 5 == 0:  # the broker closes the probe: the next sample opens one
                assert await bus.queue_state(f"{settings.prefix}.no-such-queue") is None
        assert await bus.shard_queue_state(0) == (3, 0)
        await asyncio.sleep(0.5)  # what a closed robust channel reopened would be open by now
        assert _channels_opened() - before == 0, "an aio-pika channel opened for a sample"
        # 20 missing queues sampled: only the probe in use is open.
        assert _open_channels(bus) - open_before <= 1, "channels left open by the probes"


def _open_channels(bus: Bus) -> int:
    """Channels open on the bus's connection (aiormq's table: the broker's view)."""
    assert bus._connection is not None and bus._connection.transport is not None
    table = bus._connection.transport.connection.channels
    return sum(1 for channel in table.values() if channel is not None and not channel.is_closed)


@pytest.mark.parametrize("on", [True, False])
async def test_an_owner_bundles_single_tasks_only_when_its_settings_say_so(
    settings: Settings, on: bool
) -> None:
    """SHARDFLOW_BUNDLE_TASKS=false (chart: orchestrator.bundleTasks) for a rolling upgrade
    from workers that know no bundles: the backlog still chunks bags, and bundles nothing."""
    settings = settings.model_copy(update={"bundle_tasks": on})
    async with connected(settings) as (store, bus):
        orchestrator = Orchestrator(settings, [0], store=store, bus=bus)
        transitions = orchestrator.transitions
        assert transitions.chunk_for == orchestrator.backlog.chunk
        assert transitions.bundle_for == (orchestrator.backlog.bundle if on else None)
        await orchestrator.backlog.close()
