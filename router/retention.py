"""`shardflow purge`: delete ended programs now, instead of waiting for their retention."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable

from orchestrator.marks import Marks
from orchestrator.store import TERMINAL, Store


async def purge(
    store: Store, *, statuses: Iterable[str] = TERMINAL, older_than_s: float = 0.0
) -> Counter[str]:
    """Delete every ended program with one of `statuses` that ended at least `older_than_s`
    ago; how many were purged, and how many were live, kept or already gone. A live program
    is never touched: lua/purge.lua checks its status in the same step as it deletes."""
    wanted = set(statuses)
    if not wanted or not wanted <= TERMINAL:
        raise ValueError(f"statuses: choose among {', '.join(sorted(TERMINAL))}")
    cutoff_ms = int((time.time() - older_than_s) * 1000)
    counts: Counter[str] = Counter()
    async for wf in store.programs():
        counts[await store.purge(wf, ",".join(sorted(wanted)), cutoff_ms)] += 1
    await Marks(store).prune_index()  # the creation index loses what was purged
    return counts
