"""The delivery policy: what every consumer (shard, pools, ingress) does with a message.

Shaped like aio-pika's `message.process()`, for at-least-once work:

    async with process(delivery, bus, source, poison=(MessageError,)):
        ...  # decode, transition, publish (each publish awaits the broker's confirm)

- the block returns: ack. Its publishes were confirmed inside it, so the ack comes after them.
- the block raises `Poison` or one of `poison`: retrying cannot help. The message is parked in
  the dead-letter queue with the reason, then acked.
- the block raises anything else: the message is published again at the queue's tail (with
  its reply-to and correlation ids, and its sender's message id in a header) and the
  original acked, so it cannot wedge the head of a shard's queue, then a pause, so a broken
  dependency is not hammered. Any error but a lost connection (UNCOUNTED) or Redis refusing
  work (REFUSING) is counted in the header `x-shardflow-failures`, and at `limit` failures the
  message is dead-lettered with its last error, on every queue type. A lost connection (Redis
  away, a Redis Cluster failing over) or a refusal (Redis full) is not counted, however often:
  the header is kept as it was (present, so the message counts as redelivered). It is not
  nacked either: a quorum queue counts each nack against its `x-delivery-limit` (RabbitMQ
  3.x), so a Redis restart of a few seconds would have the broker dead-letter every message in
  flight. When RabbitMQ is away too, the message is handed back as it is (the nack, or the
  channel's close).
- the block is cancelled (a hard stop): neither. The channel's close hands it back.

A message carried inside another (a bundle's task) is settled by the same policy as a `Part`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from aiormq.exceptions import ChannelInvalidStateError
from pydantic import ValidationError
from redis.exceptions import (
    ClusterDownError,
    ReadOnlyError,
    RedisClusterUnreachableError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from orchestrator import metrics
from orchestrator.documents import key_name, printable

log = logging.getLogger(__name__)

# After a transient failure: long enough not to spin on a dead dependency, short enough to
# recover quickly once it is back.
RETRY_PAUSE_S = 0.5
FAILURES = "x-shardflow-failures"
# The message id a requeued message's sender gave ("" for none), which its copy keeps.
SENT_ID = "x-shardflow-message-id"
MAX_MESSAGE_ID = 255  # an AMQP short string's
OWN_HEADERS = "x-shardflow-"
MAX_REASON = 1000
# The services being away: not the message's fault, so never counted against it. (aiormq's
# connection errors are OSErrors; a refused publish, DeliveryError, is not one of these.)
UNREACHABLE = (
    OSError,
    RedisConnectionError,
    RedisTimeoutError,
    RedisClusterUnreachableError,  # no node of a Redis Cluster reached
    ChannelInvalidStateError,
)
# Of those, the ones the delivery policy never counts against a message, however long they
# last: a connection lost or refused (RabbitMQ's or Redis's, Redis loading its data too), a
# Redis Cluster failing over. Any other error, an OSError too, counts toward the limit.
UNCOUNTED = (
    ConnectionError,
    RedisConnectionError,
    RedisTimeoutError,
    ChannelInvalidStateError,
    ClusterDownError,
    RedisClusterUnreachableError,
    TryAgainError,
    ReadOnlyError,
)


# An outage requeues every message in flight about once a RETRY_PAUSE_S: a line per queue
# every QUIET_S, saying how many more since, not one a message (5 in flight made 125 lines in
# 30 s, and the line that named the fault was lost among them).
QUIET_S = 10.0
MAX_QUIET = 1024  # queues remembered (this cluster's own: a bound all the same)
_quiet: dict[str, tuple[float, int]] = {}


# Redis up but refusing work, for as long as an operator takes to mend it: full (OOM, under
# the noeviction the docs ask for), its disk failing (MISCONF), a script running long (BUSY),
# too few replicas (NOREPLICAS), an ACL (NOPERM; inside a script, "ERR ... can't run this
# command"), a replica's master away (MASTERDOWN), loading its data (LOADING). None is the
# message's fault: counted, every message in flight was dead-lettered within 10 s, and its
# program stayed running for good. So they are not counted, as a lost connection is not.
REFUSING = frozenset({"OOM", "MISCONF", "BUSY", "NOREPLICAS", "NOPERM", "MASTERDOWN", "LOADING"})
_REFUSING_TEXTS = ("can't run this command", "OOM command not allowed")
# The last refusal seen (when, what), for /healthz: PING is still answered while Redis is full.
last_refusal: tuple[float, str] | None = None


def redis_refuses(exc: BaseException) -> bool:
    """Whether `exc` is Redis refusing work for a while (REFUSING), whatever the message."""
    if not isinstance(exc, ResponseError):
        return False
    if getattr(exc, "status_code", None) in REFUSING:
        return True
    text = str(exc)
    return any(refusal in text for refusal in _REFUSING_TEXTS)


def waits_for_services(exc: BaseException) -> bool:
    """Whether `exc` says RabbitMQ or Redis is away or refusing work: nothing the message did,
    so never counted against it (and noted for /healthz when Redis refuses)."""
    if redis_refuses(exc):
        global last_refusal
        last_refusal = (time.monotonic(), f"refuses work: {describe(exc)[:200]}")
        return True
    return isinstance(exc, UNCOUNTED)


class Poison(Exception):
    """A message that can never be processed; `str()` is the reason recorded with it."""


class Delivery(Protocol):
    """One received message; `consuming.Incoming` is one (and aio-pika's IncomingMessage)."""

    @property
    def body(self) -> bytes: ...

    @property
    def redelivered(self) -> bool | None: ...

    @property
    def headers(self) -> dict[str, Any]: ...

    @property
    def priority(self) -> int | None: ...

    async def ack(self) -> None: ...

    async def nack(self, *, requeue: bool = True) -> None: ...


class Part:
    """A message carried inside another (a bundle's task), which the policy settles on its own:
    poison parks just it, a failure publishes just it again. Acking it is the carrier's
    business; a nack (the broker away) asks for the whole carrier back (`handed_back`)."""

    __slots__ = ("_body", "_whole", "handed_back")

    def __init__(self, whole: Delivery, body: Callable[[], bytes]) -> None:
        self._whole = whole
        self._body = body  # made only when needed: parked or published again
        self.handed_back = False

    @property
    def body(self) -> bytes:
        return self._body()

    @property
    def redelivered(self) -> bool | None:
        return self._whole.redelivered

    @property
    def headers(self) -> dict[str, Any]:
        return self._whole.headers

    @property
    def priority(self) -> int | None:
        return self._whole.priority

    async def ack(self) -> None:
        pass

    async def nack(self, *, requeue: bool = True) -> None:
        self.handed_back = True


class Requeues(Protocol):
    """What the policy needs of the transport; `Bus` is one."""

    async def dead_letter(
        self, body: bytes, *, reason: str, source: str, message_id: str | None = None
    ) -> None: ...

    async def requeue(
        self,
        queue: str,
        body: bytes,
        headers: dict[str, Any],
        priority: int | None,
        *,
        reply_to: str | None = None,
        correlation_id: str | None = None,
    ) -> None: ...


@contextlib.asynccontextmanager
async def process(
    delivery: Delivery,
    bus: Requeues,
    source: str,
    *,
    poison: tuple[type[Exception], ...] = (),
    on_poison: Callable[[str], Awaitable[None]] | None = None,
    limit: int = 20,
) -> AsyncIterator[None]:
    """Run the block for one delivery of queue `source` and settle it by the policy above.

    `on_poison(reason)` runs after a message was parked, poison or at the limit (e.g. to
    answer its sender, who would otherwise hear nothing).
    """
    if redelivered(delivery):
        metrics.REDELIVERIES.labels(source).inc()
    try:
        yield
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        if not isinstance(exc, (Poison, *poison)):
            await _again(delivery, bus, source, exc, limit, on_poison)
            return
        reason = describe(exc)
        try:
            await bus.dead_letter(
                delivery.body, reason=reason, source=source, message_id=_sent(delivery)
            )
            metrics.DEAD_LETTERS.labels(source, "refused").inc()
            if on_poison is not None:
                await on_poison(reason)
        except Exception as failure:  # the broker went away: keep the message, try later
            await _requeue(delivery, source, failure)
            return
    await settle(delivery, ok=True)


async def split(delivery: Delivery, bus: Requeues, source: str, bodies: list[bytes]) -> None:
    """Publish messages a bundle carried each alone to `source`, counted as redelivered (the
    failures header): a try of the bundle was cut short, maybe by one of them, which so takes
    no other program's message with it again, or these were not settled in its try."""
    log.info("%s: %d message(s) of a bundle go on alone", source, len(bodies))
    headers = split_headers(delivery)
    for body in bodies:
        await bus.requeue(source, body, headers, delivery.priority)


def split_headers(delivery: Delivery) -> dict[str, Any]:
    """The headers of what a bundle carried, published again on its own: counted as
    redelivered (the failures header), with the bundle's own headers that may be kept."""
    return {FAILURES: 0, **kept_headers(delivery.headers)}


def redelivered(delivery: Delivery) -> bool:
    """Whether an earlier try at this message may have been cut short: the broker redelivered
    it, or the policy published it again after a failure. Such a message publishes again what
    its transition produces, even when that transition already happened."""
    return bool(delivery.redelivered) or FAILURES in (delivery.headers or {})


async def _again(
    delivery: Delivery,
    bus: Requeues,
    source: str,
    exc: Exception,
    limit: int,
    on_poison: Callable[[str], Awaitable[None]] | None = None,
) -> None:
    """Publish the message again at the tail of its queue, counting the failure unless the
    services are away, or dead-letter it at `limit` failures; then ack the original."""
    unreachable = waits_for_services(exc)
    try:
        headers = kept_headers(delivery.headers)
        failures = _int((delivery.headers or {}).get(FAILURES)) + (0 if unreachable else 1)
        if failures >= limit:
            reason = f"failed {failures} times, the limit; last: {describe(exc)}"
            await bus.dead_letter(
                delivery.body, reason=reason, source=source, message_id=_sent(delivery)
            )
            metrics.DEAD_LETTERS.labels(source, "limit").inc()
            if on_poison is not None:
                await on_poison(reason)
        else:
            if unreachable:
                _say_requeued(source, exc)
            else:
                log.warning(
                    "%s: failure %d of %d, requeued: %s", source, failures, limit, fault(exc)
                )
            headers[FAILURES] = failures
            # The copy gets a message id of the client's own: it keeps the sender's here.
            headers[SENT_ID] = _sent(delivery) or ""
            await bus.requeue(
                source,
                delivery.body,
                headers,
                delivery.priority,
                reply_to=getattr(delivery, "reply_to", None),
                correlation_id=getattr(delivery, "correlation_id", None),
            )
            metrics.REQUEUED.labels(source, "unreachable" if unreachable else "failed").inc()
    except Exception as failure:  # could not publish (RabbitMQ away): hand it back as it is
        await _requeue(delivery, source, failure)
        return
    await settle(delivery, ok=True)
    if failures < limit:
        await asyncio.sleep(RETRY_PAUSE_S)


def kept_headers(headers: dict[str, Any] | None) -> dict[str, Any]:
    """The headers a message published again keeps: shardflow's own (`x-shardflow-*`) as
    values the client can write back, an integer or a short text. Any other header is read by
    no part, and one the client cannot write back (a long string that is no UTF-8, a double
    too large for it) made every try to publish it again fail, so a message sent back after a
    failure, or a bundle split, went round forever."""
    kept: dict[str, Any] = {}
    for name, value in (headers or {}).items():
        writable = (isinstance(value, int) and -(2**63) <= value < 2**63) or (
            isinstance(value, str) and len(value) <= MAX_MESSAGE_ID
        )
        if name.startswith(OWN_HEADERS) and writable and not isinstance(value, bool):
            kept[name] = value
    return kept


def _sent(delivery: Delivery) -> str | None:
    """The id its sender gave the message, kept with it when it is parked: an ingress request
    without a workflow id takes its id from it, so one sent back (`dead --requeue`) submits
    the same program, never a second."""
    return sent_id(delivery, getattr(delivery, "message_id", None))


def sent_id(delivery: Delivery, message_id: str | None) -> str | None:
    """The message id the sender gave (`message_id`, the delivery's), or what a copy
    published again after a failure kept of it; None for none."""
    kept = (delivery.headers or {}).get(SENT_ID, message_id)
    if isinstance(kept, bytes):
        kept = kept.decode("utf-8", "replace")
    if not isinstance(kept, str) or len(kept) > MAX_MESSAGE_ID:
        return message_id  # a header nobody here wrote: the delivery's own
    return kept or None


def _int(value: Any) -> int:
    try:
        return max(0, int(value))
    except (TypeError, ValueError, OverflowError):  # a header nobody here wrote
        return 0


def _say_requeued(source: str, exc: Exception) -> None:
    """Log a message requeued while a service is away: the first of `source`'s in QUIET_S,
    with how many were since the last line."""
    now = time.monotonic()
    last, since = _quiet.get(source, (-QUIET_S, 0))
    if now - last < QUIET_S:
        _quiet[source] = (last, since + 1)
        return
    if len(_quiet) >= MAX_QUIET:
        _quiet.clear()
    _quiet[source] = (now, 0)
    more = f" ({since} more in the last {now - last:.0f}s)" if since else ""
    log.warning("%s: message requeued after %s%s", source, fault(exc), more)


def fault(exc: BaseException) -> str:
    """An error for a log line, by its type and text: redis-py's repr is only its category
    (`server:ResponseError`), which named no fault."""
    return f"{type(exc).__name__}: {describe(exc)}"


async def _requeue(delivery: Delivery, source: str, exc: Exception) -> None:
    _say_requeued(source, exc)
    metrics.REQUEUED.labels(source, "unreachable").inc()
    await settle(delivery, ok=False)
    await asyncio.sleep(RETRY_PAUSE_S)


async def settle(delivery: Delivery, *, ok: bool) -> None:
    """Ack, or hand back for redelivery. When the channel is already gone the broker hands the
    message back by itself, so a failure here is logged, not raised."""
    try:
        if ok:
            await delivery.ack()
        else:
            await delivery.nack(requeue=True)
    except Exception as exc:
        log.warning(
            "could not %s a message (%s); it will be delivered again",
            "ack" if ok else "requeue",
            exc,
        )


def describe(exc: BaseException) -> str:
    """One line for a refusal: a validation error's first fault with where it is, else str()
    (escaped where not printable: it is logged, and listed by `shardflow dead`); at most
    MAX_REASON characters, since it travels in a message header."""
    text = printable(first_error(exc) if isinstance(exc, ValidationError) else str(exc))
    return text if len(text) <= MAX_REASON else text[: MAX_REASON - 10] + " ... (cut)"


def first_error(
    exc: ValidationError,
    name: Callable[[tuple[int | str, ...]], str] | None = None,
    root: str = "message",
) -> str:
    """`where: what` for the first fault of a validation error, `(+N more)` when there are more.

    `name` turns the fault's location, its keys as `key_name` shows them, into a name
    (default: dotted, e.g. `batch.0.index`, or `root` for the whole document).
    """
    first = exc.errors()[0]
    # The location holds the document's own keys, and pydantic's message can repeat its values
    # (a tag that matches none): the reason is logged and shown, so neither is taken raw.
    loc = tuple(part if isinstance(part, int) else key_name(part) for part in first["loc"])
    where = name(loc) if name else ".".join(str(part) for part in loc) or root
    more = f" (+{exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    # A validator's own ValueError reads as pydantic words it: "Value error, <ours>".
    return f"{where}: {printable(first['msg'].removeprefix('Value error, '))}{more}"
