"""Metrics and JSON logs of a running cluster, read through its real HTTP endpoint; the
dashboard's queries against the metrics the code exports."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from orchestrator import metrics
from orchestrator.connections import connected
from orchestrator.messages import Start, encode
from orchestrator.settings import Settings
from router.client import Router
from tests.brokers import free_port
from worker import TaskContext, task

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "helm" / "shardflow" / "files" / "dashboard.json"
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@task(name="metrics.logs")
def logs_a_line(ctx: TaskContext) -> str:
    """A handler that logs: its line must carry the task's identity (run by the dev process)."""
    logging.getLogger("shop").info("resizing %s", ctx.args.get("name"))
    return "logged"


def get(port: int, path: str) -> tuple[int, str]:
    """GET over real HTTP, no proxy: the status and body (0 when nothing answers)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, ""


def scrape(port: int) -> Samples:
    status, text = get(port, "/metrics")
    assert status == 200, text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def wait_until(check: Callable[[], Any], seconds: float, what: str) -> Any:
    """Poll `check` until it answers something true; fail naming `what` and the last answer
    after `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        answer = check()
        if answer:
            return answer
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: still not so after {seconds}s (last: {answer!r})")
        time.sleep(0.1)


def environment(settings: Settings, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "SHARDFLOW_AMQP_URL": settings.amqp_url,
        "SHARDFLOW_REDIS_URL": settings.redis_url,
        "SHARDFLOW_PREFIX": settings.prefix,
        "SHARDFLOW_SHARDS": str(settings.shards),
        "SHARDFLOW_GRACE_S": "10",
        **extra,
    }


class Running:
    """A `shardflow` process of a test, its metrics port and its log file."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self.port = free_port()
        self.log = log
        with log.open("w") as stderr:  # the child holds its own copy
            self.process = subprocess.Popen(
                [sys.executable, "-m", "shardflow", *args, "--metrics-port", str(self.port)],
                cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=stderr,
            )  # fmt: skip

    def stop(self) -> str:
        """SIGTERM; the process must exit 0. Its log."""
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=60)
        text = self.log.read_text()
        assert self.process.returncode == 0, text[-3000:]
        return text


@pytest.fixture
def dev(settings: Settings, tmp_path: Path) -> Iterator[Running]:
    """`shardflow dev` in its own process with JSON logs, ready (consuming) when yielded."""
    env = environment(settings, SHARDFLOW_LOG_FORMAT="json")
    running = Running(
        ["dev", "--app", "tests.app", "--app", "tests.test_metrics"], env, tmp_path / "dev.log"
    )
    try:
        wait_until(lambda: get(running.port, "/readyz")[0] == 200, 60, "dev ready")
        yield running
    finally:
        if running.process.poll() is None:
            running.process.kill()
            running.process.wait()


async def test_a_running_cluster_exports_what_it_did_over_http(
    settings: Settings, dev: Running
) -> None:
    two_steps = {"steps": [{"task": "add", "args": {"n": 1}}, {"bag": [{"task": "add"}] * 3}]}
    retry = {"max_attempts": 2, "backoff_s": 0.01}
    programs: list[dict[str, Any]] = [
        two_steps,
        two_steps,
        {"steps": [{"task": "flaky", "args": {"fail_until": 1}, "retry": retry}]},
        {"steps": [{"task": "boom"}]},
        {"steps": [{"task": "no.such.task"}]},  # the worker fails it: label "unknown"
        {"steps": [{"task": "metrics.logs", "args": {"name": "cat.jpg"}}]},
        {"steps": [{"task": "item", "pool": "parallel", "args": {"sleep_s": 2.6}}]},
    ]
    async with connected(settings, "test-metrics") as (store, bus):
        router = Router(settings, store=store, bus=bus)
        submitted = [await router.submit(program) for program in programs]
        ended = [await router.wait(s.workflow_id, timeout_s=60) for s in submitted]
        assert [e["status"] for e in ended] == ["completed"] * 3 + ["failed"] * 2 + [
            "completed"
        ] * 2
        # A message no one can read, and two duplicates of a start: one as it is, one as
        # the delivery policy requeues a message after a failure (counted as redelivered).
        await bus.publish_to_shard(0, b"not json")
        first = submitted[0]
        start = encode(Start(wf=first.workflow_id))
        await bus.publish_to_shard(first.shard, start)
        queue = bus.names.shard_queue(first.shard)
        await bus.requeue(queue, start, {"x-shardflow-failures": 1}, None)

    port = dev.port

    dead = bus.names.shard_queue(0)

    def settled() -> Samples | None:
        samples = scrape(port)
        idle = [
            samples.get(("shardflow_programs_in_flight", (("shard", str(shard)),)))
            for shard in range(settings.shards)
        ]
        done = (
            value(samples, "shardflow_duplicates_ignored_total", part="orchestrator") >= 2
            and value(samples, "shardflow_dead_letters_total", queue=dead, cause="refused") >= 1
            and idle == [0] * settings.shards  # counted (5 s apart) after every program ended
        )
        return samples if done else None

    samples = wait_until(settled, 60, "the counters of the last messages")
    assert value(samples, "shardflow_programs_started_total") == 7
    assert value(samples, "shardflow_programs_ended_total", status="completed") == 5
    assert value(samples, "shardflow_programs_ended_total", status="failed") == 2
    assert value(samples, "shardflow_retries_total") == 1
    assert value(samples, "shardflow_duplicates_ignored_total", part="orchestrator") == 2
    assert value(samples, "shardflow_redeliveries_total", queue=queue) == 1
    assert value(samples, "shardflow_republished_total") == 0  # a completed program: stale
    assert value(samples, "shardflow_dead_letters_total", queue=dead, cause="refused") == 1

    tasks = "shardflow_task_duration_seconds_count"
    assert value(samples, tasks, pool="serial", task="add", outcome="completed") == 2
    assert value(samples, tasks, pool="parallel", task="add", outcome="completed") == 6
    assert value(samples, tasks, pool="serial", task="flaky", outcome="failed") == 1
    assert value(samples, tasks, pool="serial", task="flaky", outcome="completed") == 1
    assert value(samples, tasks, pool="serial", task="boom", outcome="failed") == 1
    assert value(samples, tasks, pool="serial", task="unknown", outcome="failed") == 1
    names = {dict(labels).get("task") for (name, labels) in samples if name == tasks}
    assert "no.such.task" not in names, "a task name from a message must not mint a series"
    buckets = "shardflow_task_duration_seconds_bucket"
    inf = value(samples, buckets, pool="parallel", task="add", outcome="completed", le="+Inf")
    assert inf == 6

    steps = "shardflow_step_duration_seconds_count"
    # Every step that ended through its owner: 2 + 1 + 1 + 1 + 1 serial tasks, 2 bags, and
    # the sleeping task, timed on Redis's clock from its dispatch to its owner's advance.
    assert value(samples, steps, pool="serial", kind="task") == 6
    assert value(samples, steps, pool="parallel", kind="task") == 1
    slow = {"pool": "parallel", "kind": "task"}
    assert value(samples, "shardflow_step_duration_seconds_bucket", **slow, le="2.5") == 0
    assert 2.6 <= value(samples, "shardflow_step_duration_seconds_sum", **slow) < 60
    assert value(samples, steps, pool="parallel", kind="bag") == 2
    for pool in ("serial", "parallel"):
        assert value(samples, "shardflow_tasks_running", pool=pool) == 0
    assert value(samples, "shardflow_dependency_up", dependency="redis") == 1
    assert value(samples, "shardflow_dependency_up", dependency="rabbitmq") == 1
    assert ("shardflow_event_loop_lag_seconds", ()) in samples
    assert get(port, "/healthz") == (200, json.dumps({"status": "ok", "faults": []}))

    log = dev.stop()
    lines = [json.loads(line) for line in log.splitlines()]  # every line is one JSON object
    (logged,) = [line for line in lines if line["logger"] == "shop"]
    wf = submitted[5].workflow_id
    assert logged["message"] == "resizing cat.jpg"
    assert logged["level"] == "INFO"
    assert logged["workflow_id"] == wf
    assert (logged["step"], logged["task"], logged["attempt"]) == ("0", "metrics.logs", 0)
    ends = [line for line in lines if line["message"] == f"{wf}: ended completed"]
    assert [(line["workflow_id"], line["step"]) for line in ends] == [(wf, "0")]


def test_the_metrics_port_and_log_format_are_checked(settings: Settings) -> None:
    env = environment(settings)
    bad_port = subprocess.run(
        [sys.executable, "-m", "shardflow", "worker", "--pool", "serial", "--app", "tests.app",
         "--metrics-port", "70000"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad_port.returncode == 2
    assert "'70000': a port from 0 to 65535" in bad_port.stderr
    bad_format = subprocess.run(
        [sys.executable, "-m", "shardflow", "dev"],
        cwd=ROOT, env={**env, "SHARDFLOW_LOG_FORMAT": "xml"}, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert bad_format.returncode == 2
    assert "settings: SHARDFLOW_LOG_FORMAT: Input should be 'text' or 'json'" in bad_format.stderr


# --- the dashboard


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # a collapsed row holds its panels


def test_every_dashboard_query_names_a_metric_the_code_exports() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exported = metrics.names()  # read from the registry, as /metrics serves it
    assert "shardflow_programs_started_total" in exported  # the registry holds ours
    used: set[str] = set()
    graphs = [panel for panel in _panels(dashboard["panels"]) if panel["type"] != "row"]
    assert len(graphs) >= 10
    for panel in graphs:
        exprs = [target["expr"] for target in panel.get("targets", [])]
        assert exprs, f"panel {panel['title']!r} has no query"
        for expr in exprs:
            named = set(re.findall(r"\bshardflow_[a-z0-9_]+", expr))
            assert named, f"panel {panel['title']!r}: {expr!r} names no shardflow metric"
            unknown = named - exported
            assert not unknown, f"panel {panel['title']!r} asks for {unknown}, not exported"
            used |= named
    ours = {family.name for family in _families() if family.name.startswith("shardflow_")}
    shown = {name for name in ours if any(u.startswith(name) for u in used)}
    assert shown == ours, f"metrics on no panel: {sorted(ours - shown)}"


def _families() -> list[Any]:
    from prometheus_client import REGISTRY

    return list(REGISTRY.collect())


def test_every_end_status_is_named_where_programs_ended_is_described() -> None:
    """The help text, the metrics doc and the dashboard list every status a program ends in
    (saga compensation added compensated and compensation_failed)."""
    from orchestrator.store import TERMINAL

    [family] = [f for f in _families() if f.name == "shardflow_programs_ended"]
    doc = Path(__file__).parent.parent / "docs" / "observability.md"
    [row] = [line for line in doc.read_text().splitlines() if "programs_ended_total` |" in line]
    panels = _panels(json.loads(DASHBOARD.read_text())["panels"])
    [shown] = [p for p in panels if "programs_ended_total" in json.dumps(p.get("targets"))]
    for where, text in (("help", family.documentation), ("doc", row), ("panel", shown)):
        missing = [s for s in sorted(TERMINAL) if s not in str(text)]
        assert not missing, f"{where} names no {missing}"


def test_every_metric_is_in_the_metrics_doc() -> None:
    """docs/observability.md's table names every metric shardflow serves (one was missing)."""
    doc = (Path(__file__).parent.parent / "docs" / "observability.md").read_text()
    # A counter's family drops the `_total` its samples carry.
    served = [
        f"{f.name}_total" if f.type == "counter" else f.name
        for f in _families()
        if f.name.startswith("shardflow_")
    ]
    missing = [name for name in served if f"| `{name}` |" not in doc]
    assert len(served) > 10 and not missing, missing


def test_durations_have_buckets_up_to_the_longest_a_step_may_wait() -> None:
    """A day's task and a 30-day sleep each fall in a bucket of their own size, not in +Inf
    (the buckets stopped at an hour: every quantile above read 3,600 s)."""
    from orchestrator.program import MAX_SLEEP_S, Task

    longest_task = Task.model_fields["timeout_s"].metadata
    [task_cap] = [m.le for m in longest_task if getattr(m, "le", None) is not None]
    for histogram in (metrics.STEP_DURATION, metrics.TASK_DURATION):
        bounds = histogram._upper_bounds  # the buckets, +Inf last
        assert bounds[-2] >= MAX_SLEEP_S and task_cap in bounds, bounds
        # a day's task lands at a day, not at the bucket below +Inf
        assert next(b for b in bounds if b >= 86400 * 0.9) == 86400


async def test_maps_over_no_items_take_no_pool_label_from_a_pool_that_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Maps over [] naming junk pools end without a worker: their pools take none of the
    MAX_POOL_LABELS labels, so a pool whose task then runs has its own."""
    from prometheus_client import REGISTRY

    from orchestrator.keys import Keys
    from orchestrator.memory_store import MemoryStore
    from orchestrator.messages import Next, decode_shard_message
    from orchestrator.plans import Plans
    from orchestrator.program import parse_program
    from orchestrator.shares import share_of
    from orchestrator.transitions import Transitions
    from tests.test_owner_steps import Recorder

    monkeypatch.setattr(metrics, "_pool_labels", {"serial", "parallel", "timer"})
    store = MemoryStore(Keys("labels"))
    bus = Recorder()
    transitions = Transitions(store, bus, Plans(store, 8))
    router = Router(Settings(prefix="labels", shards=1), store=store, bus=bus)
    for i in range(metrics.MAX_POOL_LABELS - 1):
        program = {"steps": [{"map": "[]", "task": "ok", "pool": f"junk{i}", "max_items": 1}]}
        wf = (await router.submit(program, None, f"junk-{i}")).workflow_id
        while bus.shard:  # its start, then the owner's own `next` of the empty map
            message = decode_shard_message(bus.shard.pop(0))
            await transitions.apply(message, redelivered=False, shard=0)
        assert (await store.state(wf))["status"] == "completed"
    assert not bus.tasks  # no task of theirs was ever published

    def timed(pool: str, kind: str) -> float:
        labels = {"pool": pool, "kind": kind}
        return REGISTRY.get_sample_value("shardflow_step_duration_seconds_count", labels) or 0

    # A pool of maps only (its steps' reports are the owner's own `next`) and a pool of tasks,
    # named so that its tasks go to a share's queue (`thumbs.<k>`): the pool is labelled.
    before = timed("thumbs", "map"), timed("reports", "task")
    program = {"steps": [{"map": "[1]", "task": "ok", "pool": "thumbs", "max_items": 1}]}
    steps = [program["steps"][0], {"task": "ok", "pool": "reports"}]
    name = next(
        name
        for name in (f"kind{k}" for k in range(100))
        if share_of(parse_program({"name": name, "steps": steps}))
    )
    await router.submit({"name": name, "steps": steps})
    [wf] = {decode_shard_message(body).wf for body in bus.shard}
    await transitions.apply(decode_shard_message(bus.shard.pop()), redelivered=False, shard=0)
    assert len(bus.tasks) == 1  # the map's item, published to "thumbs"; its worker's report:
    assert (await store.record(wf, "0", 1, {0: "1"})).verdict == "fire"
    await transitions.apply(Next(wf=wf, path="0", stored=True), redelivered=False, shard=0)
    assert len(bus.tasks) == 2  # the task, published to "reports"; its worker's report:
    await transitions.apply(Next(wf=wf, path="1", output=1), redelivered=False, shard=0)
    assert (await store.state(wf))["status"] == "completed"
    assert (timed("thumbs", "map"), timed("reports", "task")) == (before[0] + 1, before[1] + 1)
    assert not {f"junk{i}" for i in range(metrics.MAX_POOL_LABELS)} & metrics._pool_labels
    assert not [label for label in metrics._pool_labels if "." in label]  # no share's queue
