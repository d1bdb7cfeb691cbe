"""The loop watch names where a blocked event loop is stuck, once per stall; a loop that was
idle but not let run (other threads holding the CPU) is told apart, naming no handler."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import threading
import time

import pytest

from orchestrator import loopwatch, metrics
from orchestrator.loopwatch import watched


def _a_handler_that_never_yields(seconds: float) -> None:
    time.sleep(seconds)  # as an `async def` calling a blocking client would


async def test_a_blocked_loop_is_logged_with_its_stack_once_and_its_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="orchestrator.loopwatch")
    counted = metrics.LOOP_STALLS.labels("blocked")
    before = counted._value.get()
    async with watched("test-worker", blocked_s=0.3) as watch:
        await asyncio.sleep(0.5)  # turning: nothing to say
        assert watch.stalls == 0 and not caplog.records
        _a_handler_that_never_yields(1.2)  # 4x the threshold: still one stall
        await asyncio.sleep(0.5)  # the watch sees it turn again
        _a_handler_that_never_yields(0.8)
        await asyncio.sleep(0.5)
    assert watch.stalls == 2  # (a loaded machine may also starve it now and then)
    assert counted._value.get() - before == 2  # a scrape sees it after it is over
    blocked = [r for r in caplog.records if r.levelno == logging.ERROR]
    turned = [r for r in caplog.records if "turns again" in r.getMessage()]
    assert len(blocked) == 2 and len(turned) == 2, caplog.text
    first = blocked[0].getMessage()
    assert first.startswith("test-worker: the event loop is blocked (no turn for 0.")
    assert "in _a_handler_that_never_yields" in first and "time.sleep(seconds)" in first
    assert "in test_a_blocked_loop_is_logged" in first  # its caller, up the stack
    lasted = float(turned[0].getMessage().split("at least ")[1].split("s")[0])
    assert 0.9 <= lasted <= 2.0, turned[0].getMessage()  # the 1.2 s, less a beat at most


async def test_an_idle_loop_not_let_run_is_starved_not_blocked(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop waits in select, its heartbeat late (its turns not let run: other threads held
    the GIL, or other processes the CPU): late, but no handler of its own is at fault. Its
    turns are made rare here: a thread holding the GIL instead raced the watch's own thread
    for it once let go, and the loop's turn often came first (it failed 1 run in 2 here)."""
    caplog.set_level(logging.WARNING, logger="orchestrator.loopwatch")

    async def rare_beat(self: loopwatch.LoopWatch) -> None:
        self._loop_thread = threading.get_ident()
        while True:
            self._beat = time.monotonic()
            await asyncio.sleep(1.0)  # idle in select between: the watch reads it late

    monkeypatch.setattr(loopwatch.LoopWatch, "beat", rare_beat)
    async with watched("test-worker", blocked_s=0.3) as watch:
        await asyncio.sleep(0.9)
    assert watch.stalls == 0, caplog.text
    assert watch.starved >= 1, caplog.text
    assert metrics.LOOP_STALLS.labels("starved")._value.get() >= 1
    assert "though it was idle" in caplog.text and "Traceback" not in caplog.text


async def test_a_handler_waiting_for_a_child_process_is_blocked_not_idle(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`subprocess.run` waits in a selector too: called by the handler, not by the loop."""
    caplog.set_level(logging.WARNING, logger="orchestrator.loopwatch")
    async with watched("test-worker", blocked_s=0.3) as watch:
        await asyncio.sleep(0.2)
        subprocess.run(["sleep", "1"], capture_output=True, check=True)  # noqa: ASYNC221 (the point)
        await asyncio.sleep(0.3)
    assert watch.stalls == 1, caplog.text
    [blocked] = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert "in test_a_handler_waiting_for_a_child_process" in blocked, blocked
