"""Bundles of reports: the reports a worker sends in one loop turn to one shard for the tasks of
a bundle, sent as one message, and an owner applying each of them as if it had come alone, in
its place in its program's order (orchestrator/owner.py)."""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiormq
import pytest
from pamqp.commands import Basic
from pamqp.encode import short_string as encode_short_string

from orchestrator import metrics
from orchestrator.bus import NEW, Bus
from orchestrator.connections import connected
from orchestrator.delivery import FAILURES
from orchestrator.keys import Keys, Names
from orchestrator.messages import (
    CARRY,
    CARRYING,
    MAX_BUNDLE,
    MAX_BUNDLE_BODY,
    MessageError,
    Next,
    Start,
    TaskMessage,
    bundle,
    decode_reports,
    decode_shard_body,
    decode_shard_message,
    decode_task,
    decode_tasks,
    encode,
)
from orchestrator.owner import Orchestrator, send_on
from orchestrator.program import parse_program
from orchestrator.settings import Settings
from orchestrator.shares import share_of, share_pool
from orchestrator.store import Store
from router.client import Router
from tests.polling import until
from tests.test_amqp_decode import RawProperties
from tests.test_bundling import Flaky, Parked, _take, _three_at_their_first_task
from tests.test_carry import Delivery, _started, _worker
from tests.test_delivery import Held, Transport
from tests.test_hostile import dead_reasons
from tests.test_owner_window import _Watch

CHAIN = {"steps": [{"task": "work", "pool": "parallel"}, {"task": "work", "pool": "parallel"}]}
POOL = share_pool("parallel", share_of(parse_program(CHAIN)))  # where its tasks go


def _next(wf: str, output: Any = None, path: str = "0") -> Next:
    return Next(wf=wf, path=path, output=output)


def test_a_bundle_of_reports_decodes_and_names_its_fault() -> None:
    reports = [_next("a", 1), _next("b", {"x": [2]})]
    body = bundle([encode(report) for report in reports])
    assert decode_reports(body) == reports
    assert decode_shard_body(body) == reports
    assert decode_reports(encode(reports[0])) is None  # one report alone is no bundle
    assert decode_shard_body(encode(reports[0])) == reports[0]
    faults = {
        # Only what a worker reports of a task travels in a bundle of reports.
        bundle([encode(reports[0]), encode(Start(wf="a"))]): "report 1: Input tag 'start'",
        b"[]": "bundle: List should have at least 1 item",
        bundle([encode(reports[0])] * (MAX_BUNDLE + 1)): "bundle: List should have at most 100",
        b"[" + b" " * MAX_BUNDLE_BODY + b"]": "a bundle of",
        b'[{"kind": "next", "wf": "a", "path": "0", "output": NaN}]': "NaN is not JSON",
    }
    for body, fault in faults.items():
        with pytest.raises(MessageError) as raised:
            decode_shard_body(body)
        assert fault in str(raised.value), (fault, raised.value)


async def test_a_workers_reports_of_a_bundles_tasks_may_go_together_a_lone_tasks_alone() -> None:
    store = Flaky(Keys("report-bundle-worker"))
    bus = Parked()
    await _three_at_their_first_task("report-bundle-worker", store, bus)
    delivery = Delivery(bundle(list(bus.tasks)), CARRYING)
    bus.reports_most.clear()  # the starts' publishes
    await _worker(store, bus).handle(delivery, "q")
    assert delivery.acked
    assert len(bus.shard) == 3 and bus.reports_most == [MAX_BUNDLE] * 3
    # A start (a compensating program's, after a late task) goes alone: no owner reads one in
    # a bundle of reports.
    worker = _worker(store, bus)
    start = Start(wf=decode_task(bus.tasks[0]).wf)

    async def late(*_: Any, **__: Any) -> list[Any]:
        return [_next(start.wf), start]

    worker.run_tasks = late  # type: ignore[method-assign]
    bus.reports_most.clear()
    await worker.handle(Delivery(bundle(list(bus.tasks[:2])), CARRYING), "q")
    assert bus.reports_most == [MAX_BUNDLE, 1, MAX_BUNDLE, 1]
    store, lone, _, _ = await _started("report-bundle-lone")
    lone.reports_most.clear()
    await _worker(store, lone).handle(Delivery(lone.tasks[0], CARRYING), "q")
    assert len(lone.shard) == 1 and lone.reports_most == [1]


@pytest.mark.e2e
async def test_one_turns_reports_to_a_shard_go_as_one_message(settings: Settings) -> None:
    settings = settings.model_copy(update={"shards": 2})
    bundles, reports = metrics.REPORT_BUNDLES._value.get(), metrics.BUNDLED_REPORTS._value.get()
    async with connected(settings, "report-bundles") as (_, bus):
        sent = [encode(_next(f"wf-{n}", n)) for n in range(4)]
        await asyncio.gather(
            *(bus.publish_to_shard(0, body, most=MAX_BUNDLE) for body in sent[:3]),
            bus.publish_to_shard(1, sent[3], most=MAX_BUNDLE),  # another shard: its own
        )
        await bus.publish_to_shard(0, sent[0], most=MAX_BUNDLE)  # a later turn: alone
    assert await _take(settings, bus.names.shard_queue(0)) == [bundle(sent[:3]), sent[0]]
    assert await _take(settings, bus.names.shard_queue(1)) == [sent[3]]
    assert metrics.REPORT_BUNDLES._value.get() - bundles == 1
    assert metrics.BUNDLED_REPORTS._value.get() - reports == 3


def _one_shard(settings: Settings) -> Settings:
    return settings.model_copy(update={"shards": 1, "prefetch": 8})


@contextlib.asynccontextmanager
async def _owner(settings: Settings) -> AsyncIterator[tuple[Store, Bus, Orchestrator, Router]]:
    """An owner of the one shard, running (no worker: its tasks stay in their queue); stopped
    on the way out."""
    async with connected(settings, "report-bundles") as (store, bus):
        owner = Orchestrator(settings, [0], store=store, bus=bus)
        running = asyncio.create_task(owner.run())
        try:
            yield store, bus, owner, Router(settings, store=store, bus=bus, known_tasks=None)
        finally:
            owner.shutdown()
            await running


async def _tasks(settings: Settings, bus: Bus, count: int) -> list[TaskMessage]:
    """The next `count` task messages of the parallel pool, taken from its queues."""
    found: list[TaskMessage] = []

    async def take() -> dict[str, Any]:
        for body in await _take(settings, bus.names.task_queue(POOL)):
            found.extend(decode_tasks(body) or [decode_task(body)])
        return {"tasks": len(found)}

    await until(take, lambda seen: seen["tasks"] >= count)
    return found


async def _at(store: Store, wf: str) -> dict[str, Any]:
    return {"cursor": (await store.state(wf)).get("cursor")}


@pytest.mark.e2e
async def test_an_owner_applies_each_report_of_a_bundle_alone_and_acks_it_once(
    settings: Settings,
) -> None:
    settings = _one_shard(settings)
    async with _owner(settings) as (store, bus, _, router):
        ids = [(await router.submit(CHAIN)).workflow_id for _ in range(3)]
        firsts = await _tasks(settings, bus, 3)
        assert sorted(task.wf for task in firsts) == sorted(ids)
        reports = [Next(wf=task.wf, path="0", output=task.wf) for task in firsts]
        ghost = _next("ghost-in-a-bundle")  # a program nobody submitted: parked alone
        await bus.publish_to_shard(0, bundle([encode(r) for r in [*reports, ghost]]))
        seconds = await _tasks(settings, bus, 3)
        assert sorted((task.wf, task.path) for task in seconds) == [(wf, "1") for wf in sorted(ids)]
        for wf in ids:
            await until(lambda wf=wf: _at(store, wf), lambda found: found["cursor"] == "1")
        assert await dead_reasons(settings, 1) == ["ghost-in-a-bundle: no such program"]
    # Acked once all were settled: nothing handed back at the stop, only the ghost's parked.
    async with connected(settings, "report-bundles") as (_, bus):
        assert await bus.shard_queue_state(0) == (0, 0)
        assert [body for _, body in await bus.peek_dead(100)] == [encode(ghost)]


@pytest.mark.e2e
async def test_a_bundle_of_reports_that_came_back_goes_on_report_by_report(
    settings: Settings,
) -> None:
    settings = _one_shard(settings)
    async with _owner(settings) as (store, bus, _, router):
        ids = [(await router.submit(CHAIN)).workflow_id for _ in range(2)]
        firsts = await _tasks(settings, bus, 2)
        reports = [encode(Next(wf=task.wf, path="0", output=1)) for task in firsts]
        requeued: list[tuple[bytes, dict[str, Any]]] = []
        requeue = bus.requeue

        async def spy(queue: str, body: bytes, headers: dict[str, Any], *args: Any) -> None:
            requeued.append((body, headers))
            await requeue(queue, body, headers, *args)

        bus.requeue = spy  # type: ignore[method-assign]
        # As a try cut short would have left it: counted as redelivered.
        await requeue(bus.names.shard_queue(0), bundle(reports), {FAILURES: 1}, None)
        await _tasks(settings, bus, 2)
        for wf in ids:
            await until(lambda wf=wf: _at(store, wf), lambda found: found["cursor"] == "1")
    # Each report went on alone, still counted as redelivered, so its transition publishes
    # again what it produces even if it already happened.
    assert sorted(body for body, _ in requeued) == sorted(reports)
    assert [headers[FAILURES] for _, headers in requeued] == [1, 1]
    assert all(isinstance(decode_shard_message(body), Next) for body, _ in requeued)


@pytest.mark.e2e
async def test_a_report_in_a_bundle_keeps_its_place_in_its_programs_order(
    settings: Settings,
) -> None:
    settings = _one_shard(settings)
    async with connected(settings, "report-bundles") as (store, bus):
        # In the queue before the owner starts, so it holds them all at once: each program's
        # start, a bundle of both's reports, then another start of the first.
        first, second = await _two_behind_their_starts(settings, store, bus)
        await bus.publish_to_shard(0, encode(Start(wf=first)), NEW)
        owner = Orchestrator(settings, [0], store=store, bus=bus)
        applied: list[tuple[str, str]] = []
        watch = _Watch(owner.transitions.apply)

        async def apply(message: Any, **kwargs: Any) -> str:
            applied.append((message.wf, message.kind))
            return await watch(message, **kwargs)

        owner.transitions.apply = apply  # type: ignore[method-assign]
        running = asyncio.create_task(owner.run())
        try:
            await until(_count(applied), lambda found: found["applied"] == 5)
        finally:
            owner.shutdown()
            await running
    assert [kind for wf, kind in applied if wf == first] == ["start", "next", "start"]
    assert [kind for wf, kind in applied if wf == second] == ["start", "next"]
    assert watch.overlapped == [], "a program was in two transitions at once"


async def _two_behind_their_starts(
    settings: Settings, store: Store, bus: Bus, outputs: tuple[Any, Any] = (None, None)
) -> tuple[str, str]:
    """Two programs submitted, each start in the queue, and behind both, at the starts' level
    (the queue gives a program's next step before any new one), a bundle of their reports."""
    router = Router(settings, store=store, bus=bus, known_tasks=None)
    first, second = [(await router.submit(CHAIN)).workflow_id for _ in range(2)]
    reports = [encode(_next(wf, out)) for wf, out in zip((first, second), outputs, strict=True)]
    await bus.publish_to_shard(0, bundle(reports), NEW)
    return first, second


def _count(applied: list[Any]) -> Any:
    return _count_of(lambda: len(applied), "applied")


def _count_of(value: Callable[[], int], name: str = "value") -> Any:
    async def check() -> dict[str, Any]:
        return {name: value()}

    return check


@pytest.mark.e2e
async def test_a_stop_sends_on_the_reports_of_a_bundle_it_never_began(
    settings: Settings,
) -> None:
    settings = _one_shard(settings)
    async with connected(settings, "report-bundles") as (store, bus):
        first, second = await _two_behind_their_starts(settings, store, bus)
        owner = Orchestrator(settings, [0], store=store, bus=bus)
        watch = _Watch(owner.transitions.apply)
        owner.transitions.apply = watch  # type: ignore[method-assign]
        watch.gate.clear()  # the starts wait until the stop, and each report behind its start
        running = asyncio.create_task(owner.run())
        await until(_count_of(lambda: watch.begun), lambda found: found["value"] == 2)
        owner.shutdown()
        watch.stopped = True
        await asyncio.sleep(0.1)
        watch.gate.set()
        await running
        assert watch.after_stop == 0, "a report held at the stop was begun after it"
        # Neither report was applied: both went on in one message, to be split by the next
        # owner, and the bundle was acked.
        assert await _take(settings, bus.names.shard_queue(0)) == [
            bundle([encode(_next(first)), encode(_next(second))])
        ]
        for wf in (first, second):
            assert (await _at(store, wf))["cursor"] == "0"


@pytest.mark.e2e
async def test_a_stop_sends_on_only_the_reports_of_a_bundle_it_never_began(
    settings: Settings,
) -> None:
    """Handing the bundle back whole would have it split when it came back, and each report
    already applied would publish its program's next task a second time."""
    settings = _one_shard(settings)
    async with connected(settings, "report-bundles") as (store, bus):
        first, second = await _two_behind_their_starts(settings, store, bus, (1, 2))
        owner = Orchestrator(settings, [0], store=store, bus=bus)
        real = owner.transitions.apply
        gate, applied = asyncio.Event(), []

        async def apply(message: Any, **kwargs: Any) -> str:
            if (message.wf, message.kind) == (second, "start"):
                await gate.wait()  # the second's start holds its report until the stop
            verdict = await real(message, **kwargs)
            applied.append((message.wf, message.kind))
            return verdict

        owner.transitions.apply = apply  # type: ignore[method-assign]
        requeued: list[bytes] = []
        counted: list[Any] = []
        requeue = bus.requeue

        async def spy(queue: str, body: bytes, headers: dict[str, Any], *args: Any) -> None:
            requeued.append(body)
            counted.append(headers.get(FAILURES))
            await requeue(queue, body, headers, *args)

        bus.requeue = spy  # type: ignore[method-assign]
        running = asyncio.create_task(owner.run())
        await until(_count(applied), lambda found: found["applied"] == 2)  # first's two
        owner.shutdown()
        await asyncio.sleep(0.1)
        gate.set()
        await running
        assert sorted(applied) == sorted([(first, "start"), (first, "next"), (second, "start")])
        # Only the report never begun went on (in a bundle of its own, to be split); the
        # bundle itself was acked.
        assert requeued == [bundle([encode(_next(second, 2))])]
        # Counted as redelivered: a report whose transition may have happened publishes again
        # what it produces.
        assert counted == [0]
        assert await bus.shard_queue_state(0) == (1, 0)
        # The first program's next task was published once, the second's not yet.
        seconds = [task for task in await _tasks(settings, bus, 3) if task.path == "1"]
        assert [task.wf for task in seconds] == [first]
        # Another owner takes the report on: the second program moves on as well.
        async with _owner(settings):
            await until(lambda: _at(store, second), lambda found: found["cursor"] == "1")


@pytest.mark.e2e
async def test_an_owner_works_on_at_most_its_prefetch_of_reports_at_once(
    settings: Settings,
) -> None:
    """A bundle takes one of the prefetch's slots: its reports still wait for a turn, so a
    bundle of 100 cannot start 100 transitions beside the others, nor try a broken Redis 100
    times a pause."""
    settings = _one_shard(settings).model_copy(update={"prefetch": 2})
    async with _owner(settings) as (store, bus, owner, router):
        watch = _Watch(owner.transitions.apply)
        owner.transitions.apply = watch  # type: ignore[method-assign]
        ids = [(await router.submit(CHAIN)).workflow_id for _ in range(6)]
        firsts = await _tasks(settings, bus, 6)
        watch.most = 0  # the starts' own window aside
        await bus.publish_to_shard(0, bundle([encode(_next(task.wf)) for task in firsts]))
        for wf in ids:
            await until(lambda wf=wf: _at(store, wf), lambda found: found["cursor"] == "1")
    assert watch.most == 2, watch.most


@pytest.mark.e2e
async def test_a_bundle_sent_back_with_a_header_the_client_cannot_write_is_split_and_parked(
    cluster: Router, settings: Settings
) -> None:
    """The split copied every header, and the client could write back neither a long string
    that is no UTF-8 nor a double too large for its single float: each try failed, and the
    bundle went round forever, never parked."""
    entries = (
        encode_short_string(FAILURES) + b"I" + struct.pack(">i", 1)
        + encode_short_string("k-bytes") + b"S" + struct.pack(">I", 2) + b"\xff\xfe"
        + encode_short_string("k-double") + b"d" + struct.pack(">d", 1e300)
    )  # fmt: skip
    flags = Basic.Properties.flags["headers"]
    raw = struct.pack(">HI", flags, len(entries)) + entries
    body = bundle([encode(_next("ghost-odd-1")), encode(_next("ghost-odd-2"))])
    connection = await aiormq.connect(settings.amqp_url)
    try:
        channel = await connection.channel()
        queue = Names(settings.prefix).shard_queue(0)
        await channel.basic_publish(body, routing_key=queue, properties=RawProperties(raw))
    finally:
        await connection.close()
    reasons = sorted(await dead_reasons(settings, 2))
    assert reasons == [f"ghost-odd-{n}: no such program" for n in (1, 2)]


async def test_reports_that_go_on_go_in_one_bundle_or_each_alone_when_they_no_longer_fit() -> None:
    """A bundle another sender wrote can be longer written again (1e15 comes back as
    1000000000000000.0): one over what an owner reads would be parked whole."""
    bus = Transport()
    whole = Held(headers={"k": "not ours", CARRY: 1})
    small = [encode(_next("a")), encode(_next("b"))]
    await send_on(whole, bus, "q", small)
    assert [(body, headers) for body, headers, _ in bus.sent] == [
        (bundle(small), {FAILURES: 0, CARRY: 1})
    ]
    bus = Transport()
    large = [encode(_next(wf, "x" * (MAX_BUNDLE_BODY // 2))) for wf in ("a", "b")]
    await send_on(whole, bus, "q", large)
    assert [(body, headers) for body, headers, _ in bus.sent] == [
        (body, {FAILURES: 0, CARRY: 1}) for body in large
    ]
