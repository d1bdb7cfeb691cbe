"""A worker's slots, handed to its queues in turn: the fair share's worker half."""

from __future__ import annotations

import asyncio
from collections import OrderedDict


class FairSlots:
    """`capacity` slots for consumers that each wait for one slot at a time. A freed slot goes
    to the consumer that waited longest since it was last served (round robin), not to whoever
    asks first, so one busy queue cannot take every slot that frees."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.busy = 0
        # Consumer -> its waiter, in the order they are due: a served one goes to the back.
        self._waiting: OrderedDict[str, asyncio.Future[None]] = OrderedDict()

    async def acquire(self, consumer: str) -> None:
        """Wait for a slot; one waiter per consumer (each consumer asks for one at a time)."""
        if self.busy < self.capacity and not self._waiting:
            self.busy += 1
            return
        if consumer in self._waiting:
            raise RuntimeError(f"{consumer} already waits for a slot")
        waiter = asyncio.get_running_loop().create_future()
        self._waiting[consumer] = waiter
        try:
            await waiter  # release() counted the slot as ours before waking us
        except asyncio.CancelledError:
            if self._waiting.get(consumer) is waiter:
                del self._waiting[consumer]
            elif waiter.done() and not waiter.cancelled():
                self.release()  # handed to us as we were cancelled: pass it on
            raise

    def release(self) -> None:
        """Free a slot: the longest-waiting consumer gets it, else it is free."""
        while self._waiting:
            _, waiter = self._waiting.popitem(last=False)
            if not waiter.done():
                waiter.set_result(None)  # the slot stays busy: it is the waiter's now
                return
        self.busy -= 1
