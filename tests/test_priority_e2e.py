"""Priorities on a real cluster: a program submitted with a higher priority has its tasks run
before lower ones' waiting in the same pool; the level is checked at every door."""

from __future__ import annotations

import asyncio
import json
import uuid

import aio_pika
import pytest

from orchestrator.bus import GOING_ON, TASK_MAX_PRIORITY, Bus, task_priority
from orchestrator.connections import connected
from orchestrator.program import MAX_PRIORITY, ProgramError
from orchestrator.settings import Settings
from orchestrator.shares import share_of, share_pool
from router.client import Router
from shardflow.cli import _parser
from shardflow.dev import Together, workers
from tests.app import Trace
from tests.polling import until
from worker.registry import Registry

pytestmark = pytest.mark.e2e

# One task on a pool no other worker runs: they wait there until the test starts its worker.
PROGRAM = {"name": "prio", "steps": [{"task": "echo", "pool": "prio", "args": {"sleep_s": 0.02}}]}


async def test_higher_priority_programs_tasks_run_first_in_their_pool(
    cluster: Router, settings: Settings, registry: Registry, trace: Trace
) -> None:
    low = [(await cluster.submit(PROGRAM, trace.as_input())).workflow_id for _ in range(6)]
    high = [
        (await cluster.submit(PROGRAM, trace.as_input(), priority=3)).workflow_id for _ in range(3)
    ]
    top = (await cluster.submit(PROGRAM, trace.as_input(), priority=MAX_PRIORITY)).workflow_id
    queue = f"{settings.prefix}.tasks.{share_pool('prio', share_of(cluster.validate(PROGRAM)))}"
    assert cluster.bus is not None
    await until(lambda: cluster.bus.queue_state(queue), lambda s: s is not None and s[0] == 10)
    report = await cluster.explain(top)
    assert report is not None and report["priority"] == MAX_PRIORITY
    # One task at a time: the order they start in is the order the pool hands them out.
    async with connected(settings, "prio-worker") as (store, bus):
        service = Together(
            workers(settings, registry, ["prio"], store=store, bus=bus, concurrency=1)
        )
        running = asyncio.create_task(service.run())
        try:
            for wf in [*low, *high, top]:
                assert (await cluster.wait(wf, timeout_s=30))["status"] == "completed"
        finally:
            service.shutdown()
            await running
    starts = [
        e["wf"] for e in sorted(trace.events(), key=lambda e: e["seq"]) if e["event"] == "start"
    ]
    assert starts[0] == top, starts
    assert set(starts[1:4]) == set(high), starts
    assert set(starts[4:]) == set(low), starts


async def test_a_priority_is_refused_outside_its_levels(cluster: Router) -> None:
    for bad in (-1, MAX_PRIORITY + 1, True, 1.5, "2"):
        with pytest.raises(ProgramError, match=r"priority: .* is not a whole number 0-4"):
            await cluster.submit(PROGRAM, priority=bad)  # type: ignore[arg-type]
    with pytest.raises(SystemExit):
        _parser().parse_args(["submit", "p.json", "--priority", "5"])
    assert _parser().parse_args(["submit", "p.json", "--priority", "4"]).priority == 4


def test_task_levels_keep_the_head_start_within_a_priority() -> None:
    assert task_priority(0, going_on=False) < task_priority(0, going_on=True)
    assert task_priority(0, going_on=True) < task_priority(1, going_on=False)
    assert task_priority(MAX_PRIORITY, going_on=True) == TASK_MAX_PRIORITY
    assert task_priority(0, going_on=True) == GOING_ON


async def test_a_task_queue_an_older_version_declared_keeps_working(settings: Settings) -> None:
    # A classic queue declared with 2 priority levels, as before program priorities.
    bus = Bus(settings)
    name = bus.names.task_queue(f"old{uuid.uuid4().hex[:6]}")
    legacy = bus._queue_arguments(max_priority=GOING_ON)
    async with await aio_pika.connect(settings.amqp_url) as connection:
        channel = await connection.channel()
        await channel.declare_queue(name, durable=True, arguments=legacy)
    await bus.connect()
    try:
        pool = name.rsplit(".", 1)[1]
        await bus.publish_all(pool, [json.dumps({"hello": 1}).encode()], TASK_MAX_PRIORITY)
        assert await bus.queue_state(name) == (1, 0)
    finally:
        await bus.close()
