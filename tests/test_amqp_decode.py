"""Timestamps datetime cannot hold (orchestrator/amqp_decode.py): decoded as pamqp did when it
could, as the raw u64 when not, and on a real cluster parked like any other bad message
instead of dropping the connection for good."""

from __future__ import annotations

import datetime
import struct
from typing import Any, cast

import aio_pika
import aiormq
import pytest
from aiormq.abc import DeliveredMessage
from pamqp import decode, encode
from pamqp.commands import Basic
from pamqp.header import ContentHeader

import orchestrator.bus  # noqa: F401 (installs the decoders, as in every process)
from orchestrator import amqp_decode
from orchestrator.consuming import Incoming
from orchestrator.keys import Names
from orchestrator.settings import Settings
from router.client import Router
from router.hashing import shard_for
from tests.test_hostile import dead_reasons

U64 = struct.Struct(">Q")
UTC = datetime.UTC
# pamqp reads a u64 over 0xFFFFFFFF as milliseconds.
IN_RANGE = {
    0: datetime.datetime(1970, 1, 1, tzinfo=UTC),
    0xFFFFFFFF: datetime.datetime(2106, 2, 7, 6, 28, 15, tzinfo=UTC),
    0xFFFFFFFF + 1: datetime.datetime.fromtimestamp(4_294_967.296, tz=UTC),
    1_772_000_000_000: datetime.datetime.fromtimestamp(1_772_000_000, tz=UTC),
    253_402_300_799_999: datetime.datetime.fromtimestamp(253_402_300_799.999, tz=UTC),
}
OUT_OF_RANGE = (
    253_402_300_800_000,  # the first millisecond of the year 10000
    2**63 + 5,
    2**64 - 1,  # the max u64, and -1 as the Java client writes it
    2**64 - 86_400,  # a day before 1970, as a u64
)


def test_a_timestamp_in_range_decodes_as_pamqp_decoded_it() -> None:
    for raw, expected in IN_RANGE.items():
        assert amqp_decode.timestamp(U64.pack(raw)) == (8, expected)
        assert amqp_decode.PAMQP_TIMESTAMP(U64.pack(raw)) == (8, expected)
        assert amqp_decode.property_timestamp(U64.pack(raw)) == (8, expected)


def test_a_timestamp_out_of_range_is_the_raw_integer_in_a_table_and_none_as_a_property() -> None:
    for raw in OUT_OF_RANGE:
        assert amqp_decode.timestamp(U64.pack(raw) + b"rest") == (8, raw)
        assert amqp_decode.property_timestamp(U64.pack(raw)) == (8, None)


def test_a_truncated_timestamp_is_still_a_broken_frame() -> None:
    with pytest.raises(ValueError, match="Could not unpack timestamp"):
        amqp_decode.timestamp(b"\x00" * 7)


def test_importing_the_bus_installed_the_decoders_and_installing_again_changes_nothing() -> None:
    for _ in range(2):
        assert decode.timestamp is amqp_decode.timestamp
        assert decode.TABLE_MAPPING[b"T"] is amqp_decode.timestamp
        assert decode.METHODS["timestamp"] is amqp_decode.property_timestamp
        assert decode.METHODS["shortstr"] is amqp_decode.short_str
        assert ContentHeader.unmarshal is amqp_decode.content_header
        amqp_decode.install()


def test_a_short_string_that_is_no_utf8_reads_with_replacements() -> None:
    assert amqp_decode.short_str(b"\x03abcdef") == (4, "abc")  # as pamqp
    assert amqp_decode.short_str(b"\x02\xff\xfe") == (3, "\ufffd\ufffd")
    with pytest.raises(ValueError, match="Could not unpack short string"):
        amqp_decode.short_str(b"")
    # A delivery whose routing key is no UTF-8 (a fanout exchange takes any): its method frame
    # decodes, so the connection stays up.
    frame = struct.pack(">HH", 60, 60) + encode.short_string("c") + struct.pack(">Q?", 1, False)
    frame += encode.short_string("x") + b"\x02\xff\xfe"
    deliver = Basic.Deliver()
    deliver.unmarshal(frame[4:])
    assert (deliver.exchange, deliver.routing_key) == ("x", "\ufffd\ufffd")


def test_properties_pamqp_cannot_read_leave_a_delivery_with_none() -> None:
    """A header of a type AMQP has not, a header name that is no UTF-8: the message is kept,
    with no properties, and judged by its body."""
    table = encode.short_string("ok") + b"S" + struct.pack(">I", 2) + b"hi"
    for broken in (table + b"\x01kZ", table + b"\x01\xffS" + struct.pack(">I", 0)):
        raw = struct.pack(">HI", Basic.Properties.flags["headers"], len(broken)) + broken
        header = ContentHeader()
        header.unmarshal(struct.pack(">HHQ", 60, 0, 5) + raw)
        assert header.body_size == 5 and header.properties.headers is None
    # Tables nested too deep for pamqp's recursion: a RecursionError, not a ValueError.
    nested = b""
    for _ in range(3000):
        nested = encode.short_string("n") + b"F" + struct.pack(">I", len(nested)) + nested
    raw = struct.pack(">HI", Basic.Properties.flags["headers"], len(nested)) + nested
    header = ContentHeader()
    header.unmarshal(struct.pack(">HHQ", 60, 0, 5) + raw)
    assert header.body_size == 5 and header.properties.headers is None
    header = ContentHeader()
    good = struct.pack(">HI", Basic.Properties.flags["headers"], len(table)) + table
    header.unmarshal(struct.pack(">HHQ", 60, 0, 5) + good)
    assert header.properties.headers == {"ok": "hi"}  # as pamqp
    with pytest.raises(struct.error):
        ContentHeader().unmarshal(b"\x00" * 11)  # truncated: broken, as pamqp says


def stamped(header_stamps: dict[str, int] | None = None, stamp: int | None = None) -> bytes:
    """Basic.Properties as on the wire, with 'T' headers and a `timestamp` of any u64: pamqp
    (and so aio-pika) refuses to encode one datetime cannot hold. A text header goes last."""
    flags, parts = 0, []
    if header_stamps is not None:
        entries = b"".join(
            encode.short_string(name) + b"T" + U64.pack(raw) for name, raw in header_stamps.items()
        )
        entries += encode.short_string("x-after") + encode.encode_table_value("kept")
        flags |= Basic.Properties.flags["headers"]
        parts.append(struct.pack(">I", len(entries)) + entries)
    if stamp is not None:
        flags |= Basic.Properties.flags["timestamp"]
        parts.append(U64.pack(stamp))
    return struct.pack(">H", flags) + b"".join(parts)


def test_a_delivery_with_such_timestamps_reaches_every_reader_of_it() -> None:
    """pamqp's ContentHeader, aiormq's DeliveredMessage, aio-pika's IncomingMessage and our
    Incoming all take an int header and a None timestamp."""
    stamps = {f"x-stamp-{n}": raw for n, raw in enumerate(OUT_OF_RANGE)}
    header = ContentHeader()
    header.unmarshal(struct.pack(">HHQ", 60, 0, 2) + stamped(stamps, 2**63 + 5))
    assert header.properties.headers == {**stamps, "x-after": "kept"}
    assert header.properties.timestamp is None
    deliver = Basic.Deliver(consumer_tag="c", delivery_tag=1, routing_key="q")
    channel = cast(Any, None)
    delivered = DeliveredMessage(delivery=deliver, header=header, body=b"{}", channel=channel)
    assert aio_pika.IncomingMessage(delivered).headers == header.properties.headers
    assert aio_pika.IncomingMessage(delivered).timestamp is None
    assert Incoming(delivered, channel, no_ack=False).headers == header.properties.headers


class RawProperties(Basic.Properties):
    """Properties sent as the bytes given."""

    def __init__(self, raw: bytes) -> None:
        super().__init__()
        self.raw = raw

    def marshal(self) -> bytes:
        return self.raw


@pytest.mark.e2e
async def test_messages_with_properties_pamqp_cannot_read_are_parked_and_the_shard_goes_on(
    cluster: Router, settings: Settings
) -> None:
    """Before amqp_decode, each took the owner's connection down on every delivery."""
    good = "ts-good"
    shard = str(shard_for(good, settings.shards))  # the shard the good program needs
    exchange = Names(settings.prefix).orchestrator_exchange
    odd_name = b"\x01\xffS" + struct.pack(">I", 0)  # a header named by a byte of no UTF-8
    hostile = {
        b'{"kind": "start", "wf": "ghost-ts-header"}': stamped({"x-sent-at": 2**63 + 5}),
        b'{"kind": "start", "wf": "ghost-ts-stamp"}': stamped(stamp=2**64 - 1),
        # A message id and a header name that are no UTF-8: each dropped it too. (A header of
        # no AMQP type RabbitMQ refuses itself.)
        b'{"kind": "start", "wf": "ghost-id"}': struct.pack(
            ">H", Basic.Properties.flags["message_id"]
        )
        + b"\x01\xff",
        b'{"kind": "start", "wf": "ghost-name"}': struct.pack(
            ">HI", Basic.Properties.flags["headers"], len(odd_name)
        )
        + odd_name,
    }
    connection = await aiormq.connect(settings.amqp_url)
    try:
        channel = await connection.channel()
        for body, properties in hostile.items():
            await channel.basic_publish(
                body, exchange=exchange, routing_key=shard, properties=RawProperties(properties)
            )
    finally:
        await connection.close()
    reasons = sorted(await dead_reasons(settings, 4))
    assert reasons == [
        f"ghost-{name}: no such program" for name in ("id", "name", "ts-header", "ts-stamp")
    ]
    await cluster.submit({"steps": [{"task": "echo"}]}, None, good)
    assert (await cluster.wait(good, timeout_s=30))["status"] == "completed"
