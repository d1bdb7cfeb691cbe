"""`shardflow purge`: delete ended programs now, instead of waiting for their retention."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Iterable

from orchestrator.marks import PRUNE_PAGE, Entries, Marks
from orchestrator.store import TERMINAL, Store, purge_verdict

# Programs read, and purged, per round trip: what a purge holds at once, however many there are.
PURGE_PAGE = 500


async def purge(
    store: Store, *, statuses: Iterable[str] = TERMINAL, older_than_s: float = 0.0
) -> Counter[str]:
    """Delete every ended program with one of `statuses` that ended at least `older_than_s`
    ago; how many were purged, and how many were live, kept or already gone. A live program
    is never touched: lua/purge.lua checks its status in the same step as it deletes.

    A page of programs at a time: their status and end read together, then purge.lua, sent
    together, for those the read says may go. One that does not costs its read alone."""
    wanted = set(statuses)
    if not wanted or not wanted <= TERMINAL:
        raise ValueError(f"statuses: choose among {', '.join(sorted(TERMINAL))}")
    # On Redis's clock, which stamped each end: a CLI ahead of it purged what just ended.
    cutoff_ms = int((await store.now() - older_than_s) * 1000)
    allowed = ",".join(sorted(wanted))
    counts: Counter[str] = Counter()
    marks, purged = Marks(store), Entries()
    async for page in _pages(store.programs(), PURGE_PAGE):
        going = []
        for wf, (status, ended) in zip(page, await store.ends(page), strict=True):
            verdict = purge_verdict(status, ended, wanted, cutoff_ms)
            if verdict == "purged":
                going.append(wf)  # purge.lua decides, checking again as it deletes
            else:
                counts[verdict] += 1
        if not going:
            continue
        seen = await marks.entries(going)  # while they are there: an id indexed again later
        verdicts = await store.purge_many(going, allowed, cutoff_ms)  # keeps its new entry
        for wf, verdict in zip(going, verdicts, strict=True):
            counts[verdict] += 1
            if verdict == "purged":
                purged.take(seen, wf)
        if len(purged) >= PRUNE_PAGE:  # the indexes lose what was purged, a page at a time
            await marks.forget(purged)
            purged = Entries()
    await marks.forget(purged)
    await marks.prune_index()
    return counts


async def _pages(ids: AsyncIterator[str], size: int) -> AsyncIterator[list[str]]:
    """`ids` in lists of `size` (the last one shorter)."""
    page: list[str] = []
    async for wf in ids:
        page.append(wf)
        if len(page) >= size:
            yield page
            page = []
    if page:
        yield page
