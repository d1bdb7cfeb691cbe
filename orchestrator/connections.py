"""Connections a process holds: one Redis client and one RabbitMQ connection."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from aiormq.exceptions import ChannelNotFoundEntity

from orchestrator.bus import Bus
from orchestrator.delivery import UNREACHABLE
from orchestrator.redis_store import RedisStore
from orchestrator.settings import Settings

log = logging.getLogger(__name__)


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
        pause = 0.5
        while True:
            try:
                await store.load_scripts()
                await bus.connect(declare=declare)
                break
            except (*UNREACHABLE, ChannelNotFoundEntity) as exc:
                # RabbitMQ answers a declare of a queue whose process died with NOT_FOUND "has
                # crashed and failed to restart", and restarts it soon: wait for it too.
                if not _passing(exc) or time.monotonic() + pause > deadline:
                    raise
                log.warning("%s: waiting for RabbitMQ and Redis: %s", name, exc)
                await bus.close()
                await asyncio.sleep(pause)
                pause = min(pause * 2, 5.0)
        yield store, bus
    finally:
        await bus.close()
        await store.close()


def _passing(exc: BaseException) -> bool:
    """A fault that goes away by itself: a service away, or a queue the broker restarts."""
    return not isinstance(exc, ChannelNotFoundEntity) or "has crashed" in str(exc)
