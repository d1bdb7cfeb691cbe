"""Each Lua transition against a real Redis: duplicates and stale messages change nothing."""

import asyncio
import json

from redis.crc import key_slot

from orchestrator.redis_store import RedisStore

PLAN = json.dumps({"program": {"steps": [{"task": "a"}]}, "input": None, "owner": 1})


async def started(store: RedisStore, wf: str = "wf-1", cursor: str = "0") -> str:
    await store.submit(wf, PLAN, 1, "demo", "d")
    await store.advance(wf, "", cursor, "running")
    return wf


async def test_submit_records_once_and_reports_what_exists(store: RedisStore) -> None:
    first = await store.submit("wf-1", PLAN, 3, "demo", "d")
    assert (first.created, first.status, first.owner) == (True, "pending", 3)
    again = await store.submit("wf-1", '{"other": true}', 0, "other", "d")
    assert (again.created, again.status, again.owner, again.conflict) == (
        False,
        "pending",
        3,
        False,
    )
    other = await store.submit("wf-1", '{"other": true}', 0, "other", "e")
    assert (other.created, other.conflict) == (False, True)
    assert await store.plan("wf-1") == json.loads(PLAN)
    state = await store.state("wf-1")
    assert state["name"] == "demo" and state["cursor"] == "" and int(state["created_ms"]) > 0


async def test_advance_applies_once_then_replays_then_is_stale(store: RedisStore) -> None:
    await store.submit("wf-1", PLAN, 1, "demo", "d")
    applied = await store.advance("wf-1", "", "0", "running")
    assert (applied.verdict, applied.status, applied.cursor) == ("applied", "running", "0")
    # The same start again: already done, from the same cursor.
    replay = await store.advance("wf-1", "", "0", "running")
    assert (replay.verdict, replay.cursor) == ("replay", "0")
    moved = await store.advance("wf-1", "0", "1", "running")
    assert moved.verdict == "applied"
    # The start is now two transitions old: stale, and nothing changes.
    stale = await store.advance("wf-1", "", "0", "running")
    assert (stale.verdict, stale.cursor) == ("stale", "1")
    state = await store.state("wf-1")
    assert (state["cursor"], state["from"], state["status"]) == ("1", "0", "running")


async def test_advance_ends_a_program_once(store: RedisStore) -> None:
    wf = await started(store)
    done = await store.advance(wf, "0", "", "completed", "result", '{"x": 1}')
    assert (done.verdict, done.status) == ("applied", "completed")
    # A late failure report for the same step cannot turn it into a failure.
    late = await store.advance(wf, "0", "", "failed", "error", "boom")
    assert (late.verdict, late.status) == ("replay", "completed")
    state = await store.state(wf)
    assert state["status"] == "completed" and state["result"] == '{"x": 1}'
    assert "error" not in state and int(state["ended_ms"]) >= int(state["started_ms"])


async def test_an_applied_advance_times_the_step_it_leaves_on_redis_clock(
    store: RedisStore,
) -> None:
    await store.submit("wf-t", PLAN, 1, "demo", "d")
    start = await store.advance("wf-t", "", "1", "running", leaf="bag:2", opened=[
        ("1/branch:0", "1/branch:0/0", "task"), ("1/branch:1", "1/branch:1/0", "task"),
    ])  # fmt: skip
    assert start.elapsed_ms is None  # a start leaves no step
    await asyncio.sleep(0.5)
    first = await store.advance(
        "wf-t", "1/branch:0/0", "1/branch:0/1", "running", scope="1/branch:0"
    )
    # A branch's step is timed by its own cursor, which moved just now, not the program's.
    second = await store.advance("wf-t", "1/branch:0/1", "", "running", scope="1/branch:0")
    other = await store.advance("wf-t", "1/branch:1/0", "", "running", scope="1/branch:1")
    done = await store.advance("wf-t", "1", "", "completed", "result", "1")
    assert [v.verdict for v in (first, second, other, done)] == ["applied"] * 4
    assert 500 <= (first.elapsed_ms or 0) < 5000 and second.elapsed_ms is not None
    assert second.elapsed_ms < 400
    assert 500 <= (other.elapsed_ms or 0) < 5000 and 500 <= (done.elapsed_ms or 0) < 5000
    replay = await store.advance("wf-t", "1", "", "completed", "result", "1")
    assert (replay.verdict, replay.elapsed_ms) == ("replay", None)  # timed once


async def test_a_branch_advance_again_is_a_replay_by_the_branch_own_from(store: RedisStore) -> None:
    await store.submit("wf-r", PLAN, 1, "demo", "d")
    opened = [("1/branch:0", "1/branch:0/0", "task"), ("1/branch:1", "1/branch:1/0", "task")]
    await store.advance("wf-r", "", "1", "running", leaf="bag:2", opened=opened)
    moved = await store.advance(
        "wf-r", "1/branch:1/0", "1/branch:1/1", "running", scope="1/branch:1"
    )
    again = await store.advance(
        "wf-r", "1/branch:1/0", "1/branch:1/1", "running", scope="1/branch:1"
    )
    # The program's own `from` is the start's (""): a redelivery is known by the branch's.
    assert (moved.verdict, again.verdict, again.cursor) == ("applied", "replay", "1/branch:1/1")
    ended = await store.advance("wf-r", "1/branch:1/1", "", "running", scope="1/branch:1")
    late = await store.advance(
        "wf-r", "1/branch:1/0", "1/branch:1/1", "running", scope="1/branch:1"
    )
    assert (ended.verdict, late.verdict) == ("applied", "stale")


async def test_advance_of_an_unknown_program_is_missing(store: RedisStore) -> None:
    assert (await store.advance("nope", "", "0", "running")).verdict == "missing"


async def test_a_single_task_keeps_its_first_output(store: RedisStore) -> None:
    wf = await started(store)
    first = await store.complete(wf, "0", None, 1, '"first"')
    assert (first.verdict, first.outputs) == ("fire", ['"first"'])
    rerun = await store.complete(wf, "0", None, 1, '"second"')
    assert (rerun.verdict, rerun.outputs) == ("again", ['"first"'])


async def test_a_bag_barrier_fires_exactly_once_after_every_member(store: RedisStore) -> None:
    wf = await started(store, cursor="3")
    size = 5
    verdicts = []
    for index in [4, 0, 4, 2, 0, 1]:  # with duplicates, before the last member
        verdicts.append(
            (await store.complete(wf, "3", index, size, json.dumps(index * 10))).verdict
        )
    assert verdicts == ["wait"] * 6
    last = await store.complete(wf, "3", 3, size, "30")
    assert last.verdict == "fire"
    assert last.outputs == ["0", "10", "20", "30", "40"]  # in bag order, not arrival order
    # Every later duplicate reports the step as already complete, with the first outputs.
    dup = await store.complete(wf, "3", 2, size, '"rerun"')
    assert (dup.verdict, dup.outputs[2]) == ("again", "20")
    members = await store.client.smembers(store.keys.barrier(wf, "3"))
    assert members == {"0", "1", "2", "3", "4"}


async def test_completions_for_another_step_or_an_ended_program_are_stale(
    store: RedisStore,
) -> None:
    wf = await started(store, cursor="1")
    old = await store.complete(wf, "0", None, 1, '"late"')
    assert old.verdict == "stale"
    assert await store.client.get(store.keys.output(wf, "0")) is None
    await store.advance(wf, "1", "", "failed", "error", "boom")
    after_end = await store.complete(wf, "1", 0, 2, '"late"')
    assert after_end.verdict == "stale"
    assert not await store.client.exists(store.keys.barrier(wf, "1"))


async def test_scripts_reload_after_the_script_cache_is_flushed(store: RedisStore) -> None:
    wf = await started(store)
    await store.client.script_flush()
    assert (await store.complete(wf, "0", None, 1, "1")).verdict == "fire"


async def test_every_key_of_a_program_shares_one_cluster_slot(store: RedisStore) -> None:
    wf = await started(store, cursor="2")
    await store.complete(wf, "2", 0, 2, "1")
    keys = [key async for key in store.client.scan_iter(match=store.keys.pattern(wf))]
    assert len(keys) == 5  # state, plan, one output, the barrier, the registry of keys
    slots = {key_slot(key.encode()) for key in keys}
    assert len(slots) == 1


async def test_a_failed_attempt_is_recorded_once_and_the_last_returns_every_error(
    store: RedisStore,
) -> None:
    wf = await started(store, cursor="1")
    assert (await store.fail(wf, "1", 2, 0, "first", 3)).verdict == "retry"
    assert (await store.fail(wf, "1", 2, 0, "first again", 3)).verdict == "again"
    assert (await store.fail(wf, "1", 2, 1, "second", 3)).verdict == "retry"
    last = await store.fail(wf, "1", 2, 2, "third", 3)
    assert (last.verdict, last.outputs) == ("exhausted", ["first", "second", "third"])
    assert (await store.fail(wf, "1", 2, 2, "dup", 3)).outputs == ["first", "second", "third"]
    assert (await store.fail(wf, "0", 0, 0, "late", 3)).verdict == "stale"


async def test_reports_that_do_not_fit_the_leaf_are_refused_before_anything_is_written(
    store: RedisStore,
) -> None:
    wf = "wf-h"
    await store.submit(wf, PLAN, 1, "demo", "d")
    await store.advance(wf, "", "2", "running", leaf="bag:3")
    before = await store.state(wf)
    # A negative index once wrote KEYS[3 + index]: the state hash itself.
    for index in (-2, -1, 3, 10**9):
        refused = await store.record(wf, "2", 3, {index: '"forged"'})
        assert refused.verdict == "invalid", index
    assert (await store.record(wf, "2", 5, {0: "1"})).verdict == "invalid"  # not a bag of 5
    assert (await store.record(wf, "2", 1, {None: "1"})).verdict == "invalid"  # not a task
    assert await store.state(wf) == before
    # attempt 10**7 once looped for 20 s inside Redis; now it is refused at once.
    huge = await store.fail(wf, "2", 0, 10**7, "boom", 10**7 + 1)
    assert huge.verdict == "invalid"
    assert (await store.fail(wf, "2", 0, 5, "boom", 3)).verdict == "invalid"
    assert (await store.fail(wf, "2", 7, 0, "boom", 3)).verdict == "invalid"
    assert not await store.client.exists(store.keys.failures(wf, "2"))
    assert (await store.record("nope", "0", 1, {None: "1"})).verdict == "missing"
    assert (await store.fail("nope", "0", 0, 0, "x", 1)).verdict == "missing"
