"""Choice steps on a real cluster: the first case that holds runs, its output goes on."""

from __future__ import annotations

import pytest

from orchestrator.messages import decode_shard_message
from router.client import Router

pytestmark = pytest.mark.e2e

POLL = {
    "until": "iteration >= 2",
    "max_iterations": 5,
    "steps": [
        {
            "choice": [
                {"when": "iteration == 0", "steps": [{"task": "echo", "args": {"case": 0}}]},
                {"when": "iteration == 1", "steps": [{"task": "counter"}, {"task": "counter"}]},
            ],
            "otherwise": [{"task": "echo", "args": {"case": "otherwise"}}],
        }
    ],
}


async def test_each_iteration_takes_its_case_and_the_last_output_goes_on(cluster: Router) -> None:
    wf = (
        await cluster.submit({"steps": [POLL, {"task": "echo", "args": {"last": True}}]})
    ).workflow_id
    status = await cluster.wait(wf, timeout_s=30)
    assert status["status"] == "completed", status
    # Iteration 2 took the otherwise; its output reached the last step.
    assert status["result"]["prev"]["args"] == {"case": "otherwise"}
    assert status["result"]["prev"]["prev"] == {"iteration": 1}  # iteration 1's second counter


async def test_a_choice_where_nothing_holds_fails_the_program_naming_it(cluster: Router) -> None:
    program = {"steps": [{"choice": [{"when": "input.go", "steps": [{"task": "echo"}]}]}]}
    status = await cluster.wait((await cluster.submit(program, {"go": False})).workflow_id, 30)
    assert (status["status"], status["error"]) == (
        "failed",
        "step 0: no case of the choice held, and it has no otherwise",
    )


def test_a_path_inside_a_case_is_on_the_wire() -> None:
    message = decode_shard_message(b'{"kind": "next", "wf": "w", "path": "1/case:2/0/iter:0/0"}')
    assert message.path == "1/case:2/0/iter:0/0"  # type: ignore[union-attr]


def test_explain_locates_a_step_inside_a_case() -> None:
    from orchestrator.program import parse_program
    from router.explain import locate

    program = parse_program({"steps": [POLL]})
    where = locate(program, "0/iter:1/0/case:1/1")
    assert where is not None and where.step.task == "counter"  # type: ignore[union-attr]
    assert [(loop.path, loop.iteration) for loop in where.loops] == [("0", 1)]
    assert locate(program, "0/iter:1/0/case:3/0") is None  # two cases and an otherwise
