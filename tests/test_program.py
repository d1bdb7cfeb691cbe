"""The program format: what it accepts, and the paths its errors name."""

import json
from pathlib import Path

import pytest

from orchestrator.program import Bag, ProgramError, Task, Untiloop, parse_input, parse_program
from orchestrator.program import program_schema as schema

EXAMPLE = Path(__file__).parent.parent / "examples" / "thumbnails.json"


def test_the_example_program_parses_into_its_three_step_kinds() -> None:
    program = parse_program(EXAMPLE.read_text())
    assert program.name == "thumbnails"
    assert [type(step) for step in program.steps] == [Task, Bag, Untiloop, Task]
    assert program.steps[3].pool == "parallel"
    assert program.steps[3].retry is not None and program.steps[3].retry.max_attempts == 5
    assert program.task_names() == {"fetch", "resize", "poll", "publish"}


def test_untiloops_nest() -> None:
    program = parse_program(
        {
            "steps": [
                {
                    "until": "iteration >= 1",
                    "max_iterations": 3,
                    "steps": [
                        {"task": "a"},
                        {
                            "until": "prev > 2",
                            "max_iterations": 5,
                            "steps": [{"bag": [{"task": "b"}]}],
                        },
                    ],
                }
            ]
        }
    )
    inner = program.steps[0].steps[1]
    assert isinstance(inner, Untiloop) and isinstance(inner.steps[0], Bag)


@pytest.mark.parametrize(
    ("program", "fault"),
    [
        ({"steps": []}, "steps: List should have at least 1 item"),
        ({}, "steps: Field required"),
        ({"steps": [{"task": "a"}, {"oops": 1}]}, "steps[1]: a step needs exactly one of"),
        ({"steps": [{"task": "a", "bag": []}]}, "steps[0]: a step needs exactly one of"),
        ({"steps": [{"bag": []}]}, "steps[0].bag: List should have at least 1 item"),
        (
            {"steps": [{"bag": [{"task": "a"}], "chunk": 0}]},
            "steps[0].chunk: Input should be greater than or equal to 1",
        ),
        (
            {
                "steps": [
                    {"task": "a"},
                    {"until": "prev.x ==", "max_iterations": 2, "steps": [{"task": "a"}]},
                ]
            },
            "steps[1].until: invalid CEL: Failed to parse expression",
        ),
        (
            {
                "steps": [
                    {"task": "a"},
                    {"until": "done", "max_iterations": 2, "steps": [{"task": "a"}]},
                ]
            },
            "steps[1].until: invalid CEL: unknown variable 'done'",
        ),
        (
            {"steps": [{"until": "prev", "steps": [{"task": "a"}]}]},
            "steps[0].max_iterations: Field required",
        ),
        (
            {"steps": [{"until": "prev", "max_iterations": 0, "steps": [{"task": "a"}]}]},
            "steps[0].max_iterations: Input should be greater than or equal to 1",
        ),
        (
            {"steps": [{"until": "prev", "max_iterations": 2, "steps": []}]},
            "steps[0].steps: List should have at least 1 item",
        ),
        (
            {
                "steps": [
                    {
                        "until": "true",
                        "max_iterations": 2,
                        "steps": [{"bag": [{"task": "b", "pool": "serial"}]}],
                    }
                ]
            },
            "steps[0].steps[0].bag[0].pool: Extra inputs are not permitted",
        ),
        ({"steps": [{"task": "no spaces"}]}, "steps[0].task: String should match pattern"),
        (
            {"steps": [{"task": "a", "pool": "fast"}]},
            "steps[0].pool: Input should be 'serial' or 'parallel'",
        ),
        ({"steps": [{"task": "a", "retry": {"max_attempts": 0}}]}, "steps[0].retry.max_attempts"),
        (
            {"steps": [{"task": "a", "args": [1]}]},
            "steps[0].args: Input should be a valid dictionary",
        ),
        ({"steps": "a"}, "steps: Input should be a valid list"),
        ([1], "program: Input should be a valid dictionary"),
    ],
)
def test_invalid_programs_name_the_path_of_the_fault(program: object, fault: str) -> None:
    with pytest.raises(ProgramError) as caught:
        parse_program(program)  # type: ignore[arg-type]
    assert str(caught.value).startswith(fault), str(caught.value)
    assert "\n" not in str(caught.value)


def test_not_json_and_too_large_are_refused() -> None:
    with pytest.raises(ProgramError, match=r"^program: not JSON"):
        parse_program('{"steps": [')
    big = json.dumps({"steps": [{"task": "a", "args": {"blob": "x" * 5000}}]})
    with pytest.raises(ProgramError, match=r"^program: \d+ bytes, more than the limit of 4096"):
        parse_program(big, max_bytes=4096)


def test_unknown_task_names_are_refused_when_the_router_knows_the_tasks() -> None:
    program = {"steps": [{"task": "a"}, {"bag": [{"task": "b"}, {"task": "zzz"}]}]}
    assert parse_program(program, known_tasks={"a", "b", "zzz"})
    with pytest.raises(ProgramError, match=r"^steps: unknown task 'zzz'$"):
        parse_program(program, known_tasks={"a", "b"})


def test_input_must_be_json() -> None:
    assert parse_input('{"a": [1, 2]}') == {"a": [1, 2]}
    with pytest.raises(ProgramError, match=r"^input: not JSON"):
        parse_input("{a: 1}")


def test_the_schema_describes_every_step_kind() -> None:
    document = schema()
    assert {"Task", "Bag", "Untiloop", "Member", "Retry"} <= set(document["$defs"])
    assert document["$defs"]["Untiloop"]["required"] == ["until", "max_iterations", "steps"]
