"""Private RabbitMQ and Redis instances on free loopback ports, for tests that kill them.

The shared services are never restarted: a fault test starts its own and stops them after.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_for_port(port: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {seconds}s")


class PrivateRedis:
    """redis-server with AOF (appendfsync always), so a kill -9 loses nothing acknowledged."""

    def __init__(self, *args: str) -> None:
        """`args`: more redis-server options (`--requirepass`, `pw`)."""
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="sf-redis-"))
        self.args = args
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--dir",
             str(self.dir), "--appendonly", "yes", "--appendfsync", "always", "--save", "",
             *self.args],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        wait_for_port(self.port, 20)

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def restart(self) -> None:
        self.kill()
        self.start()

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


class PrivateRabbit:
    """A RabbitMQ node of its own (about 5 s to start); folders owned by the rabbitmq user."""

    def __init__(self, conf: str = "", advanced: str = "") -> None:
        """`conf`: rabbitmq.conf lines; `advanced`: an advanced.config term (`[...].`)."""
        self.port = free_port()
        self.dist_port = free_port()
        self.node = f"sftest{uuid.uuid4().hex[:6]}@localhost"
        self.dir = Path(tempfile.mkdtemp(prefix="sf-rabbit-"))
        for sub in ("mnesia", "log"):
            (self.dir / sub).mkdir()
        (self.dir / "enabled_plugins").write_text("[].\n")
        (self.dir / "advanced.config").write_text(advanced or "[].\n")
        if conf:
            (self.dir / "rabbitmq.conf").write_text(conf)
        if os.geteuid() == 0:
            user = pwd.getpwnam("rabbitmq")
            for path in [self.dir, *self.dir.rglob("*")]:
                os.chown(path, user.pw_uid, user.pw_gid)

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/"

    def _env(self) -> dict[str, str]:
        return {
            **os.environ,
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": str(self.dir / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.dir / "log"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.dir / "enabled_plugins"),
            "RABBITMQ_CONFIG_FILE": str(self.dir / "rabbitmq"),  # none: defaults only
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(self.dir / "advanced.config"),
        }

    def start(self) -> None:
        subprocess.run(["rabbitmq-server", "-detached"], env=self._env(), check=True)
        wait_for_port(self.port, 60)

    def stop(self) -> None:
        subprocess.run(
            ["rabbitmqctl", "-n", self.node, "stop"], env=self._env(), capture_output=True,
            timeout=60,
        )  # fmt: skip

    def restart(self) -> None:
        self.stop()
        self.start()

    def ctl(self, *args: str) -> str:
        """`rabbitmqctl -n <this node> args...`; its output."""
        return subprocess.run(
            ["rabbitmqctl", "-q", "-n", self.node, *args], env=self._env(), capture_output=True,
            text=True, check=True, timeout=60,
        ).stdout  # fmt: skip

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class PrivateRedisCluster:
    """Three redis-server masters in cluster mode, joined with `redis-cli --cluster create`."""

    def __init__(self, masters: int = 3) -> None:
        self.ports = [free_port() for _ in range(masters)]
        self.bus_ports = [free_port() for _ in range(masters)]
        self.dir = Path(tempfile.mkdtemp(prefix="sf-cluster-"))
        self.processes: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def start(self) -> None:
        for port, bus_port in zip(self.ports, self.bus_ports, strict=True):
            node_dir = self.dir / str(port)
            node_dir.mkdir()
            self.processes.append(
                subprocess.Popen(
                    ["redis-server", "--bind", "127.0.0.1", "--port", str(port),
                     "--cluster-enabled", "yes", "--cluster-port", str(bus_port),
                     "--cluster-config-file", "nodes.conf", "--dir", str(node_dir),
                     "--save", "", "--appendonly", "no"],
                    stdout=subprocess.DEVNULL,
                )
            )  # fmt: skip
            wait_for_port(port, 20)
        nodes = [f"127.0.0.1:{port}" for port in self.ports]
        subprocess.run(
            ["redis-cli", "--cluster", "create", *nodes, "--cluster-replicas", "0",
             "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while True:
            info = subprocess.run(
                ["redis-cli", "-p", str(self.ports[0]), "cluster", "info"],
                capture_output=True, text=True, timeout=10,
            ).stdout  # fmt: skip
            if "cluster_state:ok" in info:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the cluster did not come up: {info}")
            time.sleep(0.2)

    def close(self) -> None:
        for process in self.processes:
            process.kill()
            process.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
