"""The threads a worker runs plain-function handlers in.

asyncio's default executor has min(32, CPUs + 4) threads: 6 on a 2-core node, however many
tasks the worker runs at once (16 by default), so plain functions ran 6 at a time. And a
thread cannot be stopped: a handler that timed out (or whose program was cancelled) runs on
in its thread, which the pool does not get back until it returns. A worker's own pool has a
thread for each task it may run and as many again for such handlers, and says when one is
left behind, with how many are, so a worker slowly filling with stuck handlers is seen.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
import weakref
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

log = logging.getLogger(__name__)


class _Call:
    """One handler's call: whether its thread started it, ended it, was given up on."""

    __slots__ = ("ended", "started")

    def __init__(self) -> None:
        self.started = self.ended = False


_pools: weakref.WeakSet[HandlerThreads] = weakref.WeakSet()


def left_running() -> int:
    """Plain-function handlers of this process still running after their task ended: at its
    exit, Python waits for their threads (for good, for a stuck one)."""
    return sum(pool.left_behind for pool in list(_pools))


class HandlerThreads:
    """A thread pool of `2 * concurrency` threads for plain-function handlers."""

    def __init__(self, concurrency: int, name: str) -> None:
        self.size = 2 * concurrency
        self._executor = ThreadPoolExecutor(self.size, thread_name_prefix=name)
        self._lock = threading.Lock()
        # The calls of handlers running on in a thread whose task ended, until each returns.
        self._running_on: set[Future[Any]] = set()
        _pools.add(self)

    @property
    def left_behind(self) -> int:
        """Handlers running on in a thread whose task ended."""
        with self._lock:
            return len(self._running_on)

    async def run(self, handler: Callable[[Any], Any], ctx: Any) -> Any:
        """`handler(ctx)` in one of the threads, with the caller's context variables (as
        asyncio.to_thread); cancelling the wait leaves the thread to run on, counted."""
        call = _Call()
        context = contextvars.copy_context()
        running = self._executor.submit(self._call, call, context, handler, ctx)
        running.add_done_callback(self._forget)
        try:
            return await asyncio.wrap_future(running)
        except asyncio.CancelledError:
            with self._lock:
                given_up = call.started and not call.ended
                if given_up:
                    self._running_on.add(running)
                left = len(self._running_on)
            if given_up:
                log.warning(
                    "a plain-function handler runs on in its thread after its task ended; "
                    "%d such now, of %d threads (a stuck one holds its thread for good)",
                    left,
                    self.size,
                )
            raise

    def _call(
        self, call: _Call, context: contextvars.Context, handler: Callable[[Any], Any], ctx: Any
    ) -> Any:
        with self._lock:
            call.started = True
        try:
            return context.run(handler, ctx)
        except (StopIteration, asyncio.CancelledError, futures.CancelledError) as exc:
            # asyncio cannot set a StopIteration on a future (the await never ended), and a
            # CancelledError would read as the task's own cancel: each fails the task instead,
            # its traceback chained (the handler's frames are logged).
            said = str(exc)
            raise RuntimeError(
                f"the handler raised {type(exc).__name__}{': ' + said if said else ''}"
            ) from exc
        finally:
            with self._lock:
                call.ended = True

    def _forget(self, running: Future[Any]) -> None:
        with self._lock:  # in the thread that ran it, as it returns; one never given up is
            self._running_on.discard(running)  # not there

    async def settled(self) -> None:
        """Return once every handler left running in a thread has returned (a serial lane
        waits for it: its next task must not run beside it)."""
        while True:
            with self._lock:
                pending = list(self._running_on)
            if not pending:
                return
            waits = [asyncio.wrap_future(future) for future in pending]
            try:
                await asyncio.wait(waits)
            finally:
                for wait in waits:  # their outcomes were the tasks' (reported then): dropped
                    if wait.done() and not wait.cancelled():
                        wait.exception()
                    else:
                        wait.cancel()

    def shutdown(self) -> None:
        """Take no more calls; threads still inside a handler end when it returns."""
        self._executor.shutdown(wait=False, cancel_futures=True)
