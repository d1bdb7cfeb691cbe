"""Parallel branches on a real cluster: a bag member that is a sequence of steps, with its own
cursor; the join waits for every branch, the bag's output lists members and branches in order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.marks import redis_of
from orchestrator.program import SERIAL, ProgramError, parse_program
from router.client import Router
from router.explain import explain_text
from tests.polling import until
from worker.registry import Registry

pytestmark = pytest.mark.e2e
PARTITIONS = Path(__file__).parent.parent / "examples" / "partitions.json"


@pytest.fixture
def registry() -> Registry:
    """The test tasks and the examples' (examples/partitions.json runs here as written)."""
    return Registry.from_modules(["tests.app", "examples.tasks"])


# Member 0 a task; member 1 a branch of a task, a sleep and a loop; member 2 a branch of a
# choice and a map. Each branch's first step sees the bag's prev; the next its branch's prev.
BRANCHES = {
    "steps": [
        {"task": "add", "args": {"n": 1}, "pool": "parallel"},
        {
            "bag": [
                {"task": "echo", "args": {"m": 0}},
                {
                    "steps": [
                        {"task": "add", "args": {"n": 10}, "pool": "parallel", "id": "ten"},
                        {"sleep_s": 0.2},
                        {
                            "until": "iteration >= 2",
                            "max_iterations": 5,
                            "steps": [{"task": "counter", "pool": "parallel"}],
                        },
                    ]
                },
                {
                    "steps": [
                        {
                            "choice": [
                                {"when": "prev == 1", "steps": [{"task": "add", "args": {"n": 2}}]}
                            ],
                            "otherwise": [{"task": "boom"}],
                        },
                        {
                            "task": "item",
                            "map": "[prev, prev * 2]",
                            "max_items": 5,
                        },
                    ]
                },
            ]
        },
        {"task": "echo", "args_from": {"ten": "steps.ten"}, "pool": "parallel"},
    ]
}


async def test_each_branch_runs_its_steps_in_order_and_the_join_lists_them(
    cluster: Router,
) -> None:
    wf = (await cluster.submit(BRANCHES)).workflow_id
    status = await cluster.wait(wf, timeout_s=60)
    assert status["status"] == "completed", status
    joined = status["result"]["prev"]
    assert joined[0] == {"args": {"m": 0}, "prev": 1}  # a task member sees the bag's prev
    assert joined[1] == {"iteration": 2}  # the branch's last step: the loop's last iteration
    assert [m["item"] for m in joined[2]] == [3, 6]  # the map over the choice's output (1 + 2)
    # A step after the bag reads a step of a branch by id.
    assert status["result"]["args"] == {"ten": 11}


async def test_a_failing_branch_fails_the_program_and_a_redrive_runs_the_bag_again(
    cluster: Router,
) -> None:
    program = {
        "steps": [
            {"task": "add", "args": {"n": 1}, "pool": "parallel"},
            {
                "bag": [
                    {"task": "echo"},
                    {"steps": [{"task": "add", "pool": "parallel"}, {"task": "boom"}]},
                ]
            },
        ]
    }
    wf = (await cluster.submit(program)).workflow_id
    status = await cluster.wait(wf, timeout_s=30)
    assert (status["status"], status["error"]) == (
        "failed",
        "step 1/branch:1/1: task 'boom': RuntimeError: boom",
    )
    # The program's cursor stood at the bag: a redrive runs the bag (every branch) again.
    await cluster.redrive(wf)
    again = await cluster.wait(wf, timeout_s=30)
    assert again["status"] == "failed" and again["error"] == status["error"], again


async def test_a_retried_task_inside_a_branch_and_a_signal_wait_there(cluster: Router) -> None:
    program = {
        "steps": [
            {
                "bag": [
                    {
                        "steps": [
                            {
                                "task": "shaky",
                                "pool": "parallel",
                                "retry": {"max_attempts": 2, "backoff_s": 0},
                            }
                        ]
                    },
                    {"steps": [{"signal": "approve", "timeout_s": 60}, {"task": "echo"}]},
                ]
            }
        ]
    }
    wf = (await cluster.submit(program)).workflow_id
    await until(lambda: cluster.status(wf), lambda s: s is not None and s["status"] == "running")
    await cluster.signal(wf, "approve", {"ok": True})
    status = await cluster.wait(wf, timeout_s=30)
    assert status["status"] == "completed", status
    first, second = status["result"]
    assert first["attempt"] == 1  # the retry ran at the branch's own path
    assert second["prev"] == {"ok": True}  # the branch's step after the signal took its data


async def test_cancel_ends_a_program_while_its_branches_sleep(cluster: Router) -> None:
    program = {"steps": [{"bag": [{"steps": [{"sleep_s": 30}]}, {"steps": [{"sleep_s": 30}]}]}]}
    wf = (await cluster.submit(program)).workflow_id
    await until(lambda: cluster.status(wf), lambda s: s is not None and s["status"] == "running")
    await cluster.cancel(wf, "enough")
    status = await cluster.status(wf)
    assert status is not None and (status["status"], status["error"]) == ("cancelled", "enough")


async def test_explain_shows_where_each_branch_of_an_open_bag_stands(cluster: Router) -> None:
    retry = {"max_attempts": 2, "backoff_s": 0}
    branch = [
        {"task": "flaky", "args": {"fail_until": 1}, "retry": retry, "pool": "parallel"},
        {"signal": "go", "timeout_s": 60},
    ]
    bag = [
        {"task": "echo", "args": {"m": 0}},
        {"steps": branch},
        {"task": "echo", "args": {"m": 2}},
    ]
    wf = (await cluster.submit({"steps": [{"bag": bag}]})).workflow_id

    def waits(report: dict) -> bool:
        step = report["step"] or {}
        found = step.get("branches") or [{}]
        return step.get("done") == 2 and found[0].get("cursor") == "0/branch:1/1"

    report = await until(lambda: cluster.explain(wf), waits)
    step = report["step"]
    # Both task members are done (bag indices 0 and 2, not positions among the tasks).
    assert [(t["index"], t["done"]) for t in step["tasks"]] == [(0, True), (2, True)]
    assert (step["size"], step["done"], step["members_done"]) == (3, 2, [0, 2])
    (entry,) = step["branches"]
    assert {k: entry[k] for k in ("index", "scope", "status", "cursor", "leaf", "kind")} == {
        "index": 1,
        "scope": "0/branch:1",
        "status": "running",
        "cursor": "0/branch:1/1",
        "leaf": "signal",
        "kind": "signal",
    }
    assert entry["signal"] == "go" and entry["wakes_ms"] > entry["since_ms"] > 0
    # Not "step 0 is done": its branch waits.
    assert report["waiting_for"] == (
        "its branches of step 0: branch 1 at step 0/branch:1/1 (a wait for signal 'go'); "
        f"send it with `shardflow signal {wf} go --data JSON`"
    )
    # The failed attempt inside the branch names its task.
    assert [(a["step"], a["task"], a["retry_pending"]) for a in report["attempts"]] == [
        ("0/branch:1/0", "flaky", False)
    ]
    text = explain_text(report)
    assert "Bag members done: 2 of 3 (0, 2); not done: 1." in text
    assert "  Branch 1 at step 0/branch:1/1 (a wait for signal 'go'), for " in text
    await cluster.signal(wf, "go", "ok")
    status = await cluster.wait(wf, timeout_s=30)
    assert status["status"] == "completed", status
    assert [m["args"] if isinstance(m, dict) else m for m in status["result"]] == [
        {"m": 0},
        "ok",
        {"m": 2},
    ]


async def test_explain_names_the_signal_command_for_signals_of_nested_branches(
    cluster: Router,
) -> None:
    inner = {"bag": [{"steps": [{"signal": "inner"}]}, {"task": "echo", "pool": "parallel"}]}
    program = {"steps": [{"bag": [{"steps": [inner]}, {"steps": [{"signal": "outer"}]}]}]}
    wf = (await cluster.submit(program)).workflow_id
    command = f"`shardflow signal {wf} NAME --data JSON` (NAME: 'outer', 'inner')"
    report = await until(lambda: cluster.explain(wf), lambda r: command in r["waiting_for"])
    assert report["waiting_for"].startswith("its branches of step 0: branch 0 at step ")
    await cluster.signal(wf, "inner", 1)
    await cluster.signal(wf, "outer", 2)
    status = await cluster.wait(wf, timeout_s=30)
    assert status["status"] == "completed", status


async def test_a_serial_task_in_a_branch_holds_the_lane_as_explain_tells(cluster: Router) -> None:
    slow = {"task": "echo", "args": {"sleep_s": 30}}
    program = {"steps": [{"bag": [{"task": "add"}, {"steps": [slow]}]}]}
    holder = (await cluster.submit(program)).workflow_id
    client = redis_of(cluster.store)
    assert client is not None
    lane = cluster.store.keys.lane(SERIAL)  # written by the serial worker as the task starts

    async def mark() -> dict[str, str]:
        return {"mark": await client.get(lane) or ""}

    await until(mark, lambda m: m["mark"].startswith(f"{holder} 0/branch:1/0 echo "))
    queued = (await cluster.submit({"steps": [{"task": "add"}]})).workflow_id
    # The lane's holder is believed while its branch's cursor (not the program's) is there.
    behind = await until(lambda: cluster.explain(queued), lambda r: r["status"] == "running")
    assert behind["lane"]["held"], behind
    assert behind["waiting_for"] == (
        f"the serial lane, held by program {holder} (step 0/branch:1/0, task 'echo')"
    )
    for wf in (holder, queued):
        await cluster.cancel(wf)


def test_submit_refuses_what_a_branch_cannot_read_and_bounds_branches() -> None:
    sibling = {
        "steps": [
            {
                "bag": [
                    {"steps": [{"task": "a", "id": "x"}]},
                    {"steps": [{"task": "b", "args_from": {"v": "steps.x"}}]},
                ]
            }
        ]
    }
    with pytest.raises(ProgramError) as caught:
        parse_program(sibling)
    assert "steps[0].bag[1].steps[0].args_from.v: step 'x'" in str(caught.value)
    too_many = {"steps": [{"bag": [{"steps": [{"task": "a"}]}] * 21}]}
    with pytest.raises(ProgramError, match=r"steps\[0\]\.bag: 21 branches: a bag holds at most"):
        parse_program(too_many)
    deep: dict = {"task": "a"}
    for _ in range(4):
        deep = {"bag": [{"steps": [deep]}]}
    with pytest.raises(ProgramError, match=r"branches nested 4 deep, at most 3"):
        parse_program({"steps": [deep]})
    # A branch reads earlier steps of its own list and of the lists around it.
    parse_program(
        {
            "steps": [
                {"task": "a", "id": "before"},
                {
                    "bag": [
                        {
                            "steps": [
                                {"task": "a", "id": "mine"},
                                {
                                    "task": "b",
                                    "args_from": {"v": "steps.mine", "w": "steps.before"},
                                },
                            ]
                        }
                    ]
                },
            ]
        }
    )


async def test_the_partitions_example_runs_three_branches_beside_a_task(cluster: Router) -> None:
    program = json.loads(PARTITIONS.read_text())
    wf = (await cluster.submit(program, {"table": "orders", "day": "2026-12-01"})).workflow_id
    status = await cluster.wait(wf, timeout_s=30)
    assert status["status"] == "completed", status
    # Each branch fetched, cut a tenth, validated twice (its loop); the snapshot beside them.
    assert status["result"] == {
        "table": "orders",
        "partitions": {"eu": 108, "us": 270, "apac": 72},
        "checks": 6,
        "snapshot": "orders@2026-12-01",
    }
