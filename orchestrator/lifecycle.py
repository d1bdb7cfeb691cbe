"""The shared lifecycle of long-running parts: `run()` until `shutdown()`, then a two-phase stop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from aiormq.exceptions import ChannelInvalidStateError, ChannelNotFoundEntity

from orchestrator.consuming import Deliveries, Incoming

log = logging.getLogger(__name__)
T = TypeVar("T")

# The pause before a consumer that failed under a broker restart starts again.
RECONSUME_S = 1.0
# A queue that answers each start with 404 (its cluster node is down) is tried again after a
# pause that doubles up to this: each try opens a channel, which aio-pika keeps 4.3 KB of, so a
# node down for hours cost a worker 15 MB an hour a queue at one try a second.
REFUSED_MAX_S = 16.0
# A consumer start or stop that takes longer is given up (and a start tried again): a broker
# that never answers one RPC must not hold a part's loop, or its stop, forever.
CONSUMER_RPC_TIMEOUT_S = 30.0
# How long a stop waits for a cancelled loop or task to end before it leaves it behind.
LOOP_END_S = 10.0
# A lost connection (aiormq's errors are OSErrors), as a consumer sees it.
_LOST = (OSError, ChannelInvalidStateError)
# Starting one, also: a queue declared but not there (404: in a cluster, its node is down).
_NOT_YET = (TimeoutError, *_LOST, ChannelNotFoundEntity)


def raise_if_cancelled() -> None:
    """For a loop that calls clients between its sleeps: a stop cancels the loop, a client may
    swallow that cancellation (aio-pika, redis-py while a connection closes), and a loop that
    went on would hold the stop forever."""
    this = asyncio.current_task()
    if this is not None and this.cancelling():
        raise asyncio.CancelledError


async def within(awaitable: Awaitable[T], timeout_s: float) -> T:
    """`awaitable`'s result, or TimeoutError after `timeout_s`, when it is cancelled and left
    behind. Unlike asyncio.wait_for (3.11), never waits for a cancelled call to end: aio-pika
    may hold one on an RPC the broker never answers, until its connection closes."""
    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not done:
        task.cancel()
        raise TimeoutError(f"no answer in {timeout_s:g}s")
    return task.result()


async def end_tasks(
    tasks: list[asyncio.Task[Any]], what: str, within_s: float | None = None
) -> bool:
    """Cancel tasks and wait `within_s` (LOOP_END_S) for them; a task that still runs (it
    refuses its cancel) is left behind, said in the log. Whether all ended."""
    for task in tasks:
        task.cancel()
    if not tasks:
        return True
    _, stuck = await asyncio.wait(tasks, timeout=LOOP_END_S if within_s is None else within_s)
    for task in stuck:
        log.warning("%s did not end when cancelled; left behind: %r", what, task)
    return not stuck


async def _started(
    start: Callable[[], Awaitable[Deliveries]],
    stop: Callable[[Deliveries], Awaitable[None]],
) -> Deliveries:
    """A consumer `start` opened within CONSUMER_RPC_TIMEOUT_S, else TimeoutError. A start
    given up (a timeout, a stop) is cancelled, and if it still opens its consumer (aio-pika
    may finish an RPC it was cancelled in) that consumer is stopped: left open, it would hold
    messages nobody reads."""
    starting = asyncio.ensure_future(start())
    try:
        done, _ = await asyncio.wait({starting}, timeout=CONSUMER_RPC_TIMEOUT_S)
    except asyncio.CancelledError:
        await _abandon(starting, stop)
        raise
    if not done:
        await _abandon(starting, stop)
        raise TimeoutError(f"no consumer in {CONSUMER_RPC_TIMEOUT_S:g}s")
    return starting.result()


async def _abandon(
    starting: asyncio.Future[Deliveries],
    stop: Callable[[Deliveries], Awaitable[None]],
) -> None:
    def stop_late(done: asyncio.Future[Deliveries]) -> None:
        if not done.cancelled() and done.exception() is None:
            task = asyncio.ensure_future(stop(done.result()))
            _left.add(task)
            task.add_done_callback(_left.discard)

    starting.add_done_callback(stop_late)
    starting.cancel()
    await asyncio.wait({starting}, timeout=LOOP_END_S)


_left: set[asyncio.Task[None]] = set()  # stops of abandoned consumers, held until done


def format_counts(counts: Counter[str]) -> str:
    """`applied 5, stale 1`: what a part handled, for its stop log."""
    return ", ".join(f"{name} {counts[name]}" for name in sorted(counts))


class Service:
    """Consumer loops that stop taking work on shutdown, get a grace period, then are cancelled.

    Subclasses implement `_start()`, returning the loops to run; each loop reads its queue
    through `_messages()`, so shutdown can cancel the consumer first.
    """

    name = "service"

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self._stop = asyncio.Event()
        self._iterators: set[Deliveries] = set()
        self._wanted = 0  # consumer loops under way: each wants a consumer started
        self._in_flight: set[asyncio.Task[Any]] = set()
        # One consumer start at a time: a worker starts one per share queue, and several
        # opening channels and declaring at once on one connection only contend.
        self._starting = asyncio.Lock()

    async def _start(self) -> list[Coroutine[Any, Any, None]]:
        raise NotImplementedError

    async def _messages(
        self,
        start: Callable[[], Awaitable[Deliveries]],
        stop: Callable[[Deliveries], Awaitable[None]],
    ) -> AsyncIterator[Incoming]:
        """The messages of a consumer that `start` opens, until shutdown. One that fails (its
        channel closed: a reconnect) or ends (the broker cancelled it) is stopped, its channel
        too, and started again (orchestrator/consuming.py)."""
        refused = 0  # starts in a row the broker answered 404
        self._wanted += 1
        try:
            while True:
                try:
                    async with self._starting:
                        iterator = await _started(start, stop)
                except _NOT_YET as exc:
                    raise_if_cancelled()
                    # Counted up to a bound: 2 ** 1024 is no float (a node down for 4.5 hours).
                    refused = min(refused + 1, 16) if isinstance(exc, ChannelNotFoundEntity) else 0
                    pause = min(RECONSUME_S * 2 ** max(0, refused - 1), REFUSED_MAX_S)
                    log.warning(
                        "%s: a consumer did not start (%r); trying again in %gs",
                        self.name,
                        exc,
                        pause,
                    )
                    await asyncio.sleep(pause)
                    continue
                refused = 0
                self._iterators.add(iterator)
                try:
                    async for message in iterator:
                        yield message
                    if self._stop.is_set():
                        return
                    log.warning("%s: a consumer ended under us; consuming again", self.name)
                except _LOST as exc:
                    log.warning("%s: a consumer failed (%r); consuming again", self.name, exc)
                finally:
                    self._iterators.discard(iterator)
                with contextlib.suppress(Exception):
                    await within(stop(iterator), CONSUMER_RPC_TIMEOUT_S)
                raise_if_cancelled()
                await asyncio.sleep(RECONSUME_S)
        finally:
            self._wanted -= 1

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run one message's work beside the loop; held until done, awaited on stop.

        Stopping the loop never cuts a message's work short: `run()` gives it the grace.
        """
        task = asyncio.create_task(coroutine)
        self._in_flight.add(task)
        task.add_done_callback(self._in_flight.discard)
        return task

    @property
    def consuming(self) -> bool:
        """Whether this part consumes now: every consumer it wants started (one of four
        shards' failing to start for good left it ready), and it is not stopping."""
        # A consumer the broker took back (consumer_timeout, its channel closed) counts as
        # none at once: a worker whose slots are all busy would notice only once it read it.
        started = sum(1 for iterator in self._iterators if getattr(iterator, "live", True))
        return started > 0 and started >= self._wanted and not self._stop.is_set()

    def summary(self) -> str:
        """One line of what this part handled, logged when it stops."""
        return ""

    def shutdown(self) -> None:
        """Ask `run()` to stop; safe to call twice or before `run()`."""
        self._stop.set()

    async def run(self) -> None:
        """Consume until `shutdown()` or a loop dies; return only after a complete stop."""
        loops = [asyncio.create_task(loop) for loop in await self._start()]
        stop = asyncio.create_task(self._stop.wait())
        try:
            await asyncio.wait([*loops, stop], return_when=asyncio.FIRST_COMPLETED)
        finally:
            log.info("%s: stopping: no new work", self.name)
            self._stop.set()  # a consumer that ends now is not started again
            # Stop the loops first: an iterator closed while a loop waits on it would end it,
            # and the loop would consume again. Then cancel the consumers; messages they
            # hold but never started go back to the queue. Neither is waited for without
            # bound: a cancelled aio-pika call may wait on an RPC the broker never answers.
            # A loop cancelled while it waits for a message forgets its iterator: taken first.
            iterators = set(self._iterators)
            await end_tasks(loops, f"{self.name}: a consumer loop")
            for iterator in iterators | self._iterators:
                with contextlib.suppress(Exception):
                    await within(iterator.close(), CONSUMER_RPC_TIMEOUT_S)
            pending = list(self._in_flight)
            if pending:
                _, late = await asyncio.wait(pending, timeout=self.grace_s)
                if late:
                    log.warning(
                        "%s: %d still busy after %.1fs; cancelling",
                        self.name,
                        len(late),
                        self.grace_s,
                    )
                    await end_tasks(list(late), f"{self.name}: a task")
            stop.cancel()
            log.info("%s: stopped; %s", self.name, self.summary() or "nothing handled")
        for loop in loops:
            if loop.done() and not loop.cancelled() and loop.exception() is not None:
                raise loop.exception()  # type: ignore[misc]
