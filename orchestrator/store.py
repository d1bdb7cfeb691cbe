"""The store boundary: what the engine, the router and the workers need from program state.

Two implementations follow the same contract: `RedisStore` (the Lua scripts in `lua/`, the
real thing) and `MemoryStore` (a pure-Python model of those scripts: their executable
specification, and a store for tests that need no Redis).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from orchestrator.keys import Keys

TERMINAL = frozenset({"completed", "failed", "cancelled", "compensated", "compensation_failed"})
# The state fields a sweep reads of each live program (Store.brief).
BRIEF = ("status", "owner", "created_ms", "updated_ms")
# Live statuses: a program in them may still move (compensating: its compensations run).
LIVE = frozenset({"pending", "running", "compensating"})


@dataclass(frozen=True, slots=True)
class Verdict:
    """What a transition script decided, and the program's status and cursor after it."""

    verdict: str
    status: str
    cursor: str
    # A branch's end (now, or before: a replay) found every member of its bag finished.
    joined: bool = False
    # An applied advance: ms since the moving cursor reached the leaf it left (Redis's clock).
    elapsed_ms: int | None = None


# A report may name at most this many attempts (lua/fail.lua has the same bound).
MAX_ATTEMPTS = 100
# Signals of one name a program keeps before its step takes them; signal ids it remembers.
MAX_SIGNALS_WAITING = 100
MAX_SIGNAL_IDS = 1000
# A redriven program keeps the records of this many of its ended runs (lua/redrive.lua).
MAX_RUNS = 20


@dataclass(frozen=True, slots=True)
class Recorded:
    """What submit found: whether it created the program, its status and owner shard; with
    `conflict`, the id exists with another program or input (and nothing changed)."""

    created: bool
    status: str
    owner: int
    conflict: bool = False


@dataclass(frozen=True, slots=True)
class Ended:
    """What cancel found: whether this call ended the program, its status and owner shard;
    `stale`: a deadline of an earlier run (before a redrive), which ends nothing."""

    now: bool
    status: str
    owner: int
    stale: bool = False


@dataclass(frozen=True, slots=True)
class Redriven:
    """What redrive found: `applied` (a new run, pending), `refused` (live or completed),
    `changed` (ended in another epoch than the caller read) or `missing`; the status, epoch
    and owner shard after it."""

    verdict: Literal["applied", "refused", "changed", "missing"]
    status: str
    epoch: int
    owner: int


@dataclass(frozen=True, slots=True)
class Completion:
    """A task's completion as recorded; `fire` and `again` carry every output (JSON) of the step,
    `exhausted` every attempt's error, `invalid` the reason a report was refused, `go` the
    members to run (lua/begin.lua). `late`: recorded for a program compensating from its step."""

    verdict: Literal[
        "fire", "again", "wait", "stale", "retry", "exhausted", "missing", "invalid", "late", "go"
    ]
    outputs: list[str]


@dataclass(frozen=True, slots=True)
class Slot:
    """What a per-key limit's script answered: acquired, held, busy (acquire), renewed, lost
    (renew), released, gone (release); how many hold a slot of the key now; for busy, how
    long the first lease has left (ms, by the Redis server's clock)."""

    verdict: Literal["acquired", "held", "busy", "renewed", "lost", "released", "gone"]
    held: int = 0
    left_ms: int | None = None


@dataclass(frozen=True, slots=True)
class Stored:
    """A step's recorded outputs read back: `values` in bag order (None when one is missing or
    together they are over the reader's limit), and their size in bytes."""

    values: list[str] | None
    total: int


class Store(Protocol):
    """Program state: five compare-and-advance transitions, plus plain reads and the shard sets.

    Every transition is atomic and idempotent: a duplicate call changes nothing and answers
    what the first one did (see each script's header in `lua/`).
    """

    keys: Keys

    async def load_scripts(self) -> None:
        """Prepare the transitions (a no-op where there is nothing to load)."""

    async def close(self) -> None: ...

    async def submit(self, wf: str, plan: str, owner: int, name: str, digest: str) -> Recorded:
        """Record a new program once, or report the one that exists (lua/submit.lua)."""
        ...

    async def advance(
        self,
        wf: str,
        expected: str,
        cursor: str,
        status: str,
        field: str = "",
        payload: str = "",
        leaf: str = "",
        drop: str = "",
        refs: Sequence[tuple[str, str]] = (),
        epoch: int | None = None,
        scope: str = "",
        opened: Sequence[tuple[str, str, str]] = (),
        output: str | None = None,
    ) -> Verdict:
        """Compare-and-advance the cursor: applied, replay, stale or missing (lua/advance.lua).
        `scope`: the parallel branch whose cursor moves ("": the program's); in a branch,
        running with the cursor "" ends it, `payload` its output in its bag's barrier
        (`joined` when that filled the barrier). `opened`: the branch cursors the new leaf
        opens (scope, first leaf, its shape).
        `epoch`: the run the message belongs to (None: a start, any run); another is stale.
        `leaf` is the new leaf's shape (`task`, `bag:<size>`, "" at the end); `drop` a loop
        iteration whose keys go (a path prefix such as `3/iter:4/`); `refs` the outputs (id,
        JSON) of steps that other steps read, recorded only if the advance applies; `output` the
        finished single task's own output (JSON, at `out:<expected>`), recorded (latest wins)
        only if it applies: the owner records what its transition used. When the program
        ends, every key it owns gets the store's retention."""
        ...

    async def record(
        self,
        wf: str,
        path: str,
        size: int,
        outputs: Mapping[int | None, str],
        epoch: int = 0,
    ) -> Completion:
        """Record a single task's output (key None) or bag members' (keys: their indices):
        fire, again, wait, stale, missing or invalid (lua/complete.lua). A task of another
        run (`epoch`) than the program's is stale."""
        ...

    async def fail(
        self,
        wf: str,
        path: str,
        index: int | None,
        attempt: int,
        error: str,
        max_attempts: int,
        epoch: int = 0,
    ) -> Completion:
        """Record a failed attempt once: retry, exhausted, again, stale, missing or invalid
        (lua/fail.lua)."""
        ...

    async def cancel(
        self,
        wf: str,
        status: str,
        reason: str,
        epoch: int | None = None,
        compensates: bool = False,
        stop: bool = False,
    ) -> Ended | None:
        """End a live program now; None when there is no such program (lua/cancel.lua).
        With `epoch` (a deadline's run), a program in another run is left as it is. With
        `compensates` (the program names compensations) it becomes compensating instead. A
        compensating program is left so (`ended`) unless `stop`: then its compensations
        stop and it ends compensation_failed."""
        ...

    async def redrive(
        self, wf: str, epoch: int, rerun: str, prior: str, record: str, roots: list[str]
    ) -> Redriven:
        """Open a failed or cancelled program for a new run (lua/redrive.lua): the ended run's
        `record` kept, the keys of the steps at or under `roots` gone, every expiry removed;
        pending, so that its owner's start runs `rerun` with the output of `prior`."""
        ...

    async def at(self, wf: str, path: str) -> dict[str, str]:
        """The program's state as a leaf at `path` sees it: in a parallel branch, with the
        branch's cursor, from, leaf and updated_ms in place of the program's."""
        ...

    async def leaf_outputs(self, wf: str, leaves: list[tuple[str, int | None]]) -> list[str | None]:
        """The recorded outputs (JSON) of these leaves or bag members, None where there is
        none (one read)."""
        ...

    async def members(self, wf: str, path: str) -> int:
        """How many members of the bag or map at `path` finished (its barrier's size)."""
        ...

    async def begin(
        self, wf: str, path: str, indexes: list[int], epoch: int = 0, attempt: int = 0
    ) -> Completion:
        """Tasks of a step that names compensations start (lua/begin.lua): `go` with the
        indexes to run (as text), stale (with the status and cursor), missing or invalid."""
        ...

    async def started(self, wf: str, path: str) -> int:
        """How many members of the step at `path` started and have not ended (lua/begin.lua):
        its compensations wait for them."""
        ...

    async def stash(self, wf: str, blobs: Mapping[str, str]) -> bool:
        """Keep large values under the program (names: `input`, or a leaf's path for its prev);
        False when the program has ended or does not exist (lua/stash.lua)."""
        ...

    async def blobs(self, wf: str, names: list[str]) -> list[str | None]:
        """The stashed values, None where one is missing."""
        ...

    async def signal(self, wf: str, name: str, data: str, signal_id: str = "") -> Verdict:
        """Keep a signal for the program's step waiting for `name` (lua/signal.lua): verdict
        kept (status: how many wait now), duplicate, full, ended (status) or missing."""
        ...

    async def take(self, wf: str, path: str, name: str, epoch: int | None = None) -> str:
        """The signal step at `path` takes its signal (lua/take.lua): taken, waiting, stale
        (`epoch` given: also when the program is in another run) or missing."""
        ...

    async def acquire(
        self, key: str, holder: str, most: int, lease_ms: int, now_ms: int | None = None
    ) -> Slot:
        """Take a slot of a per-key limit if fewer than `most` hold one, dropping run-out
        leases first (lua/acquire.lua); `now_ms` None: the Redis server's clock."""
        ...

    async def renew(self, key: str, holder: str, lease_ms: int, now_ms: int | None = None) -> Slot:
        """Start a holder's lease again, unless it was dropped: renewed or lost (lua/renew.lua)."""
        ...

    async def release(self, key: str, holder: str) -> Slot:
        """Give a holder's slot back: released or gone (lua/release.lua)."""
        ...

    async def refs(self, wf: str, ids: list[str]) -> dict[str, str]:
        """The recorded outputs (JSON) of the steps with these ids; those not recorded are
        missing."""
        ...

    async def outputs(self, wf: str, path: str, size: int | None, limit: int) -> Stored:
        """A step's recorded outputs (a single task: size None), unless over `limit` bytes."""
        ...

    async def purge(self, wf: str, statuses: str, ended_before_ms: int) -> str:
        """Delete an ended program now: purged, live, kept or missing (lua/purge.lua)."""
        ...

    async def purge_many(
        self, wfs: Sequence[str], statuses: str, ended_before_ms: int
    ) -> list[str]:
        """`purge` each of `wfs`, sent together (a page: pipelined): what each found."""
        ...

    async def now(self) -> float:
        """Seconds since the epoch on Redis's clock (TIME): the clock of every time a program's
        state keeps, so what is compared with them (orchestrator/clock.py)."""
        ...

    async def ends(self, wfs: Sequence[str]) -> list[tuple[str | None, str | None]]:
        """Each program's status and ended_ms (None: no such program, or not ended), read
        together: what `purge_verdict` needs."""
        ...

    def programs(self) -> AsyncIterator[str]:
        """The id of every program in the store (SCAN: for maintenance, not a hot path)."""
        ...

    async def track(self, wf: str, owner: int) -> None:
        """Count a program as in flight on its owner shard (before it is recorded)."""

    async def untrack(self, wf: str, owner: int) -> None:
        """The program ended: idempotent, so every redelivery of its end may call it."""

    async def in_flight(self, shard: int) -> int: ...

    def live(self, shard: int) -> AsyncIterator[str]:
        """The ids of the programs counted in flight on a shard, in batches (SSCAN)."""
        ...

    async def live_page(self, shard: int, cursor: str, count: int) -> tuple[str, list[str]]:
        """One step of a scan of those ids (SSCAN): about `count` of them, and the cursor to go
        on from ("0" starts a scan, and ends it: the ids present all along were all seen)."""
        ...

    async def shards_used(self) -> set[int]: ...

    async def plan(self, wf: str) -> dict[str, Any] | None:
        """The recorded program, input and owner."""
        ...

    async def state(self, wf: str) -> dict[str, str]:
        """The program's state hash (empty when there is no such program)."""
        ...

    async def brief(self, wf: str) -> dict[str, str]:
        """The state's BRIEF fields that it has (empty when there is no such program): what
        an owner's sweep reads of every live program, cheaper than the whole hash."""
        ...


def purge_verdict(
    status: str | None, ended_ms: str | None, statuses: Collection[str], ended_before_ms: int
) -> str:
    """What lua/purge.lua decides for a program of this status and ended_ms: purged (it may
    go), live, kept (its status or age does not match) or missing."""
    if status is None:
        return "missing"
    if status in LIVE:
        return "live"
    try:  # as Lua's tonumber: anything else is no time
        ended = float(ended_ms) if ended_ms is not None else None
    except ValueError:
        ended = None
    if status not in statuses or ended is None or ended > ended_before_ms:
        return "kept"
    return "purged"


def reopened(found: list[str | None], owner: int) -> bool:
    """Whether a program `untrack` just stopped counting on `owner` is live there again
    ([status, owner] read after): redriven since its caller read it ended. Every caller
    untracks an ended program, or one another shard owns."""
    status, found_owner = found
    return status is not None and status not in TERMINAL and found_owner == str(owner)
