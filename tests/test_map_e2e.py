"""Map steps on a real cluster: one task per item of a list computed when the step starts."""

from __future__ import annotations

import asyncio
import time

import pytest

from router.client import Router
from router.explain import explain_text

pytestmark = pytest.mark.e2e

RETRY = {"max_attempts": 2, "backoff_s": 0.01}


async def _run(cluster: Router, program: dict, input: object = None) -> dict:
    wf = (await cluster.submit(program, input)).workflow_id
    return await cluster.wait(wf, timeout_s=30)


async def test_a_map_runs_one_task_per_item_and_keeps_their_order(cluster: Router) -> None:
    parts = [{"n": n} for n in range(7)]
    parts[4] = {"n": 4, "fail_once": True}  # retried alone, inside a chunk of three
    program = {
        "steps": [
            {"map": "input.parts", "task": "item", "max_items": 10, "chunk": 3, "retry": RETRY},
            {"task": "echo"},
        ]
    }
    status = await _run(cluster, program, {"parts": parts})
    assert status["status"] == "completed", status
    outputs = status["result"]["prev"]
    assert [o["item"] for o in outputs] == parts
    assert [o["index"] for o in outputs] == list(range(7))
    assert [o["attempt"] for o in outputs] == [0, 0, 0, 0, 1, 0, 0]


async def test_a_map_over_prev_inside_a_loop_and_over_an_empty_list(cluster: Router) -> None:
    program = {
        "steps": [
            {"map": "[]", "task": "item", "max_items": 1},
            {
                "until": "iteration >= 2",
                "max_iterations": 5,
                "steps": [
                    {"task": "echo", "args": {"k": 1}},
                    {
                        "map": "[prev.args.k, iteration, size(prev.prev)]",
                        "task": "item",
                        "max_items": 3,
                    },
                ],
            },
        ]
    }
    status = await _run(cluster, program)
    assert status["status"] == "completed", status
    # The empty map's output is []; each iteration's echo sees the map before it.
    assert [o["item"] for o in status["result"]] == [1, 2, 3]


async def test_a_map_over_too_many_items_or_not_a_list_fails_clearly(cluster: Router) -> None:
    many = {"steps": [{"task": "echo"}, {"map": "input", "task": "item", "max_items": 2}]}
    status = await _run(cluster, many, [1, 2, 3])
    assert status["status"] == "failed"
    assert status["error"] == "step 1: map 'input': gave 3 items, more than max_items=2"
    status = await _run(cluster, {"steps": [{"map": "input", "task": "item", "max_items": 2}]}, 5)
    assert status["status"] == "failed"
    assert status["error"] == "step 0: map 'input': gave int 5, not a list"


async def test_explain_shows_a_maps_members(cluster: Router) -> None:
    program = {
        "steps": [{"map": "input", "task": "item", "max_items": 5, "args": {"sleep_s": 0.5}}]
    }
    wf = (await cluster.submit(program, ["a", "b", "c"])).workflow_id
    deadline = time.monotonic() + 20
    while True:
        report = await cluster.explain(wf)
        if report and report["step"] and report["status"] == "running":
            break
        assert time.monotonic() < deadline, report
        await asyncio.sleep(0.02)
    assert report["step"]["kind"] == "map"
    assert report["step"]["size"] == 3
    assert [t["index"] for t in report["step"]["tasks"]] == [0, 1, 2]
    assert "a map of task 'item' over 3 item(s) on the parallel pool" in explain_text(report)
    status = await cluster.wait(wf, timeout_s=30)
    assert [o["item"] for o in status["result"]] == ["a", "b", "c"]
