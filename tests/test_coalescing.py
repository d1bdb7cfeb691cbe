"""Write coalescing: the AMQP frames of one loop turn go out in one write, in order, and a real
connection publishes, confirms and consumes through it."""

import asyncio
from typing import Any

import aio_pika
import pytest

from orchestrator.bus import Bus
from orchestrator.coalescing import MAX_HELD, CoalescingConnection, CoalescingTransport
from orchestrator.settings import Settings


class Recording(asyncio.Transport):
    """A socket's transport that keeps what it is given (a pure stand-in, no socket)."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[bytes] = []
        self.closed = self.aborted = False

    def write(self, data: Any) -> None:
        self.written.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def is_closing(self) -> bool:
        return self.closed or self.aborted

    def get_write_buffer_size(self) -> int:
        return 0


async def test_the_frames_of_one_turn_are_one_write_in_their_order() -> None:
    inner = Recording()
    transport = CoalescingTransport(inner, asyncio.get_running_loop())
    for n in range(5):
        transport.write(b"frame%d;" % n)
    transport.writelines([b"a;", b"b;"])
    assert inner.written == [] and transport.get_write_buffer_size() == 7 * 7 - 2 * 5
    await asyncio.sleep(0)  # the turn ends
    assert inner.written == [b"frame0;frame1;frame2;frame3;frame4;a;b;"]
    transport.write(b"next")
    await asyncio.sleep(0)
    assert inner.written[1:] == [b"next"]
    assert (transport.writes, transport.frames) == (2, 8)


async def test_a_close_sends_what_is_held_first_and_an_abort_drops_it() -> None:
    inner = Recording()
    transport = CoalescingTransport(inner, asyncio.get_running_loop())
    transport.write(b"close-ok")
    transport.close()
    assert inner.written == [b"close-ok"] and inner.closed
    await asyncio.sleep(0)  # the scheduled flush finds nothing left
    assert inner.written == [b"close-ok"]

    inner = Recording()
    transport = CoalescingTransport(inner, asyncio.get_running_loop())
    transport.write(b"lost with the connection")
    transport.abort()
    await asyncio.sleep(0)
    assert inner.written == [] and inner.aborted


async def test_a_large_write_goes_out_at_once_and_nothing_goes_to_a_closed_socket() -> None:
    inner = Recording()
    transport = CoalescingTransport(inner, asyncio.get_running_loop())
    transport.write(b"x" * 10)
    transport.write(b"y" * MAX_HELD)
    assert inner.written == [b"x" * 10 + b"y" * MAX_HELD]  # without waiting for the turn
    transport.write(b"after the peer went")
    inner.closed = True  # the socket closed under it
    await asyncio.sleep(0)
    assert len(inner.written) == 1


async def test_a_bus_publishes_side_by_side_in_few_writes_and_every_message_arrives(
    settings: Settings,
) -> None:
    bus = Bus(settings)
    await bus.connect()
    try:
        connection = bus._connection
        assert isinstance(connection, CoalescingConnection)
        transport = connection.kwargs["transport_factory"].last
        assert isinstance(transport, CoalescingTransport)
        writes, frames = transport.writes, transport.frames
        bodies = [b'{"n": %d}' % n for n in range(50)]
        await bus.publish_all("parallel", bodies)  # each publish awaits its confirm
        assert transport.frames - frames >= 50
        assert transport.writes - writes <= 10  # one write per turn, not one per frame
        channel = await connection.channel()
        queue = await channel.get_queue(bus.names.task_queue("parallel"), ensure=True)
        got = []
        for _ in range(50):
            message = await queue.get(no_ack=True, timeout=5)
            got.append(message.body)
        assert sorted(got) == sorted(bodies)
    finally:
        await bus.close()


async def test_publishes_waiting_for_their_confirms_are_bounded(settings: Settings) -> None:
    """While the broker confirms nothing (an alarm), what a process holds is bounded by the
    publishes waiting at once, not by the socket: here one, so each goes alone."""
    bus = Bus(settings)
    await bus.connect()
    try:
        bus._unconfirmed = asyncio.Semaphore(1)
        transport = bus._connection.kwargs["transport_factory"].last  # type: ignore[union-attr]
        writes = transport.writes
        await bus.publish_all("parallel", [b"{}"] * 20)
        assert transport.writes - writes >= 20  # one at a time: each waited for the one before
    finally:
        await bus.close()


async def test_coalescing_can_be_turned_off(settings: Settings) -> None:
    bus = Bus(settings.model_copy(update={"amqp_coalescing": False}))
    await bus.connect()
    try:
        assert type(bus._connection) is aio_pika.RobustConnection
        await bus.publish_all("parallel", [b"{}"])
    finally:
        await bus.close()


@pytest.mark.parametrize("url", ["amqp://guest:guest@127.0.0.1:1/"])
async def test_a_refused_connection_is_aiormqs_connection_error(url: str) -> None:
    with pytest.raises(aio_pika.exceptions.AMQPConnectionError):
        await aio_pika.connect(url, connection_class=CoalescingConnection, timeout=5)
