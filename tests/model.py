"""Programs drawn by hypothesis, and a tiny independent model of what running one must give.

Drawn programs use two tasks: `work`, whose output is a fixed function of where it runs
(`output_of`), and `boom`, which always fails. Conditions come from two templates whose
meaning the model computes in plain Python, so the model shares no code with the system.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st


def output_of(path: str, index: int | None) -> dict[str, int]:
    """What `work` returns at a step path (and bag index): the same on every run."""
    return {"v": zlib.crc32(f"{path}#{index}".encode()) % 5}


def _task(pool: str | None, failing: bool) -> dict[str, Any]:
    step: dict[str, Any] = {"task": "boom" if failing else "work"}
    if pool is not None:
        step["pool"] = pool
    return step


@st.composite
def steps(draw: st.DrawFn, depth: int = 0, max_bag: int = 50, fail_rate: int = 25) -> list[Any]:
    """A list of 1-4 steps; untiloops nest up to two deep."""
    kinds = ["task", "bag"] + (["loop"] if depth < 2 else [])
    drawn: list[Any] = []
    for _ in range(draw(st.integers(1, 4 if depth == 0 else 2))):
        kind = draw(st.sampled_from(kinds))
        fails = lambda: draw(st.integers(0, fail_rate)) == 0  # noqa: E731
        if kind == "task":
            drawn.append(_task(draw(st.sampled_from([None, "serial", "parallel"])), fails()))
        elif kind == "bag":
            size = draw(st.integers(1, max_bag))
            drawn.append({"bag": [_task(None, fails()) for _ in range(size)]})
        else:
            body = draw(steps(depth + 1, max_bag, fail_rate))
            last_is_task = "task" in body[-1]
            templates = ["iteration >= {k}"] + (["prev.v % {m} == 0"] if last_is_task else [])
            until = draw(st.sampled_from(templates)).format(
                k=draw(st.integers(0, 3)), m=draw(st.integers(1, 3))
            )
            max_iterations = draw(st.integers(1, 4))
            drawn.append({"until": until, "max_iterations": max_iterations, "steps": body})
    return drawn


def programs(max_bag: int = 50, fail_rate: int = 25) -> st.SearchStrategy[dict[str, Any]]:
    """Whole programs of the grammar: tasks, bags of 1..max_bag, nested untiloops, both pools."""
    return steps(0, max_bag, fail_rate).map(lambda drawn: {"name": "drawn", "steps": drawn})


@dataclass
class Expected:
    """What the system must do: run `leaves` (path, size) in this order, then end so."""

    leaves: list[tuple[str, int]] = field(default_factory=list)
    status: str = "completed"
    result: Any = None
    error_prefix: str = ""

    def position(self, path: str) -> int:
        return [leaf for leaf, _ in self.leaves].index(path)


class _Stop(Exception):
    pass


def expect(program: dict[str, Any]) -> Expected:
    """Interpret a drawn program the slow, obvious way."""
    expected = Expected()
    try:
        expected.result = _run(program["steps"], None, "", expected)
    except _Stop:
        expected.result = None
    return expected


def _run(steps: list[Any], prev: Any, prefix: str, expected: Expected) -> Any:
    for k, step in enumerate(steps):
        path = f"{prefix}{k}"
        if "task" in step:
            expected.leaves.append((path, 1))
            if step["task"] == "boom":
                _fail(expected, f"step {path}: task 'boom': RuntimeError: boom")
            prev = output_of(path, None)
        elif "bag" in step:
            members = step["bag"]
            expected.leaves.append((path, len(members)))
            if any(member["task"] == "boom" for member in members):
                _fail(expected, f"step {path}/bag:")
            prev = [output_of(path, i) for i in range(len(members))]
        else:
            for iteration in range(step["max_iterations"]):
                prev = _run(step["steps"], prev, f"{path}/iter:{iteration}/", expected)
                if _holds(step["until"], prev, iteration):
                    break
            else:
                _fail(expected, f"step {path}: until {step['until']!r} not met")
    return prev


def _holds(until: str, prev: Any, iteration: int) -> bool:
    if match := re.fullmatch(r"iteration >= (\d+)", until):
        return iteration >= int(match[1])
    if match := re.fullmatch(r"prev\.v % (\d+) == 0", until):
        return bool(prev["v"] % int(match[1]) == 0)
    raise AssertionError(f"no model for {until!r}")


def _fail(expected: Expected, error_prefix: str) -> None:
    expected.status = "failed"
    expected.error_prefix = error_prefix
    raise _Stop
