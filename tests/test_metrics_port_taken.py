"""A metrics port that is taken: the process says so once, naming the port, and runs on without
the endpoint (docs/observability.md); its consumers start once, as with a free port."""

from __future__ import annotations

import logging
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.connections import connected
from orchestrator.health import serving
from orchestrator.settings import Settings
from tests.test_metrics import ROOT, environment


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port another socket listens on, on 127.0.0.1 (as a second process on a host would)."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield int(holder.getsockname()[1])


class _Idle:
    consuming = False


async def test_serving_on_a_taken_port_yields_none_and_chains_nothing(
    settings: Settings, taken_port: int, caplog: pytest.LogCaptureFixture
) -> None:
    settings = settings.model_copy(update={"metrics_port": taken_port, "metrics_addr": "127.0.0.1"})
    caplog.set_level(logging.ERROR, logger="orchestrator.health")
    async with connected(settings, "test-port-taken") as (store, bus):
        with pytest.raises(RuntimeError) as raised:
            async with serving(settings, store, bus, _Idle()) as health:
                assert health is None
                raise RuntimeError("the service failed")
    # The block's own error, not one "during handling of" the bind's OSError.
    assert raised.value.__context__ is None
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and f"127.0.0.1:{taken_port}" in errors[0], errors
    assert "running on without them" in errors[0] and "a free port" in errors[0], errors


def test_a_worker_whose_metrics_port_is_taken_runs_on_and_consumes_once(
    settings: Settings, taken_port: int, tmp_path: Path
) -> None:
    # The orchestrator and the router take the same path (cli._serve, health.serving).
    args = ["worker", "--pool", "parallel", "--app", "examples.tasks"]
    consuming = r"worker\[parallel\]: consuming"
    log = tmp_path / "process.log"
    env = environment(settings, SHARDFLOW_METRICS_ADDR="127.0.0.1")
    with log.open("w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "shardflow", *args, "--metrics-port", str(taken_port)],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=stderr,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not re.search(consuming, log.read_text(), re.M):
            assert process.poll() is None, log.read_text()  # it runs on: no exit
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        time.sleep(0.5)  # a second start (a retry after the bind's error) would show by now
        assert process.poll() is None, log.read_text()
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    text = log.read_text()
    assert process.returncode == 0, text
    errors = [line for line in text.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and f"127.0.0.1:{taken_port}" in errors[0], text
    assert len(re.findall(consuming, text, re.M)) == 1, text
