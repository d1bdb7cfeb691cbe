"""`shardflow dev`: every shard and both pools in one process, for a laptop and the demo."""

from __future__ import annotations

import asyncio

from orchestrator.bus import Bus
from orchestrator.owner import Orchestrator
from orchestrator.settings import Settings
from orchestrator.store import Store
from worker.pool import Worker
from worker.registry import Registry


class Dev:
    """An orchestrator for all shards plus a serial and a parallel worker, sharing connections."""

    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        *,
        store: Store,
        bus: Bus,
        concurrency: int | None = None,
    ) -> None:
        self.orchestrator = Orchestrator(
            settings, range(settings.shards), store=store, bus=bus, drain=True
        )
        self.workers = [
            Worker(settings, registry, pool="serial", store=store, bus=bus),
            Worker(
                settings, registry, pool="parallel", store=store, bus=bus, concurrency=concurrency
            ),
        ]
        self._parts = [self.orchestrator, *self.workers]

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
