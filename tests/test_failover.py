"""Standby failover: two orchestrator processes own the same shards; killing the active one
(kill -9, then SIGTERM) hands the shards to the other with nothing lost or reordered.

The takeover time (from the kill to the next transition on that shard) is printed, not asserted.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.connections import connected
from orchestrator.settings import Settings
from orchestrator.store import TERMINAL
from router.client import Router
from shardflow.dev import Dev
from tests.app import Trace
from tests.ordering import assert_leaves_in_order
from worker.registry import Registry

pytestmark = pytest.mark.fault

ROOT = Path(__file__).parent.parent
PROGRAM = {
    "steps": [
        {"task": "add", "args": {"n": 1}},
        {"bag": [{"task": "add", "args": {"n": i, "sleep_s": 0.02}} for i in range(3)]},
        {"task": "add", "pool": "parallel", "args": {"n": 0}},
    ]
}


def orchestrator(settings: Settings, log: Path) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "SHARDFLOW_AMQP_URL": settings.amqp_url,
        "SHARDFLOW_REDIS_URL": settings.redis_url,
        "SHARDFLOW_PREFIX": settings.prefix,
        "SHARDFLOW_SHARDS": str(settings.shards),
    }
    before = log.read_text().count("orchestrator: consuming") if log.exists() else 0
    with log.open("ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "shardflow", "orchestrator", "--shards", "0,1"],
            cwd=ROOT, env=env, stdout=out, stderr=out,
        )  # fmt: skip
    deadline = time.monotonic() + 30
    while log.read_text().count("orchestrator: consuming") < before + 2:
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    return process


async def test_the_standby_takes_over_with_nothing_lost(
    settings: Settings, registry: Registry, trace: Trace, tmp_path: Path
) -> None:
    settings = settings.model_copy(update={"shards": 2})
    first = orchestrator(settings, tmp_path / "first.log")  # active: it consumed first
    second = orchestrator(settings, tmp_path / "second.log")  # standby
    submitted: list[str] = []
    kills: list[tuple[str, float]] = []
    async with connected(settings) as (store, bus):
        workers = Dev(settings, registry, store=store, bus=bus).workers
        running = [asyncio.create_task(worker.run()) for worker in workers]
        router = Router(settings, store=store, bus=bus)

        async def submit_for(seconds: float) -> None:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                submitted.append((await router.submit(PROGRAM, trace.as_input())).workflow_id)
                await asyncio.sleep(0.02)

        await submit_for(1.5)
        kills.append(("kill -9", time.time() * 1000))
        first.send_signal(signal.SIGKILL)
        first.wait()
        await submit_for(1.5)
        first = orchestrator(settings, tmp_path / "first.log")  # back, now the standby
        kills.append(("SIGTERM", time.time() * 1000))
        second.send_signal(signal.SIGTERM)
        await submit_for(1.5)
        statuses = [await router.wait(wf, timeout_s=60) for wf in submitted]
        for worker in workers:
            worker.shutdown()
        await asyncio.gather(*running)
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=30) == 0 and second.wait(timeout=30) == 0

    assert [s["status"] for s in statuses] == ["completed"] * len(submitted)
    assert all(s["result"] == 6 for s in statuses)  # 1, then [1, 2, 3], then their sum
    assert_leaves_in_order(trace.events(), ["0", "1", "2"])
    for how, at in kills:
        for shard in (0, 1):
            moments = [
                s[key] for s in statuses if s["owner"] == shard
                for key in ("started_ms", "ended_ms") if s[key] and s[key] > at
            ]  # fmt: skip
            print(f"\nfailover: {how} of the active orchestrator: shard {shard} moved on "
                  f"{min(moments) - at:.0f} ms later")  # fmt: skip
    assert all(s["status"] in TERMINAL for s in statuses)
