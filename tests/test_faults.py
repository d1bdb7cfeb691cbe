"""Nothing lost: a cluster of real processes under kill -9, a Redis restart and a RabbitMQ restart.

Private RabbitMQ and Redis (AOF, appendfsync always) on free loopback ports; two orchestrator
processes per shard (one active, one standby), two workers per pool. While a few hundred
programs run, random processes are killed with SIGKILL and started again, Redis is killed and
restarted once, RabbitMQ is stopped and started once. Afterwards every program must have ended,
once, with the right result, in step order, and the dead-letter queue must hold exactly the
messages the test poisoned. `SHARDFLOW_FAULT_PROGRAMS` / `SHARDFLOW_FAULT_SECONDS` run it longer.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import aio_pika
import pytest
from redis.asyncio import Redis

from orchestrator.keys import Keys, Names
from orchestrator.redis_store import RedisStore
from orchestrator.settings import Settings
from orchestrator.store import TERMINAL, Store
from router.client import Router
from tests.app import Trace
from tests.brokers import PrivateRabbit, PrivateRedis
from tests.ordering import assert_leaves_in_order

pytestmark = pytest.mark.fault

ROOT = Path(__file__).parent.parent
PROGRAMS = int(os.environ.get("SHARDFLOW_FAULT_PROGRAMS", "200"))
CHAOS_S = float(os.environ.get("SHARDFLOW_FAULT_SECONDS", "30"))
SHARDS = 2


def program(k: int) -> dict:
    return {
        "name": f"fault-{k}",
        "steps": [
            {"task": "add", "args": {"n": 1, "sleep_s": 0.01}},
            {
                "bag": [{"task": "add", "args": {"n": i, "sleep_s": 0.05}} for i in range(5)],
                "chunk": 1 + k % 3,  # one, two or three members per task message
            },
            {
                "until": "prev.iteration >= 2",
                "max_iterations": 5,
                "steps": [{"task": "counter", "pool": "parallel", "args": {"sleep_s": 0.02}}],
            },
            {"task": "echo", "pool": "parallel", "args": {"k": k}},
        ],
    }


PATHS = ["0", "1", "2/iter:0/0", "2/iter:1/0", "2/iter:2/0", "3"]


class Fleet:
    """The cluster's processes; each can be killed and started again by name."""

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.env = env
        self.logs = logs
        self.specs: dict[str, list[str]] = {}
        for shard in range(SHARDS):
            for replica in ("a", "b"):
                self.specs[f"orch{shard}{replica}"] = ["orchestrator", "--shards", str(shard)]
        for pool in ("serial", "parallel"):
            for replica in ("a", "b"):
                self.specs[f"{pool}{replica}"] = [
                    "worker", "--pool", pool, "--app", "tests.app", "--concurrency", "8"
                ]  # fmt: skip
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.started_at: dict[str, int] = {}  # log offset of each process's latest start
        self.kills = 0

    def start(self, name: str) -> None:
        path = self.logs / f"{name}.log"
        self.started_at[name] = path.stat().st_size if path.exists() else 0
        with path.open("ab") as log:
            self.processes[name] = subprocess.Popen(
                [sys.executable, "-m", "shardflow", *self.specs[name]],
                cwd=ROOT,
                env={**os.environ, **self.env},
                stdout=log,
                stderr=log,
            )

    def start_all(self) -> None:
        for name in self.specs:
            self.start(name)

    def kill(self, name: str) -> None:
        process = self.processes[name]
        process.send_signal(signal.SIGKILL)
        process.wait()
        self.kills += 1

    def ready(self, name: str) -> bool:
        with (self.logs / f"{name}.log").open("rb") as log:
            log.seek(self.started_at[name])
            return b": consuming " in log.read()

    def stop_all(self) -> list[int]:
        # A process still importing when SIGTERM comes dies of it (exit -15) holding nothing;
        # graceful stop is only tested on processes that got as far as consuming.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(map(self.ready, self.processes)):
            time.sleep(0.1)
        for process in self.processes.values():
            process.send_signal(signal.SIGTERM)
        return [process.wait(timeout=60) for process in self.processes.values()]

    def log_text(self) -> str:
        return "".join(path.read_text(errors="replace") for path in self.logs.glob("*.log"))


@pytest.fixture
def brokers() -> Iterator[tuple[PrivateRabbit, PrivateRedis]]:
    rabbit, redis = PrivateRabbit(), PrivateRedis()
    try:
        redis.start()
        rabbit.start()
        yield rabbit, redis
    finally:
        rabbit.close()
        redis.close()


async def poison(settings: Settings) -> int:
    """Publish messages no one can use: they must end in the dead-letter queue, and only they."""
    names = Names(settings.prefix)
    connection = await aio_pika.connect(settings.amqp_url)
    async with connection:
        channel = await connection.channel()
        bad = [
            (names.shard_queue(0), b"not json"),
            (names.shard_queue(1), b'{"kind": "next", "wf": "x"}'),
            (names.shard_queue(1), b'{"kind": "start", "wf": "no such {program}"}'),
            (names.task_queue("parallel"), b'{"wf": "x", "path": "0"}'),
            (names.task_queue("serial"), b"\xff\xfe"),
        ]
        for queue, body in bad:
            # Persistent, like everything shardflow sends: they must outlive the broker restart
            # (new work has the lower priority, so they may still be waiting then).
            message = aio_pika.Message(body, delivery_mode=aio_pika.DeliveryMode.PERSISTENT)
            await channel.default_exchange.publish(message, routing_key=queue)
    return len(bad)


async def dead_letters(settings: Settings) -> list[str]:
    names = Names(settings.prefix)
    connection = await aio_pika.connect(settings.amqp_url)
    async with connection:
        channel = await connection.channel()
        queue = await channel.get_queue(names.dead_queue)
        reasons = []
        while (message := await queue.get(no_ack=True, fail=False)) is not None:
            reasons.append(str((message.headers or {}).get("x-shardflow-reason")))
        return reasons


async def chaos(fleet: Fleet, rabbit: PrivateRabbit, redis: PrivateRedis) -> Counter[str]:
    """Kill random processes for CHAOS_S seconds; restart Redis and RabbitMQ once each."""
    rng = random.Random(os.environ.get("SHARDFLOW_FAULT_SEED"))
    restarts: Counter[str] = Counter()
    started = time.monotonic()
    while (elapsed := time.monotonic() - started) < CHAOS_S:
        if not restarts["redis"] and elapsed > CHAOS_S * 0.3:
            await asyncio.to_thread(redis.restart)
            restarts["redis"] += 1
        if not restarts["rabbitmq"] and elapsed > CHAOS_S * 0.6:
            await asyncio.to_thread(rabbit.restart)
            restarts["rabbitmq"] += 1
        victim = rng.choice(sorted(fleet.specs))
        fleet.kill(victim)
        await asyncio.sleep(rng.uniform(0.0, 0.3))
        fleet.start(victim)
        await asyncio.sleep(rng.uniform(0.2, 0.8))
    return restarts


async def test_every_program_ends_once_in_order_through_kills_and_restarts(
    brokers: tuple[PrivateRabbit, PrivateRedis], redis_url: str, prefix: str, tmp_path: Path
) -> None:
    rabbit, redis = brokers
    settings = Settings(
        amqp_url=rabbit.url, redis_url=redis.url, shards=SHARDS, prefix=prefix, grace_s=2
    )
    env = {
        "SHARDFLOW_AMQP_URL": rabbit.url,
        "SHARDFLOW_REDIS_URL": redis.url,
        "SHARDFLOW_SHARDS": str(SHARDS),
        "SHARDFLOW_PREFIX": prefix,
        "SHARDFLOW_GRACE_S": "2",
    }
    trace = Trace(redis_url, f"{prefix}:trace")  # on the shared Redis, which nobody restarts
    fleet = Fleet(env, tmp_path)
    store = RedisStore(Redis.from_url(redis.url, decode_responses=True), Keys(settings.prefix))
    from orchestrator.bus import Bus

    bus = Bus(settings)
    await bus.connect()
    try:
        router = Router(settings, store=store, bus=bus)
        fleet.start_all()
        poisoned = await poison(settings)
        ids = [f"f{k}" for k in range(PROGRAMS)]
        for k, wf in enumerate(ids):
            await router.submit(program(k), trace.as_input(), wf)
        await bus.close()
        restarts = await chaos(fleet, rabbit, redis)
        statuses = await _wait_all(store, ids, timeout_s=180)
    finally:
        await bus.close()
        exits = fleet.stop_all()
        await store.close()

    logs = fleet.log_text()
    lost = [wf for wf, status in statuses.items() if status.get("status") not in TERMINAL]
    ended = Counter(re.findall(r"(f\d+): ended ", logs))
    republished = len(re.findall(r"redelivered after a crash: published again", logs))
    ignored = len(re.findall(r"message for .* ignored \(", logs))
    dead = await dead_letters(settings)
    print(
        f"\nfault summary: programs {len(ids)}, kills {fleet.kills}, restarts "
        f"redis {restarts['redis']} rabbitmq {restarts['rabbitmq']}, republished after "
        f"redelivery {republished}, duplicates ignored {ignored}, dead-lettered {len(dead)} "
        f"(poisoned {poisoned}), lost = {len(lost)}"
    )
    assert not lost, f"{len(lost)} programs never ended: {lost[:5]}"
    for k, wf in enumerate(ids):
        status = statuses[wf]
        assert status["status"] == "completed", (wf, status)
        assert json.loads(status["result"]) == {"args": {"k": k}, "prev": {"iteration": 2}}
    assert max(ended.values(), default=0) == 1, ended.most_common(3)
    assert_leaves_in_order(trace.events(), PATHS)
    assert len(dead) == poisoned, dead
    assert all(code == 0 for code in exits), exits


async def _wait_all(store: Store, ids: list[str], timeout_s: float) -> dict[str, dict[str, str]]:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            statuses = {wf: await store.state(wf) for wf in ids}
        except Exception:  # Redis may still be coming back
            statuses = {}
        if statuses and all(s.get("status") in TERMINAL for s in statuses.values()):
            return statuses
        if time.monotonic() > deadline:
            return statuses
        await asyncio.sleep(0.5)
