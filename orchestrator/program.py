"""The program format (user-facing contract): tasks, bags and untiloops, validated with pydantic."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    ValidationError,
    field_validator,
)

from orchestrator.conditions import MAX_SOURCE_CHARS, ConditionError, compile_condition
from orchestrator.documents import (  # the documents' names stay importable from here
    ProgramError,
    check_value,
    load,
    short,
)

TASK_NAME = r"^[A-Za-z_][A-Za-z0-9_.:-]{0,127}$"
MAX_BAG = 1000
MAX_SLEEP_S = 30 * 86400
CHUNK = (
    "members per task message, run side by side by one worker; unset: one per message "
    "while the pool keeps up, up to SHARDFLOW_AUTO_CHUNK while its queue has a backlog"
)
# A pool names a task queue (`<prefix>.tasks.<pool>`) and its retry queues
# (`<prefix>.delay.<pool>.<ms>`); `shard<N>` is taken by a shard's delayed messages there.
POOL_NAME = r"^[a-z][a-z0-9_-]{0,39}$"
SERIAL, PARALLEL = "serial", "parallel"
# `serial-<name>` pools are lanes too: one task at a time for that lane only.
LANE_PREFIX = "serial-"
_POOL_NAME = re.compile(POOL_NAME)
_RESERVED_POOL = re.compile(r"^shard[0-9]+$")


def check_pool_name(name: str) -> str:
    """Return the pool name, or raise ValueError saying what a pool name may hold."""
    if not _POOL_NAME.fullmatch(name):
        raise ValueError(
            f"{short(name)} is not a pool name: use 1-40 of a-z, 0-9, '_' or '-', "
            "starting with a letter"
        )
    if _RESERVED_POOL.fullmatch(name):
        raise ValueError(f"{short(name)} is not a pool name: shard<N> is reserved")
    return name


def is_lane(pool: str) -> bool:
    """Whether a pool is a serial lane (one task at a time): `serial`, or `serial-<name>`."""
    return pool == SERIAL or pool.startswith(LANE_PREFIX)


def _no_serial_bag(name: str) -> str:
    if is_lane(name):
        raise ValueError(
            "a bag or map runs its members side by side: a serial lane takes single tasks"
        )
    return name


PoolName = Annotated[
    str,
    AfterValidator(check_pool_name),
    Field(
        json_schema_extra={"pattern": POOL_NAME, "not": {"pattern": _RESERVED_POOL.pattern}},
        description="serial: one lane for the cluster, serial-<name>: a lane of its own (one "
        "task at a time); parallel, or any other name: a pool of its own, with many consumers",
    ),
]
BagPool = Annotated[
    str,
    AfterValidator(check_pool_name),
    AfterValidator(_no_serial_bag),
    Field(
        json_schema_extra={
            "pattern": POOL_NAME,
            "not": {
                "anyOf": [
                    {"pattern": _RESERVED_POOL.pattern},
                    {"const": SERIAL},
                    {"pattern": f"^{LANE_PREFIX}"},
                ]
            },
        },
        description="parallel, or any other name but serial and serial-*: a pool with many "
        "consumers",
    ),
]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Retry(_Model):
    """How often a failing task is tried, and how long to wait between tries."""

    max_attempts: int = Field(default=3, ge=1, le=100)
    backoff_s: float = Field(default=1.0, ge=0, le=86400)
    factor: float = Field(default=2.0, ge=1, le=10)
    max_backoff_s: float = Field(default=300.0, ge=0, le=86400)

    def delay_s(self, attempt: int) -> float:
        """The wait before attempt `attempt + 1`, after attempt `attempt` (from 0) failed."""
        return min(self.backoff_s * self.factor**attempt, self.max_backoff_s)


class Member(_Model):
    """One task of a bag; it runs on the bag's pool unless it names its own (never serial)."""

    task: str = Field(pattern=TASK_NAME)
    args: dict[str, Any] = Field(default_factory=dict)
    retry: Retry | None = None
    timeout_s: float | None = Field(default=None, gt=0, le=86400)
    pool: BagPool | None = None


class Task(Member):
    """A single task: the next step starts only after it finished."""

    pool: PoolName = SERIAL


class Bag(_Model):
    """Tasks run in parallel; a join barrier holds the program until all finished."""

    bag: list[Member] = Field(min_length=1, max_length=MAX_BAG)
    # The pool of every member that does not name its own.
    pool: BagPool = PARALLEL
    # Members per task message. Above 1, one worker runs a chunk's members side by side:
    # fewer messages for bags of short tasks, less spreading for long ones. None: adaptive
    # (orchestrator/backlog.py), one per message unless the pool has a backlog.
    chunk: int | None = Field(default=None, ge=1, le=MAX_BAG, description=CHUNK)


class Map(Member):
    """One task per item of a list computed when the step starts, run like a bag's members."""

    map: str = Field(
        min_length=1,
        max_length=MAX_SOURCE_CHARS,
        description="CEL over input, prev and iteration giving the list of items",
    )
    max_items: int = Field(ge=1, le=MAX_BAG, description="more items fail the step")
    chunk: int | None = Field(default=None, ge=1, le=MAX_BAG, description=CHUNK)

    @field_validator("map")
    @classmethod
    def _map_compiles(cls, value: str) -> str:
        return _compiles(value)


class Sleep(_Model):
    """A durable timer: the program waits `sleep_s`, holding no worker; its output is prev."""

    sleep_s: float = Field(gt=0, le=MAX_SLEEP_S, description="seconds to wait, up to 30 days")


SIGNAL_NAME = r"^[a-z][a-z0-9_.-]{0,63}$"
# A signal's data: its step's output, carried in the shard message that takes it.
MAX_SIGNAL_BYTES = 65536


class Signal(_Model):
    """Waits, holding no worker, for a named signal sent to the program (`shardflow signal`);
    its output is the signal's data. One sent before the program gets here is kept for it."""

    signal: str = Field(pattern=SIGNAL_NAME, description="the signal's name")
    timeout_s: float | None = Field(
        default=None,
        gt=0,
        le=MAX_SLEEP_S,
        description="seconds to wait before the step fails (none: wait until cancelled)",
    )


class Untiloop(_Model):
    """A body of steps repeated until `until` holds over its last output."""

    until: str = Field(min_length=1, max_length=MAX_SOURCE_CHARS)
    max_iterations: int = Field(ge=1, le=100_000)
    # Finished iterations whose outputs stay in Redis; older ones go as the loop moves on.
    keep_iterations: int = Field(
        default=1,
        ge=1,
        le=1000,
        description="finished iterations whose recorded outputs stay in Redis (older ones go)",
    )
    # A durable timer between iterations (not before the first): the wait is a sleep leaf
    # of its own, at the iteration's path (`3/iter:4`).
    interval_s: float | None = Field(
        default=None, gt=0, le=MAX_SLEEP_S, description="seconds to wait between iterations"
    )
    steps: list[Step] = Field(min_length=1)

    @field_validator("until")
    @classmethod
    def _until_compiles(cls, value: str) -> str:
        return _compiles(value)


def _compiles(source: str) -> str:
    try:
        compile_condition(source)
    except ConditionError as exc:
        raise ValueError(f"invalid CEL: {exc}") from None
    return source


MAX_CASES = 20


class Case(_Model):
    """One branch of a choice: its steps run when `when` holds."""

    when: str = Field(min_length=1, max_length=MAX_SOURCE_CHARS)
    steps: list[Step] = Field(min_length=1)

    @field_validator("when")
    @classmethod
    def _when_compiles(cls, value: str) -> str:
        return _compiles(value)


class Choice(_Model):
    """The first case whose `when` holds runs (else `otherwise`); its output is the step's."""

    choice: list[Case] = Field(min_length=1, max_length=MAX_CASES)
    otherwise: list[Step] | None = Field(default=None, min_length=1)

    def branch(self, k: int) -> list[Step] | None:
        """The steps of case `k`, `otherwise` as case len(choice); None when there is none."""
        if 0 <= k < len(self.choice):
            return self.choice[k].steps
        return self.otherwise if k == len(self.choice) else None

    def branches(self) -> list[list[Step]]:
        return [case.steps for case in self.choice] + ([self.otherwise] if self.otherwise else [])


def _step_kind(value: Any) -> str | None:
    if isinstance(value, BaseModel):
        return type(value).__name__
    if not isinstance(value, dict):
        return None
    kinds = [kind for key, kind in _KINDS.items() if key in value]
    if kinds == ["Task", "Map"]:  # a map names its task too
        return "Map"
    return kinds[0] if len(kinds) == 1 else None


_KINDS = {
    "task": "Task",
    "bag": "Bag",
    "until": "Untiloop",
    "map": "Map",
    "sleep_s": "Sleep",
    "choice": "Choice",
    "signal": "Signal",
}

Step = Annotated[
    Annotated[Task, Tag("Task")]
    | Annotated[Bag, Tag("Bag")]
    | Annotated[Map, Tag("Map")]
    | Annotated[Sleep, Tag("Sleep")]
    | Annotated[Untiloop, Tag("Untiloop")]
    | Annotated[Choice, Tag("Choice")]
    | Annotated[Signal, Tag("Signal")],
    Discriminator(
        _step_kind,
        custom_error_type="step_kind",
        custom_error_message=(
            "a step needs exactly one of 'task', 'bag', 'map', 'sleep_s', 'until', 'choice' "
            "or 'signal'"
        ),
    ),
]
Untiloop.model_rebuild()
Case.model_rebuild()
Choice.model_rebuild()


class Program(_Model):
    """A program: a name and a non-empty list of steps."""

    name: str = Field(default="", max_length=200)
    steps: list[Step] = Field(min_length=1)
    # The program fails if it has not ended this long after it was submitted.
    deadline_s: float | None = Field(default=None, gt=0, le=30 * 86400)

    def task_names(self) -> set[str]:
        """Every task name the program may run."""
        return _names(self.steps)

    def pools(self) -> set[str]:
        """Every pool the program may send a task to."""
        return _pools(self.steps)

    def signals(self) -> set[str]:
        """Every signal name the program may wait for."""
        return _signals(self.steps)


def pool_of(step: Task | Bag | Map, index: int | None = None) -> str:
    """The pool of a single task, of bag member `index` (else the bag's own pool), or of a
    map's members (its `pool`, else parallel)."""
    if isinstance(step, Task):
        return step.pool
    if isinstance(step, Map):
        return step.pool or PARALLEL
    member = step.bag[index].pool if index is not None else None
    return member or step.pool


def _pools(steps: list[Step]) -> set[str]:
    pools: set[str] = set()
    for step in steps:
        if isinstance(step, Task | Map):
            pools.add(pool_of(step))
        elif isinstance(step, Bag):
            pools.update(pool_of(step, i) for i in range(len(step.bag)))
        elif isinstance(step, Untiloop):
            pools |= _pools(step.steps)
        elif isinstance(step, Choice):
            for branch in step.branches():
                pools |= _pools(branch)
    return pools


def _signals(steps: list[Step]) -> set[str]:
    names: set[str] = set()
    for step in steps:
        if isinstance(step, Signal):
            names.add(step.signal)
        elif isinstance(step, Untiloop):
            names |= _signals(step.steps)
        elif isinstance(step, Choice):
            for branch in step.branches():
                names |= _signals(branch)
    return names


def _names(steps: list[Step]) -> set[str]:
    names: set[str] = set()
    for step in steps:
        if isinstance(step, Task | Map):
            names.add(step.task)
        elif isinstance(step, Bag):
            names.update(member.task for member in step.bag)
        elif isinstance(step, Untiloop):
            names |= _names(step.steps)
        elif isinstance(step, Choice):
            for branch in step.branches():
                names |= _names(branch)
    return names


_PROGRAM = TypeAdapter(Program)


def parse_program(
    source: str | bytes | dict[str, Any],
    *,
    max_bytes: int = 256 * 1024,
    known_tasks: set[str] | None = None,
) -> Program:
    """Validate a program from JSON text or a dict; raise ProgramError naming each fault's path."""
    if isinstance(source, str | bytes):
        source = load(source, "program", max_bytes)
    else:
        check_value(source, "program", max_bytes)
    try:
        program = _PROGRAM.validate_python(source)
    except ValidationError as exc:
        raise ProgramError([_fault(err) for err in exc.errors()]) from None
    if known_tasks is not None:
        unknown = sorted(program.task_names() - known_tasks)
        if unknown:
            raise ProgramError([f"steps: unknown task {', '.join(map(repr, unknown))}"])
    return program


def _fault(error: Any) -> str:
    path = ""
    for part in error["loc"]:
        if part in ("Task", "Bag", "Map", "Sleep", "Untiloop", "Choice", "Signal"):
            continue  # union tags, not part of the user's document
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    message = error["msg"].removeprefix("Value error, ")
    return f"{path or 'program'}: {message}"


def program_schema() -> dict[str, Any]:
    """The JSON Schema of the program format."""
    return _PROGRAM.json_schema()
