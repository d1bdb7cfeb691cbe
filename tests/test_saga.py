"""Saga compensation step by step over the model of the scripts: the plan (last step first, a
bag's side by side, only what completed), each compensation's item, the end statuses, a
compensation's retries, cancels before and during, duplicates and stale reports, redrive."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from orchestrator.keys import Keys
from orchestrator.marks import attempt_field
from orchestrator.memory_store import MemoryStore
from orchestrator.messages import (
    MAX_ITEM_BYTES,
    Failed,
    ItemFrom,
    Next,
    Start,
    TaskMessage,
    decode_shard_message,
    decode_task,
    encode,
)
from orchestrator.plans import Plans
from orchestrator.program import ProgramError, parse_program, program_schema
from orchestrator.settings import Settings
from orchestrator.transitions import Transitions
from router.client import Router
from router.redriving import RedriveError
from tests.test_owner_steps import Recorder
from worker.context import TaskContext
from worker.pool import Worker
from worker.registry import Registry

UNDO = {"retry": {"max_attempts": 2, "backoff_s": 0}}
BOOKING = {
    "name": "booking",
    "steps": [
        {"task": "flight", "compensate": {"task": "unflight", "args": {"why": "saga"}}},
        {
            "bag": [
                {"task": "hotel", "compensate": {"task": "unhotel", **UNDO}},
                {"task": "car", "compensate": {"task": "uncar"}},
                {"task": "note"},
            ]
        },
        {"task": "charge", "retry": {"max_attempts": 2, "backoff_s": 0}},
    ],
}


class Saga:
    """One program on the model, driven as the broker and the workers would."""

    def __init__(self, program: dict[str, Any], wf: str = "trip", retention_ms: int = 0) -> None:
        self.store = MemoryStore(Keys("saga"), retention_ms=retention_ms)
        self.bus = Recorder()
        self.transitions = Transitions(self.store, self.bus, Plans(self.store, 8))
        self.router = Router(Settings(prefix="saga"), store=self.store, bus=self.bus)
        self.program = program
        self.wf = wf
        self.owner = 0

    async def submit(self) -> None:
        self.owner = (await self.router.submit(self.program, {"who": "ada"}, self.wf)).shard
        await self.shard()

    async def shard(self, redelivered: bool = False) -> list[str]:
        """Deliver every message waiting for the owner shard."""
        verdicts = []
        while self.bus.shard:
            message = decode_shard_message(self.bus.shard.pop(0))
            verdicts.append(
                await self.transitions.apply(message, redelivered=redelivered, shard=self.owner)
            )
        return verdicts

    def tasks(self) -> list[TaskMessage]:
        found = [decode_task(body) for body in self.bus.tasks]
        self.bus.tasks.clear()
        return [one for task in found for one in _members(task)]

    async def complete(self, task: TaskMessage, output: Any) -> None:
        outputs = {task.index: json.dumps(output)}
        done = await self.store.record(self.wf, task.path, task.size, outputs, task.epoch)
        if done.verdict == "late":  # its compensations may start now, as the worker says
            self.bus.shard.append(Start(wf=self.wf).model_dump_json().encode())
        if done.verdict == "fire":  # the last member: the worker reports the step done
            value = output if task.index is None else [json.loads(v) for v in done.outputs]
            self.bus.shard.append(
                Next(wf=self.wf, path=task.path, output=value, epoch=task.epoch)
                .model_dump_json()
                .encode()
            )
        await self.shard()

    async def begin(self, task: TaskMessage) -> str:
        """A worker takes the task: noted as started when it names compensations (go)."""
        assert task.undoable
        index = [task.index or 0]
        found = await self.store.begin(self.wf, task.path, index, task.epoch, task.attempt)
        return found.verdict

    async def fail(self, task: TaskMessage, error: str = "no") -> None:
        report = Failed(
            wf=self.wf, path=task.path, index=task.index, attempt=task.attempt, task=task.task,
            error=error, item=task.item, epoch=task.epoch,
        )  # fmt: skip
        await self.transitions.apply(report, redelivered=False, shard=self.owner)
        await self.shard()

    async def state(self) -> dict[str, str]:
        return await self.store.state(self.wf)


def _members(task: TaskMessage) -> list[TaskMessage]:
    """A chunked message as its members, one message each, as a worker splits it."""
    return task.split()


async def _to_charge(saga: Saga) -> TaskMessage:
    """Run the booking to its charge: every step before it completes."""
    await saga.submit()
    [flight] = saga.tasks()
    await saga.complete(flight, {"flight": "F1"})
    members = {t.task: t for t in saga.tasks()}
    for name, member in sorted(members.items()):
        await saga.complete(member, {name: f"{name}-1"})
    [charge] = saga.tasks()
    assert charge.task == "charge"
    return charge


async def test_a_failure_undoes_the_completed_steps_last_first_a_bags_side_by_side() -> None:
    saga = Saga(BOOKING, retention_ms=60_000)
    charge = await _to_charge(saga)
    await saga.fail(charge, "declined")
    retry = saga.tasks()
    await saga.fail(retry[0], "declined again")
    state = await saga.state()
    assert state["status"] == "compensating" and state["cause"] == "failed"
    assert "declined again" in state["error"]
    assert not saga.store.ttl, "a compensating program's keys do not expire yet"
    # Group 1 (the bag's): its two compensating members side by side, each with its output.
    group = saga.tasks()
    assert {(t.path, t.task, t.index, json.dumps(t.item)) for t in group} == {
        ("saga:1", "unhotel", 0, '{"hotel": "hotel-1"}'),
        ("saga:1", "uncar", 1, '{"car": "car-1"}'),
    }
    assert all(t.input == {"who": "ada"} and t.prev is None for t in group)
    # The hotel's compensation fails once and is tried again by its own policy.
    unhotel = next(t for t in group if t.task == "unhotel")
    await saga.fail(unhotel, "busy")
    [again] = saga.tasks()
    assert (again.task, again.attempt, again.item) == ("unhotel", 1, {"hotel": "hotel-1"})
    for task in [again, next(t for t in group if t.task == "uncar")]:
        await saga.complete(task, None)
    [unflight] = saga.tasks()
    assert (unflight.path, unflight.args, unflight.item) == (
        "saga:0",
        {"why": "saga"},
        {"flight": "F1"},
    )
    assert (await saga.router.status(saga.wf))["compensations"]["groups"] == [
        {"path": "saga:1", "undoes": 1, "tasks": ["unhotel (member 0)", "uncar (member 1)"],
         "state": "done"},
        {"path": "saga:0", "undoes": 0, "tasks": ["unflight"], "state": "running"},
    ]  # fmt: skip
    await saga.complete(unflight, "released")
    state = await saga.state()
    assert state["status"] == "compensated" and "ended_ms" in state
    assert saga.store.ttl, "an ended saga's keys expire as any ended program's"
    status = await saga.router.status(saga.wf)
    assert [g["state"] for g in status["compensations"]["groups"]] == ["done", "done"]
    with pytest.raises(RedriveError, match="compensated"):
        await saga.router.redrive(saga.wf)


async def test_an_output_over_64_kib_is_named_where_it_is_read_not_carried() -> None:
    """A compensation's message stays small: an item over MAX_ITEM_BYTES is read by its
    worker where the step recorded it (`item_from`), a chunk's member's and a retry's too; a
    small one is carried."""
    saga = Saga(BOOKING)
    saga.transitions.chunk_for = lambda pool: 8  # a backlog: a group goes in one message
    await saga.submit()
    [flight] = saga.tasks()
    await saga.complete(flight, {"flight": "F"})
    members = {t.task: t for t in saga.tasks()}
    hotel, car = {"hotel": "h" * MAX_ITEM_BYTES}, {"car": "c" * MAX_ITEM_BYTES}
    await saga.complete(members["hotel"], hotel)
    await saga.complete(members["car"], car)
    await saga.complete(members["note"], None)
    [charge] = saga.tasks()
    await saga.fail(charge, "declined")
    await saga.fail(saga.tasks()[0], "declined again")
    [body] = saga.bus.tasks  # the group's two members, chunked
    assert len(body) < 4096
    group = {t.task: t for t in saga.tasks()}
    assert (group["unhotel"].item, group["unhotel"].item_from) == (None, ItemFrom(step=1, index=0))
    assert (group["uncar"].item, group["uncar"].item_from) == (None, ItemFrom(step=1, index=1))
    await saga.fail(group["unhotel"], "busy")
    [again] = saga.tasks()
    assert (again.attempt, again.item, again.item_from) == (1, None, ItemFrom(step=1, index=0))
    # A worker reads each where it is (a chunk's member too) and hands it to its handler.
    given: dict[str, Any] = {}

    def undo(ctx: TaskContext) -> None:
        given[ctx.args.get("why", "") or str(ctx.index)] = ctx.item

    worker = Worker(
        Settings(prefix="saga"), Registry({"unhotel": undo, "uncar": undo, "unflight": undo}),
        pool="parallel", store=saga.store, bus=saga.bus,
    )  # fmt: skip
    reports = await worker.run_tasks([again, group["uncar"]], redelivered=False)
    assert given == {"0": hotel, "1": car}
    saga.bus.shard.extend(encode(report) for report in reports)
    await saga.shard()
    [unflight] = saga.tasks()
    assert (unflight.item, unflight.item_from) == ({"flight": "F"}, None)
    await worker.run_tasks([unflight], redelivered=False)
    assert given["saga"] == {"flight": "F"}


async def test_duplicates_and_late_reports_change_nothing() -> None:
    saga = Saga(BOOKING)
    charge = await _to_charge(saga)
    await saga.fail(charge)
    [retry] = saga.tasks()
    await saga.fail(retry)
    group = saga.tasks()
    # A late report of the step that failed, and a duplicate start, change nothing.
    late = Next(wf=saga.wf, path="1", output=[1, 2, 3])
    assert await saga.transitions.apply(late, redelivered=False, shard=saga.owner) == "stale"
    late = Next(wf=saga.wf, path="2", output=1)  # the step it failed at: its transition ran
    assert await saga.transitions.apply(late, redelivered=False, shard=saga.owner) == "replay"
    assert not saga.bus.shard and not saga.tasks()
    start = Start(wf=saga.wf)
    assert await saga.transitions.apply(start, redelivered=False, shard=saga.owner) == "replay"
    assert not saga.tasks(), "a duplicate start sent nothing"
    # Redelivered after a crash: the group is sent again (it still stands there).
    assert await saga.transitions.apply(start, redelivered=True, shard=saga.owner) == "replay"
    assert len(saga.tasks()) == 2
    for task in group:
        await saga.complete(task, None)
    [unflight] = saga.tasks()
    # The group's report again, redelivered (a crash may have cut its publish short): the
    # group after it, which still runs, is sent again; the group itself is not.
    done = Next(wf=saga.wf, path="saga:1", output=[None, None])
    assert await saga.transitions.apply(done, redelivered=True, shard=saga.owner) == "replay"
    assert saga.tasks() == [unflight]
    # A completion for a group the saga left is stale.
    stale = await saga.store.record(saga.wf, "saga:1", 2, {0: "null"})
    assert stale.verdict == "stale"
    await saga.complete(unflight, None)
    assert (await saga.state())["status"] == "compensated"
    assert await saga.transitions.apply(done, redelivered=True, shard=saga.owner) == "stale"
    last = Next(wf=saga.wf, path="saga:0", output=[None])  # the end, again: nothing owed
    assert await saga.transitions.apply(last, redelivered=True, shard=saga.owner) == "replay"
    assert not saga.tasks() and not saga.bus.shard


async def test_a_compensation_out_of_tries_ends_compensation_failed() -> None:
    saga = Saga(BOOKING)
    charge = await _to_charge(saga)
    await saga.fail(charge)
    await saga.fail(saga.tasks()[0])
    group = {t.task: t for t in saga.tasks()}
    await saga.fail(group["uncar"], "car office closed")  # no retry policy: one attempt
    state = await saga.state()
    assert state["status"] == "compensation_failed"
    assert "car office closed" in state["saga_error"] and state["cause"] == "failed"
    assert not saga.tasks(), "the groups after it do not run"
    # The hotel's compensation still reports, but nothing moves any more.
    await saga.complete(group["unhotel"], None)
    assert (await saga.state())["status"] == "compensation_failed"
    groups = (await saga.router.status(saga.wf))["compensations"]["groups"]
    assert [g["state"] for g in groups] == ["failed", "skipped"]


async def test_a_cancel_compensates_a_second_changes_nothing_and_a_stop_stops_them() -> None:
    saga = Saga(BOOKING)
    await saga.submit()
    [flight] = saga.tasks()
    await saga.complete(flight, {"flight": "F1"})
    members = saga.tasks()
    await saga.complete(members[0], {"hotel": "H"})  # the car and the note still run
    status = await saga.router.cancel(saga.wf, "changed my mind")
    assert status["status"] == "compensating"
    await saga.shard()
    [unhotel] = saga.tasks()
    assert (unhotel.path, unhotel.task, unhotel.item) == ("saga:1", "unhotel", {"hotel": "H"})
    # No worker took the car before the cancel: its report is refused, nothing to undo.
    assert (await saga.store.record(saga.wf, "1", 3, {1: "{}"})).verdict == "stale"
    # A retried cancel (or one that races a failure) changes nothing and says so.
    status = await saga.router.cancel(saga.wf, "changed my mind")
    assert status["status"] == "compensating" and "changed nothing" in status["note"]
    assert "saga_error" not in await saga.state()
    await saga.shard()  # the start sent again moves nothing: saga:1 still runs
    assert not saga.tasks()
    with pytest.raises(RedriveError, match=r"is compensating: .* not redriven"):
        await saga.router.redrive(saga.wf)
    status = await saga.router.cancel(saga.wf, "enough", stop_compensations=True)
    assert status["status"] == "compensation_failed" and "note" not in status
    state = await saga.state()
    assert state["saga_error"] == "compensations stopped by a cancel: enough"
    assert state["cause"] == "cancelled" and state["error"] == "changed my mind"
    await saga.complete(unhotel, None)
    assert not saga.tasks()


async def test_started_members_end_before_the_compensations_and_are_undone_too() -> None:
    """The hotel and the car had started when the program was cancelled; the note had not.
    The compensations wait for both (begin.lua); the car completes (late: recorded), the
    hotel fails (late: no retry); then the saga undoes the car and the flight."""
    saga = Saga(BOOKING)
    await saga.submit()
    [flight] = saga.tasks()
    await saga.complete(flight, {"flight": "F1"})
    members = {t.task: t for t in saga.tasks()}
    assert all(t.undoable for t in members.values())
    for name in ("hotel", "car"):
        assert await saga.begin(members[name]) == "go"
    assert (await saga.router.cancel(saga.wf, "changed my mind"))["status"] == "compensating"
    assert await saga.shard() == ["waiting"]
    assert not saga.tasks()
    assert (await saga.router.status(saga.wf))["compensations"]["waiting_for"] == 2
    assert await saga.begin(members["note"]) == "stale"  # nothing new starts
    await saga.complete(members["car"], {"car": "C"})
    assert not saga.tasks(), "the hotel still runs"
    await saga.fail(members["hotel"], "no rooms")
    assert (await saga.state())["status"] == "compensating"
    [uncar] = saga.tasks()
    assert (uncar.path, uncar.task, uncar.item) == ("saga:1", "uncar", {"car": "C"})
    await saga.complete(uncar, None)
    [unflight] = saga.tasks()
    await saga.complete(unflight, None)
    assert (await saga.state())["status"] == "compensated"


async def test_nothing_to_undo_ends_as_its_cause_and_can_be_redriven() -> None:
    saga = Saga(BOOKING)
    await saga.submit()
    [flight] = saga.tasks()
    await saga.fail(flight)  # the first step never completed: nothing to undo
    state = await saga.state()
    assert state["status"] == "failed" and state["from"] == "0"
    redriven = await saga.router.redrive(saga.wf)
    assert redriven["status"] == "pending"
    await saga.shard()
    [flight] = saga.tasks()
    assert flight.epoch == 1
    await saga.complete(flight, {"flight": "F2"})
    members = saga.tasks()
    await saga.fail(next(t for t in members if t.task == "hotel"))  # one attempt: failed
    # The flight of run 1 completed: it is undone, with its output of that run.
    [unflight] = saga.tasks()
    assert (unflight.path, unflight.item, unflight.epoch) == ("saga:0", {"flight": "F2"}, 1)
    await saga.complete(unflight, None)
    assert (await saga.state())["status"] == "compensated"


async def test_a_deadline_leaves_compensations_running() -> None:
    # Long enough for its start to come before it (a start past it fails the program at once:
    # with 1 ms, a slow machine's start came after it), then waited out.
    saga = Saga({**BOOKING, "deadline_s": 0.5})
    charge = await _to_charge(saga)
    deadline = decode_shard_message(saga.bus.later.pop())
    await asyncio.sleep(0.6)  # its 0.5 s have passed
    verdict = await saga.transitions.apply(deadline, redelivered=False, shard=saga.owner)
    assert verdict == "applied"
    assert (await saga.state())["status"] == "compensating"
    await saga.shard()
    assert len(saga.tasks()) == 2
    # The same deadline again (redelivered) ends nothing: the compensations go on.
    await saga.transitions.apply(deadline, redelivered=True, shard=saga.owner)
    assert (await saga.state())["status"] == "compensating"
    assert (await saga.store.record(saga.wf, charge.path, 1, {None: "1"})).verdict == "stale"


@pytest.mark.parametrize(
    ("steps", "fault"),
    [
        (
            [
                {
                    "until": "true",
                    "max_iterations": 2,
                    "steps": [{"task": "a", "compensate": {"task": "u"}}],
                }
            ],
            "steps[0].steps[0].compensate: only a top-level task",
        ),
        (
            [{"bag": [{"steps": [{"task": "a", "compensate": {"task": "u"}}]}]}],
            "steps[0].bag[0].steps[0].compensate: only a top-level task",
        ),
        (
            [{"map": "input", "task": "a", "max_items": 2, "compensate": {"task": "u"}}],
            "steps[0].compensate: a map's members cannot be compensated",
        ),
        (
            [{"task": "a", "compensate": {"task": "u", "pool": "serial"}}],
            "steps[0].compensate.pool: a compensation never runs on a serial lane",
        ),
        (
            [{"task": "a", "compensate": {"task": "u", "retry": {"max_attempts": 0}}}],
            "steps[0].compensate.retry.max_attempts",
        ),
        (
            [{"task": "a", "compensate": {"task": "u", "extra": 1}}],
            "steps[0].compensate.extra",
        ),
    ],
)
def test_compensations_are_refused_where_none_can_run(
    steps: list[dict[str, Any]], fault: str
) -> None:
    with pytest.raises(ProgramError) as caught:
        parse_program({"steps": steps})
    assert any(str(f).startswith(fault) for f in caught.value.faults), caught.value.faults


def test_compensating_tasks_count_as_the_programs_tasks_and_pools() -> None:
    program = parse_program(BOOKING)
    assert {"unflight", "unhotel", "uncar"} <= program.task_names()
    with pytest.raises(ProgramError, match="unknown task 'uncar'"):
        parse_program(BOOKING, known_tasks={"flight", "hotel", "car", "note", "charge"} | {
            "unflight", "unhotel"})  # fmt: skip


def test_the_schema_names_compensate_where_a_task_may_carry_one() -> None:
    defs = program_schema()["$defs"]
    assert defs["Compensate"]["required"] == ["task"]
    assert defs["Compensate"]["additionalProperties"] is False
    for kind in ("Task", "Member"):
        assert "compensate" in defs[kind]["properties"], kind


async def test_a_redelivered_failure_sends_the_start_a_crash_cut_short() -> None:
    """Killed between the advance to compensating and the publish of the saga's start: the
    redelivered report is stale for fail.lua, yet it sends the start again (idempotent)."""
    saga = Saga(BOOKING)
    charge = await _to_charge(saga)
    await saga.fail(charge, "declined")
    [retry] = saga.tasks()
    report = Failed(
        wf=saga.wf, path=retry.path, index=retry.index, attempt=retry.attempt,
        task=retry.task, error="declined again", item=retry.item, epoch=retry.epoch,
    )  # fmt: skip
    assert await saga.transitions.apply(report, redelivered=False, shard=saga.owner) == "applied"
    assert (await saga.state())["status"] == "compensating"
    saga.bus.shard.clear()  # the crash: the start never went out
    assert await saga.transitions.apply(report, redelivered=True, shard=saga.owner) == "stale"
    await saga.shard()
    assert {t.path for t in saga.tasks()} == {"saga:1"}
    # Once the saga moved, a redelivery owes nothing: no second start, no group sent twice.
    assert await saga.transitions.apply(report, redelivered=True, shard=saga.owner) == "stale"
    assert not saga.bus.shard and not saga.tasks()


async def test_a_groups_next_counts_only_once_every_member_is_recorded() -> None:
    """A forged (or misrouted) `next` of a group still running moves nothing: the saga
    neither skips the rest of the group nor ends compensated early."""
    saga = Saga(BOOKING)
    charge = await _to_charge(saga)
    await saga.fail(charge)
    [retry] = saga.tasks()
    await saga.fail(retry)
    unhotel, uncar = sorted(saga.tasks(), key=lambda t: t.index or 0)
    await saga.complete(unhotel, None)  # the car's undo still runs
    forged = Next(wf=saga.wf, path="saga:1", output=[None, None])
    assert await saga.transitions.apply(forged, redelivered=False, shard=saga.owner) == "stale"
    assert await saga.transitions.apply(forged, redelivered=True, shard=saga.owner) == "stale"
    ahead = Next(wf=saga.wf, path="saga:0", output=[None])  # a group not reached yet
    assert await saga.transitions.apply(ahead, redelivered=False, shard=saga.owner) == "stale"
    assert not saga.tasks() and not saga.bus.shard
    state = await saga.store.at(saga.wf, "saga:1")
    assert (state["status"], state["cursor"]) == ("compensating", "saga:1")
    await saga.complete(uncar, None)
    [unflight] = saga.tasks()
    await saga.complete(unflight, None)
    assert (await saga.state())["status"] == "compensated"
    # A late failure of a compensation, once the program ended, is stale (not poison).
    late = Failed(
        wf=saga.wf, path="saga:1", index=1, attempt=0, task="uncar", error="late", epoch=0
    )
    assert await saga.transitions.apply(late, redelivered=False, shard=saga.owner) == "stale"


async def test_explain_names_a_compensations_attempts_and_its_pending_retry() -> None:
    saga = Saga(BOOKING)
    charge = await _to_charge(saga)
    await saga.fail(charge)
    await saga.fail(saga.tasks()[0])
    group = {t.task: t for t in saga.tasks()}
    await saga.fail(group["unhotel"], "hotel busy")  # retried (2 attempts)
    # The owner's mark of that retry (orchestrator/marks.py writes it on Redis only).
    due = {"attempt": 0, "due_ms": int(time.time() * 1000) + 60_000}
    field = attempt_field("saga:1", group["unhotel"].index)
    saga.store.data[saga.store.keys.attempts(saga.wf)] = {field: json.dumps(due)}
    explained = await saga.router.explain(saga.wf)
    assert explained is not None
    [attempt] = [a for a in explained["attempts"] if a["step"] == "saga:1"]
    assert (attempt["task"], attempt["index"]) == ("unhotel", group["unhotel"].index)
    assert attempt["failed"] == [{"attempt": 0, "error": "hotel busy"}]
    assert attempt["retry_pending"] is True
