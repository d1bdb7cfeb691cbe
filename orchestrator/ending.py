"""Ending a live program from outside its step order: a cancel, or a deadline that passed.

Both the router (`shardflow cancel`) and the engine (a deadline message) end programs this way.
"""

from __future__ import annotations

import logging

from orchestrator import metrics
from orchestrator.bus import NEW, Publisher
from orchestrator.messages import MAX_ERROR, Cancelled, Start, encode
from orchestrator.store import TERMINAL, Store

log = logging.getLogger(__name__)


async def end_program(
    store: Store,
    bus: Publisher,
    wf: str,
    status: str,
    reason: str,
    *,
    epoch: int | None = None,
    compensates: bool = False,
    stop: bool = False,
) -> str:
    """Cancel (or fail) a live program wherever it stands, and tell the workers. With
    `epoch` (a deadline's), only while the program is still in that run. A program that
    names compensations (`compensates`) becomes compensating instead: its owner is sent a
    `start`, which runs them (a crash before it leaves that to the owner's sweep). A cancel
    of a compensating program changes nothing (`ended`) unless `stop`: then its
    compensations stop (it ends compensation_failed).

    The reason is kept (and logged, escaped) cut to MAX_ERROR characters, as a task's error is.

    Returns `applied` (ended now), `ended` (it had ended before), `stale` (it was redriven
    since: another run) or `missing`.
    """
    if len(reason) > MAX_ERROR:
        reason = reason[: MAX_ERROR - 20] + " ... (cut)"
    ended = await store.cancel(wf, status, reason, epoch, compensates, stop)
    if ended is None:
        return "missing"
    if ended.stale:
        return "stale"
    if ended.status == "compensating":  # live: its owner runs the compensations
        await bus.publish_to_shard(ended.owner, encode(Start(wf=wf)), NEW)
    else:
        await store.untrack(wf, ended.owner)
    if ended.now and ended.status in TERMINAL:
        log.info("%s: ended %s: %r", wf, ended.status, reason)
        metrics.program_ended(ended.status)
    elif ended.now:
        log.info("%s: %s, compensating: %r", wf, status, reason)
    # Told again on a redelivery too: a crash may have cut the first notice short.
    if ended.now or ended.status in (status, "compensating"):
        await bus.publish_control(encode(Cancelled(wf=wf)))
    return "applied" if ended.now else "ended"
