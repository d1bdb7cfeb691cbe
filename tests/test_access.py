"""Credentials and permissions: a login or a name refused is the configuration's fault, said
in one line naming the user (never the password), and not waited for like an outage."""

import json
import os
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

from orchestrator.settings import Settings
from tests.brokers import PrivateRabbit, PrivateRedis, PrivateRedisCluster, free_port

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
SECRET = "s3cret-pw"


def shardflow(*args: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shardflow", *args], capture_output=True, text=True, cwd=ROOT,
        timeout=timeout, env={**os.environ, "SHARDFLOW_METRICS_PORT": "0", **env},
    )  # fmt: skip


@pytest.fixture(scope="module")
def rabbit() -> Iterator[PrivateRabbit]:
    """A node of its own, where users are made: `flow` holds the README's permissions on the
    prefix `pf`, `looker` may not configure."""
    node = PrivateRabbit()
    node.start()
    try:
        for user, configure in (("flow", r"^pf\."), ("looker", "^$")):
            node.ctl("add_user", user, SECRET)
            node.ctl("set_permissions", "-p", "/", user, configure, r"^(pf\.|amq\.default$)",
                     r"^pf\.")  # fmt: skip
        yield node
    finally:
        node.close()


def _env(rabbit: PrivateRabbit, settings: Settings, user: str, password: str) -> dict[str, str]:
    return {
        "SHARDFLOW_AMQP_URL": f"amqp://{user}:{password}@127.0.0.1:{rabbit.port}/",
        "SHARDFLOW_REDIS_URL": settings.redis_url,
        "SHARDFLOW_PREFIX": "pf",
    }


def test_a_wrong_password_is_one_line_and_exit_2_at_once_for_commands_and_services(
    rabbit: PrivateRabbit, settings: Settings
) -> None:
    """A service retried it as an outage for SHARDFLOW_STARTUP_WAIT_S (118 s), logging
    "waiting for RabbitMQ and Redis", then exited 4 as for one. Now it says what is refused
    as an error while it tries again a while (30 s at most: a user an operator makes after
    the pod), then exits 2; a command at once."""
    env = {**_env(rabbit, settings, "flow", "wrong-pw"), "SHARDFLOW_STARTUP_WAIT_S": "2"}
    fault = (
        "shardflow: RabbitMQ (SHARDFLOW_AMQP_URL) refused user 'flow' on vhost '/': a wrong "
        "password, or no such user (ACCESS_REFUSED"
    )
    for args in (("submit", "examples/album.json"), ("orchestrator", "--shards", "0")):
        result = shardflow(*args, env=env)
        assert result.returncode == 2, result.stderr
        assert result.stderr.splitlines()[-1].startswith(fault), result.stderr
        assert "waiting for" not in result.stderr and "wrong-pw" not in result.stderr
        assert ("trying again for a while" in result.stderr) == (args[0] == "orchestrator")


def test_a_user_who_may_not_declare_is_told_what_it_needs(
    rabbit: PrivateRabbit, settings: Settings
) -> None:
    """A 78-line traceback and exit 1, from every command that declares."""
    result = shardflow(
        "submit", "examples/album.json", env=_env(rabbit, settings, "looker", SECRET)
    )
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith(
        "shardflow: RabbitMQ (SHARDFLOW_AMQP_URL) refused user 'looker' on vhost '/': "
        "ACCESS_REFUSED"
    ), result.stderr
    assert "needs configure, write and read on '^pf\\.' and write on 'amq.default'" in (
        result.stderr
    )


def test_the_permissions_the_readme_gives_run_a_program_end_to_end(
    rabbit: PrivateRabbit, settings: Settings
) -> None:
    """Every exchange and queue shardflow declares is under its prefix (a worker's control
    queue was aio-pika's `amq_<hex>`, which such a user may not declare)."""
    env = _env(rabbit, settings, "flow", SECRET)
    dev = subprocess.Popen(
        [sys.executable, "-m", "shardflow", "dev", "--app", "examples.tasks"], cwd=ROOT,
        env={**os.environ, "SHARDFLOW_METRICS_PORT": "0", **env}, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        done = shardflow("submit", "examples/thumbnails.json", "--input", '{"album": "a"}',
                         "--wait", "--timeout", "60", env=env)  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout) == {"published": "a", "after_polls": 3}
    finally:
        dev.send_signal(signal.SIGTERM)
        _, stderr = dev.communicate(timeout=30)
    assert dev.returncode == 0 and "ACCESS_REFUSED" not in stderr, stderr


def test_healthz_says_why_rabbitmq_is_not_connected_after_a_password_rotation(
    rabbit: PrivateRabbit, settings: Settings
) -> None:
    """The password changed under a running service and its connection closed: /healthz said
    only `rabbitmq: not connected`; the refusal of every reconnect was in the logs alone."""
    rabbit.ctl("add_user", "rotated", SECRET)
    rabbit.ctl("set_permissions", "-p", "/", "rotated", r"^pf\.", r"^(pf\.|amq\.default$)",
               r"^pf\.")  # fmt: skip
    port = free_port()
    env = {**_env(rabbit, settings, "rotated", SECRET), "SHARDFLOW_METRICS_PORT": str(port)}
    service = subprocess.Popen(
        [sys.executable, "-m", "shardflow", "orchestrator", "--shards", "0"], cwd=ROOT,
        env={**os.environ, **env}, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert _healthz(port, lambda answer: answer[0] == 200, 60)[1] == []
        rabbit.ctl("change_password", "rotated", "rotated-pw")
        rabbit.ctl("close_all_connections", "rotation")
        status, faults = _healthz(port, lambda answer: "ACCESS_REFUSED" in str(answer[1]), 60)
        assert status == 503 and faults[0].startswith("rabbitmq: not connected ("), faults
        assert "rotated-pw" not in str(faults) and SECRET not in str(faults)
        rabbit.ctl("change_password", "rotated", SECRET)  # put back: it reconnects by itself
        assert _healthz(port, lambda answer: answer[0] == 200, 60)[1] == []
    finally:
        service.send_signal(signal.SIGTERM)
        service.communicate(timeout=30)


def _healthz(port: int, wanted: Callable[[tuple[int, list[str]]], bool], seconds: float) -> Any:
    """Poll /healthz until its (status, faults) is `wanted`."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as got:
                answer = (got.status, json.load(got).get("faults", []))
        except urllib.error.HTTPError as refused:
            answer = (refused.code, json.load(refused).get("faults", []))
        except OSError:
            answer = (0, ["not serving"])
        if wanted(answer):
            return answer
        assert time.monotonic() < deadline, answer
        time.sleep(0.1)


def test_a_redis_password_missing_or_wrong_is_one_line_and_exit_2(settings: Settings) -> None:
    redis = PrivateRedis("--requirepass", SECRET)
    redis.start()
    try:
        base = f"127.0.0.1:{redis.port}/0"
        _refusals_said(settings, base, {}, bob=True)
    finally:
        redis.close()


def test_a_redis_clusters_refused_login_is_exit_2_too(settings: Settings) -> None:
    """redis-py wraps a cluster's refused login in a cluster error: it was exit 4, as if no
    node could be reached, and the service waited for it its whole startup wait."""
    cluster = PrivateRedisCluster()
    cluster.start()
    try:
        for port in cluster.ports:
            subprocess.run(["redis-cli", "-p", str(port), "config", "set", "requirepass", SECRET],
                           check=True, capture_output=True, timeout=30)  # fmt: skip
        base = cluster.url.removeprefix("redis://")
        _refusals_said(settings, base, {"SHARDFLOW_REDIS_CLUSTER": "true"}, bob=False)
    finally:
        cluster.close()


def _refusals_said(settings: Settings, base: str, env: dict[str, str], *, bob: bool) -> None:
    """A command and a service, given a Redis URL (host:port/db `base`) with no password, a
    wrong one, or (`bob`) a user Redis does not know: exit 2 and one line naming the fault,
    never the password; the right password is taken."""
    cases = {
        f"redis://{base}": "asks for a password, and the URL gives none",
        f"redis://:wrong-pw@{base}": "refused user 'default': a wrong password, or no such",
    }
    if bob:
        cases[f"redis://bob:{SECRET}@{base}"] = "refused user 'bob': a wrong password, or no such"
    for url, fault in cases.items():
        each = {
            **env,
            "SHARDFLOW_REDIS_URL": url,
            "SHARDFLOW_STARTUP_WAIT_S": "1",
            "SHARDFLOW_AMQP_URL": settings.amqp_url,
            "SHARDFLOW_PREFIX": settings.prefix,
        }
        for args in (("list",), ("orchestrator", "--shards", "0")):
            result = shardflow(*args, env=each)
            assert result.returncode == 2, result.stderr
            last = result.stderr.splitlines()[-1]
            assert last.startswith(f"shardflow: Redis (SHARDFLOW_REDIS_URL) {fault}"), last
            assert "wrong-pw" not in result.stderr and SECRET not in result.stderr
    good = {**env, "SHARDFLOW_REDIS_URL": f"redis://:{SECRET}@{base}", "SHARDFLOW_PREFIX": "x"}
    assert shardflow("list", env=good).returncode == 0
