"""Signal steps on a real cluster: a program waits, holding no worker, for a named signal."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio import Redis

from orchestrator.connections import connected
from orchestrator.messages import Next, Signalled, encode
from orchestrator.settings import Settings
from router.client import Router
from router.explain import explain_text
from shardflow.dev import Dev
from tests.app import Trace
from tests.polling import until
from worker.registry import Registry

pytestmark = pytest.mark.e2e

APPROVAL = {
    "steps": [
        {"task": "echo", "args": {"order": 7}},
        {"signal": "approve", "timeout_s": 60},
        {"task": "echo"},
    ]
}


def _waiting(report: dict) -> bool:
    return report["status"] == "running" and report["step"]["kind"] == "signal"


async def test_a_waiting_step_takes_the_signal_and_its_data_is_the_output(
    cluster: Router,
) -> None:
    wf = (await cluster.submit(APPROVAL)).workflow_id
    report = await until(lambda: cluster.explain(wf), _waiting)
    assert report["pool"] is None and report["step"]["signal"] == "approve"
    assert report["waiting_for"].startswith(
        f"a signal 'approve' at step 1: send it with `shardflow signal {wf} approve"
    )
    assert "it times out at" in report["waiting_for"]
    assert "a wait for signal 'approve'" in explain_text(report)
    # A forged `next` for the waiting step changes nothing: there is no output to read.
    async with connected(cluster.settings) as (_, bus):
        await bus.publish_to_shard(report["owner"], encode(Next(wf=wf, path="1", stored=True)))
        await bus.publish_to_shard(report["owner"], encode(Signalled(wf=wf, name="approve")))
    await asyncio.sleep(0.3)
    assert (await cluster.explain(wf))["step"]["kind"] == "signal"
    sent = await cluster.signal(wf, "approve", {"by": "ann"})
    assert sent == {"workflow_id": wf, "signal": "approve", "duplicate": False, "waiting": 1}
    status = await cluster.wait(wf, timeout_s=30)
    assert status["status"] == "completed", status
    assert status["result"] == {"args": {}, "prev": {"by": "ann"}}


async def test_signals_sent_early_are_kept_and_each_is_taken_once_in_order(
    cluster: Router,
) -> None:
    loop = {
        "steps": [
            {"task": "echo", "args": {"sleep_s": 0.3}},
            {
                "until": "iteration >= 2",
                "max_iterations": 5,
                "steps": [{"signal": "tick"}, {"task": "echo"}],
            },
        ]
    }
    wf = (await cluster.submit(loop)).workflow_id
    # Before the program reaches its signal step: each kept, in order; a resend of an id is
    # no second signal.
    waiting = []
    for n in (1, 2, 3):
        waiting.append((await cluster.signal(wf, "tick", n, signal_id=f"tick-{n}"))["waiting"])
    again = await cluster.signal(wf, "tick", 99, signal_id="tick-2")
    assert again["duplicate"] is True and again["waiting"] is None
    assert waiting[0] == 1
    status = await cluster.wait(wf, timeout_s=30)
    assert status["status"] == "completed", status
    assert status["result"]["prev"] == 3  # iterations took 1, 2 and 3: the last passes 3 on
    async with connected(cluster.settings) as (store, _):
        assert not await store.client.exists(store.keys.signals(wf, "tick"))  # all taken
    with pytest.raises(ValueError, match=r"has ended \(completed\): not signalled"):
        await cluster.signal(wf, "tick", 4)
    # A sender that lost the answer to a delivered signal resends it after the end: a
    # duplicate, not a refusal.
    late = await cluster.signal(wf, "tick", 3, signal_id="tick-3")
    assert late["duplicate"] is True


async def test_a_signal_that_never_comes_fails_the_step(cluster: Router) -> None:
    program = {"steps": [{"task": "echo"}, {"signal": "late", "timeout_s": 0.5}]}
    wf = (await cluster.submit(program)).workflow_id
    status = await cluster.wait(wf, timeout_s=30)
    assert status["status"] == "failed"
    assert status["error"] == "step 1: signal 'late' not received within 0.5s"


async def test_bad_signals_are_refused_naming_the_fault(cluster: Router) -> None:
    wf = (await cluster.submit(APPROVAL)).workflow_id
    with pytest.raises(ValueError, match=r"has no signal step 'reject' \(its signals: 'approve'\)"):
        await cluster.signal(wf, "reject")
    with pytest.raises(ValueError, match="is not a signal name"):
        await cluster.signal(wf, "Bad Name")
    with pytest.raises(ValueError, match=r"signal data: .* more than the limit of 65536"):
        await cluster.signal(wf, "approve", "x" * 70_000)
    with pytest.raises(ValueError, match="NaN"):
        await cluster.signal(wf, "approve", float("nan"))
    with pytest.raises(LookupError, match="no program 'nobody'"):
        await cluster.signal("nobody", "approve")
    await cluster.cancel(wf)
    with pytest.raises(ValueError, match=r"has ended \(cancelled\)"):
        await cluster.signal(wf, "approve")


async def test_a_wait_survives_its_orchestrators_going_away(
    settings: Settings, registry: Registry
) -> None:
    async with connected(settings, "signal-test") as (store, bus):
        router = Router(settings, store=store, bus=bus, known_tasks=None)
        first = Dev(settings, registry, store=store, bus=bus, concurrency=4)
        running = asyncio.create_task(first.run())
        wf = (await router.submit(APPROVAL)).workflow_id
        await until(lambda: router.explain(wf), _waiting)
        first.shutdown()
        await running
        # Sent while no orchestrator runs: kept in Redis, its message waits in the shard queue.
        await router.signal(wf, "approve", "yes")
        second = Dev(settings, registry, store=store, bus=bus, concurrency=4)
        running = asyncio.create_task(second.run())
        try:
            status = await router.wait(wf, timeout_s=30)
        finally:
            second.shutdown()
            await running
    assert status["status"] == "completed", status
    assert status["result"]["prev"] == "yes"


async def test_a_redrive_from_the_step_after_a_signal_reruns_it_with_the_signals_data(
    cluster: Router, trace: Trace, redis_url: str
) -> None:
    gate = f"{trace.key}:gate"
    program = {"steps": [{"signal": "go"}, {"task": "gated", "args": {"gate": gate}}]}
    client = Redis.from_url(redis_url)
    try:
        await client.set(gate, 1)
        wf = (await cluster.submit(program, trace.as_input())).workflow_id
        await cluster.signal(wf, "go", {"n": 7})
        assert (await cluster.wait(wf, timeout_s=30))["status"] == "failed"
        await client.delete(gate)
        await cluster.redrive(wf, "1")  # the step before it is the signal: its data is kept
        status = await cluster.wait(wf, timeout_s=30)
    finally:
        await client.aclose()
    assert status["status"] == "completed", status
    assert status["result"]["prev"] == {"n": 7}
