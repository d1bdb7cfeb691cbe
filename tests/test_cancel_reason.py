"""A cancel's reason is an operator's (or an API caller's) text: kept bounded, as a task's error
is, and logged escaped, so no reason can forge a log line."""

from __future__ import annotations

import logging

import pytest

from orchestrator.messages import MAX_ERROR
from orchestrator.redis_store import RedisStore
from orchestrator.settings import Settings
from router.client import Router
from tests.test_owner_steps import Recorder

PROGRAM = {"steps": [{"task": "echo"}]}


async def test_a_reason_over_the_error_bound_is_kept_cut(
    settings: Settings, store: RedisStore
) -> None:
    router = Router(settings, store=store, bus=Recorder())
    wf = (await router.submit(PROGRAM, None, "long-reason")).workflow_id
    status = await router.cancel(wf, "R" * 5_000_000)
    assert status["status"] == "cancelled"
    error = status["error"]
    assert len(error) <= MAX_ERROR and error == "R" * (MAX_ERROR - 20) + " ... (cut)"
    assert (await store.state(wf))["error"] == error


async def test_a_reason_with_line_breaks_and_escapes_is_logged_on_one_line(
    settings: Settings, store: RedisStore, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="orchestrator.ending")
    router = Router(settings, store=store, bus=Recorder())
    wf = (await router.submit(PROGRAM, None, "forger")).workflow_id
    reason = "ops\r\n2026-12-05 06:00:00,001 CRITICAL orchestrator.owner: forged\x1b[2J"
    status = await router.cancel(wf, reason)
    assert status["error"] == reason  # kept as given: the status is JSON
    [said] = [r.getMessage() for r in caplog.records if r.name == "orchestrator.ending"]
    assert said == f"{wf}: ended cancelled: {reason!r}"
    assert not {"\r", "\n", "\x1b"} & set(said)
