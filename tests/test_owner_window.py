"""A shard owner that holds several messages at once (SHARDFLOW_PREFETCH > 1), on a real
cluster: different programs' transitions overlap, one program's never do and its leaves run in
order, and a stop begins none of the messages it still holds but hands them back
(orchestrator/owner.py)."""

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from orchestrator.connections import connected
from orchestrator.messages import Start, encode
from orchestrator.owner import Orchestrator
from orchestrator.settings import Settings
from router.client import Router
from shardflow.dev import Dev
from tests.app import Trace
from tests.ordering import assert_leaves_in_order
from tests.polling import until
from worker.registry import Registry

pytestmark = pytest.mark.e2e

PROGRAM = {
    "name": "window",
    "steps": [
        {"task": "add", "args": {"n": 1}},
        {"bag": [{"task": "add", "args": {"n": i}} for i in range(4)]},
        {"task": "echo", "pool": "parallel"},
        {"task": "echo", "args": {"last": True}, "pool": "parallel"},
    ],
}
PATHS = ["0", "1", "2", "3"]
RESULT = {"args": {"last": True}, "prev": {"args": {}, "prev": [1, 2, 3, 4]}}


class _Watch:
    """Wraps an owner's `Transitions.apply` (the real one runs): which programs are in a
    transition now, the most at once, any program in two at once, and applies begun after
    `stopped` was set."""

    def __init__(self, apply: Callable[..., Awaitable[str]]) -> None:
        self.apply, self.busy, self.most = apply, set[str](), 0
        self.overlapped: list[str] = []
        self.begun = 0
        self.after_stop = 0
        self.stopped = False
        self.gate = asyncio.Event()
        self.gate.set()

    async def __call__(self, message: Any, **kwargs: Any) -> str:
        if self.stopped:
            self.after_stop += 1
        self.begun += 1
        if message.wf in self.busy:
            self.overlapped.append(message.wf)
        self.busy.add(message.wf)
        self.most = max(self.most, len(self.busy))
        try:
            await self.gate.wait()
            await asyncio.sleep(0.002)  # a Redis round trip or two, so transitions can meet
            return await self.apply(message, **kwargs)
        finally:
            self.busy.discard(message.wf)


def _windowed(settings: Settings, prefetch: int) -> Settings:
    return settings.model_copy(update={"prefetch": prefetch, "shards": 1})


async def test_programs_overlap_and_each_keeps_its_order(
    settings: Settings, registry: Registry, trace: Trace
) -> None:
    settings = _windowed(settings, 8)
    async with connected(settings, "window-test") as (store, bus):
        dev = Dev(settings, registry, store=store, bus=bus, concurrency=16)
        transitions = dev.orchestrator.transitions
        watch = _Watch(transitions.apply)
        transitions.apply = watch  # type: ignore[method-assign]
        router = Router(settings, store=store, bus=bus, known_tasks=None)
        ids = [(await router.submit(PROGRAM, trace.as_input())).workflow_id for _ in range(30)]
        for wf in ids:  # duplicates (as after a crash): a program's messages side by side
            for _ in range(2):
                await bus.publish_to_shard(0, encode(Start(wf=wf)))
        running = asyncio.create_task(dev.run())  # all in the queue before the owner starts
        try:
            for wf in ids:
                status = await router.wait(wf, timeout_s=60)
                assert status["status"] == "completed", status
                assert status["result"] == RESULT, status
        finally:
            dev.shutdown()
            await running
    assert watch.overlapped == [], "a program was in two transitions at once"
    assert watch.most > 1, "no two programs' transitions overlapped: the window did nothing"
    assert_leaves_in_order(trace.events(), PATHS)


async def test_a_stop_begins_none_of_the_messages_it_holds(
    settings: Settings, registry: Registry
) -> None:
    settings = _windowed(settings, 8)
    async with connected(settings, "window-test") as (store, bus):
        owner = Orchestrator(settings, [0], store=store, bus=bus)
        watch = _Watch(owner.transitions.apply)
        owner.transitions.apply = watch  # type: ignore[method-assign]
        watch.gate.clear()  # every transition waits until the stop was asked
        router = Router(settings, store=store, bus=bus, known_tasks=None)
        ids = [(await router.submit(PROGRAM, None)).workflow_id for _ in range(3)]
        for _ in range(2):  # two more of the first program: in hand, behind its start
            await bus.publish_to_shard(0, encode(Start(wf=ids[0])))
        running = asyncio.create_task(owner.run())
        # Every message delivered (none ready) and the three programs' starts begun.
        await until(lambda: _ready(bus), lambda found: found["ready"] == 0)
        await until(_ask(lambda: watch.begun), lambda found: found["value"] == 3)
        owner.shutdown()
        watch.stopped = True
        await asyncio.sleep(0.1)
        watch.gate.set()
        await running
        assert watch.after_stop == 0, "a message held at the stop was begun after it"
        assert watch.overlapped == []
        # Nothing lost, nothing kept: the two it never began are back in the queue at once
        # (after their program's message before them), for a standby to take, while this
        # process's connection is still open.
        await until(lambda: _ready(bus), lambda found: found["ready"] == 2)
        for wf in ids:
            assert (await store.state(wf))["status"] == "running", wf


async def _ready(bus: Any) -> dict[str, Any]:
    state = await bus.shard_queue_state(0)
    return {"ready": state[0] if state else -1}


def _ask(value: Callable[[], int]) -> Callable[[], Awaitable[dict[str, Any]]]:
    async def check() -> dict[str, Any]:
        return {"value": value()}

    return check
