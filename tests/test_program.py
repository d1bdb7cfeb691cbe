"""The program format: what it accepts, and the paths its errors name."""

import json
import math
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import given
from hypothesis import settings as hyp_settings
from pydantic import ValidationError

from orchestrator.documents import parse_input
from orchestrator.program import (
    Bag,
    Map,
    Program,
    ProgramError,
    Retry,
    Task,
    Untiloop,
    parse_program,
    pool_of,
    program_schema,
)
from orchestrator.program import program_schema as schema
from orchestrator.settings import Settings
from tests.model import programs, with_compensations

EXAMPLE = Path(__file__).parent.parent / "examples" / "thumbnails.json"


def test_the_example_program_parses_into_its_three_step_kinds() -> None:
    program = parse_program(EXAMPLE.read_text())
    assert program.name == "thumbnails"
    assert [type(step) for step in program.steps] == [Task, Bag, Untiloop, Task]
    assert program.steps[3].pool == "parallel"
    assert program.steps[3].retry is not None and program.steps[3].retry.max_attempts == 5
    assert program.task_names() == {"fetch", "resize", "poll", "publish"}


def test_the_album_example_maps_over_a_list_known_at_run_time() -> None:
    program = parse_program((EXAMPLE.parent / "album.json").read_text())
    mapped = program.steps[1]
    assert isinstance(mapped, Map) and (mapped.max_items, mapped.chunk) == (500, 4)
    assert program.task_names() == {"list_photos", "thumbnail", "summarize"}


def test_the_etl_example_uses_map_loop_waits_and_choice() -> None:
    program = parse_program((EXAMPLE.parent / "etl.json").read_text())
    assert [type(step).__name__ for step in program.steps] == ["Task", "Map", "Untiloop", "Choice"]
    assert program.task_names() == {
        "etl.partitions", "etl.transform", "etl.poll", "etl.publish", "etl.alert"
    }  # fmt: skip


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
        (
            {"steps": [{"task": "a"}, {"oops": 1}]},
            "steps[1]: no kind among 'oops': a step needs exactly one of",
        ),
        # An unknown key: the field it is close to, of its step's kind where the path says it.
        (
            {"steps": [{"task": "a", "timeout": 5}]},
            "steps[0].timeout: Extra inputs are not permitted (did you mean 'timeout_s'?)",
        ),
        (
            {"steps": [{"task": "a", "retry": {"max_attempt": 3}}]},
            "steps[0].retry.max_attempt: Extra inputs are not permitted (did you mean "
            "'max_attempts'?)",
        ),
        ({"steps": [{"task": "a", "zzz": 1}]}, "steps[0].zzz: Extra inputs are not permitted"),
        (
            {"task": "a"},
            'steps: Field required; task: Extra inputs are not permitted: a program is {"steps": '
            "[STEP, ...]}",
        ),
        (
            {"steps": [{"bags": [{"task": "a"}]}]},
            "steps[0]: no kind among 'bags' (did you mean 'bag'?): a step needs exactly one of",
        ),
        ({"steps": [{}]}, "steps[0]: an empty step: a step needs exactly one of"),
        ({"steps": [[]]}, "steps[0]: a JSON object, not a list"),
        (
            {"steps": [{"task": "a", "bag": []}]},
            "steps[0]: 'task' and 'bag' in one step: a step needs exactly one of",
        ),
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
            "steps[0].steps[0].bag[0].pool: a bag or map runs its members side by side: a "
            "serial lane takes single tasks",
        ),
        ({"steps": [{"task": "no spaces"}]}, "steps[0].task: String should match pattern"),
        (
            {"steps": [{"task": "a", "pool": "Fast"}]},
            "steps[0].pool: 'Fast' is not a pool name: use 1-40 of a-z, 0-9, '_' or '-', "
            "starting with a letter",
        ),
        ({"steps": [{"task": "a", "retry": {"max_attempts": 0}}]}, "steps[0].retry.max_attempts"),
        (
            {"steps": [{"task": "a", "args": [1]}]},
            "steps[0].args: Input should be a valid dictionary",
        ),
        ({"steps": "a"}, "steps: Input should be a valid list"),
        ([1], "program: a JSON object, not a list"),
        ({"steps": [{"map": "input", "task": "a"}]}, "steps[0].max_items: Field required"),
        ({"steps": [{"map": "input", "max_items": 2}]}, "steps[0].task: Field required"),
        (
            {"steps": [{"map": "input", "task": "a", "max_items": 1001}]},
            "steps[0].max_items: Input should be less than or equal to 1000",
        ),
        (
            {"steps": [{"map": "items", "task": "a", "max_items": 2}]},
            "steps[0].map: invalid CEL: unknown variable 'items'",
        ),
        (
            {"steps": [{"map": "input", "task": "a", "max_items": 2, "pool": "serial"}]},
            "steps[0].pool: a bag or map runs its members side by side",
        ),
        (
            {"steps": [{"map": "input", "bag": [], "max_items": 2}]},
            "steps[0]: 'bag' and 'map' in one step",
        ),
        ({"steps": [{"sleep_s": 0}]}, "steps[0].sleep_s: Input should be greater than 0"),
        ({"steps": [{"choice": []}]}, "steps[0].choice: List should have at least 1 item"),
        (
            {"steps": [{"choice": [{"when": "x", "steps": [{"task": "a"}]}]}]},
            "steps[0].choice[0].when: invalid CEL: unknown variable 'x'",
        ),
        (
            {"steps": [{"choice": [{"when": "true", "steps": [{"oops": 1}]}]}]},
            "steps[0].choice[0].steps[0]: no kind among 'oops': a step needs exactly one of",
        ),
        (
            {"steps": [{"choice": [{"when": "true", "steps": [{"task": "a"}]}], "otherwise": []}]},
            "steps[0].otherwise: List should have at least 1 item",
        ),
        (
            {"steps": [{"sleep_s": 2592001}]},
            "steps[0].sleep_s: Input should be less than or equal to 2592000",
        ),
        (
            {"steps": [{"sleep_s": 1, "task": "a"}]},
            "steps[0]: 'task' and 'sleep_s' in one step: a step needs exactly one of",
        ),
        (
            {"steps": [{"task": "a", "compensate": {"task": "b", "pool": "serial-x"}}]},
            "steps[0].compensate.pool: a compensation never runs on a serial lane",
        ),
        ({"steps": [{"sleep_s": 1, "args": {}}]}, "steps[0].args: Extra inputs"),
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


def test_pools_outside_shardflow_pools_are_refused_naming_them() -> None:
    program = {
        "steps": [
            {"task": "a", "pool": "billing"},
            {"bag": [{"task": "b", "pool": "billng"}, {"task": "c"}]},
            {"task": "d", "pool": "serial-reports", "compensate": {"task": "u", "pool": "gpu"}},
        ]
    }
    known = Settings(pools="billing,serial-reports").allowed_pools
    with pytest.raises(ProgramError) as caught:
        parse_program(program, known_pools=known)
    assert caught.value.faults == [
        f"{path}: pool {name!r} is not one of SHARDFLOW_POOLS (billing, serial-reports; serial "
        "and parallel always are)"
        for path, name in (("steps[1].bag[0].pool", "billng"), ("steps[2].compensate.pool", "gpu"))
    ]
    assert parse_program(program, known_pools=known | {"billng", "gpu"})
    assert parse_program(program, known_pools=None)  # unset: any pool
    assert Settings().allowed_pools is None


def test_shardflow_pools_is_a_list_of_pool_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDFLOW_POOLS", " gpu, billing ,gpu,")
    assert Settings().pools == "gpu,billing"
    assert Settings().allowed_pools == {"serial", "parallel", "gpu", "billing"}
    for bad, fault in [("GPU", "'GPU' is not a pool name"), ("shard1", "reserved")]:
        monkeypatch.setenv("SHARDFLOW_POOLS", bad)
        with pytest.raises(ValidationError, match=fault):
            Settings()
    monkeypatch.setenv("SHARDFLOW_POOLS", ",".join(f"p{n}" for n in range(257)))
    with pytest.raises(ValidationError, match="257 pools, over 256"):
        Settings()


def test_unknown_task_names_are_refused_when_the_router_knows_the_tasks() -> None:
    program = {"steps": [{"task": "a"}, {"bag": [{"task": "b"}, {"task": "zzz"}]}]}
    assert parse_program(program, known_tasks={"a", "b", "zzz"})
    with pytest.raises(ProgramError, match=r"^steps\[1\]\.bag\[1\]\.task: unknown task 'zzz'$"):
        parse_program(program, known_tasks={"a", "b"})
    # Each unknown name once, at its first use, deep and in compensations too; a program of
    # many unknown names gets a short error.
    deep = {"steps": [
        {"task": "x", "compensate": {"task": "undo"}},
        {"until": "true", "max_iterations": 2, "steps": [{"task": "y"}, {"task": "x"}]},
        {"bag": [{"steps": [{"map": "input", "max_items": 5, "task": "z"}]}]},
    ]}  # fmt: skip
    with pytest.raises(ProgramError) as caught:
        parse_program(deep, known_tasks=set())
    assert caught.value.faults == [
        "steps[0].task: unknown task 'x'",
        "steps[0].compensate.task: unknown task 'undo'",
        "steps[1].steps[0].task: unknown task 'y'",
        "steps[2].bag[0].steps[0].task: unknown task 'z'",
    ]
    many = {"steps": [{"task": f"t{i}"} for i in range(30)]}
    with pytest.raises(ProgramError) as caught:
        parse_program(many, known_tasks=set())
    assert len(caught.value.faults) == 11
    assert caught.value.faults[-1] == "and 20 more unknown tasks"


def test_input_must_be_json() -> None:
    assert parse_input('{"a": [1, 2]}') == {"a": [1, 2]}
    with pytest.raises(ProgramError, match=r"^input: not JSON"):
        parse_input("{a: 1}")


def test_the_schema_describes_every_step_kind() -> None:
    document = schema()
    assert {"Task", "Bag", "Map", "Sleep", "Choice", "Case", "Untiloop"} <= set(document["$defs"])
    assert document["$defs"]["Map"]["required"] == ["task", "map", "max_items"]
    assert document["$defs"]["Untiloop"]["required"] == ["until", "max_iterations", "steps"]


# --- Hostile documents: depth, duplicate keys, NaN, bad Unicode, oversized conditions ----------


def deep(levels: int, leaf: object = 1) -> object:
    """A list nested `levels` deep, built without recursion."""
    for _ in range(levels):
        leaf = [leaf]
    return leaf


def test_deep_nesting_is_refused_not_a_recursion_error() -> None:
    text = "[" * 100_000 + "]" * 100_000
    for parse, what in [(parse_input, "input"), (parse_program, "program")]:
        with pytest.raises(ProgramError, match=rf"^{what}: nested deeper than 64 levels$"):
            parse(text)
    program = {"steps": [{"task": "a", "args": {"x": deep(100_000)}}]}
    with pytest.raises(ProgramError, match=r"^program: nested deeper than 64 levels$"):
        parse_program(program)
    assert parse_input(json.dumps(deep(64))) == deep(64)
    with pytest.raises(ProgramError, match="nested deeper than 64 levels"):
        parse_input(json.dumps(deep(65)))
    looped: dict[str, object] = {}
    looped["self"] = looped
    with pytest.raises(ProgramError, match="nested deeper than 64 levels"):
        parse_program({"steps": [{"task": "a", "args": looped}]})


@pytest.mark.parametrize(
    ("text", "fault"),
    [
        ('{"a": 1, "a": 2}', "duplicate key 'a'"),
        ('{"x": [{"b": 1, "c": 2, "b": 3}]}', "duplicate key 'b'"),
        ("NaN", "NaN is not JSON"),
        ('{"x": Infinity}', "Infinity is not JSON"),
        ("[-Infinity]", "-Infinity is not JSON"),
        ("[1e400]", "number '1e400' is out of range"),
        ("1" * 5000, "number '1111111111111111111111111111111111111111'… has too many digits"),
        ('"\udcff"', "not UTF-8 text: a lone surrogate '\\udcff'"),
        ('"\\udcff"', "not UTF-8 text: a lone surrogate '\\udcff'"),
    ],
)
def test_inputs_are_strict_json(text: str, fault: str) -> None:
    with pytest.raises(ProgramError) as caught:
        parse_input(text)
    assert str(caught.value) == f"input: {fault}"


def test_programs_are_strict_json_whether_text_or_dict() -> None:
    with pytest.raises(ProgramError, match=r"^program: duplicate key 'steps'$"):
        parse_program('{"steps": [{"task": "a"}], "steps": [{"task": "b"}]}')
    with pytest.raises(ProgramError, match=r"^program: duplicate key 'task'$"):
        parse_program('{"steps": [{"task": "a", "task": "b"}]}')
    with pytest.raises(ProgramError, match=r"^program: NaN is not JSON$"):
        parse_program('{"steps": [{"task": "a", "args": {"x": NaN}}]}')
    with pytest.raises(ProgramError, match=r"^program: not UTF-8 text: a lone surrogate"):
        parse_program('{"steps": [{"task": "a", "args": {"x": "\\udcff"}}]}')
    for program in [
        {"steps": [{"task": "a", "timeout_s": math.nan}]},
        {"steps": [{"task": "a", "args": {"x": math.inf}}]},
        {"steps": [{"task": "a", "retry": {"backoff_s": math.nan}}]},
    ]:
        with pytest.raises(ProgramError, match=r"^program: NaN and infinities are not JSON$"):
            parse_program(program)
    with pytest.raises(ValidationError, match="finite number"):
        Retry(backoff_s=math.nan)
    with pytest.raises(ValidationError, match="finite number"):
        Program.model_validate({"steps": [{"task": "a"}], "deadline_s": math.inf})


def test_conditions_are_bounded_when_a_program_is_validated() -> None:
    def loop(until: str) -> dict[str, object]:
        return {"steps": [{"until": until, "max_iterations": 2, "steps": [{"task": "a"}]}]}

    with pytest.raises(ProgramError) as caught:
        parse_program(loop("prev == " + "1 + " * 2500 + "1"))  # 10 KB
    assert str(caught.value) == "steps[0].until: String should have at most 1000 characters"
    with pytest.raises(ProgramError, match=r"^steps\[0\].until: invalid CEL: comprehensions"):
        parse_program(loop("prev.all(a, a.all(b, b.all(c, c.all(d, d))))"))
    with pytest.raises(ProgramError, match=r"^steps\[0\].until: invalid CEL: unknown function"):
        parse_program(loop('bool("true")'))
    assert parse_program(loop("prev.all(a, a.all(b, b.all(c, c > 0)))"))
    assert program_schema()["$defs"]["Untiloop"]["properties"]["until"]["maxLength"] == 1000


# --- Pools: serial, parallel, and named pools --------------------------------------------------


def test_a_task_a_bag_and_a_member_may_name_a_pool() -> None:
    program = parse_program(
        {
            "steps": [
                {"task": "a"},
                {"task": "a", "pool": "reports"},
                {"bag": [{"task": "b"}, {"task": "b", "pool": "gpu-2"}], "pool": "reports"},
                {"bag": [{"task": "b"}, {"task": "b", "pool": "parallel"}]},
            ]
        }
    )
    first, named, bag, plain = program.steps
    assert isinstance(first, Task) and isinstance(named, Task)
    assert isinstance(bag, Bag) and isinstance(plain, Bag)
    assert (pool_of(first), pool_of(named)) == ("serial", "reports")
    assert [pool_of(bag), pool_of(bag, 0), pool_of(bag, 1)] == ["reports", "reports", "gpu-2"]
    assert [pool_of(plain), pool_of(plain, 0), pool_of(plain, 1)] == ["parallel"] * 3
    assert program.pools() == {"serial", "reports", "gpu-2", "parallel"}


BAD_POOLS = ["", "Reports", "9lives", "-x", "a.b", "a b", "x" * 41, "shard0", "shard12", "é"]
GOOD_POOLS = ["a", "reports", "gpu_2", "long-tasks", "x" * 40, "shard", "shards1", "parallel"]


@pytest.mark.parametrize("pool", BAD_POOLS)
def test_a_bad_pool_name_is_refused_naming_its_path(pool: str) -> None:
    for program, path in [
        ({"steps": [{"task": "a", "pool": pool}]}, "steps[0].pool"),
        ({"steps": [{"task": "a"}, {"bag": [{"task": "b"}], "pool": pool}]}, "steps[1].pool"),
        (
            {"steps": [{"bag": [{"task": "b"}, {"task": "b", "pool": pool}]}]},
            "steps[0].bag[1].pool",
        ),
    ]:
        with pytest.raises(ProgramError) as caught:
            parse_program(program)
        assert str(caught.value).startswith(f"{path}: "), str(caught.value)
        assert "is not a pool name" in str(caught.value)


def test_the_schema_accepts_and_refuses_the_pool_names_the_format_does() -> None:
    validator = jsonschema.Draft202012Validator(schema())
    for pool in GOOD_POOLS + BAD_POOLS:
        for program in [
            {"steps": [{"task": "a", "pool": pool}]},
            {"steps": [{"bag": [{"task": "b"}], "pool": pool}]},
            {"steps": [{"bag": [{"task": "b", "pool": pool}]}]},
        ]:
            assert validator.is_valid(program) == (pool in GOOD_POOLS), program
            assert parse_program(program) if pool in GOOD_POOLS else True
    for program in [
        {"steps": [{"bag": [{"task": "b"}], "pool": "serial"}]},
        {"steps": [{"bag": [{"task": "b", "pool": "serial"}]}]},
    ]:
        assert not validator.is_valid(program)
        with pytest.raises(ProgramError, match=r"a serial lane takes single tasks"):
            parse_program(program)
    assert validator.is_valid({"steps": [{"task": "a", "pool": "serial"}]})


@hyp_settings(max_examples=150, deadline=None)
@given(program=with_compensations(programs(max_bag=5, branchy=True)))
def test_every_task_and_pool_is_found_at_the_path_a_fault_would_name(program: dict) -> None:
    """A refusal of an unknown task or pool names the path of its first use: each path
    names that value in the document (or, for a pool not written, the field that would), and
    together they are every task and pool the program uses, so no fault goes unnamed."""
    from orchestrator.program import _leaf_paths

    parsed = parse_program(program)
    tasks, pools = set(), set()
    for (task_path, task), (pool_path, pool) in _leaf_paths(parsed.steps, "steps"):
        assert _at(program, task_path) == task
        assert _at(program, pool_path) in (pool, None)
        tasks.add(task)
        pools.add(pool)
    assert tasks == parsed.task_names()
    assert pools == parsed.pools()


def _at(document: Any, path: str) -> Any:
    """The value at a fault's path (`steps[1].bag[0].pool`), None when the last key is absent."""
    for part in re.findall(r"\[(\d+)\]|\.?([a-z_]+)", path):
        index, key = part
        document = document[int(index)] if index else document.get(key)
        if document is None:
            return None
    return document


@pytest.mark.parametrize(
    ("step", "fault"),
    [
        ({"sleep_s": True}, "steps[0]: sleep_s: a boolean where a number goes"),
        ({"task": "a", "retry": {"max_attempts": True}}, "steps[0].retry: max_attempts: a bool"),
        ({"until": "false", "max_iterations": True, "steps": [{"task": "a"}]}, "max_iterations"),
        ({"bag": [{"task": "a"}], "chunk": False}, "steps[0]: chunk: a boolean where a number"),
        ({"task": "a", "timeout_s": True}, "steps[0]: timeout_s: a boolean where a number goes"),
    ],
)
def test_a_boolean_is_no_number(step: dict[str, Any], fault: str) -> None:
    """pydantic took `true` for 1 where the published schema says integer or number: a
    `"max_attempts": true` meant one attempt, silently."""
    with pytest.raises(ProgramError) as refused:
        parse_program(json.dumps({"steps": [step]}))
    assert fault in str(refused.value), str(refused.value)
    assert parse_program(json.dumps({"steps": [{"sleep_s": "5"}]}))  # a number as a string


def test_every_field_the_schema_calls_a_number_refuses_a_boolean() -> None:
    """Tied to the published schema, so a field added later is covered too."""
    from orchestrator import program

    def numeric(schema: dict[str, Any]) -> bool:
        kinds = [schema, *schema.get("anyOf", [])]
        return any(kind.get("type") in ("integer", "number") for kind in kinds)

    models, found = list(program._Model.__subclasses__()), 0
    while models:
        model = models.pop()
        models.extend(model.__subclasses__())
        schema = model.model_json_schema()
        if "$ref" in schema:  # a recursive model: its own entry among the definitions
            schema = schema["$defs"][schema["$ref"].rsplit("/", 1)[1]]
        properties = schema["properties"]
        for name, field in model.model_fields.items():
            kind = properties[field.alias or name]
            assert numeric(kind) == program._numeric(field.annotation), (model, name)
            if numeric(kind):
                found += 1
                with pytest.raises(ValidationError, match="a boolean where a number goes"):
                    model.model_validate({field.alias or name: True})
    assert found >= 17


def test_only_the_first_unknown_keys_are_matched_to_a_field() -> None:
    """A fuzzy match for each of thousands of keys held the router's loop (0.47 s for 240 KB,
    where the refusal alone took 0.07 s)."""
    from orchestrator.program import MAX_UNKNOWN_NAMED

    step = {"task": "a", **{f"timeout_{n:03}": 1 for n in range(3 * MAX_UNKNOWN_NAMED)}}
    with pytest.raises(ProgramError) as caught:
        parse_program({"steps": [step]})
    said = str(caught.value)
    assert said.count("Extra inputs are not permitted") == 3 * MAX_UNKNOWN_NAMED
    assert said.count("(did you mean 'timeout_s'?)") == MAX_UNKNOWN_NAMED, said
