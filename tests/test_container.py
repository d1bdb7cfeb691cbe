"""The image: built from the Dockerfile with podman, and the demo's program run in containers.

The containers run the chart's processes (an orchestrator, a serial and a parallel worker, and
`submit --wait`) on the host's network against the local RabbitMQ and Redis, as the image's
non-root user, on a read-only root filesystem with a tmpfs /tmp and no capabilities. No
registry is reachable: scripts/podman.sh makes the base image from Debian's packages once.
Skips when podman cannot work here; fails instead when CI is set.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

pytestmark = [pytest.mark.container, pytest.mark.timeout(1500)]

ROOT = Path(__file__).resolve().parent.parent
IMAGE = "localhost/shardflow:test"
DEMO_IMAGE = "localhost/shardflow-demo:test"
UID = "10001"
# What `bash scripts/demo.sh` prints for this input (examples/tasks.py: ready on the 3rd poll).
DEMO_INPUT = '{"album": "holiday"}'
DEMO_RESULT = {"published": "holiday", "after_polls": 3}


def _unusable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


@dataclass
class Podman:
    """`podman --runtime runc` with our containers.conf; remembers the containers it made."""

    env: dict[str, str]
    base: str
    made: list[str] = field(default_factory=list)

    def __call__(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["podman", "--runtime", "runc", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def ok(self, *args: str, timeout: float = 120) -> str:
        result = self(*args, timeout=timeout)
        assert result.returncode == 0, f"podman {' '.join(args)}:\n{result.stderr[-3000:]}"
        return result.stdout


@pytest.fixture(scope="module")
def podman() -> Podman:
    """podman set up by scripts/podman.sh (without installing anything), with its base image."""
    if shutil.which("podman") is None:
        _unusable("no podman: run scripts/podman.sh (Debian's podman, runc and debootstrap)")
    prepared = subprocess.run(
        ["bash", str(ROOT / "scripts" / "podman.sh")],
        env={**os.environ, "SHARDFLOW_PODMAN_NO_INSTALL": "1"},
        capture_output=True,
        text=True,
        timeout=1200,
    )
    if prepared.returncode != 0:
        _unusable(f"scripts/podman.sh could not prepare podman: {prepared.stderr[-1500:]}")
    told = dict(line.split("=", 1) for line in prepared.stdout.splitlines() if "=" in line)
    podman = Podman(
        {**os.environ, "CONTAINERS_CONF": told["CONTAINERS_CONF"]}, told["SHARDFLOW_BASE_IMAGE"]
    )
    smoke = podman("run", "--rm", "--network", "host", podman.base, "true")
    if smoke.returncode != 0:
        _unusable(f"podman cannot run a container here: {smoke.stderr[-1500:]}")
    return podman


@pytest.fixture(scope="module")
def image(podman: Podman) -> str:
    """The Dockerfile's image on the local base, and a test image adding examples/ to /app."""
    podman.ok(
        "build",
        "--network", "host",
        "--build-arg", f"BASE={podman.base}",
        "--tag", IMAGE,
        "--file", str(ROOT / "Dockerfile"),
        str(ROOT),
        timeout=900,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as context:
        shutil.copytree(ROOT / "examples", Path(context) / "examples")
        (Path(context) / "Containerfile").write_text(f"FROM {IMAGE}\nCOPY examples /app/examples\n")
        podman.ok("build", "--tag", DEMO_IMAGE, context, timeout=300)
    return DEMO_IMAGE


@pytest.fixture
def containers(podman: Podman) -> Iterator[Podman]:
    """Every container a test makes is removed after it, passed or failed."""
    yield podman
    if podman.made:
        podman("rm", "--force", "--ignore", "--time", "0", *podman.made)
        podman.made.clear()


def test_the_image_runs_the_demo_program_as_non_root_on_a_read_only_root(
    image: str, containers: Podman, amqp_url: str, redis_url: str
) -> None:
    podman = containers
    prefix = f"ct{uuid.uuid4().hex[:10]}"
    name = f"shardflow-{prefix}"
    env = {
        "SHARDFLOW_AMQP_URL": amqp_url,
        "SHARDFLOW_REDIS_URL": redis_url,
        "SHARDFLOW_PREFIX": prefix,
        "SHARDFLOW_SHARDS": "2",
        "SHARDFLOW_GRACE_S": "2",
        "SHARDFLOW_STARTUP_WAIT_S": "30",
    }
    # What a restricted pod gets: no root, no writable root filesystem, no capabilities.
    hardened = [
        "--network", "host",
        "--read-only",
        "--tmpfs", "/tmp:rw,size=16m",
        "--cap-drop", "ALL",
        "--security-opt", "no-new-privileges",
        *[arg for key, value in env.items() for arg in ("--env", f"{key}={value}")],
    ]  # fmt: skip
    processes = {
        "orchestrator": ["orchestrator", "--shards", "0,1"],
        "serial": ["worker", "--pool", "serial", "--app", "examples.tasks"],
        "parallel": ["worker", "--pool", "parallel", "--app", "examples.tasks"],
    }
    try:
        for role, args in processes.items():
            podman.made.append(f"{name}-{role}")
            podman.ok("run", "--detach", "--name", f"{name}-{role}", *hardened, image, *args)
        podman.made.append(f"{name}-submit")
        submitted = podman(
            "run", "--name", f"{name}-submit", *hardened, image,
            "submit", "examples/thumbnails.json", "--input", DEMO_INPUT,
            "--wait", "--timeout", "60",
            timeout=120,
        )  # fmt: skip
        assert submitted.returncode == 0, submitted.stderr + _logs(podman, name, processes)
        assert json.loads(submitted.stdout) == DEMO_RESULT

        for role in processes:
            user = podman.ok("exec", f"{name}-{role}", "id", "-u").strip()
            assert user == UID, f"{role} runs as {user}, not the image's user {UID}"
        # The chart's `helm test` pod runs this script in the image: both shards have a consumer.
        check = (ROOT / "helm" / "shardflow" / "files" / "check_shards.py").read_text()
        podman.made.append(f"{name}-helm-test")
        checked = podman(
            "run", "--name", f"{name}-helm-test", *hardened, "--env", "SHARDFLOW_TEST_WAIT_S=20",
            "--entrypoint", "python3", image, "-c", check,
        )  # fmt: skip
        assert checked.returncode == 0, checked.stdout + checked.stderr
        assert "every one of the 2 shards has a consumer" in checked.stdout

        # The demo ran with nothing writable but /tmp: a write elsewhere is refused.
        probe = podman("exec", f"{name}-orchestrator", "touch", "/app/probe")
        assert probe.returncode != 0 and "Read-only file system" in probe.stderr, probe

        # As a kubelet stops a pod: SIGTERM to PID 1, which must finish cleanly on its own.
        podman.ok("stop", "--time", "20", *[f"{name}-{role}" for role in processes], timeout=60)
        for role in processes:
            code = podman.ok("inspect", "--format", "{{.State.ExitCode}}", f"{name}-{role}")
            assert code.strip() == "0", f"{role} exited {code.strip()} on SIGTERM" + _logs(
                podman, name, processes
            )
    finally:
        _drop_keys(redis_url, prefix)


def test_the_image_is_built_as_documented(image: str, containers: Podman) -> None:
    config = json.loads(containers.ok("image", "inspect", IMAGE))[0]["Config"]
    assert config["User"] == f"{UID}:{UID}"
    assert config["Entrypoint"] == ["shardflow"]
    assert "PYTHONDONTWRITEBYTECODE=1" in config["Env"]
    # The wheel holds the Lua scripts, without which no transition can run.
    containers.made.append(name := f"shardflow-lua-{uuid.uuid4().hex[:8]}")
    listed = containers.ok(
        "run", "--name", name, "--read-only", "--entrypoint", "python3", IMAGE,
        "-c", "import importlib.resources as r; print(sorted(p.name for p in "
        "r.files('lua').iterdir() if p.name.endswith('.lua')))",
    )  # fmt: skip
    assert "advance.lua" in listed


def _logs(podman: Podman, name: str, processes: dict[str, list[str]]) -> str:
    return "".join(
        f"\n--- {role}:\n{podman('logs', f'{name}-{role}').stderr[-2000:]}" for role in processes
    )


def _drop_keys(redis_url: str, prefix: str) -> None:
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        for start in range(0, len(keys), 500):
            client.delete(*keys[start : start + 500])
    finally:
        client.close()
