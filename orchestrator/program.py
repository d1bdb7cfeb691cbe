"""The program format (user-facing contract): tasks, bags and untiloops, validated with pydantic."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterator
from functools import cached_property
from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin

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
    model_validator,
)

from orchestrator.conditions import (
    KEY_VARIABLES,
    MAX_SOURCE_CHARS,
    STEP_ID,
    ConditionError,
    compile_condition,
    step_references,
)
from orchestrator.documents import (  # the documents' names stay importable from here
    ProgramError,
    check_value,
    key_name,
    load,
    printable,
    short,
)

TASK_NAME = r"^[A-Za-z_][A-Za-z0-9_.:-]{0,127}$"
MAX_BAG = 1000
MAX_ITERATIONS = 100_000  # of one loop
# Parallel branches (a bag member that is a list of steps): bounds on their number in one
# bag, on the steps of one branch's own list, on how deep branches nest in branches, and on
# all of a program's branches (every branch of a bag holds a cursor of its own while it runs).
MAX_BRANCHES = 20
MAX_BRANCH_STEPS = 50
MAX_BRANCH_DEPTH = 3
MAX_PROGRAM_BRANCHES = 100
# A program's priority, given at submit: 0 (the default) to MAX_PRIORITY, higher first.
MAX_PRIORITY = 4
MAX_SLEEP_S = 30 * 86400
CHUNK = (
    "members per task message, run side by side by one worker; unset: one per message "
    "while the pool keeps up, up to SHARDFLOW_AUTO_CHUNK while its queue or the owner's "
    "shard queues have a backlog"
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


def _no_serial_compensation(name: str) -> str:
    if is_lane(name):
        raise ValueError(
            "a compensation never runs on a serial lane (a bag's compensations run side by "
            "side): name a pool of many consumers, or none"
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
_NO_LANE = Field(
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
    description="parallel, or any other name but serial and serial-*: a pool with many consumers",
)
BagPool = Annotated[str, AfterValidator(check_pool_name), AfterValidator(_no_serial_bag), _NO_LANE]
CompensationPool = Annotated[
    str, AfterValidator(check_pool_name), AfterValidator(_no_serial_compensation), _NO_LANE
]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_boolean_numbers(cls, data: Any) -> Any:
        """`true` is no number: pydantic took it for 1 (`"max_attempts": true`, one attempt)
        where the published schema says integer or number."""
        if isinstance(data, dict):
            for name, field in cls.model_fields.items():
                if isinstance(data.get(field.alias or name), bool) and _numeric(field.annotation):
                    raise ValueError(f"{name}: a boolean where a number goes")
        return data


def _numeric(annotation: Any) -> bool:
    """An int or float field, optional or not, annotated or not."""
    if get_origin(annotation) is Annotated:
        return _numeric(get_args(annotation)[0])
    if annotation in (int, float):
        return True
    return get_origin(annotation) in (Union, UnionType) and any(
        _numeric(kind) for kind in get_args(annotation)
    )


class Retry(_Model):
    """How often a failing task is tried, and how long to wait between tries."""

    max_attempts: int = Field(default=3, ge=1, le=100)
    backoff_s: float = Field(default=1.0, ge=0, le=86400)
    factor: float = Field(default=2.0, ge=1, le=10)
    max_backoff_s: float = Field(default=300.0, ge=0, le=86400)

    def delay_s(self, attempt: int) -> float:
        """The wait before attempt `attempt + 1`, after attempt `attempt` (from 0) failed."""
        return min(self.backoff_s * self.factor**attempt, self.max_backoff_s)


# Per-key concurrency limits: the most tasks of one key that may run at once, and the
# longest key a `limit.key` may give (longer, or not a string: its step fails naming it).
MAX_LIMIT = 1000
MAX_LIMIT_KEY_CHARS = 256


def _key_compiles(source: str) -> str:
    try:
        compile_condition(source, KEY_VARIABLES)
    except ConditionError as exc:
        raise ValueError(f"invalid CEL: {exc}") from None
    return source


class Limit(_Model):
    """At most `max` tasks with the same key run at once, across every worker and pool."""

    key: str = Field(
        min_length=1,
        max_length=MAX_SOURCE_CHARS,
        description="CEL over input, args and (a map's member) item, evaluated by the owner "
        f"when the task is sent: a string of 1-{MAX_LIMIT_KEY_CHARS} characters",
    )
    max: int = Field(ge=1, le=MAX_LIMIT, description="tasks of one key running at once")

    @field_validator("key")
    @classmethod
    def _check_key(cls, value: str) -> str:
        return _key_compiles(value)


MAX_ARGS_FROM = 20

# A step's name for references (`steps.<id>` in CEL): unique in its program.
StepId = Annotated[
    str,
    Field(
        pattern=STEP_ID,
        description="a name for this step, unique in the program: later steps read its output "
        "as steps.<id> in CEL (args_from, map, until, when)",
    ),
]


def _compiles_value(source: str) -> str:
    return _compiles(source)


Cel = Annotated[
    str, Field(min_length=1, max_length=MAX_SOURCE_CHARS), AfterValidator(_compiles_value)
]


class Compensate(_Model):
    """The task that undoes a task that completed (saga compensation): run when the program
    fails or is cancelled, with the output of the task it undoes as `ctx.item`."""

    task: str = Field(pattern=TASK_NAME)
    args: dict[str, Any] = Field(default_factory=dict)
    retry: Retry | None = None
    timeout_s: float | None = Field(default=None, gt=0, le=86400)
    # A bag's compensations run side by side: like a bag member's, never on a serial lane.
    pool: CompensationPool | None = None


class Member(_Model):
    """One task of a bag; it runs on the bag's pool unless it names its own (never serial)."""

    task: str = Field(pattern=TASK_NAME)
    args: dict[str, Any] = Field(default_factory=dict)
    # Arguments computed by the owner when the step starts, merged into `args`.
    args_from: dict[Annotated[str, Field(min_length=1, max_length=128)], Cel] = Field(
        default_factory=dict,
        max_length=MAX_ARGS_FROM,
        description="argument name -> CEL over input, prev, iteration and steps.<id>, "
        "evaluated when the step starts; its value (JSON, at most 64 KiB) joins args",
    )
    retry: Retry | None = None
    timeout_s: float | None = Field(default=None, gt=0, le=86400)
    pool: BagPool | None = None
    limit: Limit | None = None
    compensate: Compensate | None = Field(
        default=None,
        description="a task that undoes this one once it completed, run when the program fails "
        "or is cancelled (only on a top-level task or a top-level bag's task member)",
    )


class Task(Member):
    """A single task: the next step starts only after it finished."""

    id: StepId | None = None
    pool: PoolName = SERIAL


class Branch(_Model):
    """A bag member that is a sequence of steps (any kinds) run in order beside the bag's
    other members; its output is its last step's output. Its first step's prev is the bag's."""

    steps: list[Step] = Field(min_length=1, max_length=MAX_BRANCH_STEPS)


def _member_kind(value: Any) -> str | None:
    if isinstance(value, BaseModel):
        return type(value).__name__
    if not isinstance(value, dict):
        return None
    if "steps" in value:
        return "Branch"
    return "Member" if "task" in value else None


BagMember = Annotated[
    Annotated[Member, Tag("Member")] | Annotated[Branch, Tag("Branch")],
    Discriminator(
        _member_kind,
        custom_error_type="member_kind",
        custom_error_message="a bag member needs 'task' (a task) or 'steps' (a branch)",
    ),
]


class Bag(_Model):
    """Tasks (and branches of steps) run in parallel; a join barrier holds the program until
    all finished."""

    id: StepId | None = None
    bag: list[BagMember] = Field(min_length=1, max_length=MAX_BAG)
    # The pool of every member that does not name its own.
    pool: BagPool = PARALLEL
    # Members per task message. Above 1, one worker runs a chunk's members side by side:
    # fewer messages for bags of short tasks, less spreading for long ones. None: adaptive
    # (orchestrator/backlog.py), one per message unless the pool or the owner has a backlog.
    chunk: int | None = Field(default=None, ge=1, le=MAX_BAG, description=CHUNK)

    @field_validator("bag")
    @classmethod
    def _few_branches(cls, value: list[Member | Branch]) -> list[Member | Branch]:
        count = sum(isinstance(member, Branch) for member in value)
        if count > MAX_BRANCHES:
            raise ValueError(f"{count} branches: a bag holds at most {MAX_BRANCHES}")
        return value

    def tasks(self) -> list[tuple[int, Member]]:
        """The members that are single tasks, with their indices."""
        return [(i, m) for i, m in enumerate(self.bag) if isinstance(m, Member)]

    def branches(self) -> list[tuple[int, Branch]]:
        """The members that are branches, with their indices."""
        return [(i, m) for i, m in enumerate(self.bag) if isinstance(m, Branch)]


class Map(Member):
    """One task per item of a list computed when the step starts, run like a bag's members."""

    id: StepId | None = None
    map: str = Field(
        min_length=1,
        max_length=MAX_SOURCE_CHARS,
        description="CEL over input, prev, iteration and steps.<id> giving the list of items",
    )
    max_items: int = Field(ge=1, le=MAX_BAG, description="more items fail the step")
    chunk: int | None = Field(default=None, ge=1, le=MAX_BAG, description=CHUNK)

    @field_validator("map")
    @classmethod
    def _map_compiles(cls, value: str) -> str:
        return _compiles(value)


class Sleep(_Model):
    """A durable timer: the program waits `sleep_s`, holding no worker; its output is prev."""

    id: StepId | None = None
    sleep_s: float = Field(gt=0, le=MAX_SLEEP_S, description="seconds to wait, up to 30 days")


SIGNAL_NAME = r"^[a-z][a-z0-9_.-]{0,63}$"
# A signal's data: its step's output, carried in the shard message that takes it.
MAX_SIGNAL_BYTES = 65536


class Signal(_Model):
    """Waits, holding no worker, for a named signal sent to the program (`shardflow signal`);
    its output is the signal's data. One sent before the program gets here is kept for it."""

    id: StepId | None = None
    signal: str = Field(pattern=SIGNAL_NAME, description="the signal's name")
    timeout_s: float | None = Field(
        default=None,
        gt=0,
        le=MAX_SLEEP_S,
        description="seconds to wait before the step fails (none: wait until cancelled)",
    )


class Untiloop(_Model):
    """A body of steps repeated until `until` holds over its last output."""

    id: StepId | None = None
    until: str = Field(min_length=1, max_length=MAX_SOURCE_CHARS)
    max_iterations: int = Field(ge=1, le=MAX_ITERATIONS)
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

    id: StepId | None = None
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


_ONE_KIND = (
    "a step needs exactly one of 'task', 'bag', 'map', 'sleep_s', 'until', 'choice' or 'signal'"
)
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
        custom_error_message=_ONE_KIND,
    ),
]
Untiloop.model_rebuild()
Branch.model_rebuild()
Bag.model_rebuild()
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

    @cached_property
    def compensations(self) -> tuple[tuple[int, tuple[tuple[int | None, Compensate], ...]], ...]:
        """The top-level steps that name compensations, in step order: (step index, its
        compensations by member index, None for a task step)."""
        found: list[tuple[int, tuple[tuple[int | None, Compensate], ...]]] = []
        for n, step in enumerate(self.steps):
            if isinstance(step, Task) and step.compensate is not None:
                found.append((n, ((None, step.compensate),)))
            elif isinstance(step, Bag):
                members = tuple((i, m.compensate) for i, m in step.tasks() if m.compensate)
                if members:
                    found.append((n, members))
        return tuple(found)

    @cached_property
    def referenced(self) -> frozenset[str]:
        """The ids of steps whose output some expression reads (`steps.<id>`): only these
        are recorded when their step finishes."""
        return frozenset(
            name for _, _, names in _expressions(self.steps, "steps") for name in names
        )


def _compensations(steps: list[Step]) -> Iterator[Compensate]:
    """Every compensation a step list names (deep, for the task names and pools it adds)."""
    for step in steps:
        members = step.tasks() if isinstance(step, Bag) else [(0, step)]
        for _, member in members:
            if isinstance(member, Member) and member.compensate is not None:
                yield member.compensate
        for inner in _inner(step):
            yield from _compensations(inner)


def pool_of(step: Task | Bag | Map, index: int | None = None) -> str:
    """The pool of a single task, of bag member `index` (else the bag's own pool), or of a
    map's members (its `pool`, else parallel)."""
    if isinstance(step, Task):
        return step.pool
    if isinstance(step, Map):
        return step.pool or PARALLEL
    member = step.bag[index] if index is not None else None
    return (member.pool if isinstance(member, Member) else None) or step.pool


def _pools(steps: list[Step]) -> set[str]:
    pools: set[str] = set()
    for step in steps:
        if isinstance(step, Task | Map):
            pools.add(pool_of(step))
        elif isinstance(step, Bag):
            pools.update(pool_of(step, i) for i, _ in step.tasks())
        for inner in _inner(step):
            pools |= _pools(inner)
    return pools | {c.pool or PARALLEL for c in _compensations(steps)}


def _inner(step: Step) -> list[list[Step]]:
    """The step lists inside a step: a loop's body, a choice's cases, a bag's branches."""
    if isinstance(step, Untiloop):
        return [step.steps]
    if isinstance(step, Choice):
        return step.branches()
    if isinstance(step, Bag):
        return [branch.steps for _, branch in step.branches()]
    return []


def _signals(steps: list[Step]) -> set[str]:
    names: set[str] = set()
    for step in steps:
        if isinstance(step, Signal):
            names.add(step.signal)
        for inner in _inner(step):
            names |= _signals(inner)
    return names


def _names(steps: list[Step]) -> set[str]:
    names: set[str] = set()
    for step in steps:
        if isinstance(step, Task | Map):
            names.add(step.task)
        elif isinstance(step, Bag):
            names.update(member.task for _, member in step.tasks())
        for inner in _inner(step):
            names |= _names(inner)
    return names | {c.task for c in _compensations(steps)}


_PROGRAM = TypeAdapter(Program)


def parse_program(
    source: str | bytes | dict[str, Any],
    *,
    max_bytes: int = 256 * 1024,
    known_tasks: set[str] | None = None,
    known_pools: frozenset[str] | None = None,
) -> Program:
    """Validate a program from JSON text or a dict; raise ProgramError naming each fault's path.
    `known_tasks`, `known_pools`: the only task names and pools it may use (None: any)."""
    if isinstance(source, str | bytes):
        source = load(source, "program", max_bytes)
    else:
        check_value(source, "program", max_bytes)
    try:
        program = _PROGRAM.validate_python(source)
    except ValidationError as exc:
        errors = exc.errors()
        # A key's hint costs a fuzzy match: only the first few (a program may hold thousands).
        extra = [n for n, err in enumerate(errors) if err["type"] == "extra_forbidden"]
        hinted = set(extra[:MAX_UNKNOWN_NAMED])
        raise ProgramError([_fault(err, n in hinted) for n, err in enumerate(errors)]) from None
    faults = check_branches(program) + check_references(program) + check_compensations(program)
    if faults:
        raise ProgramError(faults)
    if known_tasks is not None and program.task_names() - known_tasks:
        raise ProgramError(_unknown_tasks(program, known_tasks))
    if known_pools is not None and program.pools() - known_pools:
        raise ProgramError(_unknown_pools(program, known_pools))
    return program


MAX_UNKNOWN_NAMED = 10  # a program of many unknown tasks still gets a short error


def _unknown_tasks(program: Program, known: set[str]) -> list[str]:
    """Each unknown task name once, at the path of its first use in the document."""
    tasks = (task for task, _ in _leaf_paths(program.steps, "steps"))
    return _unknown(tasks, known, "unknown task {!r}", "unknown tasks")


def _unknown_pools(program: Program, known: frozenset[str]) -> list[str]:
    """Each pool not in SHARDFLOW_POOLS once, at the path of its first use in the document."""
    named = ", ".join(sorted(known - {SERIAL, PARALLEL})) or "none"
    fault = f"pool {{!r}} is not one of SHARDFLOW_POOLS ({named}; serial and parallel always are)"
    pools = (pool for _, pool in _leaf_paths(program.steps, "steps"))
    return _unknown(pools, known, fault, "unknown pools")


def _unknown(
    uses: Iterator[tuple[str, str]], known: set[str] | frozenset[str], fault: str, more: str
) -> list[str]:
    """`<path>: <fault with the name>` for each name not known, at its first use; at most
    MAX_UNKNOWN_NAMED, then how many `more`."""
    first: dict[str, str] = {}
    for path, name in uses:
        if name not in known:
            first.setdefault(name, path)
    faults = [f"{path}: {fault.format(name)}" for name, path in first.items()]
    left = len(faults) - MAX_UNKNOWN_NAMED
    return faults[:MAX_UNKNOWN_NAMED] + ([f"and {left} more {more}"] if left > 0 else [])


def _leaf_paths(
    steps: list[Step], prefix: str
) -> Iterator[tuple[tuple[str, str], tuple[str, str]]]:
    """For every task a step list runs, compensations too, deep: ((document path of its
    `task` field, the name), (path of the `pool` field that sends it there, the pool))."""
    for n, step in enumerate(steps):
        path = f"{prefix}[{n}]"
        members: list[tuple[str, Member, str, str]] = []  # path, member, pool's path, pool
        if isinstance(step, Task | Map):
            members = [(path, step, f"{path}.pool", pool_of(step))]
        elif isinstance(step, Bag):
            for i, member in step.tasks():
                where = f"{path}.bag[{i}]"
                named = f"{where}.pool" if member.pool else f"{path}.pool"
                members.append((where, member, named, pool_of(step, i)))
        for where, member, pool_path, pool in members:
            yield (f"{where}.task", member.task), (pool_path, pool)
            if member.compensate is not None:
                yield (
                    (f"{where}.compensate.task", member.compensate.task),
                    (f"{where}.compensate.pool", member.compensate.pool or PARALLEL),
                )
        for inner, inner_path in _branches(step, path):
            yield from _leaf_paths(inner, inner_path)


# --- saga compensation ---------------------------------------------------------------------


def check_compensations(program: Program) -> list[str]:
    """The faults of compensations named where none can run, each naming its path: only a
    top-level task, or a task member of a top-level bag, may name one (its output is kept
    where the compensation reads it; a loop, a choice or a branch keeps no such place)."""
    faults: list[str] = []

    def walk(steps: list[Step], prefix: str, top: bool) -> None:
        for n, step in enumerate(steps):
            path = f"{prefix}[{n}]"
            if isinstance(step, Map) and step.compensate is not None:
                faults.append(f"{path}.compensate: a map's members cannot be compensated")
            elif isinstance(step, Task) and step.compensate is not None and not top:
                faults.append(f"{path}.compensate: {_WHERE}")
            elif isinstance(step, Bag) and not top:
                for i, member in step.tasks():
                    if member.compensate is not None:
                        faults.append(f"{path}.bag[{i}].compensate: {_WHERE}")
            for inner, inner_path in _branches(step, path):
                walk(inner, inner_path, False)

    walk(program.steps, "steps", True)
    return faults


_WHERE = "only a top-level task or a top-level bag's task member may name a compensation"


# --- step references ---------------------------------------------------------------------


def _branches(step: Step, path: str) -> list[tuple[list[Step], str]]:
    """The step lists inside a step, with their paths in the document."""
    if isinstance(step, Untiloop):
        return [(step.steps, f"{path}.steps")]
    if isinstance(step, Choice):
        found = [(case.steps, f"{path}.choice[{k}].steps") for k, case in enumerate(step.choice)]
        return found + ([(step.otherwise, f"{path}.otherwise")] if step.otherwise else [])
    if isinstance(step, Bag):
        return [(branch.steps, f"{path}.bag[{i}].steps") for i, branch in step.branches()]
    return []


def check_branches(program: Program) -> list[str]:
    """The faults of a program's parallel branches, each naming its path: branches nested
    deeper than MAX_BRANCH_DEPTH, or more than MAX_PROGRAM_BRANCHES in all."""
    faults: list[str] = []
    total = 0

    def walk(steps: list[Step], prefix: str, depth: int) -> None:
        nonlocal total
        for n, step in enumerate(steps):
            path = f"{prefix}[{n}]"
            inside = depth
            if isinstance(step, Bag) and step.branches():
                inside = depth + 1
                total += len(step.branches())
                if inside > MAX_BRANCH_DEPTH:
                    faults.append(
                        f"{path}.bag: branches nested {inside} deep, at most {MAX_BRANCH_DEPTH}"
                    )
                    continue
            for inner, inner_path in _branches(step, path):
                walk(inner, inner_path, inside)

    walk(program.steps, "steps", 0)
    if total > MAX_PROGRAM_BRANCHES:
        faults.append(f"steps: {total} branches in all, at most {MAX_PROGRAM_BRANCHES}")
    return faults


def _own_expressions(step: Step, path: str) -> Iterator[tuple[str, str]]:
    """The CEL a step evaluates when it starts: (document path, source)."""
    if isinstance(step, Task | Map):
        for name, source in step.args_from.items():
            yield f"{path}.args_from.{key_name(name)}", source
    if isinstance(step, Map):
        yield f"{path}.map", step.map
    if isinstance(step, Bag):
        for i, member in step.tasks():
            for name, source in member.args_from.items():
                yield f"{path}.bag[{i}].args_from.{key_name(name)}", source
    if isinstance(step, Choice):
        for k, case in enumerate(step.choice):
            yield f"{path}.choice[{k}].when", case.when


def _expressions(steps: list[Step], prefix: str) -> Iterator[tuple[str, str, frozenset[str]]]:
    """Every CEL expression of a step list, deep: (document path, source, ids it names)."""
    for n, step in enumerate(steps):
        path = f"{prefix}[{n}]"
        for where, source in _own_expressions(step, path):
            yield where, source, step_references(source)
        if isinstance(step, Untiloop):
            yield f"{path}.until", step.until, step_references(step.until)
        for inner, inner_path in _branches(step, path):
            yield from _expressions(inner, inner_path)


def check_references(program: Program) -> list[str]:
    """Every fault of the program's step ids and references, each naming its path: a
    duplicate id, an argument in both args and args_from, a reference to an unknown id or to a
    step that cannot have finished before the expression runs. A step may read the steps
    before it in its own list and in the lists of the steps that enclose it; an `until`, and
    every step after a loop, also read the steps of its body's own list (the body ran at
    least once; its last run's outputs count); every step after a bag reads the steps of
    each of its branches' own lists (the join waited for them). A branch never reads
    another branch of its bag: they run side by side."""
    ids: dict[str, str] = {}  # id -> path of the step carrying it
    faults: list[str] = []

    def collect(steps: list[Step], prefix: str) -> None:
        for n, step in enumerate(steps):
            path = f"{prefix}[{n}]"
            if step.id is not None:
                if step.id in ids:
                    faults.append(f"{path}.id: id {step.id!r} is also the id of {ids[step.id]}")
                else:
                    ids[step.id] = path
            members: list[tuple[int, Member]] = (
                step.tasks()
                if isinstance(step, Bag)
                else [(0, step)]
                if isinstance(step, Task | Map)
                else []
            )
            for i, member in members:
                where = f"{path}.bag[{i}]" if isinstance(step, Bag) else path
                for name in sorted(set(member.args) & set(member.args_from)):
                    faults.append(
                        f"{where}.args_from.{key_name(name)}: also in args; give it in one"
                    )
            for inner, inner_path in _branches(step, path):
                collect(inner, inner_path)

    def check(where: str, source: str, visible: frozenset[str]) -> None:
        for name in sorted(step_references(source)):
            if name not in ids:
                faults.append(f"{where}: unknown step id {name!r}")
            elif name not in visible:
                faults.append(
                    f"{where}: step {name!r} ({ids[name]}) cannot have finished before this "
                    "runs (only earlier steps of this list or of an enclosing one can)"
                )

    def walk(steps: list[Step], prefix: str, visible: frozenset[str]) -> None:
        for n, step in enumerate(steps):
            path = f"{prefix}[{n}]"
            for where, source in _own_expressions(step, path):
                check(where, source, visible)
            for inner, inner_path in _branches(step, path):
                walk(inner, inner_path, visible)
            if isinstance(step, Bag):  # every branch ran to its end: its own list's steps
                for _, branch in step.branches():
                    visible = visible | {s.id for s in branch.steps if s.id is not None}
            if isinstance(step, Untiloop):  # after each run of the body
                body = frozenset(s.id for s in step.steps if s.id is not None)
                check(f"{path}.until", step.until, visible | body)
                visible = visible | body  # the body ran at least once: its last run's
            if step.id is not None:
                visible = visible | {step.id}

    collect(program.steps, "steps")
    walk(program.steps, "steps", frozenset())
    return faults


_TAGS = ("Task", "Bag", "Map", "Sleep", "Untiloop", "Choice", "Signal", "Member", "Branch")


def _fields(model: type[BaseModel]) -> list[str]:
    return [field.alias or name for name, field in model.model_fields.items()]


# Every field of any part of a program: what an unknown key of an untagged part is matched to.
_ALL_FIELDS = sorted(
    {
        name
        for model in (Program, Retry, Limit, Compensate, Case, *(globals()[t] for t in _TAGS))
        for name in _fields(model)
    }
)


def _fault(error: Any, hinted: bool = False) -> str:
    path = ""
    for part in error["loc"]:
        if part in _TAGS:
            continue  # union tags, not part of the user's document
        # A key can be the document's own (an unknown field, an argument's name): never raw.
        name = str(part) if isinstance(part, int) else key_name(part)
        path += f"[{name}]" if isinstance(part, int) else (f".{name}" if path else name)
    # pydantic's message can repeat a value of the document (CEL's error, its source's).
    message = printable(error["msg"].removeprefix("Value error, "))
    if error["type"] == "model_type":  # pydantic names its class: "instance of Program"
        message = f"a JSON object, not {_json_kind(error['input'])}"
    elif error["type"] == "step_kind":
        message = _kind_fault(error["input"])
    elif error["type"] == "extra_forbidden" and hinted:
        message += _extra_hint(error["loc"])
    return f"{path or 'program'}: {message}"


def _extra_hint(loc: tuple[Any, ...]) -> str:
    """For a key no field has: the field it is close to (of its step's kind where the path
    says it, else of any part of a program), or, at the top, that a program holds its steps
    in a list."""
    key = loc[-1]
    if not isinstance(key, str):
        return ""
    if len(loc) == 1 and key in _KINDS:  # a file holding one step, not a program
        return ': a program is {"steps": [STEP, ...]}'
    tagged = len(loc) > 1 and loc[-2] in _TAGS
    names = _fields(globals()[loc[-2]]) if tagged else _ALL_FIELDS
    close = difflib.get_close_matches(key[:40], names, n=1, cutoff=0.7)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _kind_fault(step: Any) -> str:
    """Why a step has no kind, naming what it holds instead: the kinds that clash, or the
    keys that are none (with the kind each is close to), at most MAX_UNKNOWN_NAMED of them."""
    if not isinstance(step, dict):
        return f"a JSON object, not {_json_kind(step)}"
    kinds = [key for key in _KINDS if key in step]
    if len(kinds) > 1:  # task and map together are a map: not here
        both = ", ".join(repr(key) for key in kinds[:-1]) + f" and {kinds[-1]!r}"
        return f"{both} in one step: {_ONE_KIND}"
    if not step:
        return f"an empty step: {_ONE_KIND}"
    named = []
    for key in list(step)[:MAX_UNKNOWN_NAMED]:
        close = difflib.get_close_matches(key[:40], _KINDS, n=1, cutoff=0.6)
        named.append(short(key) + (f" (did you mean {close[0]!r}?)" if close else ""))
    return f"no kind among {', '.join(named)}: {_ONE_KIND}"


def _json_kind(value: Any) -> str:
    kinds = {list: "a list", str: "a string", bool: "true or false", type(None): "null"}
    return kinds.get(type(value), "a number")


def program_schema() -> dict[str, Any]:
    """The JSON Schema of the program format."""
    return _PROGRAM.json_schema()
