"""Plans: a recorded program with its input, as the owner reads it, and the cache of them.

A plan is immutable once submitted, so it is only ever cached, never kept as state. A parsed
program is shared by every plan recorded with the same program text: a program submitted
many times with different inputs (the common case) is parsed once, and a plan missed by the
cache, as it is when more programs are live than the cache holds, costs a read, not a parse.
The text, not a normal form: key order inside `args` is the user's, and a handler sees it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from orchestrator.caches import ByText, Lru, json_bytes, program_bytes
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

# What the plan cache may hold, in bytes (caches.py's estimates): its inputs, and each distinct
# program its plans hold parsed, once. A count alone let 1,024 plans of 256 KiB inputs outgrow
# the chart's 256 MiB limit; inputs' text alone let 16,384 plans of programs of their own (a
# bag of 100 members with their args: 92 KB parsed each) grow to 1.5 GB.
MAX_PLAN_BYTES = 64 << 20
# What a plan costs besides its input's text: its key, the Plan and the table's entry
# (215 bytes measured with tracemalloc, and a 32-character id).
PLAN_OVERHEAD = 300


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
    # What its program holds parsed, about (`caches.program_bytes`): shared by the plans of one
    # program text, and charged to the plan cache once.
    program_bytes: int = 0

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
    cost: int  # what the program holds parsed, about


class Plans:
    """A bounded cache of plans, so a transition costs one Redis call, not two; and of parsed
    programs by their text's digest, so a plan's miss costs a read, not a parse."""

    def __init__(self, store: Store, size: int) -> None:
        self._store = store
        # Each plan with its shard's generation when it was read: one read before the shard's
        # last `forget_shard` is no hit (dropping them one by one was a scan of the cache).
        self._cache: Lru[str, tuple[Plan, int]] = Lru(size, MAX_PLAN_BYTES, _program_of)
        self._generations: dict[int, int] = {}
        self._forgets = 0  # shards forgotten so far: a read that spans one is not kept
        self._programs = ByText(self._parse)

    async def get(self, wf: str, *, fresh: bool = False) -> Plan | None:
        """The program's plan; `fresh` reads it again (a start: an id whose program ended, was
        purged or expired, and was submitted again has a new plan under the same id)."""
        if fresh:
            self._cache.pop(wf)
        plan = self.cached(wf)
        if plan is not None:
            return plan
        forgets = self._forgets
        raw = await self._store.plan(wf)
        if raw is None:
            return None
        generation = self._generations.get(raw["owner"], 0)
        parsed = self._programs.get(raw["program"])
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
            parsed.cost,
        )
        # The input as read, and its text too when the plan keeps that.
        cost = PLAN_OVERHEAD + json_bytes(text.encode()) + (len(text) if big else 0)
        if forgets == self._forgets:  # a shard forgotten meanwhile: this read may be older
            self._cache.put(wf, (plan, generation), cost)
        return plan

    def cached(self, wf: str) -> Plan | None:
        """The plan kept for `wf`, unless its shard's plans were forgotten since it was read."""
        found = self._cache.get(wf)
        if found is None:
            return None
        plan, generation = found
        return plan if generation == self._generations.get(plan.owner, 0) else None

    def forget(self, wf: str) -> None:
        self._cache.pop(wf)

    def forget_shard(self, owner: int) -> None:
        """Let no plan of one shard's programs read until now be a hit: this process has just
        become the shard's owner, which another process was meanwhile, where an id may have
        ended, been purged and been submitted again with another program. O(1); the old
        entries go as the cache's least recently used."""
        self._generations[owner] = self._generations.get(owner, 0) + 1
        self._forgets += 1

    @property
    def parses(self) -> int:
        """Programs parsed so far (tests/test_plans.py)."""
        return self._programs.made

    @staticmethod
    def _parse(source: Any) -> _Parsed:
        program = parse_program(source, max_bytes=1 << 30)
        text = source if isinstance(source, str) else json.dumps(source)
        cost = program_bytes(text.encode())
        return _Parsed(program, _evaluates(program.steps), share_of(program), cost)


def _program_of(entry: tuple[Plan, int]) -> tuple[object, int]:
    """The part plans share: their parsed program, and what it holds."""
    return entry[0].program, entry[0].program_bytes


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
