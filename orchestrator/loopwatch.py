"""Where a blocked event loop is stuck, in the log while it is stuck.

A handler that never yields (an `async def` calling `time.sleep`, a CPU-bound loop) stops
every consumer, heartbeat and report of its process. /livez says *that* the loop stopped; this
says *where*: a thread watches a heartbeat the loop stamps, and once it is BLOCKED_S late logs
the loop thread's stack (its innermost frames, which name the handler and its line), once per
stall, and how long the stall lasted once the loop turns again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
import time
import traceback
from collections.abc import AsyncIterator

log = logging.getLogger(__name__)

BEAT_S = 0.25  # how often the loop stamps its heartbeat, and the thread reads it
BLOCKED_S = 1.0  # late by this much: the loop is blocked, and its stack is logged
FRAMES = 12  # innermost frames logged: the blocking call and its callers up to the handler


class LoopWatch:
    """A heartbeat stamped by the loop and a daemon thread that reads it."""

    def __init__(self, name: str, *, blocked_s: float = BLOCKED_S) -> None:
        self.name = name
        self.blocked_s = blocked_s
        self.stalls = 0  # stalls seen, for tests and curiosity
        self._beat = time.monotonic()
        self._loop_thread: int | None = None  # the thread of the loop that beats
        self._stop = threading.Event()

    async def beat(self) -> None:
        """Stamp the heartbeat until cancelled (run in the loop being watched)."""
        self._loop_thread = threading.get_ident()
        while True:
            self._beat = time.monotonic()
            await asyncio.sleep(BEAT_S)

    def watch(self) -> None:
        """The thread's body: check the heartbeat until stopped."""
        stalled_since: float | None = None
        while not self._stop.wait(min(BEAT_S, self.blocked_s / 4)):  # a test's blocked_s is short
            beat = self._beat
            late = time.monotonic() - beat
            if stalled_since is None and late > self.blocked_s:
                stalled_since = beat
                self.stalls += 1
                log.error(
                    "%s: the event loop is blocked (no turn for %.1fs): every consumer and "
                    "heartbeat of this process waits; it is at:\n%s",
                    self.name,
                    late,
                    self._stack(),
                )
            elif stalled_since is not None and beat > stalled_since:
                log.warning(
                    "%s: the event loop turns again, after %.1fs blocked",
                    self.name,
                    beat - stalled_since,
                )
                stalled_since = None

    def stop(self) -> None:
        self._stop.set()

    def _stack(self) -> str:
        frame = None if self._loop_thread is None else sys._current_frames().get(self._loop_thread)
        if frame is None:
            return "  (its thread is gone)"
        return "".join(traceback.format_stack(frame)[-FRAMES:]).rstrip()


@contextlib.asynccontextmanager
async def watched(name: str, *, blocked_s: float = BLOCKED_S) -> AsyncIterator[LoopWatch]:
    """Watch the running loop while the block runs."""
    watch = LoopWatch(name, blocked_s=blocked_s)
    beating = asyncio.create_task(watch.beat())
    thread = threading.Thread(target=watch.watch, name="shardflow-loopwatch", daemon=True)
    thread.start()
    try:
        yield watch
    finally:
        watch.stop()
        beating.cancel()
        await asyncio.gather(beating, return_exceptions=True)
