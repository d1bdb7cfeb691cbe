"""Why a robust RabbitMQ connection is down: what closed it, then why each reconnect failed.

aio-pika reconnects by itself and logs why an attempt failed, but keeps no reason: `/healthz`
said `rabbitmq: not connected`, and the reason (a rotated password, a broker away) was in the
logs alone. Its close callbacks get the exception both of the loss and of each failed attempt.
"""

from __future__ import annotations

from typing import Any

from aio_pika.abc import AbstractRobustConnection

MAX_REASON = 300  # characters kept: an exception's text is the broker's or the kernel's


class DownReason:
    """The last reason `connection` went down or failed to come back (read it only while the
    connection is down: it is not cleared when the connection is back)."""

    def __init__(self, connection: AbstractRobustConnection) -> None:
        self.reason = ""
        connection.close_callbacks.add(self._lost)

    def _lost(self, _sender: Any, exc: BaseException | None = None) -> None:
        if exc is not None:
            self.reason = describe(exc)


def describe(exc: BaseException) -> str:
    """An exception as one short line: its type and text (never a URL: aiormq's texts hold
    the broker's reply or the kernel's, and the address)."""
    text = str(exc) or repr(exc)
    return f"{type(exc).__name__}: {text}"[:MAX_REASON]
