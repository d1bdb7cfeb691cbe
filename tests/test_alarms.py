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
