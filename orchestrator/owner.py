"""The shard owner: the orchestrator process that consumes its shards' queues, one message at a
time per shard, and so owns the ordering of their programs."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Sequence
from typing import Any

from orchestrator.bus import Bus, Publisher
from orchestrator.delivery import Delivery, process
from orchestrator.lifecycle import Service, format_counts
from orchestrator.machine import PathError
from orchestrator.messages import decode_shard_message
from orchestrator.program import ProgramError
from orchestrator.settings import Settings
from orchestrator.store import Store
from orchestrator.transitions import Plans, Transitions

log = logging.getLogger(__name__)

# Retrying cannot help these (nor a MessageError): the plan or the path a message names is bad.
SHARD_POISON = (ProgramError, PathError)


async def handle_shard_message(
    delivery: Delivery, transitions: Transitions, bus: Publisher, source: str
) -> None:
    """Apply one shard message; ack only after what it publishes is confirmed."""
    async with process(delivery, bus, source, poison=SHARD_POISON):
        decoded = decode_shard_message(delivery.body)
        await transitions.apply(decoded, redelivered=bool(delivery.redelivered))


class ShardError(ValueError):
    """Shards an orchestrator cannot own."""


class Orchestrator(Service):
    """Owns the ordering of the programs on the shards it consumes; any replica may take over."""

    name = "orchestrator"

    def __init__(
        self,
        settings: Settings,
        owned: Sequence[int],
        *,
        store: Store,
        bus: Bus,
        drain: bool = False,
    ) -> None:
        """Consume the shards in `owned`; with `drain`, also every shard outside the ring
        (0..settings.shards-1) that owned programs."""
        super().__init__(settings.grace_s)
        if not owned or min(owned) < 0:
            raise ValueError(f"{list(owned)}: name one or more shards, from 0")
        self.settings = settings
        self.owned = sorted(set(owned))
        self.store = store
        self.bus = bus
        self.drain = drain
        self.transitions = Transitions(store, bus, Plans(store, settings.plan_cache_size))

    def summary(self) -> str:
        return format_counts(self.transitions.counts)

    async def _start(self) -> list[Coroutine[Any, Any, None]]:
        ring = self.settings.shards
        if self.drain:
            used = await self.store.shards_used()
            self.owned = sorted(set(self.owned) | {shard for shard in used if shard >= ring})
        outside = [shard for shard in self.owned if shard >= ring]
        if outside:
            # After the shard count went down, old shards are drained, never invented.
            used = await self.store.shards_used()
            unknown = [shard for shard in outside if shard not in used]
            if unknown:
                raise ShardError(
                    f"shards {unknown} are outside the ring 0..{ring - 1} "
                    f"(SHARDFLOW_SHARDS={ring}) and never owned a program"
                )
            log.info("orchestrator: draining shards %s, outside the ring 0..%d", outside, ring - 1)
        return [self._consume(shard) for shard in self.owned]

    async def _consume(self, shard: int) -> None:
        queue = self.bus.names.shard_queue(shard)
        iterator = self._track(await self.bus.consume_shard(shard, self.settings.prefetch))
        log.info("orchestrator: consuming %s", queue)
        async for message in iterator:
            # One message at a time, in delivery order; shielded so a stop lets it finish.
            await asyncio.shield(
                self._spawn(handle_shard_message(message, self.transitions, self.bus, queue))
            )
