"""The loop watch names where a blocked event loop is stuck, once per stall."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from orchestrator.loopwatch import watched


def _a_handler_that_never_yields(seconds: float) -> None:
    time.sleep(seconds)  # as an `async def` calling a blocking client would


async def test_a_blocked_loop_is_logged_with_its_stack_once_and_its_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="orchestrator.loopwatch")
    async with watched("test-worker", blocked_s=0.3) as watch:
        await asyncio.sleep(0.5)  # turning: nothing to say
        assert watch.stalls == 0 and not caplog.records
        _a_handler_that_never_yields(1.2)  # 4x the threshold: still one stall
        await asyncio.sleep(0.5)  # the watch sees it turn again
        _a_handler_that_never_yields(0.6)
        await asyncio.sleep(0.5)
    assert watch.stalls == 2
    blocked = [r for r in caplog.records if r.levelno == logging.ERROR]
    turned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(blocked) == 2 and len(turned) == 2, caplog.text
    first = blocked[0].getMessage()
    assert first.startswith("test-worker: the event loop is blocked (no turn for 0.")
    assert "in _a_handler_that_never_yields" in first and "time.sleep(seconds)" in first
    assert "in test_a_blocked_loop_is_logged" in first  # its caller, up the stack
    lasted = float(turned[0].getMessage().split("after ")[1].split("s")[0])
    assert 1.0 <= lasted < 3.0, turned[0].getMessage()
