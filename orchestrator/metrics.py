"""Prometheus metrics of every shardflow process, and the small helpers that record them.

One registry per process (prometheus_client's default, with its process and GC collectors), so
`shardflow dev` serves every part's metrics on one port. docs/observability.md lists each
metric with its labels. Label values come only from bounded sets: pools (a worker's own, or
at most MAX_POOL_LABELS that tasks were published to), shards, statuses, queue names of this
cluster, and task names this worker registered (any other is `unknown`: a task name in a
message is untrusted and must not mint series).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Container, Iterable
from typing import Any

from prometheus_client import Counter, Gauge, Histogram, disable_created_metrics

from orchestrator.lifecycle import raise_if_cancelled
from orchestrator.store import TERMINAL, Store, Verdict

log = logging.getLogger(__name__)

# No `_created` series beside every counter and histogram: a scrape's noise, no dashboard's need.
disable_created_metrics()

# From a millisecond to 30 days: a task runs from a cache lookup to a day's encode (its
# timeout_s is at most a day), a step with retries or a sleep or signal wait for up to 30 days
# (MAX_SLEEP_S, deadline_s). With an hour on top, a day read as 3,600 s in every quantile.
DURATION_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300,
    600, 1800, 3600, 7200, 14400, 43200, 86400, 259200, 604800, 2592000,
)  # fmt: skip
# How often an owner counts its shards' programs in flight (one SCARD per shard).
IN_FLIGHT_EVERY_S = 5.0

PROGRAMS_STARTED = Counter(
    "shardflow_programs_started_total", "Programs whose first step was dispatched by an owner."
)
PROGRAMS_ENDED = Counter(
    "shardflow_programs_ended_total",
    "Programs that ended, by status (completed, failed, cancelled, compensated, "
    "compensation_failed).",
    ["status"],
)
STEP_DURATION = Histogram(
    "shardflow_step_duration_seconds",
    "From dispatching a step (a task or a whole bag) to the owner advancing past it.",
    ["pool", "kind"],
    buckets=DURATION_BUCKETS,
)
TASK_DURATION = Histogram(
    "shardflow_task_duration_seconds",
    "One run of a task handler in a worker, by outcome (completed, failed, cancelled).",
    ["pool", "task", "outcome"],
    buckets=DURATION_BUCKETS,
)
TASKS_RUNNING = Gauge(
    "shardflow_tasks_running", "Task handlers running now in a worker's slots.", ["pool"]
)
WORKER_SLOTS = Gauge(
    "shardflow_worker_slots", "Task handlers a worker runs at once (its concurrency).", ["pool"]
)
HANDLERS_LEFT = Gauge(
    "shardflow_handlers_left_running",
    "Handlers still running after their task ended (timed out or cancelled) and gave its slot "
    "back: they did not end when cancelled (a plain function never can).",
    ["pool"],
)
RETRIES = Counter("shardflow_retries_total", "Failed tasks scheduled to run again.")
SLOT_WAITS = Counter(
    "shardflow_slot_waits_total",
    "Tasks that found every slot of their per-key limit held, sent back to wait.",
    ["pool"],
)
BUNDLES = Counter(
    "shardflow_bundles_total",
    "Task messages that carried the single tasks of several programs (orchestrator/bundling.py).",
)
BUNDLED_TASKS = Counter("shardflow_bundled_tasks_total", "Tasks sent in those bundles.")
REPORT_BUNDLES = Counter(
    "shardflow_report_bundles_total",
    "Shard messages that carried the reports of several of a bundle's tasks.",
)
BUNDLED_REPORTS = Counter("shardflow_bundled_reports_total", "Reports sent in those bundles.")
DEAD_LETTERS = Counter(
    "shardflow_dead_letters_total",
    "Messages parked in the dead-letter queue: refused (poison) or over the failure limit.",
    ["queue", "cause"],
)
REDELIVERIES = Counter(
    "shardflow_redeliveries_total",
    "Messages received that an earlier try may have cut short (redelivered or requeued).",
    ["queue"],
)
REQUEUED = Counter(
    "shardflow_requeued_total",
    "Messages handed back for another try: RabbitMQ or Redis away (unreachable), or an error.",
    ["queue", "cause"],
)
DUPLICATES = Counter(
    "shardflow_duplicates_ignored_total",
    "Duplicate or late messages acked and ignored, by the part that ignored them.",
    ["part"],
)
GONE = Counter(
    "shardflow_gone_ignored_total",
    "Messages (for a worker, tasks) acked and ignored because their program no longer exists "
    "(ended, then expired or purged): a timer, a retry that waited past the end, a task that "
    "ended after its program was deleted.",
    ["part"],
)
REPUBLISHED = Counter(
    "shardflow_republished_total",
    "What a redelivered message produces, published again (a crash may have cut it short).",
)
SUBMITTED = Counter(
    "shardflow_ingress_requests_total",
    "Submit requests on the ingress queue: created, existing (resubmitted) or refused.",
    ["outcome"],
)
IN_FLIGHT = Gauge(
    "shardflow_programs_in_flight",
    "Programs recorded on a shard and not ended, as counted by the shard's orchestrators.",
    ["shard"],
)
LOOP_LAG = Gauge(
    "shardflow_event_loop_lag_seconds", "How late the event loop ran the last heartbeat."
)
# Counted by the loop watch's thread: a stall is over before a scrape reads the lag gauge.
LOOP_STALLS = Counter(
    "shardflow_event_loop_stalls_total",
    "Times the event loop went a second or more without a turn, by cause: blocked (code kept "
    "it; the log names where) or starved (idle, but other threads or processes held the CPU).",
    ["cause"],
)
DEPENDENCY_UP = Gauge(
    "shardflow_dependency_up",
    "1 while a dependency answers (redis: a PING, and no refusal of work in 10 s; rabbitmq: "
    "the connection is open and not blocked by a memory or disk alarm).",
    ["dependency"],
)

# Pools come from programs, and anyone who submits one may name a pool: a pool gets series of
# its own once a task of it is published or run (a map over no items, or a bag of branches
# only, runs none), the first few such; any other is counted as `other`. ("timer": a sleep's
# or a signal's step.)
MAX_POOL_LABELS = 32
_pool_labels: set[str] = {"serial", "parallel", "timer"}


def pool_label(pool: str) -> str:
    """The `pool` label of a pool whose tasks are published or run (a worker's own, or one an
    owner published to): itself, or `other` past MAX_POOL_LABELS."""
    if pool not in _pool_labels and len(_pool_labels) < MAX_POOL_LABELS:
        _pool_labels.add(pool)
    return pool if pool in _pool_labels else "other"


def _step_label(pool: str, kind: str) -> str:
    """The `pool` label of a finished step: a task's step moved on from its worker's report,
    so its pool ran a task; any other's pool keeps the label it was given (pool_label), or is
    `other`."""
    if kind == "task":
        return pool_label(pool)
    return pool if pool in _pool_labels else "other"


def advanced(
    expected: str,
    step: tuple[str, str] | None,
    verdict: Verdict,
    *,
    redelivered: bool,
) -> None:
    """Record what one compare-and-advance of the owner did (see Transitions.apply); `step`
    is the finished leaf's (pool, "task" | "bag" | ...), timed by `verdict.elapsed_ms`: from
    its cursor reaching it to now, on Redis's clock, so no table of open steps is held here
    and a step that outlives a failover is timed too."""
    if verdict.verdict == "applied":
        if expected == "":
            PROGRAMS_STARTED.inc()
        elif step is not None and verdict.elapsed_ms is not None:
            STEP_DURATION.labels(_step_label(*step), step[1]).observe(verdict.elapsed_ms / 1000)
        if verdict.status in TERMINAL:
            PROGRAMS_ENDED.labels(verdict.status).inc()
    elif verdict.verdict == "replay" and redelivered:
        REPUBLISHED.inc()
    else:
        DUPLICATES.labels("orchestrator").inc()


def failure_verdict(verdict: str) -> None:
    """A failed-task report that did not end its step: retried, or a stale duplicate."""
    if verdict == "retried":
        RETRIES.inc()
    else:
        DUPLICATES.labels("orchestrator").inc()


def program_ended(status: str) -> None:
    """A program ended from outside its step order (a cancel or a deadline)."""
    PROGRAMS_ENDED.labels(status).inc()


def recorded(verdict: str, *, redelivered: bool) -> None:
    """A worker recorded outputs; `again` or `stale` outside a redelivery was a duplicate."""
    if verdict == "stale" or (verdict == "again" and not redelivered):
        DUPLICATES.labels("worker").inc()
    elif verdict == "again":
        REPUBLISHED.inc()


def task_ended(pool: str, task: str, known: Container[str], outcome: str, started: float) -> None:
    """One handler run ended; `started` is its time.monotonic() at the start."""
    name = task if task in known else "unknown"
    TASK_DURATION.labels(pool, name, outcome).observe(time.monotonic() - started)


async def count_in_flight(store: Store, shards: Iterable[int]) -> None:
    """Keep `shardflow_programs_in_flight` of these shards current, until cancelled."""
    shards = list(shards)
    while True:
        for shard in shards:
            try:
                IN_FLIGHT.labels(str(shard)).set(await store.in_flight(shard))
            except Exception as exc:  # Redis away: the health check says so; keep counting
                log.debug("in-flight count of shard %d skipped: %r", shard, exc)
        raise_if_cancelled()
        await asyncio.sleep(IN_FLIGHT_EVERY_S)


def names(registry: Any = None) -> set[str]:
    """Every sample name the registry exports (counters with `_total`, histograms with
    `_bucket`, `_sum`, `_count`): what a dashboard query may name."""
    from prometheus_client import REGISTRY

    found: set[str] = set()
    for family in (registry or REGISTRY).collect():
        found.add(family.name)
        found.update(sample.name for sample in family.samples)
        if family.type == "counter":
            found.add(family.name + "_total")
        elif family.type == "histogram":
            found.update(family.name + end for end in ("_bucket", "_sum", "_count"))
    return found
