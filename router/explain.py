"""Explaining programs: the details `status` shows, and `shardflow explain`.

Everything read is checked: Redis holds what any process (or person) wrote. The state hash and
the plan are the truth; the marks of orchestrator/marks.py (when a retry is due, who holds the
serial lane, who owns a shard) are checked against them before they are believed.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from orchestrator import saga
from orchestrator.bus import Bus, ladder_ms
from orchestrator.caches import ByText
from orchestrator.marks import attempt_field, redis_of
from orchestrator.paths import SAGA, is_saga
from orchestrator.program import (
    MAX_BRANCH_DEPTH,
    SERIAL,
    Bag,
    Branch,
    Choice,
    Map,
    Member,
    Program,
    ProgramError,
    Signal,
    Sleep,
    Step,
    Task,
    Untiloop,
    is_lane,
    parse_program,
    pool_of,
)
from orchestrator.shares import share_of, share_pool
from orchestrator.store import TERMINAL, Store
from router import redriving
from router.listing import as_int, clean

# Recorded programs, parsed once per text: `status` and `explain` read the same ones again.
_RECORDED: ByText[Program] = ByText(lambda source: parse_program(source, max_bytes=1 << 30))


def _plan_program(raw: Any) -> Program | None:
    if not isinstance(raw, dict):
        return None
    try:
        return _RECORDED.get(raw.get("program"))
    except (ProgramError, TypeError, ValueError):
        return None


SAGA_STATUSES = ("compensating", saga.COMPENSATED, saga.COMPENSATION_FAILED)
# A timer this late is no longer "due now": a wake comes within moments of its time, unless
# its message was parked or no owner takes it.
OVERDUE_MS = 10_000


async def compensations(
    store: Store, wf: str, state: dict[str, str], program: Program | None
) -> dict[str, Any] | None:
    """The saga of a program that compensates (None for any other): why (`cause`: failed or
    cancelled), a compensation's failure, and per group of compensations (last step first)
    the step it undoes, its tasks and whether it ran, runs, failed, waits or was skipped;
    before they start, how many tasks of the step it stopped at still run to their end
    (`waiting_for`: their outputs are undone too, lua/begin.lua)."""
    status = state.get("status", "")
    if program is None or not program.compensations or status not in SAGA_STATUSES:
        return None
    groups = saga.plan(program, await store.leaf_outputs(wf, saga.leaves(program)))
    cursor = await store.at(wf, f"{SAGA}:0")  # the saga's own cursor
    at = cursor.get("cursor") or cursor.get("from") or ""
    found: dict[str, Any] = {
        "cause": state.get("cause"),
        "error": state.get("saga_error"),
        "groups": saga.describe(groups, status, at),
    }
    stopped_at = state.get("from") or ""
    if status == "compensating" and not at and stopped_at.isdigit():
        found["waiting_for"] = await store.started(wf, stopped_at)
        found["stopped_at"] = int(stopped_at)
    return found


# What a cursor may point at.
Leafy = Task | Bag | Map | Sleep | Signal


@dataclass(frozen=True, slots=True)
class Loop:
    path: str
    iteration: int
    max_iterations: int


@dataclass(frozen=True, slots=True)
class Where:
    """The step a cursor names: the task or bag, and the loops around it (outermost first)."""

    step: Leafy
    loops: list[Loop]
    top: int  # the top-level step it belongs to, from 0


def locate(program: Program, path: str) -> Where | None:
    """What `path` names in the program, or None when it names no leaf of it."""
    steps: list[Step] = program.steps
    parts = path.split("/") if path else []
    loops: list[Loop] = []
    walked: list[str] = []
    top = None
    while parts:
        head, parts = parts[0], parts[1:]
        if not head.isdigit() or int(head) >= len(steps):
            return None
        step = steps[int(head)]
        top = int(head) if top is None else top
        walked.append(head)
        if not parts:
            return None if isinstance(step, Untiloop | Choice) else Where(step, loops, top)
        if isinstance(step, Choice):
            case = re.fullmatch(r"case:(\d{1,3})", parts[0])
            branch = step.branch(int(case[1])) if case else None
            if branch is None:
                return None
            walked.append(parts[0])
            steps, parts = branch, parts[1:]
            continue
        if isinstance(step, Bag):  # `2/branch:1/0`: step 0 of the branch that is member 1
            member = re.fullmatch(r"branch:(\d{1,4})", parts[0])
            found = step.bag[int(member[1])] if member and int(member[1]) < len(step.bag) else None
            if not isinstance(found, Branch):
                return None
            walked.append(parts[0])
            steps, parts = found.steps, parts[1:]
            continue
        if not isinstance(step, Untiloop) or not re.fullmatch(r"iter:\d{1,9}", parts[0]):
            return None
        iteration = int(parts[0].removeprefix("iter:"))
        loops.append(Loop("/".join(walked), iteration, step.max_iterations))
        if len(parts) == 1:  # `3/iter:4`: the wait before that iteration
            if step.interval_s is None:
                return None
            return Where(Sleep(sleep_s=step.interval_s), loops, top)
        walked.append(parts[0])
        steps, parts = step.steps, parts[1:]
    return None


def _members(step: Leafy, leaf: str) -> list[tuple[int | None, Any]]:
    if isinstance(step, Sleep | Signal):
        return []
    if isinstance(step, Bag):  # its branches run steps of their own, at their own paths
        return list(step.tasks())
    if isinstance(step, Map):  # its size was recorded when it started: `bag:<size>`
        size = as_int(leaf.removeprefix("bag:")) if leaf.startswith("bag:") else None
        return [(i, step) for i in range(min(size or 0, step.max_items))]
    return [(None, step)]


class _Reads:
    """Plain reads of a program's keys in one round trip, on Redis or on the model's dict."""

    def __init__(self, store: Store) -> None:
        self.client = redis_of(store)
        self.data: dict[str, Any] | None = getattr(store, "data", None)

    @property
    def available(self) -> bool:
        return self.client is not None or self.data is not None

    async def many(self, calls: list[tuple[str, str]]) -> list[Any]:
        """Each (command, key) of hgetall, smembers, get, exists: its answer, in order."""
        if self.client is not None:
            async with self.client.pipeline(transaction=False) as pipe:
                for command, key in calls:
                    getattr(pipe, command)(key)
                return list(await pipe.execute())
        answers: list[Any] = []
        for command, key in calls:
            value = (self.data or {}).get(key)
            if command == "exists":
                answers.append(int(value is not None))
            elif command == "hgetall":
                answers.append(dict(value) if isinstance(value, dict) else {})
            elif command == "smembers":
                answers.append(set(value) if isinstance(value, set) else set())
            else:
                answers.append(value if isinstance(value, str) else None)
        return answers


@dataclass(slots=True)
class Details:
    """What a program's state, plan and marks say about its steps and attempts."""

    steps: int | None = None
    step: dict[str, Any] | None = None
    attempts: list[dict[str, Any]] = field(default_factory=list)
    program: Program | None = None
    where: Where | None = None


async def details(
    store: Store, wf: str, state: dict[str, str], raw_plan: Any, now_ms: float | None = None
) -> Details:
    """The current step (task names, loop iterations, bag members done) and every failed
    attempt the owner recorded, including those of tasks that later succeeded. `now_ms`: on
    Redis's clock (this process's when not given)."""
    program = _plan_program(raw_plan)
    found = Details(program=program)
    if program is None:
        return found
    found.steps = len(program.steps)
    reads = _Reads(store)
    cursor = state.get("cursor") or ""
    where = locate(program, cursor) if cursor else None
    found.where = where
    calls = [("hgetall", store.keys.attempts(wf)), ("hgetall", store.keys.limit_waits(wf))]
    if where is not None:
        calls.append(("hgetall", store.keys.failures(wf, cursor)))
        if isinstance(where.step, Bag | Map):
            calls.append(("smembers", store.keys.barrier(wf, cursor)))
        else:
            calls.append(("exists", store.keys.output(wf, cursor)))
    answers = await reads.many(calls) if reads.available else [{}] * len(calls)
    marks: dict[str, str] = answers[0] or {}
    slot_waits: dict[str, str] = answers[1] or {}
    answers = [answers[0], *answers[2:]]
    # The open bag's branches, each at a cursor of its own (nested ones under theirs).
    branches: list[dict[str, Any]] = []
    if where is not None and isinstance(where.step, Bag) and reads.available:
        finished = {as_int(i) for i in answers[2] or ()}
        branches = await _branches(store, reads, wf, program, cursor, where.step, finished)
    # The cursors a task may run at now: the program's, and its open branches'.
    cursors = {cursor} | set(_cursors(branches))
    failed_paths = sorted({_split_field(name)[0] for name in marks})
    errors = (
        await reads.many([("hgetall", store.keys.failures(wf, path)) for path in failed_paths])
        if failed_paths and reads.available
        else []
    )
    errors_of = dict(zip(failed_paths, errors, strict=True))
    undoing: dict[str, list[str]] = {}  # a compensation's leaf: its group's tasks, in order
    if any(is_saga(path) for path in failed_paths):
        undoing, saga_at = await _saga_tasks(store, wf, state, program)
        cursors |= {saga_at} - {""}
    now = time.time() * 1000 if now_ms is None else now_ms
    for name in sorted(marks, key=_field_order):
        path, index = _split_field(name)
        mark = _mark(marks[name])
        spot = locate(program, path)
        task = _task_name(spot, index)
        if is_saga(path):  # locate() reads the program's steps; a group is made at runtime
            names = undoing.get(path, [])
            task = names[index] if index is not None and 0 <= index < len(names) else None
        failed = _failed(errors_of.get(path) or {}, index)
        if not failed and mark is not None:  # its errors went with an old loop iteration
            failed = [{"attempt": a, "error": None} for a in range(mark["attempt"] + 1)]
        due = mark["due_ms"] if mark else None
        found.attempts.append(
            {
                "step": path,
                "index": index,
                "task": task,
                "failed": failed,
                "retry_due_ms": due,
                "retry_pending": bool(due and due > now and path in cursors),
            }
        )
    if where is not None:
        here_errors: dict[str, str] = answers[1] or {}
        done_marker = answers[2]
        listed = _members(where.step, state.get("leaf") or "")
        if isinstance(where.step, Sleep | Signal):
            done = []
        elif not isinstance(where.step, Task):
            # bag member indices (tasks and branches), or a map's items
            size = len(where.step.bag) if isinstance(where.step, Bag) else len(listed)
            members = {as_int(i) for i in done_marker or ()}
            done = sorted(i for i in members if i is not None and 0 <= i < size)
        else:
            done = [0] if done_marker else []
        tasks = []
        leaf = where.step
        for index, member in listed:  # none for a sleep or a signal
            position = 0 if index is None else index
            failed = _failed(here_errors, index)
            mark = _mark(marks.get(attempt_field(cursor, index), ""))
            retry = member.retry
            tasks.append(
                {
                    "index": index,
                    "task": member.task,
                    "pool": "" if isinstance(leaf, Sleep | Signal) else pool_of(leaf, index),
                    "done": position in done,
                    "attempt": (max(f["attempt"] for f in failed) + 1) if failed else 0,
                    "max_attempts": retry.max_attempts if retry else 1,
                    "failed": failed,
                    "retry_due_ms": mark["due_ms"] if mark else None,
                    "limit": _slot_wait(slot_waits.get(attempt_field(cursor, index), "")),
                }
            )
        await _held_now(store, tasks)
        updated = as_int(state.get("updated_ms"))
        found.step = {
            "path": cursor,
            "id": where.step.id,  # the name later steps read it by, if it has one
            "top": where.top,
            "kind": _kind(where.step),
            "pool": _pool(where.step),  # a bag's own; a member may name another
            "wakes_ms": _wakes_ms(where.step, updated),
            "signal": where.step.signal if isinstance(where.step, Signal) else None,
            "tasks": tasks,
            # a bag's members count its branches; those run at cursors of their own
            "size": len(where.step.bag) if isinstance(where.step, Bag) else len(tasks),
            "done": len(done),
            "members_done": done,
            "branches": branches,
            "loops": [
                {"path": loop.path, "iteration": loop.iteration, "max": loop.max_iterations}
                for loop in where.loops
            ],
            "since_ms": updated,
            "running_s": None if updated is None else round(max(0.0, now - updated) / 1000, 3),
        }
    return found


async def _branches(
    store: Store,
    reads: _Reads,
    wf: str,
    program: Program,
    path: str,
    bag: Bag,
    finished: set[int | None],
    depth: int = 1,
) -> list[dict[str, Any]]:
    """Where each branch of the open bag at `path` stands, from its own cursor
    (`cur:<path>/branch:<i>`): `running` at its cursor, `done` (its output is in the bag's
    barrier), or `unopened` (no cursor: none was recorded for it). A running branch whose
    leaf is itself a bag with branches lists those too (at most MAX_BRANCH_DEPTH deep)."""
    members = bag.branches()
    scopes = [f"{path}/branch:{i}" for i, _ in members]
    found = await reads.many([("hgetall", store.keys.branch(wf, scope)) for scope in scopes])
    report: list[dict[str, Any]] = []
    for (i, _), scope, held in zip(members, scopes, found, strict=True):
        held = held or {}
        cursor: str = held.get("cursor") or ""
        opened = "cursor" in held
        done = i in finished or (opened and not cursor)
        status = "done" if done else ("running" if opened else "unopened")
        where = locate(program, cursor) if status == "running" else None
        updated = as_int(held.get("updated_ms"))
        entry: dict[str, Any] = {
            "index": i,
            "scope": scope,
            "status": status,
            "cursor": cursor,
            "leaf": held.get("leaf", ""),
            "kind": None if where is None else _kind(where.step),
            "task": None,
            "signal": None,
            "since_ms": updated,
            "wakes_ms": None if where is None else _wakes_ms(where.step, updated),
            "branches": [],
            "lane": None,
        }
        if where is not None:
            step = where.step
            if isinstance(step, Task | Map):
                entry["task"] = step.task
                if isinstance(step, Task) and is_lane(pool_of(step)):  # a single task's lane
                    entry["lane"] = await _lane(store, wf, pool_of(step))
            elif isinstance(step, Signal):
                entry["signal"] = step.signal
            elif isinstance(step, Bag) and step.branches() and depth < MAX_BRANCH_DEPTH:
                (inner,) = await reads.many([("smembers", store.keys.barrier(wf, cursor))])
                entry["branches"] = await _branches(
                    store, reads, wf, program, cursor, step, {as_int(k) for k in inner or ()},
                    depth + 1,
                )  # fmt: skip
        report.append(entry)
    return report


def _cursors(branches: list[dict[str, Any]]) -> list[str]:
    """The cursors of the running branches, nested ones too."""
    found: list[str] = []
    for branch in branches:
        if branch["status"] == "running":
            found.append(branch["cursor"])
            found.extend(_cursors(branch["branches"]))
    return found


def _slot_wait(text: str) -> dict[str, Any] | None:
    """A task's wait for a slot of its key (orchestrator/marks.py), if its mark reads well."""
    try:
        value = json.loads(text)
    except (TypeError, ValueError):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("key"), str):
        return None
    numbers = {name: as_int(value.get(name)) for name in ("max", "held", "waits", "at_ms")}
    if any(number is None for number in numbers.values()):
        return None
    return {"key": clean(value["key"], 300), **numbers}


async def _held_now(store: Store, tasks: list[dict[str, Any]]) -> None:
    """How many hold a slot of each key a task waits for, read now (the mark's count is as
    the task last found it)."""
    client = redis_of(store)
    waiting = [t for t in tasks if t["limit"] is not None and not t["done"]]
    if client is None or not waiting:
        return
    async with client.pipeline(transaction=False) as pipe:
        for task in waiting:
            pipe.zcard(store.keys.limit(task["limit"]["key"]))
        counts = await pipe.execute()
    for task, count in zip(waiting, counts, strict=True):
        task["limit"]["held"] = int(count)


def _kind(step: Leafy) -> str:
    return type(step).__name__.lower()


def _pool(step: Leafy) -> str | None:
    if isinstance(step, Sleep | Signal):
        return None  # a timer in the broker: no pool
    return pool_of(step)


def _wakes_ms(step: Leafy, began_ms: int | None) -> int | None:
    """When a sleep is due, or a signal step times out."""
    if began_ms is None:
        return None
    if isinstance(step, Signal) and step.timeout_s is not None:
        return began_ms + round(step.timeout_s * 1000)
    return began_ms + round(step.sleep_s * 1000) if isinstance(step, Sleep) else None


def _split_field(name: str) -> tuple[str, int | None]:
    path, sep, index = name.rpartition("/bag:")
    if sep and index.isdigit():
        return path, int(index)
    return name, None


def _field_order(name: str) -> tuple[list[Any], int]:
    path, index = _split_field(name)
    parts = [int(p) if p.isdigit() else p for p in re.split(r"[/:]", path)]
    return [(isinstance(p, str), p) for p in parts], -1 if index is None else index  # type: ignore[return-value]


def _mark(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except (TypeError, ValueError):
        return None
    if not isinstance(value, dict) or as_int(value.get("attempt")) is None:
        return None
    return {"attempt": as_int(value["attempt"]), "due_ms": as_int(value.get("due_ms"))}


def _failed(errors: dict[str, str], index: int | None) -> list[dict[str, Any]]:
    """The failed attempts of one member, from its step's failures hash (`<index>:<attempt>`)."""
    member = str(index or 0)
    found = []
    for name, error in errors.items():
        who, _, attempt = name.partition(":")
        if who == member and attempt.isdigit():
            found.append({"attempt": int(attempt), "error": error})
    return sorted(found, key=lambda f: f["attempt"])


async def _saga_tasks(
    store: Store, wf: str, state: dict[str, str], program: Program
) -> tuple[dict[str, list[str]], str]:
    """The compensations' task names per group leaf (`saga:<step>`), and the leaf the saga's
    cursor stands at while compensating ("" else): where a retry may be pending."""
    if not program.compensations:
        return {}, ""
    groups = saga.plan(program, await store.leaf_outputs(wf, saga.leaves(program)))
    names = {g.path: [u.compensate.task for u in g.undo] for g in groups}
    if state.get("status") != "compensating":
        return names, ""
    return names, (await store.at(wf, f"{SAGA}:0")).get("cursor") or ""


def _task_name(where: Where | None, index: int | None) -> str | None:
    if where is None:
        return None
    if isinstance(where.step, Bag):
        inside = index is not None and 0 <= index < len(where.step.bag)
        member = where.step.bag[index] if inside else None  # type: ignore[index]
        return member.task if isinstance(member, Member) else None
    return None if isinstance(where.step, Sleep | Signal) else where.step.task


def elapsed(state: dict[str, str], now_ms: float | None = None) -> dict[str, float | None]:
    """Seconds: since submitted (to the end, if it ended), and waiting to start."""
    now = time.time() * 1000 if now_ms is None else now_ms
    created, started, ended = (
        as_int(state.get(f)) for f in ("created_ms", "started_ms", "ended_ms")
    )
    if created is None:
        return {"elapsed_s": None, "queued_s": None}
    end = ended if ended is not None else now
    begun = started if started is not None else (ended if ended is not None else now)
    return {
        "elapsed_s": round(max(0.0, end - created) / 1000, 3),
        "queued_s": round(max(0.0, begun - created) / 1000, 3),
    }


# --- explain --------------------------------------------------------------------------------


async def explain(store: Store, bus: Bus | None, wf: str) -> dict[str, Any] | None:
    """Where a program stands and what it waits for, as JSON-ready data (None: no program)."""
    state = await store.state(wf)
    if not state:
        return None
    raw_plan = await store.plan(wf)
    # On the clock of the stamps it is compared with: a client's clock ahead of Redis's
    # called a timer overdue as it fell due.
    now = await store.now() * 1000
    found = await details(store, wf, state, raw_plan, now)
    status = state.get("status", "")
    owner = as_int(state.get("owner"))
    report: dict[str, Any] = {
        "workflow_id": wf,
        "name": state.get("name", ""),
        "status": status,
        "owner": owner,
        "created_ms": as_int(state.get("created_ms")),
        "started_ms": as_int(state.get("started_ms")),
        "updated_ms": as_int(state.get("updated_ms")),
        "ended_ms": as_int(state.get("ended_ms")),
        "error": state.get("error"),
        **elapsed(state, now),
        "steps": found.steps,
        "step": found.step,
        "attempts": found.attempts,
        "deadline": None,
        "pool": None,
        "pools": [],
        "retry_queue": None,
        "lane": None,
        "shard": None,
        "waiting_for": "",
        "priority": _priority(raw_plan),
    }
    if "epoch" in state:  # redriven: this run, and how the earlier ones ended
        report.update(run=as_int(state["epoch"]), runs=redriving.runs(state))
    program = found.program
    report["compensations"] = await compensations(store, wf, state, program)
    created = report["created_ms"]
    if program is not None and program.deadline_s is not None and created is not None:
        until = report["ended_ms"] or now  # an ended program's: what was left at its end
        since = created  # a redriven run's begins at its start (Transitions._publish_deadline)
        if report.get("run"):
            since = report["started_ms"] if status != "pending" else until
        left = program.deadline_s - (until - (since or until)) / 1000
        report["deadline"] = {"deadline_s": program.deadline_s, "left_s": round(left, 3)}
    if status not in TERMINAL and owner is not None:
        report["shard"] = await _shard(store, bus, owner)
    step = found.step
    if status == "running" and step is not None:
        if bus is not None and step["pool"] is not None:
            # The pools of the members not done yet (all of them when every one is done).
            open_pools = [t["pool"] for t in step["tasks"] if not t["done"]]
            every = [t["pool"] for t in step["tasks"]] or [step["pool"]]  # a map over none
            pools = dict.fromkeys(open_pools or every)
            share = share_of(program) if program is not None else 0
            for pool in pools:
                queue = await _queue(bus, bus.names.task_queue(share_pool(pool, share)))
                report["pools"].append({"pool": pool, **queue})
            report["pool"] = _without_name(report["pools"][0])
            waiting = [t for t in step["tasks"] if not t["done"] and t["retry_due_ms"]]
            due = [t for t in waiting if t["retry_due_ms"] > now and t["failed"]]
            if due and found.where is not None:
                first = min(due, key=lambda t: t["retry_due_ms"])
                delay_s = _retry_delay(found.where, first)
                if delay_s is not None:
                    target = share_pool(first["pool"], share)
                    name = bus.names.delay_queue(target, ladder_ms(delay_s))
                    report["retry_queue"] = await _queue(bus, name)
        if step["pool"] and is_lane(step["pool"]):
            report["lane"] = await _lane(store, wf, step["pool"])
    report["waiting_for"] = _waiting_for(report, cursor=state.get("cursor") or "", now=now)
    return report


def _retry_delay(where: Where, task: dict[str, Any]) -> float | None:
    index = task["index"]
    member = where.step.bag[index] if isinstance(where.step, Bag) else where.step
    if not isinstance(member, Member) or member.retry is None or not task["failed"]:
        return None
    return member.retry.delay_s(task["failed"][-1]["attempt"])


def _without_name(pool: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in pool.items() if key != "pool"}


def _priority(raw_plan: Any) -> int:
    """The priority the program was submitted with (recorded only when not 0)."""
    value = raw_plan.get("priority") if isinstance(raw_plan, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


async def _queue(bus: Bus, name: str) -> dict[str, Any]:
    found = await bus.queue_state(name)
    if found is None:
        return {"queue": name, "exists": False, "depth": 0, "consumers": 0}
    return {"queue": name, "exists": True, "depth": found[0], "consumers": found[1]}


async def _shard(store: Store, bus: Bus | None, shard: int) -> dict[str, Any]:
    report: dict[str, Any] = {"shard": shard, "owner": None, "owner_seen_ms": None}
    client = redis_of(store)
    if client is not None:
        mark: str | None = await client.get(store.keys.shard_owner(shard))  # type: ignore[assignment]
        who, _, seen = (mark or "").partition(" ")
        if who and as_int(seen) is not None:
            report["owner"], report["owner_seen_ms"] = clean(who, 200), as_int(seen)
    if bus is not None:
        report.update(await _queue(bus, bus.names.shard_queue(shard)))
    return report


async def _lane(store: Store, wf: str, pool: str = SERIAL) -> dict[str, Any] | None:
    """Who holds a serial lane: the lane's task started last, if its program still waits for
    it (its cursor is still there) and it does not wait for its retry; else the lane is
    free."""
    client = redis_of(store)
    if client is None:
        return None
    mark: str | None = await client.get(store.keys.lane(pool))  # type: ignore[assignment]
    parts = (mark or "").split(" ")
    if len(parts) not in (4, 5) or as_int(parts[3]) is None:
        return {"held": False}
    holder, path, task, since = parts[0], parts[1], parts[2], as_int(parts[3])
    attempt = as_int(parts[4]) if len(parts) == 5 else None  # a release before: none
    # the cursor the lane's task ran at: the program's, or its branch's (`2/branch:1/0`)
    state = await store.at(holder, path) if holder else {}
    if state.get("status") != "running" or state.get("cursor") != path:
        return {"held": False}
    # An attempt that failed holds nothing (its retry, if any, marks the lane as it starts):
    # the owner's mark of the failed attempts says whether the one marked here is among them.
    found: str | None = await client.hget(store.keys.attempts(holder), path)  # type: ignore[misc,assignment]
    failed = _mark(found or "")
    if attempt is not None and failed is not None and failed["attempt"] >= attempt:
        return {"held": False}
    return {
        "held": True,
        "workflow_id": clean(holder, 200),
        "path": clean(path, 200),
        "task": clean(task, 200),
        "since_ms": since,
        "this_program": holder == wf,
    }


def _waiting_for(report: dict[str, Any], *, cursor: str, now: float) -> str:
    """One sentence: what the program waits for."""
    status = report["status"]
    shard = report["shard"] or {}
    if status in TERMINAL:
        return f"nothing: it ended {status}"
    if status == "compensating":
        saga_now = report.get("compensations") or {}
        groups = saga_now.get("groups") or []
        now_running = [g for g in groups if g["state"] == "running"]
        if not now_running and saga_now.get("waiting_for"):
            return (
                f"{saga_now['waiting_for']} started task(s) of step {saga_now['stopped_at']} to "
                "end (their outputs are undone too), then its compensations"
            )
        if not now_running:
            return f"its compensations to start, on shard {report['owner']}"
        group = now_running[0]
        return (
            f"its compensations of step {group['undoes']}: {', '.join(group['tasks'])} "
            f"(at {group['path']})"
        )
    if status == "pending":
        if shard.get("exists") and not shard.get("consumers"):
            return f"an orchestrator: shard {report['owner']} has no consumer"
        return f"its start on shard {report['owner']}"
    step = report["step"]
    if step is None:
        shown = _quoted(clean(cursor, 200))
        return f"nothing it can name: its cursor {shown} is not a step of its plan"
    due = step["wakes_ms"]
    when = "" if due is None else _when(due, now)
    if step["kind"] == "sleep" and due is not None:
        return f"its timer: step {step['path']} sleeps until {_clock(due)} ({when})"
    if step["kind"] == "signal":
        name = step["signal"]
        until = "" if due is None else f"; it times out at {_clock(due)} ({when})"
        return (
            f"a signal {name!r} at step {step['path']}: send it with "
            f"`shardflow signal {report['workflow_id']} {name} --data JSON`{until}"
        )
    open_tasks = [t for t in step["tasks"] if not t["done"]]
    open_branches = [b for b in step.get("branches") or () if b["status"] != "done"]
    if not open_tasks and not open_branches:
        return f"shard {report['owner']} to take in that step {step['path']} is done"
    if not open_tasks:  # a bag whose open members are all branches
        labels = "; ".join(_branch_label(b) for b in open_branches[:10])
        more = f" and {len(open_branches) - 10} more" if len(open_branches) > 10 else ""
        return f"its branches of step {step['path']}: {labels}{more}{_send(report, open_branches)}"
    retries = [t for t in open_tasks if t["retry_due_ms"] and t["retry_due_ms"] > now]
    if retries and len(retries) == len(open_tasks):
        t = min(retries, key=lambda t: t["retry_due_ms"])
        return (
            f"a retry: task {t['task']!r} attempt {t['attempt'] + 1} of {t['max_attempts']} "
            f"is due at {_clock(t['retry_due_ms'])} (in {_span((t['retry_due_ms'] - now) / 1000)})"
        )
    slots = [t for t in open_tasks if t not in retries and t.get("limit")]
    if slots and len(slots) == len(open_tasks):
        limit = slots[0]["limit"]
        more = f" (and {len(slots) - 1} more task(s) for slots)" if len(slots) > 1 else ""
        return (
            f"a slot of key {_quoted(limit['key'])}: {limit['held']} of {limit['max']} held by "
            f"other tasks; {_task_label(slots[0])} tried {limit['waits']} time(s){more}"
        )
    # A pool with no consumer: its tasks wait until a worker for it starts.
    waiting_pools = {t["pool"] for t in open_tasks if t not in retries}
    for pool in report["pools"]:
        if pool["pool"] in waiting_pools and not pool["consumers"]:
            return (
                f"a worker: the {pool['pool']} pool has no consumer "
                f"({pool['depth']} message(s) queued in {pool['queue']})"
            )
    lane = report["lane"]
    if lane and lane.get("held") and not lane.get("this_program"):
        return (
            f"the {step['pool']} lane, held by program {lane['workflow_id']} "
            f"(step {lane['path']}, task {_quoted(lane['task'])})"
        )
    names = ", ".join(_task_label(t, step["pool"]) for t in open_tasks[:10])
    more = f" and {len(open_tasks) - 10} more" if len(open_tasks) > 10 else ""
    pools = {t["pool"] for t in open_tasks}
    tasks = f"{names}{more}" + (f" on the {step['pool']} pool" if pools == {step["pool"]} else "")
    if open_branches:
        labels = "; ".join(_branch_label(b) for b in open_branches[:10])
        more = f" and {len(open_branches) - 10} more" if len(open_branches) > 10 else ""
        return f"{tasks}; and its branches: {labels}{more}"
    return tasks


def _send(report: dict[str, Any], branches: list[dict[str, Any]]) -> str:
    """`; send it with `shardflow signal ...``: for the signals its branches (nested ones too)
    wait for, as a signal step's line says."""
    names: list[str] = []
    stack = list(branches)
    while stack and len(names) <= 5:  # the report bounds its branches; this, the walk's length
        branch = stack.pop(0)
        if branch.get("status") != "running":
            continue
        if branch.get("signal") is not None and branch["signal"] not in names:
            names.append(branch["signal"])
        stack.extend(branch.get("branches") or ())
    if not names:
        return ""
    wf = report["workflow_id"]
    if len(names) == 1:
        return f"; send it with `shardflow signal {wf} {names[0]} --data JSON`"
    more = ", ..." if len(names) > 5 else ""
    shown = ", ".join(repr(name) for name in names[:5]) + more
    return f"; send them with `shardflow signal {wf} NAME --data JSON` (NAME: {shown})"


def _branch_label(branch: dict[str, Any]) -> str:
    """`branch 1 at step 2/branch:1/0 (a wait for signal 'go')`."""
    if branch["status"] != "running":
        return f"branch {branch['index']} ({branch['status']})"
    kind = branch["kind"]
    lane = branch.get("lane") or {}
    if branch["task"] is not None and lane.get("held") and not lane.get("this_program"):
        what = (
            f"task {branch['task']!r}, waiting for its lane, held by program "
            f"{lane['workflow_id']} (step {lane['path']}, task {_quoted(lane['task'])})"
        )
    elif branch["task"] is not None:
        what = f"{'a map of ' if kind == 'map' else ''}task {branch['task']!r}"
    elif branch["signal"] is not None:
        what = f"a wait for signal {branch['signal']!r}"
    elif kind == "bag":
        inner = [b for b in branch["branches"] if b["status"] != "done"]
        what = "a bag" + (f" with {len(inner)} branch(es) open" if inner else "")
    else:
        what = "a sleep" if kind == "sleep" else "a step not in its plan"
    return f"branch {branch['index']} at step {clean(branch['cursor'], 200)} ({what})"


def _task_label(task: dict[str, Any], step_pool: str | None = None) -> str:
    """`member 1 task 'echo' (attempt 1 of 3)`; its pool too when not `step_pool`."""
    member = "" if task["index"] is None else f"member {task['index']} "
    attempt = f"attempt {task['attempt'] + 1} of {task['max_attempts']}"
    pool = task.get("pool", step_pool)
    where = f" on the {pool} pool" if step_pool is not None and pool != step_pool else ""
    return f"{member}task {task['task']!r} ({attempt}){where}"


def _clock(ms: float) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _when(due: int, now: float) -> str:
    """`in 3.0 s`, `due now`; or, well past it, that it is late and where its timer may be."""
    if due > now:
        return f"in {_span((due - now) / 1000)}"
    if now - due < OVERDUE_MS:
        return "due now"
    return (
        f"{_span((now - due) / 1000)} overdue: is its timer's message parked (`shardflow "
        "dead`), or its shard's owner away?"
    )


def _span(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _quoted(text: str) -> str:
    """Text `clean()` escaped, in quotes: `!r` would escape its escapes again (their backslashes
    doubled)."""
    return f"'{text}'"


def explain_text(report: dict[str, Any], now_ms: float | None = None) -> str:
    """The report in plain words, one fact a line."""
    now = time.time() * 1000 if now_ms is None else now_ms
    name = f" {_quoted(clean(report['name'], 200))}" if report["name"] else ""
    lines = [f"Program {report['workflow_id']}{name} is {report['status']}."]
    if report["created_ms"] is not None:
        lines.append(
            f"Submitted {_clock(report['created_ms'])}, {_span(report['elapsed_s'] or 0)} "
            + ("before it ended." if report["status"] in TERMINAL else "ago.")
        )
    if (report["status"] in TERMINAL or report["status"] in SAGA_STATUSES) and report["error"]:
        lines.append(f"Error: {clean(report['error'], 2000)}")
    saga_report = report.get("compensations")
    if saga_report:
        lines.append(
            f"Compensations (the program {saga_report['cause'] or 'failed'}), last step first:"
        )
        for group in saga_report["groups"]:
            lines.append(
                f"  {group['path']} undoes step {group['undoes']}: "
                f"{', '.join(group['tasks'])}: {group['state']}"
            )
        if not saga_report["groups"]:
            lines.append("  none: no step that names one had completed")
        if saga_report["error"]:
            lines.append(f"Compensation error: {clean(saga_report['error'], 2000)}")
    if report.get("priority"):
        lines.append(f"Priority {report['priority']}: its tasks go before lower ones' in a pool.")
    if report.get("runs"):
        lines.append(f"This is run {report['run']}: it was redriven after the runs below.")
        for run in report["runs"]:
            where = f" at step {clean(run['step'], 200)}" if run["step"] else ""
            error = f": {clean(run['error'], 300)}" if run["error"] else ""
            lines.append(f"  Run {run['run']} ended {clean(run['status'], 20)}{where}{error}")
    step = report["step"]
    if step is not None:
        steps = report["steps"]
        if step["kind"] == "task":
            kind = f"task {step['tasks'][0]['task']!r}"
        elif step["kind"] == "map" and step["tasks"]:
            kind = f"a map of task {step['tasks'][0]['task']!r} over {step['size']} item(s)"
        elif step["kind"] in ("map", "sleep"):
            kind = "a map over no items" if step["kind"] == "map" else "a sleep"
        elif step["kind"] == "signal":
            kind = f"a wait for signal {step['signal']!r}"
        else:
            kind = f"a bag of {step['size']}"
        where = f" on the {step['pool']} pool" if step["pool"] else ""
        lines.append(
            f"At step {step['path']} (top-level step {step['top'] + 1} of {steps}"
            + (f", id {step['id']!r}" if step.get("id") else "")
            + f"): {kind}"
            f"{where}, for {_span(step['running_s'] or 0)}."
        )
        for loop in step["loops"]:
            lines.append(
                f"Loop at step {loop['path']}: iteration {loop['iteration'] + 1} "
                f"of at most {loop['max']}."
            )
        if step["kind"] in ("bag", "map"):
            done = list(step.get("members_done") or ())
            open_ = [i for i in range(step["size"]) if i not in done]
            lines.append(
                f"{step['kind'].capitalize()} members done: {step['done']} of {step['size']}"
                + (f" ({_indices(done)})" if done else "")
                + (f"; not done: {_indices(open_)}." if open_ else ".")
            )
        for branch in step.get("branches") or ():
            since = branch["since_ms"]
            running = (
                f", for {_span((now - since) / 1000)}"
                if branch["status"] == "running" and since is not None
                else ""
            )
            lines.append(f"  {_branch_label(branch).capitalize()}{running}.")
        for task in step["tasks"]:
            if task["done"]:
                continue
            label = _task_label(task)
            for failure in task["failed"]:
                lines.append(
                    f"  {label}: attempt {failure['attempt'] + 1} failed: "
                    f"{clean(failure['error'], 300)}"
                )
            slot = task.get("limit")
            if slot:
                lines.append(
                    f"  {label}: waits for a slot of key {_quoted(slot['key'])} "
                    f"({slot['held']} of {slot['max']} held; tried {slot['waits']} time(s))."
                )
            due = task["retry_due_ms"]
            if due and task["failed"]:
                when = f"in {_span((due - now) / 1000)}" if due > now else "due, queued"
                lines.append(f"  {label}: retry due at {_clock(due)} ({when}).")
    lines.append(f"Waiting for: {report['waiting_for']}.")
    pools = report.get("pools") or ([report["pool"]] if report["pool"] else [])
    queues = [("Pool", queue) for queue in pools] + [("Retry", report["retry_queue"])]
    for label, queue in queues:
        if queue is None:
            continue
        line = (
            f"{label} queue {queue['queue']}: {queue['depth']} message(s) ready, "
            f"{queue['consumers']} consumer(s)."
        )
        if label == "Pool" and not queue["consumers"] and "pool" in queue:
            line += (
                f" No worker runs it: start one with shardflow worker --pool {queue['pool']}"
                " --app MODULE."
            )
        lines.append(line)
    lane = report["lane"]
    if lane is not None:
        pool = (report["step"] or {}).get("pool") or SERIAL
        label = "Serial lane" if pool == SERIAL else f"Lane {pool}"
        if not lane["held"]:
            lines.append(f"{label}: free.")
        else:
            who = "this program" if lane["this_program"] else f"program {lane['workflow_id']}"
            lines.append(
                f"{label}: held by {who} (step {lane['path']}, task {_quoted(lane['task'])}) "
                f"since {_clock(lane['since_ms'])}."
            )
    shard = report["shard"]
    if shard is not None:
        text = f"Shard {shard['shard']}:"
        if "queue" in shard:
            text += (
                f" queue {shard['queue']} holds {shard['depth']} message(s), "
                f"{shard['consumers']} consumer(s);"
            )
        if shard["owner"]:
            seen = _span((now - shard["owner_seen_ms"]) / 1000)
            who = "last owner" if shard.get("consumers") == 0 else "owner"
            text += f" {who} {shard['owner']} (last seen {seen} ago)."
        else:
            text += " no owner seen in the last minute."
        lines.append(text)
    deadline = report["deadline"]
    if deadline is not None and report["status"] not in TERMINAL:
        lines.append(
            f"Deadline: {_span(deadline['left_s'])} left of {deadline['deadline_s']} s."
            if deadline["left_s"] > 0
            else f"Deadline: {deadline['deadline_s']} s, passed."
        )
    return "\n".join(lines)


def _indices(values: list[int]) -> str:
    shown = ", ".join(map(str, values[:20]))
    return shown + (f" … ({len(values) - 20} more)" if len(values) > 20 else "")
