"""`until` conditions: CEL expressions over `input`, `prev`, `iteration` and `steps` (never Python
eval). `steps.<id>` is the output of the step carrying that `id` (see `step_references`).

Bounds, because a condition is written by whoever submits a program:

- **Size**, checked when a program is validated: at most `MAX_SOURCE_CHARS` characters,
  brackets nested at most `MAX_NESTING` deep and comprehension macros (`all`, `exists`,
  `exists_one`, `map`, `filter`) at most `MAX_COMPREHENSION_NESTING` deep. The `cel` module
  exposes no syntax tree, so `_scan` counts nesting in one pass over the source, skipping
  string literals and comments; `cel.compile` then parses it for real.
- **Time**, per evaluation: `BUDGET_S` (0.1 s) unless the caller passes `budget_s`. Cost still
  depends on the data (`prev.all(a, prev.all(b, prev.all(c, ...)))` over a 300-element list is
  n^3, about 10 s), so evaluation needs a hard stop. The `cel` extension holds the GIL while it
  evaluates (measured: while a thread evaluated for 1.2 s, the event loop ran twice), so a
  thread with a timeout would stall the loop anyway, and could not be stopped. Conditions are
  therefore evaluated in a small evaluator process (orchestrator/evaluator.py, loading only
  the native extension), one per process, started on first use: a call that
  exceeds its budget kills it (SIGKILL) and fails with "exceeded its time budget of 0.1 s"
  (the n^3 example: after 0.10-0.12 s), and a fresh evaluator is started at once. The budget
  counts from the moment the values are CEL values: decoding and converting them is linear in
  their size (~0.1 s per MB) and bounded by the size limits on inputs and outputs.
  Cost, measured on 2 cores: ~18 MB resident, ~50 ms to start (again after each kill), ~0.1 ms
  per evaluation of small values; evaluations in one process run one at a time. The
  evaluator also limits itself (kernel rlimits): CPU time per evaluation (budget + 2 s), so a
  runaway ends even if its parent died, and `MEMORY_BYTES` of address space.

`evaluate()` blocks its caller for at most the budget, plus converting the values (and, on
first use, starting the evaluator); `evaluate_async()` waits in a thread, so an event loop
keeps serving other work meanwhile.

Functions offered (each one tested in tests/test_conditions_functions.py): `size`; the
conversions `int`, `uint`, `double`, `string`, `bytes`, `type`, `dyn`, `duration`,
`timestamp`, called as functions; the string methods `contains`, `startsWith`, `endsWith`,
`matches`; and the timestamp/duration accessors `getFullYear`, `getMonth`, `getDate`,
`getDayOfMonth`, `getDayOfWeek`, `getDayOfYear`, `getHours`, `getMinutes`, `getSeconds`,
`getMilliseconds`, in UTC only. `bool()` is not implemented by the library and is refused.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from functools import lru_cache
from typing import TYPE_CHECKING, Any, NoReturn

from orchestrator.evaluator import EVALUATOR, EvaluatorError, load_cel

if TYPE_CHECKING:
    import cel
else:
    cel = load_cel()  # without the package's command line (prompt_toolkit): 70 ms a start

VARIABLES = frozenset({"input", "prev", "iteration", "steps"})
# A per-key limit's key (`limit.key`) reads only what its task message carries: the input, the
# task's args (with what args_from gave) and a map member's item.
KEY_VARIABLES = frozenset({"input", "args", "item"})
MAX_SOURCE_CHARS = 1000
MAX_NESTING = 32
MAX_COMPREHENSION_NESTING = 3
BUDGET_S = 0.1  # per evaluation, unless the caller passes budget_s
QUOTE_CHARS = 80  # an expression quoted in an error is cut to this many characters

# Type names read as identifiers (`type(prev) == list`).
_TYPES = frozenset({"bool", "bytes", "double", "int", "list", "map", "null_type", "string", "type"})
_ACCESSORS = frozenset(
    {
        "getFullYear", "getMonth", "getDate", "getDayOfMonth", "getDayOfWeek", "getDayOfYear",
        "getHours", "getMinutes", "getSeconds", "getMilliseconds",
    }
)  # fmt: skip
# The library implements these only as methods (`s.matches(re)`), and these only as functions.
_METHODS = frozenset({"contains", "startsWith", "endsWith", "matches"}) | _ACCESSORS
_CONVERSIONS = frozenset(
    {"int", "uint", "double", "string", "bytes", "type", "dyn", "duration", "timestamp"}
)
# CEL's standard functions that the library implements; operators show up as `_+_`, `!_`,
# `@in` and are always allowed.
_FUNCTIONS = frozenset({"size"}) | _METHODS | _CONVERSIONS
_COMPREHENSIONS = frozenset({"all", "exists", "exists_one", "map", "filter"})


class ConditionError(ValueError):
    """A condition that does not compile, names unknown variables, or does not give a bool."""


@lru_cache(maxsize=512)
def compile_condition(source: str, variables: frozenset[str] = VARIABLES) -> cel.Program:
    """Compile once; raise ConditionError naming what is wrong (`variables`: the names it may
    read)."""
    if len(source) > MAX_SOURCE_CHARS:
        raise ConditionError(f"{len(source)} characters, more than the limit of {MAX_SOURCE_CHARS}")
    bound = _scan(source)  # names bound by comprehensions (`x` in `prev.all(x, x > 1)`)
    step_references(source)  # `steps` only as `steps.<id>`
    try:
        program = cel.compile(source)
    except ValueError as exc:
        raise ConditionError(_one_line(str(exc), source)) from None
    unknown = sorted(set(program.variables()) - variables - _TYPES - bound)
    if unknown:
        raise ConditionError(
            f"unknown variable {_names(unknown)}; use {', '.join(sorted(variables))}"
        )
    functions = [name for name in program.functions() if name[0].isalpha() or name[0] == "_"]
    unknown = sorted(name for name in set(functions) - _FUNCTIONS if not _is_operator(name))
    if unknown:
        raise ConditionError(f"unknown function {_names(unknown)}")
    return program


def _names(names: list[str]) -> str:
    return _cut(", ".join(map(repr, names)), 200)


def _is_operator(name: str) -> bool:
    # CEL reports operators as `_+_`, `_[_]`, `_?_:_`, `!_`, `-_`, `@in`.
    return not name.replace("_", "").isidentifier()


def _context(
    source: str, input: Any, prev: Any, iteration: int, steps: Mapping[str, Any] | None
) -> dict[str, Any]:
    """The variables of one evaluation; `steps` holds only the outputs the source names."""
    known = steps or {}
    named = {name: known[name] for name in sorted(step_references(source)) if name in known}
    return {"input": input, "prev": prev, "iteration": iteration, "steps": named}


def evaluate(
    source: str,
    *,
    input: Any,
    prev: Any,
    iteration: int,
    budget_s: float | None = None,
    steps: Mapping[str, Any] | None = None,
) -> bool:
    """Evaluate a condition within `budget_s` (default `BUDGET_S`); only a real bool counts.
    `steps`: the recorded outputs of steps by id (only those the source names are sent).

    Blocks the calling thread for at most the budget; see `evaluate_async` for event loops.
    """
    context = _context(source, input, prev, iteration, steps)
    reply = _run(source, context, budget_s, {})
    if "value" in reply:
        return bool(reply["value"])
    if "gave" in reply:
        raise ConditionError(f"gave {reply['gave']} {_cut(reply['repr'])}, not a bool")
    return _raise_error(reply, source)


def _run(
    source: str,
    context: dict[str, Any],
    budget_s: float | None,
    extra: dict[str, Any],
    variables: frozenset[str] = VARIABLES,
) -> dict[str, Any]:
    """One evaluation in the evaluator process: its reply, or ConditionError."""
    compile_condition(source, variables)
    budget = BUDGET_S if budget_s is None else budget_s
    try:
        request = json.dumps({"source": source, "context": context, "budget_s": budget, **extra})
    except (TypeError, ValueError) as exc:
        raise ConditionError(f"input or prev is not JSON: {exc}") from None
    try:
        return EVALUATOR.run(request.encode() + b"\n", budget)
    except EvaluatorError as exc:
        raise ConditionError(str(exc)) from None


def _raise_error(reply: dict[str, Any], source: str) -> NoReturn:
    if reply["error"] == "KeyError":  # its message is the missing key's repr
        raise ConditionError(f"no such key {_cut(reply['message'])}")
    if reply["error"] == "NotJSON":
        raise ConditionError(reply["message"])
    raise ConditionError(_one_line(reply["message"], source))


def evaluate_list(
    source: str,
    *,
    input: Any,
    prev: Any,
    iteration: int,
    max_items: int,
    max_bytes: int,
    budget_s: float | None = None,
    steps: Mapping[str, Any] | None = None,
) -> list[Any]:
    """Evaluate a map step's expression: a JSON list of at most `max_items` items and
    `max_bytes` bytes, within the budget (as `evaluate`); ConditionError naming the fault."""
    context = _context(source, input, prev, iteration, steps)
    reply = _run(source, context, budget_s, {"max_items": max_items, "max_bytes": max_bytes})
    if "items" in reply:
        items: list[Any] = reply["items"]
        return items
    if "too_many" in reply:
        raise ConditionError(f"gave {reply['too_many']} items, more than max_items={max_items}")
    if "too_large" in reply:
        raise ConditionError(f"gave {reply['too_large']} bytes of items, over {max_bytes}")
    if "gave" in reply:
        raise ConditionError(f"gave {reply['gave']} {_cut(reply['repr'])}, not a list")
    return _raise_error(reply, source)


def evaluate_value(
    source: str,
    *,
    input: Any,
    prev: Any,
    iteration: int,
    max_bytes: int,
    budget_s: float | None = None,
    steps: Mapping[str, Any] | None = None,
) -> Any:
    """Evaluate an argument's expression (`args_from`): any JSON value of at most `max_bytes`
    bytes, within the budget (as `evaluate`); ConditionError naming the fault."""
    context = _context(source, input, prev, iteration, steps)
    reply = _run(source, context, budget_s, {"max_value_bytes": max_bytes})
    if "json" in reply:
        return json.loads(reply["json"])
    if "too_large" in reply:
        raise ConditionError(f"gave {reply['too_large']} bytes, over {max_bytes}")
    return _raise_error(reply, source)


def evaluate_key(
    source: str, *, input: Any, args: Any, item: Any, max_chars: int, budget_s: float | None = None
) -> str:
    """Evaluate a per-key limit's key (`limit.key`, over input, args and item): a non-empty
    string of at most `max_chars` characters, within the budget (as `evaluate`);
    ConditionError naming the fault."""
    context = {"input": input, "args": args, "item": item}
    # Bytes bound the reply before it is decoded: a string of max_chars is at most 6 bytes of
    # JSON a character (a control character's escape), plus its quotes.
    reply = _run(source, context, budget_s, {"max_value_bytes": 6 * max_chars + 2}, KEY_VARIABLES)
    if "too_large" in reply:
        raise ConditionError(f"gave a value of {reply['too_large']} bytes, not a key")
    if "json" not in reply:
        return _raise_error(reply, source)
    value = json.loads(reply["json"])
    if not isinstance(value, str):
        kind = "null" if value is None else type(value).__name__
        raise ConditionError(f"gave {kind} {_cut(reply['json'])}, not a string")
    if not value or len(value) > max_chars:
        raise ConditionError(f"gave a key of {len(value)} characters: from 1 to {max_chars}")
    return value


async def evaluate_async(
    source: str, *, input: Any, prev: Any, iteration: int, budget_s: float | None = None
) -> bool:
    """`evaluate` off the event loop: the loop keeps serving while the evaluator works.

    Raises ConditionError("exceeded its time budget of X s") when it takes longer than the
    budget; the runaway evaluation is killed, not left running.
    """
    import asyncio  # here, not at the top: the evaluator process imports this module too

    def call() -> bool:
        return evaluate(source, input=input, prev=prev, iteration=iteration, budget_s=budget_s)

    return await asyncio.get_running_loop().run_in_executor(EVALUATOR.executor(), call)


def quote(source: str) -> str:
    """A condition as an error message quotes it: repr, cut to `QUOTE_CHARS` characters."""
    return _clip(source)


def _clip(text: str, limit: int = QUOTE_CHARS) -> str:
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}… ({len(text)} characters)"


def _cut(text: str, limit: int = QUOTE_CHARS) -> str:
    return text if len(text) <= limit else f"{text[: limit - 1]}…"


def _one_line(message: str, source: str) -> str:
    # CEL's messages quote the whole expression, then point at the fault on later lines.
    if source:
        message = message.replace(f"'{source}'", _clip(source))
    lines = message.strip().splitlines()
    line = lines[0] if lines else "invalid expression"
    return _cut(line, 300)


_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NUMBER = re.compile(r"0[xX][0-9a-fA-F]+[uU]?|[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?[uU]?")
_STRING_PREFIXES = frozenset({"r", "R", "b", "B", "br", "bR", "Br", "BR", "rb", "rB", "Rb", "RB"})


def _scan(source: str) -> frozenset[str]:
    """Check nesting and the form of calls in one pass, outside strings and comments; return
    the names that comprehension macros bind."""
    open_brackets: list[bool] = []  # one per open bracket: does it open a comprehension?
    comprehensions = 0
    bound: set[str] = set()
    after_dot = False  # the last token was `.`: a name here is a field or a method
    comprehension_next = False  # the next `(` opens a comprehension macro
    at, end = 0, len(source)
    while at < end:
        char = source[at]
        if char in " \t\r\n\f":
            at += 1
            continue
        if source.startswith("//", at):
            newline = source.find("\n", at)
            at = end if newline < 0 else newline + 1
            continue
        if char in "'\"":
            at, after_dot = _skip_string(source, at, raw=False), False
            continue
        if char.isdigit():
            number = _NUMBER.match(source, at)
            at, after_dot = (number.end() if number else at + 1), False
            continue
        if name := _IDENTIFIER.match(source, at):
            at = name.end()
            if name.group() in _STRING_PREFIXES and at < end and source[at] in "'\"":
                at = _skip_string(source, at, raw="r" in name.group().lower())
            else:
                comprehension_next = _check_call(source, name.group(), at, after_dot, bound)
            after_dot = False
            continue
        if char in "([{":
            opens = comprehension_next and char == "("
            open_brackets.append(opens)
            comprehensions += opens
            if len(open_brackets) > MAX_NESTING:
                raise ConditionError(f"brackets nested deeper than {MAX_NESTING} levels")
            if comprehensions > MAX_COMPREHENSION_NESTING:
                raise ConditionError(
                    "comprehensions (all, exists, exists_one, map, filter) nested deeper than "
                    f"{MAX_COMPREHENSION_NESTING} levels"
                )
        elif char in ")]}" and open_brackets:
            comprehensions -= open_brackets.pop()
        comprehension_next = False
        after_dot = char == "."
        at += 1
    return frozenset(bound)


STEP_ID = r"^[a-z][a-z0-9_]{0,39}$"
_STEP_ID = re.compile(STEP_ID)


@lru_cache(maxsize=512)
def step_references(source: str) -> frozenset[str]:
    """The step ids an expression names as `steps.<id>` (outside strings and comments);
    ConditionError for any other use of `steps` (`steps["x"]`, `steps` alone, a bound name),
    so that every reference can be checked when the program is submitted."""
    names: set[str] = set()
    after_dot = False
    at, end = 0, len(source)
    while at < end:
        char = source[at]
        if char in " \t\r\n\f":
            at += 1
        elif source.startswith("//", at):
            newline = source.find("\n", at)
            at = end if newline < 0 else newline + 1
        elif char in "'\"":
            at, after_dot = _skip_string(source, at, raw=False), False
        elif char.isdigit():
            number = _NUMBER.match(source, at)
            at, after_dot = (number.end() if number else at + 1), False
        elif name := _IDENTIFIER.match(source, at):
            at = name.end()
            if name.group() in _STRING_PREFIXES and at < end and source[at] in "'\"":
                at = _skip_string(source, at, raw="r" in name.group().lower())
            elif name.group() == "steps" and not after_dot:
                dot = _skip_space(source, at)
                field = _IDENTIFIER.match(source, _skip_space(source, dot + 1))
                if dot >= end or source[dot] != "." or field is None:
                    raise ConditionError("write steps.<id> to use the output of a step")
                if not _STEP_ID.match(field.group()):
                    raise ConditionError(f"steps.{_cut(field.group())}: not a step id")
                names.add(field.group())
                at = field.end()
            after_dot = False
        else:
            after_dot = char == "."
            at += 1
    return frozenset(names)


def _check_call(source: str, name: str, at: int, method: bool, bound: set[str]) -> bool:
    """Refuse the call forms the library lacks; say whether `(` opens a comprehension."""
    paren = _skip_space(source, at)
    if paren >= len(source) or source[paren] != "(":
        return False  # not a call
    if name in _METHODS and not method:
        raise ConditionError(f"{name}() is a method: write x.{name}(...)")
    if name in _CONVERSIONS and method:
        raise ConditionError(f"{name}() is a function: write {name}(x)")
    if name in _ACCESSORS:
        closing = _skip_space(source, paren + 1)
        if closing < len(source) and source[closing] != ")":
            raise ConditionError(f"{name}() takes no time zone: only UTC is supported")
    if method and name in _COMPREHENSIONS:
        variable = _IDENTIFIER.match(source, _skip_space(source, paren + 1))
        if variable:
            bound.add(variable.group())
        return True
    return False


def _skip_space(source: str, at: int) -> int:
    """Past whitespace and comments: `prev.all // c` + newline + `(x, x)` is still a call."""
    while at < len(source):
        if source.startswith("//", at):
            newline = source.find("\n", at)
            at = len(source) if newline < 0 else newline + 1
        elif source[at] in " \t\r\n\f":
            at += 1
        else:
            break
    return at


def _skip_string(source: str, at: int, *, raw: bool) -> int:
    """The index just past the string literal that starts at `at` (or the end of the source)."""
    quote_char = source[at]
    delimiter = quote_char * 3 if source.startswith(quote_char * 3, at) else quote_char
    at += len(delimiter)
    while at < len(source):
        if source.startswith(delimiter, at):
            return at + len(delimiter)
        if len(delimiter) == 1 and source[at] in "\r\n":
            return at  # unterminated: cel.compile says so
        at += 2 if source[at] == "\\" and not raw else 1
    return len(source)
