"""What the inspection commands print for people: the `list` table and `submit --wait`'s live
progress (on a terminal only). `explain`'s words are router/explain.py's `explain_text`."""

from __future__ import annotations

from datetime import UTC, datetime
from types import TracebackType
from typing import Any, TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn

from router.listing import clean


def list_table(programs: list[dict[str, Any]]) -> str:
    """One line per program under a header, columns padded; text from Redis made printable."""
    header = ("CREATED (UTC)", "ID", "NAME", "STATUS", "STEP")
    rows = [header] + [
        (
            _when(program["created_ms"]),
            program["workflow_id"],
            clean(program["name"] or "-", 40),
            program["status"],
            clean(program["cursor"] or "-", 40),
        )
        for program in programs
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def _when(ms: int | None) -> str:
    if ms is None:
        return "?"
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S")


def describe_step(status: dict[str, Any]) -> str:
    """The current step in a few words: `step 1: bag 3 of 10 done`, `step 2/iter:1/0: 'poll'`."""
    step = status.get("step")
    if step is None:
        return status["status"]
    if step["kind"] == "sleep":
        what = "sleeping"
    elif step["kind"] != "task":  # a bag or a map
        what = f"{step['kind']} {step['done']} of {step['size']} done"
    else:
        task = step["tasks"][0]
        retry = f", attempt {task['attempt'] + 1}" if task["attempt"] else ""
        what = f"{clean(task['task'], 60)!r}{retry}"
    loops = "".join(f", iteration {loop['iteration'] + 1}" for loop in step["loops"])
    return f"step {clean(step['path'], 60)}: {what}{loops}"


class LiveProgress:
    """Steps done of total, the current step, bag members done: redrawn on a terminal."""

    def __init__(self, stream: TextIO) -> None:
        self._progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("steps"),
            console=Console(file=stream),
            transient=False,
        )
        self._task = self._progress.add_task("starting", total=None)

    def __enter__(self) -> LiveProgress:
        self._progress.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._progress.stop()

    def update(self, status: dict[str, Any]) -> None:
        total = status.get("steps")
        step = status.get("step")
        if status["status"] == "completed":
            done = total
        elif step is not None:
            done = step["top"]
        else:
            done = 0
        self._progress.update(
            self._task, description=describe_step(status), total=total, completed=done or 0
        )
