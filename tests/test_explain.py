"""`explain` and the details of `status`, on real RabbitMQ and Redis: a program waiting for a
retry, for a pool with no consumer, for the serial lane, for bag members; failed attempts of a
task that later succeeded; `submit --wait` without a terminal prints nothing extra."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time

from orchestrator.connections import connected
from orchestrator.keys import Keys
from orchestrator.memory_store import MemoryStore
from orchestrator.messages import decode_task
from orchestrator.owner import Orchestrator
from orchestrator.settings import Settings
from router.client import Router
from router.explain import OVERDUE_MS, _waiting_for, explain, explain_text
from tests.brokers import free_port
from tests.polling import until
from tests.test_carry import _started
from tests.test_cli import EXAMPLE, dev, environment, no_program, shardflow  # noqa: F401  (dev: a fixture)


def test_a_timer_long_past_its_time_is_said_to_be_overdue_not_due_now() -> None:
    """A wake whose message was parked never comes: "due now" hid that for as long as it
    lasted (an operator probe saw it 21 s late)."""
    step = {"kind": "sleep", "path": "1", "wakes_ms": 100_000}
    report = {"workflow_id": "w", "status": "running", "shard": {}, "step": step}

    def said(now: int) -> str:
        return _waiting_for(report, cursor="1", now=now)

    assert said(99_000).endswith("(in 1.0 s)")
    assert said(100_000 + OVERDUE_MS - 1).endswith("(due now)")
    assert said(121_000).endswith(
        "(21.0 s overdue: is its timer's message parked (`shardflow dead`), or its shard's "
        "owner away?)"
    )


async def test_explain_reads_now_on_redis_clock_not_its_own() -> None:
    """Every stamp it compares (created, started, a timer's due time) is Redis's TIME: on a
    client an hour ahead, a program just started had its deadline long past, and a timer
    falling due was called overdue."""
    behind = 3_600_000  # Redis's clock an hour behind this one

    def clock() -> str:
        return str(int(time.time() * 1000) - behind)

    store = MemoryStore(Keys("explain-clock"), clock=clock)
    program = {"deadline_s": 60, "steps": [{"task": "echo"}]}
    _, bus, _, _ = await _started("explain-clock", program, store)
    report = await explain(store, None, decode_task(bus.tasks[0]).wf)
    assert report is not None and 59 < report["deadline"]["left_s"] <= 60, report["deadline"]
    assert report["elapsed_s"] < 1, report


async def test_an_ended_programs_deadline_is_what_was_left_at_its_end(cluster: Router) -> None:
    """It went on counting down after the end (`left_s` -72 in a probe)."""
    wf = (await cluster.submit({"deadline_s": 60, "steps": [{"task": "echo"}]})).workflow_id
    assert (await cluster.wait(wf, timeout_s=20))["status"] == "completed"
    first = (await cluster.explain(wf))["deadline"]
    await asyncio.sleep(0.3)
    again = (await cluster.explain(wf))["deadline"]
    assert first == again and 55 < first["left_s"] < 60, (first, again)
    # A redriven run gets the whole deadline again, from its start: not from the submission.
    wf = (await cluster.submit({"deadline_s": 60, "steps": [{"task": "boom"}]})).workflow_id
    assert (await cluster.wait(wf, timeout_s=20))["status"] == "failed"
    await asyncio.sleep(1.5)
    await cluster.redrive(wf)
    assert (await cluster.wait(wf, timeout_s=20))["status"] == "failed"
    report = await cluster.explain(wf)
    assert report["run"] == 1 and report["deadline"]["left_s"] > 59.3, report["deadline"]


async def test_the_lane_is_held_by_an_attempt_until_the_owner_marks_it_failed(
    settings: Settings,
) -> None:
    """By attempts, not by time: the retry's due time is the owner's clock, the lane's mark
    the worker's, and a worker behind called a running retry's lane free."""
    from orchestrator.redis_store import RedisStore
    from router.explain import _lane

    store = RedisStore.connect(settings)
    keys = store.keys
    try:
        await store.client.hset(keys.state("w"), mapping={"status": "running", "cursor": "0"})
        lane = keys.lane("serial")
        attempts = keys.attempts("w")

        async def held(mark: str, failed: int | None) -> bool:
            await store.client.set(lane, mark)
            await store.client.delete(attempts)
            if failed is not None:  # due long ago on the owner's clock: it says nothing
                await store.client.hset(attempts, "0", json.dumps({"attempt": failed, "due_ms": 1}))
            report = await _lane(store, "w")
            assert report is not None
            return bool(report["held"])

        later = str(int(time.time() * 1000) + 3_600_000)  # a worker's clock an hour ahead
        assert await held(f"w 0 flaky {later} 0", None)  # the first attempt runs
        assert not await held(f"w 0 flaky {later} 0", 0)  # it failed: waits for its retry
        assert await held("w 0 flaky 5 1", 0)  # the retry runs, its mark stamped early
        assert not await held("w 0 flaky 5 1", 1)  # the retry failed too
        assert await held("w 0 flaky 5", 0)  # a mark without its attempt: held, as before
    finally:
        await store.client.delete(keys.state("w"), keys.lane("serial"), keys.attempts("w"))
        await store.close()


async def test_a_program_waiting_for_a_retry(cluster: Router) -> None:
    retry = {"max_attempts": 2, "backoff_s": 100}
    program = {"steps": [{"task": "flaky", "args": {"fail_until": 1}, "retry": retry}]}
    wf = (await cluster.submit(program)).workflow_id
    # The failure is recorded in Redis before the retry is published to its delay queue, so
    # wait for both: a sample between the two reads the queue empty.
    report = await until(
        lambda: cluster.explain(wf),
        lambda r: bool(r["attempts"]) and (r["retry_queue"] or {}).get("depth") == 1,
    )
    now = time.time() * 1000
    task = report["step"]["tasks"][0]
    assert (task["task"], task["attempt"], task["max_attempts"]) == ("flaky", 1, 2)
    assert task["failed"] == [{"attempt": 0, "error": "RuntimeError: attempt 0 fails"}]
    assert now + 60_000 < task["retry_due_ms"] < now + 200_000
    assert report["waiting_for"].startswith("a retry: task 'flaky' attempt 2 of 2 is due at ")
    # the retry waits in its delay queue, the only message there
    queue = report["retry_queue"]
    assert queue["queue"].startswith(f"{cluster.settings.prefix}.delay.serial.")
    assert (queue["depth"], queue["consumers"]) == (1, 0)
    text = explain_text(report)
    assert "attempt 1 failed: RuntimeError: attempt 0 fails" in text
    assert "retry due at" in text
    # Its failed run left the lane: another program's serial task may run meanwhile.
    assert report["lane"] == {"held": False}, report["lane"]
    assert "Serial lane: free." in text
    await cluster.cancel(wf)


async def test_a_program_waiting_for_a_pool_with_no_consumer(settings: Settings) -> None:
    # Orchestrators only: no worker consumes the serial pool.
    async with connected(settings) as (store, bus):
        orchestrator = Orchestrator(settings, range(settings.shards), store=store, bus=bus)
        running = asyncio.create_task(orchestrator.run())
        try:
            router = Router(settings, store=store, bus=bus)
            one = (await router.submit({"name": "first", "steps": [{"task": "t"}]})).workflow_id
            await router.submit({"steps": [{"task": "t"}]})
            report = await until(
                lambda: router.explain(one),
                lambda r: r["status"] == "running" and r["pool"]["depth"] == 2,
            )
        finally:
            orchestrator.shutdown()
            await running
    queue = f"{settings.prefix}.tasks.serial"
    assert report["waiting_for"] == (
        f"a worker: the serial pool has no consumer (2 message(s) queued in {queue})"
    )
    assert report["pool"] == {"queue": queue, "exists": True, "depth": 2, "consumers": 0}
    assert report["step"]["tasks"][0]["task"] == "t"
    assert report["shard"]["owner"] == f"{socket.gethostname()}/{os.getpid()}"
    assert report["lane"] == {"held": False}
    assert "Serial lane: free." in explain_text(report)


async def test_the_serial_lane_and_a_bag_half_done(cluster: Router) -> None:
    slow = {"task": "echo", "args": {"sleep_s": 30}}
    holder = (await cluster.submit({"steps": [slow]})).workflow_id
    await until(lambda: cluster.explain(holder), lambda r: bool(r["lane"] and r["lane"]["held"]))
    queued = (await cluster.submit({"steps": [{"task": "add"}]})).workflow_id
    bag = {"bag": [{"task": "add"}, {**slow, "retry": {"max_attempts": 3}}, {"task": "add"}]}
    half = (await cluster.submit({"steps": [bag]})).workflow_id
    # A branch's single task goes to the lane too: it said only that the parallel pool waited.
    branched = {"bag": [{"steps": [{"task": "add"}]}, {"task": "add"}]}
    in_branch = (await cluster.submit({"steps": [branched]})).workflow_id
    behind = await until(lambda: cluster.explain(queued), lambda r: r["status"] == "running")
    assert behind["waiting_for"] == (
        f"the serial lane, held by program {holder} (step 0, task 'echo')"
    )
    assert behind["lane"]["this_program"] is False
    report = await until(lambda: cluster.explain(in_branch), lambda r: r["step"]["done"] == 1)
    assert report["waiting_for"] == (
        "its branches of step 0: branch 0 at step 0/branch:0/0 (task 'add', waiting for its "
        f"lane, held by program {holder} (step 0, task 'echo'))"
    )
    report = await until(lambda: cluster.explain(half), lambda r: r["step"]["done"] == 2)
    assert [(t["index"], t["done"]) for t in report["step"]["tasks"]] == [
        (0, True),
        (1, False),
        (2, True),
    ]
    assert report["waiting_for"] == "member 1 task 'echo' (attempt 1 of 3) on the parallel pool"
    assert "Bag members done: 2 of 3 (0, 2); not done: 1." in explain_text(report)
    for wf in (holder, queued, half, in_branch):
        await cluster.cancel(wf)
    ended = await cluster.explain(half)
    assert ended is not None and ended["waiting_for"] == "nothing: it ended cancelled"


async def test_status_shows_failed_attempts_of_a_task_that_later_succeeded(
    cluster: Router,
) -> None:
    retry = {"max_attempts": 3, "backoff_s": 0.01}
    program = {
        "name": "flaky-then-fine",
        "steps": [
            {"task": "add"},
            {
                "bag": [
                    {"task": "add"},
                    {"task": "flaky", "args": {"fail_until": 2}, "retry": retry},
                ]
            },
        ],
    }
    wf = (await cluster.submit(program)).workflow_id
    status = await cluster.wait(wf, timeout_s=30)
    assert status["status"] == "completed"
    assert status["attempts"] == [
        {
            "step": "1",
            "index": 1,
            "task": "flaky",
            "failed": [
                {"attempt": 0, "error": "RuntimeError: attempt 0 fails"},
                {"attempt": 1, "error": "RuntimeError: attempt 1 fails"},
            ],
            "retry_due_ms": status["attempts"][0]["retry_due_ms"],
            "retry_pending": False,
        }
    ]
    assert status["steps"] == 2 and status["step"] is None
    assert status["elapsed_s"] >= status["queued_s"] >= 0
    # the fields every version printed are all still there
    assert {"workflow_id", "name", "status", "owner", "cursor", "created_ms", "started_ms",
            "ended_ms", "result", "error"} <= set(status)  # fmt: skip


async def test_status_names_the_tasks_of_the_current_step_and_its_loop(cluster: Router) -> None:
    loop = {
        "until": "false",
        "max_iterations": 5,
        "steps": [{"task": "echo", "args": {"sleep_s": 30}}],
    }
    wf = (await cluster.submit({"steps": [{"task": "add"}, loop]})).workflow_id
    status = await until(lambda: cluster.status(wf), lambda s: s["cursor"] == "1/iter:0/0")
    step = status["step"]
    assert (step["kind"], step["pool"], step["top"]) == ("task", "serial", 1)
    assert [t["task"] for t in step["tasks"]] == ["echo"]
    assert step["loops"] == [{"path": "1", "iteration": 0, "max": 5}]
    assert step["running_s"] >= 0
    await cluster.cancel(wf)


def test_the_explain_command(settings: Settings) -> None:
    env = environment(settings)
    started = shardflow("submit", str(EXAMPLE), "--id", "cli-explain", env=env)
    assert started.returncode == 0, started.stderr
    words = shardflow("explain", "cli-explain", env=env)
    assert words.returncode == 0, words.stderr
    assert "Program cli-explain 'thumbnails' is pending." in words.stdout
    assert "Waiting for: an orchestrator: shard" in words.stdout  # none runs here
    data = json.loads(shardflow("explain", "cli-explain", "--json", env=env).stdout)
    assert data["shard"]["consumers"] == 0 and data["status"] == "pending"
    missing = shardflow("explain", "nothing-here", env=env)
    said = no_program("nothing-here", env)
    assert (missing.returncode, missing.stderr) == (1, f"shardflow: {said}\n")
    # RabbitMQ away: what Redis holds is still said (it exited 4), the queues' part is not.
    no_rabbit = {**env, "SHARDFLOW_AMQP_URL": f"amqp://guest:guest@127.0.0.1:{free_port()}/"}
    alone = shardflow("explain", "cli-explain", "--json", env=no_rabbit)
    assert alone.returncode == 0, alone.stderr
    assert "cannot connect to RabbitMQ (SHARDFLOW_AMQP_URL)" in alone.stderr
    report = json.loads(alone.stdout)
    assert report["status"] == "pending" and "consumers" not in report["shard"], report


def test_submit_wait_without_a_terminal_prints_nothing_extra(
    dev: dict[str, str],  # noqa: F811
) -> None:
    done = shardflow(
        "submit", str(EXAMPLE), "--input", '{"album": "a"}', "--id", "quiet", "--wait", env=dev
    )
    assert done.returncode == 0, done.stderr
    assert (done.stdout, done.stderr) == ('{"published": "a", "after_polls": 3}\n', "quiet\n")
