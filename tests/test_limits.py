"""Per-key limits without a cluster: the format and its faults, the keys the machine
evaluates, the task messages that carry them, and a worker that finds every slot held."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from redis.exceptions import ReadOnlyError

from orchestrator import limits
from orchestrator.keys import Keys
from orchestrator.machine import Failed, Leaf, first
from orchestrator.memory_store import MemoryStore
from orchestrator.messages import KeyLimit, TaskMessage, decode_task, encode
from orchestrator.plans import Plan
from orchestrator.program import (
    MAX_LIMIT,
    MAX_LIMIT_KEY_CHARS,
    ProgramError,
    parse_program,
    program_schema,
)
from orchestrator.settings import Settings
from orchestrator.store import Slot
from orchestrator.transitions import task_messages
from worker.pool import Worker
from worker.registry import Registry

LIMIT = {"key": "input.customer", "max": 2}


@pytest.mark.parametrize(
    ("step", "fault"),
    [
        ({"task": "t", "limit": {"key": "prev.x", "max": 1}}, "steps[0].limit.key: invalid CEL: "
         "unknown variable 'prev'; use args, input, item"),
        ({"task": "t", "limit": {"key": "steps.a", "max": 1}}, "steps[0].limit.key: invalid CEL"),
        ({"task": "t", "limit": {"key": "input.c", "max": 0}}, "steps[0].limit.max: Input should "
         "be greater than or equal to 1"),
        ({"task": "t", "limit": {"key": "input.c", "max": MAX_LIMIT + 1}}, "steps[0].limit.max"),
        ({"task": "t", "limit": {"key": "input.c"}}, "steps[0].limit.max: Field required"),
        ({"task": "t", "limit": {"key": "", "max": 1}}, "steps[0].limit.key: String should have"),
        ({"task": "t", "limit": {"key": "x" * 1001, "max": 1}}, "steps[0].limit.key: String"),
        ({"task": "t", "limit": {"key": "input.c", "max": 1, "wait": 3}}, "steps[0].limit.wait: "
         "Extra inputs are not permitted"),
        ({"bag": [{"task": "t"}, {"task": "t", "limit": {"key": "input +", "max": 1}}]},
         "steps[0].bag[1].limit.key: invalid CEL"),
        ({"map": "[1]", "max_items": 1, "task": "t", "limit": {"key": 3, "max": 1}},
         "steps[0].limit.key: Input should be a valid string"),
    ],
)  # fmt: skip
def test_a_bad_limit_is_refused_naming_its_path(step: dict[str, Any], fault: str) -> None:
    with pytest.raises(ProgramError) as caught:
        parse_program({"steps": [step]})
    assert any(f.startswith(fault) for f in caught.value.faults), caught.value.faults


def test_the_schema_describes_a_limit() -> None:
    schema = program_schema()
    limit = schema["$defs"]["Limit"]
    assert set(limit["required"]) == {"key", "max"}
    assert limit["properties"]["max"]["maximum"] == MAX_LIMIT
    assert "additionalProperties" in limit and limit["additionalProperties"] is False
    assert "limit" in schema["$defs"]["Member"]["properties"]


def _leaf(program: dict[str, Any], input: Any) -> Leaf | Failed:
    outcome = first(parse_program(program), input)
    assert isinstance(outcome, Leaf | Failed)
    return outcome


def test_the_machine_evaluates_each_members_key_over_input_args_and_item() -> None:
    task = {"task": "t", "args": {"a": "x"}, "args_from": {"b": "input.n"}, "limit": {
        "key": "args.a + string(args.b) + input.c", "max": 1}}  # fmt: skip
    leaf = _leaf({"steps": [task]}, {"c": "-c", "n": 7})
    assert isinstance(leaf, Leaf) and leaf.limits == ("x7-c",)
    bag = {"bag": [{"task": "t"}, {"task": "t", "args": {"k": "m1"}, "limit": {
        "key": "args.k", "max": 1}}]}  # fmt: skip
    leaf = _leaf({"steps": [bag]}, None)
    assert isinstance(leaf, Leaf) and leaf.limits == (None, "m1")
    mapped = {"map": "['p', 'q']", "max_items": 2, "task": "t", "limit": {
        "key": "'i-' + item", "max": 1}}  # fmt: skip
    leaf = _leaf({"steps": [mapped]}, None)
    assert isinstance(leaf, Leaf) and leaf.limits == ("i-p", "i-q")
    leaf = _leaf({"steps": [{"task": "t"}]}, None)
    assert isinstance(leaf, Leaf) and leaf.limits == ()


@pytest.mark.parametrize(
    ("input", "error"),
    [
        ({"c": 3}, "step 0/bag:1: limit key 'input.c': gave int 3, not a string"),
        ({"c": None}, "step 0/bag:1: limit key 'input.c': gave null null, not a string"),
        ({"c": ""}, "step 0/bag:1: limit key 'input.c': gave a key of 0 characters: from 1 to "
         f"{MAX_LIMIT_KEY_CHARS}"),
        ({"c": "é" * (MAX_LIMIT_KEY_CHARS + 1)}, f"gave a key of {MAX_LIMIT_KEY_CHARS + 1} "
         "characters"),
        ({"c": "x" * 10_000}, "gave a value of 10002 bytes, not a key"),
        ({}, "step 0/bag:1: limit key 'input.c': no such key"),
    ],
)  # fmt: skip
def test_a_key_that_is_no_short_string_fails_the_step_naming_it(
    input: dict[str, Any], error: str
) -> None:
    bag = {"bag": [{"task": "t"}, {"task": "t", "limit": {"key": "input.c", "max": 1}}]}
    outcome = _leaf({"steps": [bag]}, input)
    assert isinstance(outcome, Failed)
    assert error in outcome.error, outcome.error


def test_members_with_a_limit_travel_alone_carrying_their_key() -> None:
    members: list[dict[str, Any]] = [{"task": f"t{i}"} for i in range(5)]
    for i in (1, 3):
        members[i]["limit"] = {"key": f"'k{i}'", "max": 2}
    program = parse_program({"steps": [{"bag": members, "chunk": 5}]})
    leaf = first(program)
    assert isinstance(leaf, Leaf)
    bodies = task_messages("wf-1", Plan(program, None, owner=0), leaf)["parallel"]
    messages = [decode_task(body) for body in bodies]
    groups = [[t.index for t in m.split()] for m in messages]
    assert groups == [[1], [3], [0, 2, 4]]
    assert [m.limit for m in messages] == [
        KeyLimit(key="k1", max=2),
        KeyLimit(key="k3", max=2),
        None,
    ]
    assert b'"limit"' not in bodies[2]  # left out while unused: older workers read it
    # A retry of member 3 carries its key again.
    alone = task_messages("wf-1", Plan(program, None, owner=0), leaf, attempt=1, only=3)
    assert decode_task(alone["parallel"][0]).limit == KeyLimit(key="k3", max=2)


def test_a_task_message_with_a_limit_is_checked_at_the_door() -> None:
    base = {"wf": "w", "path": "0", "task": "t", "owner": 0}
    ok = TaskMessage.model_validate({**base, "limit": {"key": "k", "max": 2, "waits": 3}})
    assert decode_task(encode(ok)) == ok
    # Left out unless set: a worker from before it must keep reading waiting tasks.
    assert b"redelivered" not in encode(ok)
    flagged = ok.model_copy(update={"limit": KeyLimit(key="k", max=2, redelivered=True)})
    assert decode_task(encode(flagged)) == flagged
    bad = [
        {**base, "limit": {"key": "", "max": 2}},
        {**base, "limit": {"key": "k" * (MAX_LIMIT_KEY_CHARS + 1), "max": 2}},
        {**base, "limit": {"key": "k", "max": 0}},
        {**base, "limit": {"key": "k", "max": 2, "waits": -1}},
        {**base, "index": 0, "size": 2, "limit": {"key": "k", "max": 2},
         "batch": [{"index": 1, "task": "t"}]},
    ]  # fmt: skip
    for body in bad:
        with pytest.raises(ValueError):
            decode_task(json.dumps(body).encode())


def test_waits_double_up_to_their_bound_and_never_past_the_first_lease() -> None:
    waits = [limits.backoff_s(n) for n in range(10)]
    assert waits[0] == limits.LIMIT_BACKOFF_S
    assert waits == sorted(waits) and waits[-1] == limits.LIMIT_MAX_BACKOFF_S
    assert limits.backoff_s(10, lease_left_s=0.3) == 0.3
    assert limits.backoff_s(10, lease_left_s=-5) == limits.LIMIT_BACKOFF_S
    assert limits.backoff_s(10**6) == limits.LIMIT_MAX_BACKOFF_S


class _Bus:
    """Records what a worker publishes later."""

    def __init__(self) -> None:
        self.later: list[tuple[str, bytes, float]] = []

    async def publish_later(
        self, pool: str, body: bytes, delay_s: float, priority: int = 1, headers: Any = None
    ) -> None:
        self.later.append((pool, body, delay_s))


async def test_a_task_that_finds_every_slot_held_goes_back_and_runs_nothing() -> None:
    store = MemoryStore(Keys("m"))
    await store.submit("w", json.dumps({"program": {}, "input": None, "owner": 0}), 0, "", "d")
    await store.advance("w", "", "0", "running", leaf="task")
    ran: list[str] = []
    registry = Registry()

    async def handler(ctx: Any) -> str:
        ran.append(ctx.workflow_id)
        return "done"

    registry.add("t", handler)
    bus = _Bus()
    worker = Worker(Settings(), registry, pool="parallel", store=store, bus=bus)  # type: ignore[arg-type]
    for holder in ("a", "b"):
        assert (await store.acquire("k", holder, 2, 30_000)).verdict == "acquired"
    task = TaskMessage(wf="w", path="0", task="t", owner=0, limit=KeyLimit(key="k", max=2))
    # From the pool's share 3: it waits in that share again.
    assert await worker._limited(task, "parallel.3", redelivered=False) is None
    assert ran == []
    [(pool, body, delay_s)] = bus.later
    assert pool == "parallel.3" and delay_s == limits.LIMIT_BACKOFF_S
    assert decode_task(body).limit == KeyLimit(key="k", max=2, waits=1)
    # A slot comes free: the task runs, holding it, and gives it back.
    await store.release("k", "a")
    reports = await worker._limited(decode_task(body), "parallel.3", redelivered=False)
    assert ran == ["w"] and [r.kind for r in reports] == ["next"]
    assert set(await _holders(store, "k")) == {"b"}


async def _holders(store: MemoryStore, key: str) -> dict[str, str]:
    return dict(store.data.get(store.keys.limit(key)) or {})  # type: ignore[arg-type]


async def test_a_redelivered_task_that_waits_for_a_slot_still_reports_a_step_it_completed() -> None:
    """A worker runs a limited task, records its output and dies before its report; the
    broker redelivers the message (flagged), but every slot is held (by dead workers), so it
    goes back to wait: a new message, which the broker does not flag. When it gets a slot,
    the step is already complete ("again"): it must still report, or nothing moves the
    program on (the property machine's lost message: die_holding_slot, a crash past the
    record, a wait)."""
    store = MemoryStore(Keys("m"))
    await store.submit("w", json.dumps({"program": {}, "input": None, "owner": 0}), 0, "", "d")
    await store.advance("w", "", "0", "running", leaf="task")
    registry = Registry()

    async def handler(ctx: Any) -> str:
        return "done"

    registry.add("t", handler)
    bus = _Bus()
    worker = Worker(Settings(), registry, pool="parallel", store=store, bus=bus)  # type: ignore[arg-type]
    for holder in ("a", "b"):
        assert (await store.acquire("k", holder, 2, 30_000)).verdict == "acquired"
    task = TaskMessage(wf="w", path="0", task="t", owner=0, limit=KeyLimit(key="k", max=2))
    assert await worker._limited(task, "parallel", redelivered=True) is None
    # The first delivery's run (still holding its slot as this one came): recorded, then its
    # worker died before it reported. (Recorded before, the copy reports at once, unrun.)
    assert (await store.record("w", "0", 1, {None: json.dumps("done")})).verdict == "fire"
    [(_, body, _)] = bus.later
    await store.release("k", "a")
    reports = await worker._limited(decode_task(body), "parallel", redelivered=False)
    assert [(r.kind, getattr(r, "output", None)) for r in reports] == [("next", "done")]


class _Renewals:
    """A store whose renewals answer as told: renewed, raise (Redis unreachable), or never
    answer (a dead socket)."""

    def __init__(self, how: str) -> None:
        self.how = how
        self.calls = 0
        self.keys = Keys("renewals")

    async def renew(self, key: str, holder: str, lease_ms: int) -> Any:
        self.calls += 1
        if self.how == "raise":
            raise ConnectionError("Redis unreachable")
        if self.how == "read-only":  # a replica, after a failover
            raise ReadOnlyError("You can't write against a read only replica.")
        if self.how == "hang":
            await asyncio.Event().wait()
        return Slot("renewed")


@pytest.mark.parametrize("how", ["raise", "read-only", "hang"])
async def test_a_slot_no_renewal_reached_is_lost_when_its_lease_runs_out(how: str) -> None:
    """Renewals that fail or never return: by the time the lease ran out on Redis, another
    worker may hold the slot, so the handler must stop then; it ran on without a bound."""
    store = _Renewals(how)
    worker = Worker(Settings(key_lease_s=0.3), Registry(), pool="parallel", store=store, bus=_Bus())  # type: ignore[arg-type]
    lost, done = asyncio.Event(), asyncio.Event()
    since = time.monotonic()
    renewing = asyncio.create_task(worker._renew("k", "me", lost, done, since))
    await asyncio.wait_for(lost.wait(), 2)
    assert 0.3 <= time.monotonic() - since < 0.5, "lost when the lease ran out, not later"
    assert store.calls >= 1
    done.set()
    await renewing


async def test_a_slot_renewed_in_time_is_kept() -> None:
    store = _Renewals("renew")
    worker = Worker(Settings(key_lease_s=0.3), Registry(), pool="parallel", store=store, bus=_Bus())  # type: ignore[arg-type]
    lost, done = asyncio.Event(), asyncio.Event()
    renewing = asyncio.create_task(worker._renew("k", "me", lost, done, time.monotonic()))
    await asyncio.sleep(1.2)  # four leases
    assert not lost.is_set() and store.calls >= 8
    done.set()
    await renewing
