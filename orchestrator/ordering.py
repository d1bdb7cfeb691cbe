"""Side by side across programs, one at a time within one: how a shard owner handles the
messages its prefetch holds (docs/architecture.md, "One program's messages in order")."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


class ProgramOrder:
    """Runs each message's work as soon as the work of the same program's earlier messages
    ended. Holds one entry per program with work in hand: no more than the messages in
    hand (the consumer's prefetch)."""

    def __init__(self) -> None:
        self._last: dict[str, asyncio.Future[None]] = {}

    def __len__(self) -> int:
        return len(self._last)

    async def run(self, key: str, work: Coroutine[Any, Any, None]) -> None:
        """Await `work` after every earlier `run` of `key` ended (in the order of the calls).
        Cancelled while it waits, `work` never runs and a later `run` of `key` still waits
        for the earlier ones."""
        before = self._last.get(key)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._last[key] = done
        try:
            if before is not None:
                await asyncio.shield(before)
            await work
        finally:
            work.close()  # never awaited when cancelled while it waited: no warning
            if before is not None and not before.done():
                before.add_done_callback(lambda _: self._end(key, done))
            else:
                self._end(key, done)

    def _end(self, key: str, done: asyncio.Future[None]) -> None:
        done.set_result(None)
        if self._last.get(key) is done:
            del self._last[key]
