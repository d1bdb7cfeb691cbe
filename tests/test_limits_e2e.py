"""Per-key concurrency limits on a real cluster: at most `max` tasks of one key run at once,
another key is not held up, a waiting task holds no worker and `explain` names the key."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest
from redis.asyncio import Redis

from orchestrator.settings import Settings
from router.client import Router
from router.explain import explain_text
from tests.app import Trace
from tests.polling import until

pytestmark = pytest.mark.e2e

LIMIT = {"key": "input.customer", "max": 2}


def concurrent(events: list[dict[str, Any]], key_of: dict[str, str]) -> dict[str, list[int]]:
    """Per key, how many of its tasks were running after each start (trace order)."""
    running: Counter[str] = Counter()
    seen: dict[str, list[int]] = {}
    for event in sorted(events, key=lambda e: e["seq"]):
        key = key_of.get(event["wf"])
        if key is None:
            continue
        running[key] += 1 if event["event"] == "start" else -1
        if event["event"] == "start":
            seen.setdefault(key, []).append(running[key])
    return seen


def test_concurrent_counts_holders_per_key() -> None:
    """The counter the tests rely on sees an overlap, and only within one key."""
    events = [
        {"wf": "a1", "event": "start", "seq": 1},
        {"wf": "b1", "event": "start", "seq": 2},
        {"wf": "a2", "event": "start", "seq": 3},
        {"wf": "a1", "event": "end", "seq": 4},
        {"wf": "a3", "event": "start", "seq": 5},
    ]
    key_of = {"a1": "a", "a2": "a", "a3": "a", "b1": "b"}
    assert concurrent(events, key_of) == {"a": [1, 2, 2], "b": [1]}


async def test_at_most_max_tasks_of_a_key_run_at_once_and_another_key_goes_on(
    cluster: Router, settings: Settings, trace: Trace
) -> None:
    slow = {"task": "echo", "pool": "parallel", "args": {"sleep_s": 0.4}, "limit": LIMIT}
    program = {"steps": [slow]}
    acme = [
        (await cluster.submit(program, trace.as_input(customer="acme"))).workflow_id
        for _ in range(10)
    ]
    beta = [
        (await cluster.submit(program, trace.as_input(customer="beta"))).workflow_id
        for _ in range(4)
    ]

    # Some acme program waits for a slot while two others hold them: explain says so. Which
    # one is not known: programs on different shards start in no fixed order.
    async def a_waiter() -> dict[str, Any] | None:
        for wf in acme:
            found = await cluster.explain(wf)
            if found is not None and "a slot of key 'acme'" in found["waiting_for"]:
                return found | {"wf": wf}
        return {"waiting_for": "no acme program waits for a slot"}

    report = await until(a_waiter, lambda r: "wf" in r)
    waiter = report["wf"]
    assert report["status"] == "running", report
    assert report["waiting_for"].startswith("a slot of key 'acme': "), report["waiting_for"]
    [task] = report["step"]["tasks"]
    assert task["limit"]["key"] == "acme" and task["limit"]["max"] == 2
    assert task["limit"]["held"] <= 2 and task["limit"]["waits"] >= 1
    assert "waits for a slot of key 'acme'" in explain_text(report)
    for wf in acme + beta:
        status = await cluster.wait(wf, timeout_s=60)
        assert status["status"] == "completed", status
    key_of = {wf: "acme" for wf in acme} | {wf: "beta" for wf in beta}
    events = [e for e in trace.events() if e["wf"] in key_of]
    assert Counter(e["event"] for e in events) == {"start": 14, "end": 14}
    seen = concurrent(events, key_of)
    assert max(seen["acme"]) == 2, seen  # the limit was reached, and never exceeded
    assert max(seen["beta"]) <= 2, seen
    # beta did not queue behind acme's ten: each of its tasks ended before acme's last began.
    last_acme = max(e["seq"] for e in events if e["event"] == "start" and key_of[e["wf"]] == "acme")
    beta_ends = [e["seq"] for e in events if e["event"] == "end" and key_of[e["wf"]] == "beta"]
    assert max(beta_ends) < last_acme, (beta_ends, last_acme)
    # Every slot was given back; the waits left no mark.
    client = Redis.from_url(settings.redis_url)
    try:
        for key in ("acme", "beta"):
            assert await client.zcard(cluster.store.keys.limit(key)) == 0
        assert await client.exists(cluster.store.keys.limit_waits(waiter)) == 0
    finally:
        await client.aclose()
    report = await cluster.explain(waiter)
    assert report is not None and report["waiting_for"] == "nothing: it ended completed"


async def test_bag_members_and_map_items_hold_their_own_keys(cluster: Router, trace: Trace) -> None:
    one = {"key": "'solo'", "max": 1}
    bag = {
        "bag": [
            {"task": "echo", "args": {"sleep_s": 0.15, "n": n}, "limit": one} for n in range(3)
        ],
        "chunk": 3,  # members with a limit travel alone anyway
    }
    items = {
        "map": "['x', 'y', 'x', 'y']",
        "max_items": 4,
        "task": "item",
        "args": {"sleep_s": 0.1},
        "limit": {"key": "'item-' + item", "max": 1},
    }
    wf = (await cluster.submit({"steps": [bag, items]}, trace.as_input())).workflow_id
    status = await cluster.wait(wf, timeout_s=60)
    assert status["status"] == "completed", status
    assert [r["item"] for r in status["result"]] == ["x", "y", "x", "y"]
    events = [e for e in trace.events() if e["wf"] == wf and e["path"] == "0"]
    running = 0
    for event in sorted(events, key=lambda e: e["seq"]):  # one member of key 'solo' at a time
        running += 1 if event["event"] == "start" else -1
        assert running <= 1, events
    assert len(events) == 6


async def test_a_key_that_is_not_a_string_fails_its_step_naming_it(cluster: Router) -> None:
    program = {"steps": [{"task": "echo", "limit": {"key": "input.n", "max": 1}}]}
    wf = (await cluster.submit(program, {"n": 3})).workflow_id
    status = await cluster.wait(wf, timeout_s=30)
    assert status["status"] == "failed"
    assert status["error"] == "step 0: limit key 'input.n': gave int 3, not a string"


async def test_waiting_tasks_hold_no_worker(cluster: Router, trace: Trace) -> None:
    """With every slot of a key held, more tasks of it than the pool's concurrency (16) wait
    in the delay ladder while tasks of other keys still run at once."""
    held = {"task": "echo", "pool": "parallel", "args": {"sleep_s": 1.0}, "limit": LIMIT}
    blocked = [
        (await cluster.submit({"steps": [held]}, trace.as_input(customer="one"))).workflow_id
        for _ in range(20)
    ]
    await asyncio.sleep(0.3)  # the 18 that wait have met a held key by now
    free = {"task": "echo", "pool": "parallel", "args": {"sleep_s": 0.05}}
    others = [(await cluster.submit({"steps": [free]})).workflow_id for _ in range(3)]
    for wf in others:
        status = await cluster.wait(wf, timeout_s=5)  # not behind twenty 1 s tasks
        assert status["status"] == "completed", status
    for wf in blocked:
        assert (await cluster.wait(wf, timeout_s=60))["status"] == "completed"
