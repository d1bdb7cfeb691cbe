"""Ending a live program from outside its step order: a cancel, or a deadline that passed.

Both the router (`shardflow cancel`) and the engine (a deadline message) end programs this way.
"""

from __future__ import annotations

import logging

from orchestrator import metrics
from orchestrator.bus import Publisher
from orchestrator.messages import Cancelled, encode
from orchestrator.store import Store

log = logging.getLogger(__name__)


async def end_program(
    store: Store, bus: Publisher, wf: str, status: str, reason: str, *, epoch: int | None = None
) -> str:
    """Cancel (or fail) a live program wherever it stands, and tell the workers. With
    `epoch` (a deadline's), only while the program is still in that run.

    Returns `applied` (ended now), `ended` (it had ended before), `stale` (it was redriven
    since: another run) or `missing`.
    """
    ended = await store.cancel(wf, status, reason, epoch)
    if ended is None:
        return "missing"
    if ended.stale:
        return "stale"
    await store.untrack(wf, ended.owner)
    if ended.now:
        log.info("%s: ended %s: %s", wf, status, reason)
        metrics.program_ended(wf, status)
    # Told again on a redelivery too: a crash may have cut the first notice short.
    if ended.now or ended.status == status:
        await bus.publish_control(encode(Cancelled(wf=wf)))
    return "applied" if ended.now else "ended"
