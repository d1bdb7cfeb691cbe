"""shardflow beside Celery canvas, in one run on one machine, on the same RabbitMQ and Redis.

    make bench     (or: .venv/bin/python bench/compare.py [--quick] [--chains] [--stamp NAME])

Each system gets a fresh RabbitMQ vhost and its own Redis database. Workloads (no-op tasks
returning small dicts; every result is checked):
  A  one task, a bag of 10 that each get its output, one task that gets the 10 in order;
     M = 200 and M = 1000 programs submitted at once
  B  a chain of 20 tasks: M = 1 fifty times (per-step overhead), and M = 200; beside it the
     floor of a step under the design card, two bare processes with no shardflow code
     (bench/floor.py). In 5 rounds, each system and the floor in turn in each round, so a
     machine whose speed drifts moves them alike; its ratios are the medians of the rounds'.
     --chains runs shape B and the floor alone
  C  shape A at M = 1000 with 1, 2 and 4 orchestrator processes (shardflow only)
  memory: orchestrator RSS with 100 and 10,000 programs in flight; Redis bytes per program
  cost: CPU seconds per 1,000 tasks of every process involved (orchestrators or Celery workers
     with their children, the shared RabbitMQ and Redis, this client), from /proc/<pid>/stat
     around each A and B run (bench/cpu.py); broker messages per task, counted in a separate
     short run with RabbitMQ's firehose; during shape A at the larger M, each orchestrator's
     CPU share and each shard queue's depth every 0.5 s
shardflow runs one orchestrator and one worker of 16 (ORCHESTRATORS, WORKERS: two busy
processes on two cores), every task on its parallel pool; Celery runs a prefork pool of 2 and
a threads pool of 16 (acks_late, Redis result backend), and ratios are against the better of
the two. Shape B's rounds also run Celery's prefork pool with publisher confirms, as shardflow
publishes (the broker confirms a persistent message once it is on disk): the
`*_same_guarantee` ratios, never counted as Celery's best. Latency is from submit to the last
task's own clock.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from datetime import date
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import aio_pika  # noqa: E402
from aio_pika.abc import AbstractIncomingMessage  # noqa: E402
from redis.asyncio import Redis  # noqa: E402

from bench.cpu import Meter, cost, cpu_s  # noqa: E402
from bench.floor import floor_loaded, floor_step_ms  # noqa: E402
from bench.services import AMQP, drop_vhost, vhost  # noqa: E402
from orchestrator.connections import connected  # noqa: E402
from orchestrator.keys import Names  # noqa: E402
from orchestrator.settings import Settings  # noqa: E402
from orchestrator.shares import share_pools  # noqa: E402
from router.client import Router  # noqa: E402


def shape_a(chunk: int | None = None) -> dict[str, Any]:
    """One task, a bag of 10 that each get its output, one task; `chunk` members per message
    (see "chunk" in the README's program format): the same work, fewer messages. No chunk:
    the default, adaptive (one per message unless the pool's queue has a backlog)."""
    bag: dict[str, Any] = {"bag": [{"task": "member", "args": {"i": i}} for i in range(10)]}
    if chunk is not None:
        bag["chunk"] = chunk
    steps = [{"task": "begin", "pool": "parallel"}, bag, {"task": "finish", "pool": "parallel"}]
    return {"name": "A", "steps": steps}


SHAPE_A, SHAPE_A_CHUNKED, SHAPE_A_CHUNK1 = shape_a(), shape_a(chunk=10), shape_a(chunk=1)
# Shape A's variants: the default (adaptive), and a chunk named in the program.
A_VARIANTS = (("", SHAPE_A), ("_chunk1", SHAPE_A_CHUNK1), ("_chunk10", SHAPE_A_CHUNKED))
SHAPE_B = {"name": "B", "steps": [{"task": "step", "pool": "parallel"}] * 20}
SHARDS = 4
# The fleet every shardflow figure here runs on, unless a run names its own: one orchestrator
# (owning the SHARDS shards) and one worker, two busy processes on this 2-core machine as
# Celery's prefork pool of 2 runs two children. Two and two (until 2026-12-03) ran shape A and
# chains at M=200 slower, at more CPU a task: bench/README.md, `bench/ab.py --set fleet=...`.
ORCHESTRATORS, WORKERS = 1, 1
# A worker's parallel tasks at once, shardflow's default; passed as --concurrency, so
# SHARDFLOW_PARALLEL_CONCURRENCY does not change it here.
CONCURRENCY = 16
MAX_WORKERS = 8  # the most worker processes a bench's own fleet may name
COUNTED = 50  # programs in each run that counts broker messages (not a timed run)
# Shape B's rounds: every system in turn, each round's chains a share of `repeats`.
ROUNDS = 5
CELERY_POOLS = (("celery prefork 2", "prefork", 2), ("celery threads 16", "threads", 16))
# In shape B's rounds only, and never "Celery's best": Celery as shardflow publishes, with
# publisher confirms (bench/celery_app.py), for ratios under the same delivery guarantee.
CONFIRMING = "celery prefork 2 confirms"
# A Celery result not seen in this long is a stalled run (the longest run here takes about
# 45 s), made again at most RUN_ATTEMPTS times in all.
STALL_S = 120.0
RUN_ATTEMPTS = 3


def spawn(
    args: list[str], env: dict[str, str], log: Path, root: Path = ROOT
) -> subprocess.Popen[bytes]:
    """Start a process in `root` (a checkout: `python -m shardflow` runs its code)."""
    with log.open("ab") as out:
        return subprocess.Popen(args, cwd=root, env={**os.environ, **env}, stdout=out, stderr=out)


def stop(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        process.terminate()
    for process in processes:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise LookupError(pid)


def figures(m: int, tasks_per_program: int, started: float, submits: list[float],
            ends: list[float]) -> dict[str, float]:  # fmt: skip
    wall = max(ends) - started
    latencies = [(end - submit) * 1000 for submit, end in zip(submits, ends, strict=True)]
    cuts = statistics.quantiles(latencies, n=100) if len(latencies) > 1 else latencies * 99
    return {
        "wall_s": round(wall, 3),
        "programs_per_s": round(m / wall, 1),
        "tasks_per_s": round(m * tasks_per_program / wall, 1),
        "latency_p50_ms": round(cuts[49], 1),
        "latency_p99_ms": round(cuts[98], 1),
    }


def summary(samples: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    return {
        key: {"max": round(max(values), 2), "mean": round(statistics.mean(values), 2)}
        for key, values in samples.items()
        if values
    }


async def count_messages(name: str, run: Awaitable[object], tasks: int) -> dict[str, float]:
    """Messages RabbitMQ took in (publish) and handed out (deliver) per task over `run`, in vhost
    `name`. RabbitMQ 3.10 keeps no per-vhost message counters without the management plugin,
    so this turns on its firehose for the vhost (a copy of each publish and delivery to
    amq.rabbitmq.trace) and counts the copies. Tracing costs the broker: never in a CPU figure."""
    ctl = ["rabbitmqctl", "-q"]
    await asyncio.to_thread(subprocess.run, [*ctl, "trace_on", "-p", name], check=True,
                            capture_output=True)  # fmt: skip
    counts: Counter[str] = Counter()
    try:
        async with await aio_pika.connect(AMQP + name) as connection:
            channel = await connection.channel()
            queue = await channel.declare_queue(exclusive=True)
            await queue.bind("amq.rabbitmq.trace", routing_key="#")

            async def on(message: AbstractIncomingMessage) -> None:
                counts[(message.routing_key or "").split(".", 1)[0]] += 1

            await queue.consume(on, no_ack=True)
            await run
            seen = -1
            while seen != counts.total():  # until the last copies have arrived
                seen = counts.total()
                await asyncio.sleep(1)
    finally:
        await asyncio.to_thread(subprocess.run, [*ctl, "trace_off", "-p", name],
                                capture_output=True)  # fmt: skip
    return {
        "published_per_task": round(counts["publish"] / tasks, 2),
        "delivered_per_task": round(counts["deliver"] / tasks, 2),
    }


class Shardflow:
    """Orchestrator and worker processes, driven through the Python API."""

    def __init__(self, logs: Path, root: Path = ROOT) -> None:
        self.logs = logs
        self.root = root  # the checkout whose code the fleet runs (bench/ab.py --ref)
        self.settings = Settings(
            amqp_url=vhost("shardflow-bench"),
            redis_url="redis://127.0.0.1:6379/2",
            shards=SHARDS,
            prefix="sfb",
        )
        self.env = {
            "SHARDFLOW_AMQP_URL": self.settings.amqp_url,
            "SHARDFLOW_REDIS_URL": self.settings.redis_url,
            "SHARDFLOW_SHARDS": str(SHARDS),
            "SHARDFLOW_PREFIX": self.settings.prefix,
            "SHARDFLOW_LOG_LEVEL": "WARNING",
        }
        self.processes: list[subprocess.Popen[bytes]] = []
        self.orchestrators: list[subprocess.Popen[bytes]] = []
        self.shards: list[list[int]] = []  # each orchestrator's shards

    def start(
        self,
        orchestrators: int = ORCHESTRATORS,
        worker_concurrency: int = CONCURRENCY,
        workers: int = WORKERS,
    ) -> None:
        self.shards = [list(range(SHARDS))[i::orchestrators] for i in range(orchestrators)]
        cli = [sys.executable, "-m", "shardflow"]
        self.orchestrators = [
            spawn([*cli, "orchestrator", "--shards", ",".join(map(str, group))], self.env,
                  self.logs / "orchestrator.log", self.root)
            for group in self.shards
        ]  # fmt: skip
        self.processes = self.orchestrators + [
            spawn([*cli, "worker", "--pool", "parallel", "--app", "bench.tasks",
                   "--concurrency", str(worker_concurrency)], self.env, self.logs / "worker.log",
                  self.root)
            for _ in range(workers)
        ]  # fmt: skip
        time.sleep(2.5)  # imports and connections

    def stop(self) -> None:
        stop(self.processes)
        self.processes = []

    def groups(self) -> dict[str, list[int]]:
        """The process trees a run's CPU figure counts, besides RabbitMQ, Redis and the client."""
        workers = self.processes[len(self.orchestrators) :]
        return {"orchestrators": [p.pid for p in self.orchestrators],
                "workers": [p.pid for p in workers]}  # fmt: skip

    async def sample(self, done: asyncio.Event, every_s: float = 0.5) -> dict[str, Any]:
        """Until `done`: each orchestrator's CPU share (1.0 = one core; its process alone, one
        event loop, so near 1.0 it is the bottleneck) and each shard queue's ready messages,
        with the parallel pool's task queue beside them."""
        names = Names(self.settings.prefix)
        owners = {f"orchestrator {i} (shards {','.join(map(str, group))})": process.pid
                  for i, (process, group) in enumerate(zip(self.orchestrators, self.shards,
                                                           strict=True))}  # fmt: skip
        queues = {f"shard {shard}": [names.shard_queue(shard)] for shard in range(SHARDS)}
        # Every share of the parallel pool (orchestrator/shares.py), summed.
        queues["tasks.parallel"] = [names.task_queue(pool) for pool in share_pools("parallel")]
        shares: dict[str, list[float]] = {key: [] for key in owners}
        depths: dict[str, list[float]] = {key: [] for key in queues}
        async with await aio_pika.connect(self.settings.amqp_url) as connection:
            channel = await connection.channel()
            last, then = {key: cpu_s(pid) for key, pid in owners.items()}, time.monotonic()
            while not done.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(done.wait(), every_s)
                now = time.monotonic()
                if now - then < every_s / 2:
                    break  # a short last interval: too few clock ticks to tell a share
                for key, pid in owners.items():
                    used = cpu_s(pid)
                    shares[key].append((used - last[key]) / (now - then))
                    last[key] = used
                then = now
                for key, group in queues.items():
                    depth = 0
                    for name in group:
                        queue = await channel.declare_queue(name, passive=True)
                        depth += queue.declaration_result.message_count or 0
                    depths[key].append(depth)
        return {"every_s": every_s, "owner_cpu_share": summary(shares),
                "queue_depth": summary(depths)}  # fmt: skip

    async def run(self, program: dict[str, Any], m: int, tasks: int,
                  check: Callable[[Any], bool],
                  sample: bool = False) -> dict[str, Any]:  # fmt: skip
        """One measured run of `m` programs; `sample`: with `sample()`'s figures as "shards"."""
        done = asyncio.Event()
        sampler = asyncio.create_task(self.sample(done)) if sample else None
        meter = Meter(self.groups())
        meter.start()
        started = time.monotonic()
        try:
            result = await self._run(program, m, tasks, check)
            result.update(cost(meter, started, m * tasks))
        finally:
            done.set()
        if sampler is not None:
            result["shards"] = await sampler
        return result

    async def _run(self, program: dict[str, Any], m: int, tasks: int,
                   check: Callable[[Any], bool]) -> dict[str, Any]:  # fmt: skip
        async with connected(self.settings, "bench") as (store, bus):
            router = Router(self.settings, store=store, bus=bus)
            ids = [uuid.uuid4().hex for _ in range(m)]
            submits = [0.0] * m
            started = time.time()

            async def submit(k: int) -> None:
                submits[k] = time.time()
                await router.submit(program, None, ids[k])

            for chunk in range(0, m, 50):
                await asyncio.gather(*(submit(k) for k in range(chunk, min(m, chunk + 50))))
            ends = []
            for wf in ids:
                status = await router.wait(wf, timeout_s=600)
                assert status["status"] == "completed" and check(status["result"]), status
                ends.append(status["result"]["t"])
            self.last_ids = ids
            return figures(m, tasks, started, submits, ends)

    async def redis_bytes_per_program(self) -> float:
        client = Redis.from_url(self.settings.redis_url)
        try:
            sizes = []
            for wf in self.last_ids[:50]:
                total = 0
                async for key in client.scan_iter(match=f"{self.settings.prefix}:{{{wf}}}:*"):
                    total += await client.memory_usage(key) or 0
                sizes.append(total)
            return round(statistics.mean(sizes), 1)
        finally:
            await client.aclose()

    async def rss_in_flight(self, counts: list[int]) -> dict[str, float]:
        """Orchestrator RSS once `count` programs wait on a task that holds the only slot."""
        self.start(orchestrators=1, worker_concurrency=1, workers=1)
        result = {}
        try:
            async with connected(self.settings, "bench") as (store, bus):
                router = Router(self.settings, store=store, bus=bus)
                program = {"steps": [{"task": "hold", "pool": "parallel", "args": {"s": 600}}]}
                submitted: list[str] = []
                for count in counts:
                    while len(submitted) < count:
                        batch = range(len(submitted), min(count, len(submitted) + 50))
                        done = await asyncio.gather(*(router.submit(program) for _ in batch))
                        submitted += [s.workflow_id for s in done]
                    while True:  # every one started: its task dispatched, its plan seen
                        states = [await store.state(wf) for wf in submitted[-50:]]
                        if all(state.get("status") == "running" for state in states):
                            break
                        await asyncio.sleep(0.5)
                    await asyncio.sleep(1)
                    result[f"rss_mb_{count}_in_flight"] = round(
                        rss_mb(self.orchestrators[0].pid), 1
                    )
        finally:
            self.stop()
        return result


class CeleryRun:
    """Celery workers (one pool kind at a time), driven through canvas."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.env = {
            "BENCH_CELERY_BROKER": vhost("celery-bench"),
            "BENCH_CELERY_BACKEND": "redis://127.0.0.1:6379/3",
        }
        os.environ.update(self.env)
        self.processes: list[subprocess.Popen[bytes]] = []

    def start(self, pool: str, concurrency: int, confirms: bool = False) -> None:
        self.env["BENCH_CELERY_CONFIRMS"] = "1" if confirms else "0"
        args = [sys.executable, "-m", "celery", "-A", "bench.celery_app", "worker",
                "--pool", pool, "-c", str(concurrency), "--loglevel", "WARNING",
                "--without-gossip", "--without-mingle", "--without-heartbeat"]  # fmt: skip
        self.processes = [spawn(args, self.env, self.logs / f"celery-{pool}.log")]
        time.sleep(4)

    def stop(self) -> None:
        stop(self.processes)

    def run(self, make: Callable[[], Any], m: int, tasks: int, check: Callable[[Any], bool],
            attempts: int = RUN_ATTEMPTS) -> dict[str, Any]:  # fmt: skip
        """One measured run; a run that stalls is made again, `attempts` times at most in all,
        and the result names each stall before it ("stalls"); then Stalled."""
        stalls: list[str] = []
        for _ in range(attempts):
            # the worker's tree: a prefork pool's children are counted with their parent
            meter = Meter({"workers": [p.pid for p in self.processes]})
            meter.start()
            started = time.monotonic()
            try:
                result: dict[str, Any] = self._run(make, m, tasks, check)
            except Stalled as exc:
                print(f"celery: a run stalled ({exc}); running it again", flush=True)
                stalls.append(str(exc))
                continue
            result.update(cost(meter, started, m * tasks))
            if stalls:
                result["stalls"] = stalls
            return result
        raise Stalled(f"{attempts} run(s) in a row stalled: {stalls}")

    def _run(self, make: Callable[[], Any], m: int, tasks: int,
             check: Callable[[Any], bool]) -> dict[str, Any]:  # fmt: skip
        from celery.exceptions import TimeoutError as ResultTimeout

        submits, results = [], []
        started = time.time()
        for _ in range(m):
            submits.append(time.time())
            results.append(make().apply_async())
        ends = []
        for result in results:
            try:
                value = result.get(timeout=STALL_S)
            except ResultTimeout:
                # Its key in Redis, read directly rather than through the notice that get()
                # waits for: a result stored whose notice was missed, or a message lost.
                meta = result.backend.get_task_meta(result.id)
                found = "its notice missed" if meta["status"] == "SUCCESS" else "no result"
                for left in results:  # no subscription or key left behind by this run
                    left.forget()
                raise Stalled(f"{result.id}: {found} after {STALL_S:.0f} s") from None
            assert check(value), value
            ends.append(value["t"])
            result.forget()
        return figures(m, tasks, started, submits, ends)


class Stalled(RuntimeError):
    """A Celery run that stopped moving: a result not seen in STALL_S (2026-12-03, once in a
    shape B run at M=200: the client's Redis subscription waited 600 s for one result)."""


def check_a(result: Any) -> bool:
    return bool(result["order"] == list(range(10)))


def check_b(result: Any) -> bool:
    return bool(result["k"] == 20)


async def shapes_a_and_c(out: dict[str, dict[str, Any]], sf: Shardflow, celery: CeleryRun,
                         big: int, small: int, quick: bool) -> None:  # fmt: skip
    """Shapes A and C, memory and broker messages: each system once, one after the other."""
    sf.start()
    try:
        for m in (small, big):
            for variant, shape in A_VARIANTS:
                key = f"A_M{m}{variant}"
                out["shardflow"][key] = await sf.run(shape, m, 12, check_a, sample=m == big)
                print(f"shardflow {key}: {out['shardflow'][key]}", flush=True)
        counted = (
            ("A", SHAPE_A, 12, check_a),
            ("A_chunk1", SHAPE_A_CHUNK1, 12, check_a),
            ("A_chunk10", SHAPE_A_CHUNKED, 12, check_a),
            ("B", SHAPE_B, 20, check_b),
        )
        for key, shape, tasks, check in counted:
            out["shardflow"][f"messages_{key}"] = await count_messages(
                "shardflow-bench", sf.run(shape, COUNTED, tasks, check), COUNTED * tasks
            )
        out["shardflow"]["redis_bytes_per_program"] = await sf.redis_bytes_per_program()
    finally:
        sf.stop()
    for orchestrators in (1, 2, 4):
        sf.start(orchestrators=orchestrators)
        try:
            key = f"C_M{big}_{orchestrators}_orchestrators"
            out["shardflow"][key] = await sf.run(SHAPE_A, big, 12, check_a)
            print(f"shardflow {key}: {out['shardflow'][key]}", flush=True)
        finally:
            sf.stop()
    out["shardflow"].update(await sf.rss_in_flight([100, 1000 if quick else 10_000]))

    from bench import celery_app

    for name, pool, concurrency in CELERY_POOLS:
        celery.start(pool, concurrency)
        try:
            for m in (small, big):
                out[name][f"A_M{m}"] = celery.run(celery_app.shape_a, m, 12, check_a)
                print(f"{name} A M={m}: {out[name][f'A_M{m}']}", flush=True)
            counted_celery = (
                ("A", celery_app.shape_a, 12, check_a),
                ("B", celery_app.shape_b, 20, check_b),
            )
            for key, make, tasks, check in counted_celery:
                for attempt in range(RUN_ATTEMPTS):  # a stalled run's messages count for none
                    try:
                        out[name][f"messages_{key}"] = await count_messages(
                            "celery-bench",
                            asyncio.to_thread(celery.run, make, COUNTED, tasks, check, 1),
                            COUNTED * tasks,
                        )
                        break
                    except Stalled:
                        if attempt + 1 == RUN_ATTEMPTS:
                            raise
        finally:
            celery.stop()


async def chain_rounds(out: dict[str, dict[str, Any]], sf: Shardflow, celery: CeleryRun,
                       small: int, repeats: int) -> None:  # fmt: skip
    """Shape B and the floor in ROUNDS rounds, every system in turn in each (the order
    reversed every other round), so a machine whose speed drifts over minutes moves all of
    them alike; the chain ratios are the medians of each round's (report())."""
    from bench import celery_app

    per_round = max(2, repeats // ROUNDS)  # a round's step p50 needs two chains at least
    steps: dict[str, list[dict[str, Any]]] = {name: [] for name in out}
    loaded: dict[str, list[dict[str, Any]]] = {name: [] for name in out}
    floors: list[float] = []
    loaded_floors: list[dict[str, Any]] = []

    async def shardflow() -> dict[str, float]:
        sf.start()
        try:
            runs = [await sf.run(SHAPE_B, 1, 20, check_b) for _ in range(per_round)]
            loaded["shardflow"].append(await sf.run(SHAPE_B, small, 20, check_b))
        finally:
            sf.stop()
        steps["shardflow"] += runs
        return _round_figures(runs, loaded["shardflow"][-1])

    async def floor() -> dict[str, float]:
        # No shardflow process runs while the floor does, as none of Celery's does.
        floors.append(await asyncio.to_thread(floor_step_ms, per_round, 20))
        loaded_floors.append(await asyncio.to_thread(floor_loaded, small, 20))
        return {
            "step_p50_ms": floors[-1],
            "tasks_per_s": loaded_floors[-1]["tasks_per_s"],
            "cpu_s_per_1000_tasks": loaded_floors[-1]["cpu_s_per_1000_tasks"],
        }

    def pool(name: str, kind: str, concurrency: int) -> Callable[[], Awaitable[dict[str, float]]]:
        async def run() -> dict[str, float]:
            celery.start(kind, concurrency, confirms=name == CONFIRMING)
            try:
                runs = [celery.run(celery_app.shape_b, 1, 20, check_b) for _ in range(per_round)]
                loaded[name].append(celery.run(celery_app.shape_b, small, 20, check_b))
            finally:
                celery.stop()
            steps[name] += runs
            return _round_figures(runs, loaded[name][-1])

        return run

    sides: list[tuple[str, Callable[[], Awaitable[dict[str, float]]]]] = [
        ("shardflow", shardflow),
        ("floor", floor),
        *((name, pool(name, kind, concurrency)) for name, kind, concurrency in CELERY_POOLS),
        (CONFIRMING, pool(CONFIRMING, "prefork", 2)),
    ]
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name, _ in sides}
    for number in range(ROUNDS):
        for name, side in sides if number % 2 == 0 else sides[::-1]:
            rounds[name].append(await side())
            print(f"round {number + 1}/{ROUNDS} {name} B: {rounds[name][-1]}", flush=True)
    for name in out:
        out[name]["B_M1"] = _per_step(steps[name])
        # The round at the median of tasks/s, whole, for the table and the chart.
        ordered = sorted(loaded[name], key=lambda run: run["tasks_per_s"])
        out[name][f"B_M{small}"] = ordered[len(ordered) // 2]
        out[name]["B_rounds"] = rounds[name]
    out["shardflow"]["B_M1_floor"] = {"step_p50_ms": round(statistics.median(floors), 3)}
    ordered_floors = sorted(loaded_floors, key=lambda run: run["tasks_per_s"])
    out["shardflow"][f"B_M{small}_floor"] = ordered_floors[len(ordered_floors) // 2]
    out["shardflow"]["B_floor_rounds"] = rounds["floor"]


def _round_figures(runs: list[dict[str, Any]], loaded: dict[str, Any]) -> dict[str, float]:
    """A round of one system: its step from the M=1 `runs`, its throughput and cost from the
    `loaded` run, and how many Celery runs stalled and were made again (none are figures)."""
    stalls = sum(len(run.get("stalls", ())) for run in [*runs, loaded])
    return {
        "step_p50_ms": _per_step(runs)["step_p50_ms"],
        "tasks_per_s": loaded["tasks_per_s"],
        "cpu_s_per_1000_tasks": loaded["cpu_s_per_1000_tasks"],
        **({"stalls": stalls} if stalls else {}),
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller M, for a smoke run")
    parser.add_argument(
        "--chains",
        action="store_true",
        help="shape B and its floor alone, for every system, in rounds (about 6 min)",
    )
    parser.add_argument("--stamp", help="results' file name (default: the date, -quick)")
    args = parser.parse_args()
    big, small, repeats = (200, 50, 10) if args.quick else (1000, 200, 50)
    full = not args.chains  # else shape B and the floor alone
    logs = ROOT / "bench" / "results" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for db in ("2", "3"):  # the two systems' Redis databases, emptied before the run
        await asyncio.to_thread(
            subprocess.run, ["redis-cli", "-n", db, "flushdb"], check=True, capture_output=True
        )
    out: dict[str, dict[str, Any]] = {"shardflow": {}, "celery prefork 2": {},
                                      "celery threads 16": {}, CONFIRMING: {}}  # fmt: skip

    sf = Shardflow(logs)
    celery = CeleryRun(logs)  # sets the broker for the app, so before importing it
    if full:
        await shapes_a_and_c(out, sf, celery, big, small, args.quick)
    await chain_rounds(out, sf, celery, small, repeats)
    report(out, big, small, args.quick, args.stamp, full)
    cleanup()


def cleanup() -> None:
    """Leave the shared broker and Redis as they were."""
    for name in ("shardflow-bench", "celery-bench"):
        drop_vhost(name)
    for db in ("2", "3"):
        subprocess.run(["redis-cli", "-n", db, "flushdb"], capture_output=True)


def _per_step(runs: list[dict[str, Any]]) -> dict[str, float]:
    per_step = [run["latency_p50_ms"] / 20 for run in runs]
    cuts = statistics.quantiles(per_step, n=100)
    return {"step_p50_ms": round(cuts[49], 2), "step_p99_ms": round(cuts[98], 2)}


def median_ratio(ours: list[dict[str, float]], theirs: list[list[dict[str, float]]],
                 figure: str, higher: bool) -> float:  # fmt: skip
    """The median over rounds of `figure`'s ratio, ours over the best of theirs in that round
    (the highest when `higher` is better, else the lowest): each round's systems ran minutes
    apart at most, so a machine that drifts between rounds moves both sides of a ratio."""
    if not ours or any(len(rounds) != len(ours) for rounds in theirs):
        raise ValueError("every side needs one figure a round")
    pick = max if higher else min
    return statistics.median(
        mine[figure] / pick(other[figure] for other in others)
        for mine, *others in zip(ours, *theirs, strict=True)
    )


def report(out: dict[str, dict[str, Any]], big: int, small: int, quick: bool,
           stamp: str | None = None, full: bool = True) -> None:  # fmt: skip
    sf = out["shardflow"]
    celery = {k: v for k, v in out.items() if k.startswith("celery") and k != CONFIRMING}

    def best(key: str, figure: str, higher: bool) -> float:
        values = [c[key][figure] for c in celery.values()]
        return max(values) if higher else min(values)

    def ratio(key: str, figure: str, higher: bool, variant: str = "") -> float:
        return float(sf[key + variant][figure] / best(key, figure, higher))

    ratios = {}
    for m in (small, big) if full else ():
        for variant, _ in A_VARIANTS:
            a = f"A_M{m}{variant}"
            ratios[f"{a}_tasks_per_s"] = ratio(f"A_M{m}", "tasks_per_s", True, variant)
            ratios[f"{a}_latency_p50"] = ratio(f"A_M{m}", "latency_p50_ms", False, variant)
            ratios[f"{a}_latency_p99"] = ratio(f"A_M{m}", "latency_p99_ms", False, variant)
            # CPU seconds of every process per task: the cost, which a busy machine's noise
            # moves much less than tasks/s; target <= 0.33
            ratios[f"{a}_cpu_per_task"] = ratio(f"A_M{m}", "cpu_s_per_1000_tasks", False, variant)

    def per_round(figure: str, higher: bool, mine: str = "B_rounds") -> float:
        theirs = [c["B_rounds"] for c in celery.values()]
        return median_ratio(sf[mine], theirs, figure, higher)

    ratios["B_M1_step_p50"] = per_round("step_p50_ms", False)
    ratios["B_M1_step_p99"] = ratio("B_M1", "step_p99_ms", False)  # over every round's chains
    ratios[f"B_M{small}_tasks_per_s"] = per_round("tasks_per_s", True)
    ratios[f"B_M{small}_cpu_per_task"] = per_round("cpu_s_per_1000_tasks", False)
    # A step's floor under the design card (bench/floor.py) against Celery's step: what the
    # design costs; shardflow's step against the floor: what shardflow's own code costs.
    ratios["B_M1_floor_over_celery"] = per_round("step_p50_ms", False, "B_floor_rounds")
    ratios["B_M1_step_over_floor"] = median_ratio(
        sf["B_rounds"], [sf["B_floor_rounds"]], "step_p50_ms", False
    )
    # The same at M=small: what the design allows for chains under load, and what of it
    # shardflow's code takes.
    ratios[f"B_M{small}_floor_over_celery"] = per_round("tasks_per_s", True, "B_floor_rounds")
    for figure, name, higher in (("tasks_per_s", "tasks_per_s", True),
                                 ("cpu_s_per_1000_tasks", "cpu_per_task", False)):  # fmt: skip
        ratios[f"B_M{small}_{name}_over_floor"] = median_ratio(
            sf["B_rounds"], [sf["B_floor_rounds"]], figure, higher
        )
    # Against Celery with publisher confirms, as shardflow publishes (not a target's ratio).
    confirming = [out[CONFIRMING]["B_rounds"]]
    ratios["B_M1_step_p50_same_guarantee"] = median_ratio(
        sf["B_rounds"], confirming, "step_p50_ms", False
    )
    for figure, name, higher in (("tasks_per_s", "tasks_per_s", True),
                                 ("cpu_s_per_1000_tasks", "cpu_per_task", False)):  # fmt: skip
        ratios[f"B_M{small}_{name}_same_guarantee"] = median_ratio(
            sf["B_rounds"], confirming, figure, higher
        )
    in_flight = [k for k in sf if k.startswith("rss_mb_")]
    if in_flight:
        ratios["rss_many_over_few"] = sf[in_flight[-1]] / sf[in_flight[0]]
    ratios = {k: round(v, 2) for k, v in ratios.items()}  # fmt: skip
    result: dict[str, Any] = {
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}",
        "command": "make bench" + (" (--quick)" if quick else "")
        + ("" if full else " (--chains)"),
        # shardflow's processes; shape C varies the orchestrators beside WORKERS workers, and
        # the RSS figures run one orchestrator and one worker of concurrency 1
        "fleet": {"orchestrators": ORCHESTRATORS, "workers": WORKERS, "concurrency": CONCURRENCY},
        "note": "shardflow runs every task on its parallel pool in these shapes; "
        "A_*: the bag with no chunk (the default: adaptive); A_*_chunk1: one member per "
        "message (\"chunk\": 1, the default before adaptive chunks); A_*_chunk10: the same bag "
        "sent as one task message (\"chunk\": 10); "
        "cpu_s_per_1000_tasks: CPU seconds of every process involved (orchestrators or Celery "
        "workers with their children, the shared RabbitMQ and Redis, the client) per 1,000 "
        "tasks; messages_*: broker publishes and deliveries per task (RabbitMQ's firehose, "
        f"{COUNTED} programs, not a timed run); shards: each orchestrator's CPU share and "
        "each shard queue's ready messages, sampled during the run",
        "figures": out,
        "ratios": ratios,
    }  # fmt: skip
    stamp = stamp or result["date"] + ("-quick" if quick else "")
    stamp += "" if full else "-chains"
    path = ROOT / "bench" / "results" / f"{stamp}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(table(out, big, small))
    for key in (f"A_M{big}{variant}" for variant, _ in A_VARIANTS):
        shards = sf.get(key, {}).get("shards", {})
        for kind, samples in shards.items():
            if isinstance(samples, dict):
                print(f"{key} {kind} (max / mean): " + ", ".join(
                    f"{k} {v['max']} / {v['mean']}" for k, v in samples.items()))  # fmt: skip
    print(
        "ratios (shardflow over Celery's best; *_same_guarantee over Celery with confirms; "
        "the floor's as named):"
    )
    for key, value in ratios.items():
        print(f"  {key:36} {value}")
    if not full:
        print(f"written: {path.relative_to(ROOT)}")
        return
    chart(result, ROOT / "bench" / "results" / f"{stamp}.png", big, small)
    print(f"written: {path.relative_to(ROOT)} and its .png")


def table(out: dict[str, dict[str, Any]], big: int, small: int) -> str:
    """Both systems side by side, one row per figure."""
    cost = (("CPU-s/1000 tasks", "cpu_s_per_1000_tasks"), ("cores used", "cpu_cores"),
            ("machine cores busy", "machine_cores"))  # fmt: skip
    rows = [(f"A M={m}{label}: {name}", f"A_M{m}{variant}", figure)
            for m in (small, big) for variant, label in (("", ""), ("_chunk1", " chunk 1"),
                                                         ("_chunk10", " chunk 10"))
            for name, figure in (("tasks/s", "tasks_per_s"), ("p50 ms", "latency_p50_ms"),
                                 ("p99 ms", "latency_p99_ms"), *cost)]  # fmt: skip
    rows += [("B M=1: step p50 ms", "B_M1", "step_p50_ms"),
             ("B M=1: floor step p50 ms", "B_M1_floor", "step_p50_ms"),
             ("B M=1: step p99 ms", "B_M1", "step_p99_ms"),
             (f"B M={small}: tasks/s", f"B_M{small}", "tasks_per_s")]  # fmt: skip
    rows += [(f"B M={small}: {name}", f"B_M{small}", figure) for name, figure in cost]
    rows += [
        (f"B M={small}: floor tasks/s", f"B_M{small}_floor", "tasks_per_s"),
        (f"B M={small}: floor CPU-s/1000", f"B_M{small}_floor", "cpu_s_per_1000_tasks"),
    ]
    rows += [(f"{shape}: broker {kind}/task", f"messages_{shape}", f"{kind}_per_task")
             for shape in ("A", "A_chunk1", "A_chunk10", "B")
             for kind in ("published", "delivered")]  # fmt: skip
    systems = list(out)
    lines = [f"{'figure':30}" + "".join(f"{name:>27}" for name in systems)]
    for label, key, figure in rows:
        cells = [out[name].get(key, {}).get(figure) for name in systems]
        lines.append(f"{label:30}" + "".join(f"{'-' if c is None else c:>27}" for c in cells))
    extra = {k: v for k, v in out["shardflow"].items() if isinstance(v, int | float)}
    for key, value in out["shardflow"].items():
        if key.startswith("C_"):
            extra[key] = value["tasks_per_s"]
            extra[f"{key} CPU-s/1000 tasks"] = value["cpu_s_per_1000_tasks"]
    lines += [f"{key:48}{value:>10}" for key, value in extra.items()]
    return "\n".join(lines)


def chart(result: dict[str, Any], path: Path, big: int, small: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = result["figures"]
    systems = list(figures)

    def bars(key: str, figure: str) -> list[tuple[str, float]]:
        shown = [(name, figures[name][key][figure]) for name in systems if key in figures[name]]
        for variant, label in (("_chunk10", "chunk 10"), ("_chunk1", "chunk 1")):
            if key + variant in figures["shardflow"]:
                value = figures["shardflow"][key + variant][figure]
                shown.insert(1, (f"shardflow\n{label}", value))
        if key + "_floor" in figures["shardflow"]:  # the same step with no shardflow code
            shown.insert(
                1, ("floor\n(bench/floor.py)", figures["shardflow"][key + "_floor"][figure])
            )
        return shown

    panels = [
        (f"A M={big}: tasks/s (higher is better)", bars(f"A_M{big}", "tasks_per_s")),
        (f"A M={big}: latency p50 ms", bars(f"A_M{big}", "latency_p50_ms")),
        (f"A M={big}: CPU-s per 1000 tasks", bars(f"A_M{big}", "cpu_s_per_1000_tasks")),
        ("B M=1: per-step p50 ms", bars("B_M1", "step_p50_ms")),
        (f"B M={small}: tasks/s", bars(f"B_M{small}", "tasks_per_s")),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(21, 4))
    for axis, (title, shown) in zip(axes, panels, strict=True):
        labels = [label for label, _ in shown]
        colours = [
            "#2a7"
            if label.startswith("shardflow")
            else "#999"
            if label.startswith("floor")
            else "#c84"
            for label in labels
        ]
        axis.bar(labels, [value for _, value in shown], color=colours)
        axis.set_title(title, fontsize=10)
        axis.tick_params(axis="x", labelsize=7, rotation=15)
    fig.suptitle(f"shardflow vs Celery, {result['date']}, {result['machine']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    asyncio.run(main())
