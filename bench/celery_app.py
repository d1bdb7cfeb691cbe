"""Celery's side of the benchmark: the same no-op tasks, canvas for the same shapes."""

import os
import time
from typing import Any

from celery import Celery, chain, chord, group

app = Celery(
    "bench",
    broker=os.environ.get("BENCH_CELERY_BROKER", "amqp://guest:guest@127.0.0.1:5672/"),
    backend=os.environ.get("BENCH_CELERY_BACKEND", "redis://127.0.0.1:6379/3"),
)
app.conf.update(task_acks_late=True, worker_hijack_root_logger=False, result_expires=3600)
if os.environ.get("BENCH_CELERY_CONFIRMS") == "1":
    # Publisher confirms, as shardflow publishes every message: the broker confirms a
    # persistent message once it is on disk, so a crash of the broker's machine loses none.
    app.conf.broker_transport_options = {"confirm_publish": True}


@app.task
def begin() -> dict[str, Any]:
    return {"v": 1}


@app.task
def member(prev: dict[str, Any], i: int) -> dict[str, Any]:
    return {"i": i, "v": prev["v"]}


@app.task
def finish(outs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"order": [out["i"] for out in outs], "t": time.time()}


@app.task
def step(prev: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"k": (prev or {"k": 0})["k"] + 1, "t": time.time()}


def shape_a() -> Any:
    """One task, a bag of 10 that each get its output, one task that gets the 10 in order."""
    return chain(begin.s(), chord(group(member.s(i) for i in range(10)), finish.s()))


def shape_b() -> Any:
    """A chain of 20 tasks."""
    return chain(step.s(), *(step.s() for _ in range(19)))
