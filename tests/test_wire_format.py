"""Cross-language routing: the committed shard vectors, checked against shardflow and against a
from-scratch MurmurHash3 (the 20 lines another language would port)."""

import json
import re
from pathlib import Path
from typing import Any

import pytest

from orchestrator import messages
from orchestrator.machine import Leaf, first
from orchestrator.messages import (
    MessageError,
    Next,
    Start,
    TaskMessage,
    decode_shard_message,
    decode_task,
    encode,
)
from orchestrator.plans import Plan
from orchestrator.program import parse_program
from orchestrator.transitions import task_messages
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


@pytest.mark.parametrize(("chunk", "sizes"), [(1, [1] * 7), (3, [3, 3, 1]), (7, [7]), (50, [7])])
def test_a_bag_goes_out_in_chunks_that_split_back_into_its_members(
    chunk: int, sizes: list[int]
) -> None:
    program = parse_program(
        {
            "steps": [
                {"bag": [{"task": f"t{i}", "args": {"i": i}} for i in range(7)], "chunk": chunk}
            ]
        }
    )
    leaf = first(program)
    assert isinstance(leaf, Leaf)
    by_pool = task_messages("wf-1", Plan(program, {"x": 1}, owner=2), leaf)
    assert list(by_pool) == ["parallel"]
    bodies = by_pool["parallel"]
    messages = [decode_task(body) for body in bodies]
    assert [len(message.split()) for message in messages] == sizes
    tasks = [task for message in messages for task in message.split()]
    assert [(t.index, t.task, t.args, t.size) for t in tasks] == [
        (i, f"t{i}", {"i": i}, 7) for i in range(7)
    ]
    assert all(t.batch == [] and t.input == {"x": 1} and t.owner == 2 for t in tasks)
    # A retry sends one member alone, whatever the chunk.
    alone = task_messages("wf-1", Plan(program, None, owner=2), leaf, attempt=1, only=5)
    assert [(t.index, t.attempt) for t in decode_task(alone["parallel"][0]).split()] == [(5, 1)]


def test_a_bag_goes_to_its_pool_and_its_members_to_theirs_in_chunks_of_one_pool() -> None:
    members = [{"task": f"t{i}"} for i in range(7)]
    for i in (1, 4, 5):
        members[i]["pool"] = "gpu"
    program = parse_program({"steps": [{"bag": members, "chunk": 2, "pool": "reports"}]})
    leaf = first(program)
    assert isinstance(leaf, Leaf)
    by_pool = task_messages("wf-1", Plan(program, None, owner=0), leaf)
    chunks = {
        pool: [[t.index for t in decode_task(body).split()] for body in bodies]
        for pool, bodies in by_pool.items()
    }
    assert chunks == {"reports": [[0, 2], [3, 6]], "gpu": [[1, 4], [5]]}
    # A retry of one member goes to that member's pool.
    assert list(task_messages("wf-1", Plan(program, None, owner=0), leaf, only=4)) == ["gpu"]
    single = parse_program({"steps": [{"task": "t", "pool": "reports"}]})
    leaf = first(single)
    assert isinstance(leaf, Leaf)
    assert list(task_messages("wf-1", Plan(single, None, owner=0), leaf)) == ["reports"]


def test_a_task_message_has_no_pool_field_so_every_worker_version_reads_it() -> None:
    # The pool is the queue a message is published to, never a field of it: a worker that
    # predates named pools decodes every task message a newer owner sends, and the reverse.
    program = parse_program({"steps": [{"task": "t", "pool": "reports"}]})
    leaf = first(program)
    assert isinstance(leaf, Leaf)
    (body,) = task_messages("wf-1", Plan(program, None, owner=1), leaf)["reports"]
    assert set(json.loads(body)) == {
        "wf", "path", "index", "size", "task", "args", "input", "prev", "input_ref",
        "prev_ref", "iteration", "attempt", "owner", "timeout_s", "batch",
    }  # fmt: skip
    # A map member's item is carried (and only then: older workers refuse unknown fields).
    mapped = parse_program({"steps": [{"map": "[7, null]", "task": "t", "max_items": 2,
                                       "chunk": 2}]})  # fmt: skip
    leaf = first(mapped)
    assert isinstance(leaf, Leaf)
    (body,) = task_messages("wf-1", Plan(mapped, None, owner=1), leaf)["parallel"]
    carried = json.loads(body)
    assert (carried["item"], carried["batch"][0].keys()) == (7, {"index", "task", "args",
                                                                "timeout_s"})  # fmt: skip
    assert decode_task(body).split()[1].item is None
    old = b'{"wf": "w", "path": "0", "task": "t", "owner": 1}'  # the minimal, older shape
    assert decode_task(old) == TaskMessage(wf="w", path="0", task="t", owner=1)


def test_a_large_value_is_referred_to_or_carried_never_both() -> None:
    from orchestrator.messages import (
        MAX_MESSAGE_BYTES,
        Failed,
        ItemFrom,
        MessageError,
        Slot,
        decode_shard_message,
    )

    referred = TaskMessage(wf="w", path="1", task="t", owner=0, input_ref=True, prev_ref=True)
    assert decode_task(encode(referred)) == referred
    both = b'{"wf": "w", "path": "1", "task": "t", "owner": 0, "prev": 1, "prev_ref": true}'
    with pytest.raises(MessageError, match="prev: carried and referred to at once"):
        decode_task(both)
    stored = b'{"kind": "next", "wf": "w", "path": "1", "output": 1, "stored": true}'
    with pytest.raises(MessageError, match="output: carried and referred to at once"):
        decode_shard_message(stored)
    assert decode_shard_message(encode(Failed(wf="w", path="1", error="e", prev_ref=True)))
    # A compensation's large item is read where its step's output was recorded.
    read = TaskMessage(
        wf="w", path="saga:1", index=0, size=3, task="t", owner=0,
        item_from=ItemFrom(step=1, index=3),
        batch=[Slot(index=1, task="u", item_from=ItemFrom(step=1)), Slot(index=2, task="v")],
    )  # fmt: skip
    assert decode_task(encode(read)) == read
    assert json.loads(encode(read))["batch"][1].keys() == {"index", "task", "args", "timeout_s"}
    both = b'{"wf": "w", "path": "0", "task": "t", "owner": 0, "item": 1, "item_from": {"step": 1}}'
    with pytest.raises(MessageError, match="item: carried and referred to at once"):
        decode_task(both)
    # Only a compensation reads its item, from the step it undoes, each member its own.
    elsewhere = read.model_dump() | {"path": "1"}
    with pytest.raises(MessageError, match="only a compensation reads its item"):
        decode_task(json.dumps(elsewhere).encode())
    other_step = read.model_dump() | {"item_from": {"step": 2, "index": 3}}
    with pytest.raises(MessageError, match="only a compensation reads its item"):
        decode_task(json.dumps(other_step).encode())
    twice = read.model_dump() | {"item_from": {"step": 1, "index": None}}
    with pytest.raises(MessageError, match="two members read one output"):
        decode_task(json.dumps(twice).encode())
    with pytest.raises(MessageError, match=r"item_from\.step"):
        decode_task(
            b'{"wf": "w", "path": "saga:1", "task": "t", "owner": 0, "item_from": {"step": -1}}'
        )
    with pytest.raises(MessageError, match="over 16777216"):
        decode_task(b" " * (MAX_MESSAGE_BYTES + 1))


def test_the_epoch_of_a_redriven_run_travels_only_when_it_is_not_0() -> None:
    from orchestrator.messages import (
        Deadline,
        Failed,
        MessageError,
        Next,
        Wake,
        decode_shard_message,
    )

    program = parse_program({"steps": [{"task": "t"}]})
    leaf = first(program)
    assert isinstance(leaf, Leaf)
    (first_run,) = task_messages("w", Plan(program, None, owner=1), leaf)["serial"]
    assert "epoch" not in json.loads(first_run)  # workers from before redrive read it
    (again,) = task_messages("w", Plan(program, None, owner=1), leaf, epoch=2)["serial"]
    assert json.loads(again)["epoch"] == 2 and decode_task(again).epoch == 2
    reports = [
        Next(wf="w", path="0", output=1),
        Failed(wf="w", path="0", error="e"),
        Wake(wf="w", path="0"),
        Deadline(wf="w", deadline_s=1.0),
    ]
    for report in reports:
        assert "epoch" not in json.loads(encode(report))
        carried = report.model_copy(update={"epoch": 3})
        assert decode_shard_message(encode(carried)) == carried
    with pytest.raises(MessageError, match="epoch"):
        decode_shard_message(b'{"kind": "next", "wf": "w", "path": "0", "epoch": -1}')


@pytest.mark.parametrize(
    ("body", "fault"),
    [
        (b'{"kind": "next", "wf": "w", "path": "0", "output": {"v": NaN}}', "NaN is not JSON"),
        (b'{"kind": "next", "wf": "w", "path": "0", "output": [-Infinity]}', "Infinity"),
        (b'{"kind": "next", "wf": "w", "path": "0", "output": 1E+400}', "'1E+400' is out of"),
        (b'{"kind": "next", "wf": "w", "path": "0", "output": [-2.5E+0999]}', "out of range"),
        # No exponent: 309 digits before the point make an infinite float too; with two, 210.
        (b'{"kind": "next", "wf": "w", "path": "0", "output": 1' + b"0" * 320 + b".5}", "range"),
        (
            b'{"kind": "next", "wf": "w", "path": "0", "output": {"v": 1' + b"0" * 210 + b"e99}}",
            "range",
        ),
        (
            b'{"kind": "next", "wf": "w", "path": "0", "output": [-9' + b"9" * 209 + b"E+99]}",
            "range",
        ),
        (b'{"kind": "failed", "wf": "w", "path": "0", "error": "x", "iteration": -5}', "iter"),
        (b'{"kind": "failed", "wf": "w", "path": "0", "error": "x", "iteration": 100000}', "iter"),
    ],
)
def test_a_shard_message_holding_what_json_cannot_carry_is_refused(body: bytes, fault: str) -> None:
    with pytest.raises(MessageError, match=re.escape(fault)):
        decode_shard_message(body)


def test_the_words_nan_and_infinity_and_big_exponents_in_strings_are_kept() -> None:
    body = b'{"kind": "next", "wf": "w", "path": "0", "output": ["NaN", "Infinity", "e400"]}'
    assert decode_shard_message(body).output == ["NaN", "Infinity", "e400"]  # type: ignore[union-attr]
    task = b'{"wf": "w", "path": "0", "task": "t", "owner": 0, "args": {"x": 1e308}}'
    assert decode_task(task).args == {"x": 1e308}
    with pytest.raises(MessageError, match="NaN is not JSON"):
        decode_task(b'{"wf": "w", "path": "0", "task": "t", "owner": 0, "prev": NaN}')


def test_a_users_value_as_deep_as_the_ingress_takes_passes_in_messages_with_big_numbers() -> None:
    # The ingress takes 64 levels; a message holds the value a level or two deeper, and
    # 1e100 sends it to the number check, which once refused it as too deep.
    value: Any = 1e100
    for _ in range(64):
        value = [value]
    task = TaskMessage(wf="w", path="0", task="t", owner=0, input=value, prev={"a": value})
    assert decode_task(encode(task)) == task
    report = Next(wf="w", path="0", output={"a": value})
    assert decode_shard_message(encode(report)) == report
    with pytest.raises(MessageError, match="number '1e400' is out of range"):
        decode_task(encode(task).replace(b"1e+100", b"1e400"))


def test_only_a_body_that_may_hold_an_infinite_number_is_parsed_twice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    strict: list[bytes] = []
    monkeypatch.setattr(messages, "check_numbers", lambda body, *_: strict.append(body))
    # A hex id holds "e851" one time in three: an exponent only in the cheap scan.
    plain = b'{"kind": "next", "wf": "40c1a89de851", "path": "0", "output": [1.5e10, "x1e400"]}'
    decode_shard_message(plain)
    decode_shard_message(plain.replace(b"40c1a89de851", b"1e851a89dc40"))  # a quote before it
    assert strict == []
    for number in (b"1e400", b"-0.5E+308", b"7" * 200):
        body = b'{"kind": "next", "wf": "w", "path": "0", "output": ' + number + b"}"
        decode_shard_message(body)
        assert strict[-1] == body
    # A large body is parsed strictly at once: the exact scan would cost more than the parse.
    large = plain.replace(b'"x1e400"', b'"' + b"x" * messages.EXACT_SCAN_BYTES + b'"')
    decode_shard_message(large)
    assert strict[-1] == large
