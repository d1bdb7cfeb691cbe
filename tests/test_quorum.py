"""Quorum queues: a message that keeps failing is dead-lettered by the broker at the limit."""

import asyncio
import contextlib
import json
import subprocess
from urllib.parse import urlparse

import pytest

from orchestrator.connections import connected
from orchestrator.messages import Start, encode
from orchestrator.owner import Orchestrator
from orchestrator.redis_store import RedisStore
from orchestrator.settings import Settings
from router.client import Router
from shardflow.dev import Dev
from tests.brokers import PrivateRedis
from worker.registry import Registry

pytestmark = pytest.mark.e2e


@pytest.fixture
def queue_type() -> str:
    return "quorum"


async def test_a_message_that_always_fails_is_dead_lettered_at_the_delivery_limit(
    settings: Settings, store: RedisStore
) -> None:
    settings = settings.model_copy(update={"delivery_limit": 2})
    # A recorded program whose plan cannot be read: every delivery of its start fails.
    await store.submit("broken", "{not json", 0, "broken", "digest")
    async with connected(settings) as (_, bus):
        assert _broker_queue_type(settings, bus.names.shard_queue(0)) == "quorum"
        orchestrator = Orchestrator(settings, [0], store=store, bus=bus)
        running = asyncio.create_task(orchestrator.run())
        await bus.publish_to_shard(0, encode(Start(wf="broken")))
        parked: list = []
        for _ in range(100):
            parked = await bus.peek_dead(10)
            if parked:
                break
            await asyncio.sleep(0.1)
        orchestrator.shutdown()
        await running
    assert len(parked) == 1
    headers, body = parked[0]
    assert json.loads(body) == {"kind": "start", "wf": "broken"}
    # Counted by shardflow itself (the same limit on every queue type); the broker's own
    # x-delivery-limit stays as the backstop for a process that crashes on the message.
    assert headers["x-shardflow-reason"].startswith("failed 2 times, the limit; last:")
    assert headers["x-shardflow-from"] == bus.names.shard_queue(0)


async def test_replicas_that_start_together_all_consume_a_new_quorum_lane(
    settings: Settings,
) -> None:
    # RabbitMQ 3.10 refuses a consume on a quorum queue another client is declaring at that
    # moment, closing the connection: each of three starting together must still consume.
    async with contextlib.AsyncExitStack() as stack:
        buses = [
            (await stack.enter_async_context(connected(settings, f"replica-{n}")))[1]
            for n in range(3)
        ]
        for pool, consumers in [(f"{kind}race{n}", 1 if kind else 3) for n in range(3)
                                for kind in ("", "serial-")]:  # fmt: skip
            iterators = await asyncio.gather(*(bus.consume_pool(pool, 1) for bus in buses))
            state = await buses[0].queue_state(buses[0].names.task_queue(pool))
            # A lane's broker counts its single active consumer only.
            assert state == (0, consumers), (pool, state)
            for iterator in iterators:
                await iterator.close()


async def test_a_redis_restart_dead_letters_nothing_in_flight(
    settings: Settings, registry: Registry
) -> None:
    """A report that meets no Redis goes back to its queue uncounted, and not by a nack: a
    quorum queue counts each nack against `x-delivery-limit`, and with a limit of 2 the broker
    dead-lettered the step's report a second into the outage, the program running forever."""
    redis = PrivateRedis()
    redis.start()
    try:
        settings = settings.model_copy(update={"delivery_limit": 2, "redis_url": redis.url})
        async with connected(settings, "quorum-outage") as (store, bus):
            dev = Dev(settings, registry, store=store, bus=bus, concurrency=4)
            running = asyncio.create_task(dev.run())
            router = Router(settings, store=store, bus=bus, known_tasks=None)
            try:
                program = {"steps": [{"task": "echo", "args": {"sleep_s": 1.0}}, {"task": "echo"}]}
                wf = (await router.submit(program)).workflow_id
                await asyncio.sleep(0.3)  # its first task runs
                await asyncio.to_thread(redis.kill)
                await asyncio.sleep(4)  # the task ends; its report meets no Redis, 8 times
                await asyncio.to_thread(redis.start)  # its AOF keeps everything acknowledged
                status = await router.wait(wf, timeout_s=30)
                parked = await bus.peek_dead(5)
            finally:
                dev.shutdown()
                await running
    finally:
        redis.close()
    assert status["status"] == "completed", status
    assert parked == []


def _broker_queue_type(settings: Settings, queue: str) -> str:
    """The queue's type as the broker reports it (not as we asked for it)."""
    vhost = urlparse(settings.amqp_url).path.lstrip("/") or "/"
    listing = subprocess.run(
        ["rabbitmqctl", "-q", "list_queues", "-p", vhost, "name", "type"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    types = dict(line.split("\t")[:2] for line in listing.splitlines() if "\t" in line)
    return types[queue]
