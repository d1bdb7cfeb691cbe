"""A queue's deliveries read straight from aiormq's channel, one lean object each.

aio-pika's queue iterator hands each delivery through two more tasks, an asyncio.Queue and an
`IncomingMessage` built for it: about a twentieth of an owner's or a worker's CPU under load
(bench/README.md). Here aiormq's own task for the delivery appends it to a deque and wakes the
reader. What aio-pika's robust consumer did after a reconnect, `Service._messages` does: a
consumer whose channel closed ends with ChannelInvalidStateError, and is started again on a
new channel; one the broker cancelled (its queue was deleted) ends, and is started again too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from typing import Any

import aiormq
from aiormq.abc import DeliveredMessage
from aiormq.exceptions import ChannelInvalidStateError

log = logging.getLogger(__name__)


class Incoming:
    """One delivery (a `delivery.Delivery`), settled at most once: a second ack of one
    delivery tag would make the broker close the channel, and every message on it."""

    __slots__ = ("_channel", "_message", "_no_ack", "_settled", "body")

    def __init__(self, message: DeliveredMessage, channel: aiormq.Channel, no_ack: bool) -> None:
        self._message = message
        self._channel = channel
        self._no_ack = no_ack
        self._settled = no_ack
        self.body: bytes = message.body

    @property
    def redelivered(self) -> bool | None:
        return getattr(self._message.delivery, "redelivered", None)

    @property
    def headers(self) -> dict[str, Any]:
        return self._message.header.properties.headers or {}

    @property
    def priority(self) -> int | None:
        return self._message.header.properties.priority

    @property
    def reply_to(self) -> str | None:
        return self._message.header.properties.reply_to

    @property
    def correlation_id(self) -> str | None:
        return self._message.header.properties.correlation_id

    @property
    def message_id(self) -> str | None:
        return self._message.header.properties.message_id

    def _tag(self) -> int:
        if self._settled:
            raise RuntimeError("the message was settled already" if not self._no_ack else
                               "a message consumed without acks is not settled")  # fmt: skip
        tag = self._message.delivery_tag
        if tag is None:
            raise RuntimeError("a delivery without a delivery tag")
        self._settled = True
        return tag

    async def ack(self) -> None:
        await self._channel.basic_ack(self._tag())

    async def nack(self, *, requeue: bool = True) -> None:
        await self._channel.basic_nack(self._tag(), requeue=requeue)


class Deliveries:
    """The deliveries of one consumer on `channel` (aiormq's), in order, until `close()`, the
    channel closing (ChannelInvalidStateError) or the broker cancelling it (the end)."""

    def __init__(self, channel: aiormq.Channel, queue: str, *, no_ack: bool = False) -> None:
        self._channel = channel
        self._queue = queue
        self._no_ack = no_ack
        self._ready: deque[DeliveredMessage] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._tag: str | None = None
        self._closed = False  # by close() or the broker: no more deliveries
        self._lost: BaseException | None = None  # the channel closed under it
        self._watch: asyncio.Future[Any] | None = None

    @property
    def consumer_tag(self) -> str | None:
        return self._tag

    async def consume(self) -> None:
        """Start the consumer (one RPC)."""
        ok = await self._channel.basic_consume(self._queue, self._on_message, no_ack=self._no_ack)
        self._tag = ok.consumer_tag
        self._channel.on_consumer_cancel_callbacks.add(self._on_cancel)
        self._watch = self._channel.closing
        self._watch.add_done_callback(self._on_channel_closed)

    async def _on_message(self, message: DeliveredMessage) -> None:
        if self._closed and not self._no_ack:  # in flight as it was cancelled: back it goes
            with contextlib.suppress(Exception):
                await Incoming(message, self._channel, False).nack(requeue=True)
            return
        self._ready.append(message)
        self._wake()

    def _on_cancel(self, frame: aiormq.spec.Basic.Cancel) -> None:
        if frame.consumer_tag == self._tag:
            log.warning("the broker cancelled the consumer of %s", self._queue)
            self._closed = True
            self._wake()

    def _on_channel_closed(self, closing: asyncio.Future[Any]) -> None:
        reason = None if closing.cancelled() else closing.exception()
        self._lost = ChannelInvalidStateError(f"the channel of {self._queue} closed: {reason!r}")
        self._ready.clear()  # the broker hands them to the next consumer
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def __aiter__(self) -> Deliveries:
        return self

    async def __anext__(self) -> Incoming:
        while not self._ready:
            if self._lost is not None:
                raise self._lost
            if self._closed:
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return Incoming(self._ready.popleft(), self._channel, self._no_ack)

    async def close(self) -> None:
        """Cancel the consumer and hand back what it holds unread; the end of the iteration."""
        self._closed = True
        self._wake()
        self._channel.on_consumer_cancel_callbacks.discard(self._on_cancel)
        if self._watch is not None:
            self._watch.remove_done_callback(self._on_channel_closed)
            self._watch.cancel()  # an observer: cancelling it leaves the channel be
        left, self._ready = list(self._ready), deque()
        if self._tag is None or self._channel.is_closed:
            return
        await self._channel.basic_cancel(self._tag)
        for message in left if not self._no_ack else ():
            await Incoming(message, self._channel, False).nack(requeue=True)
