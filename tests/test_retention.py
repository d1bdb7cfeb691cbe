"""Retention: an ended program's keys expire, a live program's never do, purge never takes a
live one, and a long untiloop keeps a bounded number of keys (on a real cluster)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from prometheus_client import REGISTRY

from orchestrator.connections import connected
from orchestrator.marks import Marks
from orchestrator.messages import Failed, KeyLimit
from orchestrator.redis_store import RedisStore
from orchestrator.settings import Settings
from router.client import Router
from router.retention import purge
from shardflow.dev import Dev
from tests.polling import until
from worker.pool import Worker
from worker.registry import Registry

LIVE = ("pending", "running")


async def _keys(store: RedisStore, wf: str) -> dict[str, int]:
    """Every key of one program, with its PTTL (-1: no expiry)."""
    names = [
        key async for key in store.client.scan_iter(match=store.keys.pattern(wf), count=10_000)
    ]
    return {name: await store.client.pttl(name) for name in names}


@pytest.fixture
async def short(settings: Settings, registry: Registry) -> AsyncIterator[tuple[Router, Dev]]:
    """A cluster whose ended programs stay 2 s, and whose bags may join at most 200 kB."""
    settings = settings.model_copy(update={"retention_s": 2.0, "max_join_bytes": 200_000})
    async with connected(settings, "retention-test") as (store, bus):
        dev = Dev(settings, registry, store=store, bus=bus, concurrency=8)
        running = asyncio.create_task(dev.run())
        try:
            yield Router(settings, store=store, bus=bus, known_tasks=None), dev
        finally:
            dev.shutdown()
            await running


LOOP = {
    "steps": [
        {"task": "add", "args": {"n": 1}},
        {
            "until": "iteration >= 3",
            "max_iterations": 10,
            "steps": [{"bag": [{"task": "counter"}] * 3}, {"task": "counter"}],
        },
    ]
}


async def test_an_ended_programs_keys_expire_and_a_live_ones_do_not(
    short: tuple[Router, Dev], store: RedisStore
) -> None:
    router, _ = short
    done = await router.submit(LOOP, None)
    status = await router.wait(done.workflow_id, timeout_s=60)
    assert status["status"] == "completed", status
    ended = await _keys(store, done.workflow_id)
    assert len(ended) >= 5 and all(0 < ttl <= 2000 for ttl in ended.values()), ended
    # A program waiting on a task that sleeps: every key it owns so far has no expiry.
    slow = await router.submit(
        {"steps": [{"task": "add"}, {"task": "echo", "args": {"sleep_s": 30}}]}, None
    )
    await asyncio.sleep(1.0)
    held = await _keys(store, slow.workflow_id)
    assert held and all(ttl == -1 for ttl in held.values()), held
    await asyncio.sleep(2.5)
    assert await _keys(store, done.workflow_id) == {}  # gone after the retention
    assert (await router.status(slow.workflow_id) or {}).get("status") == "running"
    still = await _keys(store, slow.workflow_id)
    assert all(ttl == -1 for ttl in still.values()), still
    cancelled = await router.cancel(slow.workflow_id)
    assert cancelled["status"] == "cancelled", cancelled
    ended_now = await _keys(store, slow.workflow_id)
    assert ended_now and all(0 < ttl <= 2000 for ttl in ended_now.values()), ended_now


async def test_purge_takes_ended_programs_and_never_a_live_one(
    settings: Settings, registry: Registry, store: RedisStore
) -> None:
    async with connected(settings, "purge-test") as (shared, bus):
        router = Router(settings, store=shared, bus=bus, known_tasks=None)
        parallel = Worker(settings, registry, pool="parallel", store=shared, bus=bus)
        dev = Dev(settings, registry, store=shared, bus=bus)
        dev._parts = [dev.orchestrator, parallel]  # no serial worker: serial tasks wait
        running = asyncio.create_task(dev.run())
        try:
            ended = await router.submit({"steps": [{"bag": [{"task": "add"}]}]}, None)
            assert (await router.wait(ended.workflow_id, timeout_s=30))["status"] == "completed"
            waiting = await router.submit({"steps": [{"task": "add"}]}, None)
            cancelled = await router.submit({"steps": [{"task": "add"}]}, None)
            await router.cancel(cancelled.workflow_id)
            before = await _keys(store, waiting.workflow_id)

            kept = await purge(store, statuses=["cancelled"], older_than_s=3600)
            assert kept["purged"] == 0 and kept["kept"] >= 2, kept
            counts = await purge(store)
            assert counts["purged"] == 2 and counts["live"] == 1, counts
            assert await _keys(store, ended.workflow_id) == {}
            assert await _keys(store, cancelled.workflow_id) == {}
            assert await _keys(store, waiting.workflow_id) == before
            assert await router.status(ended.workflow_id) is None
            with pytest.raises(ValueError, match="choose among"):
                await purge(store, statuses=["running"])
        finally:
            dev.shutdown()
            await running


async def test_a_long_untiloop_keeps_a_bounded_number_of_keys(
    short: tuple[Router, Dev], store: RedisStore
) -> None:
    router, _ = short
    program = {
        "steps": [
            {
                "until": "iteration >= 59",
                "max_iterations": 100,
                "steps": [{"bag": [{"task": "counter"}] * 3}, {"task": "counter"}],
            }
        ]
    }
    submitted = await router.submit(program, None)
    wf, most = submitted.workflow_id, 0
    while (await router.status(wf) or {}).get("status") in LIVE:
        # The registry names every key the program owns beyond state and plan, read in one
        # call (a SCAN would see keys over a window of many iterations).
        most = max(most, await store.client.scard(store.keys.registry(wf)))
        await asyncio.sleep(0.01)
    status = await router.wait(wf, timeout_s=60)
    assert status["status"] == "completed" and status["result"] == {"iteration": 59}
    # Two iterations (the last finished and the current one) of a bag of 3 (3 outputs and
    # its barrier) and a task: 2 * 5 = 10, whatever the number of iterations.
    assert 0 < most <= 10, most
    owned = await _keys(store, wf)  # quiet now: a SCAN sees every key there is
    registered = await store.client.smembers(store.keys.registry(wf))
    assert set(owned) == {*registered, *(store.keys.registry(wf), store.keys.plan(wf))} | {
        store.keys.state(wf)
    }
    assert len(owned) <= 13, sorted(owned)


async def test_large_values_travel_by_reference_and_an_oversized_join_fails_clearly(
    short: tuple[Router, Dev], store: RedisStore
) -> None:
    router, _ = short
    big_input = {"rows": ["r" * 100] * 1000}  # ~100 kB: over the 64 kB carried inline
    program = {
        "steps": [
            {"task": "blob", "args": {"n": 150_000}},  # a 150 kB output: read back by the owner
            {"task": "echo"},  # its prev (150 kB) is referred to
            {"bag": [{"task": "blob", "args": {"n": 90_000}}] * 3},  # 270 kB > 200 kB joined
        ]
    }
    submitted = await router.submit(program, big_input)
    wf = submitted.workflow_id
    status = await router.wait(wf, timeout_s=60)
    assert status["status"] == "failed", status
    assert "step 2: its output of 270006 bytes is over the limit of 200000" in status["error"]
    names = {name.rsplit(":", 1)[-1] for name in await _keys(store, wf)}
    assert {"input", "1"} <= names  # the stashed input and step 1's prev
    echoed = json.loads(await store.client.get(store.keys.output(wf, "1")))
    assert echoed["prev"] == "x" * 150_000  # the worker read the prev it was referred to


def test_the_purge_command_prints_its_counts_and_refuses_a_live_status(
    settings: Settings,
) -> None:
    from tests.test_cli import environment, shardflow

    done = shardflow(
        "purge", "--status", "completed", "--older-than", "1h", env=environment(settings)
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"purged": 0, "live": 0, "kept": 0, "missing": 0}
    refused = shardflow("purge", "--status", "running", env=environment(settings))
    assert refused.returncode == 2 and "invalid choice: 'running'" in refused.stderr
    assert "never a live one" in shardflow("purge", "--help").stdout


async def test_a_timer_that_outlives_its_program_is_no_dead_letter(
    short: tuple[Router, Dev], store: RedisStore
) -> None:
    """A deadline (or a signal timeout's wake) may fall due long after its program ended and
    expired; each such timer was parked as "no such program", filling the dead letters."""
    router, _ = short
    before = _gone("orchestrator")
    programs = [
        {"deadline_s": 5.0, "steps": [{"task": "add"}]},
        {"steps": [{"signal": "go", "timeout_s": 5.0}, {"task": "add"}]},
    ]
    due = asyncio.get_running_loop().time() + 5.0  # both timers, about
    submitted = [(await router.submit(program, None)).workflow_id for program in programs]
    # Signalled once it waits: its wake is set then (a signal kept before sets none).
    await until(lambda: router.explain(submitted[1]), lambda r: "a signal" in r["waiting_for"])
    await router.signal(submitted[1], "go")
    for wf in submitted:
        assert (await router.wait(wf, timeout_s=10))["status"] == "completed"
    await asyncio.sleep(2.5)  # both expired (2 s) before their timers fall due
    assert asyncio.get_running_loop().time() < due, "too slow to test what it means to"
    assert all([await _keys(store, wf) == {} for wf in submitted])
    await asyncio.sleep(due + 1.5 - asyncio.get_running_loop().time())
    async with connected(router.settings, "retention-dead") as (_, bus):
        assert await bus.peek_dead(10) == []
    assert _gone("orchestrator") - before == 2  # the deadline and the wake, as a metric


async def test_a_retry_that_outlives_its_program_is_no_dead_letter(
    short: tuple[Router, Dev], store: RedisStore
) -> None:
    """A retry waits in the delay ladder (up to 27 h): a program cancelled meanwhile that
    expired (or was purged) before it fell due left it parked as "no such program", for good."""
    router, dev = short
    before = _gone("worker")
    program = {"steps": [{"task": "boom", "pool": "parallel",
                          "retry": {"max_attempts": 2, "backoff_s": 6.0}}]}  # fmt: skip
    wf = (await router.submit(program, None)).workflow_id
    for _ in range(200):  # the first attempt failed: its retry waits
        if (await router.status(wf) or {}).get("attempts"):
            break
        await asyncio.sleep(0.05)
    await router.cancel(wf)
    await asyncio.sleep(2.5)  # expired (2 s) well before the retry falls due (6.8 s)
    assert await _keys(store, wf) == {}
    await asyncio.sleep(5.0)
    async with connected(router.settings, "retention-dead") as (_, bus):
        assert await bus.peek_dead(10) == []
    assert sum(worker.counts["gone"] for worker in dev.workers) == 1
    assert _gone("worker") - before == 1


def _gone(part: str) -> float:
    return REGISTRY.get_sample_value("shardflow_gone_ignored_total", {"part": part}) or 0.0


async def test_a_late_mark_writes_nothing_for_a_program_gone_and_expires_with_an_ended_one(
    store: RedisStore,
) -> None:
    """A worker's wait for a slot, or an owner's failed attempt, may be noted after its
    program was purged or expired (the worker checked it before): the mark wrote the
    program's key registry anew, with no expiry, and nothing ever removed it. Nor did one
    expire that a mark made for a program cancelled before any key was registered."""
    marks, client = Marks(store), store.client
    plan = json.dumps({"program": {"steps": [{"task": "t"}]}, "input": None, "owner": 0})
    limit = KeyLimit(key="k", max=1)
    for wf in ("gone", "ended", "live"):
        await store.submit(wf, plan, 0, "t", "d")
    await store.cancel("gone", "cancelled", "by hand")
    assert await store.purge("gone", "cancelled", 2**62) == "purged"
    await marks.slot_wait("gone", "0", None, limit, 1)
    await marks.failed(Failed(wf="gone", path="0", error="e"), 1.0)
    assert await _keys(store, "gone") == {}

    await store.cancel("ended", "cancelled", "by hand")  # no key registered before
    await marks.failed(Failed(wf="ended", path="0", error="e"), None)
    ended = await _keys(store, "ended")  # state, plan, the registry and the mark
    assert store.keys.attempts("ended") in await client.smembers(store.keys.registry("ended"))
    assert len(ended) == 4 and all(0 < ttl <= store.retention_ms for ttl in ended.values()), ended

    await marks.slot_wait("live", "0", None, limit, 1)
    live = await _keys(store, "live")
    assert store.keys.limit_waits("live") in await client.smembers(store.keys.registry("live"))
    assert len(live) == 4 and all(ttl == -1 for ttl in live.values()), live


def test_a_retention_under_a_millisecond_is_not_forever(settings: Settings) -> None:
    """0 ms is keep for ever: 0.0005 s rounded down to it."""
    for seconds, kept_ms in ((0.0005, 1), (0, 0), (1.2345, 1235)):
        store = RedisStore.connect(settings.model_copy(update={"retention_s": seconds}))
        assert store.retention_ms == kept_ms, seconds
