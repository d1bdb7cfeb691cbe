"""Waiting in tests for something to hold, with a bound."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any


async def until(
    check: Callable[[], Awaitable[dict[str, Any] | None]],
    holds: Callable[[dict[str, Any]], bool],
    timeout_s: float = 20,
) -> dict[str, Any]:
    """Call `check` until what it answers `holds`; that answer. Fails after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = await check()
        if found is not None and holds(found):
            return found
        assert time.monotonic() < deadline, f"never held: {found}"
        await asyncio.sleep(0.02)
