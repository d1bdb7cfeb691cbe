"""What a task handler receives."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class TaskContext:
    """The task's inputs and identity (`item`: a map member's element of the list).

    `idempotency_key` names the logical task (workflow, step path with iterations, bag index):
    it stays the same across redeliveries and retries, so a handler that may run more than
    once can use it to do its side effect once.
    """

    input: Any
    args: dict[str, Any]
    prev: Any
    workflow_id: str
    step: str
    iteration: int
    index: int | None
    attempt: int
    # A map member's item (None for other tasks).
    item: Any = None

    @property
    def idempotency_key(self) -> str:
        member = "" if self.index is None else f"/bag:{self.index}"
        return f"{self.workflow_id}/{self.step}{member}"
