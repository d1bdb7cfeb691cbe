"""A queue's deliveries read straight from aiormq's channel, one lean object each.

aio-pika's queue iterator hands each delivery through two more tasks, an asyncio.Queue and an
`IncomingMessage` built for it: about 7% of an owner's and of a worker's CPU a chain task at
M=200 (bench/README.md). Here aiormq's own task for the delivery appends it to a deque and
wakes the reader. What aio-pika's robust consumer did after a reconnect, `Service._messages`
does: a consumer whose channel closed fails with ChannelInvalidStateError, one the broker
cancelled (its queue was deleted) ends, and either is started again on a new channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import deque
from typing import Any

import aiormq
from aiormq.abc import DeliveredMessage
from aiormq.exceptions import ChannelInvalidStateError

log = logging.getLogger(__name__)

# A consumer without acks has no prefetch, so what it holds unread is bounded here: its
# messages are hints (the control queue's notices, which anyone on the vhost may publish).
MAX_UNREAD_NO_ACK = 1024
# What RabbitMQ (3.8.15 and later) closes a channel with when a delivery stays unacked past
# its consumer_timeout.
ACK_TIMED_OUT = "delivery acknowledgement on channel"


class Incoming:
    """One delivery (a `delivery.Delivery`), settled at most once: a second ack of one
    delivery tag would make the broker close the channel, and every message on it."""

    __slots__ = ("_channel", "_message", "_no_ack", "_settled", "body")

    def __init__(self, message: DeliveredMessage, channel: aiormq.Channel, no_ack: bool) -> None:
        self._message = message
        self._channel = channel
        self._no_ack = no_ack
        self._settled = False
        self.body: bytes = message.body

    @property
    def redelivered(self) -> bool | None:
        return getattr(self._message.delivery, "redelivered", None)

    @property
    def headers(self) -> dict[str, Any]:
        return self._message.header.properties.headers or {}

    @property
    def priority(self) -> int | None:
        return self._message.header.properties.priority or 0  # as aio-pika's: 0 when none

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
        if self._no_ack:
            raise RuntimeError("a message consumed without acks is not settled")
        if self._settled:
            raise RuntimeError("the message was settled already")
        tag = self._message.delivery_tag
        if tag is None:
            raise RuntimeError("a delivery without a delivery tag")
        self._settled = True
        return tag

    def gone(self) -> asyncio.Future[Any]:
        """A new future, done once its channel closed: the delivery can no longer be settled,
        and the broker hands it to another consumer. An observer aiormq adds to the channel
        (about 1 KB) until it is done or cancelled: the caller cancels it when it is through."""
        return self._channel.closing

    async def ack(self) -> None:
        await self._channel.basic_ack(self._tag())

    async def nack(self, *, requeue: bool = True) -> None:
        await self._channel.basic_nack(self._tag(), requeue=requeue)


class Deliveries:
    """The deliveries of one consumer on `channel` (aiormq's), in order, until `close()`, the
    channel closing (ChannelInvalidStateError) or the broker cancelling it (the end, once
    what it held is read)."""

    def __init__(self, channel: aiormq.Channel, queue: str, *, no_ack: bool = False) -> None:
        self._channel = channel
        self._queue = queue
        self._no_ack = no_ack
        self._ready: deque[DeliveredMessage] = deque()
        self._waiter: asyncio.Future[None] | None = None
        # Chosen here, so a cancel from the broker that comes with the answer to the consume
        # (its queue deleted at once) is known to be ours.
        self._tag = f"shardflow.{uuid.uuid4().hex}"
        self._ended = False  # the broker cancelled it
        self._closed = False  # close() was called: nothing more is handed on
        self._drained = False  # close() took what it held: a later delivery goes back at once
        self._lost: BaseException | None = None  # the channel closed under it
        self._watch: asyncio.Future[Any] | None = None
        self.dropped = 0  # unread over MAX_UNREAD_NO_ACK, without acks

    @property
    def queue(self) -> str:
        """The queue it consumes."""
        return self._queue

    @property
    def live(self) -> bool:
        """Whether it still consumes: not closed, not cancelled by the broker, its channel
        open. Known at once, not only once its holder reads it again (a worker whose slots are
        all busy reads none)."""
        return self._lost is None and not self._ended and not self._closed

    async def consume(self) -> None:
        """Start the consumer (one RPC), watching for its end from before it is sent."""
        self._channel.on_consumer_cancel_callbacks.add(self._on_cancel)
        self._watch = self._channel.closing
        self._watch.add_done_callback(self._on_channel_closed)
        try:
            await self._channel.basic_consume(
                self._queue, self._on_message, no_ack=self._no_ack, consumer_tag=self._tag
            )
        except BaseException:
            self._forget()
            raise

    async def _on_message(self, message: DeliveredMessage) -> None:
        if self._drained:  # in flight as it was cancelled: back it goes
            with contextlib.suppress(Exception):
                await self._hand_back(message)
            return
        if self._no_ack and len(self._ready) >= MAX_UNREAD_NO_ACK:
            if not self.dropped % 1000:
                log.warning("%s: %d unread, dropping more", self._queue, len(self._ready))
            self.dropped += 1
            return
        self._ready.append(message)
        self._wake()

    async def _hand_back(self, message: DeliveredMessage) -> None:
        """Back to its queue (nothing to do for a message consumed without acks)."""
        if not self._no_ack:
            await Incoming(message, self._channel, False).nack(requeue=True)

    def _on_cancel(self, frame: aiormq.spec.Basic.Cancel) -> None:
        if frame.consumer_tag == self._tag:
            log.warning("the broker cancelled the consumer of %s", self._queue)
            self._ended = True
            self._wake()

    def _on_channel_closed(self, closing: asyncio.Future[Any]) -> None:
        reason = None if closing.cancelled() else closing.exception()
        if ACK_TIMED_OUT in str(reason):
            # RabbitMQ's consumer_timeout ran out under a task still running: it is handed to
            # another consumer now, and again at every timeout (docs/kubernetes.md).
            log.error(
                "%s: the broker took back a task held past its consumer_timeout (%r); set "
                "consumer_timeout above the longest task timeout (docs/kubernetes.md)",
                self._queue,
                reason,
            )
        self._lost = ChannelInvalidStateError(f"the channel of {self._queue} closed: {reason!r}")
        self._ready.clear()  # the broker hands them to the next consumer
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _forget(self) -> None:
        """Take its callbacks off the channel, which may outlive it."""
        self._channel.on_consumer_cancel_callbacks.discard(self._on_cancel)
        if self._watch is not None:
            self._watch.remove_done_callback(self._on_channel_closed)
            self._watch.cancel()  # an observer: cancelling it leaves the channel be
            self._watch = None

    def __aiter__(self) -> Deliveries:
        return self

    async def __anext__(self) -> Incoming:
        while True:
            if self._lost is not None:
                raise self._lost
            if self._closed:
                raise StopAsyncIteration
            if self._ready:
                return Incoming(self._ready.popleft(), self._channel, self._no_ack)
            if self._ended:
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    async def close(self) -> None:
        """Cancel the consumer and hand back, in order, what it holds unread (with what
        reaches it until the broker confirms the cancel); the end of the iteration."""
        self._closed = True
        self._wake()
        try:
            if not self._channel.is_closed and not self._ended and self._lost is None:
                await self._channel.basic_cancel(self._tag)
        finally:
            self._forget()
            left, self._ready, self._drained = list(self._ready), deque(), True
        if self._channel.is_closed:
            return
        for message in left:
            await self._hand_back(message)
