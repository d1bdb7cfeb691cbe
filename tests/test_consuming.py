"""The lean consumer (orchestrator/consuming.py) on a real RabbitMQ: what it hands on of each
delivery, a settle at most once, and how it ends (closed, its queue deleted, its channel gone),
each of which must leave no message unread and unsettled."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiormq.exceptions import ChannelInvalidStateError

from orchestrator.bus import Bus
from orchestrator.consuming import Deliveries, Incoming
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
