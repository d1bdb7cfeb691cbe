"""Render-then-run: the chart as a cluster would run it, on this machine.

`helm template` renders the chart; every replica of every rendered Deployment runs as a local
process with exactly its pod's command, args and environment (the rendered ConfigMap and
Secret), from shardflow's wheel installed in a venv of its own, started, probed, restarted and
stopped as a kubelet and the Deployment controller would (tests/kubelet.py). On one prefix,
while programs arrive on the ingress queue: install with 2 shards, kill -9 each shard's active
owner, `helm upgrade` to 4 shards, shrink to 2 with `drainShards`, wait until `shardflow
shards` reports the drained shards removable, and drop them. Every program submitted along the
way must complete with its own result. docs/kubernetes.md says what this cannot show.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aio_pika
import pytest
from redis.asyncio import Redis

from orchestrator.connections import connected
from orchestrator.keys import Keys, Names
from orchestrator.redis_store import RedisStore
from orchestrator.settings import Settings
from orchestrator.store import TERMINAL
from router.client import Router
from router.hashing import shard_for
from tests.kubelet import Cluster, Image, Pod, hook

yaml = pytest.importorskip("yaml")

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "shardflow"
HELM = os.environ.get("SHARDFLOW_HELM") or shutil.which("helm") or str(ROOT / ".tools" / "helm")
RELEASE = "rr"
NAMESPACE = "flows"
# The demo's program and tasks (examples/): `app: [tasks]` is the chart's default, and
# helm/README.md's way to add one module: `COPY tasks.py /app/`.
PROGRAM = json.loads((ROOT / "examples" / "thumbnails.json").read_text())
SUBMIT_EVERY_S = 0.15
# A second task module in the image: a task that holds its program in flight until the test
# opens the gate, so the draining shards deterministically still hold programs after the shrink.
GATE_MODULE = '''"""Holds a program in flight until a Redis key exists."""
import asyncio

from redis.asyncio import Redis

from worker import TaskContext, task


@task()
async def hold(ctx: TaskContext) -> str:
    client = Redis.from_url(ctx.input["gate"]["url"])
    try:
        while not await client.exists(ctx.input["gate"]["key"]):
            await asyncio.sleep(0.1)
    finally:
        await client.aclose()
    return "opened"
'''

if not Path(HELM).exists():
    if os.environ.get("CI"):
        raise RuntimeError(f"no helm at {HELM}: run scripts/helm.sh")
    pytest.skip("no helm binary: run scripts/helm.sh", allow_module_level=True)


def expected(album: str) -> dict[str, Any]:
    return {"published": album, "after_polls": 3}  # examples/tasks.py: ready on the 3rd poll


def held(wf: str) -> dict[str, Any]:
    """A program that waits at the gate, then runs one more step (the owner dispatches it)."""
    return {"name": "held", "steps": [{"task": "hold", "pool": "parallel"},
                                      {"task": "fetch", "args": {"url": wf}}]}  # fmt: skip


@pytest.fixture(scope="session")
def shardflow_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """shardflow's wheel, built from this tree, installed with its dependencies in a new venv."""
    where = tmp_path_factory.mktemp("wheel")
    for argv in (
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(where), str(ROOT)],
        [sys.executable, "-m", "venv", str(where / "venv")],
    ):
        done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = where.glob("shardflow-*.whl")
    pip = [str(where / "venv" / "bin" / "python"), "-m", "pip", "install", "-q", str(wheel)]
    done = subprocess.run(pip, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return where / "venv"


@pytest.fixture
def cluster(shardflow_venv: Path, tmp_path: Path) -> Iterator[Cluster]:
    app = tmp_path / "app"  # the image's WORKDIR: the task module only, never this repository
    app.mkdir()
    shutil.copy(ROOT / "examples" / "tasks.py", app / "tasks.py")
    shutil.copy(ROOT / "examples" / "thumbnails.json", app / "program.json")
    (app / "gate.py").write_text(GATE_MODULE)
    image = Image.from_dockerfile(ROOT / "Dockerfile")
    assert "/opt/shardflow/bin" in image.env["PATH"], "the image's venv moved: follow it here"
    cluster = Cluster(
        image, install_root=("/opt/shardflow", shardflow_venv), workdir=app, logs=tmp_path
    )
    try:
        yield cluster
    finally:
        cluster.kill_all()


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("0.0.0.0", 0))
        return int(probe.getsockname()[1])


def chart_values(settings: Settings, port: int, **changes: Any) -> dict[str, Any]:
    """The release's values: this test's RabbitMQ vhost, Redis and prefix."""
    return {
        "prefix": settings.prefix,
        "connection": {"amqpUrl": settings.amqp_url, "redisUrl": settings.redis_url},
        "app": ["tasks", "gate"],
        "gracePeriodSeconds": 3,
        "metrics": {"port": port},  # one free port, in every pod (each has its own address)
        **changes,
    }


def render(values: dict[str, Any], directory: Path) -> list[dict[str, Any]]:
    path = directory / f"values-{time.monotonic_ns()}.yaml"
    path.write_text(yaml.safe_dump(values))
    argv = [HELM, "template", RELEASE, str(CHART), "-n", NAMESPACE, "-f", str(path)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


async def helm_test(cluster: Cluster, documents: list[dict[str, Any]]) -> str:
    """`helm test`: the chart's test pod, run to its end; it must pass."""
    (pod,) = [doc for doc in documents if hook(doc) == "test"]
    code, output = await cluster.run_hook(pod)
    assert code == 0, output
    return output


async def shards(cluster: Cluster) -> dict[int, dict[str, Any]]:
    """`kubectl exec deploy/<release>-worker-parallel -- shardflow shards`."""
    code, out, err = await cluster.exec(f"{RELEASE}-worker-parallel", "shardflow", "shards")
    assert code == 0, err
    return {line["shard"]: line for line in map(json.loads, out.splitlines())}


class Submitter:
    """A client of the release: submit requests on the ingress queue, for the router pods."""

    def __init__(self, channel: aio_pika.abc.AbstractChannel, queue: str) -> None:
        self.channel = channel
        self.queue = queue
        self.ids: list[str] = []  # the demo's programs, submitted every SUBMIT_EVERY_S

    @classmethod
    @contextlib.asynccontextmanager
    async def running(cls, settings: Settings) -> AsyncIterator[Submitter]:
        connection = await aio_pika.connect(settings.amqp_url)
        try:
            channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
            submitter = cls(channel, Names(settings.prefix).ingress_queue)
            every = asyncio.create_task(submitter._every())
            try:
                yield submitter
            finally:
                every.cancel()
                await asyncio.gather(every, return_exceptions=True)
                if not every.cancelled() and every.exception() is not None:
                    raise every.exception()  # type: ignore[misc]
        finally:
            await connection.close()

    async def submit(self, wf: str, program: dict[str, Any], given: Any) -> None:
        body = {"program": program, "input": given, "workflow_id": wf}
        message = aio_pika.Message(
            json.dumps(body).encode(),
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            content_type="application/json",
        )
        # Confirmed and routed (mandatory), or this raises: the broker has the request.
        await self.channel.default_exchange.publish(message, self.queue, mandatory=True)

    async def _every(self) -> None:
        while True:
            wf = f"rr-{len(self.ids):04d}"
            await self.submit(wf, PROGRAM, {"album": wf})
            self.ids.append(wf)
            await asyncio.sleep(SUBMIT_EVERY_S)


async def active_owner(cluster: Cluster, redis: Redis, prefix: str, shard: int) -> Pod:
    """The pod whose process handles the shard's messages now (its owner mark names its pid,
    written on the messages it handles)."""
    deadline = time.monotonic() + 60
    while True:
        mark = await redis.get(Keys(prefix).shard_owner(shard))
        if mark:
            pid = int(str(mark).split()[0].rsplit("/", 1)[1])
            pod = cluster.pod_with_pid(pid)
            if pod is not None and pod.owner == f"{RELEASE}-orchestrator-{shard}":
                return pod
        assert time.monotonic() < deadline, f"no owner of shard {shard}:\n{cluster.report()}"
        await asyncio.sleep(0.05)


async def owner_other_than(
    cluster: Cluster, redis: Redis, prefix: str, shard: int, pid: int
) -> Pod:
    deadline = time.monotonic() + 60
    while True:
        pod = await active_owner(cluster, redis, prefix, shard)
        if pod.pid != pid:
            return pod
        assert time.monotonic() < deadline, f"shard {shard} was not taken over"
        await asyncio.sleep(0.05)


async def owners(router: Router, ids: list[str]) -> set[int]:
    found = set()
    for wf in ids:
        state = await router.store.state(wf)
        if state:
            found.add(int(state["owner"]))
    return found


async def wait_running(router: Router, ids: list[str]) -> None:
    """Until each program was submitted by a router and started by its owner."""
    deadline = time.monotonic() + 60
    for wf in ids:
        while True:
            state = await router.store.state(wf)
            if state and state["status"] == "running":
                break
            assert time.monotonic() < deadline, f"{wf} did not start: {state}"
            await asyncio.sleep(0.1)


async def wait_all(router: Router, ids: list[str], timeout_s: float) -> dict[str, dict[str, Any]]:
    """Every program's final status (a request may still wait in the ingress queue)."""
    deadline = time.monotonic() + timeout_s
    statuses: dict[str, dict[str, Any]] = {}
    for wf in ids:
        while True:
            state = await router.store.state(wf)
            if state and state["status"] in TERMINAL:
                status = await router.status(wf)
                assert status is not None
                statuses[wf] = status
                break
            assert time.monotonic() < deadline, f"{wf} did not end: {state}"
            await asyncio.sleep(0.1)
    return statuses


async def test_the_rendered_chart_installs_fails_over_grows_and_shrinks(
    settings: Settings, cluster: Cluster, tmp_path: Path
) -> None:
    port = free_port()
    phases: list[tuple[str, float]] = []
    began = time.monotonic()

    def phase(name: str) -> None:
        phases.append((name, time.monotonic() - began))

    # The pods run shardflow from the wheel, not from this repository.
    two = render(chart_values(settings, port, shards=2), tmp_path)
    await cluster.apply(two)
    phase("install with 2 shards")
    assert "every one of the 2 shards has a consumer" in await helm_test(cluster, two)
    code, where, _ = await cluster.exec(
        f"{RELEASE}-worker-parallel", "python3", "-c", "import shardflow; print(shardflow.__file__)"
    )
    assert code == 0 and where.startswith(str(cluster.install_root[1])), where

    redis = Redis.from_url(settings.redis_url, decode_responses=True)
    store = RedisStore.connect(settings)
    router = Router(settings, store=store)
    cli: list[asyncio.Task[tuple[int, str, str]]] = []

    def submit_with_the_cli(album: str) -> None:
        """`kubectl exec deploy/...-worker-parallel -- shardflow submit ... --wait`."""
        argv = ["shardflow", "submit", "program.json", "--input", json.dumps({"album": album}),
                "--id", album, "--wait", "--timeout", "300"]  # fmt: skip
        running = cluster.exec(f"{RELEASE}-worker-parallel", *argv, timeout_s=400)
        cli.append(asyncio.create_task(running))

    try:
        async with Submitter.running(settings) as submitter:
            submit_with_the_cli("cli-install")

            # kill -9 of each shard's active owner: its standby takes over, and the kubelet
            # starts the killed container again (it comes back as the standby).
            killed: list[Pod] = []
            for shard in (0, 1):
                owner = await active_owner(cluster, redis, settings.prefix, shard)
                assert owner.pid is not None
                at = time.monotonic()
                os.kill(owner.pid, signal.SIGKILL)
                successor = await owner_other_than(
                    cluster, redis, settings.prefix, shard, owner.pid
                )
                took_ms = 1000 * (time.monotonic() - at)
                print(f"\nrender-run: shard {shard}: {successor.name} took over from "
                      f"{owner.name} {took_ms:.0f} ms after kill -9")  # fmt: skip
                assert successor.owner == owner.owner and successor is not owner
                killed.append(owner)
                await cluster.wait_restarted(owner)
            phase("kill -9 of each shard's owner")

            # helm upgrade --set shards=4: every pod template changes (the config checksum).
            four = render(chart_values(settings, port, shards=4), tmp_path)
            await cluster.apply(four)
            phase("upgrade to 4 shards")
            assert "every one of the 4 shards has a consumer" in await helm_test(cluster, four)
            submit_with_the_cli("cli-four")
            grown_from = len(submitter.ids)
            deadline = time.monotonic() + 120
            while not {2, 3} <= await owners(router, submitter.ids[grown_from:]):
                assert time.monotonic() < deadline, "no program reached shards 2 and 3"
                await asyncio.sleep(0.2)

            # Two programs on each of shards 2 and 3 wait at the gate through the shrink.
            gate = {"url": settings.redis_url, "key": f"{settings.prefix}:gate"}
            candidates = [f"held-{k}" for k in range(100)]
            holding = [wf for wf in candidates if shard_for(wf, 4) == 2][:2]
            holding += [wf for wf in candidates if shard_for(wf, 4) == 3][:2]
            for wf in holding:
                await submitter.submit(wf, held(wf), {"gate": gate})
            await wait_running(router, holding)

            # helm upgrade --set shards=2 --set 'drainShards={2,3}'
            drained = render(chart_values(settings, port, shards=2, drainShards=[2, 3]), tmp_path)
            await cluster.apply(drained)
            await cluster.settle()  # the 4-shard orchestrators are gone
            phase("shrink to 2, draining 2 and 3")
            await helm_test(cluster, drained)
            draining = [p for s in (2, 3) for p in cluster.pods(f"{RELEASE}-orchestrator-{s}")]
            report = await shards(cluster)
            assert [report[s]["state"] for s in (2, 3)] == ["draining", "draining"], report
            shrunk_from = len(submitter.ids)
            submit_with_the_cli("cli-shrunk")
            await asyncio.sleep(3)  # programs keep arriving on the shrunk ring
            await redis.set(gate["key"], "open")
        submitted = list(submitter.ids)

        # Watch `shardflow shards` until the drained shards are removable, then drop them.
        deadline = time.monotonic() + 240
        while True:
            report = await shards(cluster)
            if all(report.get(s, {}).get("state") == "removable" for s in (2, 3)):
                break
            assert time.monotonic() < deadline, report
            await asyncio.sleep(1)
        phase("shards 2 and 3 removable")
        final = render(chart_values(settings, port, shards=2, drainShards=[]), tmp_path)
        await cluster.apply(final)
        await cluster.settle()
        phase("drained shards dropped")
        assert "every one of the 2 shards has a consumer" in await helm_test(cluster, final)
        assert sorted(cluster.deployments) == sorted(
            d["metadata"]["name"] for d in final if d["kind"] == "Deployment"
        )
        assert f"{RELEASE}-orchestrator-2" not in cluster.deployments

        statuses = await wait_all(router, submitted, timeout_s=240)
        ended_held = await wait_all(router, holding, timeout_s=60)
        by_cli = [await asyncio.wait_for(task, 400) for task in cli]
        code, dead, _ = await cluster.exec(f"{RELEASE}-worker-parallel", "shardflow", "dead")
        assert code == 0
        # An OOM kill would be a restart in a cluster: each process's peak resident memory
        # (after every phase and the load above) stays under its container's limit.
        memory = {p.name: p.memory() for d in cluster.deployments.values() for p in d.pods}
        assert not {name: m for name, m in memory.items() if m[0] >= m[1]}, memory
        peak_mib = max(peak for peak, _ in memory.values()) / 2**20
        await cluster.uninstall()
        phase("uninstall")
    finally:
        await redis.aclose()
        await store.close()

    # Every program submitted along the way completed, with its own result.
    wrong = {wf: s for wf, s in statuses.items()
             if (s["status"], s["result"]) != ("completed", expected(wf))}  # fmt: skip
    assert not wrong, list(wrong.items())[:3]
    for code, _, err in by_cli:
        assert code == 0, err
    assert [json.loads(out) for _, out, _ in by_cli] == [
        expected(album) for album in ("cli-install", "cli-four", "cli-shrunk")
    ]
    assert dead == "", dead  # nothing was refused or dead-lettered
    # The held programs ended on their shards, finished there by the draining orchestrators.
    assert {wf: (s["status"], s["owner"], s["result"]) for wf, s in ended_held.items()} == {
        wf: ("completed", shard_for(wf, 4), {"url": wf, "bytes": 1024 * len(wf)}) for wf in holding
    }
    # Once every router ran with 2 shards, new programs went to shards 0 and 1 only.
    assert owners_of(statuses, submitted[shrunk_from:]) <= {0, 1}
    assert owners_of(statuses, submitted[grown_from:shrunk_from]) >= {2, 3}
    # No container crashed or failed a probe: only the two killed ones restarted, once each.
    restarted = {pod.name: pod.exits for pod in cluster.every_pod if pod.exits}
    assert restarted == {pod.name: [-signal.SIGKILL] for pod in killed}, restarted
    assert not [pod.name for pod in cluster.every_pod if pod.liveness_kills]
    # Every pod stopped on SIGTERM within its grace period, with exit code 0.
    assert len(cluster.stops) == len(cluster.every_pod)
    assert [s for s in cluster.stops if s.code != 0 or s.killed] == []
    logs = {pod.name: pod.log.read_text() for pod in cluster.every_pod}
    assert not [name for name, text in logs.items() if "Traceback" in text or " ERROR " in text]
    drain_logs = "".join(logs[pod.name] for pod in draining)
    assert all(f"{wf}: ended completed" in drain_logs for wf in holding), drain_logs[-3000:]
    applied = sum(int(n) for n in re.findall(r"applied (\d+)", drain_logs))
    phases_text = ", ".join(f"{name} at {at:.0f}s" for name, at in phases)
    print(f"\nrender-run: {len(submitted)} programs over the ingress and 3 with the CLI, "
          f"{len(cluster.every_pod)} pods, {len(cluster.stops)} stopped with SIGTERM, "
          f"{applied} transitions applied by the draining orchestrators, "
          f"peak resident memory of a pod {peak_mib:.0f} MiB; "
          f"{phases_text}; not run here: {sorted(cluster.ignored)}")  # fmt: skip


def owners_of(statuses: dict[str, dict[str, Any]], ids: list[str]) -> set[int]:
    return {int(statuses[wf]["owner"]) for wf in ids}


async def test_a_draining_shard_that_never_held_a_program_stays_up_and_ready(
    settings: Settings, cluster: Cluster, tmp_path: Path
) -> None:
    """drainShards naming a shard that was in the ring but never got a program: its pods must
    not crash-loop (a Deployment restarts a container that exits, even with 0). They stay up,
    consuming the empty queue (ready), and log that the shard can leave drainShards."""
    async with connected(settings.model_copy(update={"shards": 3}), "ring-of-3"):
        pass  # every process of a 3-shard ring declares shard 2's queue
    documents = render(chart_values(settings, free_port(), shards=2, drainShards=[2]), tmp_path)
    only = [d for d in documents if d["metadata"]["name"] == f"{RELEASE}-orchestrator-2"
            or d["kind"] in ("ConfigMap", "Secret")]  # fmt: skip
    await cluster.apply(only, timeout_s=60)  # returns once both pods are ready
    pods = cluster.pods(f"{RELEASE}-orchestrator-2")
    assert len(pods) == 2 and all(pod.ready for pod in pods)
    for pod in pods:
        assert "shards [2] left the ring and never held a program: nothing to drain; remove " \
            "them from drainShards" in pod.log.read_text()  # fmt: skip
    await cluster.uninstall()
    assert [pod.exits for pod in pods] == [[], []]
    assert [(s.code, s.killed) for s in cluster.stops] == [(0, False), (0, False)]
