"""Bundles: the single tasks of several programs that an owner publishes in one loop turn to
one queue, sent as one message while the pool has a backlog (orchestrator/bundling.py), and a
worker settling each of a bundle's tasks as if it had come alone."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from orchestrator import logs, metrics
from orchestrator.bundling import Bundles
from orchestrator.connections import connected
from orchestrator.delivery import FAILURES, redelivered
from orchestrator.keys import Keys
from orchestrator.messages import (
    CARRYING,
    MAX_BUNDLE,
    MAX_BUNDLE_BYTES,
    MAX_BUNDLED_BYTES,
    TaskMessage,
    bundle,
    decode_shard_message,
    decode_task,
    decode_tasks,
    encode,
)
from orchestrator.plans import Plans
from orchestrator.settings import Settings
from orchestrator.transitions import Transitions
from router.client import Router
from shardflow.dev import Dev
from tests.test_carry import Bus as Recorder
from tests.test_carry import Counting, Delivery, _started, _worker
from worker.pool import Worker
from worker.registry import Registry


def _task(wf: str, **fields: Any) -> bytes:
    return encode(TaskMessage(wf=wf, path="0", task="work", owner=0, **fields))


async def _take(settings: Settings, queue: str) -> list[bytes]:
    """Every message in `queue`, in order (a real broker's basic.get)."""
    async with connected(settings, "bundling-reader") as (_, bus):
        channel = await bus._consumer_channel()
        try:
            found = await channel.get_queue(queue, ensure=False)
            bodies = []
            while (message := await found.get(no_ack=True, fail=False)) is not None:
                bodies.append(message.body)
            return bodies
        finally:
            await channel.close()


async def test_one_turns_tasks_for_a_queue_go_in_bundles_of_at_most_most(
    settings: Settings,
) -> None:
    async with connected(settings, "bundling-test") as (_, bus):
        small = [_task(f"w{i}") for i in range(7)]
        urgent = [_task(f"u{i}") for i in range(2)]
        large = _task("big", args={"x": "y" * MAX_BUNDLED_BYTES})
        await asyncio.gather(
            *(bus.publish_all("parallel", [body], 1, CARRYING, most=3) for body in small),
            *(bus.publish_all("parallel", [body], 5, CARRYING, most=3) for body in urgent),
            bus.publish_all("parallel", [large], 1, CARRYING, most=3),
        )
        # Without a backlog (most 1): one message each, as before bundles.
        await asyncio.gather(*(bus.publish_all("parallel", [b], 1, most=1) for b in small[:2]))
    got = await _take(settings, f"{settings.prefix}.tasks.parallel")
    shapes = []
    for body in got:
        tasks = decode_tasks(body)
        shapes.append(
            [t.wf for t in tasks] if tasks is not None else decode_task(body).wf[:3] + " alone"
        )
    # The priority-5 bundle is delivered first: its level is higher.
    assert shapes[0] == ["u0", "u1"]
    assert sorted(map(str, shapes[1:])) == sorted(
        map(
            str,
            [
                ["w0", "w1", "w2"],
                ["w3", "w4", "w5"],
                "w6 alone",
                "big alone",
                "w0 alone",
                "w1 alone",
            ],
        )
    )


async def test_a_failed_bundle_fails_each_of_its_publishers_and_a_cancelled_one_leaves_it() -> None:
    sent: list[bytes] = []
    refuse = True

    async def send(key: Any, body: bytes) -> None:
        await asyncio.sleep(0.01)
        if refuse:
            raise ConnectionError("the broker went away")
        sent.append(body)

    bundles = Bundles(send)
    results = await asyncio.gather(
        *(bundles.publish("q", _task(f"w{i}"), 10) for i in range(3)), return_exceptions=True
    )
    assert [type(r) for r in results] == [ConnectionError] * 3 and sent == []
    refuse = False
    publishers = [asyncio.create_task(bundles.publish("q", _task(f"w{i}"), 10)) for i in range(3)]
    await asyncio.sleep(0)  # all three joined the bundle; one of them is cancelled now
    publishers[1].cancel()
    results = await asyncio.gather(*publishers, return_exceptions=True)
    assert results[0] is None and results[2] is None
    assert isinstance(results[1], asyncio.CancelledError)
    assert [[t.wf for t in decode_tasks(body) or []] for body in sent] == [["w0", "w1", "w2"]]
    assert bundles.bundles == 1 and bundles.bundled == 3


class Parked(Recorder):
    """The publishes, with what the worker parks and sends again."""

    def __init__(self) -> None:
        super().__init__()
        self.dead: list[tuple[bytes, str]] = []
        self.again: list[tuple[bytes, dict[str, Any]]] = []
        self.again_to: list[tuple[str, Any]] = []  # each one's queue and priority

    async def dead_letter(self, body: bytes, *, reason: str, source: str, **_: Any) -> None:
        self.dead.append((body, reason))

    async def requeue(self, queue: str, body: bytes, headers: Any, priority: Any, **_: Any) -> None:
        self.again.append((body, headers))
        self.again_to.append((queue, priority))


class Flaky(Counting):
    """The model of the scripts, away for one program's reads."""

    away = ""

    async def at(self, wf: str, path: str) -> dict[str, str]:
        if wf == self.away:
            raise ConnectionError("Redis went away")
        return await super().at(wf, path)


async def _three_at_their_first_task(prefix: str, store: Counting, bus: Parked) -> list[bytes]:
    """Three programs submitted and started: their first tasks' messages."""
    transitions = Transitions(store, bus, Plans(store, 8))
    router = Router(Settings(prefix=prefix), store=store, bus=bus)
    for _ in range(3):
        owner = (await router.submit({"steps": [{"task": "work"}, {"task": "work"}]})).shard
        start = decode_shard_message(bus.shard.pop())
        assert await transitions.apply(start, redelivered=False, shard=owner) == "applied"
    return list(bus.tasks)


async def test_a_worker_settles_each_task_of_a_bundle_as_if_it_came_alone() -> None:
    store = Flaky(Keys("bundle-worker"))
    bus = Parked()
    await _three_at_their_first_task("bundle-worker", store, bus)
    tasks = [decode_task(body) for body in bus.tasks]
    assert len(tasks) == 3
    ghost = TaskMessage(wf="ghost", path="0", task="work", owner=0)
    store.away = tasks[2].wf
    delivery = Delivery(bundle([*bus.tasks, encode(ghost)]), CARRYING)
    await _worker(store, bus).handle(delivery, "q")
    assert delivery.acked  # once, for the whole bundle
    reports = [json.loads(body) for body in bus.shard]
    assert sorted(r["wf"] for r in reports) == sorted(t.wf for t in tasks[:2])
    assert all(r["kind"] == "next" and r["output"] == "done" for r in reports)
    # The program nobody submitted: its task alone is parked, with why.
    assert bus.dead == [(encode(ghost), "ghost: no such program")]
    # Redis away for one program: its task alone goes back to the queue, uncounted.
    assert bus.again == [
        (encode(tasks[2]), {**CARRYING, FAILURES: 0, "x-shardflow-message-id": ""})
    ]


async def test_a_bundle_on_a_lane_is_parked_whole() -> None:
    store, bus, _, _ = await _started("bundle-lane")
    parked = Parked()
    worker = _worker(store, parked)
    worker.pool = "serial"
    body = bundle([bus.tasks[0], bus.tasks[0]])
    delivery = Delivery(body, CARRYING)
    await worker.handle(delivery, "q")
    assert parked.dead == [(body, "a bundle of tasks on a lane, which runs one task at a time")]
    assert parked.shard == [] and delivery.acked


@pytest.mark.e2e
async def test_chains_under_load_go_in_bundles_and_each_ends_with_its_own_result(
    settings: Settings, registry: Registry
) -> None:
    def chain(k: int) -> dict[str, Any]:
        return {
            "steps": [
                {"task": "add", "pool": "parallel", "args": {"n": n, "sleep_s": 0.02}}
                for n in (k, 10, 100, 1000, 10000, 100000)
            ]
        }

    before = metrics.BUNDLED_TASKS._value.get()
    reports = metrics.BUNDLED_REPORTS._value.get()
    async with connected(settings, "bundling-e2e") as (store, bus):
        dev = Dev(settings, registry, store=store, bus=bus, concurrency=8)
        running = asyncio.create_task(dev.run())
        try:
            router = Router(settings, store=store, bus=bus, known_tasks=None)
            submitted = []
            for start in range(0, 120, 10):  # a few at a time: the client's Redis pool is small
                batch = (router.submit(chain(k)) for k in range(start, start + 10))
                submitted += await asyncio.gather(*batch)
            results = [await router.wait(s.workflow_id, timeout_s=120) for s in submitted]
        finally:
            dev.shutdown()
            await running
    for k, status in enumerate(results):
        assert status["status"] == "completed", status
        assert status["result"] == k + 111110, (k, status)
    # The backlog made the owner send single tasks together (the counter is the process's).
    bundled = metrics.BUNDLED_TASKS._value.get() - before
    assert bundled >= 20, bundled
    # And the worker sent reports of a bundle's tasks together (each applied on its own).
    assert metrics.BUNDLED_REPORTS._value.get() - reports >= 2


@pytest.mark.parametrize(
    ("step", "backlog", "most"),
    [
        ({"task": "work", "pool": "parallel"}, 7, 7),  # a chain's step while the pool is busy
        ({"task": "work", "pool": "parallel"}, 1, 1),  # idle: one task a message, to spread
        ({"task": "work", "pool": "serial"}, 7, 1),  # a lane runs one task at a time
        ({"task": "work", "pool": "parallel", "limit": {"key": "'k'", "max": 2}}, 7, 1),
        ({"bag": [{"task": "work"}, {"task": "work"}], "pool": "parallel"}, 7, 1),  # chunked
    ],
)
async def test_the_owner_bundles_only_single_tasks_without_a_limit_while_the_pool_is_busy(
    step: dict[str, Any], backlog: int, most: int
) -> None:
    store = Counting(Keys("bundle-owner"))
    bus = Parked()
    transitions = Transitions(store, bus, Plans(store, 8))
    transitions.bundle_for = lambda pool: backlog
    router = Router(Settings(prefix="bundle-owner"), store=store, bus=bus)
    owner = (await router.submit({"steps": [step]})).shard
    start = decode_shard_message(bus.shard.pop())
    assert await transitions.apply(start, redelivered=False, shard=owner) == "applied"
    assert bus.most == [most]


@pytest.mark.parametrize(
    ("flagged", "headers", "sent_with"),
    [
        (True, CARRYING, {FAILURES: 0, **CARRYING}),  # the broker's: a try was cut short
        (False, {**CARRYING, FAILURES: 2}, {**CARRYING, FAILURES: 2}),  # sent again whole
    ],
)
async def test_a_bundle_that_came_back_sends_each_task_on_alone_counted_as_redelivered(
    flagged: bool, headers: dict[str, Any], sent_with: dict[str, Any]
) -> None:
    """A try was cut short (one handler may have killed the worker), or failed: no task runs in
    it, each goes back alone, so a crashing task takes no other program's task with it again."""
    store, bus = Counting(Keys("bundle-again")), Parked()
    bodies = await _three_at_their_first_task("bundle-again", store, bus)
    delivery = Delivery(bundle(bodies), headers, redelivered=flagged)
    delivery.priority = 3
    await _worker(store, bus).handle(delivery, "tasks.q")
    assert delivery.acked and bus.shard == [] and bus.dead == []
    expected = [encode(decode_task(body)) for body in bodies]
    assert bus.again == [(body, sent_with) for body in expected]
    assert bus.again_to == [("tasks.q", 3)] * 3  # its own queue, at its own level
    # Each alone, and counted as redelivered: a task whose report was cut short reports.
    assert all(redelivered(Delivery(body, headers)) for body, headers in bus.again)


@pytest.mark.parametrize("concurrency", [1, 2, 16])
async def test_a_bundle_runs_at_most_the_workers_concurrency_of_its_tasks_at_once(
    concurrency: int,
) -> None:
    store, bus = Counting(Keys(f"bundle-slots-{concurrency}")), Parked()
    bodies = await _three_at_their_first_task(f"bundle-slots-{concurrency}", store, bus)
    running, most = 0, 0
    registry = Registry()

    async def work(ctx: Any) -> Any:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await asyncio.sleep(0.02)
        running -= 1
        return "done"

    registry.add("work", work)
    worker = Worker(
        Settings(), registry, pool="parallel", store=store, bus=bus, concurrency=concurrency
    )
    await worker.handle(Delivery(bundle(bodies), CARRYING), "q")
    assert most == min(3, concurrency) and len(bus.shard) == 3


class Away(Parked):
    """The broker away as the worker parks a task."""

    async def dead_letter(self, body: bytes, *, reason: str, source: str, **_: Any) -> None:
        raise ConnectionError("the broker went away")


async def test_a_bundle_comes_back_whole_when_one_of_its_tasks_could_not_be_settled() -> None:
    store, bus = Counting(Keys("bundle-away")), Away()
    bodies = await _three_at_their_first_task("bundle-away", store, bus)
    ghost = encode(TaskMessage(wf="ghost", path="0", task="work", owner=0))
    body = bundle([*bodies, ghost])
    delivery = Delivery(body, CARRYING)
    await _worker(store, bus).handle(delivery, "q")
    # The others ran and reported; the whole bundle goes back (their copies will be stale).
    assert len(bus.shard) == 3 and delivery.acked
    assert bus.again == [(body, {**CARRYING, FAILURES: 0, "x-shardflow-message-id": ""})]


async def test_a_bundle_over_its_size_is_parked_whole_with_why() -> None:
    store, _, _, _ = await _started("bundle-large")
    parked = Parked()
    big = _task("w0", args={"x": "y" * MAX_BUNDLE_BYTES})
    body = bundle([big, big])
    delivery = Delivery(body, CARRYING)
    await _worker(store, parked).handle(delivery, "q")
    most = MAX_BUNDLE_BYTES + MAX_BUNDLE + 1  # with its commas and brackets
    assert parked.dead == [(body, f"a bundle of {len(body)} bytes, over the {most} one may hold")]
    assert delivery.acked and parked.shard == []


def test_the_largest_bundle_an_owner_sends_decodes() -> None:
    """A hundred tasks of MAX_BUNDLE_BYTES in all, with their commas and brackets: a worker
    takes every bundle an owner may send."""
    sent: list[bytes] = []

    async def send(key: Any, body: bytes) -> None:
        sent.append(body)

    async def publish_all() -> None:
        bundles = Bundles(send)
        bare = len(_task("w00", args={"x": ""}))
        each, extra = divmod(MAX_BUNDLE_BYTES, MAX_BUNDLE)
        bodies = [
            _task(f"w{i:02}", args={"x": "y" * (each - bare + (i < extra))})
            for i in range(MAX_BUNDLE)
        ]
        assert sum(map(len, bodies)) == MAX_BUNDLE_BYTES
        await asyncio.gather(*(bundles.publish("q", body, MAX_BUNDLE) for body in bodies))

    asyncio.run(publish_all())
    [body] = sent
    assert len(body) == MAX_BUNDLE_BYTES + MAX_BUNDLE + 1
    assert [t.wf for t in decode_tasks(body) or []] == [f"w{i:02}" for i in range(MAX_BUNDLE)]


class Noted(Parked):
    """Notes the log fields bound as the worker parks a task."""

    def __init__(self) -> None:
        super().__init__()
        self.fields: list[dict[str, Any]] = []

    async def dead_letter(self, body: bytes, *, reason: str, source: str, **_: Any) -> None:
        self.fields.append(dict(logs._bound.get() or {}))
        await super().dead_letter(body, reason=reason, source=source)


async def test_the_lines_about_a_bundles_task_name_it_not_the_one_before() -> None:
    """The ghost's dead letter was logged with the workflow id, step and task of the task
    run before it in the bundle: a grep for that program found a letter that was not its."""
    store, bus = Counting(Keys("bundle-logs")), Noted()
    bodies = await _three_at_their_first_task("bundle-logs", store, bus)
    ghost = TaskMessage(wf="ghost", path="7", task="other", owner=0)
    worker = Worker(Settings(), Registry({"work": lambda _: "done"}), pool="parallel",
                    store=store, bus=bus, concurrency=1)  # fmt: skip
    await worker.handle(Delivery(bundle([bodies[0], encode(ghost)]), CARRYING), "q")
    assert bus.dead == [(encode(ghost), "ghost: no such program")]
    assert bus.fields == [{"workflow_id": "ghost", "step": "7", "task": "other"}]
