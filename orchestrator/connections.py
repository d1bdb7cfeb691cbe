"""Connections a process holds: one Redis client and one RabbitMQ connection."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from urllib.parse import unquote, urlsplit

from aiormq.exceptions import ChannelNotFoundEntity
from redis.exceptions import AuthenticationError as RedisAuthenticationError
from redis.exceptions import RedisClusterException

from orchestrator.bus import AccessRefused, Bus
from orchestrator.delivery import UNREACHABLE
from orchestrator.redis_store import RedisStore
from orchestrator.settings import Settings

log = logging.getLogger(__name__)

# How long a starting service tries again a login or a name refused (at most its startup
# wait): a command gives up at once.
ACCESS_WAIT_S = 30.0


@contextlib.asynccontextmanager
async def connected_bus(settings: Settings, name: str) -> AsyncIterator[Bus]:
    """RabbitMQ alone, declaring nothing: for a command that needs no Redis (`dead`), so it
    works while Redis is away."""
    bus = Bus(settings, name=name)
    try:
        await bus.connect(declare=False)
        yield bus
    finally:
        await bus.close()


@contextlib.asynccontextmanager
async def connected(
    settings: Settings, name: str = "shardflow", *, wait_s: float = 0.0, declare: bool = True
) -> AsyncIterator[tuple[RedisStore, Bus]]:
    """Connect to Redis and RabbitMQ, declare the topology (unless `declare` is False: a
    command that only looks), and close both on exit.

    A long-running process passes `wait_s` to wait that long for services still starting
    (or restarting); after connecting, reconnects are aio-pika's and redis-py's.
    """
    store = RedisStore.connect(settings)
    bus = Bus(settings, name=name)
    try:
        deadline = time.monotonic() + wait_s
        refused_until = time.monotonic() + min(wait_s, ACCESS_WAIT_S)
        pause = 0.5
        while True:
            service = "Redis"
            try:
                await _scripts(store, settings.redis_url)
                service = "RabbitMQ"
                await bus.connect(declare=declare)
                break
            except (*UNREACHABLE, ChannelNotFoundEntity) as exc:
                # RabbitMQ answers a declare of a queue whose process died with NOT_FOUND "has
                # crashed and failed to restart", and restarts it soon: wait for it too.
                if not _passing(exc) or time.monotonic() + pause > deadline:
                    raise
                log.warning("%s: waiting for %s: %s", name, service, exc)
            except AccessRefused as exc:
                # A user or its permissions made a moment after this pod (an operator's), an
                # LDAP backend away: a while, said as an error each time, then the one line.
                if time.monotonic() + pause > refused_until:
                    raise
                log.error("%s: %s; trying again for a while", name, exc)
            await bus.close()
            await asyncio.sleep(pause)
            pause = min(pause * 2, 5.0)
        yield store, bus
    finally:
        await bus.close()
        await store.close()


async def _scripts(store: RedisStore, url: str) -> None:
    """Load the scripts: the first command, so the one a refused login fails (AccessRefused,
    naming the user, never the password; redis-py's own words for a missing password are
    about HELLO)."""
    try:
        await store.load_scripts()
    except (RedisAuthenticationError, RedisClusterException) as exc:
        refused = refused_login(exc)
        if refused is None:
            raise
        raise redis_refusal(url, refused) from None


def refused_login(exc: BaseException) -> RedisAuthenticationError | None:
    """The refused login `exc` is, or that a Redis Cluster's error wraps (redis-py raises
    a cluster error from it when no node takes the login); None for any other fault."""
    if isinstance(exc, RedisClusterException):
        exc = exc.__cause__  # type: ignore[assignment]
    return exc if isinstance(exc, RedisAuthenticationError) else None


def redis_refusal(url: str, exc: RedisAuthenticationError) -> AccessRefused:
    """Redis refusing the URL's login, said naming the user, never the password."""
    parts = urlsplit(url)
    if not parts.password:
        return AccessRefused(
            "Redis (SHARDFLOW_REDIS_URL) asks for a password, and the URL gives none "
            "(redis://:PASSWORD@host/0, or redis://USER:PASSWORD@host/0)"
        )
    user = unquote(parts.username or "default")
    return AccessRefused(
        f"Redis (SHARDFLOW_REDIS_URL) refused user {user!r}: a wrong password, or no such "
        f"user ({exc})"
    )


def _passing(exc: BaseException) -> bool:
    """A fault that goes away by itself: a service away, or a queue the broker restarts."""
    return not isinstance(exc, ChannelNotFoundEntity) or "has crashed" in str(exc)
