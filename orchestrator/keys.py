"""Names in Redis and RabbitMQ, all derived from one prefix.

Every Redis key of a program carries the hash tag `{<workflow_id>}`, so a program's keys share
one Redis Cluster slot and every Lua script stays cluster-safe.
"""

from __future__ import annotations

import hashlib
import re
import uuid
from dataclasses import dataclass

# `$` also matches before a trailing newline in Python, so ids are checked with fullmatch; the
# pattern stays `^...$` for pydantic (messages.py), whose Rust regex has no `\Z` and whose `$`
# is the end of the text.
MAX_WORKFLOW_ID = 128
WORKFLOW_ID = re.compile(rf"^[A-Za-z0-9][A-Za-z0-9._:@-]{{0,{MAX_WORKFLOW_ID - 1}}}$")


def check_workflow_id(workflow_id: str) -> str:
    """Return the id, or raise ValueError saying what an id may hold, quoting at most one
    character more than an id may have (it may have 500,000: the error is logged)."""
    if not WORKFLOW_ID.fullmatch(workflow_id):
        shown = workflow_id[: MAX_WORKFLOW_ID + 1]
        more = f" ({len(workflow_id)} characters)" if len(workflow_id) > len(shown) else ""
        raise ValueError(
            f"workflow id {shown!r}{more}: use 1-{MAX_WORKFLOW_ID} of A-Z a-z 0-9 . _ : @ -, "
            "starting with a letter or digit"
        )
    return workflow_id


@dataclass(frozen=True, slots=True)
class Keys:
    """Redis key names for one prefix."""

    prefix: str

    def state(self, wf: str) -> str:
        return f"{self.prefix}:{{{wf}}}:state"

    def plan(self, wf: str) -> str:
        return f"{self.prefix}:{{{wf}}}:plan"

    def output(self, wf: str, path: str, index: int | None = None) -> str:
        member = "" if index is None else f"/bag:{index}"
        return f"{self.prefix}:{{{wf}}}:out:{path}{member}"

    def failures(self, wf: str, path: str) -> str:
        return f"{self.prefix}:{{{wf}}}:err:{path}"

    def barrier(self, wf: str, path: str) -> str:
        return f"{self.prefix}:{{{wf}}}:bar:{path}"

    def started(self, wf: str, path: str) -> str:
        """The members of a step that names compensations whose latest attempt started and has
        not ended, with that attempt (lua/begin.lua)."""
        return f"{self.prefix}:{{{wf}}}:started:{path}"

    def blob(self, wf: str, name: str) -> str:
        """A large value a task message refers to: `input`, or the `prev` of the leaf at a path."""
        return f"{self.prefix}:{{{wf}}}:blob:{name}"

    def signals(self, wf: str, name: str) -> str:
        """The signals of one name sent to the program and not yet taken (a list, oldest first)."""
        return f"{self.prefix}:{{{wf}}}:sig:{name}"

    def signal_ids(self, wf: str) -> str:
        """The ids of the signals sent to the program (the latest ones), so a resend is no
        second signal."""
        return f"{self.prefix}:{{{wf}}}:sigids"

    def ref(self, wf: str, step_id: str) -> str:
        """The output of the step with this `id`, which other steps read as `steps.<id>`
        (recorded by advance.lua as the program moves past it; in a loop, the latest)."""
        return f"{self.prefix}:{{{wf}}}:ref:{step_id}"

    def branch(self, wf: str, scope: str) -> str:
        """A parallel branch's own cursor (`scope`: `2/branch:1`, member 1 of the bag at
        step 2): a hash of cursor, from, leaf and updated_ms, as the state holds the
        program's (written by advance.lua)."""
        return f"{self.prefix}:{{{wf}}}:cur:{scope}"

    def registry(self, wf: str) -> str:
        """The set of the program's keys beyond state and plan, written by the scripts that
        create them, so ending a program can expire them all and a loop can prune old
        iterations without SCAN."""
        return f"{self.prefix}:{{{wf}}}:keys"

    def live(self, shard: int) -> str:
        """The set of programs a shard owns that have not ended (not per program: no hash tag)."""
        return f"{self.prefix}:live:{shard}"

    def attempts(self, wf: str) -> str:
        """Failed attempts the owner saw, for inspection: `<path>[/bag:<i>]` -> JSON
        `{"attempt", "due_ms"}` (when the retry is due; null when none follows)."""
        return f"{self.prefix}:{{{wf}}}:attempts"

    @property
    def index_created(self) -> str:
        """Every program by creation time (sorted set, score ms; one key, never in a script)."""
        return f"{self.prefix}:index:created"

    @property
    def index_ended(self) -> str:
        """Programs that ended, by when (sorted set, score ms; kept while a retention applies):
        when their keys expire, the prune drops them from `index_created` (marks.py)."""
        return f"{self.prefix}:index:ended"

    @property
    def serial_lane(self) -> str:
        """`<wf> <path> <task> <ms> <attempt>` of the serial task started last (for
        `explain`; a release before this one wrote no attempt)."""
        return self.lane("serial")

    def lane(self, pool: str) -> str:
        """The same for any serial lane (`serial`, `serial-<name>`)."""
        return f"{self.prefix}:lane:{pool}"

    def limit(self, key: str) -> str:
        """The holders of a per-key limit's slots (sorted set: holder -> lease expiry ms).
        Named by the key's digest: any characters, and a hash tag of its own (one Redis
        Cluster slot per key, apart from every program's)."""
        digest = hashlib.sha256(key.encode()).hexdigest()[:32]
        return f"{self.prefix}:limit:{{{digest}}}"

    def limit_waits(self, wf: str) -> str:
        """Tasks of the program that found no free slot, for `explain`: `<path>[/bag:<i>]` ->
        JSON `{"key", "max", "held", "waits", "at_ms"}`; removed when the task gets a slot."""
        return f"{self.prefix}:{{{wf}}}:limits"

    def shard_owner(self, shard: int) -> str:
        """`<host>/<pid> <ms>` of the process that last handled a message of the shard."""
        return f"{self.prefix}:owner:{shard}"

    @property
    def shards_used(self) -> str:
        """Every shard that ever owned a program, so a shard outside the ring can be drained."""
        return f"{self.prefix}:shards"

    def pattern(self, wf: str) -> str:
        """Every key of one program, for SCAN."""
        return f"{self.prefix}:{{{wf}}}:*"


@dataclass(frozen=True, slots=True)
class Names:
    """RabbitMQ exchange and queue names for one prefix."""

    prefix: str

    @property
    def orchestrator_exchange(self) -> str:
        return f"{self.prefix}.orchestrator"

    def shard_queue(self, shard: int) -> str:
        return f"{self.prefix}.orchestrator.{shard}"

    def task_queue(self, pool: str) -> str:
        return f"{self.prefix}.tasks.{pool}"

    def delay_queue(self, target: str, delay_ms: int) -> str:
        """Where a message waits `delay_ms` before it goes to `target`: a pool (its retry
        queue), `shard<N>.queue` (a shard's timers) or, before that, `shard<N>`, or
        `control.exchange` (a control notice's repeat)."""
        return f"{self.prefix}.delay.{target}.{delay_ms}"

    @property
    def ingress_queue(self) -> str:
        return f"{self.prefix}.ingress"

    @property
    def control_exchange(self) -> str:
        return f"{self.prefix}.control"

    def control_queue(self) -> str:
        """A process's own queue on the control exchange: a new name each call, under the
        prefix, so a user allowed only the prefix's names may declare it."""
        return f"{self.prefix}.control.{uuid.uuid4().hex}"

    @property
    def dead_exchange(self) -> str:
        return f"{self.prefix}.dead"

    @property
    def dead_queue(self) -> str:
        return f"{self.prefix}.dead"
