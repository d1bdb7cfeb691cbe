"""pamqp's decoding of what a publisher sets, made total: no timestamp, text or header a
publisher can send drops the connection.

pamqp turns every timestamp (a header table's 'T' field, the `timestamp` property) into a
datetime, and one that datetime cannot hold (past the year 9999, a negative time written as a
u64, a millisecond epoch past 9999) raises inside aiormq's frame reader. aiormq then closes the
whole connection, the robust connection reconnects, the unacked message comes back, and its
consumer is wedged for good (mosquito/aiormq#186, open). pika fixed the same bug by keeping the
raw integer (pika/pika#1699); `install()` does that here, in every process that imports
orchestrator/bus.py.

The same holds for a short string that is no UTF-8 (a message id, a routing key: RabbitMQ
passes any bytes on), read here with U+FFFD for what is not, and for any other property pamqp
cannot read (a header of an unknown type, a header name that is no UTF-8): the message comes
without properties, to be judged by its body like any other.
"""

from __future__ import annotations

import datetime
import struct

from pamqp import commands, common, decode
from pamqp.header import ContentHeader

# pamqp's own decoder, kept before `install()` replaces it: the result for every value it takes.
PAMQP_TIMESTAMP = decode.timestamp
PAMQP_CONTENT_HEADER = ContentHeader.unmarshal
_U64 = struct.Struct(">Q")
_HEADER = struct.Struct(">HHQ")  # a content header's class, weight and body size


def timestamp(value: bytes) -> tuple[int, common.FieldValue]:
    """pamqp's decoding of a timestamp, or the u64 it read when datetime cannot hold it."""
    try:
        return PAMQP_TIMESTAMP(value)
    except (ValueError, OverflowError, OSError):
        if len(value) < _U64.size:
            raise  # a truncated frame is broken, as pamqp says
        return _U64.size, _U64.unpack_from(value)[0]


def property_timestamp(value: bytes) -> tuple[int, datetime.datetime | None]:
    """The `timestamp` property: None for one out of range, since aio-pika's IncomingMessage
    refuses anything but a datetime or None there (`decode_timestamp`)."""
    consumed, decoded = timestamp(value)
    return consumed, decoded if isinstance(decoded, datetime.datetime) else None


def short_str(value: bytes) -> tuple[int, str]:
    """pamqp's short string, with U+FFFD for bytes that are no UTF-8 instead of an error."""
    try:
        length = value[0]
    except IndexError:
        raise ValueError("Could not unpack short string value") from None
    return length + 1, value[1 : length + 1].decode("utf-8", errors="replace")


def content_header(header: ContentHeader, data: bytes) -> None:
    """pamqp's content header, or, when its properties cannot be read, the header with none."""
    try:
        PAMQP_CONTENT_HEADER(header, data)
    # UnicodeDecodeError is a ValueError; tables nested a few hundred deep, a RecursionError.
    except (ValueError, OverflowError, OSError, RecursionError):
        if len(data) < _HEADER.size:
            raise  # a truncated frame is broken
        header.class_id, header.weight, header.body_size = _HEADER.unpack_from(data)
        header.properties = commands.Basic.Properties()


def install() -> None:
    """Put the total decoders where pamqp looks them up; calling it again changes nothing."""
    decode.timestamp = timestamp  # type: ignore[assignment]  # an int is the point
    decode.TABLE_MAPPING[b"T"] = timestamp  # header tables and arrays
    decode.METHODS["timestamp"] = property_timestamp  # Basic.Properties, through by_type
    decode.short_str = short_str
    decode.METHODS["shortstr"] = short_str  # method frames and properties, through by_type
    ContentHeader.unmarshal = content_header  # type: ignore[method-assign,assignment]
