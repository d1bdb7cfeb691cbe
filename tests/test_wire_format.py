"""Cross-language routing: the committed shard vectors, checked against shardflow and against a
from-scratch MurmurHash3 (the 20 lines another language would port)."""

import json
from pathlib import Path

import pytest

from orchestrator.messages import (
    Next,
    Start,
    TaskMessage,
    decode_shard_message,
    decode_task,
    encode,
)
from router.hashing import shard_for

VECTORS = json.loads((Path(__file__).parent.parent / "docs" / "shard-vectors.json").read_text())


def murmur3_x86_32(data: bytes, seed: int = 0) -> int:
    """MurmurHash3_x86_32, straight from the reference algorithm."""
    c1, c2, mask = 0xCC9E2D51, 0x1B873593, 0xFFFFFFFF
    h = seed
    rotl = lambda x, r: ((x << r) | (x >> (32 - r))) & mask  # noqa: E731
    blocks = len(data) // 4
    for i in range(blocks):
        k = int.from_bytes(data[4 * i : 4 * i + 4], "little")
        k = rotl((k * c1) & mask, 15) * c2 & mask
        h = (rotl(h ^ k, 13) * 5 + 0xE6546B64) & mask
    tail, k = data[4 * blocks :], 0
    for i, byte in enumerate(tail):
        k |= byte << (8 * i)
    if tail:
        h ^= rotl((k * c1) & mask, 15) * c2 & mask
    h ^= len(data)
    for shift, factor in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
        h = ((h ^ (h >> shift)) * factor) & mask
    return h ^ (h >> 16)


@pytest.mark.parametrize("vector", VECTORS["vectors"], ids=lambda v: v["workflow_id"] or "empty")
def test_vectors_match_shardflow_and_the_reference_algorithm(vector: dict) -> None:
    data = bytes.fromhex(vector["utf8_hex"])
    assert data == vector["workflow_id"].encode()
    assert murmur3_x86_32(data) == vector["mmh3_x86_32_seed0"]
    for shards, shard in vector["shard"].items():
        assert shard_for(vector["workflow_id"], int(shards)) == shard


def test_the_documented_messages_decode() -> None:
    assert decode_shard_message(b'{"kind": "start", "wf": "order-1"}') == Start(wf="order-1")
    next_ = decode_shard_message(
        b'{"kind": "next", "wf": "order-1", "path": "2/iter:0/1", "output": [1]}'
    )
    assert next_ == Next(wf="order-1", path="2/iter:0/1", output=[1])
    task = TaskMessage(wf="order-1", path="1", index=0, size=2, task="resize", owner=3)
    assert decode_task(encode(task)) == task
