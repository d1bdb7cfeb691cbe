"""pamqp's timestamp decoding, made total: no AMQP timestamp can drop the connection.

pamqp turns every timestamp (a header table's 'T' field, the `timestamp` property) into a
datetime, and one that datetime cannot hold (past the year 9999, a negative time written as a
u64, a millisecond epoch past 9999) raises inside aiormq's frame reader. aiormq then closes the
whole connection, the robust connection reconnects, the unacked message comes back, and its
consumer is wedged for good (mosquito/aiormq#186, open). pika fixed the same bug by keeping the
raw integer (pika/pika#1699); `install()` does that here, in every process that imports
orchestrator/bus.py.
"""

from __future__ import annotations

import datetime
import struct

from pamqp import common, decode

# pamqp's own decoder, kept before `install()` replaces it: the result for every value it takes.
PAMQP_TIMESTAMP = decode.timestamp
_U64 = struct.Struct(">Q")


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


def install() -> None:
    """Put the total decoders where pamqp looks them up; calling it again changes nothing."""
    decode.timestamp = timestamp  # type: ignore[assignment]  # an int is the point
    decode.TABLE_MAPPING[b"T"] = timestamp  # header tables and arrays
    decode.METHODS["timestamp"] = property_timestamp  # Basic.Properties, through by_type
