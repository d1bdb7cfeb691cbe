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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

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
# What each cache may hold, in bytes of the JSON text it was made of (parsed, a few times
# that): a count alone let 1,024 plans of 256 KiB inputs outgrow the chart's 256 MiB limit.
MAX_PLAN_BYTES = 16 << 20
MAX_PROGRAM_BYTES = 8 << 20
# What a plan costs besides its input's text: its key, the Plan and the table's entry
# (215 bytes measured with tracemalloc, and a 32-character id).
PLAN_OVERHEAD = 300

K = TypeVar("K")
T = TypeVar("T")


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
        self._cache: Lru[str, Plan] = Lru(size, MAX_PLAN_BYTES)
        self._programs = ByText(self._parse)

    async def get(self, wf: str) -> Plan | None:
        plan = self._cache.get(wf)
        if plan is not None:
            return plan
        raw = await self._store.plan(wf)
        if raw is None:
            return None
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
        )
        self._cache.put(wf, plan, PLAN_OVERHEAD + len(text) * (2 if big else 1))
        return plan

    def forget(self, wf: str) -> None:
        self._cache.pop(wf)

    @property
    def parses(self) -> int:
        """Programs parsed so far (tests/test_plans.py)."""
        return self._programs.made

    @staticmethod
    def _parse(source: Any) -> _Parsed:
        program = parse_program(source, max_bytes=1 << 30)
        return _Parsed(program, _evaluates(program.steps), share_of(program))


class ByText(Generic[T]):
    """`make(source)` once per distinct JSON text of `source` (a value, or the text itself),
    the MAX_PROGRAMS used last kept: for what is made of a program, by the owner and the
    router alike. The text, not a normal form: key order inside `args` is the user's, and a
    handler sees it. `exact`: sources may be a caller's values, which `json` may write as the
    text of another (an int key as a string, a tuple as a list): a hit must also equal the
    value its text reads back as, else it is made anew (and `make` names the fault)."""

    def __init__(self, make: Callable[[Any], T], *, exact: bool = False) -> None:
        self._make = make
        self._exact = exact
        # By the text's digest: what its text reads back as (when exact), and what was made.
        self._programs: Lru[bytes, tuple[Any, T]] = Lru(MAX_PROGRAMS, MAX_PROGRAM_BYTES)
        self.made = 0

    def __len__(self) -> int:
        return len(self._programs)

    def get(self, source: Any) -> T:
        try:  # a tenth of a parse's cost (bench/README); a digest keeps the table small
            text = _text(source)
            key = hashlib.blake2b(text, digest_size=32).digest()
        except (RecursionError, TypeError, ValueError):  # not JSON: `make` names the fault
            return self._made(source)
        exact = self._exact and not isinstance(source, str | bytes)
        found = self._programs.get(key)
        if found is not None and (not exact or found[0] == source):
            return found[1]
        parsed = self._made(source)
        self._programs.put(key, (json.loads(text) if exact else None, parsed), len(text))
        return parsed

    def _made(self, source: Any) -> T:
        made = self._make(source)
        self.made += 1
        return made


class Lru(Generic[K, T]):
    """The values used last, at most `size` of them and `max_bytes` of their costs (the one
    put last is kept whatever its cost)."""

    def __init__(self, size: int, max_bytes: int) -> None:
        self._size = size
        self._max_bytes = max_bytes
        self._values: OrderedDict[K, tuple[T, int]] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._values)

    def get(self, key: K) -> T | None:
        found = self._values.get(key)
        if found is None:
            return None
        self._values.move_to_end(key)
        return found[0]

    def put(self, key: K, value: T, cost: int) -> None:
        self.pop(key)
        self._values[key] = (value, cost)
        self.bytes += cost
        while len(self._values) > 1 and (
            len(self._values) > self._size or self.bytes > self._max_bytes
        ):
            self.bytes -= self._values.popitem(last=False)[1][1]

    def pop(self, key: K) -> None:
        found = self._values.pop(key, None)
        if found is not None:
            self.bytes -= found[1]


def _text(source: Any) -> bytes:
    if isinstance(source, bytes):
        return source
    return (source if isinstance(source, str) else json.dumps(source)).encode()


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
