"""A fresh RabbitMQ vhost for a benchmark run, dropped after it."""

import subprocess

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


def drop_vhost(name: str) -> None:
    subprocess.run(["rabbitmqctl", "-q", "delete_vhost", name], capture_output=True)
