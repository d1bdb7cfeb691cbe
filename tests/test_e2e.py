"""Whole programs on a real cluster (RabbitMQ + Redis), checked by their results and traces."""

import asyncio
import logging
from typing import Any

import pytest

from orchestrator import metrics
from orchestrator.connections import connected
from orchestrator.program import PARALLEL, ProgramError
from orchestrator.settings import Settings
from orchestrator.shares import share_pools
from router.client import Router
from tests.app import Trace
from tests.ordering import assert_leaves_in_order, leaf_order
from tests.polling import until
from worker.pool import Worker
from worker.registry import Registry

pytestmark = pytest.mark.e2e


@pytest.fixture(params=["classic", "quorum"])
def queue_type(request: pytest.FixtureRequest) -> str:
    """Every test here runs on classic queues and again on quorum queues."""
    return str(request.param)


MIXED = {
    "name": "mixed",
    "steps": [
        {"task": "add", "args": {"n": 1}},
        {"bag": [{"task": "add", "args": {"n": i}} for i in range(10)]},
        {
            "until": "prev.iteration >= 2",
            "max_iterations": 10,
            "steps": [{"task": "echo", "pool": "parallel"}, {"task": "counter"}],
        },
        {"task": "echo", "args": {"last": True}},
    ],
}
MIXED_PATHS = [
    "0",
    "1",
    *(f"2/iter:{i}/{j}" for i in range(3) for j in range(2)),
    "3",
]


async def test_task_bag_and_untiloop_give_the_right_result_in_order(
    cluster: Router, trace: Trace
) -> None:
    submitted = await cluster.submit(MIXED, trace.as_input())
    status = await cluster.wait(submitted.workflow_id, timeout_s=60)
    assert status["status"] == "completed", status
    # Bag members each get step 0's output (1) and add their n: the bag's output is their list.
    assert status["result"] == {"args": {"last": True}, "prev": {"iteration": 2}}
    events = trace.events()
    assert_leaves_in_order(events, MIXED_PATHS)
    bag = [e for e in events if e["path"] == "1" and e["event"] == "end"]
    assert sorted(e["index"] for e in bag) == list(range(10))


async def test_a_bag_output_is_its_members_outputs_in_bag_order(cluster: Router) -> None:
    program = {
        "steps": [
            {"task": "add", "args": {"n": 1}},
            {
                "bag": [
                    {"task": "add", "args": {"n": i, "sleep_s": 0.05 * (5 - i)}} for i in range(5)
                ]
            },
        ]
    }
    submitted = await cluster.submit(program)
    status = await cluster.wait(submitted.workflow_id, timeout_s=30)
    assert status["result"] == [1, 2, 3, 4, 5]


async def test_a_chunked_bag_runs_its_members_together_and_retries_one_alone(
    cluster: Router,
) -> None:
    retry = {"max_attempts": 2, "backoff_s": 0.01}
    flaky = {"task": "flaky", "args": {"fail_until": 1}, "retry": retry}
    members = [{"task": "add", "args": {"n": i, "sleep_s": 0.02 * (7 - i)}} for i in range(7)]
    members[4] = flaky  # fails once inside a chunk of three, then runs again on its own
    program = {"steps": [{"task": "add", "args": {"n": 1}}, {"bag": members, "chunk": 3}]}
    status = await cluster.wait((await cluster.submit(program)).workflow_id, timeout_s=30)
    assert status["status"] == "completed", status
    assert status["result"] == [1, 2, 3, 4, {"attempt": 1}, 6, 7]


async def test_fifty_programs_at_once_over_four_shards_all_complete(
    cluster: Router, trace: Trace
) -> None:
    submitted = await asyncio.gather(
        *(cluster.submit(MIXED, trace.as_input(), workflow_id=f"many-{i}") for i in range(50))
    )
    assert {s.shard for s in submitted} == {0, 1, 2, 3}
    statuses = await asyncio.gather(
        *(cluster.wait(s.workflow_id, timeout_s=120) for s in submitted)
    )
    assert [s["status"] for s in statuses] == ["completed"] * 50
    assert {s["owner"] for s in statuses} == {0, 1, 2, 3}
    events = trace.events()
    assert len(leaf_order(events)) == 50
    assert_leaves_in_order(events, MIXED_PATHS)


async def test_a_failing_task_fails_its_program_with_the_error(
    cluster: Router, trace: Trace, caplog: pytest.LogCaptureFixture
) -> None:
    """...and says it in the log, the worker at the failed attempt and the owner at the end:
    in Redis alone, the error went with the program's keys."""
    caplog.set_level(logging.INFO)
    program = {
        "steps": [
            {"task": "add"},
            {"bag": [{"task": "add"}, {"task": "boom", "args": {"message": "disk on fire"}}]},
            {"task": "echo"},
        ]
    }
    submitted = await cluster.submit(program, trace.as_input())
    status = await cluster.wait(submitted.workflow_id, timeout_s=30)
    assert status["status"] == "failed"
    assert status["error"] == "step 1/bag:1: task 'boom': RuntimeError: disk on fire"
    assert status["result"] is None
    assert "2" not in {e["path"] for e in trace.events()}  # nothing after the failure ran
    wf = submitted.workflow_id
    said = [r for r in caplog.records if r.getMessage().startswith(wf)]
    failed = [r for r in said if r.name == "worker.pool" and "failed" in r.getMessage()]
    assert [r.getMessage() for r in failed] == [
        f"{wf}: task 'boom' of step 1 #1 failed (attempt 0): RuntimeError: disk on fire"
    ]
    assert failed[0].levelno == logging.WARNING
    ended = [r.getMessage() for r in said if "ended failed" in r.getMessage()]
    assert ended == [f"{wf}: ended failed: {status['error']!r}"], ended


async def test_an_untiloop_that_never_holds_fails_at_max_iterations(cluster: Router) -> None:
    program = {
        "steps": [
            {"until": "prev.iteration > 99", "max_iterations": 4, "steps": [{"task": "counter"}]}
        ]
    }
    status = await cluster.wait((await cluster.submit(program)).workflow_id, timeout_s=30)
    assert status["status"] == "failed"
    assert status["error"] == "step 0: until 'prev.iteration > 99' not met after max_iterations=4"


async def test_an_unknown_task_fails_its_program_and_the_worker_goes_on(cluster: Router) -> None:
    missing = await cluster.submit({"steps": [{"task": "no_such_task"}]})
    status = await cluster.wait(missing.workflow_id, timeout_s=30)
    assert status["status"] == "failed"
    assert "unknown task 'no_such_task' (this worker knows: " in status["error"]
    after = await cluster.submit({"steps": [{"task": "blocking", "args": {"name": "x"}}]})
    assert (await cluster.wait(after.workflow_id, timeout_s=30))["result"] == "thread:x"


async def test_submitting_an_existing_id_returns_it_and_never_runs_it_twice(
    cluster: Router, trace: Trace
) -> None:
    program = {"steps": [{"task": "add", "args": {"n": 5}}]}
    first = await cluster.submit(program, trace.as_input(), workflow_id="once")
    assert first.created
    await cluster.wait("once", timeout_s=30)
    again = await cluster.submit(program, trace.as_input(), workflow_id="once")
    assert (again.created, again.status, again.shard) == (False, "completed", first.shard)
    with pytest.raises(ProgramError, match="exists with another program or input"):
        await cluster.submit({"steps": [{"task": "boom"}]}, None, workflow_id="once")
    await asyncio.sleep(0.2)
    assert len([e for e in trace.events() if e["event"] == "start"]) == 1
    assert (await cluster.status("once"))["result"] == 5  # type: ignore[index]


async def test_handlers_see_their_identity(cluster: Router) -> None:
    program = {
        "steps": [
            {"task": "add"},
            {
                "until": "true",
                "max_iterations": 1,
                "steps": [{"bag": [{"task": "ctx.identity"}] * 2}],
            },
        ]
    }
    status = await cluster.wait((await cluster.submit(program, workflow_id="who")).workflow_id, 30)
    assert status["result"][1] == {
        "workflow_id": "who",
        "step": "1/iter:0/0",
        "iteration": 0,
        "index": 1,
        "attempt": 0,
        "idempotency_key": "who/1/iter:0/0/bag:1",
    }


async def test_a_task_is_retried_with_backoff_until_it_succeeds(cluster: Router) -> None:
    # `flaky` fails on attempts 0 and 1, and succeeds on attempt 2.
    retry = {"max_attempts": 3, "backoff_s": 0.05, "factor": 2.0}
    program = {"steps": [{"bag": [{"task": "flaky", "args": {"fail_until": 2}, "retry": retry}]}]}
    status = await cluster.wait((await cluster.submit(program)).workflow_id, timeout_s=30)
    assert status["status"] == "completed", status
    assert status["result"] == [{"attempt": 2}]


async def test_after_the_last_attempt_the_program_fails_with_every_error(cluster: Router) -> None:
    retry = {"max_attempts": 3, "backoff_s": 0.01}
    program = {"steps": [{"task": "flaky", "args": {"fail_until": 9}, "retry": retry}]}
    status = await cluster.wait((await cluster.submit(program)).workflow_id, timeout_s=30)
    assert status["status"] == "failed"
    assert status["error"] == (
        "step 0: task 'flaky' failed 3 attempts: #1: RuntimeError: attempt 0 fails; "
        "#2: RuntimeError: attempt 1 fails; #3: RuntimeError: attempt 2 fails"
    )


async def test_cancel_stops_running_tasks_and_dispatches_nothing_more(
    cluster: Router, trace: Trace
) -> None:
    program = {
        "steps": [{"bag": [{"task": "echo", "args": {"sleep_s": 30}}] * 3}, {"task": "echo"}]
    }
    submitted = await cluster.submit(program, trace.as_input())
    await _until(lambda: len(trace.events()) == 3)  # all three members started
    status = await cluster.cancel(submitted.workflow_id, "not needed any more")
    assert (status["status"], status["error"]) == ("cancelled", "not needed any more")
    await asyncio.sleep(0.3)
    events = trace.events()
    assert [e["event"] for e in events] == ["start"] * 3  # stopped before they ended
    assert "1" not in {e["path"] for e in events}
    again = await cluster.cancel(submitted.workflow_id)
    assert again["error"] == "not needed any more"  # the first end stands


@pytest.fixture
def quick_cancel_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    from worker import pool

    monkeypatch.setattr(pool, "CANCEL_CHECK_S", 0.2)


class _NoNotice:
    """A bus whose cancel notices never reach the workers (held back by a memory alarm)."""

    def __init__(self, bus: Any) -> None:
        self._bus = bus

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bus, name)

    async def publish_control(self, body: bytes) -> None:
        pass


async def test_a_cancel_whose_notice_is_lost_still_stops_running_tasks(
    quick_cancel_checks: None, cluster: Router, trace: Trace
) -> None:
    """The notice is a publish, which an alarm holds back: the handlers ran to their end."""
    from orchestrator.ending import end_program

    program = {"steps": [{"bag": [{"task": "echo", "args": {"sleep_s": 30}}] * 2}]}
    wf = (await cluster.submit(program, trace.as_input())).workflow_id
    await _until(lambda: len(trace.events()) == 2)
    assert cluster.bus is not None
    await end_program(cluster.store, _NoNotice(cluster.bus), wf, "cancelled", "no notice")
    await _until(lambda: metrics.TASKS_RUNNING.labels("parallel")._value.get() == 0, 5)
    assert [e["event"] for e in trace.events()] == ["start"] * 2  # stopped, not ended


async def test_a_program_past_its_deadline_fails(cluster: Router) -> None:
    program = {"deadline_s": 0.3, "steps": [{"task": "echo", "args": {"sleep_s": 30}}]}
    status = await cluster.wait((await cluster.submit(program)).workflow_id, timeout_s=10)
    assert (status["status"], status["error"]) == ("failed", "deadline of 0.3s exceeded")


async def test_a_task_over_its_timeout_fails(cluster: Router) -> None:
    program = {"steps": [{"task": "echo", "timeout_s": 0.1, "args": {"sleep_s": 5}}]}
    status = await cluster.wait((await cluster.submit(program)).workflow_id, timeout_s=10)
    assert status["error"] == "step 0: task 'echo': timed out after 0.1s"


async def test_output_over_the_limit_fails_the_task(cluster: Router) -> None:
    program = {"steps": [{"task": "blob", "args": {"n": 2_000_000}}]}
    status = await cluster.wait((await cluster.submit(program)).workflow_id, timeout_s=10)
    assert status["status"] == "failed"
    assert "over the limit of 1048576 (SHARDFLOW_MAX_OUTPUT_BYTES)" in status["error"]


async def _until(condition, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.02)


async def test_a_stopping_worker_hands_back_what_it_cannot_finish(
    settings: Settings, registry: Registry, cluster: Router, caplog: pytest.LogCaptureFixture
) -> None:
    # A second worker with a short grace takes a long task, then is stopped: the task must
    # go back to the queue and be finished by the cluster's own workers.
    hasty = settings.model_copy(update={"grace_s": 0.1})
    queues = [cluster.bus.names.task_queue(pool) for pool in share_pools(PARALLEL)]

    async def consumers_on_each(n: int) -> None:
        # RabbitMQ 3.10 closes a connection that consumes a quorum queue another client is
        # declaring (INTERNAL_ERROR): start the second worker only once the first consumes.
        for queue in queues:
            await until(lambda q=queue: cluster.bus.queue_state(q), lambda s: s[1] >= n)

    await consumers_on_each(1)
    async with connected(hasty, "hasty") as (store, bus):
        worker = Worker(hasty, registry, pool="parallel", store=store, bus=bus, concurrency=4)
        running = asyncio.create_task(worker.run())
        await consumers_on_each(2)  # both workers consume now
        program = {"steps": [{"bag": [{"task": "echo", "args": {"sleep_s": 0.5}}] * 8}]}
        submitted = await cluster.submit(program)
        await asyncio.sleep(0.2)
        worker.shutdown()
        await running
    # Our own records only: an aio-pika record may fail to format (a callback's repr raises).
    ours = [r.getMessage() for r in caplog.records if r.name == "orchestrator.lifecycle"]
    assert any("still busy after 0.1s; cancelling" in message for message in ours)
    status = await cluster.wait(submitted.workflow_id, timeout_s=30)
    assert status["status"] == "completed"
    assert len(status["result"]) == 8
