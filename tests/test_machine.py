"""The pure state machine: which leaf follows which, and what `prev` each leaf gets."""

import re

import pytest

from orchestrator.machine import (
    Done,
    Failed,
    Joined,
    Leaf,
    PathError,
    after,
    dropped,
    first,
    leaf_at,
)
from orchestrator.program import Sleep, parse_program

PROGRAM = parse_program(
    {
        "steps": [
            {"task": "a"},
            {"bag": [{"task": "b"}, {"task": "b"}]},
            {
                "until": "prev.n >= 2",
                "max_iterations": 5,
                "steps": [
                    {"task": "c"},
                    {"until": "iteration >= 1", "max_iterations": 3, "steps": [{"task": "d"}]},
                ],
            },
            {"task": "e"},
        ]
    }
)


def walk(program, outputs):  # type: ignore[no-untyped-def]
    """Run a program to its end, feeding each leaf the output `outputs(path)` gives."""
    seen = []
    outcome = first(program)
    while isinstance(outcome, Leaf):
        seen.append((outcome.path, outcome.prev, outcome.iteration))
        outcome = after(program, outcome.path, outputs(outcome.path), input=None)
    return seen, outcome


def test_leaves_follow_program_order_through_bags_and_nested_loops() -> None:
    rounds = {"count": 0}

    def outputs(path: str):  # type: ignore[no-untyped-def]
        if re.fullmatch(r"2/iter:\d+/0", path):
            rounds["count"] += 1
        return {"n": rounds["count"], "at": path}

    seen, end = walk(PROGRAM, outputs)
    assert [path for path, _, _ in seen] == [
        "0",
        "1",
        "2/iter:0/0",
        "2/iter:0/1/iter:0/0",
        "2/iter:0/1/iter:1/0",
        "2/iter:1/0",
        "2/iter:1/1/iter:0/0",
        "2/iter:1/1/iter:1/0",
        "3",
    ]
    assert seen[0][1] is None  # the first step gets no prev
    assert seen[1][1] == {"n": 0, "at": "0"}
    # The first step of iteration 1 gets the last output of iteration 0.
    assert seen[5][1] == {"n": 1, "at": "2/iter:0/1/iter:1/0"}
    assert [iteration for _, _, iteration in seen] == [0, 0, 0, 0, 1, 1, 0, 1, 0]
    assert seen[-1][1] == {"n": 2, "at": "2/iter:1/1/iter:1/0"}  # a loop's output: its last
    assert end == Done({"n": 2, "at": "3"})


def test_a_loop_that_never_meets_its_condition_fails_at_max_iterations() -> None:
    program = parse_program(
        {"steps": [{"until": "prev == 'done'", "max_iterations": 3, "steps": [{"task": "x"}]}]}
    )
    seen, end = walk(program, lambda path: "not yet")
    assert [path for path, _, _ in seen] == ["0/iter:0/0", "0/iter:1/0", "0/iter:2/0"]
    assert isinstance(end, Failed)
    assert end.error == "step 0: until \"prev == 'done'\" not met after max_iterations=3"


def test_a_condition_that_breaks_fails_the_program() -> None:
    program = parse_program(
        {"steps": [{"until": "prev.ready", "max_iterations": 3, "steps": [{"task": "x"}]}]}
    )
    outcome = after(program, "0/iter:0/0", output=7, input=None)
    assert isinstance(outcome, Failed) and outcome.error.startswith("step 0: until 'prev.ready':")


def test_leaf_at_finds_tasks_and_bags_and_refuses_other_paths() -> None:
    assert leaf_at(PROGRAM, "1").bag[0].task == "b"  # type: ignore[union-attr]
    assert leaf_at(PROGRAM, "2/iter:7/1/iter:0/0").task == "d"  # type: ignore[union-attr]
    for bad in ["9", "2", "0/iter:0/0", "2/iter:0/5", "x", ""]:
        with pytest.raises(PathError):
            leaf_at(PROGRAM, bad)


def test_after_refuses_paths_that_are_not_in_the_program() -> None:
    for bad in ["7", "2/0", "0/iter:1/0", "2/iter:0/9"]:
        with pytest.raises(PathError):
            after(PROGRAM, bad, None, None)


@pytest.mark.parametrize(
    ("finished", "path", "gone"),
    [
        ("", "0", ""),  # no loop
        ("1", "2/iter:0/0", ""),  # entering a loop: nothing behind it yet
        ("2/iter:0/1/iter:1/0", "2/iter:1/0", ""),  # iteration 1 keeps iteration 0
        ("2/iter:1/1/iter:0/0", "2/iter:2/0", "2/iter:0/"),  # iteration 2 drops 0
        ("2/iter:2/0", "2/iter:2/1/iter:0/0", ""),  # the same iteration goes on
        ("2/iter:2/1/iter:1/0", "2/iter:2/1/iter:2/0", "2/iter:2/1/iter:0/"),  # inner loop
        ("2/iter:3/1/iter:1/0", "3", ""),  # leaving the loop keeps its last iterations
    ],
)
def test_a_loop_drops_the_iteration_before_the_one_it_keeps(
    finished: str, path: str, gone: str
) -> None:
    from orchestrator.machine import dropped

    assert dropped(PROGRAM, finished, path) == gone


def test_keep_iterations_keeps_more() -> None:
    from orchestrator.machine import dropped

    program = parse_program(
        {
            "steps": [
                {
                    "until": "true",
                    "max_iterations": 9,
                    "keep_iterations": 3,
                    "steps": [{"task": "a"}],
                }
            ]
        }
    )
    assert dropped(program, "0/iter:2/0", "0/iter:3/0") == ""
    assert dropped(program, "0/iter:3/0", "0/iter:4/0") == "0/iter:0/"


def test_a_map_computes_its_items_when_it_starts() -> None:
    program = parse_program(
        {
            "steps": [
                {"task": "a"},
                {"map": "prev.parts.map(p, p * 10)", "task": "b", "max_items": 3, "chunk": 2},
                {"map": "input.none", "task": "b", "max_items": 3},
            ]
        }
    )
    leaf = after(program, "0", {"parts": [1, 2]}, input=None)
    assert isinstance(leaf, Leaf) and leaf.items == (10, 20) and leaf.size == 2
    empty = after(program, "1", [10, 20], input={"none": []})
    assert isinstance(empty, Leaf) and empty.items == () and empty.size == 0
    assert after(program, "2", [], input=None) == Done([])
    assert after(program, "0", {"parts": [1, 2, 3, 4]}, input=None) == Failed(
        "step 1: map 'prev.parts.map(p, p * 10)': gave 4 items, more than max_items=3"
    )
    missing = after(program, "0", {}, input=None)
    assert missing == Failed("step 1: map 'prev.parts.map(p, p * 10)': no such key 'parts'")


def test_a_map_item_must_be_small_and_json() -> None:
    program = parse_program({"steps": [{"map": "input", "task": "b", "max_items": 3}]})
    big = first(program, ["x" * 70_000])
    assert isinstance(big, Failed) and "item 0 is 70002 bytes, over 65536" in big.error
    not_json = first(program, None)
    assert not_json == Failed("step 0: map 'input': gave NoneType None, not a list")
    assert first(program, [{"a": 1}, 2]) == Leaf("0", program.steps[0], None, 0, ({"a": 1}, 2))


def test_a_sleep_is_a_leaf_of_its_own() -> None:
    program = parse_program({"steps": [{"task": "a"}, {"sleep_s": 5}, {"task": "b"}]})
    leaf = after(program, "0", {"x": 1}, input=None)
    assert isinstance(leaf, Leaf) and leaf.path == "1" and leaf.size is None
    assert leaf.prev == {"x": 1}
    assert leaf_at(program, "1") == program.steps[1]
    assert after(program, "1", {"x": 1}, input=None) == Leaf("2", program.steps[2], {"x": 1}, 0)


def test_a_loop_with_an_interval_waits_in_a_leaf_before_each_later_iteration() -> None:
    program = parse_program(
        {
            "steps": [
                {
                    "until": "iteration >= 1",
                    "max_iterations": 3,
                    "interval_s": 2,
                    "steps": [{"task": "a"}],
                }
            ]
        }
    )
    assert first(program) == Leaf("0/iter:0/0", program.steps[0].steps[0], None, 0)
    wait = after(program, "0/iter:0/0", 7, input=None)
    assert wait == Leaf("0/iter:1", Sleep(sleep_s=2), 7, 1)
    assert leaf_at(program, "0/iter:1") == Sleep(sleep_s=2)
    assert after(program, "0/iter:1", 7, input=None) == Leaf(
        "0/iter:1/0", program.steps[0].steps[0], 7, 1
    )
    assert after(program, "0/iter:1/0", 8, input=None) == Done(8)
    assert dropped(program, "0/iter:0/0", "0/iter:1") == ""  # keeps 1 finished iteration
    with pytest.raises(PathError):
        leaf_at(PROGRAM, "2/iter:1")  # no interval_s: no wait leaf


def test_a_choice_runs_the_first_case_that_holds_else_its_otherwise() -> None:
    program = parse_program(
        {
            "steps": [
                {"task": "a"},
                {
                    "choice": [
                        {"when": "prev.n > 5", "steps": [{"task": "big"}]},
                        {"when": "prev.n > 2", "steps": [{"task": "mid"}, {"task": "mid2"}]},
                    ],
                    "otherwise": [{"task": "small"}],
                },
                {"task": "end"},
            ]
        }
    )
    picked = [after(program, "0", {"n": n}, input=None) for n in (9, 3, 0)]
    assert [(leaf.path, leaf.step.task) for leaf in picked] == [  # type: ignore[union-attr]
        ("1/case:0/0", "big"),
        ("1/case:1/0", "mid"),
        ("1/case:2/0", "small"),
    ]
    assert after(program, "1/case:1/0", "m", input=None) == Leaf(
        "1/case:1/1", leaf_at(program, "1/case:1/1"), "m", 0
    )
    # The case's last output is the choice's: the step after it gets it.
    assert after(program, "1/case:1/1", "m2", input=None) == Leaf("2", program.steps[2], "m2", 0)
    for bad in ("1", "1/case:3/0", "1/case:0", "1/case:x/0"):
        with pytest.raises(PathError):
            leaf_at(program, bad)


def test_a_choice_with_no_case_holding_and_no_otherwise_fails_naming_it() -> None:
    program = parse_program(
        {"steps": [{"choice": [{"when": "input.go", "steps": [{"task": "a"}]}]}]}
    )
    assert first(program, {"go": False}) == Failed(
        "step 0: no case of the choice held, and it has no otherwise"
    )
    assert first(program, {}) == Failed("step 0: choice 0 when 'input.go': no such key 'go'")
    assert first(program, {"go": True}) == Leaf(
        "0/case:0/0", leaf_at(program, "0/case:0/0"), None, 0
    )


def test_a_loop_inside_a_case_drops_its_old_iterations() -> None:
    program = parse_program(
        {
            "steps": [
                {
                    "choice": [
                        {
                            "when": "true",
                            "steps": [
                                {"until": "false", "max_iterations": 9, "steps": [{"task": "a"}]}
                            ],
                        }
                    ]
                }
            ]
        }
    )
    assert dropped(program, "0/case:0/0/iter:3/0", "0/case:0/0/iter:4/0") == "0/case:0/0/iter:2/"


def test_a_bag_opens_its_branches_and_a_branch_ends_by_joining_its_bag() -> None:
    program = parse_program(
        {
            "steps": [
                {"task": "a"},
                {
                    "bag": [
                        {"task": "b"},
                        {
                            "steps": [
                                {"task": "c"},
                                {
                                    "until": "iteration >= 2",
                                    "max_iterations": 5,
                                    "steps": [{"task": "d"}],
                                },
                            ]
                        },
                        {"steps": [{"bag": [{"steps": [{"sleep_s": 1}]}]}]},
                    ]
                },
                {"task": "e"},
            ]
        }
    )
    bag = after(program, "0", "A", input=None)
    assert isinstance(bag, Leaf) and (bag.path, bag.shape) == ("1", "bag:3")
    # Every branch opens with the bag, nested ones too; each first leaf gets the bag's prev.
    assert bag.opened() == [
        ("1/branch:1", "1/branch:1/0", "task"),
        ("1/branch:2", "1/branch:2/0", "bag:1"),
        ("1/branch:2/0/branch:0", "1/branch:2/0/branch:0/0", "sleep"),
    ]
    assert [first.prev for _, first in bag.branches] == ["A", "A"]
    inner = after(program, "1/branch:1/0", "C", input=None)
    assert isinstance(inner, Leaf) and (inner.path, inner.prev) == ("1/branch:1/1/iter:0/0", "C")
    assert (
        dropped(program, "1/branch:1/1/iter:1/0", "1/branch:1/1/iter:2/0") == "1/branch:1/1/iter:0/"
    )
    assert after(program, "1/branch:1/1/iter:2/0", "D", input=None) == Joined("1/branch:1", "D")
    assert after(program, "1/branch:2/0/branch:0/0", "S", input=None) == Joined(
        "1/branch:2/0/branch:0", "S"
    )
    assert isinstance(leaf_at(program, "1/branch:2/0/branch:0/0"), Sleep)
    with pytest.raises(PathError):
        leaf_at(program, "1/branch:0/0")  # member 0 is a task, not a branch
    end = after(program, "1", ["B", "D", ["S"]], input=None)
    assert isinstance(end, Leaf) and end.path == "2" and end.prev == ["B", "D", ["S"]]


def test_scope_of_a_path_is_its_innermost_branch() -> None:
    from orchestrator.paths import parent_of, scope_of

    assert scope_of("1") == "" and scope_of("2/iter:3/0") == ""
    assert scope_of("1/branch:2/0") == "1/branch:2"
    assert scope_of("1/branch:2/0/iter:1/3/branch:0/0") == "1/branch:2/0/iter:1/3/branch:0"
    assert parent_of("1/branch:2/0/branch:11") == ("1/branch:2/0", 11)
    assert parent_of("1/bag:2") is None
