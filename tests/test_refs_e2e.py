"""Step references on a real cluster: a step reads an earlier step's output as `steps.<id>`."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from orchestrator.program import ProgramError
from orchestrator.redis_store import RedisStore
from router.client import Router
from router.explain import explain, explain_text
from worker.registry import Registry

pytestmark = pytest.mark.e2e

REPORT = Path(__file__).parent.parent / "examples" / "report.json"
RETRY = {"max_attempts": 2, "backoff_s": 0.01}


@pytest.fixture
def registry() -> Registry:
    """The test tasks and the examples' (examples/report.json runs here as written)."""
    return Registry.from_modules(["tests.app", "examples.tasks"])


async def _run(cluster: Router, program: dict, input: object = None) -> tuple[str, dict]:
    wf = (await cluster.submit(program, input)).workflow_id
    return wf, await cluster.wait(wf, timeout_s=30)


async def test_the_report_example_reads_fetch_across_a_map_and_a_loop(
    cluster: Router, store: RedisStore
) -> None:
    program = json.loads(REPORT.read_text())
    wf, status = await _run(cluster, program, {"region": "north", "stores": 3})
    assert status["status"] == "completed", status
    # region from steps.fetch, three stores (the map over steps.fetch.stores), rows 10+20+30
    # loaded by the loop (steps.stores), which polled twice (steps.load, read after it).
    assert status["result"] == {"region": "north", "stores": 3, "loaded": 60, "polls": 2}
    # Each referenced output is recorded once, under the program's registry (so retention
    # and purge take it), the loop's step as its last iteration left it.
    registered = await store.client.smembers(store.keys.registry(wf))  # type: ignore[misc]
    refs = {store.keys.ref(wf, name) for name in ("fetch", "stores", "load")}
    assert refs <= registered
    found = await store.refs(wf, ["fetch", "stores", "load"])
    assert json.loads(found["load"]) == {"ready": True, "loaded": 60, "polls": 2}
    assert [s["currency"] for s in json.loads(found["stores"])] == ["EUR"] * 3


async def test_a_loop_step_is_read_as_its_latest_iteration_left_it(cluster: Router) -> None:
    program = {
        "steps": [
            {"id": "start", "task": "echo", "args": {"k": 7}},
            {
                "id": "loop",
                "until": "steps.tick.iteration >= 2",
                "max_iterations": 5,
                "steps": [
                    {"id": "tick", "task": "counter"},
                    # the same iteration's tick, and a step from before the loop
                    {
                        "task": "echo",
                        "args_from": {"tick": "steps.tick.iteration", "k": "steps.start.args.k"},
                    },
                ],
            },
            {
                "task": "echo",
                "args": {"fixed": 1},
                "args_from": {"last": "steps.tick", "loop": "steps.loop.args"},
            },
        ]
    }
    _, status = await _run(cluster, program)
    assert status["status"] == "completed", status
    assert status["result"]["args"] == {
        "fixed": 1,
        "last": {"iteration": 2},
        "loop": {"tick": 2, "k": 7},
    }


async def test_a_retry_gets_the_arguments_its_first_attempt_got(cluster: Router) -> None:
    # The prev is over 64 KiB, so it travels by reference and the retry reads it back.
    program = {
        "steps": [
            {"id": "big", "task": "blob", "args": {"n": 70_000}},
            {"task": "shaky", "retry": RETRY, "args_from": {"n": "size(prev)"}},
            {
                "bag": [
                    {"task": "echo"},
                    {"task": "shaky", "retry": RETRY, "args_from": {"n": "size(steps.big)"}},
                ]
            },
        ]
    }
    _, status = await _run(cluster, program)
    assert status["status"] == "completed", status
    assert status["result"][1] == {"args": {"n": 70_000}, "attempt": 1}
    assert status["result"][0]["prev"] == {"args": {"n": 70_000}, "attempt": 1}


async def test_an_argument_over_its_bound_fails_the_program_naming_the_step(
    cluster: Router,
) -> None:
    program = {"steps": [{"task": "echo"}, {"task": "echo", "args_from": {"big": "input"}}]}
    _, status = await _run(cluster, program, "x" * 70_000)
    assert status["status"] == "failed"
    assert status["error"] == "step 1: args_from 'big' 'input': gave 70002 bytes, over 65536"


async def test_a_map_over_a_step_and_a_choice_on_one(cluster: Router) -> None:
    program = {
        "steps": [
            {"id": "parts", "task": "echo", "args": {"items": ["a", "b", "c"]}},
            {"task": "echo", "args": {"unrelated": True}},
            {"map": "steps.parts.args.items", "task": "item", "max_items": 5},
            {
                "choice": [
                    {"when": "size(steps.parts.args.items) > 5", "steps": [{"task": "boom"}]}
                ],
                "otherwise": [{"task": "echo", "args_from": {"n": "size(prev)"}}],
            },
        ]
    }
    _, status = await _run(cluster, program)
    assert status["status"] == "completed", status
    assert status["result"]["args"] == {"n": 3}
    assert [o["item"] for o in status["result"]["prev"]] == ["a", "b", "c"]


async def test_a_reference_that_cannot_be_met_is_refused_at_submit(cluster: Router) -> None:
    program = {
        "steps": [
            {"task": "echo", "args_from": {"customer": "steps.fetch.customer"}},
            {"id": "later", "task": "echo"},
            {"task": "echo", "args_from": {"x": "steps.later"}, "args": {"x": 1}},
        ]
    }
    with pytest.raises(ProgramError) as refused:
        await cluster.submit(program)
    assert refused.value.faults == [
        "steps[2].args_from.x: also in args; give it in one",
        "steps[0].args_from.customer: unknown step id 'fetch'",
    ]


async def test_explain_and_status_name_the_steps_id(cluster: Router) -> None:
    program = {"steps": [{"task": "echo"}, {"id": "nap", "sleep_s": 60}]}
    wf = (await cluster.submit(program)).workflow_id
    for _ in range(200):  # until the sleep is the current step
        report = await explain(cluster.store, None, wf)
        if report is not None and (report["step"] or {}).get("path") == "1":
            break
        await asyncio.sleep(0.05)
    assert report is not None and report["step"]["id"] == "nap"
    assert "At step 1 (top-level step 2 of 2, id 'nap'): a sleep" in explain_text(report)
    await cluster.cancel(wf)
