"""Handlers that misbehave, on a real cluster: an exception whose text cannot be made, a
handler that catches its cancel, one that changes what it was given. Each fails or retries
its task as any failure does; none holds its worker or changes another's input."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import threading
from typing import Any

import pytest
from prometheus_client import REGISTRY

from router.client import Router
from shardflow.cli import end_the_rest
from tests.app import Trace
from tests.polling import until
from worker import pool
from worker.threads import HandlerThreads

pytestmark = pytest.mark.e2e


async def test_an_exception_whose_text_fails_fails_its_task_once(
    cluster: Router, trace: Trace
) -> None:
    """Its str() raised inside the worker's failure report: the delivery was tried 20 times
    (the handler ran 20 times) and parked, and the program stayed running."""
    program = {"steps": [{"task": "unprintable"}]}
    wf = (await cluster.submit(program, trace.as_input())).workflow_id
    status = await cluster.wait(wf, timeout_s=20)
    assert status["status"] == "failed", status
    assert "Unprintable: <str() raised AttributeError>" in status["error"], status["error"]
    assert [e["event"] for e in trace.events()] == ["start"]


async def test_a_handler_that_catches_its_cancel_still_times_out_its_task(
    cluster: Router, trace: Trace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It ran on for its 4 s, holding its slot, and the task failed only then (a key's lease
    held as long, the worker's stop waited for it). Now its slot is given back, and the
    handler that runs on is counted apart (tasks_running went to 0 while it ran)."""
    monkeypatch.setattr(pool, "HANDLER_END_S", 0.3)

    def sample(name: str) -> float | None:
        return REGISTRY.get_sample_value(f"shardflow_{name}", {"pool": "parallel"})

    assert sample("handlers_left_running") == 0
    deaf = {"task": "deaf", "args": {"for_s": 4}, "timeout_s": 0.2, "pool": "parallel"}
    wf = (await cluster.submit({"steps": [deaf]}, trace.as_input())).workflow_id
    status = await cluster.wait(wf, timeout_s=3)
    assert status["status"] == "failed" and "timed out after 0.2s" in status["error"], status
    assert sample("handlers_left_running") == 1
    assert sample("tasks_running") == 0, sample("tasks_running")


async def test_a_retry_sees_what_the_first_attempt_was_given(cluster: Router) -> None:
    """The first attempt took an item from its prev: the retry, built from the failure's
    report, ran without it."""
    retry = {"max_attempts": 2, "backoff_s": 0.1}
    program = {
        "steps": [{"task": "echo", "args": {"items": [1, 2, 3]}}, {"task": "pops", "retry": retry}]
    }
    wf = (await cluster.submit(program)).workflow_id
    status = await cluster.wait(wf, timeout_s=20)
    assert status["status"] == "completed", status
    assert status["result"] == [1, 2, 3]


async def test_a_task_that_refuses_its_cancel_does_not_hold_the_process_at_its_exit() -> None:
    """The event loop waits at its end for every task it cancels: a handler left running that
    catches every cancel kept the process (and its pod) from ever exiting."""
    stop = asyncio.Event()

    async def deaf() -> None:
        while not stop.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(0.05)

    left = asyncio.ensure_future(deaf())
    polite = asyncio.ensure_future(asyncio.sleep(60))
    await asyncio.sleep(0.01)  # both under way
    codes: list[int] = []
    try:
        await end_the_rest("test", within_s=0.3, leave=codes.append)
        assert codes == [0] and polite.cancelled() and not left.done()
    finally:
        stop.set()  # or this test's own loop would wait for it at its end
        await left
    codes.clear()
    await end_the_rest("test", within_s=0.3, leave=codes.append)
    assert codes == []  # nothing left that refuses: no early exit


async def test_a_plain_handler_still_running_at_the_stop_does_not_hold_the_process() -> None:
    """Python joins every pool thread at its exit: a stuck plain function held it for good,
    though no task was left to see."""
    release = threading.Event()
    started = threading.Event()

    def stuck(_: object) -> None:
        started.set()
        release.wait(10)

    threads = HandlerThreads(1, "test")
    call = asyncio.ensure_future(threads.run(stuck, None))
    try:
        await asyncio.to_thread(started.wait, 5)
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await call
        codes: list[int] = []
        await end_the_rest("test", within_s=0.1, leave=codes.append, code=1)
        assert codes == [1]
    finally:
        release.set()
        threads.shutdown()


async def test_a_handler_that_catches_its_programs_cancel_gives_its_slot_back(
    cluster: Router, trace: Trace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no timeout_s, its worker waited for it as long as it ran on (for good, for one
    that never returns), holding its slot."""
    monkeypatch.setattr(pool, "HANDLER_END_S", 0.3)
    deaf = {"task": "deaf", "args": {"for_s": 16}, "pool": "parallel"}
    program = {"steps": [deaf, {"task": "echo"}]}
    wf = (await cluster.submit(program, trace.as_input())).workflow_id
    for _ in range(100):
        if trace.events():
            break
        await asyncio.sleep(0.05)
    await cluster.cancel(wf)
    # The worker's slot comes back while the handler still runs (its 16 s): once the cancel's
    # notice arrives, or at the worker's own check of cancels (CANCEL_CHECK_S, 10 s).
    running = {"pool": "parallel"}
    await until(
        lambda: _now(REGISTRY.get_sample_value("shardflow_tasks_running", running)),
        lambda value: value == 0,
        timeout_s=13,
    )
    assert [e["event"] for e in trace.events()] == ["start"]  # it runs on
    assert (await cluster.status(wf))["status"] == "cancelled"


@pytest.mark.parametrize(
    ("task", "args", "fault"),
    [
        ("self_cancelled", {}, "CancelledError (raised by the handler's own code"),
        ("plain_fault", {"raise": "stop"}, "RuntimeError: the handler raised StopIteration"),
        ("plain_fault", {"raise": "cancel"}, "the handler raised CancelledError: from a thread"),
    ],
)
async def test_a_handler_raising_what_asyncio_mishandles_fails_and_retries_its_task(
    cluster: Router, trace: Trace, task: str, args: dict[str, Any], fault: str
) -> None:
    """A CancelledError of the handler's own (an inner task it awaited, cancelled elsewhere)
    was taken for its program's cancel: nothing reported, the program running for good. A
    plain function's StopIteration (next() of an empty iterator) cannot be set on a future:
    the await never ended, holding the slot (the serial lane's, here) across restarts."""
    retry = {"max_attempts": 2, "backoff_s": 0.05}
    program = {"steps": [{"task": task, "args": args, "retry": retry}]}
    wf = (await cluster.submit(program, trace.as_input())).workflow_id
    status = await cluster.wait(wf, timeout_s=20)
    assert status["status"] == "failed" and fault in status["error"], status
    assert "failed 2 attempts" in status["error"], status["error"]
    assert [e["event"] for e in trace.events()] == ["start", "start"]


@pytest.mark.parametrize(
    ("args", "fault"),
    [
        ({}, "output: not UTF-8 text: a lone surrogate '\\udce9'"),
        ({"pad": 70_000}, "output: not UTF-8 text: a lone surrogate '\\udce9'"),
        ({"depth": 65, "pad": 70_000}, "output: nested deeper than 64 levels"),  # in a thread
        ({"raise": True}, "ValueError: cannot parse report-\\udce9.csv"),
        ({"depth": 65}, "output: nested deeper than 64 levels"),
    ],
)
async def test_an_output_or_error_no_message_can_carry_fails_its_task_once_per_attempt(
    cluster: Router, trace: Trace, args: dict[str, Any], fault: str
) -> None:
    """A lone surrogate (a file name os.listdir decoded) in an output or an error made the
    report fail to encode: the handler ran 20 times, the message was parked and the program
    ran for good. So did an output nested 200 levels (the owner parked its report)."""
    retry = {"max_attempts": 2, "backoff_s": 0.05}
    program = {"steps": [{"task": "odd_text", "args": args, "retry": retry, "pool": "parallel"}]}
    wf = (await cluster.submit(program, trace.as_input())).workflow_id
    status = await cluster.wait(wf, timeout_s=20)
    assert status["status"] == "failed" and fault in status["error"], status
    assert [e["event"] for e in trace.events()] == ["start", "start"]


async def test_an_output_64_levels_deep_goes_on_and_a_bag_carries_it_a_level_deeper(
    cluster: Router,
) -> None:
    """The deepest output a handler may return: the next step gets it, and a bag's outputs hold
    it one level deeper (the owner's messages carry values deeper than a handler may give)."""
    deep = {"task": "odd_text", "args": {"depth": 64}}
    program = {"steps": [deep, {"bag": [deep, deep]}]}
    wf = (await cluster.submit(program)).workflow_id
    status = await cluster.wait(wf, timeout_s=20)
    assert status["status"] == "completed", status
    value: Any = status["result"]
    for _ in range(65):
        assert isinstance(value, list) and len(value) in (1, 2)
        value = value[0]
    assert value == 1


async def test_a_failed_handler_logs_its_traceback_and_a_groups_error_names_its_members(
    cluster: Router, caplog: pytest.LogCaptureFixture
) -> None:
    """A handler's traceback appeared nowhere, even at debug; and a TaskGroup's failure said
    only `unhandled errors in a TaskGroup (1 sub-exception)`, its KeyError nowhere."""
    wf = (await cluster.submit({"steps": [{"task": "grouped"}]})).workflow_id
    status = await cluster.wait(wf, timeout_s=20)
    assert status["error"].endswith(
        "ExceptionGroup: unhandled errors in a TaskGroup (1 sub-exception): "
        "KeyError: 'customer 2 missing'"
    ), status["error"]
    [record] = [r for r in caplog.records if wf in r.getMessage() and "failed" in r.getMessage()]
    assert record.exc_info is not None and "in lookup" in caplog.text


@pytest.mark.parametrize("handler", ["plain_sleep", "deaf"])
async def test_a_lane_waits_for_a_handler_that_runs_on_past_its_timeout(
    cluster: Router,
    trace: Trace,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    handler: str,
) -> None:
    """A plain function that timed out runs on in its thread (an `async def` that catches its
    cancel, on after 5 s): the lane's next task started beside it, two of the lane's at once,
    which the lane promises never happens."""
    monkeypatch.setattr(pool, "HANDLER_END_S", 0.3)
    first = {"steps": [{"task": handler, "args": {"for_s": 1.5, "fail": 1}, "timeout_s": 0.2}]}
    second = {"steps": [{"task": "plain_sleep", "args": {"for_s": 0}}]}
    ids = [(await cluster.submit(first, trace.as_input())).workflow_id]
    await until(lambda: _now(trace.events()), bool)  # it holds the lane: the second waits
    ids.append((await cluster.submit(second, trace.as_input())).workflow_id)
    statuses = [await cluster.wait(wf, timeout_s=20) for wf in ids]
    assert [s["status"] for s in statuses] == ["failed", "completed"], statuses
    assert "timed out after 0.2s" in statuses[0]["error"]
    events = [(e["wf"], e["event"]) for e in trace.events()]
    assert events == [(ids[0], "start"), (ids[0], "end"), (ids[1], "start"), (ids[1], "end")]
    gc.collect()  # an outcome never retrieved is said when its future is collected
    assert "never retrieved" not in caplog.text  # the late failure was the task's, reported


async def _now(value: Any) -> Any:
    return value


def test_the_output_text_check_refuses_a_lone_surrogate_and_nothing_else() -> None:
    """A pair held as two characters is written as the escape of a character beyond the BMP,
    which is what travels: it was refused as a lone surrogate."""
    for fine in ("\ud83c\udf89", "🎉", "\\ud800", "a\\\ud83d\ude00"):
        pool._check_text(json.dumps({"s": fine, fine: 1}))
    for lone in ("\udce9", "a\ud83c", "\udf89\ud83c", "\\\ud800"):
        with pytest.raises(pool._TaskError, match="output: not UTF-8 text: a lone surrogate"):
            pool._check_text(json.dumps([lone]))
