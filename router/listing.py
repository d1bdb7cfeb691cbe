"""Finding programs: `shardflow list` and `Router.list_programs`.

Listings read each program's state hash, which is the truth, so their filters are right even
where an index lags. Two indexes say where to look: the creation index (a sorted set, one key,
written before a program is recorded and again by its owner's sweep) and the shards' sets of
live programs. The one write: an index entry whose program is gone (expired, purged, or never
recorded) is dropped when a listing meets it.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import AsyncGenerator, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from orchestrator.marks import INDEX_GRACE_MS, Marks, redis_of
from orchestrator.redis_store import RedisStore
from orchestrator.settings import Settings
from orchestrator.store import Store

STATUSES = (
    "pending",
    "running",
    "compensating",
    "completed",
    "failed",
    "cancelled",
    "compensated",
    "compensation_failed",
)
LIVE = frozenset({"pending", "running", "compensating"})
DEFAULT_LIMIT = 50
MAX_DURATION_S = 36500 * 86400.0  # a `--since` or `--older-than` of 100 years: all of them
# Index entries (or live ids) one listing reads at most, whatever its filters: a listing never
# walks millions. It says where to go on (`Page.more`) when it stopped early.
SCAN_MAX = 10_000
_BATCH = 200
# The index score is the submitting router's clock, `created_ms` is Redis': allow for skew.
_SKEW_MS = 5_000
_FIELDS = ("status", "name", "created_ms", "cursor", "ended_ms", "owner")


class ListError(ValueError):
    """A bad argument to a listing (a status, a duration, a cursor)."""


def as_int(value: Any) -> int | None:
    """A number from Redis, or None when it is missing or not a number."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


# Control and format characters (C*: C0, C1, bidi overrides and isolates, ...), and the line
# and paragraph separators a log reader or an editor breaks lines at.
_UNSAFE = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})


def clean(text: Any, limit: int = 500) -> str:
    """Text from Redis, safe to print on a terminal: control characters (C0, C1, bidi
    overrides: Unicode's C*), line and paragraph separators escaped, cut short."""
    text = str(text)
    if len(text) > limit:
        text = text[:limit] + "…"
    return "".join(repr(ch)[1:-1] if unicodedata.category(ch) in _UNSAFE else ch for ch in text)


def parse_duration(text: str) -> float:
    """`90`, `90s`, `15m`, `2h`, `7d` (or `500ms`) in seconds, at most MAX_DURATION_S."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*", text)
    if not match:
        raise ListError(f"{text!r}: a duration such as 90s, 15m, 2h or 7d")
    number, unit = float(match[1]), match[2] or "s"
    seconds = number * {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}[unit]
    if not seconds <= MAX_DURATION_S:  # 400 nines is infinite: int() of it crashed the CLI
        raise ListError(f"{clean(text, 40)!r}: a duration of at most 36500d (100 years)")
    return seconds


@dataclass(frozen=True, slots=True)
class Page:
    """Programs newest first; `more` is the cursor to pass as `before` for the next page (None:
    nothing older is left); `scanned` how many entries this call read."""

    programs: list[dict[str, Any]]
    more: str | None
    scanned: int


def _cursor(created: int, wf: str) -> str:
    return f"{created}:{wf}"


def _parse_cursor(text: str) -> tuple[int, str]:
    ms, _, wf = text.partition(":")
    if not ms.isdigit() or not wf:
        raise ListError(f"{text!r}: not a cursor from a listing (<ms>:<id>)")
    return int(ms), wf


def _row(wf: str, state: dict[str, str]) -> dict[str, Any]:
    return {
        "workflow_id": wf,
        "name": state.get("name", ""),
        "status": state.get("status", ""),
        "created_ms": as_int(state.get("created_ms")),
        "ended_ms": as_int(state.get("ended_ms")),
        "cursor": state.get("cursor") or None,
        "owner": as_int(state.get("owner")),
    }


async def _states(store: Store, ids: list[str]) -> list[dict[str, str]]:
    client = redis_of(store)
    if client is None:
        return [await store.state(wf) for wf in ids]
    async with client.pipeline(transaction=False) as pipe:
        for wf in ids:
            pipe.hmget(store.keys.state(wf), list(_FIELDS))
        rows = await pipe.execute()
    return [{k: v for k, v in zip(_FIELDS, row, strict=True) if v is not None} for row in rows]


async def list_programs(
    settings: Settings,
    store: Store,
    *,
    statuses: Iterable[str] = (),
    name: str | None = None,
    since_ms: int | None = None,
    before: str | None = None,
    limit: int = DEFAULT_LIMIT,
    scan: int = SCAN_MAX,
) -> Page:
    """Programs newest first, filtered by status (any of `statuses`), exact name, and created
    at or after `since_ms`; at most `limit`, after reading at most `scan` entries.

    Filters are applied to each program's state hash, so they are right even where an index
    lags. Only pending and running asked for: read from the shards' sets of live programs.
    Otherwise: walked from the creation index.
    """
    wanted = set(statuses)
    unknown = wanted - set(STATUSES)
    if unknown:
        raise ListError(f"status {sorted(unknown)[0]!r}: one of {', '.join(STATUSES)}")
    if limit < 1 or scan < 1:
        raise ListError("limit and scan: at least 1")
    after = _parse_cursor(before) if before else None

    def keep(state: dict[str, str]) -> bool:
        created = as_int(state.get("created_ms"))
        return (
            (not wanted or state.get("status") in wanted)
            and (name is None or state.get("name", "") == name)
            and (since_ms is None or (created is not None and created >= since_ms))
        )

    if wanted and wanted <= LIVE:
        return await _list_live(settings, store, keep, after, limit, scan)
    return await _list_index(store, keep, after, since_ms, limit, scan)


async def _list_index(
    store: Store,
    keep: Callable[[dict[str, str]], bool],
    after: tuple[int, str] | None,
    since_ms: int | None,
    limit: int,
    scan: int,
) -> Page:
    if not isinstance(store, RedisStore):
        raise ListError("listing programs needs the Redis store")
    client = store.client
    key = store.keys.index_created
    lowest = "-inf" if since_ms is None else since_ms - _SKEW_MS
    old = await store.now() * 1000 - INDEX_GRACE_MS  # on the clock that scored the entries
    found: list[dict[str, Any]] = []
    scanned = 0
    last: tuple[int, str] | None = None
    entries = _walk_index(client, key, after, lowest)
    exhausted = True
    async for batch in entries:
        states = await _states(store, [wf for wf, _ in batch])
        gone: dict[str, float] = {}
        for (wf, score), state in zip(batch, states, strict=True):
            scanned += 1
            last = (score, wf)
            if not state:
                if score < old:
                    gone[wf] = score + 1  # read whole ms: up to the next one is this entry
            elif keep(state):
                found.append(_row(wf, state))
            if len(found) >= limit or scanned >= scan:
                exhausted = False
                break
        if gone:  # each entry as read: an id submitted again since keeps its new one
            await store.unindex(key, gone)
        if not exhausted:
            await entries.aclose()
            break
    more = None if exhausted or last is None else _cursor(*last)
    return Page(found, more, scanned)


async def _walk_index(
    client: Any, key: str, after: tuple[int, str] | None, lowest: float | str
) -> AsyncGenerator[list[tuple[str, int]], None]:
    """Index entries newest first, in batches; after the cursor `after` when given."""
    top: float | str = "+inf" if after is None else after[0]
    offset = 0
    while True:
        rows = await client.zrevrangebyscore(
            key, top, lowest, start=offset, num=_BATCH, withscores=True
        )
        if not rows:
            return
        batch = [
            (wf, int(score))
            for wf, score in rows
            if after is None or int(score) < after[0] or wf < after[1]
        ]
        if batch:
            yield batch
        last = rows[-1][1]
        ties = sum(1 for _, score in rows if score == last)
        offset = offset + ties if last == top else ties
        top = last


async def _list_live(
    settings: Settings,
    store: Store,
    keep: Callable[[dict[str, str]], bool],
    after: tuple[int, str] | None,
    limit: int,
    scan: int,
) -> Page:
    ids: list[str] = []
    for shard in sorted(set(range(settings.shards)) | await store.shards_used()):
        async for wf in store.live(shard):
            if len(ids) < scan:
                ids.append(wf)
    rows = []
    for start in range(0, len(ids), _BATCH):
        chunk = ids[start : start + _BATCH]
        for wf, state in zip(chunk, await _states(store, chunk), strict=True):
            if state and keep(state):
                row = _row(wf, state)
                mark = (row["created_ms"] or 0, wf)
                if after is None or mark < after:
                    rows.append((mark, row))
    rows.sort(key=lambda item: item[0], reverse=True)
    more = _cursor(*rows[limit - 1][0]) if len(rows) > limit else None
    return Page([row for _, row in rows[:limit]], more, len(ids))


async def prune_index(store: Store, scan: int = 1000) -> int:
    """Drop the entries among the `scan` oldest of the index whose program is gone; how many.
    (Each orchestrator's sweep does it too.)"""
    return await Marks(store).prune_index(scan)


# --- status details -------------------------------------------------------------------------
