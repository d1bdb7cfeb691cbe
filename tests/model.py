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


def _bag(members: list[dict[str, Any]], chunk: int) -> dict[str, Any]:
    # chunk 1 (one message per member) is the default, and where a bag shrinks to.
    return {"bag": members, "chunk": chunk} if chunk > 1 else {"bag": members}


def steps(depth: int = 0, max_bag: int = 50, fail_rate: int = 25) -> st.SearchStrategy[list[Any]]:
    """A list of 1-4 steps; untiloops nest up to two deep. Shrinks toward plain passing tasks.

    Bags inside loops hold at most 5 members, so that a drawn program stays small to run.
    """
    # 0 is where integers shrink to: make it mean "does not fail".
    fails = st.integers(0, fail_rate).map(lambda drawn: drawn == fail_rate)
    task = st.builds(_task, st.sampled_from([None, "serial", "parallel"]), fails)
    bag_size = max_bag if depth == 0 else min(max_bag, 5)
    bag = st.builds(
        _bag, st.lists(st.builds(_task, st.none(), fails), min_size=1, max_size=bag_size),
        st.integers(1, 4),
    )  # fmt: skip
    kinds = [task, bag]
    if depth < 2:
        kinds.append(untiloops(depth + 1, max_bag, fail_rate))
    return st.lists(st.one_of(kinds), min_size=1, max_size=4 if depth == 0 else 2)


@st.composite
def untiloops(draw: st.DrawFn, depth: int, max_bag: int, fail_rate: int) -> dict[str, Any]:
    body = draw(steps(depth, max_bag, fail_rate))
    templates = ["iteration >= {k}"] + (["prev.v % {m} == 0"] if "task" in body[-1] else [])
    until = draw(st.sampled_from(templates)).format(
        k=draw(st.integers(0, 3)), m=draw(st.integers(1, 3))
    )
    return {"until": until, "max_iterations": draw(st.integers(1, 4)), "steps": body}


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
