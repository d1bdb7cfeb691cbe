"""Timers are decided on Redis's clock, the clock of every time a program's state keeps: an
owner whose node's clock is off fires none early or late, and a program already past its
deadline when its start comes runs no step."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from orchestrator import clock
from orchestrator.connections import connected
from orchestrator.settings import Settings
from router.client import Router
from router.retention import purge
from shardflow.dev import Dev
from tests.app import Trace
from tests.polling import until
from worker.registry import Registry

pytestmark = pytest.mark.e2e


def _ahead(seconds: float) -> SimpleNamespace:
    """A `time` module whose wall clock is `seconds` ahead (its monotonic one is true)."""
    return SimpleNamespace(time=lambda: time.time() + seconds, monotonic=time.monotonic)


async def test_an_owner_whose_clock_is_ahead_fires_no_timer_early(
    cluster: Router, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two minutes ahead of Redis, the owner failed a 60 s deadline at its start and ended a
    30 s sleep after its first hop."""
    monkeypatch.setattr(clock, "time", _ahead(120))
    program = {"deadline_s": 60, "steps": [{"task": "echo"}, {"sleep_s": 30}, {"task": "echo"}]}
    wf = (await cluster.submit(program)).workflow_id
    report = await until(
        lambda: cluster.status(wf),
        lambda r: r["status"] not in ("pending", "running") or r.get("cursor") == "1",
    )
    assert report["status"] == "running", report  # sleeping
    await asyncio.sleep(2)  # a deadline or a wake on the owner's clock has come by now
    status = await cluster.status(wf)
    assert status is not None and status["status"] == "running", status
    assert status["cursor"] == "1", status
    await cluster.cancel(wf)


async def test_a_program_past_its_deadline_at_its_start_runs_no_step(
    settings: Settings, registry: Registry, trace: Trace
) -> None:
    """Submitted while no owner ran, it was started after its deadline: its first step's
    handler ran, and only then did its deadline end it."""
    async with connected(settings, "deadline-test") as (store, bus):
        router = Router(settings, store=store, bus=bus, known_tasks=None)
        program = {"deadline_s": 0.5, "steps": [{"task": "echo"}]}
        wf = (await router.submit(program, trace.as_input())).workflow_id
        await asyncio.sleep(1.0)  # past its deadline, not started: no owner runs
        dev = Dev(settings, registry, store=store, bus=bus, concurrency=4)
        running = asyncio.create_task(dev.run())
        try:
            status = await router.wait(wf, timeout_s=20)
            assert status["status"] == "failed", status
            assert status["error"] == "deadline of 0.5s exceeded", status
            await asyncio.sleep(0.3)  # a task sent would have started by now
            assert trace.events() == []
        finally:
            dev.shutdown()
            await running


async def test_a_router_and_a_purge_ahead_of_redis_keep_to_redis_s_clock(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A router ten minutes ahead pinned its program atop `list` above newer ones, and a
    `purge --older-than 10m` run from a terminal fifteen minutes ahead deleted what had just
    ended (the guard the help recommends, gone)."""
    real = time.time
    async with connected(settings, "clock-test") as (store, bus):
        with monkeypatch.context() as skewed:
            skewed.setattr(time, "time", lambda: real() + 600)
            ahead = Router(settings, store=store, bus=bus, known_tasks=None)
            await ahead.submit({"steps": [{"task": "echo"}]}, None, "from-ahead")
            await ahead.cancel("from-ahead")  # ended just now, by Redis's clock
        await asyncio.sleep(0.01)
        router = Router(settings, store=store, bus=bus, known_tasks=None)
        await router.submit({"steps": [{"task": "echo"}]}, None, "on-time")
        listed = await router.list_programs()
        assert [row["workflow_id"] for row in listed.programs] == ["on-time", "from-ahead"]
        with monkeypatch.context() as skewed:
            skewed.setattr(time, "time", lambda: real() + 900)
            counts = await purge(store, older_than_s=600)
        assert counts["purged"] == 0 and counts["kept"] == 1, counts
        assert (await store.state("from-ahead"))["status"] == "cancelled"
