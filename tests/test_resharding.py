"""Resharding by config: the shard count goes 2 -> 4 -> 3 while programs run.

In-flight programs finish on the shard recorded as their owner; new ones spread over the new
ring; a shard that left the ring is drained, then reported removable by `shardflow shards`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from orchestrator.connections import connected
from orchestrator.owner import Orchestrator
from orchestrator.settings import Settings
from router.client import Router
from shardflow.dev import Dev
from tests.app import Trace
from tests.ordering import assert_leaves_in_order
from worker.registry import Registry

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).parent.parent
SLOW = {
    "steps": [
        {"task": "add", "pool": "parallel", "args": {"n": 1, "sleep_s": 0.2}},
        {"bag": [{"task": "add", "args": {"n": 1, "sleep_s": 0.2}}] * 2},
        {"task": "add", "pool": "parallel", "args": {"n": 0, "sleep_s": 0.2}},
    ]
}


@contextlib.asynccontextmanager
async def orchestrating(settings: Settings) -> AsyncIterator[None]:
    """An orchestrator for today's ring, plus any shard that still needs draining."""
    async with connected(settings, f"orchestrator-n{settings.shards}") as (store, bus):
        orchestrator = Orchestrator(
            settings, range(settings.shards), store=store, bus=bus, drain=True
        )
        running = asyncio.create_task(orchestrator.run())
        try:
            yield
        finally:
            orchestrator.shutdown()
            await running


async def submit(settings: Settings, trace: Trace, count: int, tag: str) -> list[tuple[str, int]]:
    async with connected(settings, f"router-n{settings.shards}") as (store, bus):
        router = Router(settings, store=store, bus=bus)
        submitted = [
            await router.submit(SLOW, trace.as_input(), f"{tag}-{k}") for k in range(count)
        ]
    return [(s.workflow_id, s.shard) for s in submitted]


async def test_changing_the_shard_count_loses_and_reorders_nothing(
    settings: Settings, registry: Registry, trace: Trace
) -> None:
    two, four, three = (settings.model_copy(update={"shards": n}) for n in (2, 4, 3))
    async with connected(settings, "workers") as (store, bus):
        workers = Dev(settings, registry, store=store, bus=bus, concurrency=32).workers
        running = [asyncio.create_task(worker.run()) for worker in workers]
        router = Router(settings, store=store, bus=bus)

        async with orchestrating(two):
            first = await submit(two, trace, 20, "n2")
            # The router moves to 4 before the orchestrators: shards 2 and 3 wait a moment.
            second = await submit(four, trace, 20, "n4")
        async with orchestrating(four):
            await asyncio.sleep(0.3)
        # Shard 3 leaves the ring with programs still on it: they must be drained.
        assert await store.in_flight(3) > 0
        # Now the orchestrators go first, while programs of shard 3 are still in flight.
        async with orchestrating(three):
            third = await submit(three, trace, 20, "n3")
            statuses = [await router.wait(wf, timeout_s=60) for wf, _ in [*first, *second, *third]]
            report = shards_report(three)
        for worker in workers:
            worker.shutdown()
        await asyncio.gather(*running)

    assert {shard for _, shard in first} == {0, 1}
    assert {shard for _, shard in second} == {0, 1, 2, 3}
    assert {shard for _, shard in third} == {0, 1, 2}
    for (wf, shard), status in zip([*first, *second, *third], statuses, strict=True):
        assert (status["status"], status["owner"], status["result"]) == ("completed", shard, 4), wf
    assert_leaves_in_order(trace.events(), ["0", "1", "2"])
    assert [(r["shard"], r["state"]) for r in report] == [
        (0, "ring"), (1, "ring"), (2, "ring"), (3, "removable"),
    ]  # fmt: skip
    assert all(r["in_flight"] == 0 and r["depth"] == 0 for r in report)


def shards_report(settings: Settings) -> list[dict]:
    env = {
        **os.environ,
        "SHARDFLOW_AMQP_URL": settings.amqp_url,
        "SHARDFLOW_REDIS_URL": settings.redis_url,
        "SHARDFLOW_PREFIX": settings.prefix,
        "SHARDFLOW_SHARDS": str(settings.shards),
    }
    result = subprocess.run(
        [sys.executable, "-m", "shardflow", "shards"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return [json.loads(line) for line in result.stdout.splitlines()]
