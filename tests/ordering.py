"""Checks over a trace: no step starts before every task of the previous step ended.

Handlers may run more than once (a redelivery after a crash), so a leaf counts as done when
each of its members has ended at least once: the leaf is done at the latest of its members'
first ends, and the next leaf must start after that.
"""

from __future__ import annotations

from collections import defaultdict
from itertools import pairwise
from typing import Any

NEVER = -1


def leaf_order(events: list[dict[str, Any]]) -> dict[str, list[tuple[str, int, int]]]:
    """Per workflow, its leaves by first start: (path, first start, done) with done = NEVER
    while some member never ended."""
    starts: dict[tuple[str, str], int] = {}
    first_end: dict[tuple[str, str], dict[Any, int]] = defaultdict(dict)
    members: dict[tuple[str, str], set[Any]] = defaultdict(set)
    for event in sorted(events, key=lambda e: e["seq"]):
        leaf = (event["wf"], event["path"])
        members[leaf].add(event["index"])
        if event["event"] == "start":
            starts.setdefault(leaf, event["seq"])
        else:
            first_end[leaf].setdefault(event["index"], event["seq"])
    order: dict[str, list[tuple[str, int, int]]] = defaultdict(list)
    for leaf, start in starts.items():
        ends = first_end[leaf]
        done = max(ends.values()) if set(ends) == members[leaf] else NEVER
        order[leaf[0]].append((leaf[1], start, done))
    for leaves in order.values():
        leaves.sort(key=lambda leaf: leaf[1])
    return order


def assert_leaves_in_order(events: list[dict[str, Any]], expected_paths: list[str]) -> None:
    """Each workflow ran exactly `expected_paths`, each leaf starting after the one before."""
    for wf, leaves in leaf_order(events).items():
        assert [path for path, _, _ in leaves] == expected_paths, wf
        for (before, _, done), (after, start, _) in pairwise(leaves):
            assert done != NEVER, f"{wf}: {before} never ended"
            assert start > done, f"{wf}: {after} started (seq {start}) before {before} was done"
