"""What the benchmark scripts share: a fresh RabbitMQ vhost (dropped after), a fleet's
settings, the machine's name, Redis keys cleared, the chain scripts' arguments, and writing
a result's JSON."""

import argparse
import json
import shlex
import subprocess
import sys
from datetime import date
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: bench/floor.py runs no shardflow code
    from orchestrator.settings import Settings

AMQP = "amqp://guest:guest@127.0.0.1:5672/"


def vhost(name: str) -> str:
    """Create `name` afresh (dropping what an earlier run left) and return its AMQP URL."""
    drop_vhost(name)
    subprocess.run(["rabbitmqctl", "-q", "add_vhost", name], check=True, capture_output=True)
    subprocess.run(
        ["rabbitmqctl", "-q", "set_permissions", "-p", name, "guest", ".*", ".*", ".*"],
        check=True, capture_output=True,
    )  # fmt: skip
    return AMQP + name


def queue_version(name: str, version: int) -> None:
    """Make every classic queue of vhost `name` of this version, by a policy (RabbitMQ 3.10+
    converts a queue in place when its version changes)."""
    subprocess.run(
        ["rabbitmqctl", "-q", "set_policy", "-p", name, "--apply-to", "queues",
         "shardflow-queue-version", ".*", json.dumps({"queue-version": version})],
        check=True, capture_output=True,
    )  # fmt: skip


def fleet(name: str, tag: str) -> "tuple[Settings, dict[str, str]]":
    """Settings for a benchmark's own shardflow processes on a fresh vhost `name` and Redis
    database 2 (keys under a new prefix starting with `tag`), and the environment that gives
    the processes the same (quiet logs, no metrics port)."""
    import uuid

    from orchestrator.settings import Settings

    settings = Settings(
        amqp_url=vhost(name),
        redis_url="redis://127.0.0.1:6379/2",
        prefix=f"{tag}{uuid.uuid4().hex[:6]}",
    )
    env = {
        "SHARDFLOW_AMQP_URL": settings.amqp_url,
        "SHARDFLOW_REDIS_URL": settings.redis_url,
        "SHARDFLOW_PREFIX": settings.prefix,
        "SHARDFLOW_LOG_LEVEL": "WARNING",
        "SHARDFLOW_METRICS_PORT": "0",
    }
    return settings, env


def drop_vhost(name: str) -> None:
    subprocess.run(["rabbitmqctl", "-q", "delete_vhost", name], capture_output=True)


def machine() -> str:
    """The machine a figure was measured on, as the reports name it."""
    import os
    import platform

    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def write_result(name: str, figures: dict[str, Any]) -> Path:
    """Write bench/results/<name>.json: the date, the machine and the command that made it,
    then `figures`. Prints and returns its path."""
    root = Path(__file__).resolve().parent.parent
    script = Path(sys.argv[0] or "-").resolve()
    shown = script.relative_to(root) if script.is_relative_to(root) else script
    report = {
        "date": date.today().isoformat(),
        "machine": machine(),
        "command": shlex.join(["python", str(shown), *sys.argv[1:]]),
        **figures,
    }
    out = root / "bench" / "results" / f"{name}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"written to {out.relative_to(root)}")
    return out


async def drop_keys(client: Any, prefix: str) -> None:
    """Delete every Redis key a run left under its prefix."""
    keys = [key async for key in client.scan_iter(match=f"{prefix}*", count=1000)]
    for start in range(0, len(keys), 500):
        await client.delete(*keys[start : start + 500])


def chain_arguments(doc: str | None) -> argparse.Namespace:
    """`--chains`, `--steps` and `--stamp`, as the scripts that time chain steps take them."""
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    parser.add_argument("--chains", type=int, default=10)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--stamp", default=date.today().isoformat(), help="results' file name")
    return parser.parse_args()
