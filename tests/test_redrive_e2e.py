"""Redrive on a real cluster: a failed or cancelled program runs again from where it stopped,
keeping what the steps before it recorded; the earlier run's messages change nothing."""

from __future__ import annotations

from typing import Any

import aio_pika
import pytest
from redis.asyncio import Redis

from orchestrator.connections import connected
from orchestrator.ending import end_program
from orchestrator.messages import Failed, Next, decode_shard_message, encode
from orchestrator.plans import Plans
from orchestrator.redis_store import RedisStore
from orchestrator.settings import Settings
from orchestrator.transitions import Transitions
from router.client import Router
from router.hashing import shard_for
from router.redriving import RedriveError
from tests.app import Trace
from tests.polling import until
from tests.test_owner_steps import Recorder

pytestmark = pytest.mark.e2e


def _starts(trace: Trace, wf: str) -> dict[str, int]:
    """How many times each step (and member) started, per path."""
    counts: dict[str, int] = {}
    for event in trace.events():
        if event["wf"] == wf and event["event"] == "start":
            where = event["path"] if event["index"] is None else f"{event['path']}#{event['index']}"
            counts[where] = counts.get(where, 0) + 1
    return counts


def _loop_with_a_bag(gate: str) -> dict[str, Any]:
    """A task, an untiloop of two iterations (a counter, then a bag whose middle member fails
    in iteration 1 while `gate` exists), and a last task."""
    bag = [{"task": "echo"}, {"task": "gated", "args": {"gate": gate, "from": 1}}, {"task": "echo"}]
    loop = {
        "until": "iteration >= 1",
        "max_iterations": 3,
        "steps": [{"task": "counter"}, {"bag": bag}],
    }
    return {"steps": [{"task": "echo", "args": {"first": True}}, loop, {"task": "echo"}]}


async def _ttl(redis_url: str, *keys: str) -> list[int]:
    client = Redis.from_url(redis_url)
    try:
        return [await client.pttl(key) for key in keys]
    finally:
        await client.aclose()


async def test_a_program_that_failed_in_a_bag_inside_a_loop_runs_again_from_that_bag(
    cluster: Router, trace: Trace, settings: Settings
) -> None:
    gate = f"{settings.prefix}:gate"
    client = Redis.from_url(settings.redis_url)
    await client.set(gate, "closed")
    wf = (await cluster.submit(_loop_with_a_bag(gate), trace.as_input())).workflow_id
    failed = await cluster.wait(wf, timeout_s=30)
    assert (failed["status"], failed["error"]) == (
        "failed",
        "step 1/iter:1/1/bag:1: task 'gated': RuntimeError: the gate is closed",
    )
    keys = cluster.store.keys
    # Ended: its keys expire (retention) ...
    assert all(ttl > 0 for ttl in await _ttl(settings.redis_url, keys.state(wf), keys.plan(wf)))
    ran = _starts(trace, wf)
    assert (ran["0"], ran["1/iter:0/0"], ran["1/iter:1/0"], ran["1/iter:1/1#1"]) == (1, 1, 1, 1)

    await client.delete(gate)
    redriven = await cluster.redrive(wf)
    assert redriven["status"] in ("pending", "running")
    assert redriven["run"] == 1
    [earlier] = redriven["runs"]
    assert (earlier["run"], earlier["status"], earlier["step"]) == (0, "failed", "1/iter:1/1")
    assert earlier["error"] == failed["error"]
    assert earlier["started_ms"] == failed["started_ms"]
    assert earlier["ended_ms"] == failed["ended_ms"]
    # ... and no more once it runs again.
    ttls = await _ttl(settings.redis_url, keys.state(wf), keys.plan(wf), keys.output(wf, "0"))
    assert ttls == [-1, -1, -1]

    done = await cluster.wait(wf, timeout_s=30)
    assert done["status"] == "completed", done
    assert done["error"] is None and done["run"] == 1 and len(done["runs"]) == 1
    # The bag ran again with the prev its first run had: iteration 1's counter output.
    members = done["result"]["prev"]
    assert members[1] == {"prev": {"iteration": 1}, "iteration": 1, "index": 1}
    assert members[0]["prev"] == {"iteration": 1}
    ran = _starts(trace, wf)
    # The steps before the bag ran once; the bag's members twice; the last step once.
    assert (ran["0"], ran["1/iter:0/0"], ran["1/iter:0/1#1"], ran["1/iter:1/0"]) == (1, 1, 1, 1)
    assert (ran["1/iter:1/1#0"], ran["1/iter:1/1#1"], ran["1/iter:1/1#2"]) == (2, 2, 2)
    assert ran["2"] == 1
    await client.aclose()

    with pytest.raises(RedriveError, match="completed: only a failed or cancelled program"):
        await cluster.redrive(wf)


async def test_a_cancelled_program_runs_again_from_the_step_it_was_running(
    cluster: Router, trace: Trace
) -> None:
    program = {"steps": [{"task": "echo"}, {"task": "echo", "args": {"sleep_s": 0.5}}]}
    wf = (await cluster.submit(program, trace.as_input())).workflow_id
    await until(lambda: cluster.status(wf), lambda s: _starts(trace, wf).get("1") == 1)
    cancelled = await cluster.cancel(wf, "wrong moment")
    assert cancelled["status"] == "cancelled"

    redriven = await cluster.redrive(wf)
    assert [(run["status"], run["step"], run["error"]) for run in redriven["runs"]] == [
        ("cancelled", "1", "wrong moment")
    ]
    done = await cluster.wait(wf, timeout_s=30)
    assert done["status"] == "completed", done
    assert done["result"]["prev"]["args"] == {}  # step 0's output, recorded by the first run
    ran = _starts(trace, wf)
    assert (ran["0"], ran["1"]) == (1, 2)


async def test_a_second_redrive_before_the_rerun_step_moved_on_keeps_its_prev(
    cluster: Router, trace: Trace
) -> None:
    # Cancelled at step 1, redriven, cancelled again while step 1 runs once more, redriven
    # again: the third run's step 1 still gets step 0's output as its prev (the second run
    # recorded no step before its rerun, and its end kept none for the next redrive).
    program = {"steps": [{"task": "echo"}, {"task": "echo", "args": {"sleep_s": 0.5}}]}
    wf = (await cluster.submit(program, trace.as_input())).workflow_id
    for run in (1, 2):
        await until(lambda: cluster.status(wf), lambda s, n=run: _starts(trace, wf).get("1") == n)
        assert (await cluster.cancel(wf, f"wrong moment {run}"))["status"] == "cancelled"
        await cluster.redrive(wf)
    done = await cluster.wait(wf, timeout_s=30)
    assert done["status"] == "completed", done
    assert done["result"]["prev"] is not None and done["result"]["prev"]["args"] == {}, done
    assert _starts(trace, wf) == {"0": 1, "1": 3}


async def test_a_program_cancelled_before_it_started_runs_from_its_first_step(
    cluster: Router,
) -> None:
    # Recorded but its start never sent (as a router dying in between leaves it).
    plan = '{"program": {"steps": [{"task": "echo"}]}, "input": null, "owner": 0}'
    wf = "never-started"
    store = cluster.store
    await store.submit(wf, plan, 0, "", "d")
    assert cluster.bus is not None
    assert await end_program(store, cluster.bus, wf, "cancelled", "not now") == "applied"
    await cluster.redrive(wf)
    done = await cluster.wait(wf, timeout_s=30)
    assert (done["status"], done["result"]) == ("completed", {"args": {}, "prev": None})


async def test_redrive_from_a_top_level_step_reruns_every_step_from_there(
    cluster: Router, trace: Trace, settings: Settings
) -> None:
    gate = f"{settings.prefix}:gate"
    client = Redis.from_url(settings.redis_url)
    await client.set(gate, "closed")
    program = {
        "steps": [
            {"task": "add", "args": {"n": 1}},
            {"task": "add", "args": {"n": 10}},
            {"task": "gated", "args": {"gate": gate}},
        ]
    }
    wf = (await cluster.submit(program, trace.as_input())).workflow_id
    assert (await cluster.wait(wf, timeout_s=30))["status"] == "failed"
    for bad, why in [
        ("x", "give a top-level step number"),
        ("2/0", "give a top-level step number"),
        ("3", "the program stopped in step 2; steps after it never ran"),
    ]:
        with pytest.raises(RedriveError, match=why):
            await cluster.redrive(wf, bad)
    await client.delete(gate)
    await cluster.redrive(wf, "1")
    done = await cluster.wait(wf, timeout_s=30)
    assert done["status"] == "completed"
    assert done["result"]["prev"] == 11  # step 0's output (1), kept; step 1 ran again: + 10
    ran = _starts(trace, wf)
    assert (ran["0"], ran["1"], ran["2"]) == (1, 2, 2)
    await client.aclose()


async def test_redrive_from_the_step_after_a_loop_is_refused_naming_why(cluster: Router) -> None:
    loop = {"until": "true", "max_iterations": 1, "steps": [{"task": "echo"}]}
    program = {"steps": [loop, {"task": "echo"}, {"task": "boom"}]}
    wf = (await cluster.submit(program)).workflow_id
    assert (await cluster.wait(wf, timeout_s=30))["status"] == "failed"
    with pytest.raises(RedriveError, match="step 0 before it is an untiloop, whose output"):
        await cluster.redrive(wf, "1")
    # --from the failed step itself (or a step that follows a task) is a plain redrive.
    assert (await cluster.redrive(wf, "2"))["run"] == 1


async def test_redrive_of_a_running_or_unknown_program_is_refused(
    cluster: Router, trace: Trace
) -> None:
    program = {"steps": [{"task": "echo", "args": {"sleep_s": 30}}]}
    wf = (await cluster.submit(program, trace.as_input())).workflow_id
    with pytest.raises(RedriveError, match=f"program '{wf}' is (pending|running): only a failed"):
        await cluster.redrive(wf)
    assert (await cluster.status(wf) or {}).get("runs") is None  # nothing changed
    await cluster.cancel(wf)
    with pytest.raises(LookupError, match="no program 'nothing-here'"):
        await cluster.redrive("nothing-here")


async def test_a_redrive_that_a_purge_overtakes_leaves_nothing_counted_live(
    cluster: Router, settings: Settings
) -> None:
    """The router counts the program live before its script; a purge between its read and the
    script left it counted (`shards` said draining, the in-flight gauge was one up) until two
    sweeps later."""
    from router.retention import purge

    program = {"steps": [{"task": "echo", "args": {"sleep_s": 30}}]}
    wf = (await cluster.submit(program)).workflow_id
    assert (await cluster.cancel(wf))["status"] == "cancelled"
    shard = shard_for(wf, settings.shards)
    script = cluster.store.redrive

    async def purged_first(*args: Any, **kwargs: Any) -> Any:
        assert (await purge(cluster.store, statuses=["cancelled"]))["purged"] == 1
        return await script(*args, **kwargs)

    cluster.store.redrive = purged_first  # type: ignore[method-assign]
    try:
        with pytest.raises(LookupError, match=f"no program '{wf}'"):
            await cluster.redrive(wf)
    finally:
        cluster.store.redrive = script  # type: ignore[method-assign]
    assert await cluster.store.in_flight(shard) == 0


async def test_a_message_of_the_earlier_run_is_stale_in_the_new_one(
    cluster: Router, trace: Trace, settings: Settings
) -> None:
    """Forged reports of run 0 for the very step that runs again change nothing: the step
    is the program's cursor again, only the epoch tells them apart."""
    gate, hold = f"{settings.prefix}:gate", f"{settings.prefix}:hold"
    client = Redis.from_url(settings.redis_url)
    await client.set(gate, "closed")
    program = {"steps": [{"task": "echo"}, {"task": "gated", "args": {"gate": gate, "hold": hold}}]}
    wf = (await cluster.submit(program, trace.as_input())).workflow_id
    assert (await cluster.wait(wf, timeout_s=30))["status"] == "failed"
    await client.delete(gate)
    await client.set(hold, "held")
    await cluster.redrive(wf)
    await until(lambda: cluster.status(wf), lambda s: _starts(trace, wf).get("1") == 2)
    state = await cluster.store.state(wf)
    assert (state["status"], state["cursor"], state["epoch"]) == ("running", "1", "1")
    owner = int(state["owner"])
    assert cluster.bus is not None
    forged = [
        Next(wf=wf, path="1", output="forged"),
        Failed(wf=wf, path="1", error="forged", task="gated"),
    ]
    for message in forged:  # epoch 0: the first run's
        await cluster.bus.publish_to_shard(owner, encode(message))
    # And the store refuses them too, whoever calls it.
    assert (await cluster.store.record(wf, "1", 1, {None: '"forged"'}, 0)).verdict == "stale"
    assert (await cluster.store.fail(wf, "1", None, 0, "forged", 1, 0)).verdict == "stale"
    await client.delete(hold)
    done = await cluster.wait(wf, timeout_s=30)
    assert done["status"] == "completed", done
    assert done["result"]["index"] is None and done["result"]["prev"] == {"args": {}, "prev": None}
    await client.aclose()


async def test_explain_tells_the_runs_of_a_redriven_program(cluster: Router) -> None:
    from router.explain import explain_text

    wf = (await cluster.submit({"steps": [{"task": "boom"}]})).workflow_id
    assert (await cluster.wait(wf, timeout_s=30))["status"] == "failed"
    await cluster.redrive(wf)
    assert (await cluster.wait(wf, timeout_s=30))["status"] == "failed"
    report = await cluster.explain(wf)
    assert report is not None and report["run"] == 1
    text = explain_text(report)
    assert "This is run 1: it was redriven after the runs below." in text
    assert "  Run 0 ended failed at step 0: step 0: task 'boom': RuntimeError: boom" in text


async def test_a_program_of_a_shard_that_left_the_ring_is_not_redriven_without_its_queue(
    settings: Settings, store: RedisStore
) -> None:
    """Shrunk 4 -> 3: shard 3 drained (a failed program is not in flight) and reported
    removable. A redrive of its failed program is refused while nothing consumes shard 3's
    queue, and once the queue is deleted, naming the shard and what to do; nothing changes
    (before, the run was raised and set pending, then its start found no queue, and the
    program stayed pending for good: a second redrive refused a pending one)."""
    wf = next(f"w{i}" for i in range(1000) if shard_for(f"w{i}", 4) == 3)
    recorder = Recorder()
    router = Router(settings, store=store, bus=recorder)
    transitions = Transitions(store, recorder, Plans(store, 8))
    await router.submit({"steps": [{"task": "a"}, {"task": "b"}]}, None, wf)
    await transitions.apply(decode_shard_message(recorder.shard.pop()), redelivered=False, shard=3)
    await transitions.apply(Next(wf=wf, path="0", output=1), redelivered=False, shard=3)
    failed = Failed(wf=wf, path="1", task="b", error="x", prev=1)
    await transitions.apply(failed, redelivered=False, shard=3)
    before = await store.state(wf)
    assert before["status"] == "failed" and "epoch" not in before
    async with connected(settings, "test-redrive-old-ring"):  # shard 3's queue, unconsumed
        pass
    shrunk = settings.model_copy(update={"shards": 3})
    async with connected(shrunk, "test-redrive") as (_, bus):
        queue = bus.names.shard_queue(3)
        redriving = Router(shrunk, store=store, bus=bus)
        with pytest.raises(RedriveError, match=f"shard 3, .* nothing consumes {queue}: run an"):
            await redriving.redrive(wf)
        connection = await aio_pika.connect(settings.amqp_url)
        async with connection:
            await (await connection.channel()).queue_delete(queue)
        with pytest.raises(
            RedriveError,
            match=r"shard 3, outside the ring of 3 shards, and its queue .* is gone: run an "
            r"orchestrator for it \(`shardflow orchestrator --shards 3`",
        ):
            await redriving.redrive(wf)
    assert await store.state(wf) == before  # still failed, its run unchanged
    assert await store.in_flight(3) == 0
