"""The pure state machine: given a program and the step that just finished, what comes next.

A program always has exactly one active *leaf* (a task, a bag, a map or a sleep); its step
path is the program's cursor, e.g. `2` or `3/iter:4/1` inside an untiloop body. Nothing here
does I/O, so the same functions drive the orchestrator and the property tests' model. (An
`until` or a map's list is evaluated in a small evaluator process with a time budget: see
orchestrator/conditions.py.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from orchestrator.conditions import ConditionError, evaluate, evaluate_list, quote
from orchestrator.program import Bag, Choice, Map, Program, Sleep, Task, Untiloop

Step = Task | Bag | Map | Sleep | Untiloop | Choice
LeafStep = Task | Bag | Map | Sleep
# A map's items travel inside its task messages: each item, and all of them, stay this small.
MAX_ITEM_BYTES = 65536
MAX_ITEMS_BYTES = 8 * 1024 * 1024


class PathError(ValueError):
    """A step path that does not name a leaf of the program."""


@dataclass(frozen=True, slots=True)
class Leaf:
    """Run this step next, with `prev` as its input from the step before; a map's `items`
    (one task each; none: the step is done at once, with output [])."""

    path: str
    step: LeafStep
    prev: Any
    iteration: int
    items: tuple[Any, ...] | None = None

    @property
    def size(self) -> int | None:
        """Members behind the join barrier; None for a single task or a sleep."""
        if isinstance(self.step, Bag):
            return len(self.step.bag)
        return None if self.items is None else len(self.items)


@dataclass(frozen=True, slots=True)
class Done:
    """The program completed; its result is the last step's output."""

    result: Any


@dataclass(frozen=True, slots=True)
class Failed:
    """The program cannot go on (an untiloop ran out of iterations, a condition broke)."""

    error: str


Outcome = Leaf | Done | Failed


def first(program: Program, input: Any = None) -> Outcome:
    """The first leaf of a program (a map's items are computed from `input`)."""
    return _descend(program.steps, 0, prefix="", prev=None, iteration=0, input=input)


def after(program: Program, path: str, output: Any, input: Any) -> Outcome:
    """What follows once the leaf at `path` finished with `output`."""
    return _after(program.steps, _split(path), output, input, prefix="", iteration=0)


def resume(program: Program, path: str, prev: Any, input: Any) -> Outcome:
    """Where a redriven program starts again: the step at `path` (a leaf, a wait `3/iter:4`,
    or a top-level step of any kind, "" for the first), run with `prev` as if the step
    before had just finished with it."""
    if not path:
        return first(program, input)
    steps: list[Step] = program.steps
    parts, prefix, iteration = _split(path), "", 0
    while True:
        index, parts = _index(parts, len(steps), path)
        step = steps[index]
        here = f"{prefix}{index}"
        if not parts:
            return _descend(
                steps, index, prefix=prefix, prev=prev, iteration=iteration, input=input
            )
        if isinstance(step, Choice):
            steps, prefix = _case(step, parts, path), f"{here}/{parts[0]}/"
            parts = parts[1:]
            continue
        if not isinstance(step, Untiloop) or not parts[0].startswith("iter:"):
            raise PathError(f"{path}: no such step")
        number = parts[0].removeprefix("iter:")
        if not number.isdigit():
            raise PathError(f"{path}: no such step")
        iteration = int(number)
        if len(parts) == 1:  # `3/iter:4`: the wait before that iteration
            if step.interval_s is None:
                raise PathError(f"{path}: its loop has no interval_s")
            return Leaf(path, Sleep(sleep_s=step.interval_s), prev, iteration)
        steps, prefix, parts = step.steps, f"{here}/{parts[0]}/", parts[1:]


def leaf_at(program: Program, path: str) -> LeafStep:
    """The task or bag a cursor points at; PathError when the path is not a leaf of the program."""
    steps: list[Step] = program.steps
    parts = _split(path)
    while True:
        index, parts = _index(parts, len(steps), path)
        step = steps[index]
        if not parts:
            if isinstance(step, Untiloop | Choice):
                raise PathError(f"{path}: a {type(step).__name__.lower()}, not a leaf")
            return step
        if isinstance(step, Choice):
            steps, parts = _case(step, parts, path), parts[1:]
            continue
        if not isinstance(step, Untiloop) or not parts[0].startswith("iter:"):
            raise PathError(f"{path}: no such step")
        if len(parts) == 1:  # `3/iter:4`: the wait before that iteration
            if step.interval_s is None:
                raise PathError(f"{path}: its loop has no interval_s")
            return Sleep(sleep_s=step.interval_s)
        steps, parts = step.steps, parts[1:]


def dropped(program: Program, finished: str, path: str) -> str:
    """The loop iteration whose keys may go once the leaf at `path` follows `finished`, as a
    path prefix (`3/iter:4/`), or "": a loop that starts iteration k keeps its last
    `keep_iterations` finished ones (k - keep .. k - 1), so k - keep - 1 goes."""
    steps: list[Step] = program.steps
    parts, prefix = _split(path), ""
    while len(parts) >= 2:
        index, parts = _index(parts, len(steps), path)
        step = steps[index]
        if isinstance(step, Choice):  # a loop inside a case drops its iterations too
            steps, prefix = _case(step, parts, path), f"{prefix}{index}/{parts[0]}/"
            parts = parts[1:]
            continue
        if not isinstance(step, Untiloop) or not parts[0].startswith("iter:"):
            return ""
        here = f"{prefix}{index}/{parts[0]}/"
        if not finished.startswith(here):  # this loop just started a new iteration
            gone = int(parts[0].removeprefix("iter:")) - step.keep_iterations - 1
            return f"{prefix}{index}/iter:{gone}/" if gone >= 0 else ""
        steps, parts, prefix = step.steps, parts[1:], here
    return ""


def _after(
    steps: list[Step], parts: list[str], output: Any, input: Any, *, prefix: str, iteration: int
) -> Outcome:
    index, rest = _index(parts, len(steps), "/".join(parts))
    step = steps[index]
    here = f"{prefix}{index}"
    if isinstance(step, Untiloop):
        if not rest or not rest[0].startswith("iter:"):
            raise PathError(f"{here}: an untiloop path needs iter:N")
        loop_iteration = int(rest[0].removeprefix("iter:"))
        if len(rest) == 1:  # the wait before this iteration is over: run it
            if step.interval_s is None:
                raise PathError(f"{here}/{rest[0]}: its loop has no interval_s")
            return _descend(
                step.steps,
                0,
                prefix=f"{here}/{rest[0]}/",
                prev=output,
                iteration=loop_iteration,
                input=input,
            )
        inner = _after(
            step.steps,
            rest[1:],
            output,
            input,
            prefix=f"{here}/iter:{loop_iteration}/",
            iteration=loop_iteration,
        )
        if not isinstance(inner, Done):
            return inner
        output = inner.result
        try:
            met = evaluate(step.until, input=input, prev=output, iteration=loop_iteration)
        except ConditionError as exc:
            return Failed(f"step {here}: until {quote(step.until)}: {exc}")
        if not met:
            if loop_iteration + 1 >= step.max_iterations:
                return Failed(
                    f"step {here}: until {quote(step.until)} not met after "
                    f"max_iterations={step.max_iterations}"
                )
            if step.interval_s is not None:  # wait first, in a sleep leaf of its own
                return Leaf(
                    path=f"{here}/iter:{loop_iteration + 1}",
                    step=Sleep(sleep_s=step.interval_s),
                    prev=output,
                    iteration=loop_iteration + 1,
                )
            return _descend(
                step.steps,
                0,
                prefix=f"{here}/iter:{loop_iteration + 1}/",
                prev=output,
                iteration=loop_iteration + 1,
                input=input,
            )
    elif isinstance(step, Choice):
        inner = _after(
            _case(step, rest, here),
            rest[1:],
            output,
            input,
            prefix=f"{here}/{rest[0]}/",
            iteration=iteration,
        )
        if not isinstance(inner, Done):
            return inner
        output = inner.result  # the case's output is the choice's
    elif rest:
        raise PathError(f"{here}: a {type(step).__name__.lower()} has no inner steps")
    if index + 1 < len(steps):
        return _descend(
            steps, index + 1, prefix=prefix, prev=output, iteration=iteration, input=input
        )
    return Done(output)


def _descend(
    steps: list[Step], index: int, *, prefix: str, prev: Any, iteration: int, input: Any
) -> Outcome:
    step = steps[index]
    path = f"{prefix}{index}"
    if isinstance(step, Untiloop):
        return _descend(
            step.steps, 0, prefix=f"{path}/iter:0/", prev=prev, iteration=0, input=input
        )
    if isinstance(step, Map):
        return _mapped(step, path, prev, iteration, input)
    if isinstance(step, Choice):
        return _chosen(step, path, prev, iteration, input)
    return Leaf(path=path, step=step, prev=prev, iteration=iteration)


def _chosen(step: Choice, path: str, prev: Any, iteration: int, input: Any) -> Outcome:
    """Run the first case whose `when` holds (in order), else `otherwise`."""
    for k, case in enumerate(step.choice):
        try:
            holds = evaluate(case.when, input=input, prev=prev, iteration=iteration)
        except ConditionError as exc:
            return Failed(f"step {path}: choice {k} when {quote(case.when)}: {exc}")
        if holds:
            break
    else:
        if step.otherwise is None:
            return Failed(f"step {path}: no case of the choice held, and it has no otherwise")
        k = len(step.choice)
    branch = step.branch(k)
    assert branch is not None
    return _descend(
        branch, 0, prefix=f"{path}/case:{k}/", prev=prev, iteration=iteration, input=input
    )


def _case(step: Choice, parts: list[str], path: str) -> list[Step]:
    """The steps of the case a path names at `parts[0]` (`case:K`); PathError if none."""
    head = parts[0] if parts else ""
    number = head.removeprefix("case:")
    branch = step.branch(int(number)) if head.startswith("case:") and number.isdigit() else None
    if branch is None or len(parts) < 2:
        raise PathError(f"{path!r}: no such step")
    return branch


def _mapped(step: Map, path: str, prev: Any, iteration: int, input: Any) -> Outcome:
    try:
        items = evaluate_list(
            step.map,
            input=input,
            prev=prev,
            iteration=iteration,
            max_items=step.max_items,
            max_bytes=MAX_ITEMS_BYTES,
        )
    except ConditionError as exc:
        return Failed(f"step {path}: map {quote(step.map)}: {exc}")
    for n, item in enumerate(items):
        size = len(json.dumps(item, ensure_ascii=False).encode())
        if size > MAX_ITEM_BYTES:
            return Failed(
                f"step {path}: map {quote(step.map)}: item {n} is {size} bytes, over "
                f"{MAX_ITEM_BYTES} (pass a key and read the data in the task)"
            )
    return Leaf(path=path, step=step, prev=prev, iteration=iteration, items=tuple(items))


def _split(path: str) -> list[str]:
    return path.split("/") if path else []


def _index(parts: list[str], count: int, path: str) -> tuple[int, list[str]]:
    if not parts or not parts[0].isdigit() or int(parts[0]) >= count:
        raise PathError(f"{path!r}: no such step")
    return int(parts[0]), parts[1:]
