"""The delivery policy: what every consumer (shard, pools, ingress) does with a message.

Shaped like aio-pika's `message.process()`, for at-least-once work:

    async with process(delivery, bus, source, poison=(MessageError,)):
        ...  # decode, transition, publish (each publish awaits the broker's confirm)

- the block returns: ack. Its publishes were confirmed inside it, so the ack comes after them.
- the block raises `Poison` or one of `poison`: retrying cannot help. The message is parked in
  the dead-letter queue with the reason, then acked.
- the block raises anything else: requeue, then pause, so a broken dependency is not hammered.
- the block is cancelled (a hard stop): neither. The channel's close hands it back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

from pydantic import ValidationError

log = logging.getLogger(__name__)

# After a transient failure: long enough not to spin on a dead dependency, short enough to
# recover quickly once it is back.
RETRY_PAUSE_S = 0.5


class Poison(Exception):
    """A message that can never be processed; `str()` is the reason recorded with it."""


class Delivery(Protocol):
    """One received message; aio-pika's IncomingMessage is one."""

    @property
    def body(self) -> bytes: ...

    @property
    def redelivered(self) -> bool | None: ...

    async def ack(self) -> None: ...

    async def nack(self, *, requeue: bool = True) -> None: ...


class DeadLetters(Protocol):
    async def dead_letter(self, body: bytes, *, reason: str, source: str) -> None: ...


@contextlib.asynccontextmanager
async def process(
    delivery: Delivery,
    bus: DeadLetters,
    source: str,
    *,
    poison: tuple[type[Exception], ...] = (),
    on_poison: Callable[[str], Awaitable[None]] | None = None,
) -> AsyncIterator[None]:
    """Run the block for one delivery and settle it by the policy above.

    `on_poison(reason)` runs after a poison message was parked (e.g. to answer its sender).
    """
    try:
        yield
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        if not isinstance(exc, (Poison, *poison)):
            await _requeue(delivery, source, exc)
            return
        reason = describe(exc)
        try:
            await bus.dead_letter(delivery.body, reason=reason, source=source)
            if on_poison is not None:
                await on_poison(reason)
        except Exception as failure:  # the broker went away: keep the message, try later
            await _requeue(delivery, source, failure)
            return
    await settle(delivery, ok=True)


async def _requeue(delivery: Delivery, source: str, exc: Exception) -> None:
    log.warning("%s: message requeued after %r", source, exc)
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
    """One line for a refusal: a validation error's first fault with where it is, else str()."""
    if isinstance(exc, ValidationError):
        return first_error(exc)
    return str(exc)


def first_error(
    exc: ValidationError,
    name: Callable[[tuple[int | str, ...]], str] | None = None,
    root: str = "message",
) -> str:
    """`where: what` for the first fault of a validation error, `(+N more)` when there are more.

    `name` turns the fault's location into a name (default: dotted, e.g. `batch.0.index`, or
    `root` for the whole document).
    """
    first = exc.errors()[0]
    loc = tuple(first["loc"])
    where = name(loc) if name else ".".join(str(part) for part in loc) or root
    more = f" (+{exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"{where}: {first['msg']}{more}"
