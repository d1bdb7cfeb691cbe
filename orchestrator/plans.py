"""Plans: a recorded program with its input, as the owner reads it, and the cache of them.

A plan is immutable once submitted, so it is only ever cached, never kept as state. A parsed
program is shared by every plan recorded with the same program text: a program submitted
many times with different inputs (the common case) is parsed once, and a plan missed by the
cache, as it is when more programs are live than the cache holds, costs a read, not a parse.
The text, not a normal form: key order inside `args` is the user's, and a handler sees it.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from orchestrator.messages import INLINE_BYTES
from orchestrator.program import (
    MAX_PRIORITY,
    Bag,
    Branch,
    Choice,
    Map,
    Program,
    Step,
    Task,
    Untiloop,
    parse_program,
)
from orchestrator.shares import share_of
from orchestrator.store import Store

# Distinct programs kept parsed besides those of the cached plans (deployments run tens of
# kinds). A constant, not the plan cache's size: each may be up to a program's limit.
MAX_PROGRAMS = 256


@dataclass(frozen=True, slots=True)
class Plan:
    """A recorded program with its input and owner: immutable once submitted."""

    program: Program
    input: Any
    owner: int
    # The input as JSON when it is too large to carry in task messages (they refer to it).
    big_input: str | None = None
    # Whether moving on may evaluate CEL (an until or a map): then it waits in a thread.
    evaluates: bool = False
    # Which of a pool's task queues its tasks go to (fair share: orchestrator/shares.py).
    share: int = 0
    # The program's priority (0..MAX_PRIORITY, given at submit): its tasks' head start.
    priority: int = 0

    @property
    def undoable(self) -> frozenset[str]:
        """The paths of the top-level steps that name compensations (lua/begin.lua)."""
        return frozenset(str(n) for n, _ in self.program.compensations)


@dataclass(frozen=True, slots=True)
class _Parsed:
    """What a plan takes from its program alone."""

    program: Program
    evaluates: bool
    share: int


class Plans:
    """A bounded cache of plans, so a transition costs one Redis call, not two; and of parsed
    programs by their text's digest, so a plan's miss costs a read, not a parse."""

    def __init__(self, store: Store, size: int) -> None:
        self._store = store
        self._size = size
        self._cache: OrderedDict[str, Plan] = OrderedDict()
        self._programs: OrderedDict[bytes, _Parsed] = OrderedDict()  # by the text's digest
        self.parses = 0  # programs parsed (tests/test_plans.py)

    async def get(self, wf: str) -> Plan | None:
        plan = self._cache.get(wf)
        if plan is not None:
            self._cache.move_to_end(wf)
            return plan
        raw = await self._store.plan(wf)
        if raw is None:
            return None
        parsed = self._parsed(raw["program"])
        text = json.dumps(raw["input"])
        big = text if len(text) > INLINE_BYTES else None
        plan = Plan(
            parsed.program,
            raw["input"],
            raw["owner"],
            big,
            parsed.evaluates,
            parsed.share,
            _priority(raw.get("priority")),
        )
        self._cache[wf] = plan
        if len(self._cache) > self._size:
            self._cache.popitem(last=False)
        return plan

    def forget(self, wf: str) -> None:
        self._cache.pop(wf, None)

    def _parsed(self, source: Any) -> _Parsed:
        """The program recorded as `source`, parsed once for every plan that records it."""
        try:  # a tenth of a parse's cost (bench/README); a digest keeps the table small
            key = hashlib.blake2b(json.dumps(source).encode(), digest_size=32).digest()
        except (RecursionError, ValueError):  # not a program: parse_program names the fault
            return self._parse(source)
        parsed = self._programs.get(key)
        if parsed is not None:
            self._programs.move_to_end(key)
            return parsed
        parsed = self._programs[key] = self._parse(source)
        if len(self._programs) > MAX_PROGRAMS:
            self._programs.popitem(last=False)
        return parsed

    def _parse(self, source: Any) -> _Parsed:
        program = parse_program(source, max_bytes=1 << 30)
        self.parses += 1
        return _Parsed(program, _evaluates(program.steps), share_of(program))


def _priority(value: Any) -> int:
    """A recorded priority (absent before priorities existed: 0); anything else is no level."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_PRIORITY:
        return value
    return 0


def _evaluates(steps: list[Step]) -> bool:
    """Whether any step is an untiloop, a map or a choice (any deeper down is inside one up
    here), or computes arguments (`args_from`), here or in a bag's branch: moving on may then
    evaluate CEL, and waits in a thread."""
    return any(
        isinstance(step, Map | Untiloop | Choice)
        or (isinstance(step, Task) and bool(step.args_from or step.limit))
        or (
            isinstance(step, Bag)
            and any(
                _evaluates(member.steps)
                if isinstance(member, Branch)
                else member.args_from or member.limit
                for member in step.bag
            )
        )
        for step in steps
    )
