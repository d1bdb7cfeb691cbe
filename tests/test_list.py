"""`list`: programs newest first, from the creation index, filtered by their own state.

On real RabbitMQ and Redis, and once on a private Redis Cluster. No orchestrator runs unless a
test starts one, so programs stay pending where a test needs them to.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import pytest
from redis.asyncio import Redis

from orchestrator.connections import connected
from orchestrator.marks import INDEX_GRACE_MS, Marks
from orchestrator.owner import Orchestrator
from orchestrator.redis_store import RedisStore
from orchestrator.settings import Settings, redis_place
from router.client import Router
from router.listing import ListError, list_programs, parse_duration, prune_index
from router.retention import purge
from tests.brokers import PrivateRedisCluster
from tests.test_cli import environment, shardflow

ONE = {"steps": [{"task": "t"}]}


def ids(page) -> list[str]:  # type: ignore[no-untyped-def]
    return [program["workflow_id"] for program in page.programs]


async def _submit_four(router: Router) -> None:
    # Ids in the reverse of their creation order: a tie on the clock would show.
    for wf, name in [("z0", "a"), ("y1", "b"), ("x2", "a"), ("w3", "c")]:
        await router.submit({**ONE, "name": name}, None, wf)
        await asyncio.sleep(0.003)  # a new millisecond for each


async def _newest_first_filtered_and_paged(settings: Settings) -> None:
    async with connected(settings) as (store, bus):
        router = Router(settings, store=store, bus=bus)
        await _submit_four(router)
        await router.cancel("y1")
        assert ids(await router.list_programs()) == ["w3", "x2", "y1", "z0"]
        assert ids(await router.list_programs(statuses=["cancelled"])) == ["y1"]
        assert ids(await router.list_programs(name="a")) == ["x2", "z0"]
        # pending only: served from the shards' sets of live programs, same order
        live = await router.list_programs(statuses=["pending"], name="a")
        assert ids(live) == ["x2", "z0"]
        assert ids(await router.list_programs(statuses=["pending", "cancelled"], name="b")) == [
            "y1"
        ]
        since = int((await store.state("x2"))["created_ms"])
        assert ids(await router.list_programs(since_ms=since)) == ["w3", "x2"]
        pages, before = [], None
        while True:
            page = await router.list_programs(limit=3, before=before)
            pages.append(ids(page))
            if page.more is None:
                break
            before = page.more
        assert [wf for page in pages for wf in page] == ["w3", "x2", "y1", "z0"]
        assert pages[0] == ["w3", "x2", "y1"]
        live_pages = await router.list_programs(statuses=["pending"], limit=2)
        assert ids(live_pages) == ["w3", "x2"] and live_pages.more is not None
        rest = await router.list_programs(statuses=["pending"], limit=2, before=live_pages.more)
        assert ids(rest) == ["z0"] and rest.more is None


async def test_newest_first_filtered_and_paged(settings: Settings) -> None:
    await _newest_first_filtered_and_paged(settings)


async def test_a_scan_stops_at_its_bound_and_says_where_to_go_on(settings: Settings) -> None:
    async with connected(settings) as (store, bus):
        router = Router(settings, store=store, bus=bus)
        await _submit_four(router)
        page = await list_programs(settings, store, statuses=["failed"], scan=2)
        assert page.programs == [] and page.scanned == 2 and page.more is not None
        rest = await list_programs(settings, store, statuses=["failed"], before=page.more)
        assert rest.programs == [] and rest.scanned == 2 and rest.more is None


async def test_a_program_recorded_without_its_index_entry_is_listed_after_the_sweep(
    settings: Settings, store: RedisStore
) -> None:
    # The router records and indexes a program; this one is recorded as if the index write had
    # been lost (a crash, or a router from before the index): straight through the store.
    plan = json.dumps({"program": {"name": "lost", "steps": [{"task": "t"}]}, "input": None,
                       "owner": 0})  # fmt: skip
    await store.track("lost", 0)
    await store.submit("lost", plan, 0, "lost", "d")
    async with connected(settings) as (store2, bus):
        router = Router(settings, store=store2, bus=bus)
        assert "lost" not in ids(await router.list_programs())
        # the live sets serve pending and running: it is there already
        assert ids(await router.list_programs(statuses=["pending"])) == ["lost"]
        await Orchestrator(settings, [0], store=store2, bus=bus).sweep()
        assert ids(await router.list_programs()) == ["lost"]
        assert ids(await router.list_programs(name="lost", statuses=["pending"])) == ["lost"]


async def test_entries_whose_program_is_gone_are_dropped_once_old(
    settings: Settings, store: RedisStore
) -> None:
    # An entry written before a record that never came (the router died in between), or whose
    # program expired: dropped when met, but only once older than a submit can take.
    client: Redis = store.client  # type: ignore[assignment]
    now = time.time() * 1000
    key = store.keys.index_created
    await client.zadd(key, {"ghost-old": now - 2 * INDEX_GRACE_MS, "ghost-young": now})
    assert ids(await list_programs(settings, store)) == []
    assert await client.zscore(key, "ghost-old") is None
    assert await client.zscore(key, "ghost-young") is not None
    await client.zadd(key, {"ghost-older": now - 3 * INDEX_GRACE_MS})
    assert await prune_index(store) == 1
    assert await client.zrange(key, 0, -1) == ["ghost-young"]


async def test_the_index_is_pruned_a_page_at_a_time_within_its_scan(store: RedisStore) -> None:
    # Gone and kept entries interleaved, pages of 3 in a scan of 12: what one page drops moves
    # the rest up, and the next page still starts at the first entry not yet seen.
    client: Redis = store.client  # type: ignore[assignment]
    old = time.time() * 1000 - 10 * INDEX_GRACE_MS
    kept = "kggkgkkggggk"  # the 12 oldest; then 2 gone ones beyond the scan
    names = [f"{kind}{i}" for i, kind in enumerate(kept + "gg")]
    await client.zadd(store.keys.index_created, {wf: old + i for i, wf in enumerate(names)})
    for wf in names:
        if wf.startswith("k"):
            await client.hset(store.keys.state(wf), "status", "running")  # type: ignore[misc]
    assert await Marks(store).prune_index(scan=12, page=3) == kept.count("g")
    left = await client.zrange(store.keys.index_created, 0, -1)
    assert left == [wf for wf in names if wf.startswith("k")] + names[-2:]


async def test_live_programs_at_the_old_end_do_not_stop_the_prune(store: RedisStore) -> None:
    # Each scan went over the same oldest entries: with that many live programs there (long
    # sleeps, signal waits), nothing behind them was ever dropped and the index grew with
    # every program run. Each call now goes on from where the last stopped.
    client: Redis = store.client  # type: ignore[assignment]
    old = time.time() * 1000 - 10 * INDEX_GRACE_MS
    names = [f"k{i}" for i in range(6)] + [f"g{i}" for i in range(6)]
    await client.zadd(store.keys.index_created, {wf: old + i for i, wf in enumerate(names)})
    await client.zadd(store.keys.index_created, {"young": time.time() * 1000})
    for wf in names[:6]:
        await client.hset(store.keys.state(wf), "status", "running")  # type: ignore[misc]
    marks = Marks(store)
    dropped = [await marks.prune_index(scan=4, page=2) for _ in range(4)]
    assert dropped == [0, 2, 4, 0]  # k0-k3; k4, k5, g0, g1; g2-g5; then young: over again
    left = await client.zrange(store.keys.index_created, 0, -1)
    assert left == [*names[:6], "young"]
    assert await marks.prune_index(scan=4, page=2) == 0  # from the oldest again


async def test_programs_whose_retention_ran_out_leave_the_index_behind_any_number_kept(
    settings: Settings, store: RedisStore
) -> None:
    """The scan walks PRUNE_SCAN entries a sweep over every program still kept: past 167
    programs a second per process it fell behind, and the index grew for good. An ended
    program is noted by its end (`untrack`); the sweep drops it once its retention ran out,
    wherever it stands: here behind 6,000 kept programs, more than a scan reaches."""
    client: Redis = store.client  # type: ignore[assignment]
    retention_ms = store.retention_ms
    long_ago = time.time() * 1000 - retention_ms - 3 * INDEX_GRACE_MS
    kept = [f"k{i}" for i in range(6000)]
    ended = [f"e{i}" for i in range(50)]
    async with client.pipeline(transaction=False) as pipe:
        pipe.zadd(store.keys.index_created, {wf: long_ago + i for i, wf in enumerate(kept)})
        pipe.zadd(store.keys.index_created, {wf: long_ago + 6000 for wf in [*ended, "r", "n"]})
        for wf in [*kept, "r"]:
            pipe.hset(store.keys.state(wf), "status", "completed")
        await pipe.execute()
    for wf in [*ended, "r", "n"]:
        await store.untrack(wf, 0)  # each ended: noted now
    assert await client.zscore(store.keys.index_ended, "e0") is not None
    # Time passes: the ended ones' keys expire, all but "r" (redriven since) and "n" (its
    # keys purged before its retention ran out: not yet due).
    await client.zadd(store.keys.index_ended, {wf: long_ago for wf in [*ended, "r"]})
    async with connected(settings) as (store2, bus):
        await Orchestrator(settings, [0], store=store2, bus=bus).sweep()
    created = set(await client.zrange(store.keys.index_created, 0, -1))
    assert created == {*kept, "r", "n"}, "an ended program whose keys are gone is still listed"
    # "r", whose keys are still there, is looked at again one retention from now.
    assert await client.zrange(store.keys.index_ended, 0, -1) == ["n", "r"]
    assert (await client.zscore(store.keys.index_ended, "r") or 0) > long_ago + retention_ms
    assert await Marks(store).prune_ended() == 0  # nothing more is due
    # A later end (after a redrive) moves the note to its own time.
    await client.zadd(store.keys.index_ended, {"n": 1.0})
    await store.untrack("n", 0)
    assert (await client.zscore(store.keys.index_ended, "n") or 0) > long_ago


async def test_a_purge_takes_what_it_purged_out_of_the_indexes(
    settings: Settings, store: RedisStore
) -> None:
    """`shardflow purge` deletes ended programs now: their index entries go with them, not
    at some later scan that may not reach them."""
    async with connected(settings) as (store2, bus):
        router = Router(settings, store=store2, bus=bus)
        for wf in ("p0", "p1"):
            await router.submit(ONE, None, wf)
            await router.cancel(wf)
    client: Redis = store.client  # type: ignore[assignment]
    assert await client.zscore(store.keys.index_ended, "p0") is not None
    counts = await purge(store)
    assert counts["purged"] == 2
    for key in (store.keys.index_created, store.keys.index_ended):
        assert await client.zrange(key, 0, -1) == []


async def test_an_id_submitted_again_after_its_program_went_is_listed_at_its_new_time(
    settings: Settings, store: RedisStore
) -> None:
    """An id submitted again once its program expired (or was purged), before any prune
    dropped the entry: the entry kept the gone program's time (ZADD NX), and `list --since
    10m` missed the new program. A duplicate submit of a program that is there still keeps
    its entry where it is."""
    client: Redis = store.client  # type: ignore[assignment]
    key = store.keys.index_created
    async with connected(settings) as (store2, bus):
        router = Router(settings, store=store2, bus=bus)
        await router.submit(ONE, None, "again")
        hour_ago = time.time() * 1000 - 3_600_000
        await client.zadd(key, {"again": hour_ago})  # as if it was submitted an hour ago,
        await client.delete(store.keys.state("again"), store.keys.plan("again"))  # and expired
        await router.submit(ONE, None, "again")
        since = int(time.time() * 1000) - 600_000
        assert ids(await router.list_programs(since_ms=since)) == ["again"]
        score = await client.zscore(key, "again")
        await asyncio.sleep(0.003)
        await router.submit(ONE, None, "again")  # the same program: it stays where it was
        await Orchestrator(settings, [0, 1, 2, 3], store=store2, bus=bus).sweep()  # NX too
        assert await client.zscore(key, "again") == score
        # The earlier program goes between the new one's index write and its record (it
        # expires, or a purge takes it and the entry it read): the new one still gets its time.
        await router.submit(ONE, None, "racing")
        await client.zadd(key, {"racing": hour_ago})
        track = store2.track

        async def gone_meanwhile(wf: str, owner: int) -> None:
            await client.delete(store.keys.state("racing"), store.keys.plan("racing"))
            await client.zrem(key, "racing")
            await track(wf, owner)

        store2.track = gone_meanwhile  # type: ignore[method-assign]
        try:
            assert (await router.submit(ONE, None, "racing")).created
        finally:
            store2.track = track  # type: ignore[method-assign]
        assert "racing" in ids(await router.list_programs(since_ms=since))
        # The router fails between the record and the move (Redis away, the process killed):
        # the client's retry finds the program recorded, and only the sweep can mend it.
        await client.zadd(key, {"racing": hour_ago})
        await client.delete(store.keys.state("racing"), store.keys.plan("racing"))
        move = router._marks.reindex

        async def failing(wf: str, at_ms: int) -> None:
            raise ConnectionError("Redis went away")

        router._marks.reindex = failing  # type: ignore[method-assign]
        try:
            with pytest.raises(ConnectionError):
                await router.submit(ONE, None, "racing")
        finally:
            router._marks.reindex = move  # type: ignore[method-assign]
        assert not (await router.submit(ONE, None, "racing")).created  # the client's retry
        assert "racing" not in ids(await router.list_programs(since_ms=since))
        await Orchestrator(settings, [0, 1, 2, 3], store=store2, bus=bus).sweep()
        assert "racing" in ids(await router.list_programs(since_ms=since))


async def test_the_ended_prune_keeps_the_entry_of_an_id_being_submitted_again(
    store: RedisStore,
) -> None:
    """The ended prune saw a program gone and took its id out of the creation index: an id
    submitted again in between (indexed before it is recorded) lost its new entry, and its
    program was never listed. Only entries as old as the retention go now."""
    client: Redis = store.client  # type: ignore[assignment]
    long_ago = time.time() * 1000 - store.retention_ms - 3 * INDEX_GRACE_MS
    await client.zadd(store.keys.index_ended, {"back": long_ago, "gone": long_ago})
    await client.zadd(store.keys.index_created, {"gone": long_ago - 1000})
    await client.zadd(store.keys.index_created, {"back": time.time() * 1000})  # just now
    assert await Marks(store).prune_ended() == 2
    assert await client.zrange(store.keys.index_created, 0, -1) == ["back"]
    assert await client.zrange(store.keys.index_ended, 0, -1) == []


async def test_the_ended_prune_still_walks_what_a_retention_before_left_once_kept_for_good(
    settings: Settings,
) -> None:
    """Switched to SHARDFLOW_RETENTION_S=0 (keep for good), no ended program writes an entry,
    but those written under the retention before stayed in the ended index for good: the
    prune returned at once. Their programs still expire by the TTL they ended with."""
    forever = RedisStore.connect(settings.model_copy(update={"retention_s": 0}))
    try:
        client: Redis = forever.client  # type: ignore[assignment]
        long_ago = time.time() * 1000 - 3 * INDEX_GRACE_MS
        three = dict.fromkeys(("expired", "expiring", "redriven"), long_ago)
        await client.zadd(forever.keys.index_ended, three)
        await client.zadd(forever.keys.index_created, three)
        await client.hset(forever.keys.state("expiring"), "status", "completed")
        await client.pexpire(forever.keys.state("expiring"), 60_000)
        await client.hset(forever.keys.state("redriven"), "status", "running")  # no expiry
        assert await Marks(forever).prune_ended() == 1
        assert await client.zrange(forever.keys.index_created, 0, -1) == ["expiring", "redriven"]
        # The one expiring is looked at when it expires, not every minute till then; the one
        # kept for good, never again (a retention of 0 writes no entry for it).
        assert await client.zrange(forever.keys.index_ended, 0, -1) == ["expiring"]
        due = await client.zscore(forever.keys.index_ended, "expiring")
        assert time.time() * 1000 + 50_000 < due < time.time() * 1000 + 61_000
    finally:
        await forever.close()


async def test_a_purge_forgets_the_entries_it_saw_not_those_of_an_id_submitted_again(
    settings: Settings, store: RedisStore
) -> None:
    """A purge takes what it purged out of the indexes a page later: an id submitted again
    in between kept its new program, and lost its entry (a forget by id)."""
    client: Redis = store.client  # type: ignore[assignment]
    async with connected(settings) as (store2, bus):
        router = Router(settings, store=store2, bus=bus)
        await router.submit(ONE, None, "p")
        await router.cancel("p")
        marks = Marks(store)
        seen = await marks.entries(["p"])  # as purge reads them, before its script
        assert await store.purge_many(["p"], "cancelled", 2**62) == ["purged"]
        await asyncio.sleep(0.003)
        await router.submit(ONE, None, "p")  # the id again: a new program, pending
        await marks.forget(seen)
        assert ids(await router.list_programs()) == ["p"]
        assert await client.zscore(store.keys.index_ended, "p") is None  # the old end's note


def test_durations_and_bad_arguments() -> None:
    assert [parse_duration(t) for t in ("90", "90s", "15m", "2h", "7d", "500ms")] == [
        90,
        90,
        900,
        7200,
        604800,
        0.5,
    ]
    for bad in ("", "1w", "-5s", "5 minutes", "1e3"):
        with pytest.raises(ListError):
            parse_duration(bad)
    # 400 nines is float("inf"): int() of it crashed `purge --older-than` and `list --since`
    assert parse_duration("36500d") == 36500 * 86400
    for huge in ("36501d", "9" * 400, "9" * 400 + "d"):
        with pytest.raises(ListError, match="at most 36500d"):
            parse_duration(huge)


async def test_bad_filters_are_refused(settings: Settings, store: RedisStore) -> None:
    with pytest.raises(ListError, match="status 'done'"):
        await list_programs(settings, store, statuses=["done"])
    with pytest.raises(ListError, match="not a cursor"):
        await list_programs(settings, store, before="yesterday")


def test_the_list_command(settings: Settings) -> None:
    env = environment(settings)
    # Nothing at all: where it looked, since a prefix or a database left unset is the likeliest.
    empty = shardflow("list", env=env)
    assert (empty.returncode, empty.stdout.splitlines()[1:]) == (0, []), empty.stdout
    where = redis_place(Settings(redis_url=env["SHARDFLOW_REDIS_URL"]))
    prefix = env["SHARDFLOW_PREFIX"]
    assert empty.stderr == f"shardflow: note: no programs (prefix {prefix!r}, Redis {where})\n"
    assert shardflow("list", "--name", "none", env=env).stderr == ""  # filtered: no note
    for n, name in enumerate(["nightly", "hourly\x1b[31m"]):  # a name with a terminal escape
        program = json.dumps({"name": name, "steps": [{"task": "t"}]})
        done = shardflow("submit", "-", "--id", f"cli-{n}", env=env, stdin=program)
        assert done.returncode == 0, done.stderr
        time.sleep(0.003)
    table = shardflow("list", env=env)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["CREATED", "(UTC)", "ID", "NAME", "STATUS", "STEP"]
    assert [line.split()[2] for line in lines[1:]] == ["cli-1", "cli-0"]
    assert "\x1b" not in table.stdout and "hourly\\x1b[31m" in table.stdout
    found = shardflow("list", "--json", "--name", "nightly", "--since", "1h", env=env)
    rows = [json.loads(line) for line in found.stdout.splitlines()]
    assert [(r["workflow_id"], r["status"]) for r in rows] == [("cli-0", "pending")]
    paged = shardflow("list", "--json", "--limit", "1", env=env)
    assert [json.loads(line)["workflow_id"] for line in paged.stdout.splitlines()] == ["cli-1"]
    cursor = paged.stderr.strip().removeprefix("shardflow: more may match: --before ")
    rest = shardflow("list", "--json", "--before", cursor, env=env)
    assert [json.loads(line)["workflow_id"] for line in rest.stdout.splitlines()] == ["cli-0"]
    for args, error in [
        (["--status", "done"], "invalid choice: 'done'"),
        (["--since", "soon"], "a duration such as 90s"),
        (["--limit", "0"], "a number from 1 to"),
        (["--before", "nope"], "shardflow: 'nope': not a cursor"),
    ]:
        bad = shardflow("list", *args, env=env)
        assert bad.returncode == 2 and error in bad.stderr, bad.stderr


class TestOnRedisCluster:
    """The index is one key with no program's hash tag: it is only ever used alone (ZADD,
    ZREVRANGEBYSCORE, ZREM), never in a script with a program's keys, so it works on a
    Cluster; each program's state is read by its own command in a pipeline split per node."""

    @pytest.fixture
    def redis_url(self) -> Iterator[str]:
        cluster = PrivateRedisCluster()
        try:
            cluster.start()
            yield cluster.url
        finally:
            cluster.close()

    @pytest.fixture
    def redis_cluster(self) -> bool:
        return True

    async def test_newest_first_filtered_and_paged(self, settings: Settings) -> None:
        await _newest_first_filtered_and_paged(settings)
