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


async def test_a_program_with_its_keys_in_another_order_is_the_same_program(
    settings: Settings, store: RedisStore
) -> None:
    reordered = {
        "steps": [{"task": "a"}, {"bag": [{"task": "b"}, {"pool": "parallel", "task": "c"}]}]
    }
    other = {"steps": [{"task": "a"}, {"task": "b"}]}
    ids = await _submit(settings, store, BAG, [1]) + await _submit(settings, store, reordered, [2])
    ids += await _submit(settings, store, other, [3])
    plans = Plans(store, size=8)
    got = [await plans.get(wf) for wf in ids]
    assert all(got)
    assert plans.parses == 2
    assert got[0].program is got[1].program and got[2].program is not got[0].program  # type: ignore[union-attr]
    assert got[2].program.steps[1].task == "b"  # type: ignore[union-attr]


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
