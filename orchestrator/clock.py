"""Now, on Redis's clock.

Every time a program's state keeps (created, started, updated, ended) is Redis's TIME, written
by a script. A process that compares those with its own clock is off by the skew between its
node and Redis's host: on an owner two minutes ahead, a deadline of a minute failed its program
at its start, and sleeps ended early. So such a comparison takes "now" from here: this
process's clock plus its offset from Redis's, measured with TIME on first use and again once
SYNC_S old (a clock stepped meanwhile is off for at most that long).
"""

from __future__ import annotations

import time
from typing import Protocol

SYNC_S = 30.0


class Timed(Protocol):
    async def now(self) -> float:
        """Seconds since the epoch on the store's clock (Redis's TIME)."""
        ...


class RedisClock:
    """The store's clock, read once per SYNC_S: between reads, this process's clock and the
    offset measured last."""

    def __init__(self, store: Timed, sync_s: float = SYNC_S) -> None:
        self._store = store
        self._sync_s = sync_s
        self._offset = 0.0
        self._synced: float | None = None

    async def now(self) -> float:
        """Seconds since the epoch, on the store's clock."""
        if self._synced is None or time.monotonic() - self._synced >= self._sync_s:
            before = time.time()
            server = await self._store.now()
            after = time.time()
            self._offset = server - (before + after) / 2  # the read took half its trip to arrive
            self._synced = time.monotonic()
        return time.time() + self._offset
