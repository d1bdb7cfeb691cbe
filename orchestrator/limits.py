"""Per-key concurrency limits: the keys a leaf's tasks run under, and what a worker holds.

A task, bag member or map may declare `"limit": {"key": CEL, "max": n}`. The owner evaluates
the key when it sends the task (here, in the evaluator process like every CEL expression) and
puts the string on the task message; a worker never runs CEL. At most `max` tasks of one key
hold a slot at once, cluster-wide: slots are leases in Redis (lua/acquire.lua, renew.lua,
release.lua), so a worker that dies holding one loses it when its lease runs out.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any

from orchestrator.conditions import ConditionError, evaluate_key, quote
from orchestrator.program import MAX_LIMIT_KEY_CHARS, Bag, Branch, Map, Member, Signal, Sleep, Task

# A task that finds no free slot waits in the delay ladder, not in a worker: it goes back to
# its pool after LIMIT_BACKOFF_S, doubled on each wait, at most LIMIT_MAX_BACKOFF_S (and never
# longer than the first holder's lease has left, so a dead holder's slot is taken up soon).
LIMIT_BACKOFF_S = 0.05
LIMIT_MAX_BACKOFF_S = 2.0
# Waits a task message counts (for its backoff); past it the count stays.
MAX_WAITS = 1_000_000


def keys_of(
    step: Task | Bag | Map | Sleep | Signal,
    path: str,
    input: Any,
    computed: Sequence[dict[str, Any]],
    items: Sequence[Any] | None,
    only: int | None = None,
) -> tuple[str | None, ...] | str:
    """The key of each member's limit (None: it has none; `only`: just that member's), or
    why the step fails; () when no member has a limit. `computed`: what args_from gave (per
    bag member; one for a task or a map), merged into each member's args as its task gets
    them."""
    if isinstance(step, Sleep | Signal):
        return ()
    members: Sequence[Member | Branch] = step.bag if isinstance(step, Bag) else [step]
    size = len(members) if items is None else len(items)
    if all(not isinstance(member, Member) or member.limit is None for member in members):
        return ()
    found: list[str | None] = []
    for i in range(size):
        member = members[i] if isinstance(step, Bag) else step
        # A branch holds no slot: its own steps' tasks do.
        limit = member.limit if isinstance(member, Member) else None
        if limit is None or (only is not None and i != only):
            found.append(None)
            continue
        extra = computed[i if isinstance(step, Bag) else 0] if computed else {}
        try:
            key = evaluate_key(
                limit.key,
                input=input,
                args={**member.args, **extra},  # type: ignore[union-attr]
                item=items[i] if items is not None else None,
                max_chars=MAX_LIMIT_KEY_CHARS,
            )
        except ConditionError as exc:
            where = f"{path}/bag:{i}" if isinstance(step, Bag | Map) else path
            return f"step {where}: limit key {quote(limit.key)}: {exc}"
        found.append(key)
    return tuple(found)


def backoff_s(waits: int, lease_left_s: float | None = None) -> float:
    """How long a task that found no free slot waits before it tries again."""
    delay = min(LIMIT_BACKOFF_S * 2 ** min(waits, 32), LIMIT_MAX_BACKOFF_S)
    if lease_left_s is not None:
        delay = min(delay, max(lease_left_s, LIMIT_BACKOFF_S))
    return delay


def holder(wf: str, path: str, index: int | None) -> str:
    """A new holder id for one run of one task: its program, step and member (for `explain`),
    and a token of its own, so two runs of the same task (a duplicate) hold two slots."""
    member = "-" if index is None else str(index)
    return f"{wf} {path} {member} {secrets.token_hex(6)}"
