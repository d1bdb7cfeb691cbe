"""The owner's plan cache on real Redis: plans recorded with the same program share one parsed
program (a miss costs a read, not a parse), each keeps its own input, and both caches stay
within their bounds."""

from __future__ import annotations

from typing import Any

import pytest

from orchestrator import plans as plans_module
from orchestrator.plans import Plans
from orchestrator.redis_store import RedisStore
from orchestrator.settings import Settings
from router.client import Router
from tests.test_owner_steps import Recorder

BAG = {"steps": [{"task": "a"}, {"bag": [{"task": "b"}, {"task": "c", "pool": "parallel"}]}]}


async def _submit(
    settings: Settings, store: RedisStore, program: Any, inputs: list[Any]
) -> list[str]:
    router = Router(settings, store=store, bus=Recorder())
    return [(await router.submit(program, value)).workflow_id for value in inputs]


async def test_plans_of_one_program_share_its_parse_and_keep_their_inputs(
    settings: Settings, store: RedisStore
) -> None:
    ids = await _submit(settings, store, BAG, [{"n": n} for n in range(5)])
    plans = Plans(store, size=2)  # smaller than the programs: every revisit is a miss
    for _ in range(2):
        got = [await plans.get(wf) for wf in ids]
        assert [plan.input for plan in got if plan] == [{"n": n} for n in range(5)]
    assert plans.parses == 1
    first, *rest = [await plans.get(wf) for wf in ids]
    assert first is not None and all(
        plan is not None and plan.program is first.program for plan in rest
    )
    assert len(plans._cache) == 2


async def test_a_program_is_its_recorded_text_and_its_args_keep_their_order(
    settings: Settings, store: RedisStore
) -> None:
    """The router records a program's fields in the model's order (one parse for both ways of
    writing BAG), but args as the user wrote them: those are other programs, each run with its
    own order, as a handler sees it."""
    reordered = {
        "steps": [{"task": "a"}, {"bag": [{"task": "b"}, {"pool": "parallel", "task": "c"}]}]
    }
    ab = {"steps": [{"task": "a", "args": {"x": 1, "y": 2}}]}
    ba = {"steps": [{"task": "a", "args": {"y": 2, "x": 1}}]}
    ids = []
    for program in (BAG, reordered, ab, ba):
        ids += await _submit(settings, store, program, [None])
    plans = Plans(store, size=8)
    got = [await plans.get(wf) for wf in ids]
    assert all(got)
    assert plans.parses == 3
    assert got[0].program is got[1].program  # type: ignore[union-attr]
    args = [list(plan.program.steps[0].args) for plan in got[2:]]  # type: ignore[union-attr]
    assert args == [["x", "y"], ["y", "x"]]


async def test_distinct_programs_kept_parsed_are_bounded(
    settings: Settings, store: RedisStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(plans_module, "MAX_PROGRAMS", 3)
    programs = [{"name": f"p{k}", "steps": [{"task": "a"}]} for k in range(4)]
    ids = [(await _submit(settings, store, program, [None]))[0] for program in programs]
    plans = Plans(store, size=1)
    for wf in ids:
        assert await plans.get(wf) is not None
    assert plans.parses == 4 and len(plans._programs) == 3
    await plans.get(ids[0])  # the oldest was let go: parsed again
    assert plans.parses == 5
    await plans.get(ids[3])  # still kept: a read, no parse
    assert plans.parses == 5
    await plans.get(ids[2])  # used last: kept
    await plans.get(ids[1])  # parsed again, lets go of the least recently used (ids[0])
    assert plans.parses == 6
    await plans.get(ids[0])  # and again, lets go of ids[3]
    assert plans.parses == 7
    await plans.get(ids[2])  # used since ids[3]: still kept
    assert plans.parses == 7
