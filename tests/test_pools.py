"""Named pools on a real cluster: a task waits for its pool's worker (and `explain` says so),
bags and their members go to the pools they name, retries come back to the same pool."""

from __future__ import annotations

import argparse
import asyncio
import math
import shutil
import subprocess
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aio_pika
import pytest

from orchestrator import metrics
from orchestrator.bus import TASK_MAX_PRIORITY, Bus
from orchestrator.connections import connected
from orchestrator.program import ProgramError
from orchestrator.settings import Settings
from orchestrator.shares import share_of, share_pool
from router.client import Router
from router.explain import explain_text
from shardflow.cli import _parser, _pools
from shardflow.dev import Together, workers
from tests.app import Trace
from tests.polling import until
from worker.context import TaskContext
from worker.registry import Registry

pytestmark = pytest.mark.e2e


@pytest.fixture(params=["classic", "quorum"])
def queue_type(request: pytest.FixtureRequest) -> str:
    """Named pools on classic queues, and again on quorum queues."""
    return str(request.param)


def _registry_of(pool: str) -> Registry:
    """tests.app, plus tasks that only this pool's workers know: a task that reaches any other
    worker fails as unknown, so a result proves where it ran."""
    registry = Registry.from_modules(["tests.app"])

    async def whoami(ctx: TaskContext) -> dict[str, Any]:
        return {"pool": pool, "attempt": ctx.attempt}

    async def flaky_here(ctx: TaskContext) -> dict[str, Any]:
        if ctx.attempt < ctx.args.get("fail_until", 1):
            raise RuntimeError(f"attempt {ctx.attempt} fails on {pool}")
        return {"pool": pool, "attempt": ctx.attempt}

    registry.add(f"{pool}.whoami", whoami)
    registry.add(f"{pool}.flaky", flaky_here)
    return registry


@asynccontextmanager
async def _workers(settings: Settings, *pools: str) -> AsyncIterator[None]:
    """Workers for these pools in one service, on connections of their own (as `shardflow
    worker --pool a,b` runs them), each knowing its own pool's tasks."""
    async with connected(settings, "named-pools") as (store, bus):
        parts = [
            part
            for pool in pools
            for part in workers(settings, _registry_of(pool), [pool], store=store, bus=bus)
        ]
        service = Together(parts)
        running = asyncio.create_task(service.run())
        try:
            yield
        finally:
            service.shutdown()
            await running


async def test_a_task_on_a_named_pool_waits_for_its_worker_then_completes(
    cluster: Router, settings: Settings
) -> None:
    program = {
        "steps": [
            {"task": "add", "args": {"n": 1}},
            {"task": "reports.whoami", "pool": "reports"},
            {"task": "echo", "pool": "parallel"},
        ]
    }
    wf = (await cluster.submit(program)).workflow_id
    # Its share of the pool: the queue its kind of program hashes to (orchestrator/shares.py).
    share = share_of(cluster.validate(program))
    queue = f"{settings.prefix}.tasks.{share_pool('reports', share)}"
    report = await until(
        lambda: cluster.explain(wf),
        lambda r: r["step"] is not None and r["step"]["path"] == "1" and r["pool"]["depth"] == 1,
    )
    assert report["waiting_for"] == (
        f"a worker: the reports pool has no consumer (1 message(s) queued in {queue})"
    )
    assert report["step"]["pool"] == "reports"
    assert report["step"]["tasks"][0]["pool"] == "reports"
    assert report["pool"] == {"queue": queue, "exists": True, "depth": 1, "consumers": 0}
    assert report["pools"] == [{"pool": "reports", **report["pool"]}]
    assert report["lane"] is None  # not the serial pool
    text = explain_text(report)
    assert "task 'reports.whoami' on the reports pool" in text
    assert "No worker runs it: start one with shardflow worker --pool reports --app MODULE." in text
    status = await cluster.status(wf)
    assert status is not None and status["step"]["pool"] == "reports"

    # The owner declared the queue as the parallel pool's: the same arguments declare again.
    bus = cluster.bus
    assert isinstance(bus, Bus)
    arguments = bus._queue_arguments(max_priority=TASK_MAX_PRIORITY)
    connection = await aio_pika.connect(settings.amqp_url)
    async with connection:
        channel = await connection.channel()
        await channel.declare_queue(queue, durable=True, arguments=arguments)

    async with _workers(settings, "reports"):
        status = await cluster.wait(wf, timeout_s=30)
        assert status["status"] == "completed", status
        assert status["result"] == {"args": {}, "prev": {"pool": "reports", "attempt": 0}}
        report = await until(lambda: cluster.explain(wf), lambda r: r["status"] == "completed")
        assert report["waiting_for"] == "nothing: it ended completed"


async def test_a_bag_on_a_pool_its_members_overrides_and_their_retries(
    cluster: Router, settings: Settings
) -> None:
    retry = {"max_attempts": 3, "backoff_s": 0.05}
    bag = {
        "pool": "reports",
        "chunk": 2,
        "bag": [
            {"task": "reports.whoami"},
            {"task": "gpu.whoami", "pool": "gpu"},
            {"task": "reports.flaky", "args": {"fail_until": 2}, "retry": retry},
            {"task": "add", "args": {"n": 3}, "pool": "parallel"},
            {"task": "gpu.flaky", "pool": "gpu", "retry": retry},
            {"task": "reports.whoami"},
        ],
    }
    async with _workers(settings, "reports", "gpu"):
        wf = (await cluster.submit({"steps": [bag]})).workflow_id
        status = await cluster.wait(wf, timeout_s=30)
    assert status["status"] == "completed", status
    assert status["result"] == [
        {"pool": "reports", "attempt": 0},
        {"pool": "gpu", "attempt": 0},
        {"pool": "reports", "attempt": 2},  # retried twice, each time on its own pool
        3,
        {"pool": "gpu", "attempt": 1},
        {"pool": "reports", "attempt": 0},
    ]
    failed = {(a["index"], len(a["failed"])) for a in status["attempts"]}
    assert failed == {(2, 2), (4, 1)}


async def test_a_bag_member_waits_for_its_own_pool(cluster: Router, settings: Settings) -> None:
    bag = {"bag": [{"task": "add"}, {"task": "late.whoami", "pool": "late"}, {"task": "add"}]}
    wf = (await cluster.submit({"steps": [bag]})).workflow_id
    # A quorum queue's message count may lag its publish: wait for both.
    report = await until(
        lambda: cluster.explain(wf),
        lambda r: (r["step"] or {}).get("done") == 2 and (r["pool"] or {}).get("depth") == 1,
    )
    share = share_of(cluster.validate({"steps": [bag]}))
    queue = f"{settings.prefix}.tasks.{share_pool('late', share)}"
    assert report["step"]["pool"] == "parallel"
    assert [t["pool"] for t in report["step"]["tasks"]] == ["parallel", "late", "parallel"]
    assert report["waiting_for"] == (
        f"a worker: the late pool has no consumer (1 message(s) queued in {queue})"
    )
    assert [p["pool"] for p in report["pools"]] == ["late"]  # the pools of the open members
    async with _workers(settings, "late"):
        status = await cluster.wait(wf, timeout_s=30)
    assert status["result"] == [1, {"pool": "late", "attempt": 0}, 1]


def test_the_worker_command_takes_pools_repeated_or_comma_separated(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = _parser().parse_args(
        ["worker", "--pool", "reports,gpu", "--pool", "serial", "--pool", "gpu", "--app", "m"]
    )
    assert _pools(args.pool) == ["reports", "gpu", "serial"]
    for bad in ["Reports", "a.b", ",", "shard3"]:
        with pytest.raises(SystemExit) as caught:
            _parser().parse_args(["worker", "--pool", bad, "--app", "m"])
        assert caught.value.code == 2
        assert "--pool" in capsys.readouterr().err
    args = _parser().parse_args(["dev", "--pool", "reports"])
    assert _pools(args.pool) == ["reports"]
    assert isinstance(args, argparse.Namespace)


def test_pool_labels_are_bounded_whatever_programs_name() -> None:
    assert metrics.pool_label("serial") == "serial"
    names = [f"labels-{i}" for i in range(2 * metrics.MAX_POOL_LABELS)]
    labels = [metrics.pool_label(name) for name in names]
    assert labels[0] == "labels-0"
    assert labels[-1] == "other"
    assert len(set(labels) - {"other"}) <= metrics.MAX_POOL_LABELS
    assert metrics.pool_label("labels-0") == "labels-0"  # a pool keeps its series


async def test_a_named_lane_runs_one_task_at_a_time_beside_the_serial_lane(
    cluster: Router, settings: Settings, trace: Trace
) -> None:
    slow = {"task": "echo", "args": {"sleep_s": 0.3}}
    billing = [{"steps": [{**slow, "pool": "serial-billing"}]} for _ in range(3)]
    serial = {"steps": [{**slow, "pool": "serial"}]}
    with pytest.raises(ProgramError, match="a serial lane takes single tasks"):
        await cluster.submit({"steps": [{"bag": [{"task": "echo"}], "pool": "serial-billing"}]})
    # Two workers on the lane, as a Deployment of two would run: one consumes, one stands by.
    async with _workers(settings, "serial-billing", "serial-billing"):
        ids = [(await cluster.submit(p, trace.as_input())).workflow_id for p in billing]
        holder = (await cluster.submit(serial, trace.as_input())).workflow_id
        report = await until(
            lambda: cluster.explain(ids[0]),
            lambda r: r["status"] != "running" or bool(r["lane"] and r["lane"]["held"]),
        )
        for wf in [*ids, holder]:
            assert (await cluster.wait(wf, timeout_s=30))["status"] == "completed"
    if report["status"] == "running":
        assert report["step"]["pool"] == "serial-billing"
        # Held by whichever billing program's task started first: their shards race.
        assert "Lane serial-billing: held by" in explain_text(report)
    events = [e for e in trace.events() if e["wf"] in ids]
    running = 0
    for event in sorted(events, key=lambda e: e["seq"]):  # never two billing tasks at once
        running += 1 if event["event"] == "start" else -1
        assert running <= 1, events
    starts = {e["wf"]: e["seq"] for e in trace.events() if e["event"] == "start"}
    ends = {e["wf"]: e["seq"] for e in trace.events() if e["event"] == "end"}
    # The serial lane's task ran beside the billing lane's, not after all of them.
    assert starts[holder] < max(ends[wf] for wf in ids), (starts, ends)


@pytest.mark.skipif(shutil.which("rabbitmqctl") is None, reason="closes a connection by pid")
async def test_a_lane_task_stops_when_its_workers_connection_drops_so_two_never_overlap(
    cluster: Router, settings: Settings
) -> None:
    """The lane's active worker loses its connection while its task runs (a network blip, a
    broker restart, consumer_timeout): the broker hands the task to the standby at once. The
    first run must stop then: it ran on beside the standby's, two of the lane's at once."""
    runs: list[list[float]] = []  # [start, end] of each run, in this process's clock

    async def hold(ctx: TaskContext) -> str:
        run = [time.monotonic(), math.inf]
        runs.append(run)
        try:
            await asyncio.sleep(ctx.args["sleep_s"])
        finally:
            run[1] = time.monotonic()
        return "held"

    registry = Registry({"hold": hold})
    name = f"lane-a-{uuid.uuid4().hex[:8]}"
    async with (
        connected(settings, name) as (store_a, bus_a),
        connected(settings, "lane-b") as (store_b, bus_b),
    ):
        [a] = workers(settings, registry, ["serial-x"], store=store_a, bus=bus_a)
        [b] = workers(settings, registry, ["serial-x"], store=store_b, bus=bus_b)
        first, standby = Together([a]), Together([b])
        running = [asyncio.create_task(first.run())]
        await until(lambda: _now(a.consuming), bool)  # the first is the lane's active one
        running.append(asyncio.create_task(standby.run()))
        try:
            await until(lambda: _now(b.consuming), bool)
            program = {"steps": [{"task": "hold", "args": {"sleep_s": 2}, "pool": "serial-x"}]}
            wf = (await cluster.submit(program)).workflow_id
            await until(lambda: _now(len(runs)), lambda found: found == 1)
            pid = await asyncio.to_thread(_connection_pid, name)
            await asyncio.to_thread(_rabbitmqctl, "close_connection", pid, "a test drops it")
            assert (await cluster.wait(wf, timeout_s=30))["status"] == "completed"
        finally:
            first.shutdown()
            standby.shutdown()
            await asyncio.gather(*running)
    assert len(runs) == 2, runs
    (first_start, first_end), (second_start, _) = sorted(runs)
    assert first_end - first_start < 1.5, runs  # stopped, not run to its 2 s
    assert first_end <= second_start + 0.05, runs  # never two at once (one loop's clock)
    assert a.counts["let go"] == 1 and b.counts["let go"] == 0


@pytest.mark.skipif(shutil.which("rabbitmqctl") is None, reason="closes a connection by pid")
async def test_a_task_given_back_to_the_worker_that_runs_it_is_not_run_a_second_time(
    cluster: Router, settings: Settings
) -> None:
    """Its connection dropped (RabbitMQ restarted, say), the broker gives each unacked task
    back once the worker reconnects: the worker started a second handler beside the first,
    and both ran to their end. Now the copy waits for the run under way (a worker of 4), or,
    when it had to wait for the worker's one slot until that run ended, knows it ran (a
    worker of 1): either way it is acked, not run."""
    runs: list[str] = []

    async def hold(ctx: TaskContext) -> str:
        runs.append(ctx.workflow_id)
        await asyncio.sleep(ctx.args["sleep_s"])
        return "held"

    registry = Registry({"hold": hold})
    name = f"par-a-{uuid.uuid4().hex[:8]}"
    async with connected(settings, name) as (store, bus):
        [wide] = workers(settings, registry, ["par-x"], store=store, bus=bus, concurrency=4)
        [narrow] = workers(settings, registry, ["par-y"], store=store, bus=bus, concurrency=1)
        together = Together([wide, narrow])
        running = asyncio.create_task(together.run())
        try:
            await until(lambda: _now(wide.consuming and narrow.consuming), bool)
            # Longer than the worker's reconnect (aio-pika waits 5 s): the copies come meanwhile.
            ids = []
            for pool in ("par-x", "par-y"):
                program = {"steps": [{"task": "hold", "args": {"sleep_s": 10}, "pool": pool}]}
                ids.append((await cluster.submit(program)).workflow_id)
            await until(lambda: _now(len(runs)), lambda found: found == 2)
            pid = await asyncio.to_thread(_connection_pid, name)
            await asyncio.to_thread(_rabbitmqctl, "close_connection", pid, "a test drops it")
            for wf in ids:
                status = await cluster.wait(wf, timeout_s=30)
                assert (status["status"], status["result"]) == ("completed", "held"), status
        finally:
            together.shutdown()
            await running
    assert sorted(runs) == sorted(ids), runs
    assert wide.counts["ran here already"] == 1, wide.counts
    assert narrow.counts["ran here already"] == 1, narrow.counts


async def test_a_lane_task_cut_by_its_workers_stop_is_not_said_to_be_a_closed_channel(
    cluster: Router, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    """Every lane task its worker's stop cut short (SIGTERM's grace ran out) was logged as
    `its delivery's channel closed` and counted `let go`: a rolling deploy read as network
    trouble."""
    started = asyncio.Event()

    async def hold(ctx: TaskContext) -> str:
        started.set()
        await asyncio.sleep(30)
        return "held"

    lane = settings.model_copy(update={"grace_s": 0.2})
    async with connected(lane, "lane-stop") as (store, bus):
        [worker] = workers(lane, Registry({"hold": hold}), ["serial-y"], store=store, bus=bus)
        together = Together([worker])
        running = asyncio.create_task(together.run())
        try:
            program = {"steps": [{"task": "hold", "pool": "serial-y"}]}
            await cluster.submit(program)
            await asyncio.wait_for(started.wait(), 20)
        finally:
            together.shutdown()
            await running
    assert worker.counts["let go"] == 0, worker.counts
    assert "channel closed" not in caplog.text


async def _now(value: Any) -> Any:
    return value


def _connection_pid(name: str) -> str:
    for line in _rabbitmqctl("list_connections", "pid", "client_properties").splitlines():
        if name in line:
            return line.split()[0]
    raise AssertionError(f"no connection named {name}")


def _rabbitmqctl(*args: str) -> str:
    return subprocess.run(
        ["rabbitmqctl", "-q", *args], capture_output=True, text=True, check=True, timeout=30
    ).stdout


async def test_a_lane_worker_keeps_no_watch_on_its_channel_after_each_task(
    cluster: Router, settings: Settings
) -> None:
    """Each lane task watches its delivery's channel (aiormq adds a callback to it, about
    1 KB): the watch goes when the task ends, or a worker grew by every task it ran."""
    registry = Registry({"quick": _quick})
    async with connected(settings, "lane-watch") as (store, bus):
        [lane] = workers(settings, registry, ["serial-x"], store=store, bus=bus)
        service = Together([lane])
        running = asyncio.create_task(service.run())
        try:
            program = {"steps": [{"task": "quick", "pool": "serial-x"}]}
            ids = [(await cluster.submit(program)).workflow_id for _ in range(40)]
            for wf in ids:
                assert (await cluster.wait(wf, timeout_s=30))["status"] == "completed"
            watches = [len(it._channel._closing._callbacks) for it in lane._iterators]
        finally:
            service.shutdown()
            await running
    assert watches and max(watches) < 20, watches  # 5 here; one a task left them at 45


async def _quick(ctx: TaskContext) -> str:
    return "done"


@pytest.mark.parametrize("cancelled", [False, True])
async def test_a_lane_hold_cut_by_a_closed_channel_still_runs_no_task_beside_its_handler(
    cluster: Router, settings: Settings, caplog: pytest.LogCaptureFixture, cancelled: bool
) -> None:
    """A lane holds while a timed-out plain function runs on in its thread; its channel closing
    meanwhile cut the hold, and the redelivered task ran beside that thread. A cancel of its
    program while the redelivered task waits for the thread keeps it from running at all."""
    runs: list[list[float]] = []

    def hold(ctx: TaskContext) -> str:
        run = [time.monotonic(), math.inf]
        runs.append(run)
        time.sleep(8 if len(runs) == 1 else 0.05)  # the first outlasts the reconnect
        run[1] = time.monotonic()
        return "held"

    name = f"lane-cut-{uuid.uuid4().hex[:8]}"
    async with connected(settings, name) as (store, bus):
        [worker] = workers(settings, Registry({"hold": hold}), ["serial-w"], store=store, bus=bus)
        together = Together([worker])
        running = asyncio.create_task(together.run())
        try:
            program = {"steps": [{"task": "hold", "pool": "serial-w", "timeout_s": 0.2}]}
            wf = (await cluster.submit(program)).workflow_id
            await until(lambda: _now(worker.threads.left_behind), lambda left: left == 1)
            pid = await asyncio.to_thread(_connection_pid, name)
            await asyncio.to_thread(_rabbitmqctl, "close_connection", pid, "a test cuts the hold")
            if cancelled:
                waits = "an earlier task's, before this one starts"
                await until(lambda: _now(caplog.text), lambda text: waits in text)
                await cluster.cancel(wf)
            status = await cluster.wait(wf, timeout_s=30)
            await until(lambda: _now(worker.threads.left_behind), lambda left: left == 0)
        finally:
            together.shutdown()
            await running
    if cancelled:  # its program ended while it waited: it never ran
        assert status["status"] == "cancelled" and len(runs) == 1, (status, runs)
        return
    assert status["status"] == "completed", status
    assert len(runs) == 2, runs  # the first, cut short; the redelivered one
    (_, first_end), (second_start, _) = sorted(runs)
    assert first_end <= second_start, runs  # never two at once
