"""The owner's sweep reads a bounded number of live programs each time, going on where the
last one stopped: its cost is a constant, and every program is still seen
(orchestrator/owner.py)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from orchestrator import owner as owner_module
from orchestrator.connections import connected
from orchestrator.keys import Keys
from orchestrator.memory_store import MemoryStore
from orchestrator.owner import Orchestrator
from orchestrator.redis_store import RedisStore
from orchestrator.settings import Settings


async def _scan(store: Any, shard: int, count: int) -> tuple[list[str], int]:
    cursor, seen, steps = "0", [], 0
    while True:
        cursor, page = await store.live_page(shard, cursor, count)
        seen += page
        steps += 1
        if cursor == "0":
            return seen, steps


async def test_a_scan_of_the_live_set_sees_every_program_on_redis_and_in_the_model(
    settings: Settings,
) -> None:
    ids = [f"w{n:03}" for n in range(40)]
    model = MemoryStore(Keys(settings.prefix))
    real = RedisStore.connect(settings)
    try:
        for store in (model, real):
            for wf in ids:
                await store.track(wf, 2)
            seen, steps = await _scan(store, 2, 7)
            assert sorted(set(seen)) == ids and steps > 1, type(store).__name__
            assert await store.live_page(3, "0", 7) == ("0", [])  # an empty shard
    finally:
        await real.close()


async def test_each_sweep_reads_a_bounded_share_and_the_whole_set_is_still_swept(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(owner_module, "SWEEP_BUDGET", 10)
    monkeypatch.setattr(owner_module, "SWEEP_PAGE", 4)
    settings = settings.model_copy(update={"sweep_s": 0.1, "shards": 1})
    async with connected(settings, "test-sweep") as (store, bus):
        # 34 ids counted in flight that were never recorded (a router died between its two
        # writes), and one program recorded but never started, deep in the set.
        for n in range(34):
            await store.track(f"ghost-{n:02}", 0)
        plan = json.dumps({"program": {"steps": [{"task": "add"}]}, "input": 1, "owner": 0})
        await store.track("orphan", 0)
        await store.submit("orphan", plan, 0, "", "digest")
        await asyncio.sleep(0.2)  # older than a sweep
        owner = Orchestrator(settings, [0], store=store, bus=bus)
        reads: list[int] = []
        brief = store.brief

        async def counted(wf: str) -> dict[str, str]:
            reads[-1] += 1
            return await brief(wf)

        store.brief = counted  # type: ignore[method-assign]
        pages: list[list[int]] = []  # each sweep's pages' sizes
        live_page = store.live_page

        async def paged(shard: int, cursor: str, count: int) -> tuple[str, list[str]]:
            found = await live_page(shard, cursor, count)
            pages[-1].append(len(found[1]))
            return found

        store.live_page = paged  # type: ignore[method-assign]
        started = 0
        for _ in range(8):  # 35 live, 10 a sweep: two whole scans and some
            reads.append(0)
            pages.append([])
            started += await owner.sweep()
        # The budget, and one page past it at most: SSCAN's COUNT is a hint (a page of 4 may
        # hold a whole hash bucket, more: how many depends on the server's hash seed).
        for read, sizes in zip(reads, pages, strict=True):
            assert read == sum(sizes) and sum(sizes[:-1]) < 10, (read, sizes)
        assert sum(reads) >= 2 * 35  # yet every program was read, twice over
        assert started == 1  # the orphan, once
        # Ghosts seen unrecorded in two whole scans are no longer counted in flight.
        assert await store.in_flight(0) == 1


async def test_a_sweep_that_redis_refuses_logs_a_line_not_a_traceback(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    """BUSY (a long script) or MASTERDOWN logged a whole traceback every sweep."""
    from redis._parsers.base import BaseParser

    async def refused() -> int:
        raise BaseParser.parse_error("BUSY Redis is busy running a script.")

    caplog.set_level("WARNING", logger="orchestrator.owner")
    quick = settings.model_copy(update={"sweep_s": 0.1})
    async with connected(quick, "test-sweep-busy") as (store, bus):
        orchestrator = Orchestrator(quick, [0], store=store, bus=bus)
        orchestrator.sweep = refused  # type: ignore[method-assign]
        sweeping = asyncio.create_task(orchestrator._sweep_every())
        await asyncio.sleep(0.15)
        sweeping.cancel()
        await asyncio.gather(sweeping, return_exceptions=True)
    assert caplog.records and all(r.exc_info is None for r in caplog.records)
    assert caplog.records[0].getMessage() == (
        "orchestrator: sweep skipped: ResponseError: BUSY Redis is busy running a script."
    )
