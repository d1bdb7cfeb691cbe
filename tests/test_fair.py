"""A worker's slots go to its queues in turn (worker/fair.py): pure, no broker."""

import asyncio

import pytest

from worker.fair import FairSlots


async def test_a_freed_slot_goes_to_the_queue_that_waited_longest() -> None:
    slots = FairSlots(2)
    await slots.acquire("slow")
    await slots.acquire("slow")
    served: list[str] = []

    async def take(consumer: str) -> None:
        await slots.acquire(consumer)
        served.append(consumer)

    # The slow queue asks again first, then the fast one: each free slot alternates.
    waiters = [asyncio.create_task(take(name)) for name in ("slow", "fast")]
    await asyncio.sleep(0)
    assert served == [] and slots.busy == 2
    slots.release()
    await asyncio.sleep(0)
    assert served == ["slow"]
    later = asyncio.create_task(take("slow"))  # served slow goes to the back, behind fast
    await asyncio.sleep(0)
    slots.release()
    await asyncio.sleep(0)
    assert served == ["slow", "fast"]
    slots.release()
    await asyncio.gather(*waiters, later)
    assert served == ["slow", "fast", "slow"] and slots.busy == 2


async def test_a_freed_slot_goes_to_the_highest_priority_first() -> None:
    slots = FairSlots(1)
    await slots.acquire("a")
    served: list[str] = []

    async def take(consumer: str, priority: int) -> None:
        await slots.acquire(consumer, priority)
        served.append(consumer)
        slots.release()

    waiters = [
        asyncio.create_task(take(name, priority))
        for name, priority in [("low", 0), ("high", 9), ("mid", 4), ("high too", 9)]
    ]
    await asyncio.sleep(0)
    slots.release()
    await asyncio.gather(*waiters)
    assert served == ["high", "high too", "mid", "low"]  # among equals, who waited first
    assert slots.busy == 0


async def test_a_cancelled_waiter_gives_up_its_place_and_no_slot_leaks() -> None:
    slots = FairSlots(1)
    await slots.acquire("a")
    waiting = asyncio.create_task(slots.acquire("b"))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    slots.release()
    assert slots.busy == 0
    # Handed the slot and cancelled before it ran: the slot passes on, not lost.
    await slots.acquire("a")
    handed = asyncio.create_task(slots.acquire("b"))
    await asyncio.sleep(0)
    slots.release()  # b's now
    handed.cancel()
    with pytest.raises(asyncio.CancelledError):
        await handed
    assert slots.busy == 0
    await slots.acquire("c")
    assert slots.busy == 1


async def test_one_consumer_waits_for_one_slot_at_a_time() -> None:
    slots = FairSlots(1)
    await slots.acquire("a")
    first = asyncio.create_task(slots.acquire("b"))
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="b already waits"):
        await slots.acquire("b")
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
