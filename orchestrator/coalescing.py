"""AMQP frames written in one event-loop turn go out in one write (one system call).

aiormq writes every frame on its own: a publish, then an ack, then the next publish, each a
`send` on the socket. On loopback a send costs 10-30 us of CPU (the kernel delivers the
segment to the receiver in the sender's time), so an owner or a worker that handles many
messages at once spent a quarter of its CPU in them (bench/README.md, "Latest").
Here the frames of one turn are kept and sent together at the turn's end, through aiormq's own
seam for it (`TransportFactory`), which a connection class of aio-pika's hands down.

Nothing is reordered or dropped: the frames go in the order written, before a close or an
end of file; an abort drops them with the connection, as it drops the kernel's buffer.
"""

from __future__ import annotations

import asyncio
import ssl as _ssl
from typing import Any

import aiormq
from aio_pika.robust_connection import RobustConnection
from yarl import URL

# Bytes held at most before a write goes out at once (a large body needs no company).
MAX_HELD = 1 << 20
# Frames aiormq may queue for its writer (its own default is 10): a publisher past the bound
# waits with its channel's lock held, and the publishes after it then go one a turn.
QUEUED_FRAMES = 1024


class CoalescingTransport(asyncio.Transport):
    """A transport that writes what it is given in one turn as one `write` of `transport`."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._transport = transport
        self._loop = loop
        self._held: list[bytes] = []
        self._held_bytes = 0
        self._scheduled = False
        self.writes = 0  # writes given to the socket's transport, and frames given: for tests
        self.frames = 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.frames += 1
        self._held.append(bytes(data))
        self._held_bytes += len(data)
        if self._held_bytes >= MAX_HELD:
            self.flush()
        elif not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self.flush)

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:
            self.write(data)

    def flush(self) -> None:
        """Hand what is held to the socket's transport now."""
        self._scheduled = False
        if not self._held:
            return
        data = self._held[0] if len(self._held) == 1 else b"".join(self._held)
        self._held.clear()
        self._held_bytes = 0
        if self._transport.is_closing():
            return  # closed under us (the peer went): the connection's reader reports it
        self.writes += 1
        self._transport.write(data)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._held.clear()
        self._held_bytes = 0
        self._transport.abort()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def can_write_eof(self) -> bool:
        return self._transport.can_write_eof()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_write_buffer_size(self) -> int:
        return self._held_bytes + self._transport.get_write_buffer_size()

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._transport.get_write_buffer_limits()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._transport.set_write_buffer_limits(high, low)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def is_reading(self) -> bool:
        return self._transport.is_reading()

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._transport.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._transport.get_protocol()


class CoalescingFactory(aiormq.TransportFactory):
    """aiormq's connection factory, with the writer's transport coalescing (TLS as well)."""

    def __init__(self) -> None:
        self.last: CoalescingTransport | None = None  # the latest connection's: for tests

    async def create(
        self, url: URL, **kwargs: Any
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        provider = kwargs.pop("ssl_context_provider", None)
        context: _ssl.SSLContext | None = None
        if url.scheme == "amqps" and provider is not None:
            context = await provider.get_context()
        if url.host is None or url.port is None:  # aiormq fills in the scheme's port
            raise aiormq.exceptions.AMQPConnectionError(f"no host or port in {url.host}:{url.port}")
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(loop=loop)
        protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
        try:
            transport, _ = await loop.create_connection(
                lambda: protocol, url.host, url.port, ssl=context, **kwargs
            )
        except OSError as exc:
            raise aiormq.exceptions.AMQPConnectionError(*exc.args) from exc
        coalescing = self.last = CoalescingTransport(transport, loop)  # type: ignore[arg-type]
        return reader, asyncio.StreamWriter(coalescing, protocol, reader, loop)


class CoalescingConnection(RobustConnection):
    """aio-pika's robust connection, each of its (re)connections coalescing its writes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kwargs["transport_factory"] = CoalescingFactory()  # handed to aiormq.connect
        # Read by aiormq when it builds a connection; class-wide, and every connection of a
        # shardflow process is its bus's. The frames wait there a turn at most: the writer
        # hands them on at once, and each publisher awaits its confirm.
        if aiormq.Connection.FRAME_BUFFER_SIZE < QUEUED_FRAMES:
            aiormq.Connection.FRAME_BUFFER_SIZE = QUEUED_FRAMES
