"""Redis up but refusing work (full, under the noeviction the docs ask for; its disk failing;
a script running long; an ACL): no message is counted against, none is dead-lettered, no
handler runs again for a record refused, and everything goes on once Redis takes writes."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import redis
from redis._parsers.base import BaseParser

from orchestrator import delivery as policy
from orchestrator.connections import connected
from orchestrator.health import Health
from orchestrator.settings import Settings
from router.client import Router
from shardflow.dev import Dev
from tests.app import Trace
from tests.brokers import PrivateRedis
from tests.polling import until
from worker.registry import Registry

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize(
    "reply",
    [
        "OOM command not allowed when used memory > 'maxmemory'.",
        "MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist",
        "BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSCRIPT.",
        "NOREPLICAS Not enough good replicas to write.",
        "NOPERM User default has no permissions to run the 'set' command",
        "ERR The user executing the script can't run this command or subcommand script: f_1",
        "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
    ],
)
def test_redis_refusing_work_is_told_from_a_messages_fault(reply: str) -> None:
    refused = BaseParser.parse_error(reply)  # as redis-py raises it, hiredis too
    assert policy.redis_refuses(refused) or isinstance(refused, policy.UNCOUNTED)
    assert policy.waits_for_services(refused)


def test_a_redis_error_of_the_message_still_counts() -> None:
    for reply in ("ERR wrong number of arguments for 'hset' command", "WRONGTYPE Operation"):
        assert not policy.waits_for_services(BaseParser.parse_error(reply))


@pytest.fixture
def full_redis() -> Iterator[PrivateRedis]:
    server = PrivateRedis()
    server.start()
    yield server
    server.close()


async def test_a_full_redis_parks_nothing_and_runs_no_handler_twice(
    settings: Settings, registry: Registry, trace: Trace, full_redis: PrivateRedis
) -> None:
    """Counted, every message in flight was dead-lettered at the limit (here 3 tries) and its
    program stayed running for good; each try of a bag member ran its handler again."""
    ours = settings.model_copy(update={"redis_url": full_redis.url, "delivery_limit": 3})
    admin = redis.Redis(port=full_redis.port)
    shared = redis.Redis.from_url(trace.url)
    hold = f"{trace.key}:hold"
    shared.set(hold, 1)
    member = {"task": "gated", "args": {"gate": f"{trace.key}:no-gate", "hold": hold}}
    program = {"steps": [{"bag": [member, member]}, {"task": "echo"}]}
    async with connected(ours, "full-redis-test") as (store, bus):
        router = Router(ours, store=store, bus=bus, known_tasks=None)
        dev = Dev(ours, registry, store=store, bus=bus, concurrency=4)
        running = asyncio.create_task(dev.run())
        health = Health(store.client.ping, lambda: True, lambda: True)
        probing = asyncio.create_task(health.run())
        try:
            wf = (await router.submit(program, trace.as_input())).workflow_id
            await until(lambda: _events(trace), lambda e: e["starts"] == 2)
            admin.config_set("maxmemory", 1)  # full: every write refused, reads answered
            shared.delete(hold)  # the members end; their outputs cannot be recorded
            await asyncio.sleep(3)  # 3 tries would have parked them in 1.5 s
            assert any(f.startswith("redis: refuses work: ") for f in health.faults())
            assert await bus.peek_dead(10) == []
            admin.config_set("maxmemory", 0)
            status = await router.wait(wf, timeout_s=30)
            assert status["status"] == "completed", status
            assert (await _events(trace))["starts"] == 3  # each member once, then the echo
            assert await bus.peek_dead(10) == []
        finally:
            probing.cancel()
            dev.shutdown()
            await asyncio.gather(running, probing, return_exceptions=True)


async def _events(trace: Trace) -> dict[str, int]:
    return {"starts": sum(e["event"] == "start" for e in trace.events())}


def test_the_cli_says_redis_refuses_work_in_a_line(
    settings: Settings, full_redis: PrivateRedis
) -> None:
    """It printed a traceback and exited 1, as for a bug of its own."""
    from tests.test_cli import environment, shardflow

    redis.Redis(port=full_redis.port).config_set("maxmemory", 1)
    env = {**environment(settings), "SHARDFLOW_REDIS_URL": full_redis.url}
    program = '{"steps": [{"task": "echo"}]}'
    result = shardflow("submit", "-", env=env, stdin=program)
    assert result.returncode == 4, result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith("shardflow: Redis (SHARDFLOW_REDIS_URL) refuses work now ("), line
    assert "OutOfMemoryError" in line
