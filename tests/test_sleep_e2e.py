"""Sleep steps on a real cluster: durable timers that hold no worker and survive restarts."""

from __future__ import annotations

import asyncio
import time

import pytest

from orchestrator.connections import connected
from orchestrator.messages import Wake, encode
from orchestrator.settings import Settings
from router.client import Router
from router.explain import explain_text
from shardflow.dev import Dev
from tests.polling import until
from worker.registry import Registry

pytestmark = pytest.mark.e2e

NAP = {"steps": [{"task": "echo", "args": {"k": 1}}, {"sleep_s": 1.0}, {"task": "echo"}]}


def _sleeping(report: dict) -> bool:
    return report["status"] == "running" and report["step"]["kind"] == "sleep"


async def test_a_sleep_waits_and_passes_its_prev_on(cluster: Router) -> None:
    wf = (await cluster.submit(NAP)).workflow_id
    report = await until(lambda: cluster.explain(wf), _sleeping)
    began = report["step"]["since_ms"]
    assert report["pool"] is None and report["waiting_for"].startswith("its timer: step 1 sleeps")
    assert "a sleep, for" in explain_text(report)
    # A wake sent early (or forged) is only a hint: the owner reads when the sleep began.
    async with connected(cluster.settings) as (_, bus):
        await bus.publish_to_shard(report["owner"], encode(Wake(wf=wf, path="1")))
    status = await cluster.wait(wf, timeout_s=30)
    assert status["status"] == "completed", status
    assert status["result"]["prev"] == {"args": {"k": 1}, "prev": None}  # step 0's output
    assert status["ended_ms"] - began >= 1000  # the sleep's whole second, however woken


async def test_a_sleep_survives_its_orchestrators_going_away(
    settings: Settings, registry: Registry
) -> None:
    async with connected(settings, "sleep-test") as (store, bus):
        router = Router(settings, store=store, bus=bus, known_tasks=None)
        first = Dev(settings, registry, store=store, bus=bus, concurrency=4)
        running = asyncio.create_task(first.run())
        wf = (await router.submit(NAP)).workflow_id
        await until(lambda: router.explain(wf), _sleeping)
        first.shutdown()
        await running
        await asyncio.sleep(1.5)  # the timer falls due while no orchestrator runs
        assert (await router.status(wf))["status"] == "running"  # type: ignore[index]
        second = Dev(settings, registry, store=store, bus=bus, concurrency=4)
        running = asyncio.create_task(second.run())
        try:
            status = await router.wait(wf, timeout_s=30)
        finally:
            second.shutdown()
            await running
    assert status["status"] == "completed", status


async def test_a_cancelled_sleep_never_wakes_its_program(cluster: Router) -> None:
    wf = (await cluster.submit(NAP)).workflow_id
    await until(lambda: cluster.explain(wf), _sleeping)
    await cluster.cancel(wf, "no longer needed")
    await asyncio.sleep(1.3)  # past the timer
    status = await cluster.status(wf)
    assert status is not None and (status["status"], status["error"]) == (
        "cancelled",
        "no longer needed",
    )


async def test_a_loop_waits_its_interval_between_iterations_and_keeps_no_old_waits(
    cluster: Router,
) -> None:
    loop = {
        "until": "iteration >= 3",
        "max_iterations": 5,
        "interval_s": 0.3,
        "steps": [{"task": "counter"}],
    }
    wf = (await cluster.submit({"steps": [loop]})).workflow_id
    report = await until(lambda: cluster.explain(wf), _sleeping)
    assert report["step"]["path"].endswith("/iter:1") and "its timer" in report["waiting_for"]
    status = await cluster.wait(wf, timeout_s=30)
    assert status["status"] == "completed", status
    assert status["ended_ms"] - status["started_ms"] >= 900  # three waits of 0.3 s
    async with connected(cluster.settings) as (store, _):
        registry = await store.client.smembers(store.keys.registry(wf))  # type: ignore[attr-defined]
        names = [key.rpartition("}:")[2] for key in registry]
    # keep_iterations=1: the loop keeps iterations 2 and 3; iteration 1's wait went with it.
    assert sorted(n for n in names if "iter:" in n) == [
        "blob:0/iter:2",
        "blob:0/iter:3",
        "out:0/iter:2/0",
        "out:0/iter:3/0",
    ]


async def test_a_wake_for_a_step_that_is_no_sleep_is_dead_lettered(cluster: Router) -> None:
    wf = (await cluster.submit({"steps": [{"task": "echo"}]})).workflow_id
    await cluster.wait(wf, timeout_s=30)
    owner = (await cluster.status(wf))["owner"]  # type: ignore[index]
    async with connected(cluster.settings) as (_, bus):
        await bus.publish_to_shard(owner, encode(Wake(wf=wf, path="0")))
        deadline = time.monotonic() + 20
        while not (parked := await bus.peek_dead(5)):
            assert time.monotonic() < deadline, "never parked"
            await asyncio.sleep(0.05)
    [(headers, _)] = parked
    assert headers["x-shardflow-reason"] == f"{wf}: step 0 is not a sleep"
