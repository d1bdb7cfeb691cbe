"""The lean consumer (orchestrator/consuming.py) on a real RabbitMQ: what it hands on of each
delivery, a settle at most once, and how it ends (closed, its queue deleted, its channel gone),
each of which must leave no message unread and unsettled."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import pytest
from aiormq.exceptions import ChannelInvalidStateError, ChannelNotFoundEntity

from orchestrator.bus import Bus
from orchestrator.consuming import MAX_UNREAD_NO_ACK, Deliveries, Incoming
from orchestrator.lifecycle import Service
from orchestrator.settings import Settings
from tests.polling import until

POOL = "parallel"


@pytest.fixture
async def bus(settings: Settings) -> AsyncIterator[Bus]:
    bus = Bus(settings)
    await bus.connect()
    yield bus
    await bus.close()


async def _ready(bus: Bus) -> int:
    state = await bus.queue_state(bus.names.task_queue(POOL))
    assert state is not None
    return state[0]


async def _next(deliveries: Deliveries) -> Incoming:
    return await asyncio.wait_for(deliveries.__anext__(), 10)


async def test_a_delivery_carries_body_headers_priority_and_the_redelivered_flag(bus: Bus) -> None:
    await bus.publish_all(POOL, [b'{"n": 1}'], priority=3, headers={"x-shardflow-carry": 1})
    await bus.publish_all(POOL, [b'{"n": 2}'])
    deliveries = await bus.consume_pool(POOL, 10)
    first = await _next(deliveries)
    assert (first.body, first.headers, first.priority) == (b'{"n": 1}', {"x-shardflow-carry": 1}, 3)
    assert first.redelivered is False
    second = await _next(deliveries)
    assert (second.body, second.headers) == (b'{"n": 2}', {})  # none sent, none seen
    await second.nack(requeue=True)
    again = await _next(deliveries)
    assert (again.body, again.redelivered) == (b'{"n": 2}', True)
    await first.ack()
    await again.ack()
    await bus.stop_consuming(deliveries)
    assert await _ready(bus) == 0


async def test_a_second_settle_is_refused_here_and_the_channel_lives_on(bus: Bus) -> None:
    """A second ack of a delivery tag would make the broker close the channel, and hand back
    every message on it: refused before it is sent."""
    await bus.publish_all(POOL, [b"{}", b"[]"])
    deliveries = await bus.consume_pool(POOL, 10)
    first = await _next(deliveries)
    await first.ack()
    with pytest.raises(RuntimeError, match="settled already"):
        await first.ack()
    with pytest.raises(RuntimeError, match="settled already"):
        await first.nack()
    second = await _next(deliveries)
    await second.ack()  # the channel still works
    await bus.stop_consuming(deliveries)
    assert await _ready(bus) == 0


async def test_a_consumer_without_acks_holds_at_most_its_bound_unread(bus: Bus) -> None:
    """A control queue has no prefetch: a flood of notices nobody reads yet is held up to
    MAX_UNREAD_NO_ACK, and the rest dropped (they are hints), not held without bound."""
    deliveries = await bus.consume_control()
    sent = MAX_UNREAD_NO_ACK + 300
    for n in range(sent):
        await bus.publish_control(b"%d" % n)

    async def held() -> dict[str, Any]:
        return {"held": len(deliveries._ready), "dropped": deliveries.dropped}

    await until(held, lambda now: now["held"] + now["dropped"] == sent)
    assert (await held()) == {"held": MAX_UNREAD_NO_ACK, "dropped": 300}
    assert (await _next(deliveries)).body == b"0"  # the first ones are kept, in order
    await bus.stop_consuming(deliveries)


async def test_closing_hands_back_what_it_holds_unread(bus: Bus) -> None:
    await bus.publish_all(POOL, [b"%d" % n for n in range(5)])
    deliveries = await bus.consume_pool(POOL, 5)
    taken = await _next(deliveries)
    # The other four reach it too (the prefetch is 5), unread.
    await asyncio.sleep(0.3)
    await deliveries.close()
    with pytest.raises(StopAsyncIteration):
        await _next(deliveries)
    await until(lambda: _state(bus), lambda state: state["ready"] == 4)
    await taken.ack()  # what was read is still its reader's to settle
    await bus.stop_consuming(deliveries)
    assert await _ready(bus) == 4


async def test_a_deleted_queue_ends_its_consumer(bus: Bus) -> None:
    deliveries = await bus.consume_pool(POOL, 5)
    reading = asyncio.ensure_future(_next(deliveries))
    await asyncio.sleep(0.1)
    assert bus._publisher is not None
    await bus._publisher.queue_delete(bus.names.task_queue(POOL))
    with pytest.raises(StopAsyncIteration):
        await reading
    await bus.stop_consuming(deliveries)


async def test_a_consumer_the_broker_ended_is_not_live_before_anyone_reads_it(bus: Bus) -> None:
    """A worker whose slots are all busy reads none: it stayed ready with no consumer left
    (the broker takes consumers back past consumer_timeout; a queue deleted does the same)."""
    deliveries = await bus.consume_pool(POOL, 5)
    other = await bus.consume_pool(POOL + ".1", 5)
    assert deliveries.live and other.live
    assert bus._publisher is not None
    await bus._publisher.queue_delete(bus.names.task_queue(POOL))  # nobody reads meanwhile
    await until(lambda: _live(deliveries), lambda live: not live["live"])
    channel = await bus._consumer_channels[other].get_underlay_channel()
    await channel.close()
    await until(lambda: _live(other), lambda live: not live["live"])
    await bus.stop_consuming(deliveries)
    await bus.stop_consuming(other)


async def _live(deliveries: Any) -> dict[str, bool]:
    return {"live": deliveries.live}


async def test_a_channel_closed_under_it_fails_its_reader(bus: Bus) -> None:
    """As when the connection drops: the reader learns it (lifecycle consumes again on a new
    channel), and the messages it held unread are the broker's to hand out again."""
    await bus.publish_all(POOL, [b"1", b"2"])
    deliveries = await bus.consume_pool(POOL, 5)
    await _next(deliveries)
    await asyncio.sleep(0.3)  # the second is held too
    channel = bus._consumer_channels[deliveries]
    underlay = await channel.get_underlay_channel()
    await underlay.close()
    with pytest.raises(ChannelInvalidStateError, match="closed"):
        await _next(deliveries)
    await bus.stop_consuming(deliveries)
    await until(lambda: _state(bus), lambda state: state["ready"] == 2)


async def _state(bus: Bus) -> dict[str, int]:
    return {"ready": await _ready(bus)}


class _Part(Service):
    """A part consuming one queue as the worker and the router do: each message acked by a
    task of its own, after a pause (so some are in hand when the connection drops)."""

    name = "part"

    def __init__(self, start: Callable[[], Awaitable[Deliveries]], bus: Bus) -> None:
        super().__init__(grace_s=2)
        self.start, self.bus, self.acked, self.seen = start, bus, set[bytes](), set[bytes]()

    async def _start(self) -> list[Coroutine[Any, Any, None]]:
        return [self._read()]

    async def _read(self) -> None:
        async for message in self._messages(self.start, self.bus.stop_consuming):
            self.seen.add(message.body)
            self._spawn(self._ack(message))

    async def _ack(self, message: Incoming) -> None:
        await asyncio.sleep(0.2)
        with contextlib.suppress(Exception):  # its channel gone: it comes again
            await message.ack()
            self.acked.add(message.body)


@contextlib.asynccontextmanager
async def _started(
    start: Callable[[], Awaitable[Deliveries]], bus: Bus
) -> AsyncIterator[tuple[_Part, set[Deliveries]]]:
    """A part running until the block ends (and alive at its end), once it consumes; its
    first consumers."""
    part = _Part(start, bus)
    running = asyncio.ensure_future(part.run())
    try:
        await until(_consuming(part), bool)
        yield part, set(part._iterators)
        assert not running.done()
    finally:
        part.shutdown()
        await running


def _rabbitmqctl(*args: str) -> str:
    return subprocess.run(
        ["rabbitmqctl", "-q", *args], capture_output=True, text=True, check=True, timeout=30
    ).stdout


def _connections(name: str) -> list[tuple[str, int]]:
    """(pid, channels) of the broker's connections that `name` opened."""
    listed = json.loads(
        _rabbitmqctl("list_connections", "name", "channels", "client_properties",
                     "--formatter", "json")
    )  # fmt: skip
    ours = {found["name"]: int(found["channels"]) for found in listed
            if name in json.dumps(found["client_properties"])}  # fmt: skip
    pids = {}
    for line in _rabbitmqctl("list_connections", "--no-table-headers", "pid", "name").splitlines():
        pid, connection = line.split("\t", 1)
        pids[connection] = pid
    return [(pids[connection], channels) for connection, channels in ours.items()]


@pytest.mark.skipif(shutil.which("rabbitmqctl") is None, reason="closes a connection by pid")
async def test_a_part_consumes_again_after_its_connection_drops_and_keeps_no_stray_channel(
    settings: Settings,
) -> None:
    """The broker closes the part's connection: it consumes again once the connection is
    back, every message is acked, and the connection holds the publisher's channel and the
    consumer's: none of the tries made while it was down is opened again with it."""
    name = f"test-consuming-{uuid.uuid4().hex[:8]}"
    bus, publisher = Bus(settings, name=name), Bus(settings)
    await bus.connect()
    await publisher.connect()
    part = _Part(lambda: bus.consume_pool(POOL, 5), bus)
    running = asyncio.ensure_future(part.run())
    try:
        ours = await asyncio.to_thread(_connections, name)
        assert len(ours) == 1
        bodies = [b"%d" % n for n in range(30)]
        await publisher.publish_all(POOL, bodies)
        await until(_acked(part), lambda found: len(found["acked"]) >= 5)
        await asyncio.to_thread(_rabbitmqctl, "close_connection", ours[0][0], "a test drops it")
        await until(_dropped(bus), bool)

        async def state() -> dict[str, Any]:
            found = await publisher.queue_state(bus.names.task_queue(POOL))
            return {"acked": len(part.acked), "ready": found[0] if found else -1}

        await until(state, lambda now: now["acked"] == 30 and now["ready"] == 0, timeout_s=60)
        assert part.acked == set(bodies)
        channels = [n for _, n in await asyncio.to_thread(_connections, name)]
        assert channels == [2], channels  # the publisher's and the consumer's
    finally:
        part.shutdown()
        await running
        await bus.close()
        await publisher.close()


async def test_a_part_whose_queue_is_deleted_declares_it_again_and_consumes(bus: Bus) -> None:
    """Before, a deleted ingress queue ended the router (a passive declare's 404)."""
    async with _started(lambda: bus.consume_ingress(5), bus) as (part, first):
        assert bus._publisher is not None
        await bus._publisher.queue_delete(bus.names.ingress_queue)
        await until(_restarted(part, first), bool, timeout_s=10)
        await bus.requeue(bus.names.ingress_queue, b"again", {}, None)
        await until(_acked(part), lambda found: b"again" in found["acked"])


async def test_a_control_consumer_whose_exchange_and_queue_were_deleted_brings_both_back(
    bus: Bus,
) -> None:
    """Its start declares the exchange before binding to it: it used to retry the bind's 404
    each second for ever, leaving a new unconsumed queue behind each time."""
    async with _started(bus.consume_control, bus) as (part, first):
        assert bus._publisher is not None
        await bus._publisher.exchange_delete(bus.names.control_exchange)
        (deliveries,) = first
        await bus._publisher.queue_delete(deliveries._queue)
        await until(_restarted(part, first), bool, timeout_s=10)
        await bus.publish_control(b'{"wf": "w"}')  # consumed without acks: seen is enough
        await until(_seen(part), lambda found: b'{"wf": "w"}' in found["seen"])


async def test_a_cancel_that_comes_with_the_consume_answer_ends_the_consumer(bus: Bus) -> None:
    """The queue deleted as the consumer starts, both answers read in one turn of a busy loop:
    the cancel names a tag the consumer knows, and it ends, where it waited for ever. The
    broker may run the delete first (the consume is then refused, 404): that try did not
    reach the race and does not count."""
    assert bus._publisher is not None
    admin = await bus._publisher.get_underlay_channel()
    raced = 0
    for _ in range(40):  # about 1 in 16 tries is refused, so 5 races come within 40
        queue = f"{bus.names.prefix}.race.{uuid.uuid4().hex[:8]}"
        await admin.queue_declare(queue, auto_delete=True)
        channel = await bus._consumer_channel()
        deliveries = Deliveries(await channel.get_underlay_channel(), queue)
        consuming = asyncio.ensure_future(deliveries.consume())
        deleting = asyncio.ensure_future(admin.queue_delete(queue))
        for _ in range(4):
            await asyncio.sleep(0)
        # The loop busy elsewhere: both answers wait to be read together.
        time.sleep(0.1)  # noqa: ASYNC251
        try:
            await consuming
        except ChannelNotFoundEntity:
            continue
        finally:
            await deleting
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(deliveries.__anext__(), 5)
        await deliveries.close()
        await channel.close()
        raced += 1
        if raced == 5:
            break
    assert raced == 5


def _consuming(part: Service) -> Callable[[], Awaitable[dict[str, Any] | None]]:
    async def check() -> dict[str, Any] | None:
        return {"consuming": True} if part.consuming else None

    return check


def _restarted(part: Service, first: set[Deliveries]) -> Callable[[], Awaitable[Any]]:
    """A check: the part consumes through another consumer than `first`'s."""

    async def check() -> dict[str, Any] | None:
        now = set(part._iterators)
        return {"restarted": True} if part.consuming and now and not now & first else None

    return check


def _dropped(bus: Bus) -> Callable[[], Awaitable[dict[str, Any] | None]]:
    async def check() -> dict[str, Any] | None:
        return None if bus.is_connected else {"dropped": True}

    return check


def _seen(part: _Part) -> Callable[[], Awaitable[dict[str, Any] | None]]:
    async def check() -> dict[str, Any] | None:
        return {"seen": set(part.seen)}

    return check


def _acked(part: _Part) -> Callable[[], Awaitable[dict[str, Any] | None]]:
    async def check() -> dict[str, Any] | None:
        return {"acked": set(part.acked)}

    return check


async def test_a_channel_close_cut_short_by_a_stop_leaves_the_connection_up(bus: Bus) -> None:
    """A stop cancels a consumer start that is closing its probe channel: aiormq answered the
    cancelled Channel.Close with a second one, RabbitMQ closed the whole connection (504
    CHANNEL_ERROR), and the publisher channel with it (a router's signal failed)."""
    from orchestrator.bus import _close_quietly

    for turns in range(20):  # wherever the cancel lands in the close's exchange
        probe = await bus._consumer_channel()
        closer = asyncio.ensure_future(_close_quietly(probe))
        for _ in range(turns):
            await asyncio.sleep(0)
        closer.cancel()
        await asyncio.gather(closer, return_exceptions=True)
        await asyncio.sleep(0.05)  # the broker's answer to a second close, had one gone
        assert not bus._channel.is_closed and bus.is_connected, f"cancelled after {turns} turns"
    await bus.publish_to_shard(0, b"{}")  # the publisher works
