"""Fair share inside a pool: each pool that is not a lane has SHARES task queues, and a program's
tasks go to the one its kind hashes to (its `name`, or else its steps). Workers consume every
one, each at most a share of their slots, and take from them in turn: a burst of one kind of
program fills one queue and part of the slots, never the whole pool."""

from __future__ import annotations

import json

import mmh3

from orchestrator.program import Program, is_lane

# Fixed in code, not configured: owners and workers must agree on it. Two kinds of program
# share a queue with chance 1/SHARES (they then share its part of the slots).
SHARES = 8


def share_of(program: Program) -> int:
    """The task queue a program's tasks go to, 0..SHARES-1: its name picks it, or its steps."""
    kind = program.name or json.dumps(
        program.model_dump(mode="json", exclude_defaults=True), sort_keys=True
    )
    return mmh3.hash(kind, signed=False) % SHARES


def share_pool(pool: str, share: int) -> str:
    """The queue's pool name for a share: `<pool>` for share 0 (the queue before fair share),
    `<pool>.<share>` else. A lane keeps its one queue (pool names hold no dots)."""
    return pool if share == 0 or is_lane(pool) else f"{pool}.{share}"


def pool_of_share(queue_pool: str) -> str:
    """The pool a share's queue pool name (`share_pool`) belongs to."""
    return queue_pool.partition(".")[0]


def share_pools(pool: str) -> list[str]:
    """Every queue a worker of `pool` consumes."""
    return [pool] if is_lane(pool) else [share_pool(pool, share) for share in range(SHARES)]
