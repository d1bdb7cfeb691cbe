"""A worker's memory of the task messages it runs and ran, so that a copy is not run twice here.

The broker gives a message back when the connection it came on drops, and the worker,
connected again, would run a second handler beside the first; so would a publisher's retry, or
a bundle's task sent on alone. (Another worker given it runs it again: at least once.)
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from orchestrator.messages import TaskMessage

log = logging.getLogger(__name__)

# A copy that comes after its run ended, reports confirmed, is known by this many of the last
# runs.
RUNS_KEPT = 4096
# A copy waits for at most this many runs of its task in turn (each ended unsettled): a bound,
# not a count one meets.
MAX_JOINS = 3

Key = tuple[Any, ...]


@dataclass
class Run:
    """What a copy of a task message needs to know of the run of it here."""

    created_ms: str | None = None  # its program's, read as its task was checked
    # A report a redelivered run would send went unsent (a step recorded already: `again`),
    # or a task failed: a copy may owe a report (the delivery that recorded the step and
    # lost its report).
    withheld: bool = False


_RUN: ContextVar[Run | None] = ContextVar("shardflow_worker_run", default=None)


def note_created(created_ms: str | None) -> None:
    """Note the program's created_ms, read as the task running now was found current."""
    run = _RUN.get()
    if run is not None:
        run.created_ms = created_ms


def note_withheld(withheld: bool) -> None:
    """Note that this run sent no report where a redelivered one would have, or failed."""
    run = _RUN.get()
    if withheld and run is not None:
        run.withheld = True


def run_key(task: TaskMessage) -> Key:
    """What tells a task message's run from any other's: a retry, a redrive's run, a loop's
    iteration, a bag's other members, a wait for a slot each differ in it."""
    members = b""
    if task.batch:  # up to MAX_BAG indexes: a digest keeps the key small
        indexes = ",".join(str(slot.index) for slot in task.batch).encode()
        members = hashlib.blake2b(indexes, digest_size=16).digest()
    waits = -1 if task.limit is None else task.limit.waits
    return (
        task.wf,
        task.epoch,
        task.path,
        task.iteration,
        task.attempt,
        task.index,
        members,
        waits,
    )


class Runs:
    """Task messages running here, each done with its program's created_ms once it ran to its
    end, reports confirmed and none withheld (else None); the last RUNS_KEPT so run."""

    def __init__(self, created: Callable[[str], Awaitable[str | None]], name: str) -> None:
        self._created = created  # a program's created_ms now, read from the store
        self._name = name
        self._runs: dict[Key, asyncio.Future[str | None]] = {}
        self._ran: OrderedDict[Key, str] = OrderedDict()

    async def ran_here(self, key: Key, wf: str) -> bool:
        """Whether this worker ran the task message to its end, reports confirmed, or runs it
        now (waited for: its outcome). A program of the same id submitted again since (purged,
        or expired) is another: its created_ms tells."""
        # Runs under way first: a remembered one may be a program of the same id before.
        created = await self._join(key, wf) or self._ran.get(key)
        if created is None:
            return False
        now = await self._created(wf)  # a copy's read only
        if created != now and key in self._runs:  # the new program's run began meanwhile
            created = await self._join(key, wf)
        return created == now

    async def _join(self, key: Key, wf: str) -> str | None:
        """Wait for the run of `key` under way here, if any: its program's created_ms once it
        ran, settled with nothing withheld. Another copy may start a run when one ends
        unsettled: waited for too, up to MAX_JOINS runs (then the copy runs beside)."""
        for _ in range(MAX_JOINS):
            running = self._runs.get(key)
            if running is None:
                return None
            log.info("%s: %s: a copy of a task running here waits for that run", self._name, wf)
            created = await asyncio.shield(running)
            if created is not None:
                return created
        return None

    async def once(self, key: Key, run: Callable[[], Awaitable[bool]]) -> None:
        """`run()` (False when its task went back to wait for a slot), known to copies by
        `key` while it runs and, once it ran, after."""
        if key in self._runs:  # copies past MAX_JOINS: run beside, unknown to others
            await run()
            return
        noted, settled = Run(), False
        self._runs[key] = asyncio.get_running_loop().create_future()
        token = _RUN.set(noted)
        try:
            settled = await run()
        finally:
            _RUN.reset(token)
            # One sent back to wait is not kept: its waits, which tell it apart, stop counting
            # at limits.MAX_WAITS. Nor is one of a step that names compensations (lua/begin.lua
            # reads no created_ms): it runs again.
            kept = noted.created_ms if settled and not noted.withheld else None
            self._runs.pop(key).set_result(kept)
            if kept is not None:
                self._ran[key] = kept
                self._ran.move_to_end(key)  # kept again: the newest
                if len(self._ran) > RUNS_KEPT:
                    self._ran.popitem(last=False)
