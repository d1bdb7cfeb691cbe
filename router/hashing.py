"""The shard function: any client language can reproduce it (MurmurHash3 x86 32-bit, seed 0)."""

from __future__ import annotations

import mmh3


def shard_for(workflow_id: str, shards: int) -> int:
    """`mmh3.hash(workflow_id, 0, signed=False) % shards`, over the id's UTF-8 bytes."""
    if shards < 1:
        raise ValueError(f"shards must be at least 1, not {shards}")
    return mmh3.hash(workflow_id, 0, signed=False) % shards
