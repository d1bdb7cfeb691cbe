"""Automatic pipelining on a real Redis: each caller gets its own reply, its own error, and
the commands of one loop turn share one pipeline."""

import asyncio
import socket
import uuid
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from orchestrator.pipelining import Pipeliner
from orchestrator.redis_store import RedisStore
from orchestrator.settings import Settings


@pytest.fixture
async def client(keyspace: tuple[str, str]) -> AsyncIterator[Redis]:
    redis_url, _ = keyspace
    client = Redis.from_url(redis_url, decode_responses=True)
    yield client
    await client.aclose()


async def test_commands_of_one_turn_share_a_pipeline_and_each_gets_its_reply(
    client: Redis, prefix: str
) -> None:
    pipeliner = Pipeliner(client)
    replies = await asyncio.gather(
        *(pipeliner.execute("SET", f"{prefix}:k{i}", str(i), "GET") for i in range(50))
    )
    assert replies == [None] * 50  # SET ... GET: the old value, none yet
    found = await asyncio.gather(*(pipeliner.execute("GET", f"{prefix}:k{i}") for i in range(50)))
    assert found == [str(i) for i in range(50)]
    # Each turn's 50 together, its first too.
    assert (pipeliner.sent, pipeliner.commands) == (2, 100)


async def test_a_batch_is_cut_at_its_bound(client: Redis, prefix: str) -> None:
    pipeliner = Pipeliner(client, max_batch=7)
    found = await asyncio.gather(*(pipeliner.execute("INCR", f"{prefix}:n") for _ in range(20)))
    assert sorted(found) == list(range(1, 21))
    # In three pipelines (7, 7, 6), one after another, in order.
    assert found == sorted(found)
    assert pipeliner.sent == 3


async def test_one_commands_error_is_only_its_callers(client: Redis, prefix: str) -> None:
    pipeliner = Pipeliner(client)
    await client.set(f"{prefix}:text", "not a number")
    outcomes = await asyncio.gather(
        pipeliner.execute("INCR", f"{prefix}:n"),
        pipeliner.execute("INCR", f"{prefix}:text"),
        pipeliner.execute("INCR", f"{prefix}:n"),
        return_exceptions=True,
    )
    assert outcomes[0] == 1 and outcomes[2] == 2
    assert isinstance(outcomes[1], ResponseError) and "not an integer" in str(outcomes[1])


async def test_a_script_never_loaded_is_loaded_once_and_run(client: Redis, prefix: str) -> None:
    # A body of its own: no other test or process has loaded it (no SCRIPT FLUSH on a shared Redis).
    script = client.register_script(
        f"-- {uuid.uuid4().hex}\nreturn redis.call('INCRBY', KEYS[1], ARGV[1])"
    )
    pipeliner = Pipeliner(client)
    calls = [pipeliner.script(script, [f"{prefix}:s"], [5]) for _ in range(3)]
    found = await asyncio.gather(*calls)
    assert sorted(found) == [5, 10, 15]
    assert await client.script_exists(script.sha) == [True]


async def test_a_cancelled_caller_leaves_the_others_their_replies(
    client: Redis, prefix: str
) -> None:
    pipeliner = Pipeliner(client)
    first = asyncio.ensure_future(pipeliner.execute("INCR", f"{prefix}:n"))
    second = asyncio.ensure_future(pipeliner.execute("INCR", f"{prefix}:n"))
    await asyncio.sleep(0)
    first.cancel()
    assert await second in (1, 2)
    assert first.cancelled()
    # The cancelled command may still have run (as a cancelled plain call may): never more.
    assert int(await client.get(f"{prefix}:n") or 0) in (1, 2)


async def test_an_unreachable_redis_fails_every_caller_and_wedges_none() -> None:
    with socket.socket() as probe:  # a loopback port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dead = Redis(host="127.0.0.1", port=port, socket_connect_timeout=1)
    pipeliner = Pipeliner(dead)
    try:
        outcomes = await asyncio.wait_for(
            asyncio.gather(*(pipeliner.execute("PING") for _ in range(5)), return_exceptions=True),
            10,
        )
    finally:
        await dead.aclose()
    assert all(isinstance(outcome, RedisConnectionError) for outcome in outcomes), outcomes
    assert not pipeliner._pending


async def test_a_stopped_pipeline_fails_its_callers_instead_of_leaving_them_waiting(
    client: Redis, prefix: str
) -> None:
    pipeliner = Pipeliner(client, max_batch=2)
    calls = [asyncio.ensure_future(pipeliner.execute("INCR", f"{prefix}:n")) for _ in range(6)]
    await asyncio.sleep(0)  # the flush is scheduled
    await asyncio.sleep(0)  # and started
    for flush in list(pipeliner._flushes):
        flush.cancel()
    outcomes = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 10)
    assert all(isinstance(outcome, RedisConnectionError) for outcome in outcomes), outcomes


async def test_the_store_pipelines_unless_told_not_to(settings: Settings) -> None:
    on = RedisStore.connect(settings)
    off = RedisStore.connect(settings.model_copy(update={"redis_pipelining": False}))
    try:
        assert on.pipeliner is not None and off.pipeliner is None
        for store in (on, off):  # the same transition either way
            found = await store.submit("wf-1", '{"program": {}}', 1, "demo", "d")
            assert found.created is (store is on) and found.status == "pending"
            assert (await store.state("wf-1"))["status"] == "pending"
        assert on.pipeliner.commands >= 2
    finally:
        await on.close()
        await off.close()
