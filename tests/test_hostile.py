"""Hostile and unlucky messages on a real cluster: each ends in the dead-letter queue with its
reason (or is absorbed by idempotency), and the good programs around it are untouched."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aio_pika
import pytest

from orchestrator import metrics
from orchestrator.bus import MAX_TIMER_HOP_MS, ladder_floor_ms, ladder_ms
from orchestrator.connections import connected
from orchestrator.keys import Keys, Names
from orchestrator.messages import (
    MAX_ERROR,
    MessageError,
    Next,
    decode_shard_message,
    decode_task,
    encode,
)
from orchestrator.owner import Orchestrator
from orchestrator.program import ProgramError
from orchestrator.settings import Settings
from router.client import Router
from router.hashing import shard_for
from router.ingress import derived_id
from tests.polling import until
from tests.test_ingress import ask, ingress  # noqa: F401 (a fixture)

pytestmark = pytest.mark.e2e

SLOW = {"steps": [{"task": "echo", "args": {"sleep_s": 1.0}}, {"task": "echo"}]}


async def publish(
    settings: Settings,
    routing_key: str,
    body: bytes,
    exchange: str = "",
    message: aio_pika.Message | None = None,
) -> None:
    async with await aio_pika.connect(settings.amqp_url) as connection:
        channel = await connection.channel()
        target = (
            channel.default_exchange
            if not exchange
            else await channel.get_exchange(exchange, ensure=False)
        )
        await target.publish(message or aio_pika.Message(body), routing_key=routing_key)


async def dead_reasons(settings: Settings, count: int, timeout_s: float = 20) -> list[str]:
    """The reasons of the dead-lettered messages, once there are `count` of them."""
    async with connected(settings, "test-dead") as (_, bus):
        for _ in range(int(timeout_s / 0.1)):
            parked = await bus.peek_dead(100)
            if len(parked) >= count:
                return [str(headers.get("x-shardflow-reason")) for headers, _ in parked]
            await asyncio.sleep(0.1)
    raise AssertionError(f"expected {count} dead letters, found {len(parked)}")


async def test_a_forged_next_to_a_shard_that_does_not_own_the_program_is_refused(
    cluster: Router, settings: Settings
) -> None:
    submitted = await cluster.submit(SLOW, None, "owned-elsewhere")
    other = (submitted.shard + 1) % settings.shards
    forged = encode(Next(wf="owned-elsewhere", path="0", output="forged"))
    await publish(
        settings, str(other), forged, exchange=Names(settings.prefix).orchestrator_exchange
    )
    status = await cluster.wait("owned-elsewhere", timeout_s=30)
    assert status["status"] == "completed"
    assert status["result"] != "forged"
    reasons = await dead_reasons(settings, 1)
    assert reasons == [f"owned-elsewhere: owned by shard {submitted.shard}, not by shard {other}"]


async def test_messages_for_unknown_programs_are_dead_lettered_not_dropped(
    cluster: Router, settings: Settings
) -> None:
    exchange = Names(settings.prefix).orchestrator_exchange
    bodies = [
        # Timers and a signal's hint may outlive their program (ended, expired): acked.
        b'{"kind": "deadline", "wf": "ghost-3", "deadline_s": 1}',
        b'{"kind": "wake", "wf": "ghost-5", "path": "0"}',
        b'{"kind": "signal", "wf": "ghost-6", "name": "approval"}',
        b'{"kind": "start", "wf": "ghost-1"}',
        b'{"kind": "failed", "wf": "ghost-2", "path": "0", "error": "x"}',
    ]
    for body in bodies:
        await publish(settings, "0", body, exchange=exchange)
    task = {"wf": "ghost-4", "path": "0", "task": "add", "owner": 0}
    await publish(settings, f"{settings.prefix}.tasks.parallel", json.dumps(task).encode())
    reasons = sorted(await dead_reasons(settings, 3))
    assert reasons == [f"ghost-{n}: no such program" for n in (1, 2, 4)]
    async with connected(settings, "test-dead") as (_, bus):
        for _ in range(10):  # the timers acked, not parked (each is handled in ms)
            assert len(await bus.peek_dead(100)) == 3
            await asyncio.sleep(0.1)


@pytest.fixture
def settings_limit(settings: Settings) -> Settings:
    return settings.model_copy(update={"delivery_limit": 3})


async def test_a_message_that_keeps_failing_is_dead_lettered_after_the_limit(
    settings_limit: Settings, registry: Any
) -> None:
    """A task message that fails every time, and not as poison (here its program's state is
    not a hash: Redis answers WRONGTYPE), is dead-lettered after the limit: on classic queues
    it was requeued ~1000 times a second, forever. (This test first used a task naming an
    owner shard that does not exist; that is now poison, refused on its first delivery.)"""
    from shardflow.dev import Dev

    settings = settings_limit
    async with connected(settings, "test-limit") as (store, bus):
        dev = Dev(settings, registry, store=store, bus=bus, concurrency=4)
        running = asyncio.create_task(dev.run())
        try:
            # A task whose program's state cannot be read: a string where a hash should be.
            await store.client.set(Keys(settings.prefix).state("lost-owner"), "not a hash")
            task = {"wf": "lost-owner", "path": "0", "task": "add", "owner": 0}
            await publish(settings, f"{settings.prefix}.tasks.parallel", json.dumps(task).encode())
            reasons = await dead_reasons(settings, 1)
        finally:
            dev.shutdown()
            await running
    assert len(reasons) == 1 and reasons[0].startswith("failed 3 times, the limit; last:")
    assert "WRONGTYPE" in reasons[0], reasons


async def test_an_ingress_request_delivered_twice_starts_one_program(
    ingress: Router,  # noqa: F811
    settings: Settings,
) -> None:
    """A router that dies after publishing `start` and before acking gets the request again:
    an id-less request's id comes from its message_id, so the second delivery finds the first
    program (a probe once made 972 programs of one message)."""
    body = json.dumps({"program": {"steps": [{"task": "add", "args": {"n": 2}}]}}).encode()
    for _ in range(2):
        message = aio_pika.Message(body, message_id="request-7")
        await publish(settings, f"{settings.prefix}.ingress", message.body, message=message)
    wf = derived_id("request-7", body)
    for _ in range(300):  # recorded once the router took the request (wait needs it there)
        if await ingress.status(wf) is not None:
            break
        await asyncio.sleep(0.05)
    assert (await ingress.wait(wf, timeout_s=30))["result"] == 2
    await asyncio.sleep(0.3)  # the second delivery has been handled too
    async with connected(settings, "test-count") as (store, _):
        assert sum([await store.in_flight(shard) for shard in range(settings.shards)]) == 0
        keys = [key async for key in store.client.scan_iter(match=f"{settings.prefix}:*:state")]
    assert keys == [store.keys.state(wf)]


async def test_resubmitting_an_id_with_another_program_or_input_is_refused(
    cluster: Router,
) -> None:
    await cluster.submit({"steps": [{"task": "add"}]}, 1, "same-id")
    assert (await cluster.submit({"steps": [{"task": "add"}]}, 1, "same-id")).created is False
    with pytest.raises(ProgramError, match="'same-id' exists with another program or input"):
        await cluster.submit({"steps": [{"task": "add"}]}, 2, "same-id")
    with pytest.raises(ProgramError, match="exists with another program"):
        await cluster.submit({"steps": [{"task": "echo"}]}, 1, "same-id")


async def test_a_program_recorded_but_never_started_is_started_by_its_owner(
    settings: Settings, registry: Any
) -> None:
    from worker.pool import Worker

    settings = settings.model_copy(update={"sweep_s": 0.2})
    wf = "orphan-1"
    owner = shard_for(wf, settings.shards)
    async with connected(settings, "test-orphans") as (store, bus):
        # What a router that died between recording and starting leaves behind.
        plan = json.dumps({"program": {"steps": [{"task": "add"}]}, "input": 4, "owner": owner})
        await store.track(wf, owner)
        await store.submit(wf, plan, owner, "", "digest")
        await asyncio.sleep(0.3)  # older than one sweep
        parts = [
            Orchestrator(settings, range(settings.shards), store=store, bus=bus),
            Worker(settings, registry, pool="serial", store=store, bus=bus),
        ]
        running = [asyncio.create_task(part.run()) for part in parts]
        try:
            status = await Router(settings, store=store).wait(wf, timeout_s=30)
        finally:
            for part in parts:
                part.shutdown()
            await asyncio.gather(*running)
        assert (status["status"], status["result"]) == ("completed", 1)
        assert await store.in_flight(owner) == 0


async def test_a_handler_calling_sys_exit_fails_its_task_and_the_worker_goes_on(
    cluster: Router,
) -> None:
    failed = await cluster.submit({"steps": [{"task": "exits", "args": {"code": 3}}]})
    status = await cluster.wait(failed.workflow_id, timeout_s=30)
    assert status["status"] == "failed"
    assert status["error"].endswith("SystemExit: 3")
    after = await cluster.submit({"steps": [{"task": "add"}]})
    assert (await cluster.wait(after.workflow_id, timeout_s=30))["result"] == 1


def test_delays_are_rounded_up_to_a_bounded_ladder() -> None:
    asked = [n / 1000 for n in range(1, 100_000, 7)] + [3600.5, 86400 * 29.9, 1e12]
    rounded = [ladder_ms(delay) for delay in asked]
    assert all(r >= min(d * 1000, 30 * 86400 * 1000) for d, r in zip(asked, rounded, strict=True))
    assert all(
        r <= max(1.25 * d * 1000, 1) + 1 for d, r in zip(asked[:-1], rounded[:-1], strict=True)
    )
    every_delay = {ladder_ms(10 ** (e / 50) / 1000) for e in range(0, 500)}
    assert len(every_delay) <= 120  # a few queues per target, whatever the delays asked


def test_a_timer_waits_a_ladder_delay_never_past_what_is_left() -> None:
    asked = [n / 1000 for n in range(0, 100_000, 7)] + [3600.5, 86400 * 29.9, 1e12]
    floors = [ladder_floor_ms(delay) for delay in asked]
    assert all(f <= d * 1000 for d, f in zip(asked, floors, strict=True))  # never early
    assert all(f == 0 or ladder_ms(f / 1000) == f for f in floors)  # on the ladder: few queues
    # At least ~82% of what is left each time: a sleep falls due in a few hops.
    assert all(
        f >= 0.8 * d * 1000 for d, f in zip(asked[:-2], floors[:-2], strict=True) if d >= 0.001
    )


def test_names_and_errors_that_reach_redis_are_bounded_by_the_schema() -> None:
    base = {"kind": "failed", "wf": "w", "path": "0", "task": "t"}
    with pytest.raises(MessageError, match="error"):
        decode_shard_message(json.dumps({**base, "error": "x" * (MAX_ERROR + 1)}).encode())
    with pytest.raises(MessageError, match="task"):
        decode_shard_message(json.dumps({**base, "task": "x" * 5000, "error": "e"}).encode())
    task = {"wf": "w", "path": "0", "task": "t" * 129, "owner": 0}
    with pytest.raises(MessageError, match="task"):
        decode_task(json.dumps(task).encode())
    with pytest.raises(MessageError, match="owner"):
        decode_task(json.dumps({**task, "task": "t", "owner": 1024}).encode())


async def test_a_long_error_is_cut_before_it_is_reported(cluster: Router) -> None:
    program = {"steps": [{"task": "boom", "args": {"message": "x" * (MAX_ERROR * 2)}}]}
    status = await cluster.wait((await cluster.submit(program)).workflow_id, timeout_s=30)
    assert status["status"] == "failed"
    assert status["error"].endswith(" ... (cut)") and len(status["error"]) < MAX_ERROR + 200


async def test_inputs_given_as_values_are_as_strict_as_json_text(cluster: Router) -> None:
    deep: list[Any] = []
    for _ in range(100):
        deep = [deep]
    for bad, fault in [(float("nan"), "NaN"), (deep, "nested deeper than 64")]:
        with pytest.raises(ProgramError, match=fault):
            await cluster.submit({"steps": [{"task": "add"}]}, bad)


async def test_a_refused_resubmission_of_an_ended_program_leaves_nothing_in_flight(
    cluster: Router, settings: Settings
) -> None:
    submitted = await cluster.submit({"steps": [{"task": "add"}]}, 1, "ended-once")
    assert (await cluster.wait("ended-once", timeout_s=30))["status"] == "completed"
    with pytest.raises(ProgramError, match="exists with another program"):
        await cluster.submit({"steps": [{"task": "add"}]}, 2, "ended-once")
    assert await cluster.store.in_flight(submitted.shard) == 0


async def test_a_forged_cancel_of_a_live_program_stops_nothing(
    cluster: Router, settings: Settings
) -> None:
    await cluster.submit({"steps": [{"task": "echo", "args": {"sleep_s": 1.0}}]}, None, "victim")
    await asyncio.sleep(0.3)  # its handler runs
    control = Names(settings.prefix).control_exchange
    await publish(settings, "", b'{"wf": "victim"}', exchange=control)
    status = await cluster.wait("victim", timeout_s=30)
    assert status["status"] == "completed", status


async def test_a_forged_deadline_ends_no_program_before_its_own(
    cluster: Router, settings: Settings
) -> None:
    # One program with a deadline of its own (far off), one with none: a deadline message
    # saying 1 ms comes for each while its first task runs.
    timed = {"deadline_s": 60, "steps": SLOW["steps"]}
    owners = {
        "timed": (await cluster.submit(timed, None, "timed")).shard,
        "untimed": (await cluster.submit(SLOW, None, "untimed")).shard,
    }
    await asyncio.sleep(0.3)  # both started
    exchange = Names(settings.prefix).orchestrator_exchange
    for wf, owner in owners.items():
        forged = json.dumps({"kind": "deadline", "wf": wf, "deadline_s": 0.001}).encode()
        await publish(settings, str(owner), forged, exchange=exchange)
    for wf in owners:
        status = await cluster.wait(wf, timeout_s=30)
        assert status["status"] == "completed", status
    assert await dead_reasons(settings, 1) == ["untimed: a deadline, but its program names none"]


async def test_a_deadline_let_out_early_by_a_ttl_policy_waits_for_its_time(
    cluster: Router, queue_policy: Any
) -> None:
    # An operator's policy lets every delay queue's messages out after 100 ms: the deadline
    # comes early again and again, and the program ends only once its 1.5 s have passed.
    queue_policy(r"delay\.", {"message-ttl": 100})
    program = {"deadline_s": 1.5, "steps": [{"task": "echo", "args": {"sleep_s": 30}}]}
    wf = (await cluster.submit(program)).workflow_id
    await asyncio.sleep(1.0)
    assert ((await cluster.status(wf)) or {}).get("status") in ("pending", "running")
    status = await cluster.wait(wf, timeout_s=15)
    assert (status["status"], status["error"]) == ("failed", "deadline of 1.5s exceeded")
    assert status["ended_ms"] - status["created_ms"] >= 1500, status


async def test_a_long_timer_waits_in_hops_so_an_ended_program_leaves_one_hop_behind(
    cluster: Router, settings: Settings
) -> None:
    # A day's deadline waited a day in the broker, whenever its program ended: at 100
    # programs a second, 8.6 million messages held for nothing.
    submitted = await cluster.submit({"deadline_s": 86400, "steps": [{"task": "add"}]}, 1)
    assert (await cluster.wait(submitted.workflow_id, timeout_s=30))["status"] == "completed"
    names = Names(settings.prefix)
    target = f"shard{submitted.shard}.queue"
    connection = await aio_pika.connect(settings.amqp_url)
    try:
        channel = await connection.channel()
        hop = await channel.declare_queue(names.delay_queue(target, MAX_TIMER_HOP_MS), passive=True)
        assert hop.declaration_result.message_count == 1
        for whole_ms in (ladder_ms(86400), ladder_floor_ms(86400)):
            channel = await connection.channel()
            with pytest.raises(aio_pika.exceptions.ChannelNotFoundEntity):
                await channel.declare_queue(names.delay_queue(target, whole_ms), passive=True)
    finally:
        await connection.close()


async def test_no_handler_runs_for_an_unknown_program_or_a_step_its_program_left(
    cluster: Router, settings: Settings, trace: Any
) -> None:
    program = {"steps": [{"task": "echo", "args": {"a": 1}}, {"task": "echo", "args": {"b": 2}}]}
    await cluster.submit(program, trace.as_input(), "moved-on")
    assert (await cluster.wait("moved-on", timeout_s=30))["status"] == "completed"
    ignored = metrics.DUPLICATES.labels("worker")._value.get()
    # Step 0's task once more, as a replay or a redelivery after a crash brings it back; and a
    # task of a program nobody submitted, on the serial lane.
    again = {"wf": "moved-on", "path": "0", "task": "echo", "args": {"a": 1}, "owner": 0}
    again["input"] = trace.as_input()
    ghost = {"wf": "nobody", "path": "0", "task": "echo", "args": {"sleep_s": 5}, "owner": 0}
    ghost["input"] = trace.as_input()
    serial = f"{settings.prefix}.tasks.serial"
    await publish(settings, serial, json.dumps(again).encode())
    await publish(settings, serial, json.dumps(ghost).encode())
    assert await dead_reasons(settings, 1) == ["nobody: no such program"]
    starts = [(e["wf"], e["path"]) for e in trace.events() if e["event"] == "start"]
    assert starts == [("moved-on", "0"), ("moved-on", "1")]
    # The late copy is counted as a duplicate ignored (it was only in the stop summary).
    assert metrics.DUPLICATES.labels("worker")._value.get() == ignored + 1
    # Nor does the lane say it runs them (it wrote the mark before checking, once).
    mark = await cluster.store.client.get(cluster.store.keys.lane("serial"))
    assert mark is not None and mark.startswith("moved-on 1 echo "), mark


async def test_a_task_whose_item_is_read_from_an_output_never_recorded_is_parked(
    cluster: Router, settings: Settings, trace: Any
) -> None:
    """`item_from` (a compensation's large item) names an output that is not there: parked
    with the reason, its handler never run. (On any other path than a compensation's it is
    refused as it arrives: tests/test_wire_format.py.)"""
    undo = {"task": "echo", "args": {"sleep_s": 30}, "pool": "parallel"}
    program = {"steps": [{"task": "echo", "compensate": undo}, {"task": "boom"}]}
    wf = (await cluster.submit(program)).workflow_id
    await until(lambda: cluster.status(wf), lambda s: s["status"] == "compensating")
    owner = (await cluster.status(wf))["owner"]
    forged = {"wf": wf, "path": "saga:0", "index": 1, "size": 2, "task": "echo", "owner": owner}
    forged |= {"item_from": {"step": 0, "index": 7}, "input": trace.as_input()}
    await publish(settings, f"{settings.prefix}.tasks.serial", json.dumps(forged).encode())
    assert await dead_reasons(settings, 1) == [f"{wf}: no output of step 0/bag:7 for its item"]
    assert trace.events() == []
    await cluster.cancel(wf, stop_compensations=True)


async def test_a_retry_of_no_program_is_parked_by_a_worker_whose_redis_holds_none(
    cluster: Router, settings: Settings, trace: Any
) -> None:
    """A retry that outlived its program is dropped as gone; but a worker given another Redis
    (or database) finds no program at all, and dropping its retries would lose them: they are
    parked, to be sent back once it is mended."""
    retry = {"wf": "elsewhere", "path": "0", "task": "echo", "args": {}, "owner": 0, "attempt": 1}
    retry["input"] = trace.as_input()
    await publish(settings, f"{settings.prefix}.tasks.parallel", json.dumps(retry).encode())
    assert await dead_reasons(settings, 1) == [
        "elsewhere: no such program, nor any of this prefix in this Redis"
    ]
    assert [e for e in trace.events() if e["event"] == "start"] == []


async def test_a_wait_for_a_slot_that_outlived_its_program_is_dropped_a_first_try_parked(
    cluster: Router, settings: Settings, trace: Any
) -> None:
    """A task that waited for a per-key slot comes back through the delay ladder, as a retry
    does, and may outlive its program: dropped. A first try of no program is parked."""
    await cluster.submit({"steps": [{"task": "echo"}]}, trace.as_input(), "here")  # a program
    assert (await cluster.wait("here", timeout_s=30))["status"] == "completed"
    limit = {"key": "k", "max": 1, "waits": 3}
    waited = {"wf": "purged", "path": "0", "task": "echo", "args": {}, "owner": 0, "limit": limit}
    first = {"wf": "never", "path": "0", "task": "echo", "args": {}, "owner": 0}
    for task in (waited, first):
        task["input"] = trace.as_input()
        await publish(settings, f"{settings.prefix}.tasks.parallel", json.dumps(task).encode())
    assert await dead_reasons(settings, 1) == ["never: no such program"]
    await asyncio.sleep(0.5)
    assert await dead_reasons(settings, 1) == ["never: no such program"]  # still the one
    assert [e["wf"] for e in trace.events() if e["event"] == "start"] == ["here"]


async def test_forged_messages_a_probe_found_looping_are_refused_on_their_first_delivery(
    cluster: Router, settings: Settings, trace: Any
) -> None:
    """Each of these used to be tried SHARDFLOW_DELIVERY_LIMIT times (a forged task's handler
    ran each time), or wedged its program; each is now refused as poison at once, with a
    reason that names the fault, and the programs go on."""
    names = Names(settings.prefix)
    waiting = await cluster.submit({"steps": [{"signal": "go"}]}, None, "no-timer")
    slow = {"steps": [{"task": "echo", "args": {"sleep_s": 1.0}}, {"task": "echo"}]}
    running = await cluster.submit(slow, trace.as_input(), "foreign-owner")
    other = (running.shard + 1) % settings.shards
    for _ in range(100):  # a task for step 0 is current once step 0 runs (for 1 s)
        if any(e["event"] == "start" for e in trace.events()):
            break
        await asyncio.sleep(0.05)
    forged_task = {"wf": "foreign-owner", "path": "0", "task": "echo", "owner": other}
    forged_task["input"] = trace.as_input()
    await publish(settings, names.task_queue("parallel"), json.dumps(forged_task).encode())
    to_shard = [
        (waiting.shard, b'{"kind": "wake", "wf": "no-timer", "path": "0"}'),
        (running.shard, b'{"kind": "failed", "wf": "foreign-owner", "path": "0", '
                        b'"error": "forged", "iteration": -5}'),
        (running.shard, b'{"kind": "next", "wf": "foreign-owner", "path": "0", '
                        b'"output": {"v": NaN}}'),
    ]  # fmt: skip
    for shard, body in to_shard:
        await publish(settings, str(shard), body, exchange=names.orchestrator_exchange)
    reasons = sorted(await dead_reasons(settings, 4))
    assert reasons == sorted([
        f"foreign-owner: reports to shard {other}, but its owner is shard {running.shard}",
        "no-timer: step 0 is a signal without a timeout",
        "failed.iteration: Input should be greater than or equal to 0",
        "message: NaN is not JSON",
    ]), reasons  # fmt: skip
    assert (await cluster.wait("foreign-owner", timeout_s=30))["status"] == "completed"
    starts = [e["path"] for e in trace.events() if e["event"] == "start"]
    assert starts == ["0", "1"]  # the forged task never ran
    await cluster.signal("no-timer", "go", {"ok": True})
    assert (await cluster.wait("no-timer", timeout_s=30))["result"] == {"ok": True}


async def test_a_handler_returning_nan_fails_its_task_instead_of_reporting_non_json(
    cluster: Router,
) -> None:
    await cluster.submit({"steps": [{"task": "not_json"}]}, None, "nan-output")
    status = await cluster.wait("nan-output", timeout_s=30)
    assert status["status"] == "failed"
    assert "output is not JSON: Out of range float values" in status["error"], status["error"]


async def test_an_input_as_deep_as_the_ingress_takes_with_a_big_number_runs_to_its_end(
    cluster: Router,
) -> None:
    # Its task messages hold the input a level deeper than 64, and 1e100 sends them to the
    # number check, which once refused them as too deep: the program never ran a step.
    value: Any = 1e100
    for _ in range(64):
        value = [value]
    program = {"steps": [{"task": "echo"}, {"task": "echo"}]}
    await cluster.submit(program, value, "deep-input")
    status = await cluster.wait("deep-input", timeout_s=30)
    assert status["status"] == "completed", status
    assert status["result"]["prev"] == {"args": {}, "prev": None}
