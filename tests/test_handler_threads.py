"""Plain-function handlers run in the worker's own threads: as many at once as the worker
runs tasks (asyncio's default executor ran 6 on 2 cores), and one left running after its
task ended is counted and said."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import pytest

from worker.registry import Registry
from worker.threads import HandlerThreads


async def test_as_many_plain_handlers_run_at_once_as_the_worker_runs_tasks() -> None:
    """Each handler waits for all the others at a barrier: with fewer threads than tasks, the
    barrier breaks (asyncio's default executor has min(32, CPUs + 4): 6 on a 2-core machine,
    and never 40, so the test does not depend on the machine)."""
    concurrency = 40
    together = threading.Barrier(concurrency, timeout=10)
    registry = Registry({"meet": lambda _: together.wait()})
    threads = HandlerThreads(concurrency, "test")
    try:
        ctx: Any = None
        runs = [registry.run("meet", ctx, threads) for _ in range(concurrency)]
        done = await asyncio.gather(*runs)
    finally:
        threads.shutdown()
    assert sorted(done) == list(range(concurrency))  # each thread's arrival index


async def test_a_handler_left_running_after_its_task_ended_is_counted_and_said(
    caplog: pytest.LogCaptureFixture,
) -> None:
    release = threading.Event()
    started = threading.Event()

    def stuck(_: object) -> str:
        started.set()
        release.wait(10)
        return "late"

    threads = HandlerThreads(2, "test")
    try:
        call = asyncio.ensure_future(threads.run(stuck, None))
        await asyncio.to_thread(started.wait, 5)
        with caplog.at_level(logging.WARNING, logger="worker.threads"):
            call.cancel()  # its task timed out
            with pytest.raises(asyncio.CancelledError):
                await call
        assert threads.left_behind == 1
        assert "1 such now, of 4 threads" in caplog.text
        assert await threads.run(lambda _: "ran", None) == "ran"  # the other threads serve
        release.set()
        for _ in range(100):  # the stuck one returns at last: its thread is back
            if threads.left_behind == 0:
                break
            await asyncio.sleep(0.05)
        assert threads.left_behind == 0
    finally:
        release.set()
        threads.shutdown()
