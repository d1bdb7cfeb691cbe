"""Fixtures: real RabbitMQ and Redis, isolated per run (a fresh vhost) and per test (a prefix).

A missing service skips the tests that need it on a laptop, and fails them when CI is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import traceback
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import aio_pika
import pytest
import redis
from hypothesis import HealthCheck, Phase
from hypothesis import settings as hypothesis_settings
from redis.asyncio import Redis

from orchestrator.connections import connected
from orchestrator.redis_store import RedisStore
from orchestrator.settings import Settings
from router.client import Router
from shardflow.dev import Dev
from tests import app
from worker.registry import Registry

AMQP_BASE = os.environ.get("SHARDFLOW_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
REDIS_URL = os.environ.get("SHARDFLOW_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
RUN_ID = uuid.uuid4().hex[:8]

# The normal run: bounded. `pytest --hypothesis-profile=long` digs deeper.
_PROFILE = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
hypothesis_settings.register_profile("default", max_examples=60, stateful_step_count=40, **_PROFILE)
hypothesis_settings.register_profile("long", max_examples=1000, stateful_step_count=100, **_PROFILE)
# scripts/mutants.py: the default's search without shrinking, which only shortens what was found.
hypothesis_settings.register_profile(
    "catch",
    hypothesis_settings.get_profile("default"),
    phases=(Phase.explicit, Phase.reuse, Phase.generate),
)
# The long search without shrinking: to count how often something is found.
hypothesis_settings.register_profile(
    "long-catch",
    hypothesis_settings.get_profile("long"),
    phases=(Phase.explicit, Phase.reuse, Phase.generate),
)
hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def _unavailable(what: str, exc: BaseException) -> None:
    message = f"{what} is not reachable: {exc}"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def _rabbitmqctl(*args: str) -> None:
    subprocess.run(["rabbitmqctl", "-q", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture(scope="session")
def amqp_url() -> Iterator[str]:
    """A fresh vhost for this test run (deleted at the end), or the base URL without rabbitmqctl."""
    if shutil.which("rabbitmqctl") is None or "SHARDFLOW_TEST_AMQP_URL" in os.environ:
        yield AMQP_BASE
        return
    vhost = f"shardflow-test-{RUN_ID}"
    try:
        _rabbitmqctl("add_vhost", vhost)
        _rabbitmqctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
    except (subprocess.SubprocessError, OSError) as exc:
        # A broker whose vhost operations hang (one stuck delete_vhost blocks every later
        # add_vhost) still serves AMQP: every test has its own queue prefix, so the default
        # vhost isolates runs too. Only a broker that does not answer at all fails the run.
        log = logging.getLogger(__name__)
        log.warning("rabbitmqctl add_vhost failed (%s); using the default vhost", exc)
        yield AMQP_BASE
        _drop_queues("/", _PREFIXES)  # no vhost to delete: this run's queues go one by one
        return
    _VHOST[0] = vhost
    yield AMQP_BASE.rstrip("/") + "/" + vhost
    with contextlib.suppress(subprocess.SubprocessError, OSError):
        _rabbitmqctl("delete_vhost", vhost)


@pytest.fixture(scope="session")
def redis_url() -> str:
    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2).ping()
    except redis.RedisError as exc:
        _unavailable("Redis", exc)
    return REDIS_URL


_PREFIXES: set[str] = set()  # every test's, for a run that had to share the default vhost
_FINISHED: set[str] = set()  # prefixes of finished tests whose queues may still exist
_VHOST = [""]  # this run's own vhost, once made
SWEEP_EVERY = 15  # finished tests between two sweeps of their queues


def _drop_queues(vhost: str, prefixes: set[str]) -> None:
    """Delete a vhost's queues of these prefixes (best effort: a broker whose rabbitmqctl
    hangs keeps them). Kept, queues hold RabbitMQ's file descriptors (927 here), and a long
    run's would pile up until new connections hang."""
    try:
        listing = subprocess.run(
            ["rabbitmqctl", "-q", "list_queues", "-p", vhost, "name"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout  # fmt: skip
    except (subprocess.SubprocessError, OSError):
        return
    names = [name for name in listing.split() if name.split(".")[0] in prefixes]
    if not names:
        return
    url = AMQP_BASE if vhost == "/" else AMQP_BASE.rstrip("/") + "/" + vhost

    async def delete() -> None:
        async with await aio_pika.connect(url, timeout=10) as connection:
            channel = await connection.channel()
            for name in names:
                await channel.queue_delete(name)

    worker = threading.Thread(target=asyncio.run, args=(delete(),))  # no loop of pytest's
    worker.start()
    worker.join(timeout=60)


@pytest.fixture
def prefix() -> Iterator[str]:
    made = f"t{uuid.uuid4().hex[:10]}"
    _PREFIXES.add(made)
    yield made
    _FINISHED.add(made)
    if len(_FINISHED) >= SWEEP_EVERY and _VHOST[0]:
        _drop_queues(_VHOST[0], set(_FINISHED))
        _FINISHED.clear()


@pytest.fixture
def queue_policy(amqp_url: str, prefix: str) -> Iterator[Callable[[str, dict[str, Any]], None]]:
    """Set an operator's policy on this test's queues: `apply(pattern, definition)`, the
    pattern after `<prefix>.`; cleared after the test. Needs rabbitmqctl and this run's vhost."""
    if not _VHOST[0]:
        pytest.skip("an operator's policy needs rabbitmqctl and this run's own vhost")
    name = f"{prefix}-policy"

    def apply(pattern: str, definition: dict[str, Any]) -> None:
        rule = f"^{re.escape(prefix)}\\.{pattern}"
        args = ["set_policy", "-p", _VHOST[0], "--apply-to", "queues", "--priority", "9"]
        _rabbitmqctl(*args, name, rule, json.dumps(definition))

    yield apply
    with contextlib.suppress(subprocess.SubprocessError, OSError):
        _rabbitmqctl("clear_policy", "-p", _VHOST[0], name)


@pytest.fixture
async def keyspace(redis_url: str, prefix: str) -> AsyncIterator[tuple[str, str]]:
    """A Redis URL and a key prefix of this test's own; its keys are dropped after it."""
    yield redis_url, prefix
    await _drop_keys(redis_url, prefix)


@pytest.fixture
def redis_cluster() -> bool:
    """Override to run a module against a Redis Cluster (with `redis_url` pointing at it)."""
    return False


@pytest.fixture
def queue_type() -> str:
    """Override with params to run a module on quorum queues too."""
    return "classic"


@pytest.fixture
async def settings(
    amqp_url: str, redis_url: str, prefix: str, queue_type: str, redis_cluster: bool
) -> AsyncIterator[Settings]:
    """Settings for one test: its own prefix for queues and keys, cleaned up after it."""
    try:
        connection = await aio_pika.connect(amqp_url, timeout=5)
    except Exception as exc:
        _unavailable("RabbitMQ", exc)
    await connection.close()
    settings = Settings(
        amqp_url=amqp_url,
        redis_url=redis_url,
        prefix=prefix,
        shards=4,
        grace_s=2.0,
        queue_type=queue_type,  # type: ignore[arg-type]
        redis_cluster=redis_cluster,
    )
    yield settings
    if not redis_cluster:  # a private cluster is thrown away whole
        await _drop_keys(redis_url, prefix)


async def _drop_keys(redis_url: str, prefix: str) -> None:
    client = Redis.from_url(redis_url)
    try:
        batch = [key async for key in client.scan_iter(match=f"{prefix}*", count=1000)]
        for start in range(0, len(batch), 500):
            await client.delete(*batch[start : start + 500])
    finally:
        await client.aclose()


@pytest.fixture
async def store(settings: Settings) -> AsyncIterator[RedisStore]:
    store = RedisStore.connect(settings)
    await store.load_scripts()
    yield store
    await store.close()


@pytest.fixture
def registry() -> Registry:
    return Registry.from_modules(["tests.app"])


@pytest.fixture
def trace(prefix: str) -> Iterator[app.Trace]:
    """Tasks' start/end events, always on the plain shared Redis."""
    trace = app.Trace(REDIS_URL, f"{prefix}:trace")
    yield trace
    redis.Redis.from_url(REDIS_URL).delete(trace.key, trace.key + ":seq")


@pytest.fixture
def named_pools() -> list[str]:
    """Override in a module for `cluster` to run workers for these named pools too."""
    return []


@pytest.fixture
async def cluster(
    settings: Settings, registry: Registry, named_pools: list[str]
) -> AsyncIterator[Router]:
    """A whole cluster in this process (every shard, both pools); yields a router."""
    async with connected(settings, "shardflow-test") as (store, bus):
        dev = Dev(settings, registry, store=store, bus=bus, concurrency=16, pools=named_pools)
        running = asyncio.create_task(dev.run())
        try:
            yield Router(settings, store=store, bus=bus, known_tasks=None)
        finally:
            dev.shutdown()
            await running


def _dump_tasks(signum: int, frame: object) -> None:
    """`kill -USR1 <pytest>`: every asyncio task's stack on the real stderr, for a run that
    hangs idle (pytest-timeout shows threads, and a hung loop's thread only sits in select)."""
    try:
        tasks = asyncio.all_tasks()
    except RuntimeError:  # no loop running now
        return
    out = sys.__stderr__
    for task in tasks:
        print(f"--- {task!r}", file=out)
        for found in task.get_stack(limit=30):
            print("".join(traceback.format_stack(found, limit=1)), end="", file=out)


signal.signal(signal.SIGUSR1, _dump_tasks)
