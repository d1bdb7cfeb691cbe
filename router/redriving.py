"""`shardflow redrive`: where a failed or cancelled program runs again, and its runs' history.

Pure functions over the program and its state hash; `Router.redrive` (router/client.py) calls
them, then lua/redrive.lua makes the new run in one step and the owner's start runs it.
"""

from __future__ import annotations

import re
from typing import Any

from orchestrator.program import Bag, Map, Program, Signal, Sleep, Task
from orchestrator.store import MAX_RUNS

# A run's error as kept in the history: the state keeps the whole of the current one.
RECORD_ERROR_CHARS = 2000


class RedriveError(ValueError):
    """A redrive that cannot be done (a live or completed program, a bad --from)."""


def where(
    program: Program, state: dict[str, str], from_step: str | None
) -> tuple[str, str, list[str]]:
    """The step to run again, the leaf whose output is its prev ("" for none), and the step
    paths whose recorded keys go (they run again).

    Without `from_step`: the leaf the program stopped at (its failed step; a step that
    failed while moving on, as an untiloop out of iterations, runs its last leaf again; a
    cancelled one, the leaf it was running). With it: a top-level step number, at most the
    one it stopped in; every step from there on runs again (the step before must be a task,
    a bag, a map, a sleep or a signal: its output is the prev)."""
    stopped = state.get("from", "")
    everything = [str(k) for k in range(len(program.steps))]
    if from_step is None or from_step == stopped:
        if not stopped:  # it never ran a step (cancelled while pending): from the start
            return "", "", everything
        if "prior" not in state:
            raise RedriveError(
                f"it ended before redrive was supported, so the step before {stopped} is not "
                "known; redrive it --from a top-level step number"
            )
        return stopped, state["prior"], [stopped]
    top = int(stopped.split("/")[0]) if stopped else 0
    if not re.fullmatch(r"[0-9]{1,6}", from_step):
        raise RedriveError(
            f"--from {from_step!r}: give a top-level step number (0..{top}); a step inside a "
            f"loop or a choice runs again only as the failed one ({stopped or 'none'})"
        )
    number = int(from_step)
    if number > top:
        raise RedriveError(
            f"--from {number}: the program stopped in step {top}; steps after it never ran"
        )
    prior = ""
    if number > 0:
        before = program.steps[number - 1]
        if not isinstance(before, Task | Bag | Map | Sleep | Signal):
            kind = type(before).__name__.lower()
            article = "an" if kind[0] in "aeiou" else "a"
            raise RedriveError(
                f"--from {number}: step {number - 1} before it is {article} {kind}, whose output "
                "is not kept as one value; redrive from its failed step, or from a step that "
                "follows a task, a bag, a map, a sleep or a signal"
            )
        prior = str(number - 1)
    return str(number), prior, everything[number:]


def record(state: dict[str, str]) -> str:
    """The ended run as the history keeps it (tab-separated: status, started_ms, ended_ms,
    the step it stopped at, its error, cut short)."""
    error = (state.get("error") or "").replace("\t", " ")
    if len(error) > RECORD_ERROR_CHARS:
        error = error[:RECORD_ERROR_CHARS] + "…"
    fields = [state.get("status", ""), state.get("started_ms", ""), state.get("ended_ms", "")]
    return "\t".join([*fields, state.get("from", ""), error])


def runs(state: dict[str, str]) -> list[dict[str, Any]]:
    """The program's ended runs before this one (at most MAX_RUNS, oldest first)."""
    found: list[dict[str, Any]] = []
    for name, value in state.items():
        number = name.removeprefix("run:")
        if not name.startswith("run:") or not re.fullmatch(r"[0-9]{1,9}", number):
            continue
        status, started, ended, step, error = (value.split("\t", 4) + [""] * 5)[:5]
        found.append(
            {
                "run": int(number),
                "status": status,
                "started_ms": _ms(started),
                "ended_ms": _ms(ended),
                "step": step or None,
                "error": error or None,
            }
        )
    return sorted(found, key=lambda run: run["run"])[-MAX_RUNS:]


def _ms(text: str) -> int | None:
    return int(text) if re.fullmatch(r"[0-9]{1,18}", text) else None
