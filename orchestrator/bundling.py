"""Single task messages of different programs, published in one loop turn to one queue, sent
as one message (a bundle) while the pool has a backlog; and their reports, the same way.

A chain moves one task at a time, so under load an owner publishes many programs' next tasks
in each turn, every one a message of its own: the broker, the owner and the worker each pay a
publish, a confirm, a delivery and an ack per task. Sent together they pay that once a bundle
(bench/README.md: chains at M=200). The owner asks for it only while the pool's own queue has
a backlog (`Backlog.bundle`), so a pool whose workers keep up gets one task a message and its
tasks spread over them.

Each task's transition awaits the bundle's confirm before its report is acked, as before: a
bundle is only a way to carry messages, not a change to what is guaranteed.

A worker sends the reports of a bundle's tasks back the same way, a bundle a shard: those that
ended in one turn go as one message, which the owner applies report by report (owner.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable

from prometheus_client import Counter

from orchestrator import metrics
from orchestrator.messages import MAX_BUNDLE, MAX_BUNDLE_BYTES, MAX_BUNDLED_BYTES, bundle

Send = Callable[[Hashable, bytes], Awaitable[None]]


class _Bundle:
    __slots__ = ("bodies", "sent", "size")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.bodies: list[bytes] = []
        self.size = 0
        self.sent: asyncio.Future[None] = loop.create_future()


class Bundles:
    """The bundles being filled this loop turn, one a key (a task queue, priority and headers;
    or a shard and priority); `send(key, body)` publishes one and waits for its confirm."""

    def __init__(
        self,
        send: Send,
        counters: tuple[Counter, Counter] = (metrics.BUNDLES, metrics.BUNDLED_TASKS),
    ) -> None:
        self._send = send
        self._counters = counters  # bundles sent, and the messages in them
        self._open: dict[Hashable, _Bundle] = {}
        self._flushing: set[asyncio.Task[None]] = set()  # referenced until done
        self.bundles = 0  # bundles of more than one message sent, and the messages in them
        self.bundled = 0

    async def publish(self, key: Hashable, body: bytes, most: int) -> None:
        """Publish `body` in the turn's bundle for `key` (at most `most` messages), and wait for
        that bundle's confirm."""
        loop = asyncio.get_running_loop()
        most = min(most, MAX_BUNDLE)  # what a worker takes
        if most <= 1 or len(body) > MAX_BUNDLED_BYTES:
            await self._send(key, body)
            return
        current = self._open.get(key)
        most_bytes = MAX_BUNDLE_BYTES - len(body)
        if current is None or len(current.bodies) >= most or current.size > most_bytes:
            current = self._open[key] = _Bundle(loop)
            # At the turn's end: the transitions resumed in this turn publish first.
            loop.call_soon(self._close, key, current)
        current.bodies.append(body)
        current.size += len(body)
        # Shielded: one transition cancelled (a hard stop) leaves the others' publish be.
        await asyncio.shield(current.sent)

    def _close(self, key: Hashable, current: _Bundle) -> None:
        if self._open.get(key) is current:
            del self._open[key]
        task = asyncio.get_running_loop().create_task(self._flush(key, current))
        self._flushing.add(task)
        task.add_done_callback(self._flushing.discard)

    async def _flush(self, key: Hashable, current: _Bundle) -> None:
        bodies = current.bodies
        try:
            await self._send(key, bodies[0] if len(bodies) == 1 else bundle(bodies))
        except Exception as exc:
            current.sent.set_exception(exc)
            current.sent.exception()  # retrieved: each waiter raises it on its own
            return
        except BaseException:  # cancelled (the loop closing): its waiters with it
            current.sent.cancel()
            raise
        if len(bodies) > 1:
            self.bundles += 1
            self.bundled += len(bodies)
            self._counters[0].inc()
            self._counters[1].inc(len(bodies))
        current.sent.set_result(None)
