"""The wire format: JSON bodies of the messages between router, orchestrators and workers."""

from __future__ import annotations

import functools
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from orchestrator.delivery import Poison, first_error
from orchestrator.documents import ProgramError, check_numbers
from orchestrator.keys import WORKFLOW_ID
from orchestrator.paths import is_saga, saga_step
from orchestrator.program import (
    MAX_BAG,
    MAX_ITERATIONS,
    MAX_LIMIT,
    MAX_LIMIT_KEY_CHARS,
    SIGNAL_NAME,
    TASK_NAME,
)
from orchestrator.settings import MAX_SHARDS
from orchestrator.store import MAX_ATTEMPTS

WorkflowId = Annotated[str, Field(pattern=WORKFLOW_ID.pattern)]
TaskName = Annotated[str, Field(pattern=TASK_NAME)]
# A failed attempt's error is recorded in Redis: long texts are cut by the worker to this.
MAX_ERROR = 16 * 1024
# A leaf's path: `2`, `3/iter:4/1` in a loop, `3/case:1/0` in a choice's case,
# `3/branch:1/0` in a bag's parallel branch (member 1), or `3/iter:4`
# for the wait before a loop's iteration; `saga:2`: the compensations undoing step 2.
Path = Annotated[
    str,
    Field(
        pattern=r"^(\d+(/((iter|case|branch):\d+/)?\d+)*(/iter:\d+)?|saga:\d+)$",
        max_length=1000,
    ),
]
# An input, prev or step output over this many bytes of JSON travels by reference: it is kept
# in Redis under the program (lua/stash.lua, or where complete.lua recorded it) and read there.
# lua/complete.lua has the same number.
INLINE_BYTES = 65536
# An item carried in a task message (a map's element, what a compensation undoes) is at
# most this large: it never travels by reference.
MAX_ITEM_BYTES = 65536
# A task message's header: its owner records a single task's output with the advance that the
# task's `next` makes (lua/advance.lua), so the worker carries the output there instead of
# recording it first (one Redis call less a step). A header, not a field: workers from before
# it refuse unknown fields, and record as before when it is absent.
CARRY = "x-shardflow-carry"
CARRYING = {CARRY: 1}  # the header as a task message carries it
# No message is published or accepted above this: a task message's args come from a program
# (at most 8 MiB, settings.py), and everything else large travels by reference.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024


class MessageError(Poison, ValueError):
    """A message that cannot be decoded; it goes to the dead-letter queue with this reason."""


def _one_way(value: Any, ref: bool, name: str) -> None:
    if ref and value is not None:
        raise ValueError(f"{name}: carried and referred to at once")


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# The run of a program a message belongs to: 0 until it is redriven (lua/redrive.lua); sent
# only when not 0. Bounded far above any real count of redrives.
Epoch = Annotated[int, Field(ge=0, le=1_000_000)]


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
    # The output was too large to carry: the owner reads it where complete.lua recorded it.
    stored: bool = False
    epoch: Epoch = 0  # the run of the task that finished (its task message's)

    @model_validator(mode="after")
    def _output_once(self) -> Next:
        _one_way(self.output, self.stored, "output")
        return self


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
    prev_ref: bool = False
    # Bounded as the task message it rebuilds: a retry must be buildable from it.
    iteration: int = Field(default=0, ge=0, lt=MAX_ITERATIONS)
    item: Any = None  # a map member's item
    epoch: Epoch = 0  # the run of the task that failed

    @model_validator(mode="after")
    def _prev_once(self) -> Failed:
        _one_way(self.prev, self.prev_ref, "prev")
        return self


class Deadline(_Message):
    """Owner to its own shard, delayed by the program's `deadline_s`: end it if still running."""

    kind: Literal["deadline"] = "deadline"
    wf: WorkflowId
    deadline_s: float = Field(gt=0, le=30 * 86400)
    epoch: Epoch = 0  # the run it limits: a redriven program's earlier deadlines end nothing


class Wake(_Message):
    """Owner shard to itself, delayed: the sleep step at `path` may be due. Only a hint: the
    owner reads when the step began, and sends it again, delayed, while it is early."""

    kind: Literal["wake"] = "wake"
    wf: WorkflowId
    path: Path
    epoch: Epoch = 0


class Signalled(_Message):
    """Router to owner shard: a signal of this name was kept for the program (lua/signal.lua).
    Only a hint: the owner takes the signal from Redis if a step at the cursor waits for it,
    and otherwise it stays kept for the step that will."""

    kind: Literal["signal"] = "signal"
    wf: WorkflowId
    name: str = Field(pattern=SIGNAL_NAME)


class Cancelled(_Message):
    """To every worker (control exchange): stop running this program's tasks."""

    wf: WorkflowId


ShardMessage = Annotated[
    Start | Next | Failed | Deadline | Wake | Signalled, Field(discriminator="kind")
]


class ItemFrom(_Message):
    """Where a compensation's item is read instead of carried: the recorded output of the
    top-level step it undoes (of its member `index` for a bag), when over MAX_ITEM_BYTES."""

    step: int = Field(ge=0, lt=2**31)
    index: int | None = Field(default=None, ge=0, lt=MAX_BAG)


class Slot(_Message):
    """One more bag member carried by a task message (a bag's `chunk`)."""

    index: int = Field(ge=0, lt=MAX_BAG)
    task: TaskName
    args: dict[str, Any] = Field(default_factory=dict)
    timeout_s: float | None = Field(default=None, gt=0, le=86400)
    item: Any = None
    item_from: ItemFrom | None = None

    @model_validator(mode="after")
    def _item_one_way(self) -> Slot:
        _one_way(self.item, self.item_from is not None, "item")
        return self


class KeyLimit(_Message):
    """A task's per-key limit, its key evaluated by the owner; `waits`: how often it found no
    free slot (its next wait doubles); `redelivered`: a delivery of it came back redelivered
    before it waited (a run before may have recorded and died before its report, which the
    message sent back to wait, unflagged by the broker, still owes)."""

    key: str = Field(min_length=1, max_length=MAX_LIMIT_KEY_CHARS)
    max: int = Field(ge=1, le=MAX_LIMIT)
    waits: int = Field(default=0, ge=0, le=1_000_000)
    redelivered: bool = False


class TaskMessage(_Message):
    """Owner shard to a pool: run one task (and the bag members in `batch`); report to `owner`."""

    wf: WorkflowId
    path: Path
    index: int | None = Field(default=None, ge=0, lt=MAX_BAG)
    size: int = Field(default=1, ge=1, le=MAX_BAG)
    task: TaskName
    args: dict[str, Any] = Field(default_factory=dict)
    # A map member's item (its list computed by the owner when the step started), or what a
    # compensation undoes: carried, or read where `item_from` says (a large one).
    item: Any = None
    item_from: ItemFrom | None = None
    input: Any = None
    prev: Any = None
    # Large values stay in Redis: the input under `input`, the prev under the task's path.
    input_ref: bool = False
    prev_ref: bool = False
    iteration: int = Field(default=0, ge=0, lt=MAX_ITERATIONS)
    attempt: int = Field(default=0, ge=0, lt=MAX_ATTEMPTS)
    owner: int = Field(ge=0, lt=MAX_SHARDS)
    timeout_s: float | None = Field(default=None, gt=0, le=86400)
    batch: list[Slot] = Field(default_factory=list, max_length=MAX_BAG)
    # The program's run (0 until it is redriven): a task of an earlier run is stale.
    epoch: Epoch = 0
    # Run only while holding a slot of this key (a task with a limit travels alone).
    limit: KeyLimit | None = None
    # Its step names compensations: the worker notes it as started (lua/begin.lua), so a
    # failure or cancel of the program lets it run to the end, and undoes it too.
    undoable: bool = False

    @model_validator(mode="after")
    def _members_in_bag(self) -> TaskMessage:
        indices = [self.index, *(slot.index for slot in self.batch)]
        if self.batch and self.index is None:
            raise ValueError("batch: only bag members travel together")
        if self.batch and self.limit is not None:
            raise ValueError("batch: a task with a limit travels alone")
        if self.index is None and self.size != 1:
            raise ValueError("size: a single task has size 1")
        if any(i is not None and i >= self.size for i in indices):
            raise ValueError(f"index: a bag of {self.size} has members 0..{self.size - 1}")
        _one_way(self.input, self.input_ref, "input")
        _one_way(self.prev, self.prev_ref, "prev")
        _one_way(self.item, self.item_from is not None, "item")
        read = [self.item_from, *(slot.item_from for slot in self.batch)]
        named = [(where.step, where.index) for where in read if where is not None]
        if named and not (
            is_saga(self.path) and {step for step, _ in named} == {saga_step(self.path)}
        ):
            raise ValueError(
                "item_from: only a compensation reads its item, from the step it undoes"
            )
        if len(set(named)) != len(named):
            raise ValueError("item_from: two members read one output")
        return self

    def split(self) -> list[TaskMessage]:
        """One message per task it carries, each as if it had come alone."""
        alone = self.model_copy(update={"batch": []}) if self.batch else self
        # Its fields as they are (a dump would make item_from a dict).
        return [alone] + [
            self.model_copy(update={**dict(slot), "batch": []}) for slot in self.batch
        ]


# Messages of different programs sent as one (a bundle): at most this many. The owner bundles
# a loop turn's single tasks for one queue while it has a backlog, and a worker those tasks'
# reports for one shard (bundling.py).
MAX_BUNDLE = 100
# A message larger than this goes alone, and a bundle holds at most MAX_BUNDLE_BYTES of them.
# A larger bundle is refused: each message is written again alone when it is parked or
# published again, and JSON written again can be some times longer (1e15 ->
# 1000000000000000.0), so a bundle near MAX_MESSAGE_BYTES could not be.
MAX_BUNDLED_BYTES = 64 * 1024
MAX_BUNDLE_BYTES = 1024 * 1024
# The largest bundle body an owner sends: its tasks, with the commas and brackets between them.
MAX_BUNDLE_BODY = MAX_BUNDLE_BYTES + MAX_BUNDLE + 1

_SHARD = TypeAdapter(ShardMessage)
_TASK = TypeAdapter(TaskMessage)
_BUNDLE = TypeAdapter(Annotated[list[TaskMessage], Field(min_length=1, max_length=MAX_BUNDLE)])
# What a worker reports of a task: the reports of a bundle's tasks may travel as one (a bundle
# of reports), each to be applied as if it had come alone.
Report = Annotated[Next | Failed, Field(discriminator="kind")]
_REPORTS = TypeAdapter(Annotated[list[Report], Field(min_length=1, max_length=MAX_BUNDLE)])


def _unused_new_fields(message: _Message) -> dict[str, Any]:
    """Fields added since 0.1 (`item`, `item_from`, `epoch`, `limit`, `limit.redelivered`,
    `undoable`), left out while unused: parts from before them refuse unknown fields
    (extra="forbid"), and must keep reading messages during a rolling upgrade."""
    unused: dict[str, Any] = {}
    if getattr(message, "epoch", None) == 0:
        unused["epoch"] = True
    if isinstance(message, TaskMessage) and not message.undoable:
        unused["undoable"] = True
    if isinstance(message, TaskMessage) and message.limit is None:
        unused["limit"] = True
    elif isinstance(message, TaskMessage) and message.limit and not message.limit.redelivered:
        unused["limit"] = {"redelivered"}
    if isinstance(message, TaskMessage | Failed) and message.item is None:
        unused["item"] = True
    if isinstance(message, TaskMessage) and message.item_from is None:
        unused["item_from"] = True
    if isinstance(message, TaskMessage):
        slots: dict[int, set[str]] = {}
        for n, slot in enumerate(message.batch):
            names = {name for name in ("item", "item_from") if getattr(slot, name) is None}
            if names:
                slots[n] = names
        if slots:
            unused["batch"] = slots
    return unused


class MessageTooLarge(ValueError):
    """A message over MAX_MESSAGE_BYTES: large values should have travelled by reference."""


def _fits(body: bytes) -> None:
    """Refuse a body over MAX_MESSAGE_BYTES, or one holding a number that is not finite."""
    if len(body) > MAX_MESSAGE_BYTES:
        raise MessageError(f"a message of {len(body)} bytes, over {MAX_MESSAGE_BYTES}")
    if _may_not_be_finite(body):
        # pydantic's parser takes NaN, Infinity, 1e400 and 9...9e99 (210 digits) into an Any
        # field (an output, args) as a float that is not finite, which would reach Redis as
        # text that is not JSON. Only a body that may hold one is parsed again for its
        # numbers alone (documents.check_numbers: a user's value 64 levels deep is deeper
        # here), so the common message costs a few scans.
        try:
            check_numbers(body, "message")
        except ProgramError as exc:
            raise MessageError(str(exc)) from None


def _may_not_be_finite(body: bytes) -> bool:
    if b"NaN" in body or b"Infinity" in body or _LONG_DIGITS.search(body):
        return True
    # The cheap scan first: a hex id ("a89de851") matches it one time in three, the exact
    # one (a number token's exponent) only where a number may be infinite. On a hostile body
    # the exact scan costs about what the parse does: a large body goes to the parse at once,
    # so it costs one parse at most, never a scan and a parse.
    if _E3.search(body) is None:
        return False
    return len(body) > EXACT_SCAN_BYTES or _EXPONENT.search(body) is not None


EXACT_SCAN_BYTES = 65536
# An exponent of three digits or more (1e400 is infinite), anywhere; then only in a number
# token (after neither a letter, a digit, a point nor a quote). A string holding one
# ("x 1e400") is parsed for its numbers to find nothing wrong: it only costs time.
_E3 = re.compile(rb"[eE][+-]?[0-9]{3}")
_EXPONENT = re.compile(rb'(?<![0-9A-Za-z_."])-?[0-9]+(?:\.[0-9]*)?[eE][+-]?[0-9]{3}')
# 200 digits in a row, from the first of a run (linear time): with an exponent of two digits
# at most, a number needs 210 digits before its point to be infinite (9 and 209 nines, e99),
# and 309 with none (1 and 308 zeros, then ".5").
_LONG_DIGITS = re.compile(rb"(?<![0-9])[0-9]{200}")


def decode_shard_message(body: bytes) -> Start | Next | Failed | Deadline | Wake | Signalled:
    """Parse a shard queue message, or raise MessageError naming the fault."""
    _fits(body)
    try:
        return _SHARD.validate_json(body)
    except ValidationError as exc:
        raise MessageError(first_error(exc)) from None


def decode_task(body: bytes) -> TaskMessage:
    """Parse a task message, or raise MessageError naming the fault."""
    _fits(body)
    try:
        return _TASK.validate_json(body)
    except ValidationError as exc:
        raise MessageError(first_error(exc)) from None


def decode_tasks(body: bytes) -> list[TaskMessage] | None:
    """A bundle's task messages (a JSON array of them), or None when `body` is no bundle (a
    task message on its own: `decode_task`); MessageError naming the fault. Each travels as if
    it had come alone, so none carries a batch or a limit: those go alone."""
    tasks = _bundled(body, _BUNDLE, "task")
    for i, task in enumerate(tasks or ()):
        if task.batch or task.limit is not None:
            raise MessageError(f"task {i}: a bundle's task carries no batch and no limit")
    return tasks


def decode_reports(body: bytes) -> list[Next | Failed] | None:
    """A bundle's reports (a JSON array of `next` and `failed` messages), or None when `body`
    is no bundle (`decode_shard_message`); MessageError naming the fault."""
    return _bundled(body, _REPORTS, "report")


def decode_shard_body(body: bytes) -> ShardMessage | list[Next | Failed]:
    """What a shard queue's message holds: one message, or a bundle of reports."""
    reports = decode_reports(body)
    return decode_shard_message(body) if reports is None else reports


def _bundled(body: bytes, adapter: TypeAdapter[list[Any]], part: str) -> list[Any] | None:
    if body[:1] != b"[":
        return None
    if len(body) > MAX_BUNDLE_BODY:
        raise MessageError(
            f"a bundle of {len(body)} bytes, over the {MAX_BUNDLE_BODY} one may hold"
        )
    _fits(body)
    try:
        return adapter.validate_json(body)
    except ValidationError as exc:
        where = functools.partial(_in_bundle, part)
        raise MessageError(first_error(exc, where, "bundle")) from None


def _in_bundle(part: str, loc: tuple[int | str, ...]) -> str:
    return f"{part} " + ".".join(str(step) for step in loc) if loc else "bundle"


def bundle(bodies: list[bytes]) -> bytes:
    """One body for messages of different programs (`decode_tasks`, `decode_reports` read it
    back)."""
    return b"[" + b",".join(bodies) + b"]"


def encode(message: _Message) -> bytes:
    """The message's body; MessageTooLarge (a bug: every large value has a reference) when
    over MAX_MESSAGE_BYTES."""
    body = message.model_dump_json(exclude=_unused_new_fields(message)).encode()
    if len(body) > MAX_MESSAGE_BYTES:
        raise MessageTooLarge(f"{type(message).__name__} of {len(body)} bytes")
    return body
