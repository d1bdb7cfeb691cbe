"""`shardflow purge`: delete ended programs now, instead of waiting for their retention."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable

from orchestrator.marks import PRUNE_PAGE, Marks
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
    marks, purged = Marks(store), []
    async for wf in store.programs():
        verdict = await store.purge(wf, ",".join(sorted(wanted)), cutoff_ms)
        counts[verdict] += 1
        if verdict == "purged":
            purged.append(wf)
        if len(purged) >= PRUNE_PAGE:  # the indexes lose what was purged, a page at a time
            await marks.forget(purged)
            purged = []
    await marks.forget(purged)
    await marks.prune_index()
    return counts
