"""Why a robust RabbitMQ connection is down: what closed it, then why each reconnect failed.

aio-pika reconnects by itself and logs why an attempt failed, but keeps no reason: `/healthz`
said `rabbitmq: not connected`, and the reason (a rotated password, a broker away) was in the
logs alone. Its close callbacks get the exception both of the loss and of each failed attempt.
"""

from __future__ import annotations

from typing import Any

from aio_pika.abc import AbstractRobustConnection

from orchestrator.delivery import fault
from orchestrator.documents import printable

# Characters of the reason kept: an exception's text is the broker's or the kernel's (aiormq's
# hold its reply or the address, never the URL's password).
MAX_DOWN_REASON = 300


class DownReason:
    """The last reason `connection` went down or failed to come back; read it only while the
    connection is down (a close with no exception, ours, clears it)."""

    def __init__(self, connection: AbstractRobustConnection) -> None:
        self.reason = ""
        connection.close_callbacks.add(self._lost)

    def _lost(self, _sender: Any, exc: BaseException | None = None) -> None:
        if exc is None:
            self.reason = ""
        else:  # an exception of no text (ConnectionResetError()) is named by its repr
            self.reason = (fault(exc) if str(exc) else printable(repr(exc)))[:MAX_DOWN_REASON]
