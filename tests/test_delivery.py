"""The delivery policy (orchestrator/delivery.py) on an in-memory delivery and transport: what
becomes of a message whose handling fails, by the kind of failure."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import pytest
from redis.exceptions import ClusterDownError, ReadOnlyError
from redis.exceptions import ConnectionError as RedisConnectionError

from orchestrator import delivery as policy
from orchestrator.delivery import FAILURES, SENT_ID, Poison, process, sent_id, split
from orchestrator.messages import CARRY


@dataclass
class Held:
    body: bytes = b"{}"
    headers: dict[str, Any] = field(default_factory=dict)
    redelivered: bool | None = False
    priority: int | None = 0
    reply_to: str | None = None
    correlation_id: str | None = None
    message_id: str | None = None
    settled: list[str] = field(default_factory=list)

    async def ack(self) -> None:
        self.settled.append("ack")

    async def nack(self, *, requeue: bool = True) -> None:
        self.settled.append("nack")


@dataclass
class Transport:
    down: bool = False
    sent: list[tuple[bytes, dict[str, Any], dict[str, Any]]] = field(default_factory=list)
    dead: list[str] = field(default_factory=list)

    async def dead_letter(self, body: bytes, *, reason: str, source: str, **_: Any) -> None:
        self.dead.append(reason)

    async def requeue(
        self, queue: str, body: bytes, headers: dict[str, Any], priority: int | None, **ids: Any
    ) -> None:
        if self.down:
            raise ConnectionResetError("RabbitMQ is away too")
        self.sent.append((body, headers, ids))


@pytest.fixture(autouse=True)
def _no_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(policy, "RETRY_PAUSE_S", 0)


async def _fail(held: Held, bus: Transport, exc: Exception, limit: int = 3) -> None:
    async with process(held, bus, "q", limit=limit):
        raise exc


def _copy(sent: tuple[bytes, dict[str, Any], dict[str, Any]], n: int) -> Held:
    """What the queue delivers of a copy: aiormq gave it a message id of its own."""
    body, headers, ids = sent
    return Held(body=body, headers=headers, message_id=f"random-{n}", **ids)


async def test_a_lost_redis_republishes_uncounted_and_never_nacks() -> None:
    """A quorum queue counts each nack against its delivery limit: a Redis restart of a few
    seconds would have the broker dead-letter the messages in flight."""
    bus = Transport()
    held = Held(reply_to="amq.rabbitmq.reply-to", correlation_id="c1", message_id="m1")
    for n in range(10):  # far past the limit of 3
        await _fail(held, bus, RedisConnectionError("Connection refused"))
        held = _copy(bus.sent[-1], n)
    assert bus.dead == [] and len(bus.sent) == 10
    _, headers, ids = bus.sent[-1]
    assert headers == {FAILURES: 0, SENT_ID: "m1"}  # present: the copy counts as redelivered
    assert ids == {"reply_to": "amq.rabbitmq.reply-to", "correlation_id": "c1"}
    assert policy.redelivered(held) and sent_id(held, held.message_id) == "m1"


@pytest.mark.parametrize(
    "exc",
    [ConnectionResetError(), ClusterDownError("failing over"), ReadOnlyError("READONLY")],
)
async def test_connections_lost_and_failovers_are_not_counted(exc: Exception) -> None:
    bus = Transport()
    await _fail(Held(headers={FAILURES: 2}), bus, exc)
    assert bus.dead == [] and bus.sent[-1][1][FAILURES] == 2


async def test_an_os_error_that_is_no_lost_connection_counts() -> None:
    """Uncounted, a message whose own handling raises one (a broken pipe to a child that
    dies on it, a timeout of ours) was retried forever."""
    bus = Transport()
    await _fail(Held(headers={FAILURES: 2}), bus, TimeoutError("over budget"))
    assert bus.dead == ["failed 3 times, the limit; last: over budget"]


async def test_a_hostile_failures_header_is_zero_and_the_message_settled() -> None:
    for value in (float("inf"), float("nan"), "x", -5, [1]):
        bus = Transport()
        held = Held(headers={FAILURES: value})
        await _fail(held, bus, ValueError("bad"))
        assert held.settled == ["ack"] and bus.sent[-1][1][FAILURES] == 1, value


async def test_other_failures_count_and_dead_letter_at_the_limit() -> None:
    bus = Transport()
    held = Held(headers={FAILURES: 1})
    await _fail(held, bus, RedisConnectionError("refused"))  # does not count
    assert bus.sent[-1][1][FAILURES] == 1 and held.settled == ["ack"]
    held = Held(headers=bus.sent[-1][1])
    await _fail(held, bus, ValueError("bad"))
    assert bus.sent[-1][1][FAILURES] == 2
    held = Held(headers=bus.sent[-1][1])
    await _fail(held, bus, ValueError("bad"))
    assert bus.dead == ["failed 3 times, the limit; last: bad"] and held.settled == ["ack"]


async def test_with_rabbitmq_away_too_the_message_is_handed_back_as_it_is() -> None:
    bus = Transport(down=True)
    held = Held()
    await _fail(held, bus, RedisConnectionError("refused"))
    assert held.settled == ["nack"] and bus.sent == [] and bus.dead == []


async def test_poison_is_parked_not_retried() -> None:
    bus = Transport()
    held = Held()
    await _fail(held, bus, Poison("never"))
    assert bus.dead == ["never"] and bus.sent == [] and held.settled == ["ack"]


def test_a_copy_keeps_the_message_id_its_sender_gave() -> None:
    """The broker client gives a copy a message id of its own; an ingress request without a
    workflow id is identified by the sender's (none: by its body), so a copy must not differ."""
    assert sent_id(Held(), "m1") == "m1"
    assert sent_id(Held(headers={SENT_ID: ""}), "random-by-aiormq") is None
    assert sent_id(Held(headers={SENT_ID: "m1"}), "random-by-aiormq") == "m1"
    assert sent_id(Held(headers={SENT_ID: b"m1"}), "x") == "m1"
    assert sent_id(Held(headers={SENT_ID: 7}), "x") == "x"  # not ours: the delivery's own
    assert sent_id(Held(headers={SENT_ID: "m" * 256}), "x") == "x"


async def test_a_copy_of_a_message_without_an_id_says_so() -> None:
    bus = Transport()
    await _fail(Held(), bus, ValueError("bad"))
    assert bus.sent[-1][1][SENT_ID] == ""
    assert sent_id(_copy(bus.sent[-1], 1), "random-1") is None  # as the original: none


async def test_a_copy_of_a_message_with_a_header_not_ours_keeps_the_senders_id() -> None:
    """The first try reads the sender's id (none) past a header it cannot read; a copy that
    kept that header took aiormq's random id instead, deriving another workflow id."""
    for bad in (7, "m" * 256):
        bus = Transport()
        original = Held(headers={SENT_ID: bad})
        assert sent_id(original, original.message_id) is None
        await _fail(original, bus, ValueError("bad"))
        copy = _copy(bus.sent[-1], 1)
        assert sent_id(copy, copy.message_id) is None, bad


# Headers a hostile sender can give that the client cannot write back: a long string that is
# no UTF-8 (read as bytes), a double too large for the client's single float; and a boolean, a
# number past 64 bits, a long text, and headers that are not ours.
HOSTILE_HEADERS = {
    "x-shardflow-odd": b"\xff\xfe",
    "x-shardflow-big": 1e300,
    "x-shardflow-flag": True,
    "x-shardflow-huge": 2**64,
    "x-shardflow-long": "m" * 256,
    "k": "fine",
    "x-death": [{"count": 1}],
}


async def test_a_copy_keeps_only_our_headers_as_values_the_client_can_write_back() -> None:
    """Every try to publish a copy with a header the client could not write back failed, so
    the message (a bundle split too) went round forever, never parked."""
    bus = Transport()
    await _fail(Held(headers={FAILURES: 1, CARRY: 1, **HOSTILE_HEADERS}), bus, ValueError("x"))
    assert bus.sent[-1][1] == {FAILURES: 2, CARRY: 1, SENT_ID: ""}
    bus = Transport()
    await split(Held(headers={CARRY: 1, **HOSTILE_HEADERS}), bus, "q", [b"a", b"b"])
    assert [(body, headers) for body, headers, _ in bus.sent] == [
        (b"a", {FAILURES: 0, CARRY: 1}),
        (b"b", {FAILURES: 0, CARRY: 1}),
    ]


async def test_an_outage_logs_a_line_a_queue_every_few_seconds_not_one_a_message(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """5 messages in flight through 30 s of Redis away made 125 warnings: the one line that
    named the fault was lost among them."""
    clock = [1000.0]
    monkeypatch.setattr(policy.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(policy, "_quiet", {})
    caplog.set_level(logging.WARNING, logger="orchestrator.delivery")
    bus = Transport()
    for _ in range(3):  # a second's tries of 25 messages, from two queues
        for n in range(25):
            async with process(Held(), bus, f"q{n % 2}", limit=3):
                raise RedisConnectionError("Connection refused")
        clock[0] += 5
    said = [r.getMessage() for r in caplog.records]
    assert len(bus.sent) == 75 and len(said) == 4, said  # q0 and q1, at 0 s and at 10 s
    fault = "ConnectionError: Connection refused"  # redis-py's repr: network:ConnectionError
    assert said[0] == f"q0: message requeued after {fault}"
    assert said[2] == f"q0: message requeued after {fault} (25 more in the last 10s)"


async def test_redis_refusing_writes_is_never_counted_against_a_message() -> None:
    """Full (OOM, as noeviction answers), its disk failing, a long script: counted, every
    message in flight was parked within 10 s, and its program stayed running for good."""
    from redis._parsers.base import BaseParser

    for reply in ("OOM command not allowed when used memory > 'maxmemory'.", "BUSY a script"):
        bus = Transport()
        held = Held(headers={FAILURES: 2})
        for n in range(5):  # past the limit of 3
            await _fail(held, bus, BaseParser.parse_error(reply))
            held = _copy(bus.sent[-1], n)
        assert bus.dead == [] and bus.sent[-1][1][FAILURES] == 2, reply


async def test_a_message_parked_at_the_limit_is_answered_as_a_poison_one_is() -> None:
    """An ingress request parked at the limit got no reply: its sender heard nothing."""
    told: list[str] = []

    async def answer(reason: str) -> None:
        told.append(reason)

    bus = Transport()
    async with process(Held(headers={FAILURES: 2}), bus, "q", limit=3, on_poison=answer):
        raise TimeoutError("over budget")
    assert bus.dead == told == ["failed 3 times, the limit; last: over budget"]
