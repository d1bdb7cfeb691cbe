"""`shardflow dev`: every shard and both pools in one process, for a laptop and the demo; and
`Together`, the parts of one process run and stopped as one (also a worker of many pools)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from orchestrator.bus import POOLS, Bus
from orchestrator.owner import Orchestrator
from orchestrator.settings import Settings
from orchestrator.store import Store
from worker.pool import Worker
from worker.registry import Registry


class Together:
    """Parts (services) that run side by side: when one stops or fails, all stop."""

    def __init__(self, parts: list[Any]) -> None:
        self._parts = parts

    async def run(self) -> None:
        """Run every part; when one stops or fails, stop them all."""
        tasks = [asyncio.create_task(part.run()) for part in self._parts]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.shutdown()
            await asyncio.gather(*tasks, return_exceptions=True)
        for task in tasks:
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]

    @property
    def consuming(self) -> bool:
        return all(part.consuming for part in self._parts)

    def shutdown(self) -> None:
        for part in self._parts:
            part.shutdown()


def workers(
    settings: Settings,
    registry: Registry,
    pools: Iterable[str],
    *,
    store: Store,
    bus: Bus,
    concurrency: int | None = None,
) -> list[Worker]:
    """One worker per pool, sharing the connections (`concurrency`: each but the serial one)."""
    return [
        Worker(settings, registry, pool=pool, store=store, bus=bus, concurrency=concurrency)
        for pool in pools
    ]


class Dev(Together):
    """An orchestrator for all shards plus a serial and a parallel worker (and one for each
    named pool in `pools`), sharing connections."""

    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        *,
        store: Store,
        bus: Bus,
        concurrency: int | None = None,
        pools: Iterable[str] = (),
    ) -> None:
        self.orchestrator = Orchestrator(
            settings, range(settings.shards), store=store, bus=bus, drain=True
        )
        named = [pool for pool in dict.fromkeys(pools) if pool not in POOLS]
        self.workers = workers(
            settings, registry, [*POOLS, *named], store=store, bus=bus, concurrency=concurrency
        )
        super().__init__([self.orchestrator, *self.workers])
