"""A cancel's notice reaches a worker at any moment of a task's life, also between the task's
check (is its program still at this step?) and its handler's start."""

from __future__ import annotations

import asyncio
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


async def test_a_cancel_noticed_before_a_handler_starts_stops_it_and_a_redrive_runs(
    settings: Settings, registry: Registry, cluster: Router, trace: Trace
) -> None:
    """The notice came after the check: the handler used to start and run until the worker's
    own check 10 s later. And a notice kept for a run before a redrive stops no task of the
    run after it."""
    async with connected(settings, "late-worker") as (store, bus):
        paused = _FirstReadPaused(store)
        worker = Worker(settings, registry, pool="late", store=paused, bus=bus, concurrency=2)
        running = asyncio.create_task(worker.run())
        try:
            await until(lambda: _now({"on": worker.consuming}), lambda s: s["on"])
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
        finally:
            paused.go.set()
            worker.shutdown()
            await running
    # One handler ran, the second run's: the first run's never started.
    assert [e["event"] for e in trace.events()] == ["start", "end"]
