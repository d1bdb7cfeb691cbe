"""Connections a process holds: one Redis client and one RabbitMQ connection."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from orchestrator.bus import Bus
from orchestrator.settings import Settings
from orchestrator.store import Store


@contextlib.asynccontextmanager
async def connected(
    settings: Settings, name: str = "shardflow"
) -> AsyncIterator[tuple[Store, Bus]]:
    """Connect to Redis and RabbitMQ, declare the topology, and close both on exit."""
    store = Store.connect(settings)
    bus = Bus(settings, name=name)
    try:
        await store.load_scripts()
        await bus.connect()
        yield store, bus
    finally:
        await bus.close()
        await store.close()
