"""A cancel's notice reaches a worker at any moment of a task's life, also between the task's
check (is its program still at this step?) and its handler's start."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from orchestrator.connections import connected
from orchestrator.settings import Settings
from router.client import Router
from tests.app import Trace
from tests.polling import until
from worker.pool import Worker
from worker.registry import Registry

BIG = "x" * 70_000  # an input past 64 KiB travels by reference: the worker reads it first


class _FirstReadPaused:
    """A store whose first read of a task's input waits for the test: the window between the
    task's check and its handler's start, held open."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.reading = asyncio.Event()
        self.go = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def blobs(self, wf: str, names: list[str]) -> list[str | None]:
        if names and not self.reading.is_set():
            self.reading.set()
            await self.go.wait()
        found: list[str | None] = await self._store.blobs(wf, names)
        return found


async def _now(value: Any) -> Any:
    return value


@contextlib.asynccontextmanager
async def _late_worker(
    settings: Settings, registry: Registry
) -> AsyncIterator[tuple[Worker, _FirstReadPaused]]:
    """A worker of the pool `late` whose first read of a task's input waits for the test."""
    async with connected(settings, "late-worker") as (store, bus):
        paused = _FirstReadPaused(store)
        worker = Worker(settings, registry, pool="late", store=paused, bus=bus, concurrency=2)
        running = asyncio.create_task(worker.run())
        try:
            await until(lambda: _now({"on": worker.consuming}), lambda s: s["on"])
            yield worker, paused
        finally:
            paused.go.set()
            worker.shutdown()
            await running


async def test_a_cancel_noticed_before_a_handler_starts_stops_it_and_a_redrive_runs(
    settings: Settings, registry: Registry, cluster: Router, trace: Trace
) -> None:
    """The notice came after the check: the handler used to start and run until the worker's
    own check 10 s later. And a notice kept for a run before a redrive stops no task of the
    run after it."""
    async with _late_worker(settings, registry) as (worker, paused):
        program = {"steps": [{"task": "echo", "pool": "late", "args": {"sleep_s": 0.2}}]}
        wf = (await cluster.submit(program, trace.as_input(big=BIG))).workflow_id
        await asyncio.wait_for(paused.reading.wait(), 10)  # checked; its input read next
        assert (await cluster.cancel(wf))["status"] == "cancelled"
        # The notice reached the worker while the first run's message is in hand.
        await until(lambda: _now({"noticed": wf in worker._ended}), lambda s: s["noticed"])
        await cluster.redrive(wf)
        # The second run's task completes beside the first run's, still in hand.
        status = await cluster.wait(wf, timeout_s=10)
        assert status["status"] == "completed", status
        paused.go.set()
        await until(lambda: _now(dict(worker.counts)), lambda c: c.get("cancelled") == 1)
    # One handler ran, the second run's: the first run's never started.
    assert [e["event"] for e in trace.events()] == ["start", "end"]


async def test_a_notice_that_finds_its_program_compensating_lets_a_compensation_start(
    settings: Settings, registry: Registry, cluster: Router, trace: Trace
) -> None:
    """A cancel of a compensating program (without stopping its compensations) is told to
    the workers too: a compensation checked but not started yet still runs."""
    async with _late_worker(settings, registry) as (worker, paused):
        undo = {"task": "echo", "pool": "late"}
        program = {"steps": [{"task": "echo", "compensate": undo}, {"task": "boom"}]}
        wf = (await cluster.submit(program, trace.as_input(big=BIG))).workflow_id
        await asyncio.wait_for(paused.reading.wait(), 10)  # the compensation, checked
        assert (await cluster.cancel(wf))["status"] == "compensating"
        await until(lambda: _now({"noticed": wf in worker._ended}), lambda s: s["noticed"])
        paused.go.set()
        status = await cluster.wait(wf, timeout_s=10)
        assert status["status"] == "compensated", status
    events = [(e["path"], e["event"]) for e in trace.events() if e["path"] != "1"]  # boom's
    assert events == [("0", "start"), ("0", "end"), ("saga:0", "start"), ("saga:0", "end")]
