"""A worker's slots, handed to its queues in turn: the fair share's worker half."""

from __future__ import annotations

import asyncio
from collections import OrderedDict


class FairSlots:
    """`capacity` slots for consumers that each wait for one slot at a time. A freed slot goes
    to the waiter with the highest priority (the message it holds), among equals to the one
    that waited longest since it was last served (round robin), not to whoever asks first, so
    one busy queue cannot take every slot that frees."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.busy = 0
        # Consumer -> its waiter and priority, in the order they are due: a served one goes to
        # the back. At most one per consumer (a worker has a few queues), so scans are short.
        self._waiting: OrderedDict[str, tuple[asyncio.Future[None], int]] = OrderedDict()

    async def acquire(self, consumer: str, priority: int = 0) -> None:
        """Wait for a slot; one waiter per consumer (each consumer asks for one at a time)."""
        if self.busy < self.capacity and not self._waiting:
            self.busy += 1
            return
        if consumer in self._waiting:
            raise RuntimeError(f"{consumer} already waits for a slot")
        waiter = asyncio.get_running_loop().create_future()
        self._waiting[consumer] = (waiter, priority)
        try:
            await waiter  # release() counted the slot as ours before waking us
        except asyncio.CancelledError:
            if self._waiting.get(consumer, (None, 0))[0] is waiter:
                del self._waiting[consumer]
            elif waiter.done() and not waiter.cancelled():
                self.release()  # handed to us as we were cancelled: pass it on
            raise

    def release(self) -> None:
        """Free a slot: the first waiter of the highest priority gets it, else it is free."""
        while self._waiting:
            top = max(priority for _, priority in self._waiting.values())
            consumer = next(c for c, (_, p) in self._waiting.items() if p == top)
            waiter, _ = self._waiting.pop(consumer)
            if not waiter.done():
                waiter.set_result(None)  # the slot stays busy: it is the waiter's now
                return
        self.busy -= 1
