"""SHARDFLOW_REDIS_MAX_CONNECTIONS on a real Redis: a process opens no more connections than it
says, however many commands are in flight (each waits for one), and 0 leaves redis-py's own
unbounded pool."""

from __future__ import annotations

import asyncio
import uuid

from redis.asyncio import Redis

from orchestrator.redis_store import RedisStore
from orchestrator.settings import Settings

IN_FLIGHT = 40


async def _connections(redis_url: str, name: str) -> int:
    """Connections Redis counts for the client named `name`."""
    async with Redis.from_url(redis_url, decode_responses=True) as admin:
        clients = await admin.client_list()
    return sum(client.get("name") == name for client in clients)


async def _peak(settings: Settings, max_connections: int) -> tuple[int, list[dict[str, str]]]:
    """IN_FLIGHT state reads at once, one round trip each (no pipelining), each held by a
    slow Lua call in the same round: how many connections Redis saw for this store."""
    name = f"pool-{uuid.uuid4().hex[:8]}"
    url = settings.redis_url + ("&" if "?" in settings.redis_url else "?") + f"client_name={name}"
    store = RedisStore.connect(
        settings.model_copy(
            update={
                "redis_url": url,
                "redis_pipelining": False,
                "redis_max_connections": max_connections,
            }
        )
    )
    slow = "local t = redis.call('TIME') local e = t[1] * 1e6 + t[2] + 5000 " + (
        "repeat t = redis.call('TIME') until t[1] * 1e6 + t[2] >= e return 1"
    )
    try:

        async def read(n: int) -> dict[str, str]:
            await store.client.eval(slow, 0)  # type: ignore[misc]  # holds its connection 5 ms
            return await store.state(f"nobody-{n}")

        reads = asyncio.gather(*(read(n) for n in range(IN_FLIGHT)))
        peak = 0
        while not reads.done():
            peak = max(peak, await _connections(settings.redis_url, name))
            await asyncio.sleep(0.01)
        return peak, await reads
    finally:
        await store.close()


async def test_a_process_opens_no_more_redis_connections_than_its_bound(
    settings: Settings,
) -> None:
    peak, found = await _peak(settings, 3)
    assert found == [{}] * IN_FLIGHT  # every command answered: they waited, none failed
    assert 1 <= peak <= 3, peak


async def test_no_bound_opens_one_connection_per_command_in_flight(settings: Settings) -> None:
    peak, found = await _peak(settings, 0)
    assert found == [{}] * IN_FLIGHT
    assert peak > 3, peak  # what the bound above prevents
