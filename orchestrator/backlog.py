"""How many task messages wait in each pool's queue, sampled now and then, and what that means
for a bag or map that names no `chunk`: one member per message while the pool keeps up (so
members spread over the workers), several per message while messages wait anyway (fewer
messages, less CPU per task, when throughput matters). The messages waiting in the owner's own
shard queues count too: they are work on its way to the pools. Without them a burst of
submits went out one member per message until it had filled a pool's queue, and so did every
bag published while that queue drained for a moment between waves (bench/README.md)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence

log = logging.getLogger(__name__)

# Ready messages in a pool's queue per extra member in each message: 0-3 waiting -> 1,
# 36 or more -> 10.
AUTO_STEP = 4
# How often a pool's depth is sampled (in the background, never on a transition's path).
SAMPLE_EVERY_S = 0.25
# A sample older than this (the broker stopped answering) counts as no backlog.
STALE_S = 5.0
# Pools remembered; names come from programs, so the table is bounded, not grown by input.
MAX_POOLS = 256
# Shard queues sampled at most (an owner of many shards sums a few: a sign of load, not a count).
MAX_UPSTREAM = 8

Sampler = Callable[[str], Awaitable[tuple[int, int] | None]]


def auto_chunk(ready: int, limit: int) -> int:
    """Members per task message for a pool with `ready` messages waiting, at most `limit`."""
    return max(1, min(limit, 1 + ready // AUTO_STEP))


class Backlog:
    """The ready messages of queues, from `sample(queue)` -> (ready, consumers): each pool's
    (`queue_of(pool)` names it) and the `upstream` ones (the owner's shard queues)."""

    def __init__(
        self,
        sample: Sampler,
        limit: int,
        *,
        queue_of: Callable[[str], str] = str,
        upstream: Sequence[str] = (),
        every_s: float = SAMPLE_EVERY_S,
    ) -> None:
        self._sample = sample
        self.limit = limit
        self._queue_of = queue_of
        self._upstream = tuple(upstream)[:MAX_UPSTREAM]
        self._every_s = every_s
        self._seen: OrderedDict[str, tuple[int, float]] = OrderedDict()  # queue -> (ready, at)
        self._sampling: dict[str, asyncio.Task[None]] = {}

    def chunk(self, pool: str) -> int:
        """Members per message for a bag or map of `pool` that names no chunk, from the last
        samples; a stale or missing sample asks for a new one (and counts as no backlog)."""
        if self.limit <= 1:
            return 1
        waiting = self.ready(pool) + sum(self._ready(queue) for queue in self._upstream)
        return auto_chunk(waiting, self.limit)

    def bundle(self, pool: str) -> int:
        """Programs' single tasks per message for `pool` (orchestrator/bundling.py): from its
        own queue's backlog only, so a pool whose workers keep up gets one task a message even
        while submits wait in the shard queues."""
        if self.limit <= 1:
            return 1
        return auto_chunk(self.ready(pool), self.limit)

    def ready(self, pool: str) -> int:
        """The last sampled ready messages of `pool`'s queue (0 when unknown or stale)."""
        return self._ready(self._queue_of(pool))

    def _ready(self, queue: str) -> int:
        ready, at = self._seen.get(queue, (0, 0.0))
        age = time.monotonic() - at
        if age >= self._every_s and queue not in self._sampling:
            self._sampling[queue] = asyncio.get_running_loop().create_task(self._refresh(queue))
        return ready if age < STALE_S else 0

    async def _refresh(self, queue: str) -> None:
        try:
            state = await self._sample(queue)
        except Exception as exc:  # a lost connection: no backlog known; try again later
            log.debug("could not sample queue %s: %s", queue, exc)
            state = None
        finally:
            self._sampling.pop(queue, None)
        self._seen[queue] = (state[0] if state else 0, time.monotonic())
        self._seen.move_to_end(queue)
        if len(self._seen) > MAX_POOLS + len(self._upstream):
            self._seen.popitem(last=False)

    async def close(self) -> None:
        """Stop any sampling under way."""
        tasks = list(self._sampling.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
