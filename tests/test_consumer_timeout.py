"""RabbitMQ's consumer_timeout (30 min by default since 3.8.17) on a task held longer: the broker
closes the channel and hands the task on. On a private broker with a 1.5 s timeout: the worker
says so, naming the setting, and a lane's task is stopped, so the lane never runs two."""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections.abc import Iterator

import pytest

from orchestrator.connections import connected
from orchestrator.settings import Settings
from router.client import Router
from shardflow.dev import Dev, Together, workers
from tests.brokers import PrivateRabbit
from tests.polling import until
from worker.context import TaskContext
from worker.registry import Registry

pytestmark = pytest.mark.e2e


@pytest.fixture
def rabbit() -> Iterator[PrivateRabbit]:
    # The broker looks at unacked deliveries on each channel's tick (60 s by default).
    private = PrivateRabbit(
        conf="consumer_timeout = 1500\n", advanced="[{rabbit, [{channel_tick_interval, 300}]}].\n"
    )
    try:
        private.start()
        yield private
    finally:
        private.close()


async def test_a_task_held_past_consumer_timeout_is_named_and_a_lane_never_runs_two(
    rabbit: PrivateRabbit, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    settings = settings.model_copy(update={"amqp_url": rabbit.url, "shards": 1})
    runs: list[list[float]] = []

    async def hold(ctx: TaskContext) -> str:
        run = [time.monotonic(), math.inf]
        runs.append(run)
        try:
            await asyncio.sleep(10)
        finally:
            run[1] = time.monotonic()
        return "held"

    registry = Registry({"hold": hold})
    caplog.set_level(logging.ERROR, logger="orchestrator.consuming")
    async with (
        connected(settings, "owner") as (store, bus),
        connected(settings, "lane-a") as (store_a, bus_a),
        connected(settings, "lane-b") as (store_b, bus_b),
    ):
        [a] = workers(settings, registry, ["serial-x"], store=store_a, bus=bus_a)
        [b] = workers(settings, registry, ["serial-x"], store=store_b, bus=bus_b)
        parts = [Dev(settings, registry, store=store, bus=bus), Together([a])]
        running = [asyncio.create_task(part.run()) for part in parts]
        parts.append(Together([b]))
        try:
            await until(lambda: _now(a.consuming), bool)  # the lane's active consumer
            running.append(asyncio.create_task(parts[-1].run()))
            await until(lambda: _now(b.consuming), bool)
            program = {"steps": [{"task": "hold", "pool": "serial-x"}]}
            await Router(settings, store=store, bus=bus).submit(program)
            # Taken back from each holder in turn: two runs stopped, the third under way.
            await until(lambda: _now(len(runs)), lambda found: found >= 3, timeout_s=30)
        finally:
            for part in parts:
                part.shutdown()
            await asyncio.gather(*running)
    said = [r.getMessage() for r in caplog.records if "consumer_timeout" in r.getMessage()]
    assert said and "set consumer_timeout above the longest task timeout" in said[0], said
    ordered = sorted(runs)
    for earlier, later in itertools.pairwise(ordered):
        assert earlier[1] <= later[0] + 0.05, ordered  # stopped before the next began
        assert earlier[1] - earlier[0] < 5, ordered  # by the broker's timeout, not its 10 s


async def _now(value: object) -> object:
    return value
