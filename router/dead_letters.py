"""What a dead letter's headers say: when it was parked and why (ours, or the broker's
`x-death`), and where `shardflow dead --requeue` may send it back. Every header is untrusted:
anyone who may publish on the vhost can park a message with any header."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from typing import Any

from orchestrator.delivery import FAILURES, SENT_ID, kept_headers
from orchestrator.keys import Names
from orchestrator.program import check_pool_name
from orchestrator.settings import MAX_SHARDS
from orchestrator.shares import SHARES


def sent_back(
    names: Names, headers: dict[str, Any], message_id: str | None = None
) -> tuple[str, dict[str, Any]] | None:
    """Where a dead letter goes again and with which headers: the queue it came from, if that
    is one of this cluster's that a consumer reads (a header may name any queue: it is not
    trusted), counted as redelivered and without the reasons it was parked with."""
    source = headers.get("x-shardflow-from") or (first_death(headers) or {}).get("queue")
    if not isinstance(source, str) or not our_queue(names, source):
        return None
    kept = {k: v for k, v in kept_headers(headers).items() if k not in _PARKING_HEADERS}
    if source == names.ingress_queue and SENT_ID not in headers:
        if first_death(headers) is None:
            return None  # parked before ids were kept: its request would get a new id
        kept[SENT_ID] = message_id or ""  # parked by the broker, which kept the message's own
    return source, {**kept, FAILURES: 0}


_PARKING_HEADERS = ("x-shardflow-reason", "x-shardflow-from", "x-shardflow-at")


def our_queue(names: Names, queue: str) -> bool:
    """Whether `queue` is this cluster's ingress, a shard's or a pool's (share) queue."""
    if queue == names.ingress_queue:
        return True
    shard = queue.removeprefix(names.shard_queue(0)[:-1])
    if shard != queue:  # a few digits at most: int() of thousands of them raises
        return _small_number(shard) and int(shard) < MAX_SHARDS
    pool = queue.removeprefix(names.task_queue(""))
    if pool == queue or not pool:
        return False
    base, _, share = pool.rpartition(".")
    if base and _small_number(share) and int(share) < SHARES:
        pool = base
    try:
        check_pool_name(pool)
    except ValueError:
        return False
    return True


def _small_number(text: str) -> bool:
    return 0 < len(text) <= 6 and text.isascii() and text.isdigit()


# A dead letter's time further ahead than this is its parker's clock's error, not a time.
FUTURE_AT_MS = 5 * 60_000


def parked_before(older_than_s: float) -> Callable[[dict[str, Any]], bool]:
    """Whether a letter was parked at least `older_than_s` ago (this process's clock: the
    parkers' own stamped it). One whose time is not known counts as old (parked before those
    after it), and so does one stamped in the future (its parker's clock was ahead): taken as
    young, it stopped a purge at it."""
    now = time.time() * 1000
    cutoff = now - older_than_s * 1000

    def old(headers: dict[str, Any]) -> bool:
        at = parked_at(headers)
        return at is None or at <= cutoff or at > now + FUTURE_AT_MS

    return old


def parked_at(headers: dict[str, Any]) -> int | None:
    """When a message was parked, in ms: the broker's `x-death` says when it parked one
    (which keeps its sender's headers, ours too), ours say when we did."""
    when = (first_death(headers) or {}).get("time")
    if isinstance(when, datetime.datetime):
        return int(when.timestamp() * 1000)
    at = headers.get("x-shardflow-at")
    if isinstance(at, int) and not isinstance(at, bool):
        return at
    return None


def death_reason(headers: dict[str, Any]) -> str:
    # Dead-lettered by the broker (rejected, or over a quorum queue's delivery limit).
    death = first_death(headers)
    if death is not None:
        return f"{death.get('reason')} by the broker from {death.get('queue')}"
    return "unknown"


def first_death(headers: dict[str, Any]) -> dict[str, Any] | None:
    """The broker's latest `x-death` entry, when the header is the list of tables it writes
    (a sender may set it to anything)."""
    deaths = headers.get("x-death")
    if isinstance(deaths, list) and deaths and isinstance(deaths[0], dict):
        return deaths[0]
    return None
