"""Checks over a trace: no step starts before every task of the previous step ended."""

from __future__ import annotations

import itertools
from collections import defaultdict
from typing import Any


def leaf_order(events: list[dict[str, Any]]) -> dict[str, list[tuple[str, int, int]]]:
    """Per workflow, its leaves in the order they ran: (path, first start, last end)."""
    spans: dict[tuple[str, str], list[int]] = defaultdict(lambda: [1 << 62, -1])
    for event in events:
        span = spans[(event["wf"], event["path"])]
        if event["event"] == "start":
            span[0] = min(span[0], event["seq"])
        else:
            span[1] = max(span[1], event["seq"])
    order: dict[str, list[tuple[str, int, int]]] = defaultdict(list)
    for (wf, path), (start, end) in spans.items():
        order[wf].append((path, start, end))
    for leaves in order.values():
        leaves.sort(key=lambda leaf: leaf[1])
    return order


def assert_steps_in_order(events: list[dict[str, Any]], expected_paths: list[str]) -> None:
    """Each workflow ran exactly `expected_paths`, each leaf starting after the last one ended."""
    for wf, leaves in leaf_order(events).items():
        assert [path for path, _, _ in leaves] == expected_paths, wf
        for (before, _, end), (after, start, _) in itertools.pairwise(leaves):
            assert end >= 0, f"{wf}: {before} never ended"
            assert start > end, f"{wf}: {after} started (seq {start}) before {before} ended ({end})"
