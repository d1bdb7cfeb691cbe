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
import os
import sys
import threading
import time
import traceback
from collections.abc import AsyncIterator
from types import FrameType

from orchestrator import metrics

log = logging.getLogger(__name__)

BEAT_S = 0.25  # how often the loop stamps its heartbeat, and the thread reads it
BLOCKED_S = 1.0  # no turn for this long: the loop is blocked, and its stack is logged
FRAMES = 12  # innermost frames logged: the blocking call and its callers up to the handler
JOIN_S = 1.0  # how long the watch's end waits for its thread


class LoopWatch:
    """A heartbeat stamped by the loop and a daemon thread that reads it. Made in the loop's
    own thread (its stack is the one logged)."""

    def __init__(self, name: str, *, blocked_s: float = BLOCKED_S) -> None:
        self.name = name
        self.blocked_s = blocked_s
        self.beat_s = min(BEAT_S, blocked_s / 4)  # a test's short threshold, read as finely
        self.stalls = 0  # blocked turns seen (tests read it)
        self.starved = 0  # turns late though the loop was idle: the CPU was elsewhere
        self._beat = time.monotonic()
        self._loop_thread = threading.get_ident()
        self._stop = threading.Event()

    async def beat(self) -> None:
        """Stamp the heartbeat until cancelled (run in the loop being watched)."""
        self._loop_thread = threading.get_ident()
        while True:
            self._beat = time.monotonic()
            await asyncio.sleep(self.beat_s)

    def watch(self) -> None:
        """The thread's body: check the heartbeat until stopped."""
        stalled_since: float | None = None
        while not self._stop.wait(self.beat_s):
            beat = self._beat
            # The least the loop went without a turn: it may have stamped just before it
            # stopped turning, or just before its next stamp was due.
            late = time.monotonic() - beat - self.beat_s
            if stalled_since is None and late > self.blocked_s:
                stalled_since = beat
                self._stalled(late)
            elif stalled_since is not None and beat > stalled_since and not self._stop.is_set():
                log.warning(
                    "%s: the event loop turns again, after at least %.1fs without a turn",
                    self.name,
                    beat - stalled_since - self.beat_s,
                )
                stalled_since = None

    def _stalled(self, late: float) -> None:
        frame = sys._current_frames().get(self._loop_thread)
        if self._stop.is_set():
            return
        if frame is not None and _idle(frame):
            # Late though waiting for I/O: it was not let run (plain-function handlers'
            # threads holding the GIL, or a machine short of CPU); no handler to name.
            self.starved += 1
            metrics.LOOP_STALLS.labels("starved").inc()
            log.warning(
                "%s: the event loop had no turn for %.1fs though it was idle: this process's "
                "other threads, or other processes, held the CPU (or, under uvloop, a blocking "
                "call made straight from its C code, with no Python frame to name)",
                self.name,
                late,
            )
            return
        self.stalls += 1
        metrics.LOOP_STALLS.labels("blocked").inc()
        stack = (
            "".join(traceback.format_stack(frame)[-FRAMES:]).rstrip()
            if frame is not None
            else "  (its thread is gone)"
        )
        log.error(
            "%s: the event loop is blocked (no turn for %.1fs): every consumer and heartbeat "
            "of this process waits; it is at:\n%s",
            self.name,
            late,
            stack,
        )

    def stop(self) -> None:
        self._stop.set()


def _idle(frame: FrameType) -> bool:
    """Whether the loop's innermost frame is its own wait for I/O: asyncio's selector called
    by the loop (a handler's blocking `subprocess.run` waits in a selector too, called by
    the handler), or the call into uvloop's loop (whose wait is C, below any Python frame)."""
    name, path = frame.f_code.co_name, frame.f_code.co_filename
    if name == "select" and path.endswith("selectors.py"):
        caller = frame.f_back
        return caller is not None and caller.f_code.co_name == "_run_once"
    return name == "run" and path.endswith(os.path.join("asyncio", "runners.py"))


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
        await asyncio.to_thread(thread.join, JOIN_S)
