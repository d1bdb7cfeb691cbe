"""The pure state machine: given a program and the step that just finished, what comes next.

A program always has exactly one active *leaf* (a task, a bag, a map, a sleep or a signal); its step
path is the program's cursor, e.g. `2` or `3/iter:4/1` inside an untiloop body. Nothing here
does I/O, so the same functions drive the orchestrator and the property tests' model. (An
`until` or a map's list is evaluated in a small evaluator process with a time budget: see
orchestrator/conditions.py.)
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from orchestrator.conditions import (
    ConditionError,
    evaluate,
    evaluate_list,
    evaluate_value,
    quote,
)
from orchestrator.limits import keys_of
from orchestrator.messages import MAX_ITEM_BYTES
from orchestrator.program import (
    Bag,
    Branch,
    Choice,
    Map,
    Member,
    Program,
    Signal,
    Sleep,
    Task,
    Untiloop,
)

Step = Task | Bag | Map | Sleep | Signal | Untiloop | Choice
LeafStep = Task | Bag | Map | Sleep | Signal
# A map's items travel inside its task messages: each item (MAX_ITEM_BYTES), and all of them,
# stay this small.
MAX_ITEMS_BYTES = 8 * 1024 * 1024
# The output of a step that others read (`steps.<id>`) is recorded apart, up to this size;
# an argument computed by `args_from` is held to MAX_ITEM_BYTES, as a map's item.
MAX_REF_BYTES = 1024 * 1024
# What a leaf's `args_from` gave, over all the task messages that carry it (a map's members
# each carry its arguments), so that no message grows past the broker's bound.
MAX_ARGS_BYTES = 4 * 1024 * 1024


class PathError(ValueError):
    """A step path that does not name a leaf of the program."""


@dataclass(frozen=True, slots=True)
class Leaf:
    """Run this step next, with `prev` as its input from the step before; a map's `items`
    (one task each; none: the step is done at once, with output []); `args`: the arguments
    its `args_from` gave (per bag member; one for a task or all of a map's members); `refs`:
    the outputs (JSON) of the steps with a referenced id that finished on the way here, to
    record with the advance that moves past them."""

    path: str
    step: LeafStep
    prev: Any
    iteration: int
    items: tuple[Any, ...] | None = None
    args: tuple[dict[str, Any], ...] = ()
    refs: tuple[tuple[str, str], ...] = ()
    # A bag's branches: the first leaf of each, opened with the bag (by member index).
    branches: tuple[tuple[int, Leaf], ...] = ()

    def opened(self) -> list[tuple[str, str, str]]:
        """Every branch cursor the advance to this leaf opens, nested ones too: (the
        branch's scope `2/branch:1`, its first leaf's path, that leaf's shape)."""
        found: list[tuple[str, str, str]] = []
        for i, first in self.branches:
            found.append((f"{self.path}/branch:{i}", first.path, first.shape))
            found.extend(first.opened())
        return found

    @property
    def shape(self) -> str:
        """What advance.lua records as the leaf (complete and fail hold reports to it)."""
        if isinstance(self.step, Sleep | Signal):
            return type(self.step).__name__.lower()
        return "task" if self.size is None else f"bag:{self.size}"

    # The key of each member's per-key limit (None: it has none; (): no member has one).
    limits: tuple[str | None, ...] = ()

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


@dataclass(frozen=True, slots=True)
class Joined:
    """A branch of a bag ran its last step: `output` is its member's output in the bag at
    `scope`'s parent (`2/branch:1` is member 1 of the bag at step 2); `refs` as a Leaf's."""

    scope: str
    output: Any
    refs: tuple[tuple[str, str], ...] = ()


Outcome = Leaf | Done | Failed | Joined


@dataclass(slots=True)
class _Walk:
    """What one move through the program carries: the input, the outputs of steps by id
    (recorded ones, then those that finish on the way), and which ids are read at all."""

    input: Any
    refs: dict[str, Any]
    referenced: frozenset[str]
    finished: dict[str, str] = field(default_factory=dict)  # id -> output JSON, to record

    def finish(self, step: Step, path: str, output: Any) -> Failed | None:
        """Note the output of a step that finished, if other steps read it."""
        if step.id is None or step.id not in self.referenced:
            return None
        text = json.dumps(output, ensure_ascii=False)
        size = len(text.encode())
        if size > MAX_REF_BYTES:
            return Failed(
                f"step {path} (id {step.id!r}): its output of {size} bytes is over "
                f"{MAX_REF_BYTES}, the limit for a step that other steps read"
            )
        self.refs[step.id] = output
        self.finished[step.id] = text
        return None


def _walk(program: Program, input: Any, steps: Mapping[str, Any] | None) -> _Walk:
    return _Walk(input, dict(steps or {}), program.referenced)


def first(program: Program, input: Any = None) -> Outcome:
    """The first leaf of a program (a map's items are computed from `input`)."""
    walk = _walk(program, input, None)
    return _descend(program.steps, 0, prefix="", prev=None, iteration=0, walk=walk)


def after(
    program: Program,
    path: str,
    output: Any,
    input: Any,
    steps: Mapping[str, Any] | None = None,
) -> Outcome:
    """What follows once the leaf at `path` finished with `output`; `steps`: the recorded
    outputs of the steps the program reads by id (`steps.<id>`)."""
    walk = _walk(program, input, steps)
    outcome = _after(program.steps, _split(path), output, walk, prefix="", iteration=0)
    if isinstance(outcome, Leaf | Joined) and walk.finished:
        return replace(outcome, refs=tuple(sorted(walk.finished.items())))
    return outcome


def arguments(
    step: LeafStep,
    path: str,
    prev: Any,
    iteration: int,
    input: Any,
    steps: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Any], ...] | Failed:
    """The arguments a leaf's `args_from` give (see `Leaf.args`), or why the step fails."""
    if isinstance(step, Sleep | Signal):
        return ()
    members: list[Member | Branch] = list(step.bag) if isinstance(step, Bag) else [step]
    if not any(isinstance(m, Member) and m.args_from for m in members):
        return ()
    found: list[dict[str, Any]] = []
    for i, member in enumerate(members):
        values: dict[str, Any] = {}
        if isinstance(member, Branch):  # a branch computes its own steps' arguments
            found.append(values)
            continue
        for name, source in member.args_from.items():
            try:
                values[name] = evaluate_value(
                    source,
                    input=input,
                    prev=prev,
                    iteration=iteration,
                    max_bytes=MAX_ITEM_BYTES,
                    steps=steps,
                )
            except ConditionError as exc:
                where = f"{path}/bag:{i}" if isinstance(step, Bag) else path
                return Failed(f"step {where}: args_from {name!r} {quote(source)}: {exc}")
        found.append(values)
    return tuple(found)


def _args_too_large(path: str, args: tuple[dict[str, Any], ...], copies: int = 1) -> Failed | None:
    total = copies * sum(len(json.dumps(a, ensure_ascii=False).encode()) for a in args)
    if total <= MAX_ARGS_BYTES:
        return None
    return Failed(
        f"step {path}: the arguments its args_from gave come to {total} bytes over its "
        f"task messages, over {MAX_ARGS_BYTES} (pass a key and read the data in the task)"
    )


def resume(
    program: Program,
    path: str,
    prev: Any,
    input: Any,
    recorded: Mapping[str, Any] | None = None,
) -> Outcome:
    """Where a redriven program starts again: the step at `path` (a leaf, a wait `3/iter:4`,
    or a top-level step of any kind, "" for the first), run with `prev` as if the step
    before had just finished with it; `recorded`: the outputs of steps read by id."""
    if not path:
        return first(program, input)
    walk = _walk(program, input, recorded)
    steps: list[Step] = program.steps
    parts, prefix, iteration = _split(path), "", 0
    while True:
        index, parts = _index(parts, len(steps), path)
        step = steps[index]
        here = f"{prefix}{index}"
        if not parts:
            return _descend(steps, index, prefix=prefix, prev=prev, iteration=iteration, walk=walk)
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
        if isinstance(step, Bag):
            steps, parts = _branch(step, parts, path), parts[1:]
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
        if isinstance(step, Choice | Bag):  # a loop in a case or a branch drops them too
            if isinstance(step, Choice):
                steps = _case(step, parts, path)
            else:
                steps = _branch(step, parts, path)
            prefix = f"{prefix}{index}/{parts[0]}/"
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
    steps: list[Step], parts: list[str], output: Any, walk: _Walk, *, prefix: str, iteration: int
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
                walk=walk,
            )
        inner = _after(
            step.steps,
            rest[1:],
            output,
            walk,
            prefix=f"{here}/iter:{loop_iteration}/",
            iteration=loop_iteration,
        )
        if not isinstance(inner, Done):
            return inner
        output = inner.result
        try:
            met = evaluate(
                step.until,
                input=walk.input,
                prev=output,
                iteration=loop_iteration,
                steps=walk.refs,
            )
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
                walk=walk,
            )
    elif isinstance(step, Choice):
        inner = _after(
            _case(step, rest, here),
            rest[1:],
            output,
            walk,
            prefix=f"{here}/{rest[0]}/",
            iteration=iteration,
        )
        if not isinstance(inner, Done):
            return inner
        output = inner.result  # the case's output is the choice's
    elif isinstance(step, Bag) and rest:
        inner = _after(
            _branch(step, rest, here),
            rest[1:],
            output,
            walk,
            prefix=f"{here}/{rest[0]}/",
            iteration=iteration,
        )
        if not isinstance(inner, Done):
            return inner
        # The branch is over: its output joins the bag's barrier; the bag goes on from there.
        return Joined(f"{here}/{rest[0]}", inner.result)
    elif rest:
        raise PathError(f"{here}: a {type(step).__name__.lower()} has no inner steps")
    # The step at `here` is over (a leaf, a loop whose until held, a choice's case).
    too_large = walk.finish(step, here, output)
    if too_large is not None:
        return too_large
    if index + 1 < len(steps):
        return _descend(
            steps, index + 1, prefix=prefix, prev=output, iteration=iteration, walk=walk
        )
    return Done(output)


def _descend(
    steps: list[Step], index: int, *, prefix: str, prev: Any, iteration: int, walk: _Walk
) -> Outcome:
    step = steps[index]
    path = f"{prefix}{index}"
    if isinstance(step, Untiloop):
        return _descend(step.steps, 0, prefix=f"{path}/iter:0/", prev=prev, iteration=0, walk=walk)
    if isinstance(step, Choice):
        return _chosen(step, path, prev, iteration, walk)
    args = arguments(step, path, prev, iteration, walk.input, walk.refs)
    if isinstance(args, Failed):
        return args
    if isinstance(step, Map):
        return _mapped(step, path, prev, iteration, walk, args)
    too_large = _args_too_large(path, args)
    if too_large is not None:
        return too_large
    limits = keys_of(step, path, walk.input, args, None)
    if isinstance(limits, str):
        return Failed(limits)
    opened: list[tuple[int, Leaf]] = []
    if isinstance(step, Bag):
        for i, branch in step.branches():  # each starts with the bag's prev
            first = _descend(
                branch.steps, 0, prefix=f"{path}/branch:{i}/", prev=prev, iteration=iteration,
                walk=walk,
            )  # fmt: skip
            if not isinstance(first, Leaf):
                return first
            opened.append((i, first))
    return Leaf(
        path=path,
        step=step,
        prev=prev,
        iteration=iteration,
        args=args,
        limits=limits,
        branches=tuple(opened),
    )


def _chosen(step: Choice, path: str, prev: Any, iteration: int, walk: _Walk) -> Outcome:
    """Run the first case whose `when` holds (in order), else `otherwise`."""
    for k, case in enumerate(step.choice):
        try:
            holds = evaluate(
                case.when, input=walk.input, prev=prev, iteration=iteration, steps=walk.refs
            )
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
        branch, 0, prefix=f"{path}/case:{k}/", prev=prev, iteration=iteration, walk=walk
    )


def _case(step: Choice, parts: list[str], path: str) -> list[Step]:
    """The steps of the case a path names at `parts[0]` (`case:K`); PathError if none."""
    head = parts[0] if parts else ""
    number = head.removeprefix("case:")
    branch = step.branch(int(number)) if head.startswith("case:") and number.isdigit() else None
    if branch is None or len(parts) < 2:
        raise PathError(f"{path!r}: no such step")
    return branch


def _branch(step: Bag, parts: list[str], path: str) -> list[Step]:
    """The steps of the branch a path names at `parts[0]` (`branch:K`); PathError if none."""
    head = parts[0] if parts else ""
    number = head.removeprefix("branch:")
    member = (
        step.bag[int(number)]
        if head.startswith("branch:") and number.isdigit() and int(number) < len(step.bag)
        else None
    )
    if not isinstance(member, Branch) or len(parts) < 2:
        raise PathError(f"{path!r}: no such step")
    return member.steps


def _mapped(
    step: Map,
    path: str,
    prev: Any,
    iteration: int,
    walk: _Walk,
    args: tuple[dict[str, Any], ...],
) -> Outcome:
    try:
        items = evaluate_list(
            step.map,
            input=walk.input,
            prev=prev,
            iteration=iteration,
            max_items=step.max_items,
            max_bytes=MAX_ITEMS_BYTES,
            steps=walk.refs,
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
    too_large = _args_too_large(path, args, len(items))
    if too_large is not None:
        return too_large
    limits = keys_of(step, path, walk.input, args, items)
    if isinstance(limits, str):
        return Failed(limits)
    found = tuple(items)
    return Leaf(path, step, prev, iteration, items=found, args=args, limits=limits)


def _split(path: str) -> list[str]:
    return path.split("/") if path else []


def _index(parts: list[str], count: int, path: str) -> tuple[int, list[str]]:
    if not parts or not parts[0].isdigit() or int(parts[0]) >= count:
        raise PathError(f"{path!r}: no such step")
    return int(parts[0]), parts[1:]
