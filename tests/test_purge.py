"""`shardflow purge` costs what it purges: a page of programs is read in one round trip, and
lua/purge.lua runs only for those the read says may go, a page of them in one pipeline (on a
Redis Cluster, one per node). On a private redis-server, whose counters are this test's own,
and once on a private 3-master cluster."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from orchestrator.keys import Keys
from orchestrator.redis_store import RedisStore
from router.retention import purge
from tests.brokers import PrivateRedis, PrivateRedisCluster

HOUR_MS = 3_600_000


@pytest.fixture
def server() -> Iterator[PrivateRedis]:
    server = PrivateRedis()
    try:
        server.start()
        yield server
    finally:
        server.close()


async def _record(
    client: Redis | RedisCluster, keys: Keys, wfs: list[str], status: str, ended_ms: int
) -> None:
    """Programs as the scripts leave them: state, plan, an output named in the registry,
    and both index entries."""
    async with client.pipeline(transaction=False) as pipe:
        for wf in wfs:
            pipe.hset(keys.state(wf), mapping={"status": status, "ended_ms": ended_ms})
            pipe.set(keys.plan(wf), "{}")
            pipe.set(keys.output(wf, "0"), "1")
            pipe.sadd(keys.registry(wf), keys.output(wf, "0"))
            pipe.zadd(keys.index_created, {wf: ended_ms - 1000})
            pipe.zadd(keys.index_ended, {wf: ended_ms})
        await pipe.execute()


async def _counters(client: Redis) -> tuple[int, int]:
    """Redis's read events (a pipeline is one, or a few when long) and EVALSHA calls so far."""
    stats = await client.info("stats")
    calls = (await client.info("commandstats")).get("cmdstat_evalsha", {}).get("calls", 0)
    return int(stats["total_reads_processed"]), int(calls)


async def test_a_purge_runs_the_script_only_for_what_it_purges_a_page_a_round_trip(
    server: PrivateRedis, prefix: str
) -> None:
    """300 programs ended 1 h ago and `purge --older-than 2h`: every one was sent to
    purge.lua, one round trip after another (301 EVALSHA); now none is, and the whole purge
    takes a few round trips. Another prefix's keys are never touched."""
    private: Redis = Redis.from_url(server.url, decode_responses=True)
    store = RedisStore(Redis.from_url(server.url, decode_responses=True), Keys(prefix))
    keys = store.keys
    ended = [f"e{i}" for i in range(300)]
    hour_ago = int(time.time() * 1000) - HOUR_MS
    await _record(private, keys, ended, "completed", hour_ago)
    await _record(private, keys, ["run"], "running", hour_ago)
    async with private.pipeline(transaction=False) as pipe:
        for i in range(1000):
            pipe.hset(f"other:{{x{i}}}:state", "status", "completed")
        await pipe.execute()
    try:
        await store.load_scripts()
        reads, evals = await _counters(private)
        counts = await purge(store, older_than_s=7200)
        assert counts == {"kept": 300, "live": 1}, counts
        now_reads, now_evals = await _counters(private)
        assert now_evals - evals == 0, "purge.lua ran for programs it keeps"
        assert now_reads - reads < 40, now_reads - reads  # was 300 and more

        counts = await purge(store)
        assert counts == {"purged": 300, "live": 1}, counts
        last_reads, last_evals = await _counters(private)
        # one EVALSHA each purged; the indexes' own script twice per page
        assert last_evals - now_evals <= 300 + 4, last_evals - now_evals
        assert last_reads - now_reads < 40, last_reads - now_reads
        assert await private.dbsize() == 1000 + 4 + 2  # the others; the live one's, its entries
        assert await private.zrange(keys.index_created, 0, -1) == ["run"]
        assert await private.zrange(keys.index_ended, 0, -1) == ["run"]

        # Scripts flushed (a Redis restarted, failed over): loaded again, and run.
        await _record(private, keys, ["late"], "cancelled", hour_ago)
        await private.script_flush()
        assert await purge(store) == {"purged": 1, "live": 1}
    finally:
        await store.close()
        await private.aclose()


async def test_a_purge_on_a_redis_cluster_sends_each_node_its_programs(prefix: str) -> None:
    """Each program's script goes to the node of its hash tag (a pipeline per node), with
    the scripts loaded on the nodes that lack them; the indexes are one key each."""
    cluster = PrivateRedisCluster()
    try:
        cluster.start()
        client = RedisCluster.from_url(cluster.url, decode_responses=True)
        keys = Keys(prefix)
        store = RedisStore(client, keys)  # scripts never loaded: each node says NOSCRIPT
        try:
            hour_ago = int(time.time() * 1000) - HOUR_MS
            ended = [f"c{i}" for i in range(60)]
            await _record(client, keys, ended, "failed", hour_ago)
            await _record(client, keys, ["run"], "running", hour_ago)
            assert await purge(store, statuses=["completed"]) == {"kept": 60, "live": 1}
            assert await purge(store, statuses=["failed"]) == {"purged": 60, "live": 1}
            left = [key async for key in client.scan_iter(match=f"{prefix}:*")]
            assert sorted(left) == sorted(
                [keys.state("run"), keys.plan("run"), keys.output("run", "0"),
                 keys.registry("run"), keys.index_created, keys.index_ended]
            )  # fmt: skip
            assert json.loads(await client.get(keys.plan("run"))) == {}
        finally:
            await store.close()
    finally:
        cluster.close()
