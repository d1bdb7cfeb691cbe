"""Saga compensation: which compensations a failed or cancelled program runs, in which order.

A top-level task, or a task member of a top-level bag, may name a compensating task
(`compensate`). When the program fails or is cancelled, it becomes `compensating` and its
owner undoes the steps that completed, last first: one *group* per top-level step, a bag's
members side by side behind a join barrier like a bag's. "Completed" means its output is
recorded (`out:<step>`, `out:<step>/bag:<i>`): once the status left running no completion is
recorded any more (complete.lua), so the plan is a pure function of the program and of what
Redis holds, and every replay computes the same one. A group's leaf is `saga:<step>`, in the
scope `saga` (the cursor `cur:saga`, see lua/advance.lua).

Nothing here does I/O; the router (`explain`) and the engine both read it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from orchestrator.paths import SAGA, saga_step
from orchestrator.program import Compensate, Program

PREFIX = f"{SAGA}:"
# The statuses a program with compensations ends in once they ran (or one failed).
COMPENSATED, COMPENSATION_FAILED = "compensated", "compensation_failed"


@dataclass(frozen=True, slots=True)
class Undo:
    """One compensation to run: the member (None: a task step) it undoes, its task, and
    the output (JSON) of what it undoes, which it receives as `ctx.item`."""

    index: int | None
    compensate: Compensate
    output: str


@dataclass(frozen=True, slots=True)
class Group:
    """The compensations of one top-level step, run side by side at `path` (`saga:<step>`)."""

    step: int
    undo: tuple[Undo, ...]

    @property
    def path(self) -> str:
        return f"{PREFIX}{self.step}"


def leaves(program: Program) -> list[tuple[str, int | None]]:
    """Every leaf (step path, member index) whose recorded output decides the plan."""
    return [(str(n), i) for n, members in program.compensations for i, _ in members]


def plan(program: Program, outputs: Sequence[str | None]) -> list[Group]:
    """The groups to run, last step first: `outputs` are the recorded outputs of `leaves`,
    in that order (None: it never completed, nothing to undo)."""
    found = dict(zip(leaves(program), outputs, strict=True))
    groups: list[Group] = []
    for n, members in reversed(program.compensations):
        undo = []
        for i, compensate in members:
            output = found[(str(n), i)]
            if output is not None:
                undo.append(Undo(i, compensate, output))
        if undo:
            groups.append(Group(n, tuple(undo)))
    return groups


def group_at(groups: Sequence[Group], path: str) -> Group | None:
    """The group whose leaf is `path`; None when the plan has none there."""
    step = saga_step(path)
    return next((group for group in groups if group.step == step), None)


def following(groups: Sequence[Group], path: str) -> Group | None:
    """The group after the one at `path` ("": the first); None when it was the last."""
    if not path:
        return groups[0] if groups else None
    step = saga_step(path)
    later = [group for group in groups if group.step < step]
    return later[0] if later else None


def describe(groups: Sequence[Group], status: str, at: str) -> list[dict[str, Any]]:
    """What `status` and `explain` show of the compensations: per group, its leaf, the step it
    undoes, its tasks, and its state: done, running, failed, waiting (not reached yet) or
    skipped (the program ended before it). `at`: the group the saga's cursor stands at, or
    stopped at once ended ("" before the first)."""
    shown: list[dict[str, Any]] = []
    before = bool(at)  # the groups before `at` ran
    for group in groups:
        if group.path == at:
            before = False
            state = {"compensating": "running", COMPENSATED: "done"}.get(status, "failed")
        elif before:
            state = "done"
        else:
            state = "waiting" if status == "compensating" else "skipped"
        tasks = [
            undo.compensate.task + ("" if undo.index is None else f" (member {undo.index})")
            for undo in group.undo
        ]
        shown.append({"path": group.path, "undoes": group.step, "tasks": tasks, "state": state})
    return shown
