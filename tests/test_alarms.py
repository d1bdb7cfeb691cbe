"""A resource alarm of RabbitMQ's (memory or disk): the broker blocks every connection that
publishes until it clears. Nothing is lost or wedged; the process says it is blocked, and
opens no channel meanwhile (a channel opened while blocked could take the number of one the
broker had closed, and the broker then closed the whole connection)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from orchestrator.connections import connected
from orchestrator.health import Health
from orchestrator.settings import Settings
from router.client import Router
from shardflow.dev import Dev
from tests.brokers import PrivateRabbit
from worker.registry import Registry

pytestmark = pytest.mark.e2e


@pytest.fixture
def rabbit() -> Iterator[PrivateRabbit]:
    node = PrivateRabbit()
    node.start()
    try:
        yield node
    finally:
        node.close()


async def test_a_memory_alarm_is_told_waits_and_loses_nothing(
    settings: Settings, registry: Registry, rabbit: PrivateRabbit
) -> None:
    """Every probe was green and every queue still: an operator saw an idle system."""
    ours = settings.model_copy(update={"amqp_url": rabbit.url})
    async with connected(ours, "alarm-test") as (store, bus):
        router = Router(ours, store=store, bus=bus, known_tasks=None)
        dev = Dev(ours, registry, store=store, bus=bus, concurrency=4)
        running = asyncio.create_task(dev.run())
        health = Health(store.client.ping, lambda: bus.is_connected, lambda: True,
                        blocked=lambda: bus.publishing_blocked)  # fmt: skip
        beating = asyncio.create_task(health.run())
        try:
            first = (await router.submit({"steps": [{"task": "echo"}]})).workflow_id
            assert (await router.wait(first, timeout_s=20))["status"] == "completed"
            await asyncio.sleep(0.5)  # a heartbeat of health's
            assert not bus.publishing_blocked and health.faults() == []
            rabbit.ctl("set_vm_memory_high_watermark", "0.0000001")
            try:
                submitting = asyncio.create_task(router.submit({"steps": [{"task": "echo"}]}))
                for _ in range(50):  # blocked at its publish of the start
                    if bus.publishing_blocked:
                        break
                    await asyncio.sleep(0.1)
                await asyncio.sleep(0.5)  # a heartbeat of health's
                assert bus.publishing_blocked and not submitting.done()
                [fault] = health.faults()
                assert fault.startswith("rabbitmq: publishing blocked by the broker (a memory ")
                with pytest.raises(ConnectionError, match="blocks this connection"):
                    await asyncio.wait_for(bus._raw_channel(), 2)  # opened, it would wait
            finally:
                rabbit.ctl("set_vm_memory_high_watermark", "0.6")
            second = (await asyncio.wait_for(submitting, 30)).workflow_id
            assert (await router.wait(second, timeout_s=30))["status"] == "completed"
            await asyncio.sleep(0.5)
            assert not bus.publishing_blocked and health.faults() == []
        finally:
            beating.cancel()
            dev.shutdown()
            await asyncio.gather(running, beating, return_exceptions=True)


def test_the_cli_says_what_waits_for_a_blocked_broker_and_prints_the_id(
    settings: Settings, rabbit: PrivateRabbit, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`submit` hung for the alarm's whole length, and one interrupted meanwhile had printed
    no id though its program was recorded: a retry submitted it twice."""
    import time

    from tests.test_cli import environment, shardflow

    env = {**environment(settings), "SHARDFLOW_AMQP_URL": rabbit.url}
    program = '{"steps": [{"task": "echo"}]}'
    warm = shardflow("submit", "-", env=env, stdin=program)  # declares the topology
    assert warm.returncode == 0, warm.stderr
    rabbit.ctl("set_vm_memory_high_watermark", "0.0000001")
    try:
        began = time.monotonic()
        result = shardflow("submit", "-", env=env, stdin=program, timeout=60)
        took = time.monotonic() - began
        assert result.returncode == 0, result.stderr
        wf = result.stdout.strip()
        assert len(wf) == 32, result.stdout
        assert f"{wf} is recorded, and starts once RabbitMQ takes its start" in result.stderr
        assert "exists already" not in result.stderr  # recorded by this submit, not before
        assert took < 40, took  # 15 s for the confirm, and the rest
        status = shardflow("status", wf, env=env)
        assert '"status": "pending"' in status.stdout, status.stdout
    finally:
        rabbit.ctl("set_vm_memory_high_watermark", "0.6")
