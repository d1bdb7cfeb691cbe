"""The owner's plan cache on real Redis: plans recorded with the same program share one parsed
program (a miss costs a read, not a parse), each keeps its own input, and both caches stay
within their bounds."""

from __future__ import annotations

import json
from typing import Any

import pytest

from orchestrator import caches as caches_module
from orchestrator import plans as plans_module
from orchestrator.plans import Plans
from orchestrator.program import ProgramError
from orchestrator.redis_store import RedisStore
from orchestrator.settings import Settings
from router import explain as explain_module
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
    monkeypatch.setattr(caches_module, "MAX_PROGRAMS", 3)
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


async def test_both_caches_hold_a_bounded_number_of_bytes(
    settings: Settings, store: RedisStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """However few entries: plans by their inputs' text, programs by theirs; the one put last
    is kept even when it alone is over the budget."""
    monkeypatch.setattr(plans_module, "MAX_PLAN_BYTES", 2500 + 3 * plans_module.PLAN_OVERHEAD)
    program = {"name": "bytes", "steps": [{"task": "a"}]}
    ids = await _submit(settings, store, program, ["x" * 1000 for _ in range(4)])
    plans = Plans(store, size=100)
    for wf in ids:
        assert await plans.get(wf) is not None
    each = plans_module.PLAN_OVERHEAD + 1002  # the text has its quotes
    assert len(plans._cache) == 2 and plans._cache.bytes == 2 * each
    plans.forget(ids[3])
    assert len(plans._cache) == 1 and plans._cache.bytes == each
    wide = [
        {"name": f"w{k}", "steps": [{"task": "a", "args": {"pad": "y" * 500}}]} for k in range(3)
    ]
    monkeypatch.setattr(caches_module, "MAX_PROGRAM_BYTES", 1200)  # two of these texts
    texts = caches_module.ByText(lambda source: source["name"])
    assert [texts.get(w) for w in wide] == ["w0", "w1", "w2"]
    assert len(texts) == 2 and texts.get(wide[0]) == "w0" and texts.made == 4
    huge = caches_module.ByText(lambda source: len(source))
    assert huge.get("z" * 5000) == 5000 and len(huge) == 1  # alone over it: kept


async def test_a_router_validates_a_program_given_again_once_and_exactly(
    settings: Settings, store: RedisStore
) -> None:
    """The router checks a program it is given again once (the same frozen Program), from a
    dict or its text; a value `json` writes as another's text is still checked on its own."""
    router = Router(settings, store=store, bus=Recorder())
    first = router.validate(BAG)
    assert router.validate(json.loads(json.dumps(BAG))) is first
    text = json.dumps(BAG)  # the dict's own text
    assert router.validate(text) is router.validate(text.encode()) is first
    spaced = json.dumps(BAG, indent=1)
    assert router.validate(spaced) is router.validate(spaced.encode()) is not first
    assert router._validated.made == 2
    named = {"steps": [{"task": "a", "args": {"1": "x"}}]}
    router.validate(named)
    with pytest.raises(ProgramError, match="args"):  # an int key: json writes it as "1"
        router.validate({"steps": [{"task": "a", "args": {1: "x"}}]})
    with pytest.raises(ProgramError, match="args"):  # and so after the same check, cold
        Router(settings, store=store).validate({"steps": [{"task": "a", "args": {1: "x"}}]})
    ids = await _submit(settings, store, BAG, [1, 2])  # its own router: one check for both
    assert [(await store.plan(wf))["program"] for wf in ids] == [
        first.model_dump(mode="json", exclude_defaults=True)
    ] * 2


async def test_status_parses_a_recorded_program_once(settings: Settings, store: RedisStore) -> None:
    program = {"name": "status-once", "steps": [{"task": "a"}]}
    ids = await _submit(settings, store, program, [1, 2, 3])
    router = Router(settings, store=store)
    before = explain_module._RECORDED.made
    statuses = [await router.status(wf) for wf in ids]
    assert [status and status["steps"] for status in statuses] == [1, 1, 1]
    assert explain_module._RECORDED.made == before + 1
