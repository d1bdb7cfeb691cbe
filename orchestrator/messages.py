"""The wire format: JSON bodies of the messages between router, orchestrators and workers."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from orchestrator.delivery import Poison, first_error
from orchestrator.keys import WORKFLOW_ID
from orchestrator.program import MAX_BAG, TASK_NAME
from orchestrator.settings import MAX_SHARDS
from orchestrator.store import MAX_ATTEMPTS

WorkflowId = Annotated[str, Field(pattern=WORKFLOW_ID.pattern)]
TaskName = Annotated[str, Field(pattern=TASK_NAME)]
# A failed attempt's error is recorded in Redis: long texts are cut by the worker to this.
MAX_ERROR = 16 * 1024
Path = Annotated[str, Field(pattern=r"^\d+(/(iter:\d+/)?\d+)*$", max_length=1000)]


class MessageError(Poison, ValueError):
    """A message that cannot be decoded; it goes to the dead-letter queue with this reason."""


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Start(_Message):
    """Router to owner shard: run this (already recorded) program from its first step."""

    kind: Literal["start"] = "start"
    wf: WorkflowId


class Next(_Message):
    """Worker to owner shard: the leaf at `path` is done; `output` is a value, or a bag's list."""

    kind: Literal["next"] = "next"
    wf: WorkflowId
    path: Path
    output: Any = None


class Failed(_Message):
    """Worker to owner shard: one attempt of a task (bag member `index`) failed."""

    kind: Literal["failed"] = "failed"
    wf: WorkflowId
    path: Path
    index: int | None = Field(default=None, ge=0, lt=MAX_BAG)
    attempt: int = Field(default=0, ge=0, lt=MAX_ATTEMPTS)
    task: TaskName | Literal[""] = ""
    error: str = Field(max_length=MAX_ERROR)
    # What a retry needs to send the task again.
    prev: Any = None
    iteration: int = 0


class Deadline(_Message):
    """Router to owner shard, delayed by the program's `deadline_s`: end it if still running."""

    kind: Literal["deadline"] = "deadline"
    wf: WorkflowId
    deadline_s: float = Field(gt=0, le=30 * 86400)


class Cancelled(_Message):
    """To every worker (control exchange): stop running this program's tasks."""

    wf: WorkflowId


ShardMessage = Annotated[Start | Next | Failed | Deadline, Field(discriminator="kind")]


class Slot(_Message):
    """One more bag member carried by a task message (a bag's `chunk`)."""

    index: int = Field(ge=0, lt=MAX_BAG)
    task: TaskName
    args: dict[str, Any] = Field(default_factory=dict)
    timeout_s: float | None = Field(default=None, gt=0, le=86400)


class TaskMessage(_Message):
    """Owner shard to a pool: run one task (and the bag members in `batch`); report to `owner`."""

    wf: WorkflowId
    path: Path
    index: int | None = Field(default=None, ge=0, lt=MAX_BAG)
    size: int = Field(default=1, ge=1, le=MAX_BAG)
    task: TaskName
    args: dict[str, Any] = Field(default_factory=dict)
    input: Any = None
    prev: Any = None
    iteration: int = Field(default=0, ge=0)
    attempt: int = Field(default=0, ge=0, lt=MAX_ATTEMPTS)
    owner: int = Field(ge=0, lt=MAX_SHARDS)
    timeout_s: float | None = Field(default=None, gt=0, le=86400)
    batch: list[Slot] = Field(default_factory=list, max_length=MAX_BAG)

    @model_validator(mode="after")
    def _members_in_bag(self) -> TaskMessage:
        indices = [self.index, *(slot.index for slot in self.batch)]
        if self.batch and self.index is None:
            raise ValueError("batch: only bag members travel together")
        if self.index is None and self.size != 1:
            raise ValueError("size: a single task has size 1")
        if any(i is not None and i >= self.size for i in indices):
            raise ValueError(f"index: a bag of {self.size} has members 0..{self.size - 1}")
        return self

    def split(self) -> list[TaskMessage]:
        """One message per task it carries, each as if it had come alone."""
        alone = self.model_copy(update={"batch": []}) if self.batch else self
        return [alone] + [
            self.model_copy(update={**slot.model_dump(), "batch": []}) for slot in self.batch
        ]


_SHARD = TypeAdapter(ShardMessage)
_TASK = TypeAdapter(TaskMessage)


def decode_shard_message(body: bytes) -> Start | Next | Failed | Deadline:
    """Parse a shard queue message, or raise MessageError naming the fault."""
    try:
        return _SHARD.validate_json(body)
    except ValidationError as exc:
        raise MessageError(first_error(exc)) from None


def decode_task(body: bytes) -> TaskMessage:
    """Parse a task message, or raise MessageError naming the fault."""
    try:
        return _TASK.validate_json(body)
    except ValidationError as exc:
        raise MessageError(first_error(exc)) from None


def encode(message: _Message) -> bytes:
    return message.model_dump_json().encode()
