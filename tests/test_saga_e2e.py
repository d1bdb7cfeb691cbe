"""Saga compensation on a real cluster: a failure or a cancel undoes the steps that completed,
last first (a bag's compensations side by side), each with its own retries; the program ends
compensated, or compensation_failed when a compensation runs out of tries; status and explain
show the compensations; a program that compensated is not redriven."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from orchestrator.marks import redis_of
from router.client import Router
from router.explain import explain_text
from router.redriving import RedriveError
from tests import app
from tests.polling import until
from worker.registry import Registry

pytestmark = pytest.mark.e2e
BOOKING = Path(__file__).parent.parent / "examples" / "booking.json"


@pytest.fixture
def registry() -> Registry:
    """The test tasks and the examples' (examples/booking.json runs here as written)."""
    return Registry.from_modules(["tests.app", "examples.tasks"])


def _undo(**args: Any) -> dict[str, Any]:
    return {"task": "undo", "args": args, "pool": "parallel"}


# Step 0 and two members of the bag at step 1 name compensations; member 2 names none; the
# program fails at step 2 (boom, tried twice).
SAGA = {
    "steps": [
        {"task": "echo", "args": {"n": 0}, "compensate": _undo(of="0")},
        {
            "bag": [
                {"task": "echo", "args": {"m": 0}, "compensate": _undo(of="1/0", sleep_s=0.2)},
                {"task": "echo", "args": {"m": 1}, "compensate": _undo(of="1/1", sleep_s=0.2)},
                {"task": "echo", "args": {"m": 2}},
            ]
        },
        {"task": "boom", "retry": {"max_attempts": 2, "backoff_s": 0.05}},
    ]
}


def _events(trace: app.Trace, wf: str) -> list[dict[str, Any]]:
    return [e for e in trace.events() if e["wf"] == wf]


async def test_a_failure_undoes_the_completed_steps_last_first_and_ends_compensated(
    cluster: Router, trace: app.Trace
) -> None:
    wf = (await cluster.submit(SAGA, trace.as_input())).workflow_id
    status = await cluster.wait(wf, timeout_s=60)
    assert status["status"] == "compensated", status
    assert "boom" in status["error"]
    saga = status["compensations"]
    assert saga["cause"] == "failed" and saga["error"] is None
    assert saga["groups"] == [
        {"path": "saga:1", "undoes": 1, "tasks": ["undo (member 0)", "undo (member 1)"],
         "state": "done"},
        {"path": "saga:0", "undoes": 0, "tasks": ["undo"], "state": "done"},
    ]  # fmt: skip
    events = _events(trace, wf)
    seq = {(e["path"], e["index"], e["event"]): e["seq"] for e in events}
    boom = max(e["seq"] for e in events if e["path"] == "2")
    # The bag's two compensations ran side by side, after the failure, and before step 0's.
    assert boom < seq[("saga:1", 0, "start")] < seq[("saga:1", 1, "end")]
    assert seq[("saga:1", 1, "start")] < seq[("saga:1", 0, "end")]
    assert max(seq[("saga:1", 0, "end")], seq[("saga:1", 1, "end")]) < seq[("saga:0", 0, "start")]
    assert not [e for e in events if e["path"] == "saga:1" and e["index"] == 2]
    # Each received the output of what it undoes as its item.
    redis = redis_of(cluster.store)
    keys = cluster.store.keys
    undone = [json.loads(await redis.get(keys.output(wf, "saga:1", i))) for i in (0, 1)]
    assert [u["undid"] for u in undone] == [
        {"args": {"m": 0}, "prev": {"args": {"n": 0}, "prev": None}},
        {"args": {"m": 1}, "prev": {"args": {"n": 0}, "prev": None}},
    ]
    first = json.loads(await redis.get(keys.output(wf, "saga:0", 0)))
    assert first["undid"] == {"args": {"n": 0}, "prev": None} and first["args"]["of"] == "0"
    text = explain_text(await cluster.explain(wf))
    assert "Compensations (the program failed), last step first:" in text
    assert "saga:1 undoes step 1: undo (member 0), undo (member 1): done" in text
    assert await redis.pttl(keys.state(wf)) > 0, "an ended saga's keys expire"
    with pytest.raises(RedriveError, match="compensated"):
        await cluster.redrive(wf)


async def test_the_booking_example_releases_what_it_reserved(cluster: Router) -> None:
    declined = {"trip": "t1", "card": "4000-0000", "amount": 420}
    wf = (await cluster.submit(BOOKING.read_text(), declined)).workflow_id
    status = await cluster.wait(wf, timeout_s=60)
    assert status["status"] == "compensated", status
    assert "card 4000-0000 declined" in status["error"]
    tasks = [g["tasks"] for g in status["compensations"]["groups"]]
    assert tasks == [
        ["booking.release_hotel (member 0)", "booking.release_car (member 1)"],
        ["booking.release_flight"],
    ]
    redis, keys = redis_of(cluster.store), cluster.store.keys
    released = [await redis.get(keys.output(wf, "saga:1", i)) for i in (0, 1)]
    released.append(await redis.get(keys.output(wf, "saga:0", 0)))
    assert [json.loads(r)["released"] for r in released] == ["HT-t1", "CR-t1", "FL-t1"]
    paid = {**declined, "card": "4000-1234"}
    status = await cluster.wait((await cluster.submit(BOOKING.read_text(), paid)).workflow_id, 60)
    assert (status["status"], status["result"]["charged"]) == ("completed", 420)
    assert "compensations" not in status


async def test_a_compensation_out_of_tries_ends_compensation_failed(
    cluster: Router, trace: app.Trace
) -> None:
    program = json.loads(json.dumps(SAGA))
    # Member 1's compensation fails twice (its two tries); member 0's is tried again and works.
    bag = program["steps"][1]["bag"]
    bag[0]["compensate"] = {**_undo(fail_first=1), "retry": {"max_attempts": 3, "backoff_s": 0}}
    bag[1]["compensate"] = {**_undo(fail_first=9), "retry": {"max_attempts": 2, "backoff_s": 0}}
    wf = (await cluster.submit(program, trace.as_input())).workflow_id
    status = await cluster.wait(wf, timeout_s=60)
    assert status["status"] == "compensation_failed", status
    saga = status["compensations"]
    assert "step saga:1/bag:1: task 'undo' failed 2 attempts" in saga["error"]
    assert [g["state"] for g in saga["groups"]] == ["failed", "skipped"]
    # Step 0 was never undone: the program says so, and its compensation never ran.
    assert not [e for e in _events(trace, wf) if e["path"] == "saga:0"]
    text = explain_text(await cluster.explain(wf))
    assert "Compensation error: compensation step saga:1/bag:1" in text


async def test_a_cancel_undoes_what_completed_and_a_cancel_with_stop_stops_it(
    cluster: Router, trace: app.Trace
) -> None:
    program = {
        "steps": [
            {"task": "echo", "args": {"n": 0}, "compensate": _undo(sleep_s=30)},
            {"sleep_s": 60},
        ]
    }
    wf = (await cluster.submit(program, trace.as_input())).workflow_id

    await until(lambda: cluster.status(wf), lambda s: s["cursor"] == "1")
    status = await cluster.cancel(wf, "plans changed")
    assert status["status"] == "compensating"
    assert status["compensations"]["cause"] == "cancelled"

    async def events() -> dict[str, Any]:
        return {"events": _events(trace, wf)}

    await until(events, lambda found: any(e["path"] == "saga:0" for e in found["events"]))
    explained = await cluster.explain(wf)
    assert "its compensations of step 0: undo (at saga:0)" in explained["waiting_for"]
    status = await cluster.cancel(wf, "plans changed")  # a retry changes nothing
    assert status["status"] == "compensating" and "changed nothing" in status["note"]
    status = await cluster.cancel(wf, "enough", stop_compensations=True)
    assert status["status"] == "compensation_failed"
    assert status["compensations"]["error"] == "compensations stopped by a cancel: enough"
    assert status["error"] == "plans changed"
    assert [g["state"] for g in status["compensations"]["groups"]] == ["failed"]
    ended = await cluster.wait(wf, timeout_s=10)
    assert ended["status"] == "compensation_failed"


async def test_a_failure_before_anything_completed_stays_a_plain_failure(
    cluster: Router,
) -> None:
    program = {"steps": [{"task": "boom", "compensate": _undo()}, {"task": "echo"}]}
    wf = (await cluster.submit(program)).workflow_id
    status = await cluster.wait(wf, timeout_s=30)
    assert status["status"] == "failed" and "compensations" not in status
    assert (await cluster.redrive(wf))["status"] in ("pending", "running", "failed")


async def test_a_bag_member_running_when_its_bag_fails_ends_and_is_undone(
    cluster: Router, trace: app.Trace
) -> None:
    """Member 0 still runs when member 1 fails the bag: the compensations wait for it to end,
    record its output, and undo it (lua/begin.lua)."""
    program = {
        "steps": [
            {
                "bag": [
                    {"task": "echo", "args": {"m": 0, "sleep_s": 1.5}, "compensate": _undo()},
                    {"task": "boom"},
                ]
            }
        ]
    }
    wf = (await cluster.submit(program, trace.as_input())).workflow_id
    explained = await until(
        lambda: cluster.explain(wf), lambda found: found["status"] == "compensating"
    )
    if not any(e["path"] == "0" and e["event"] == "end" for e in _events(trace, wf)):
        assert "1 started task(s) of step 0 to end" in explained["waiting_for"], explained
        assert explained["compensations"]["waiting_for"] == 1
    status = await cluster.wait(wf, timeout_s=30)
    assert status["status"] == "compensated", status
    assert status["compensations"]["groups"] == [
        {"path": "saga:0", "undoes": 0, "tasks": ["undo (member 0)"], "state": "done"}
    ]
    seq = {(e["path"], e["index"], e["event"]): e["seq"] for e in _events(trace, wf)}
    assert seq[("0", 0, "end")] < seq[("saga:0", 0, "start")], seq
    redis, keys = redis_of(cluster.store), cluster.store.keys
    undone = json.loads(await redis.get(keys.output(wf, "saga:0", 0)))
    assert undone["undid"]["args"] == {"m": 0, "sleep_s": 1.5}


async def test_a_task_running_when_its_program_is_cancelled_ends_and_is_undone(
    cluster: Router, trace: app.Trace
) -> None:
    """A cancel does not stop a running task that names a compensation: it ends, and is
    undone (a task of a step that names none is stopped, as before)."""
    program = {
        "steps": [
            {"task": "echo", "args": {"n": 0, "sleep_s": 1.5}, "compensate": _undo()},
            {"task": "echo", "args": {"n": 1}},
        ]
    }
    wf = (await cluster.submit(program, trace.as_input())).workflow_id

    async def events() -> dict[str, Any]:
        return {"events": _events(trace, wf)}

    await until(events, lambda found: any(e["path"] == "0" for e in found["events"]))
    assert (await cluster.cancel(wf, "plans changed"))["status"] == "compensating"
    status = await cluster.wait(wf, timeout_s=30)
    assert (status["status"], status["error"]) == ("compensated", "plans changed"), status
    seq = {(e["path"], e["event"]): e["seq"] for e in _events(trace, wf)}
    assert seq[("0", "end")] < seq[("saga:0", "start")], seq
    assert ("1", "start") not in seq


async def test_a_compensation_receives_an_output_over_64_kib_read_where_it_was_recorded(
    cluster: Router, trace: app.Trace
) -> None:
    """An item travels in its task message up to 64 KiB; a larger output of what a
    compensation undoes is read by its worker where the step recorded it. Such a program
    ended compensation_failed with nothing undone. A small one beside it is still carried."""
    undo = {"task": "undo"}
    bag = [
        {"task": "blob", "args": {"n": 70_000}, "compensate": undo},
        {"task": "echo", "args": {"small": True}, "compensate": undo},
    ]
    program = {
        "steps": [
            {"bag": bag},
            {"task": "blob", "args": {"n": 100_000}, "compensate": undo},
            {"task": "boom"},
        ]
    }
    wf = (await cluster.submit(program, trace.as_input())).workflow_id
    status = await cluster.wait(wf, timeout_s=20)
    assert status["status"] == "compensated", status
    undone = [e for e in trace.events() if e["event"] == "end" and e["path"].startswith("saga:")]
    assert sorted((e["path"], e["index"]) for e in undone) == [
        ("saga:0", 0),
        ("saga:0", 1),
        ("saga:1", 0),
    ]
    outputs = await cluster.store.leaf_outputs(wf, [("saga:1", 0), ("saga:0", 0), ("saga:0", 1)])
    got = [json.loads(text)["undid"] for text in outputs if text is not None]
    assert got == ["x" * 100_000, "x" * 70_000, {"args": {"small": True}, "prev": None}]
