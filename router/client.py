"""The router: validates and records programs, picks their owner shard, and answers status."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from orchestrator.bus import NEW, Bus, Publisher
from orchestrator.caches import ByText, Lru, json_bytes
from orchestrator.documents import check_input, check_value
from orchestrator.ending import end_program
from orchestrator.keys import check_workflow_id
from orchestrator.marks import Marks
from orchestrator.messages import Signalled, Start, encode
from orchestrator.program import (
    MAX_PRIORITY,
    MAX_SIGNAL_BYTES,
    SIGNAL_NAME,
    Program,
    ProgramError,
    parse_program,
)
from orchestrator.settings import Settings
from orchestrator.store import TERMINAL, Store
from router import explain as explaining
from router import listing, redriving
from router.hashing import shard_for

# Plans a router keeps read (for signals), at most, and their bytes
# (`caches.json_bytes`): a plan may hold a program and an input at their limits, 2 MB read.
PLANS_KEPT = 256
PLAN_BYTES_KEPT = 16 << 20

SIGNAL_PATTERN = re.compile(SIGNAL_NAME)
MAX_SIGNAL_ID = 200
# A cancel of a compensating program changes nothing: said in its answer (and by the CLI).
COMPENSATING_NOTE = (
    "the program is compensating: this cancel changed nothing, its compensations go on "
    "(`shardflow cancel --stop-compensations` stops them: it ends compensation_failed)"
)

Progress = Callable[[dict[str, Any]], Awaitable[None] | None]


@dataclass(frozen=True, slots=True)
class Submitted:
    """The program's id, its owner shard, and whether this call created it."""

    workflow_id: str
    shard: int
    created: bool
    status: str


class NoProgram(LookupError):
    """No program of this id (a LookupError, as callers caught before it had a name)."""

    def __init__(self, workflow_id: str) -> None:
        super().__init__(f"no program {workflow_id!r}")


class Router:
    """Submit programs and read their status; uses a store and a bus owned by the caller.

    Without a bus the router can only read (status, wait).
    """

    def __init__(
        self,
        settings: Settings,
        *,
        store: Store,
        bus: Publisher | None = None,
        known_tasks: set[str] | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.bus = bus
        self.known_tasks = known_tasks
        self._marks = Marks(store)
        # Immutable once recorded: read once per program, the last used kept.
        self._plans: Lru[str, Any] = Lru(PLANS_KEPT, PLAN_BYTES_KEPT)
        # A program submitted again (the common case) is validated once: it, and its JSON.
        self._validated = ByText(self._validate, exact=True)

    def validate(self, program: Program | str | bytes | dict[str, Any]) -> Program:
        """The program, validated; raises ProgramError naming each fault's path. The same
        program given again is the same (frozen) Program."""
        return self._checked(program)[0]

    def _checked(
        self, program: Program | str | bytes | dict[str, Any]
    ) -> tuple[Program, dict[str, Any]]:
        """The program validated, and as it is recorded."""
        if isinstance(program, Program):
            return program, program.model_dump(mode="json", exclude_defaults=True)
        if isinstance(program, str | bytes) and len(program) > self.settings.max_program_bytes:
            return self._validate(program)  # over the limit: said without reading it all
        return self._validated.get(program)

    def _validate(self, source: Any) -> tuple[Program, dict[str, Any]]:
        program = parse_program(
            source,
            max_bytes=self.settings.max_program_bytes,
            known_tasks=self.known_tasks,
            known_pools=self.settings.allowed_pools,
        )
        return program, program.model_dump(mode="json", exclude_defaults=True)

    async def submit(
        self,
        program: Program | str | bytes | dict[str, Any],
        input: Any = None,
        workflow_id: str | None = None,
        priority: int = 0,
    ) -> Submitted:
        """Record and start a program; an id that exists is returned as it is, never rerun.
        `priority` (0..MAX_PRIORITY): its tasks go before lower ones' in each pool."""
        if self.bus is None:
            raise RuntimeError("Router needs a bus to submit")
        if (
            isinstance(priority, bool)
            or not isinstance(priority, int)
            or not (0 <= priority <= MAX_PRIORITY)
        ):
            raise ProgramError([f"priority: {priority!r} is not a whole number 0-{MAX_PRIORITY}"])
        checked, program_json = self._checked(program)
        try:
            wf = check_workflow_id(workflow_id) if workflow_id is not None else uuid.uuid4().hex
        except ValueError as exc:
            raise ProgramError([f"id: {exc}"]) from None
        check_input(input, max_bytes=self.settings.max_program_bytes)
        owner = shard_for(wf, self.settings.shards)
        try:
            recorded = {"program": program_json, "input": input, "owner": owner}
            if priority:  # absent: 0, as before priorities existed
                recorded["priority"] = priority
            plan = json.dumps(recorded)
            # What makes a submission the same one again: its program and its input.
            digest = hashlib.sha256(
                json.dumps([program_json, input], sort_keys=True).encode()
            ).hexdigest()
        except (TypeError, ValueError) as exc:
            raise ProgramError([f"input: not JSON: {exc}"]) from None
        if len(plan) > 2 * self.settings.max_program_bytes:
            raise ProgramError([f"input: {len(plan)} bytes with the program, over the limit"])
        # Tracked and indexed first: a crash between these and the record leaves a program
        # counted and listed that does not exist (listings drop it), never one uncounted.
        at_ms = await self._marks.clock_ms()
        indexed = await self._marks.index_new(wf, at_ms)
        await self.store.track(wf, owner)
        found = await self.store.submit(wf, plan, owner, checked.name, digest)
        if found.created and indexed:  # an earlier program's entry: this one's time now
            await self._marks.reindex(wf, at_ms)
        if found.owner != owner or found.status in TERMINAL:
            await self.store.untrack(wf, owner)  # counted above, but not in flight here
        if found.conflict:
            raise ProgramError([f"id: {wf!r} exists with another program or input; use a new id"])
        # A still-pending program may have missed its start (a crash right after recording):
        # starting it again is harmless, the first transition is compare-and-advance. Its
        # owner also sweeps for such programs (see Orchestrator), so none stays pending.
        if found.status == "pending":
            await self.bus.publish_to_shard(found.owner, encode(Start(wf=wf)), NEW)
        return Submitted(wf, found.owner, found.created, found.status)

    async def signal(
        self, workflow_id: str, name: str, data: Any = None, signal_id: str | None = None
    ) -> dict[str, Any]:
        """Send a signal to a program: kept for its signal step of that `name` (the one waiting
        now, or the next to wait for it), whose output `data` becomes. With a `signal_id`, a
        resend of the same id is no second signal. Raises LookupError (no such program) or
        ValueError (a bad name, data or id, no such signal step, an ended program, too many
        signals waiting), naming the fault."""
        if self.bus is None:
            raise RuntimeError("Router needs a bus to signal")
        check_workflow_id(workflow_id)
        if not SIGNAL_PATTERN.fullmatch(name):
            raise ValueError(
                f"{name[:80]!r} is not a signal name: 1-64 of a-z, 0-9, '_', '.' or '-', "
                "starting with a letter"
            )
        if signal_id is not None and not 0 < len(signal_id) <= MAX_SIGNAL_ID:
            raise ValueError(f"a signal id has 1 to {MAX_SIGNAL_ID} characters")
        check_value(data, "signal data", MAX_SIGNAL_BYTES)  # a ProgramError is a ValueError
        plan = await self._plan(workflow_id)
        if plan is None:
            raise NoProgram(workflow_id)
        names = parse_program(plan["program"], max_bytes=1 << 30).signals()
        if name not in names:  # the plan kept may be of an id purged and submitted again
            self._plans.pop(workflow_id)
            plan = await self._plan(workflow_id)
            if plan is None:
                raise NoProgram(workflow_id)
            names = parse_program(plan["program"], max_bytes=1 << 30).signals()
        if name not in names:
            waits = ", ".join(map(repr, sorted(names))) or "none"
            raise ValueError(
                f"program {workflow_id!r} has no signal step {name!r} (its signals: {waits})"
            )
        text = json.dumps(data, ensure_ascii=False)
        kept = await self.store.signal(workflow_id, name, text, signal_id or "")
        if kept.verdict == "missing":
            self._plans.pop(workflow_id)  # purged or expired: its id may be submitted again
            raise NoProgram(workflow_id)
        if kept.verdict == "ended":
            ended = "is compensating" if kept.status == "compensating" else "has ended"
            raise ValueError(f"program {workflow_id!r} {ended} ({kept.status}): not signalled")
        if kept.verdict == "full":
            raise ValueError(
                f"program {workflow_id!r} has {kept.status} {name!r} signals waiting already: "
                "not kept"
            )
        # Sent again for a duplicate too: the first send's message may be the one lost.
        owner = int(plan["owner"])
        await self.bus.publish_to_shard(owner, encode(Signalled(wf=workflow_id, name=name)))
        return {
            "workflow_id": workflow_id,
            "signal": name,
            "duplicate": kept.verdict == "duplicate",
            "waiting": int(kept.status) if kept.verdict == "kept" else None,
        }

    async def cancel(
        self, workflow_id: str, reason: str = "cancelled", *, stop_compensations: bool = False
    ) -> dict[str, Any]:
        """Cancel a program: no further step is dispatched, running tasks are told to stop.
        A compensating program is left so (its status gains a `note` saying the cancel
        changed nothing) unless `stop_compensations`: then it ends compensation_failed.
        `reason` is kept cut to MAX_ERROR characters (orchestrator/ending.py)."""
        if self.bus is None:
            raise RuntimeError("Router needs a bus to cancel")
        raw = await self._plan(workflow_id, fresh=True)  # it decides: never an old id's
        program = None if raw is None else parse_program(raw["program"], max_bytes=1 << 30)
        compensates = program is not None and bool(program.compensations)
        verdict = await end_program(
            self.store,
            self.bus,
            workflow_id,
            "cancelled",
            reason,
            compensates=compensates,
            stop=stop_compensations,
        )
        if verdict == "missing":
            raise NoProgram(workflow_id)
        status = await self.status(workflow_id)
        assert status is not None
        if verdict == "ended" and status["status"] == "compensating":
            status["note"] = COMPENSATING_NOTE
        elif verdict == "ended" and status["status"] in TERMINAL:  # (not redriven since)
            # A script's cancel stays idempotent (exit 0): a person is told.
            status["note"] = (
                f"the program had already ended {status['status']}: this cancel changed nothing"
            )
        return status

    async def redrive(self, workflow_id: str, from_step: str | None = None) -> dict[str, Any]:
        """Run a failed or cancelled program again from the step it stopped at (or from the
        top-level step `from_step`), keeping the outputs of the steps before it; messages of
        the earlier run are stale from now on. LookupError when there is no such program,
        RedriveError (naming why) when it is live or completed, or `from_step` is refused."""
        if self.bus is None:
            raise RuntimeError("Router needs a bus to redrive")
        state = await self.store.state(workflow_id)
        if not state:
            raise NoProgram(workflow_id)
        _refuse(workflow_id, state["status"])
        raw = await self._plan(workflow_id, fresh=True)  # it decides: never an old id's
        if raw is None:
            raise NoProgram(workflow_id)
        program = parse_program(raw["program"], max_bytes=1 << 30)
        rerun, prior, roots = redriving.where(program, state, from_step)
        owner = int(state["owner"])
        if owner >= self.settings.shards:  # left the ring: is anything still there to run it?
            await self._check_served(workflow_id, owner)
        # Tracked first, as a submit is: a crash after the script leaves a pending program
        # that its owner's sweep starts, never one nobody counts.
        await self.store.track(workflow_id, owner)
        epoch = int(state.get("epoch") or 0)
        record = redriving.record(state)
        found = await self.store.redrive(workflow_id, epoch, rerun, prior, record, roots)
        if found.verdict != "applied":
            if found.status in TERMINAL or found.verdict == "missing":  # purged meanwhile too
                await self.store.untrack(workflow_id, owner)
            if found.verdict == "missing":
                raise NoProgram(workflow_id)
            _refuse(workflow_id, found.status)
            raise redriving.RedriveError(
                f"program {workflow_id!r} was redriven meanwhile (now run {found.epoch}, "
                f"{found.status}); look at its status and try again"
            )
        await self.store.track(workflow_id, owner)  # a sweep may have dropped it meanwhile
        await self.bus.publish_to_shard(owner, encode(Start(wf=workflow_id)), NEW)
        status = await self.status(workflow_id)
        assert status is not None
        return status

    async def _check_served(self, workflow_id: str, owner: int) -> None:
        """Refuse (RedriveError) to redrive a program of a shard outside the ring whose queue
        is gone or unconsumed: its start would find no queue (the program left pending, which
        no redrive takes again) or wait in it for ever. Nothing is changed. Without a `Bus`
        (a publisher only) nothing can be asked: the redrive goes on."""
        if not isinstance(self.bus, Bus):
            return
        queue = self.bus.names.shard_queue(owner)
        found = await self.bus.shard_queue_state(owner)
        if found is not None and found[1]:
            return
        what = f"its queue {queue} is gone" if found is None else f"nothing consumes {queue}"
        raise redriving.RedriveError(
            f"program {workflow_id!r} belongs to shard {owner}, outside the ring of "
            f"{self.settings.shards} shards, and {what}: run an orchestrator for it "
            f"(`shardflow orchestrator --shards {owner}`, or `shardflow dev`), or wait for "
            "the one restarting, then redrive it again (`shardflow shards` lists the shards "
            "outside the ring)"
        )

    async def status(self, workflow_id: str) -> dict[str, Any] | None:
        """The program's status as JSON-ready data, or None when there is no such program:
        also its current step (task names, loop iterations, bag members done), every failed
        attempt (those of tasks that later succeeded too) and elapsed times."""
        state = await self.store.state(workflow_id)
        if not state:
            return None
        status = _basic(workflow_id, state)
        found = await explaining.details(
            self.store, workflow_id, state, await self._plan(workflow_id, fresh=True)
        )
        status.update(
            updated_ms=_int(state.get("updated_ms")),
            **explaining.elapsed(state),
            steps=found.steps,
            step=found.step,
            attempts=found.attempts,
        )
        if "epoch" in state:  # redriven: which run this is, and how the earlier ones ended
            status.update(run=int(state["epoch"]), runs=redriving.runs(state))
        found_saga = await explaining.compensations(self.store, workflow_id, state, found.program)
        if found_saga is not None:  # a saga: why, and its compensations
            status["compensations"] = found_saga
        return status

    async def _plan(self, workflow_id: str, *, fresh: bool = False) -> Any:
        """The recorded plan, or None (not kept: the id may be submitted yet). `fresh`: read
        now, not the one kept, which may be of an id purged and submitted again since (a
        signal, whose names are checked, reads it again when they refuse)."""
        if fresh:
            return await self.store.plan(workflow_id)
        plan = self._plans.get(workflow_id)
        if plan is None:
            plan = await self.store.plan(workflow_id)
            if plan is not None:
                self._plans.put(workflow_id, plan, json_bytes(json.dumps(plan).encode()))
        return plan

    async def list_programs(
        self,
        *,
        statuses: Iterable[str] = (),
        name: str | None = None,
        since_ms: int | None = None,
        before: str | None = None,
        limit: int = listing.DEFAULT_LIMIT,
    ) -> listing.Page:
        """Programs newest first (router/listing.py: list_programs)."""
        return await listing.list_programs(
            self.settings,
            self.store,
            statuses=statuses,
            name=name,
            since_ms=since_ms,
            before=before,
            limit=limit,
        )

    async def explain(self, workflow_id: str) -> dict[str, Any] | None:
        """Where the program stands and what it waits for (router/explain.py); with a `Bus`,
        also its pool's and shard's queues."""
        bus = self.bus if isinstance(self.bus, Bus) else None
        return await explaining.explain(self.store, bus, workflow_id)

    async def wait(
        self,
        workflow_id: str,
        timeout_s: float | None = None,
        *,
        progress: Progress | None = None,
    ) -> dict[str, Any]:
        """Poll until the program ends; TimeoutError after `timeout_s` seconds. `progress`, if
        given, is called with the full status at each poll."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pause = self.settings.wait_poll_s
        while True:
            state = await self.store.state(workflow_id)
            if not state:
                raise NoProgram(workflow_id)
            if progress is not None or state["status"] in TERMINAL:
                status = await self.status(workflow_id)
                if status is None:
                    raise NoProgram(workflow_id)
                if progress is not None:
                    shown = progress(status)
                    if shown is not None:
                        await shown
                if status["status"] in TERMINAL:
                    return status
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"program {workflow_id} still {state['status']} after {timeout_s}s"
                )
            await asyncio.sleep(pause)
            pause = min(pause * 1.5, 1.0)


def _refuse(workflow_id: str, status: str) -> None:
    """A live or completed program is not redriven: say so, naming its status."""
    if status in ("compensated", "compensation_failed"):
        raise redriving.RedriveError(
            f"program {workflow_id!r} ended {status}: a program whose compensations ran is "
            "not redriven (its completed steps were undone; submit it again under a new id)"
        )
    if status == "compensating":
        raise redriving.RedriveError(
            f"program {workflow_id!r} is compensating: a program whose compensations run is "
            "not redriven (it ends compensated or compensation_failed; submit it again under "
            "a new id)"
        )
    if status in ("pending", "running"):
        raise redriving.RedriveError(
            f"program {workflow_id!r} is {status}: only a failed or cancelled program can be "
            "redriven (cancel it first to run it again)"
        )
    if status == "completed":
        raise redriving.RedriveError(
            f"program {workflow_id!r} completed: only a failed or cancelled program can be "
            "redriven (submit it again under a new id)"
        )


def _basic(workflow_id: str, state: dict[str, str]) -> dict[str, Any]:
    """The status fields every version printed (the CLI is a contract: extend, never rename)."""
    return {
        "workflow_id": workflow_id,
        "name": state.get("name", ""),
        "status": state["status"],
        "owner": int(state["owner"]),
        "cursor": state.get("cursor") or None,
        "created_ms": _int(state.get("created_ms")),
        "started_ms": _int(state.get("started_ms")),
        "ended_ms": _int(state.get("ended_ms")),
        "result": json.loads(state["result"]) if "result" in state else None,
        "error": state.get("error"),
    }


def _int(value: str | None) -> int | None:
    return None if value is None else int(value)
