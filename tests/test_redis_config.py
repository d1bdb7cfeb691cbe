"""A Redis configured to lose writes or evict keys is named when a service starts."""

from __future__ import annotations

import redis
from redis.asyncio import Redis

from orchestrator.keys import Keys
from orchestrator.redis_store import RedisStore
from tests.brokers import PrivateRedis


async def test_each_setting_that_can_lose_a_program_is_named() -> None:
    private = PrivateRedis()  # AOF, appendfsync always, noeviction: what shardflow needs
    private.start()
    store = RedisStore(Redis.from_url(private.url, decode_responses=True), Keys("cfg"))
    try:
        assert await store.durability_faults() == []
        with redis.Redis.from_url(private.url) as admin:  # a private instance: ours to change
            admin.config_set("appendfsync", "everysec")
            [fault] = await store.durability_faults()
            assert "appendfsync everysec" in fault and "set appendfsync always" in fault
            admin.config_set("maxmemory-policy", "allkeys-lru")
            admin.config_set("appendonly", "no")
            faults = await store.durability_faults()
        assert len(faults) == 2
        assert "appendonly no" in faults[0] and "maxmemory-policy allkeys-lru" in faults[1]
    finally:
        await store.close()
        private.close()


async def test_a_redis_that_hides_its_configuration_is_not_a_fault() -> None:
    private = PrivateRedis()
    private.start()
    store = RedisStore(Redis.from_url(private.url, decode_responses=True), Keys("cfg"))
    try:
        with redis.Redis.from_url(private.url) as admin:
            admin.config_set("appendonly", "no")  # a fault, were it readable
            # As a managed Redis: CONFIG denied to this user.
            admin.execute_command("ACL", "SETUSER", "default", "-config")
        assert await store.durability_faults() == []
    finally:
        await store.close()
        private.close()
