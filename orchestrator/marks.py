"""Facts written beside the transitions only so that programs can be listed and explained.

None of them decides anything: the state hash stays the truth, and readers check each mark
against it. Each is a plain Redis call outside the transitions, or a small script of its own.
The indexes are keys of their own, never in a script with a program's keys, so they work on
Redis Cluster; the per-program marks carry the program's hash tag and are named in its key
registry, written only while the program is there (lua/mark.lua), so they expire with it. On a
store without Redis (the model) marks are not kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from orchestrator.bus import ladder_ms
from orchestrator.clock import RedisClock
from orchestrator.messages import Failed, KeyLimit
from orchestrator.redis_store import RedisStore
from orchestrator.store import Store

# A process refreshes the record of a shard it owns at most this often, while messages arrive.
OWNER_REFRESH_S = 5.0
OWNER_TTL_S = 60
LANE_TTL_S = 86400  # a mark outlives its task; readers check it against the holder's cursor
# An index entry is written before its program is recorded: younger entries whose program is
# not there yet are kept, older ones are dropped (the program expired, was purged, or its
# submit died before recording it).
INDEX_GRACE_MS = 60_000
# Each sweep looks at this many of the oldest index entries, so the index of a cluster that
# nobody lists still loses the programs that retention took.
PRUNE_SCAN = 5000
# Entries checked per round trip: one pipeline of 5,000 held about 5 MB at once (its commands,
# replies and read timers: bench/prune.py), a high mark the owner's RSS kept; 500 hold 0.07x.
PRUNE_PAGE = 500
# Programs whose retention ran out a sweep drops from the indexes at most (`prune_ended`):
# 3,333 ended a second, every 30 s sweep of one process. The scan of PRUNE_SCAN alone, which
# walks over every program still kept, fell behind from 167 a second per process.
PRUNE_ENDED = 100_000


@dataclass
class Entries:
    """Index entries of programs gone or about to go: by id, the score each may have at most
    to be taken out (the entry's own, read while its program was there, or a time before its
    id could be indexed again)."""

    created: dict[str, float] = field(default_factory=dict)
    ended: dict[str, float] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.created.keys() | self.ended.keys())

    def take(self, other: Entries, wf: str) -> None:
        """Add `wf`'s entries from `other`."""
        if wf in other.created:
            self.created[wf] = other.created[wf]
        if wf in other.ended:
            self.ended[wf] = other.ended[wf]


def now_ms() -> int:
    return int(time.time() * 1000)


def redis_of(store: Store) -> Redis | RedisCluster | None:
    """The Redis client behind a store, or None for a store that is not Redis."""
    return store.client if isinstance(store, RedisStore) else None


def attempt_field(path: str, index: int | None) -> str:
    return path if index is None else f"{path}/bag:{index}"


class Marks:
    """Writes the marks; every method is a no-op on a store without Redis."""

    def __init__(self, store: Store) -> None:
        self.keys = store.keys
        self._client = redis_of(store)
        self._store = store if isinstance(store, RedisStore) else None
        self._retention_ms = getattr(store, "retention_ms", 0)
        self._owner_written: dict[int, float] = {}
        # Where the next prune goes on, by rank: live programs at the index's old end would
        # otherwise fill every scan, and nothing behind them would ever be dropped.
        self._prune_rank = 0
        self._me = f"{socket.gethostname()}/{os.getpid()}"
        # The creation index is scored, and its grace counted, on Redis's clock, as each
        # program's created_ms: a router ahead of it pinned its programs atop `list`, one
        # behind hid them from `list --since`, and a pruner ahead dropped fresh entries.
        self.clock = RedisClock(store)

    async def clock_ms(self) -> int:
        """Now in ms, on Redis's clock."""
        return int(await self.clock.now() * 1000)

    async def index(self, created: Mapping[str, int]) -> None:
        """The sweep's repair, a page of live programs by their own `created_ms`: an entry
        missing is added, and one older than that by over INDEX_GRACE_MS moved (an earlier
        program's, of an id submitted again whose router failed before `reindex`); others,
        written by the router just before the record, stay."""
        if self._store is not None and created:
            await self._store.reindex(self.keys.index_created, created, INDEX_GRACE_MS)

    async def index_new(self, wf: str, at_ms: int) -> bool:
        """Index a program about to be recorded, at `at_ms`; whether its id had an entry
        already: a duplicate submit's, or an earlier program's (expired or purged, the id
        submitted again), which `reindex` then moves once the new program is recorded."""
        if self._client is None:
            return False
        return not await self._client.zadd(self.keys.index_created, {wf: at_ms}, nx=True)

    async def reindex(self, wf: str, at_ms: int) -> None:
        """A new program of an id indexed before takes its own time in the index (see
        lua/reindex.lua): it stood at the earlier program's, and `list --since` missed it."""
        if self._store is not None:
            await self._store.reindex(self.keys.index_created, {wf: at_ms})

    async def prune_index(self, scan: int = PRUNE_SCAN, page: int = PRUNE_PAGE) -> int:
        """Drop the entries among `scan` of the creation index whose program is gone
        (expired, purged, never recorded, and older than the grace), `page` entries a round
        trip; how many. Each call goes on from where the last stopped, oldest first, and
        starts again at the oldest once it reaches entries younger than the grace (none of
        them may go yet) or the end."""
        if self._client is None or self._store is None:
            return 0
        key = self.keys.index_created
        old = await self.clock_ms() - INDEX_GRACE_MS
        seen = dropped = 0
        first = self._prune_rank
        while seen < scan:  # at most scan / page rounds: each sees at least one entry
            start = first + seen - dropped  # what was dropped before moved the rest up
            stop = start + min(page, scan - seen) - 1
            rows: list[tuple[str, float]] = await self._client.zrange(
                key, start, stop, withscores=True
            )  # type: ignore[assignment]
            if not rows:
                self._prune_rank = 0  # the end: the next call starts over
                return dropped
            async with self._client.pipeline(transaction=False) as pipe:
                for wf, _ in rows:
                    pipe.exists(self.keys.state(wf))
                found = await pipe.execute()
            gone = {
                wf: score
                for (wf, score), there in zip(rows, found, strict=True)
                if not there and score < old
            }
            if gone:  # each entry as seen: an id indexed again since keeps its new one
                dropped += await self._store.unindex(key, gone)
            seen += len(rows)
            if rows[-1][1] >= old:
                self._prune_rank = 0  # young entries from here on: the next call starts over
                return dropped
            self._prune_rank = first + seen - dropped  # kept if a later page fails
        return dropped

    async def prune_ended(self, budget: int = PRUNE_ENDED, page: int = PRUNE_PAGE) -> int:
        """Drop from the creation index, `page` a round trip and at most `budget`, the programs
        that ended a retention (and the grace) ago and whose keys are gone; how many. One
        whose keys are still there (redriven since; a retention lowered, or another process's
        longer; a clock behind) is noted again as of now, to be looked at one retention later.
        The oldest first, so several owners pruning at once do the same work, not more of it."""
        if self._client is None:
            return 0
        # Kept for good (0) writes no entry, but those of a retention before stay to walk:
        # their programs still expire by the TTL they ended with.
        due = now_ms() - max(self._retention_ms, 0) - INDEX_GRACE_MS
        seen = dropped = 0
        while seen < budget:  # at most budget / page rounds: each takes at least one entry
            wfs: list[str] = await self._client.zrangebyscore(
                self.keys.index_ended, "-inf", due, start=0, num=min(page, budget - seen)
            )  # type: ignore[assignment]
            if not wfs:
                break
            async with self._client.pipeline(transaction=False) as pipe:
                for wf in wfs:
                    pipe.pttl(self.keys.state(wf))
                ttls = await pipe.execute()
            gone = [wf for wf, ttl in zip(wfs, ttls, strict=True) if ttl == -2]
            # Entries as old as `due` at most: an id submitted again since has a newer one.
            await self.forget(Entries(dict.fromkeys(gone, due), dict.fromkeys(gone, due)))
            # Still there: looked at again once its keys expire (noted so that it is due
            # then); one with no expiry (live again, redriven), one retention on. Kept for
            # good, such an entry would be read every minute, for good: it goes.
            at = now_ms()
            ttl_of = dict(zip(wfs, ttls, strict=True))
            again = {wf: at + ttl - self._retention_ms for wf, ttl in ttl_of.items() if ttl >= 0}
            unexpiring = [wf for wf, ttl in ttl_of.items() if ttl == -1]
            if self._retention_ms > 0:
                again.update(dict.fromkeys(unexpiring, at))
            elif unexpiring:
                await self._client.zrem(self.keys.index_ended, *unexpiring)
            if again:  # XX: one a purge took out meanwhile is not put back
                await self._client.zadd(self.keys.index_ended, again, xx=True)
            seen += len(wfs)
            dropped += len(gone)
        return dropped

    async def entries(self, wfs: Sequence[str]) -> Entries:
        """These programs' entries in the creation and ended indexes, read while the programs
        are there: `forget` then takes out those entries, never a newer program's."""
        if self._client is None or not wfs:
            return Entries()
        async with self._client.pipeline(transaction=False) as pipe:  # two keys, two slots
            for wf in wfs:
                pipe.zscore(self.keys.index_created, wf)
                pipe.zscore(self.keys.index_ended, wf)
            found = await pipe.execute()
        return Entries(
            {wf: s for wf, s in zip(wfs, found[::2], strict=True) if s is not None},
            {wf: s for wf, s in zip(wfs, found[1::2], strict=True) if s is not None},
        )

    async def forget(self, entries: Entries) -> None:
        """Take programs whose keys are gone (expired, purged) out of both indexes: each entry
        only while its score is at most the one given. Removed by id alone, an id submitted
        again meanwhile lost its new program's entry."""
        if self._store is None or not entries:
            return
        await asyncio.gather(  # together: one round trip where the store pipelines
            self._store.unindex(self.keys.index_created, entries.created),
            self._store.unindex(self.keys.index_ended, entries.ended),
        )

    async def failed(self, report: Failed, delay_s: float | None) -> None:
        """A task's attempt failed; the next one is published in `delay_s` (None: none is)."""
        if self._store is None:
            return
        due_ms = None if delay_s is None else now_ms() + ladder_ms(delay_s)  # as the queue has it
        value = json.dumps({"attempt": report.attempt, "due_ms": due_ms})
        field = attempt_field(report.path, report.index)
        await self._store.mark(report.wf, self.keys.attempts(report.wf), field, value)

    async def slot_wait(
        self, wf: str, path: str, index: int | None, limit: KeyLimit, held: int
    ) -> None:
        """A task found every slot of its key held and waits (best effort, as every mark)."""
        if self._store is None:
            return
        value = {"key": limit.key, "max": limit.max, "held": held, "waits": limit.waits + 1}
        text = json.dumps({**value, "at_ms": now_ms()})
        with contextlib.suppress(RedisError, OSError):
            await self._store.mark(wf, self.keys.limit_waits(wf), attempt_field(path, index), text)

    async def slot_taken(self, wf: str, path: str, index: int | None) -> None:
        """A task that waited got its slot: no longer waiting."""
        if self._client is not None:
            with contextlib.suppress(RedisError, OSError):
                await self._client.hdel(self.keys.limit_waits(wf), attempt_field(path, index))  # type: ignore[misc]

    async def lane(
        self, wf: str, path: str, task: str, pool: str = "serial", attempt: int = 0
    ) -> None:
        """A serial lane runs this task's attempt now (best effort: a mark never stops a
        task). The attempt, not a time, tells a failed run from its retry's: the owner's
        and the worker's clocks differ."""
        if self._client is not None:
            mark = f"{wf} {path} {task} {now_ms()} {attempt}"
            with contextlib.suppress(RedisError, OSError):
                await self._client.set(self.keys.lane(pool), mark, ex=LANE_TTL_S)

    async def owner(self, shard: int) -> None:
        """This process handles the shard's messages (written at most every few seconds; best
        effort: a mark never stops a consumer)."""
        if self._client is None:
            return
        last = self._owner_written.get(shard)
        if last is not None and time.monotonic() - last < OWNER_REFRESH_S:
            return
        self._owner_written[shard] = time.monotonic()
        mark = f"{self._me} {now_ms()}"
        with contextlib.suppress(RedisError, OSError):
            await self._client.set(self.keys.shard_owner(shard), mark, ex=OWNER_TTL_S)
