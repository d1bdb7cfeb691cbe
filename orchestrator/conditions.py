"""`until` conditions: CEL expressions over `input`, `prev` and `iteration` (never Python eval)."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import cel

VARIABLES = frozenset({"input", "prev", "iteration"})
# Type names read as identifiers (`type(prev) == list`).
_TYPES = frozenset({"bool", "bytes", "double", "int", "list", "map", "null_type", "string", "type"})
# CEL's standard functions; operators show up as `_+_`, `!_`, `@in` and are always allowed.
_FUNCTIONS = frozenset(
    {
        "size", "contains", "startsWith", "endsWith", "matches", "int", "uint", "double",
        "string", "bytes", "bool", "type", "dyn", "duration", "timestamp",
        "getFullYear", "getMonth", "getDate", "getDayOfMonth", "getDayOfWeek", "getDayOfYear",
        "getHours", "getMinutes", "getSeconds", "getMilliseconds",
    }
)  # fmt: skip


class ConditionError(ValueError):
    """A condition that does not compile, names unknown variables, or does not give a bool."""


@lru_cache(maxsize=512)
def compile_condition(source: str) -> cel.Program:
    """Compile once; raise ConditionError naming what is wrong."""
    try:
        program = cel.compile(source)
    except ValueError as exc:
        raise ConditionError(_first_line(str(exc))) from None
    unknown = sorted(set(program.variables()) - VARIABLES - _TYPES - _bound_names(program))
    if unknown:
        raise ConditionError(
            f"unknown variable {', '.join(map(repr, unknown))}; use {', '.join(sorted(VARIABLES))}"
        )
    functions = [name for name in program.functions() if name[0].isalpha() or name[0] == "_"]
    unknown = sorted(name for name in set(functions) - _FUNCTIONS if not _is_operator(name))
    if unknown:
        raise ConditionError(f"unknown function {', '.join(map(repr, unknown))}")
    return program


def _is_operator(name: str) -> bool:
    # CEL reports operators as `_+_`, `_[_]`, `_?_:_`, `!_`, `-_`, `@in`.
    return not name.replace("_", "").isidentifier()


def evaluate(source: str, *, input: Any, prev: Any, iteration: int) -> bool:
    """Evaluate a condition; only a real bool counts as an answer."""
    program = compile_condition(source)
    try:
        value = program.execute({"input": input, "prev": prev, "iteration": iteration})
    except Exception as exc:  # the CEL runtime raises TypeError/RuntimeError/ValueError
        raise ConditionError(_first_line(str(exc))) from None
    if not isinstance(value, bool):
        raise ConditionError(f"gave {type(value).__name__} {value!r}, not a bool")
    return value


def _bound_names(program: cel.Program) -> set[str]:
    # Comprehension macros (`prev.all(x, x > 1)`) bind names that are not context variables.
    source = program.source
    bound: set[str] = set()
    for macro in ("all(", "exists(", "exists_one(", "map(", "filter("):
        start = 0
        while (at := source.find(macro, start)) >= 0:
            start = at + len(macro)
            name = source[start:].split(",", 1)[0].strip()
            if name.isidentifier():
                bound.add(name)
    return bound


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "invalid expression"
