"""Step references: ids, `args_from` and `steps.<id>` in CEL; what submit refuses (naming
each fault's path), what the machine computes and records, and what advance.lua keeps."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from orchestrator.conditions import ConditionError, compile_condition, step_references
from orchestrator.keys import Keys
from orchestrator.machine import (
    MAX_ITEM_BYTES,
    MAX_REF_BYTES,
    Done,
    Failed,
    Leaf,
    after,
    first,
)
from orchestrator.memory_store import MemoryStore
from orchestrator.messages import Next, Start, decode_task
from orchestrator.plans import Plans
from orchestrator.program import ProgramError, parse_program, program_schema
from orchestrator.redis_store import RedisStore
from orchestrator.settings import Settings
from orchestrator.store import Store
from orchestrator.transitions import Transitions
from router.client import Router
from tests.test_owner_steps import Recorder


def refused(program: dict[str, Any]) -> list[str]:
    with pytest.raises(ProgramError) as caught:
        parse_program(program)
    return caught.value.faults


# --- CEL ---------------------------------------------------------------------------------


def test_references_are_read_from_the_cel_source_outside_strings_and_fields() -> None:
    source = 'steps.fetch.rows + size(steps.b_2) // steps.not_this\n + "steps.nor_this"'
    assert step_references(source) == {"fetch", "b_2"}
    assert step_references("input.steps.x + prev.map(s, s.steps)") == frozenset()
    assert step_references("steps . spaced") == {"spaced"}


@pytest.mark.parametrize(
    ("source", "error"),
    [
        ('steps["fetch"]', "write steps.<id> to use the output of a step"),
        ("steps", "write steps.<id> to use the output of a step"),
        ("size(steps) > 0", "write steps.<id> to use the output of a step"),
        ("prev.all(steps, steps > 1)", "write steps.<id> to use the output of a step"),
        ("steps.Fetch", "steps.Fetch: not a step id"),
        ("steps." + "a" * 41, "not a step id"),
    ],
)
def test_any_other_use_of_steps_is_refused(source: str, error: str) -> None:
    with pytest.raises(ConditionError, match=error):
        compile_condition(source)


# --- submit ------------------------------------------------------------------------------


def test_a_valid_program_reads_earlier_steps_ancestors_and_a_finished_loop() -> None:
    program = parse_program(
        {
            "steps": [
                {"id": "fetch", "task": "a"},
                {
                    "id": "loop",
                    "until": "steps.poll.done && steps.fetch.ok",
                    "max_iterations": 3,
                    "steps": [
                        {"id": "poll", "task": "b", "args_from": {"c": "steps.fetch.c"}},
                        {
                            "choice": [
                                {
                                    "when": "steps.poll.done",
                                    "steps": [{"bag": [{"task": "c"}, {"task": "d"}]}],
                                }
                            ],
                            "otherwise": [
                                {"task": "e", "args_from": {"p": "steps.poll", "f": "steps.fetch"}}
                            ],
                        },
                    ],
                },
                {
                    "map": "steps.fetch.items",
                    "task": "m",
                    "max_items": 3,
                    "args_from": {"last": "steps.poll", "loop": "steps.loop"},
                },
                {"id": "nap", "sleep_s": 1},
                {"bag": [{"task": "x", "args_from": {"n": "steps.nap"}}, {"task": "y"}]},
            ]
        }
    )
    assert program.referenced == {"fetch", "poll", "loop", "nap"}


def test_duplicate_ids_are_refused_naming_both_paths() -> None:
    program = {
        "steps": [
            {"id": "x", "task": "a"},
            {"until": "true", "max_iterations": 1, "steps": [{"id": "x", "sleep_s": 1}]},
            {"choice": [{"when": "true", "steps": [{"id": "x", "task": "a"}]}], "id": "y"},
        ]
    }
    assert refused(program) == [
        "steps[1].steps[0].id: id 'x' is also the id of steps[0]",
        "steps[2].choice[0].steps[0].id: id 'x' is also the id of steps[0]",
    ]


@pytest.mark.parametrize(
    ("program", "faults"),
    [
        (
            {"steps": [{"task": "a", "args_from": {"customer": "steps.fetch.customer"}}]},
            ["steps[0].args_from.customer: unknown step id 'fetch'"],
        ),
        (  # itself
            {"steps": [{"id": "me", "task": "a", "args_from": {"x": "steps.me"}}]},
            ["steps[0].args_from.x: step 'me' (steps[0]) cannot have finished before this runs"],
        ),
        (  # a later step
            {"steps": [{"map": "steps.b", "task": "a", "max_items": 1}, {"id": "b", "task": "b"}]},
            ["steps[0].map: step 'b' (steps[1]) cannot have finished before this runs"],
        ),
        (  # the loop that encloses it
            {
                "steps": [
                    {
                        "id": "loop",
                        "until": "true",
                        "max_iterations": 2,
                        "steps": [{"bag": [{"task": "a", "args_from": {"x": "steps.loop"}}]}],
                    }
                ]
            },
            [
                "steps[0].steps[0].bag[0].args_from.x: step 'loop' (steps[0]) cannot have "
                "finished before this runs"
            ],
        ),
        (  # a later step of the loop's body: in the first iteration it has not run
            {
                "steps": [
                    {
                        "until": "true",
                        "max_iterations": 2,
                        "steps": [
                            {"task": "a", "args_from": {"x": "steps.b"}},
                            {"id": "b", "task": "b"},
                        ],
                    }
                ]
            },
            ["steps[0].steps[0].args_from.x: step 'b' (steps[0].steps[1]) cannot have"],
        ),
        (  # inside a case: another case, the choice's own when, the step after the choice
            {
                "steps": [
                    {
                        "choice": [
                            {"when": "steps.c == 1", "steps": [{"id": "c", "task": "a"}]},
                            {
                                "when": "true",
                                "steps": [{"task": "b", "args_from": {"x": "steps.c"}}],
                            },
                        ],
                    },
                    {"task": "d", "args_from": {"x": "steps.c"}},
                ]
            },
            [
                "steps[0].choice[0].when: step 'c' (steps[0].choice[0].steps[0]) cannot have",
                "steps[0].choice[1].steps[0].args_from.x: step 'c' (steps[0].choice[0].steps[0])",
                "steps[1].args_from.x: step 'c' (steps[0].choice[0].steps[0]) cannot have",
            ],
        ),
        (  # a step nested below a loop's body: it may not have run
            {
                "steps": [
                    {
                        "until": "true",
                        "max_iterations": 2,
                        "steps": [
                            {
                                "choice": [
                                    {"when": "false", "steps": [{"id": "deep", "task": "a"}]}
                                ],
                                "otherwise": [{"task": "b"}],
                            }
                        ],
                    },
                    {"task": "c", "args_from": {"x": "steps.deep"}},
                ]
            },
            ["steps[1].args_from.x: step 'deep' (steps[0].steps[0].choice[0].steps[0]) cannot"],
        ),
        (
            {"steps": [{"task": "a", "args": {"x": 1}, "args_from": {"x": "input"}}]},
            ["steps[0].args_from.x: also in args; give it in one"],
        ),
        (
            {"steps": [{"map": "input", "task": "a", "max_items": 1, "args_from": {"k": "x"}}]},
            ["steps[0].args_from.k: invalid CEL: unknown variable 'x'"],
        ),
        (
            {"steps": [{"task": "a", "args_from": {"k": 'steps["a"]'}}]},
            ["steps[0].args_from.k: invalid CEL: write steps.<id> to use the output of a step"],
        ),
        (
            {"steps": [{"task": "a", "args_from": {"k": ""}}]},
            ["steps[0].args_from.k: String should have at least 1 character"],
        ),
        (
            {"steps": [{"task": "a", "args_from": {f"k{n}": "input" for n in range(21)}}]},
            ["steps[0].args_from: Dictionary should have at most 20 items"],
        ),
        (
            {"steps": [{"task": "a", "id": "Fetch"}]},
            ["steps[0].id: String should match pattern"],
        ),
        ({"steps": [{"bag": [{"task": "a", "id": "m"}]}]}, ["steps[0].bag[0].id: Extra inputs"]),
    ],
)
def test_every_fault_of_a_reference_is_refused_naming_its_path(
    program: dict[str, Any], faults: list[str]
) -> None:
    found = refused(program)
    assert len(found) == len(faults), found
    for fault, expected in zip(found, faults, strict=True):
        assert fault.startswith(expected), found


def test_the_schema_knows_ids_and_args_from() -> None:
    schema = program_schema()
    program = {
        "steps": [
            {"id": "fetch", "task": "a"},
            {"task": "b", "args_from": {"x": "steps.fetch"}},
            {"id": "z", "sleep_s": 1},
        ]
    }
    jsonschema.validate(program, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"steps": [{"id": "Bad", "task": "a"}]}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"steps": [{"task": "a", "args_from": {"x": 1}}]}, schema)


# --- the machine -------------------------------------------------------------------------

LOOPED = parse_program(
    {
        "steps": [
            {"id": "fetch", "task": "a"},
            {
                "id": "loop",
                "until": "steps.tick.n >= 1",
                "max_iterations": 3,
                "steps": [
                    {"id": "tick", "task": "b"},
                    {"task": "c", "args": {"k": 1}, "args_from": {"f": "steps.fetch.v"}},
                ],
            },
            {"task": "d", "args_from": {"t": "steps.tick", "l": "steps.loop"}},
        ]
    }
)


def test_the_machine_reports_which_referenced_steps_finished_and_evaluates_args() -> None:
    leaf = first(LOOPED)
    assert isinstance(leaf, Leaf) and leaf.refs == () and leaf.args == ()
    leaf = after(LOOPED, "0", {"v": 5}, None)
    assert isinstance(leaf, Leaf) and leaf.path == "1/iter:0/0"
    assert leaf.refs == (("fetch", '{"v": 5}'),)
    # The next transition reads fetch from the store; tick finishes on the way.
    leaf = after(LOOPED, "1/iter:0/0", {"n": 0}, None, {"fetch": {"v": 5}})
    assert isinstance(leaf, Leaf) and leaf.path == "1/iter:0/1"
    assert (leaf.refs, leaf.args) == ((("tick", '{"n": 0}'),), ({"f": 5},))
    # until reads tick (not met), so iteration 1 runs; then tick's latest output wins.
    leaf = after(LOOPED, "1/iter:0/1", "c0", None, {"fetch": {"v": 5}, "tick": {"n": 0}})
    assert isinstance(leaf, Leaf) and leaf.path == "1/iter:1/0" and leaf.refs == ()
    leaf = after(LOOPED, "1/iter:1/0", {"n": 1}, None, {"fetch": {"v": 5}, "tick": {"n": 0}})
    assert isinstance(leaf, Leaf) and leaf.refs == (("tick", '{"n": 1}'),)
    # The body's last step ends the loop: the loop's own output is recorded with it.
    leaf = after(LOOPED, "1/iter:1/1", "c1", None, {"fetch": {"v": 5}, "tick": {"n": 1}})
    assert isinstance(leaf, Leaf) and leaf.path == "2"
    assert leaf.refs == (("loop", '"c1"'),)
    assert leaf.args == ({"t": {"n": 1}, "l": "c1"},)
    done = after(LOOPED, "2", "end", None, {"fetch": {"v": 5}, "tick": {"n": 1}, "loop": "c1"})
    assert done == Done("end")


def test_an_id_nobody_reads_is_not_recorded() -> None:
    program = parse_program({"steps": [{"id": "lonely", "task": "a"}, {"task": "b"}]})
    leaf = after(program, "0", 1, None)
    assert isinstance(leaf, Leaf) and leaf.refs == ()


def test_arguments_and_referenced_outputs_over_their_bounds_fail_naming_the_step() -> None:
    program = parse_program(
        {
            "steps": [
                {"id": "big", "task": "a"},
                {"task": "b", "args_from": {"x": "input"}},
                {"bag": [{"task": "c"}, {"task": "c", "args_from": {"y": "steps.big"}}]},
            ]
        }
    )
    too_big = "x" * MAX_REF_BYTES
    failed = after(program, "0", too_big, None)
    assert isinstance(failed, Failed)
    assert failed.error == (
        f"step 0 (id 'big'): its output of {MAX_REF_BYTES + 2} bytes is over {MAX_REF_BYTES}, "
        "the limit for a step that other steps read"
    )
    failed = after(program, "0", 1, "y" * MAX_ITEM_BYTES)
    assert isinstance(failed, Failed)
    assert failed.error == (
        f"step 1: args_from 'x' 'input': gave {MAX_ITEM_BYTES + 2} bytes, over {MAX_ITEM_BYTES}"
    )
    failed = after(program, "1", 1, None, {})  # big was never recorded: a clear error too
    assert isinstance(failed, Failed)
    assert failed.error.startswith("step 2/bag:1: args_from 'y' 'steps.big': no such key")


def test_a_maps_arguments_count_once_per_member() -> None:
    program = parse_program(
        {
            "steps": [
                {
                    "map": "input.items",
                    "task": "m",
                    "max_items": 1000,
                    "args_from": {"blob": "input.blob"},
                }
            ]
        }
    )
    few = first(program, {"items": [1, 2], "blob": "b" * 60_000})
    assert isinstance(few, Leaf) and few.args == ({"blob": "b" * 60_000},)
    many = first(program, {"items": list(range(100)), "blob": "b" * 60_000})
    assert isinstance(many, Failed)
    assert many.error.startswith("step 0: the arguments its args_from gave come to 6001")


# --- advance.lua -------------------------------------------------------------------------

PLAN = json.dumps({"program": {"steps": [{"task": "a"}]}, "input": None, "owner": 1})


async def test_advance_records_references_only_when_it_applies(store: RedisStore) -> None:
    wf = "wf-refs"
    await store.submit(wf, PLAN, 1, "demo", "d")
    await store.advance(wf, "", "0", "running")
    moved = await store.advance(wf, "0", "1", "running", leaf="task", refs=[("a", '{"v": 1}')])
    assert moved.verdict == "applied"
    assert await store.refs(wf, ["a", "b"]) == {"a": '{"v": 1}'}
    registry = await store.client.smembers(store.keys.registry(wf))  # type: ignore[misc]
    assert store.keys.ref(wf, "a") in registry
    # A stale and a replayed advance change nothing.
    stale = await store.advance(wf, "", "0", "running", refs=[("a", '"old"')])
    replay = await store.advance(wf, "0", "1", "running", refs=[("a", '"again"'), ("b", "2")])
    assert (stale.verdict, replay.verdict) == ("stale", "replay")
    assert await store.refs(wf, ["a", "b"]) == {"a": '{"v": 1}'}
    # The latest wins; a loop dropping an old iteration keeps every ref.
    await store.advance(wf, "1", "2/iter:1/0", "running", drop="2/iter:0/", refs=[("a", "3")])
    assert await store.refs(wf, ["a"]) == {"a": "3"}


# --- the owner, step by step -------------------------------------------------------------


@pytest.mark.parametrize("kind", ["redis", "memory"])
async def test_a_stale_report_of_an_old_iteration_changes_no_recorded_output(
    store: RedisStore, kind: str
) -> None:
    """A loop's step read after the loop is its last iteration's output, even when a report
    of an earlier iteration comes back late (a duplicate, a redelivery) in between."""
    inner: Store = store if kind == "redis" else MemoryStore(Keys(store.keys.prefix))
    bus = Recorder()
    transitions = Transitions(inner, bus, Plans(inner, 8))
    router = Router(Settings(prefix=inner.keys.prefix), store=inner, bus=bus)
    program = {
        "steps": [
            {
                "until": "iteration >= 1",
                "max_iterations": 3,
                "steps": [{"id": "a", "task": "work"}, {"task": "work"}],
            },
            {"task": "echo", "args_from": {"ref": "steps.a"}},
        ]
    }
    owner = (await router.submit(program, None, "looper")).shard

    async def deliver(message: Start | Next, redelivered: bool = False) -> str:
        return await transitions.apply(message, redelivered=redelivered, shard=owner)

    assert await deliver(Start(wf="looper")) == "applied"
    for path, output in [("0/iter:0/0", "a0"), ("0/iter:0/1", "b0"), ("0/iter:1/0", "a1")]:
        assert await deliver(Next(wf="looper", path=path, output=output)) == "applied"
    # Iteration 0's report of `a` again, late: stale, and it records nothing.
    assert await deliver(Next(wf="looper", path="0/iter:0/0", output="a0")) == "stale"
    assert await deliver(Next(wf="looper", path="0/iter:0/0", output="a0"), True) == "stale"
    assert await deliver(Next(wf="looper", path="0/iter:1/1", output="b1")) == "applied"
    last = decode_task(bus.tasks[-1])
    assert (last.path, last.task, last.args) == ("1", "echo", {"ref": "a1"})
    assert await inner.refs("looper", ["a"]) == {"a": '"a1"'}
