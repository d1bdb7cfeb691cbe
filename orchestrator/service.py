"""The orchestrator process: consumes its shard queues, one message at a time per shard."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Sequence
from typing import Any

from orchestrator.bus import Bus, Delivery, Publisher, settle
from orchestrator.lifecycle import Service, format_counts
from orchestrator.machine import PathError
from orchestrator.messages import MessageError, decode_shard_message
from orchestrator.program import ProgramError
from orchestrator.settings import Settings
from orchestrator.store import Store
from orchestrator.transitions import Plans, Transitions

log = logging.getLogger(__name__)

RETRY_PAUSE_S = 0.5


async def handle_shard_message(
    delivery: Delivery, transitions: Transitions, bus: Publisher, source: str
) -> None:
    """Apply one shard message; ack only after what it publishes is confirmed."""
    try:
        decoded = decode_shard_message(delivery.body)
        await transitions.apply(decoded, redelivered=bool(delivery.redelivered))
    except (MessageError, ProgramError, PathError) as exc:
        # Poison: retrying cannot help. Park it with the reason and go on.
        await bus.dead_letter(delivery.body, reason=str(exc), source=source)
    except Exception as exc:
        log.warning("%s: transition failed, message requeued: %r", source, exc)
        await settle(delivery, ok=False)
        await asyncio.sleep(RETRY_PAUSE_S)
        return
    await settle(delivery, ok=True)


class ShardError(ValueError):
    """Shards an orchestrator cannot own."""


class Orchestrator(Service):
    """Owns the ordering of the programs on `shards`; any replica may take a shard over."""

    name = "orchestrator"

    def __init__(
        self,
        settings: Settings,
        shards: Sequence[int],
        *,
        store: Store,
        bus: Bus,
        drain: bool = False,
    ) -> None:
        """Own `shards`; with `drain`, also every shard outside the ring that owned programs."""
        super().__init__(settings.grace_s)
        if not shards or min(shards) < 0:
            raise ValueError(f"{list(shards)}: name one or more shards, from 0")
        self.settings = settings
        self.shards = sorted(set(shards))
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
            self.shards = sorted(set(self.shards) | {shard for shard in used if shard >= ring})
        outside = [shard for shard in self.shards if shard >= ring]
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
        return [self._consume(shard) for shard in self.shards]

    async def _consume(self, shard: int) -> None:
        queue = self.bus.names.shard_queue(shard)
        iterator = self._track(await self.bus.consume_shard(shard, self.settings.prefetch))
        log.info("orchestrator: consuming %s", queue)
        async for message in iterator:
            # One message at a time, in delivery order; shielded so a stop lets it finish.
            await asyncio.shield(
                self._spawn(handle_shard_message(message, self.transitions, self.bus, queue))
            )
