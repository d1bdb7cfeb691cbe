"""The transport: RabbitMQ topology, confirmed publishing and consumers, through aio-pika."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Hashable
from typing import Any, Protocol, TypeAlias, cast
from urllib.parse import unquote, urlsplit

import aio_pika
import aiormq
from aio_pika import RobustConnection
from aio_pika.abc import (
    AbstractChannel,
    AbstractIncomingMessage,
    AbstractRobustChannel,
    AbstractRobustConnection,
    AbstractRobustQueue,
)
from aio_pika.connection import make_url

from orchestrator import amqp_decode, metrics
from orchestrator.amqp_faults import DownReason
from orchestrator.bundling import Bundles
from orchestrator.coalescing import CoalescingConnection
from orchestrator.consuming import Deliveries
from orchestrator.delivery import MAX_MESSAGE_ID, SENT_ID, Requeues
from orchestrator.keys import Names
from orchestrator.lifecycle import within
from orchestrator.program import MAX_PRIORITY, PARALLEL, SERIAL, is_lane
from orchestrator.settings import Settings

log = logging.getLogger(__name__)
amqp_decode.install()  # before any frame is read: see orchestrator/amqp_decode.py
Properties: TypeAlias = aiormq.spec.Basic.Properties  # pamqp's, as aiormq hands it on
JSON = "application/json"
PERSISTENT = 2  # AMQP's delivery mode: written to disk by the broker

# The pools every process declares at connect; any other (a named pool) is declared on first
# use, by the owner before it publishes there and by a worker before it consumes.
POOLS = (SERIAL, PARALLEL)
# Message priorities on classic queues: work that continues a started program goes before
# work that starts a new one, so programs already running finish first.
NEW, GOING_ON = 0, 1
# Task queues also order by the program's priority (0..MAX_PRIORITY), above that head start.
TASK_MAX_PRIORITY = 2 * MAX_PRIORITY + GOING_ON


def task_priority(program_priority: int, going_on: bool) -> int:
    """A task message's priority: the program's level first, then the head start of work
    that continues a started program."""
    return 2 * program_priority + (GOING_ON if going_on else NEW)


# Delays are rounded up to these steps per decade (at most +22%): 1, 1.2, 1.5 ... 8.2 ms,
# 10 ms ... up to 30 days, so each target has at most ~120 delay queues, whatever is asked.
_STEPS = (10, 12, 15, 18, 22, 27, 33, 39, 47, 56, 68, 82)
MAX_DELAY_MS = 30 * 86400 * 1000
# A timer (a deadline, a wake, a signal's timeout) waits in the broker at most this long at a
# time: it arrives early and is sent on for what is left while its program is live, so a
# program that ended leaves at most one hop of its timers behind, not its whole deadline.
MAX_TIMER_HOP_MS = 30 * 60 * 1000  # on the ladder
# Starting a consumer: attempts, and the pause before each retry (times the attempt).
CONSUME_ATTEMPTS = 5
CONSUME_BACKOFF_S = 0.5
RECONNECT_WAIT_S = 60.0
PROBE_TIMEOUT_S = 10.0  # a queue's passive declare, which a lost connection may not answer
CLOSE_TIMEOUT_S = 10.0  # closing a consumer's channel, which a lost connection may not answer
# Publishes waiting for their confirms at once, at most: the frames of a publish are handed on
# without waiting for the socket (orchestrator/coalescing.py), so while the broker reads
# nothing (a memory or disk alarm) this, not the socket, bounds what a process holds.
MAX_UNCONFIRMED = 1024
# Dead letters `resend_dead` holds unacked because none of its queues is theirs, at most.
MAX_DEAD_HELD = 1000
# A control queue no consumer uses is deleted after this long.
CONTROL_QUEUE_EXPIRES_MS = 60_000
# A worker binds its control queue again this often (`Bus.bind_control`): an operator who
# deletes `<prefix>.control` takes every binding along, and the broker tells no consumer.
CONTROL_REBIND_S = 5.0
# Every control notice is sent again this much later, through a delay queue (it outlives a
# publisher that exits, as `shardflow cancel` does): one sent while bindings were gone reaches
# every worker once bound again. Over CONTROL_REBIND_S, with room for a busy loop.
CONTROL_REPEAT_S = 2 * CONTROL_REBIND_S
# A lost connection (INTERNAL_ERROR, a ConnectionInternalError, is one) or a closed channel.
_CONSUME_RACE = (aiormq.exceptions.AMQPConnectionError, aiormq.exceptions.ChannelInvalidStateError)
# A control notice's publish: its exchange missing (404), or its channel closed by another's.
_CONTROL_LOST = (
    aiormq.exceptions.ChannelNotFoundEntity,
    aiormq.exceptions.ChannelInvalidStateError,
)


def ladder_ms(delay_s: float) -> int:
    """The delay in ms, rounded up to the ladder (1 ms at least, 30 days at most)."""
    wanted = min(max(1, math.ceil(delay_s * 1000)), MAX_DELAY_MS)
    scale = 1
    while True:  # at most ~10 decades
        for step in _STEPS:
            value = max(1, step * scale // 10)
            if value >= wanted:
                return min(value, MAX_DELAY_MS)
        scale *= 10


def ladder_floor_ms(delay_s: float) -> int:
    """The longest ladder delay in ms not over `delay_s` (0 below 1 ms): a timer that must
    not fire early waits this long, then again for what is left."""
    wanted = min(math.floor(delay_s * 1000), MAX_DELAY_MS)
    if wanted < 1:
        return 0
    found, scale = 1, 1
    while True:  # at most ~10 decades
        for step in _STEPS:
            value = max(1, step * scale // 10)
            if value > wanted:
                return found
            found = value
        scale *= 10


class Unroutable(Exception):
    """The broker returned a message: no queue is bound for it."""


class TopologyError(RuntimeError):
    """A queue exists with other arguments than this configuration declares."""


class AccessRefused(RuntimeError):
    """RabbitMQ or Redis refused this user (a wrong password, a vhost or a name it may not
    use): the configuration's fault, which waiting does not mend."""


def _amqp_user(url: str) -> str:
    """Who the AMQP URL logs in as, and where: never its password."""
    parts = urlsplit(url)
    vhost = unquote(parts.path[1:]) or "/"
    if parts.username and parts.password is None:  # a password typed where the user goes?
        return f"the URL's user (it gives no password) on vhost {vhost!r}"
    return f"user {unquote(parts.username or 'guest')!r} on vhost {vhost!r}"


# A login refused (aiormq tells the two apart by when the broker closed: they are one fault).
AUTHENTICATION = (
    aiormq.exceptions.AuthenticationError,
    aiormq.exceptions.ProbableAuthenticationError,
)
# What a user needs of RabbitMQ, said where it is refused.
PERMISSIONS = (
    "shardflow declares its exchanges and queues, and needs configure, write and read on "
    "'^{prefix}\\.' and write on 'amq.default' (README, SHARDFLOW_AMQP_URL)"
)


class Publisher(Requeues, Protocol):
    """What the transition logic needs from the transport (and the delivery policy's
    dead-letter and requeue); `Bus` is the real one."""

    async def publish_to_shard(
        self, owner: int, body: bytes, priority: int = GOING_ON, most: int = 1
    ) -> None: ...

    async def publish_all(
        self,
        pool: str,
        bodies: list[bytes],
        priority: int = GOING_ON,
        headers: dict[str, Any] | None = None,
        most: int = 1,
    ) -> None: ...

    async def publish_later(
        self,
        pool: str,
        body: bytes,
        delay_s: float,
        priority: int = GOING_ON,
        headers: dict[str, Any] | None = None,
    ) -> None: ...

    async def publish_to_shard_later(self, owner: int, body: bytes, delay_s: float) -> None: ...

    async def publish_control(self, body: bytes) -> None: ...


class Consumer(Protocol):
    """What a consuming part (a worker pool) needs besides publishing; `Bus` is the real one."""

    names: Names

    @property
    def publishing_blocked(self) -> bool: ...

    async def consume_pool(self, pool: str, prefetch: int) -> Deliveries: ...

    async def consume_control(self) -> Deliveries: ...

    async def bind_control(self, iterator: Deliveries) -> None: ...

    async def stop_consuming(self, iterator: Deliveries) -> None: ...


class Transport(Publisher, Consumer, Protocol):
    """Publishing and consuming: everything a worker uses of the broker."""


# How long opening the connection may take (TCP, AMQP's handshake, the vhost): an OSError
# (TimeoutError) after it, as a refused connection is.
CONNECT_TIMEOUT_S = 10.0


class Bus:
    """One robust connection: a confirming publisher channel and one channel per consumer."""

    def __init__(self, settings: Settings, *, name: str = "shardflow") -> None:
        self.settings = settings
        self.names = Names(settings.prefix)
        self._name = name
        self._connection: AbstractRobustConnection | None = None
        self._publisher: AbstractRobustChannel | None = None
        self._control: aio_pika.Channel | None = None  # control notices', opened on first use
        self._controlling = asyncio.Lock()
        self._delay_queues: set[str] = set()
        self._pools: set[str] = set()  # task queues declared on this connection
        self._bundles = Bundles(self._publish_bundle)
        self._reports = Bundles(
            self._publish_reports, (metrics.REPORT_BUNDLES, metrics.BUNDLED_REPORTS)
        )
        self._consumer_channels: dict[Deliveries, AbstractRobustChannel] = {}
        self._task_arguments: dict[str, dict[str, Any]] = {}  # by task queue, once checked
        self._unconfirmed = asyncio.Semaphore(MAX_UNCONFIRMED)
        self._down: DownReason | None = None  # why the connection is down, once connected
        self._probe: aiormq.abc.AbstractChannel | None = None  # for queue_state
        self._probing = asyncio.Lock()

    async def connect(self, *, declare: bool = True) -> None:
        """Connect and declare the whole topology (idempotent); `declare=False` for a command
        that only looks: a mistyped SHARDFLOW_PREFIX or SHARDFLOW_SHARDS in an operator's
        shell would create queues nobody consumes."""
        # As aio_pika.connect_robust, but holding the connection: one that failed to open is
        # closed here, or it would go on reconnecting in the background.
        kind = CoalescingConnection if self.settings.amqp_coalescing else RobustConnection
        connection = kind(
            make_url(self.settings.amqp_url), client_properties={"connection_name": self._name}
        )
        who = _amqp_user(self.settings.amqp_url)
        try:
            # Bounded: a host that takes the connection and never answers (a firewall that
            # drops packets, a port of something else) would hold the command for good.
            await connection.connect(timeout=CONNECT_TIMEOUT_S)
        except BaseException as exc:
            await connection.close()
            if isinstance(exc, AUTHENTICATION):
                raise AccessRefused(
                    f"RabbitMQ (SHARDFLOW_AMQP_URL) refused {who}: a wrong password, or no "
                    f"such user ({exc})"
                ) from None
            # RabbitMQ closes, instead of opening, a connection to a vhost that does not exist
            # or that the user may not use; aiormq keeps only the frame's name.
            if not isinstance(exc, aiormq.exceptions.InvalidFrameError):
                raise
            if "Connection.Close" not in str(exc):
                raise
            # aiormq keeps no reply code: no such vhost, a user that may not use it, but also
            # a connection limit reached or a vhost restarting, which pass. Waited for.
            raise ConnectionRefusedError(
                f"it closed the connection as it opened the vhost for {who}: does the vhost "
                "exist, and may this user use it? (or a connection limit is reached, or the "
                "vhost restarts: the broker's log says which)"
            ) from None
        self._connection = connection
        self._down = DownReason(connection)
        self._publisher = await self._connection.channel(
            publisher_confirms=True, on_return_raises=True
        )
        if not declare:
            return
        try:
            await self.declare(self._publisher)
        except aiormq.exceptions.ChannelAccessRefused as exc:
            permissions = PERMISSIONS.format(prefix=self.settings.prefix)
            raise AccessRefused(
                f"RabbitMQ (SHARDFLOW_AMQP_URL) refused {who}: {exc}; {permissions}"
            ) from None
        except aio_pika.exceptions.ChannelPreconditionFailed as exc:
            raise TopologyError(
                f"{exc}: a queue exists with other arguments (an older shardflow, or another "
                "SHARDFLOW_QUEUE_TYPE); drain and delete it, or use a new SHARDFLOW_PREFIX"
            ) from None

    @property
    def is_connected(self) -> bool:
        """Whether the connection to RabbitMQ is up now (a robust one reconnects by itself)."""
        return self._connection is not None and self._connection.connected.is_set()

    @property
    def publishing_blocked(self) -> bool:
        """Whether RabbitMQ blocks this connection now (a memory or disk alarm, once it has
        published since): the broker reads nothing more from it, so publishes, acks and
        channel opens wait until the alarm clears. aiormq keeps this in a private event (its
        `ready()` waits on it); tests/test_alarms.py pins the name to the aiormq in use."""
        transport = self._connection.transport if self._connection is not None else None
        if transport is None:
            return False
        unblocked = getattr(transport.connection, "_Connection__connection_unblocked", None)
        return isinstance(unblocked, asyncio.Event) and not unblocked.is_set()

    @property
    def down_reason(self) -> str:
        """While the connection is down: what closed it, or why its last reconnect failed
        ("" when unknown, and while it is up)."""
        return "" if self.is_connected or self._down is None else self._down.reason

    async def close(self) -> None:
        if self._connection is not None:
            await self._connection.close()
            self._connection = None
        self._down = None

    async def declare(self, channel: AbstractRobustChannel) -> None:
        """Every exchange and queue, with the same arguments wherever it is declared."""
        names = self.names
        await self._declare_dead(channel)
        for shard in range(self.settings.shards):
            await self._declare_shard(channel, shard, exchange=shard == 0)
        await channel.declare_exchange(
            names.control_exchange, aio_pika.ExchangeType.FANOUT, durable=True
        )
        await channel.declare_queue(
            names.ingress_queue, durable=True, arguments=self._queue_arguments()
        )
        for pool in POOLS:
            await self._declare_pool(channel, pool)

    async def _declare_dead(self, channel: AbstractRobustChannel) -> None:
        """The dead-letter exchange and its queue, bound."""
        dead = await channel.declare_exchange(
            self.names.dead_exchange, aio_pika.ExchangeType.FANOUT, durable=True
        )
        dead_queue = await channel.declare_queue(
            self.names.dead_queue, durable=True, arguments=self._queue_arguments(dead_letter=False)
        )
        await dead_queue.bind(dead)

    async def _declare_pool(
        self, channel: AbstractRobustChannel, pool: str, *, robust: bool = True
    ) -> AbstractRobustQueue:
        """A pool's task queue: a serial lane's has a single active consumer, any other many.
        `robust`: declared again by the channel after a reconnect (a consumer's is not: it
        is started again on a new channel, orchestrator/consuming.py)."""
        name = self.names.task_queue(pool)
        arguments = self._task_arguments.get(name)
        if arguments is None:
            arguments = await self._task_queue_arguments(name, is_lane(pool))
        queue = await channel.declare_queue(name, durable=True, arguments=arguments, robust=robust)
        self._pools.add(pool)
        return queue

    async def _task_queue_arguments(self, name: str, lane: bool) -> dict[str, Any]:
        """A task queue's arguments, with TASK_MAX_PRIORITY levels; a classic queue declared
        by an older version has fewer (2): tried first on a channel of its own (a refusal
        closes it), that queue keeps its levels and the program's priority is lost there
        until it is drained and deleted, said once in the log."""
        arguments = self._queue_arguments(single_active=lane, max_priority=TASK_MAX_PRIORITY)
        if "x-max-priority" in arguments:
            probe = await self._consumer_channel()
            try:
                await probe.declare_queue(name, durable=True, arguments=arguments)
            except aio_pika.exceptions.ChannelPreconditionFailed as exc:
                if "x-max-priority" not in str(exc):
                    raise
                log.warning(
                    "%s was declared by an older shardflow with 2 priority levels: program "
                    "priorities are ignored there until it is drained and deleted",
                    name,
                )
                arguments = {**arguments, "x-max-priority": GOING_ON}
            finally:
                await _close_quietly(probe)
        self._task_arguments[name] = arguments
        return arguments

    async def _ensure_pool(self, pool: str) -> None:
        # A message published to a queue that does not exist is returned (mandatory), and a
        # delay queue dead-lettering into one drops it: declare a named pool before either.
        if pool not in self._pools:
            await self._declare_pool(self._channel, pool)
            log.info("declared the task queue of pool %r", pool)

    async def _declare_shard(
        self,
        channel: AbstractRobustChannel,
        shard: int,
        *,
        robust: bool = True,
        exchange: bool = True,
    ) -> AbstractRobustQueue:
        """A shard's queue, bound to the orchestrator exchange (declared first unless
        `exchange` is false: a consumer started again after the exchange was deleted brings
        it back)."""
        if exchange:
            await channel.declare_exchange(
                self.names.orchestrator_exchange,
                aio_pika.ExchangeType.DIRECT,
                durable=True,
                robust=robust,
            )
        queue = await channel.declare_queue(
            self.names.shard_queue(shard),
            durable=True,
            arguments=self._queue_arguments(single_active=True, max_priority=GOING_ON),
            robust=robust,
        )
        await queue.bind(self.names.orchestrator_exchange, routing_key=str(shard), robust=robust)
        return queue

    async def shard_queue_state(self, shard: int) -> tuple[int, int] | None:
        """(messages ready, consumers) of a shard's queue, or None when it does not exist."""
        return await self.queue_state(self.names.shard_queue(shard))

    async def queue_state(self, name: str) -> tuple[int, int] | None:
        """(messages ready, consumers) of any queue, or None when it does not exist.

        One passive declare on a probe channel kept open, one call at a time: a channel opened
        and closed for each call cost two more round trips, and each one opened leaves about
        4.5 KB behind in aio-pika 10.2 over aiormq 7.2 (a close callback on an observer future
        of the connection that is never removed). The owner samples queues several times a
        second (orchestrator/backlog.py). A missing queue closes the probe (the broker's
        answer, 404); the next call opens one. The probe is aiormq's own channel, not aio-pika's
        robust one: a robust channel the broker closed reopens itself behind our close, and
        each 404 left one more channel open on the broker (2,047 at most on a connection).
        The connection's next reconnect closes it, and the next call opens one on the new."""
        async with self._probing:
            probe = self._probe
            if probe is None or probe.is_closed:
                self._probe = probe = await self._raw_channel()
            try:
                result = await within(probe.queue_declare(name, passive=True), PROBE_TIMEOUT_S)
            except aiormq.exceptions.ChannelClosed:  # 404: the broker closed the channel
                self._probe = None
                return None
            except BaseException:  # a timeout or a lost connection: start over on a fresh one
                self._probe = None
                await _close_quietly(probe)
                raise
        return result.message_count or 0, result.consumer_count or 0

    async def _raw_channel(self) -> aiormq.abc.AbstractChannel:
        """A channel of aiormq's on the connection of the moment (never reopened by itself);
        ConnectionError while the connection is down."""
        if self._connection is None:
            raise RuntimeError("Bus.connect() was not called")
        transport = self._connection.transport
        if transport is None or not self._connection.connected.is_set():
            raise ConnectionError("the broker connection is down; it reconnects by itself")
        if self.publishing_blocked:  # opened now, its number could be a closed one's (aiormq)
            raise ConnectionError("the broker blocks this connection (a resource alarm)")
        return await transport.connection.channel(publisher_confirms=False)

    def _queue_arguments(
        self, *, single_active: bool = False, dead_letter: bool = True, max_priority: int = 0
    ) -> dict[str, Any]:
        arguments: dict[str, Any] = {}
        if max_priority and self.settings.queue_type == "classic":
            arguments["x-max-priority"] = max_priority  # quorum queues have no priorities
        if single_active:
            arguments["x-single-active-consumer"] = True
        if dead_letter:
            arguments["x-dead-letter-exchange"] = self.names.dead_exchange
        if self.settings.queue_type == "quorum":
            arguments["x-queue-type"] = "quorum"
            if dead_letter:
                arguments["x-delivery-limit"] = self.settings.delivery_limit
        return arguments

    @property
    def _channel(self) -> AbstractRobustChannel:
        if self._publisher is None:
            raise RuntimeError("Bus.connect() was not called")
        return self._publisher

    async def _send(
        self,
        exchange: str,
        routing_key: str,
        body: bytes,
        properties: Properties,
        mandatory: bool = True,
        channel: AbstractChannel | None = None,
    ) -> None:
        """Publish on the confirming channel and wait for the broker's confirm (a returned
        message raises PublishError, a nack DeliveryError). Through aiormq without waiting
        for the socket's drain, so the frames of publishes made side by side go out in one
        write (orchestrator/coalescing.py); aio-pika's `Exchange.publish` waits for it with
        the channel's lock held, one write per publish. The confirm is what we wait for, and
        at most MAX_UNCONFIRMED publishes wait for theirs at once. On `channel` if given,
        else the publisher channel."""
        channel = channel or self._channel
        if channel.is_closed:
            raise aiormq.exceptions.ChannelInvalidStateError(f"{channel!r} closed")
        # aiormq's own channel, whose publish takes `wait` (its abstract base does not say so).
        underlay = await _underlay(channel)
        async with self._unconfirmed:
            await underlay.basic_publish(
                body,
                exchange=exchange,
                routing_key=routing_key,
                properties=properties,
                mandatory=mandatory,
                wait=False,
            )

    async def publish_to_shard(
        self, owner: int, body: bytes, priority: int = GOING_ON, most: int = 1
    ) -> None:
        """Publish to the owner shard's queue and wait for the broker's confirm; Unroutable
        when no queue takes it (a shard outside the ring that is not draining). `most` > 1: a
        report may go in this turn's bundle of up to `most` reports to that shard
        (orchestrator/bundling.py)."""
        if most > 1:
            await self._reports.publish((owner, priority), body, most)
            return
        try:
            # Straight to its queue through the default exchange, the same queue the
            # orchestrator exchange routes `owner` to: the broker skips a route lookup.
            queue = self.names.shard_queue(owner)
            await self._send("", queue, body, _properties(priority=priority))
        except aio_pika.exceptions.PublishError:
            raise Unroutable(f"shard {owner} has no queue (returned: NO_ROUTE)") from None

    async def publish_task(self, pool: str, body: bytes, priority: int = GOING_ON) -> None:
        """Publish to a pool's task queue (declared first) and wait for the broker's confirm."""
        await self.publish_all(pool, [body], priority)

    async def publish_all(
        self,
        pool: str,
        bodies: list[bytes],
        priority: int = GOING_ON,
        headers: dict[str, Any] | None = None,
        most: int = 1,
    ) -> None:
        """Publish many task messages to a pool (declared first); confirms awaited together.
        `most` > 1: a lone message may go in this turn's bundle of up to `most` programs'
        tasks for the same queue, priority and headers (orchestrator/bundling.py)."""
        if most > 1 and len(bodies) == 1:
            key = (pool, priority, tuple(sorted(headers.items())) if headers else ())
            await self._bundles.publish(key, bodies[0], most)
            return
        await self._ensure_pool(pool)

        async def declare() -> None:
            self._pools.discard(pool)
            await self._ensure_pool(pool)

        await self._redeclaring(
            lambda: self._publish_tasks(pool, bodies, priority, headers),
            declare,
            self.names.task_queue(pool),
        )

    async def _publish_bundle(self, key: Hashable, body: bytes) -> None:
        """Publish a bundle (or a lone task message) of `publish_all`'s `key`."""
        pool, priority, headers = cast(tuple[str, int, tuple[tuple[str, Any], ...]], key)
        await self.publish_all(pool, [body], priority, dict(headers) or None)

    async def _publish_reports(self, key: Hashable, body: bytes) -> None:
        """Publish a bundle of reports (or a lone one) of `publish_to_shard`'s `key`."""
        owner, priority = cast(tuple[int, int], key)
        await self.publish_to_shard(owner, body, priority)

    async def _redeclaring(
        self,
        send: Callable[[], Awaitable[None]],
        declare: Callable[[], Awaitable[object]],
        queue: str,
    ) -> None:
        """Publish with `send`; returned unroutable (`queue` deleted since it was declared:
        an operator), `declare` it again and publish once more (a duplicate is harmless, a
        lost message is not)."""
        try:
            await send()
        except aio_pika.exceptions.PublishError:
            log.warning("%s was deleted; declaring it again", queue)
            await declare()
            await send()

    async def _publish_tasks(
        self, pool: str, bodies: list[bytes], priority: int, headers: dict[str, Any] | None
    ) -> None:
        queue = self.names.task_queue(pool)
        if len(bodies) == 1:  # a chain's step: without gather's task and its turn of the loop
            await self._send("", queue, bodies[0], _properties(headers, priority))
            return
        await asyncio.gather(
            *(self._send("", queue, body, _properties(headers, priority)) for body in bodies)
        )

    async def publish_later(
        self,
        pool: str,
        body: bytes,
        delay_s: float,
        priority: int = GOING_ON,
        headers: dict[str, Any] | None = None,
    ) -> None:
        """Publish a task after `delay_s`, through a TTL queue that dead-letters to the pool
        (declared first: a dead-lettered message for a missing queue is dropped); it keeps
        its `priority` and `headers` there."""
        await self._ensure_pool(pool)
        queue = self.names.task_queue(pool)
        await self._publish_delayed(pool, "", queue, body, delay_s, priority, headers)

    async def publish_to_shard_later(self, owner: int, body: bytes, delay_s: float) -> None:
        """Publish to the owner shard after `delay_s` (a deadline, a wake). Its TTL queue
        dead-letters through the default exchange straight to the shard's queue, so a deleted
        orchestrator exchange (declared again only when a consumer starts) drops nothing. The
        queues of before, `<prefix>.delay.shard<N>.<ms>`, dead-letter through the exchange:
        they drain into it and get nothing new. At most MAX_TIMER_HOP_MS at a time: every
        message sent so is one that, early, is sent on for what is left."""
        queue = self.names.shard_queue(owner)
        delay_s = min(delay_s, MAX_TIMER_HOP_MS / 1000)
        await self._publish_delayed(f"shard{owner}.queue", "", queue, body, delay_s)

    async def _publish_delayed(
        self,
        target: str,
        exchange: str,
        routing_key: str,
        body: bytes,
        delay_s: float,
        priority: int = GOING_ON,
        headers: dict[str, Any] | None = None,
    ) -> None:
        # One queue per delay: per-queue TTLs expire in order, per-message ones would not. The
        # delay is rounded up to a fixed ladder, so the queues are bounded (docs/architecture.md,
        # "How many delay queues": up to 92 for each target).
        delay_ms = ladder_ms(delay_s)
        name = self.names.delay_queue(target, delay_ms)

        async def declare() -> None:
            arguments: dict[str, Any] = {
                "x-message-ttl": delay_ms,
                "x-dead-letter-exchange": exchange,
                "x-dead-letter-routing-key": routing_key,
            }
            if self.settings.queue_type == "quorum":
                arguments["x-queue-type"] = "quorum"
            await self._channel.declare_queue(name, durable=True, arguments=arguments)
            self._delay_queues.add(name)

        if name not in self._delay_queues:
            await declare()
        await self._redeclaring(
            lambda: self._send("", name, body, _properties(headers, priority)), declare, name
        )

    async def reply(self, to: str, correlation_id: str | None, body: bytes) -> None:
        """Answer an RPC-style request on its reply queue (nobody listening is fine)."""
        properties = Properties(
            content_type=JSON,
            correlation_id=correlation_id,
            delivery_mode=1,
            priority=0,
        )
        await self._send("", to, body, properties, mandatory=False)

    async def publish_control(self, body: bytes) -> None:
        """Tell every worker (e.g. a program was cancelled); nobody listening is fine. Sent
        again CONTROL_REPEAT_S later (a duplicate is harmless: workers check the program)."""
        exchange = self.names.control_exchange
        try:
            await self._send_control(body)
        except _CONTROL_LOST:
            # 404 (deleted since it was declared: an operator), or the channel another's 404
            # closed: declared again, and the notice sent once more, not lost.
            log.warning("%s was deleted or its channel closed; declaring it again", exchange)
            await self._send_control(body, declare=True)
        await self._publish_delayed("control.exchange", exchange, "", body, CONTROL_REPEAT_S)

    async def _send_control(self, body: bytes, *, declare: bool = False) -> None:
        """On a confirming channel of its own: a publish to a deleted exchange closes its
        channel (404), failing every publish in flight there. Not a robust one: a new one is
        opened here when it closed, so none reopens by itself behind us."""
        exchange = self.names.control_exchange
        async with self._controlling:
            if self._control is None or self._control.is_closed:
                if self._connection is None:
                    raise RuntimeError("Bus.connect() was not called")
                self._control = aio_pika.Channel(self._connection, publisher_confirms=True)
                await self._control
                declare = True  # it may be open because another's 404 closed the last one
            channel = self._control
            if declare:
                await _declare_control(channel, exchange)
        await self._send(exchange, "", body, _properties(), mandatory=False, channel=channel)

    async def consume_control(self) -> Deliveries:
        """This process's own queue on the control exchange, gone when it disconnects."""

        async def queue_of(channel: AbstractRobustChannel) -> AbstractRobustQueue:
            # Deleted once unused for a while: one left unconsumed by a start that failed
            # half-way would gather every control message until the connection closed.
            queue = await channel.declare_queue(
                self.names.control_queue(),  # aio-pika's own name (`amq_...`) is no ours
                exclusive=True,
                auto_delete=True,
                arguments={"x-expires": CONTROL_QUEUE_EXPIRES_MS},
                robust=False,
            )
            await _declare_control(channel, self.names.control_exchange, queue.name)
            return queue

        return await self._consuming(queue_of, 0, no_ack=True)

    async def bind_control(self, iterator: Deliveries) -> None:
        """Bind a control consumer's queue again, declaring the exchange first (both are
        idempotent): a deleted `<prefix>.control` took the binding along. A consumer stopped,
        or whose channel closed, is left alone: it starts again bound."""
        channel = self._consumer_channels.get(iterator)
        if channel is None or channel.is_closed or not self.is_connected:
            return
        bind = _declare_control(channel, self.names.control_exchange, iterator.queue)
        await within(bind, PROBE_TIMEOUT_S)

    async def requeue(
        self,
        queue: str,
        body: bytes,
        headers: dict[str, Any],
        priority: int | None,
        *,
        reply_to: str | None = None,
        correlation_id: str | None = None,
    ) -> None:
        """Publish a message again at the tail of `queue` (after a failure), confirmed, with
        the sender's `reply_to` and `correlation_id` (a request's answer goes there). Its
        message id is the client's own, as every publish's: a copy sharing the sender's
        could have a return matched to the wrong publish (the sender's is in `headers`)."""
        properties = _properties(headers, priority or NEW)
        properties.reply_to = reply_to
        properties.correlation_id = correlation_id
        await self._send("", queue, body, properties)

    async def dead_letter(
        self, body: bytes, *, reason: str, source: str, message_id: str | None = None
    ) -> None:
        """Park an unusable message with the reason in its headers (and the id its sender
        gave it: what `dead --requeue` sends back keeps it)."""
        log.warning("dead-lettering a message from %s: %r", source, reason)
        headers: dict[str, Any] = {
            "x-shardflow-reason": reason,
            "x-shardflow-from": source,
            "x-shardflow-at": int(time.time() * 1000),  # when parked: `shardflow dead --purge`
        }
        # "" for none, as a copy after a failure says it: the header's absence is a letter
        # parked before this version.
        headers[SENT_ID] = message_id if message_id and len(message_id) <= MAX_MESSAGE_ID else ""
        # Declared again if it was deleted, or the message would go back to its queue's head
        # for good.
        queue = self.names.dead_queue
        await self._redeclaring(
            lambda: self._send("", queue, body, _properties(headers)),
            lambda: self._declare_dead(self._channel),
            queue,
        )

    async def peek_dead(self, limit: int) -> list[tuple[dict[str, Any], bytes]]:
        """Up to `limit` dead-lettered messages (headers, body), left in the queue; none when
        there is no dead-letter queue (nothing declared it: nothing was parked)."""
        channel = await self._consumer_channel()
        try:
            try:
                queue = await channel.get_queue(self.names.dead_queue, ensure=True)
            except aiormq.exceptions.ChannelNotFoundEntity:
                return []
            held: list[AbstractIncomingMessage] = []
            while len(held) < limit:
                message = await queue.get(no_ack=False, fail=False)
                if message is None:
                    break
                held.append(message)
            # Closing the channel hands every held message back, in order.
            return [(dict(message.headers or {}), message.body) for message in held]
        finally:
            await channel.close()

    async def purge_dead(
        self, old: Callable[[dict[str, Any]], bool] | None, most: int | None
    ) -> tuple[int, int]:
        """Delete dead-lettered messages from the oldest on, at most `most` (None: all, in one
        purge, those parked meanwhile too; not with `old`): all (`old` None), or those
        `old(headers)` says are, up to the first it says is not (parked in order: what
        follows is younger), which is handed back: to where it was in a classic queue, to
        the tail in a quorum queue. (deleted, left)."""
        channel = await self._consumer_channel()
        try:
            try:
                queue = await channel.get_queue(self.names.dead_queue, ensure=True)
            except aiormq.exceptions.ChannelNotFoundEntity:
                return 0, 0  # no dead-letter queue: nothing was ever parked
            # Counted before: the one handed back may not be counted yet by a declare after
            # (the broker requeues it after the nack; a test saw 1 left of 2).
            ready = queue.declaration_result.message_count or 0
            if most is None:  # all, what came meanwhile too: no `most` holds them to a count
                if old is not None:
                    raise ValueError("purge_dead: an age filter needs a most")
                purged = await queue.purge()
                left = await queue.declare()  # any held by a listing now come back later
                return purged.message_count or 0, left.message_count or 0
            deleted = 0
            while deleted < most:
                message = await queue.get(no_ack=False, fail=False)
                if message is None:
                    break
                if old is not None and not old(dict(message.headers or {})):
                    await message.nack(requeue=True)  # handed back (see above)
                    break
                await message.ack()
                deleted += 1
            return deleted, max(0, ready - deleted)
        finally:
            await channel.close()

    async def resend_dead(
        self,
        again: Callable[[dict[str, Any], str | None], tuple[str, dict[str, Any]] | None],
        most: int,
    ) -> tuple[int, int, int | None]:
        """Publish dead-lettered messages again, oldest first: those the queue held when
        this began, at most `most` of them. `again(headers, message_id)` names the queue each
        goes to and its headers (None: no queue known, kept). Each leaves the dead-letter
        queue once its copy is confirmed; those kept are handed back, in order, when the
        channel closes (at most MAX_DEAD_HELD held). (sent, kept, left: what the queue holds
        once done, letters refused again meanwhile too; None when it could not be counted)."""
        channel = await self._consumer_channel()
        try:
            try:
                queue = await channel.get_queue(self.names.dead_queue, ensure=True)
            except aiormq.exceptions.ChannelNotFoundEntity:
                return 0, 0, 0  # no dead-letter queue: nothing was ever parked
            # Only those there now: a letter refused again comes back behind them, and read
            # again it went round for as long as this ran (hundreds of times for 3 letters).
            ready = queue.declaration_result.message_count or 0
            sent = kept = 0
            while sent + kept < min(most, ready) and kept < MAX_DEAD_HELD:
                message = await queue.get(no_ack=False, fail=False)
                if message is None:
                    break
                target = again(dict(message.headers or {}), message.message_id)
                if target is None:
                    kept += 1  # held, not acked: back to the queue at the close
                    continue
                try:
                    await self.requeue(
                        target[0], message.body, target[1], message.priority,
                        reply_to=message.reply_to, correlation_id=message.correlation_id,
                    )  # fmt: skip
                except aio_pika.exceptions.PublishError:  # no such queue: it stays parked
                    kept += 1
                    continue
                await message.ack()
                sent += 1
        finally:
            await channel.close()  # the kept go back first, then they are counted
        try:  # the work is done: a count that fails is no reason to lose the others
            state = await self.queue_state(self.names.dead_queue)
        except Exception:
            return sent, kept, None
        return sent, kept, 0 if state is None else state[0]

    async def consume_ingress(self, prefetch: int) -> Deliveries:
        """Consume the ingress queue, declaring it first (with the arguments `declare` gives
        it): a consumer started again after its queue was deleted brings it back."""
        queue = self.names.ingress_queue
        return await self._consuming(
            lambda channel: channel.declare_queue(
                queue, durable=True, arguments=self._queue_arguments(), robust=False
            ),
            prefetch,
        )

    async def consume_pool(self, pool: str, prefetch: int) -> Deliveries:
        """Consume a pool's task queue, declaring it first: a named pool may be new."""
        return await self._consuming(
            lambda channel: self._declare_pool(channel, pool, robust=False), prefetch
        )

    async def consume_shard(self, shard: int, prefetch: int) -> Deliveries:
        """Consume a shard's queue, declaring it first: it may lie outside today's ring."""
        return await self._consuming(
            lambda channel: self._declare_shard(channel, shard, robust=False), prefetch
        )

    async def _consuming(
        self,
        queue_of: Callable[[AbstractRobustChannel], Awaitable[AbstractRobustQueue]],
        prefetch: int,
        *,
        no_ack: bool = False,
    ) -> Deliveries:
        """Declare a queue on a channel of its own and start consuming it.

        RabbitMQ 3.10 answers a consume on a quorum queue that another client is declaring at
        that moment (replicas starting together) with INTERNAL_ERROR, closing the connection:
        wait for the robust connection to come back and try again, a bounded number of times.
        """
        for attempt in range(1, CONSUME_ATTEMPTS + 1):
            # Waits for a connection that is down (a start's own timeout bounds it), so a
            # consumer starts again as soon as it is back, not at its next try.
            channel = await self._consumer_channel(prefetch, RECONNECT_WAIT_S)
            try:
                queue = await queue_of(channel)
                iterator = Deliveries(await _underlay(channel), queue.name, no_ack=no_ack)
                await iterator.consume()
            except _CONSUME_RACE as exc:
                await _close_quietly(channel)
                if attempt == CONSUME_ATTEMPTS:
                    raise
                log.warning("consume refused (%r); trying again once reconnected", exc)
                await asyncio.sleep(CONSUME_BACKOFF_S * attempt)
                assert self._connection is not None
                await asyncio.wait_for(self._connection.connected.wait(), RECONNECT_WAIT_S)
                continue
            except BaseException:
                # Given up (refused, a timeout, a stop): a robust channel left open is opened
                # again on every reconnect, a channel nobody uses.
                await _close_quietly(channel)
                raise
            self._consumer_channels[iterator] = channel
            return iterator
        raise AssertionError("unreachable")

    async def stop_consuming(self, iterator: Deliveries) -> None:
        """Stop a consumer for good, closing its channel too: a robust channel left open is
        opened again on every reconnect, a channel nobody uses."""
        channel = self._consumer_channels.pop(iterator, None)
        with contextlib.suppress(Exception):
            await within(iterator.close(), CLOSE_TIMEOUT_S)
        if channel is not None:
            await _close_quietly(channel)

    async def _consumer_channel(
        self, prefetch: int = 0, wait_s: float = 0
    ) -> AbstractRobustChannel:
        """A channel of its own; while the connection is down, after waiting up to `wait_s`
        for it to come back, ConnectionError (no channel made and closed again)."""
        if self._connection is None:
            raise RuntimeError("Bus.connect() was not called")
        if not self._connection.connected.is_set() and wait_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._connection.connected.wait(), wait_s)
        if not self._connection.connected.is_set():
            raise ConnectionError("the broker connection is down; it reconnects by itself")
        # aio-pika and aiormq while the connection is down: "Connection was not opened",
        # "<Connection ...> closed".
        try:
            channel = self._connection.channel(publisher_confirms=False)
        except RuntimeError as exc:
            raise ConnectionError(f"the broker connection is down: {exc}") from exc
        try:
            await channel
            if prefetch:
                await channel.set_qos(prefetch_count=prefetch)
        except BaseException as exc:
            # One that failed to open is still the robust connection's: closed, or it is
            # opened again on the next reconnect, a channel nobody uses.
            await _close_quietly(channel)
            if isinstance(exc, RuntimeError):
                raise ConnectionError(f"the broker connection is down: {exc}") from exc
            raise
        return channel


async def _underlay(channel: AbstractChannel) -> aiormq.Channel:
    """aiormq's channel under aio-pika's, which consumes (orchestrator/consuming.py)."""
    return cast(aiormq.Channel, await channel.get_underlay_channel())


async def _declare_control(channel: AbstractChannel, exchange: str, queue: str = "") -> None:
    """The control exchange declared, and `queue` (if any) bound to it: both idempotent. Through
    aiormq: a robust channel's would be declared again on its every reopening."""
    underlay = await _underlay(channel)
    await underlay.exchange_declare(exchange, exchange_type="fanout", durable=True)
    if queue:
        await underlay.queue_bind(queue, exchange)


# Channel closes under way that a caller stopped waiting for: held until done.
_closing: set[asyncio.Future[Any]] = set()


async def _close_quietly(channel: AbstractChannel | aiormq.abc.AbstractChannel) -> None:
    """Close a channel we give up on, waiting at most CLOSE_TIMEOUT_S: a closing connection may
    never answer. The close itself is never cancelled, neither by that bound nor by a stop
    that cancels the caller (a consumer start given up at shutdown): aiormq answers a cancelled
    Channel.Close by sending a second one, which RabbitMQ takes as a frame on a closed channel
    and closes the whole connection (504 CHANNEL_ERROR "expected 'channel.open'"), the publisher
    channel and every other part's consumers with it, for as long as the reconnect takes."""
    closing = asyncio.ensure_future(channel.close())
    _closing.add(closing)
    closing.add_done_callback(_closed_quietly)
    await asyncio.wait({closing}, timeout=CLOSE_TIMEOUT_S)  # a cancel leaves `closing` be


def _closed_quietly(closing: asyncio.Future[Any]) -> None:
    _closing.discard(closing)
    if not closing.cancelled():
        closing.exception()  # retrieved: a close that failed is nothing to report


def _properties(headers: dict[str, Any] | None = None, priority: int = GOING_ON) -> Properties:
    """A persistent JSON message's properties: made here, not through aio-pika's `Message`,
    which cost 27 us a publish against 1.5 (bench/README.md). No headers are sent as none, not
    as an empty table the broker decodes at every hop. A new object each time: aiormq
    writes the message id it picks into it."""
    return Properties(
        content_type=JSON, delivery_mode=PERSISTENT, headers=headers or None, priority=priority
    )
