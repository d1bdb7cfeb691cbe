"""Growth: does shardflow's cost per task stay flat as the number of programs grows?

    .venv/bin/python bench/growth.py [--sizes 1000,10000] [--iterations 10000] [--sweep-s S]

Uses `bench/compare.py`'s setup (fresh vhost, Redis database 2, its fleet of processes,
restarted and database emptied for each size) and its figures (`bench/cpu.py`'s CPU):

- shape A at each M of `--sizes`, submitted at once: tasks/s, latency p50/p99, CPU seconds per
  1,000 tasks of every process; every 0.5 s, each orchestrator's RSS, Redis `used_memory` and
  the live programs (the shards' live sets), giving Redis bytes per live program at the peak
  of live programs (over the database-empty baseline). Ratios against the first size.
- one program with an untiloop of `--iterations` iterations of one task (`bench/footprint.py`'s
  loop, keep_iterations 1): seconds per iteration for each block of 1,000 (read from the
  cursor every 20 ms), orchestrator RSS and the program's Redis keys and bytes near the start
  and at the end.

`--sweep-s` sets the orchestrators' SHARDFLOW_SWEEP_S (default: theirs, 30 s), to see what the
periodic sweep of live programs costs at a size; `--sweep-live 1000,10000` times one
`Orchestrator.sweep()` (all shards, in this process) with that many programs live and held.
`--queue-version 2` sets a policy on the bench's vhost that makes its classic queues version 2
(RabbitMQ 3.10+): how the broker bears starts waiting by the 100,000 (bench/README.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.compare import SHAPE_A, SHARDS, Shardflow, check_a, rss_mb  # noqa: E402
from bench.footprint import footprint, loop  # noqa: E402
from bench.services import drop_vhost, machine, queue_version  # noqa: E402
from orchestrator.connections import connected  # noqa: E402
from orchestrator.redis_store import RedisStore  # noqa: E402
from router.client import Router  # noqa: E402

BLOCK = 1000  # loop iterations per timed block


async def used_memory(store: RedisStore) -> int:
    return int((await store.client.info("memory"))["used_memory"])


async def live_programs(store: RedisStore) -> int:
    return sum([await store.in_flight(shard) for shard in range(SHARDS)])


def orchestrator_rss(sf: Shardflow) -> float:
    """The larger orchestrator's RSS, MB."""
    return round(max(rss_mb(p.pid) for p in sf.orchestrators), 1)


class Samples:
    """Every 0.5 s until `done`: each orchestrator's RSS, Redis used_memory, live programs."""

    def __init__(self, sf: Shardflow, store: RedisStore, baseline: int) -> None:
        self.sf, self.store, self.baseline = sf, store, baseline
        self.rss: list[list[float]] = []  # per sample, per orchestrator
        self.memory: list[int] = []
        self.live: list[int] = []

    async def run(self, done: asyncio.Event, every_s: float = 0.5) -> None:
        while not done.is_set():
            self.rss.append([rss_mb(p.pid) for p in self.sf.orchestrators])
            self.memory.append(await used_memory(self.store))
            self.live.append(await live_programs(self.store))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), every_s)

    def figures(self) -> dict[str, Any]:
        peak = max(range(len(self.live)), key=lambda i: (self.live[i], -i))
        return {
            "orchestrator_rss_mb_max": round(max(max(s) for s in self.rss), 1),
            "orchestrator_rss_mb_start": round(max(self.rss[0]), 1),
            "redis_used_memory_mb_max": round((max(self.memory) - self.baseline) / 2**20, 1),
            "live_programs_peak": self.live[peak],
            "redis_bytes_per_live_program_at_peak": round(
                (self.memory[peak] - self.baseline) / max(1, self.live[peak])
            ),
        }


async def _flush() -> None:
    """Empty the bench's Redis database (2): each part starts from nothing."""
    await asyncio.to_thread(
        subprocess.run, ["redis-cli", "-n", "2", "flushdb"], check=True, capture_output=True
    )


async def shape_a_at(sf: Shardflow, m: int) -> dict[str, Any]:
    """One size of shape A, with a fresh database and fresh orchestrators."""
    await _flush()
    sf.start()
    try:
        async with connected(sf.settings, "bench-growth") as (store, _):
            assert isinstance(store, RedisStore)
            samples = Samples(sf, store, await used_memory(store))
            done = asyncio.Event()
            sampler = asyncio.create_task(samples.run(done))
            try:
                result = await sf.run(SHAPE_A, m, 12, check_a)
            finally:
                done.set()
                await sampler
            result.update(samples.figures())
            result["redis_bytes_per_finished_program"] = round(
                (await used_memory(store) - samples.baseline) / m
            )
    finally:
        sf.stop()
    return result


async def long_loop(sf: Shardflow, iterations: int) -> dict[str, Any]:
    await _flush()
    sf.start()
    try:
        async with connected(sf.settings, "bench-growth") as (store, bus):
            assert isinstance(store, RedisStore)
            router = Router(sf.settings, store=store, bus=bus)
            wf = (await router.submit(loop(iterations, 1))).workflow_id
            state = store.keys.state(wf)
            reached: dict[int, float] = {}  # iteration -> when the cursor was first seen on it
            start: dict[str, Any] = {}
            status = "pending"
            while status in ("pending", "running"):
                status, cursor = await store.client.hmget(state, ["status", "cursor"])
                if cursor and "/iter:" in cursor:
                    iteration = int(cursor.split("/iter:", 1)[1].split("/", 1)[0])
                    reached.setdefault(iteration, time.monotonic())
                    if not start and iteration >= 100:
                        keys, size = await footprint(store, wf)
                        start = {"iteration": iteration, "keys": keys, "bytes": size,
                                 "orchestrator_rss_mb": orchestrator_rss(sf)}  # fmt: skip
                await asyncio.sleep(0.02)
            ended = time.monotonic()
            final = await router.wait(wf, timeout_s=60)
            assert final["status"] == "completed" and final["result"]["k"] == iterations, final
            keys, size = await footprint(store, wf)
            end = {"keys": keys, "bytes": size,
                   "orchestrator_rss_mb": orchestrator_rss(sf)}  # fmt: skip
    finally:
        sf.stop()
    # when each block of iterations began, and when the loop ended (0 is the first iteration)
    marks = [min(t for i, t in reached.items() if i >= b) for b in range(0, iterations, BLOCK)]
    marks.append(ended)
    per_iteration_ms = [round((b - a) * 1000 / BLOCK, 3) for a, b in itertools.pairwise(marks)]
    return {
        "iterations": iterations,
        "ms_per_iteration_by_block": per_iteration_ms,
        "last_block_over_first": round(per_iteration_ms[-1] / per_iteration_ms[0], 3),
        "start": start,
        "end": end,
    }


async def sweep_cost(sf: Shardflow, counts: list[int]) -> dict[str, dict[str, float]]:
    """One `Orchestrator.sweep()` of every shard, timed in this process (wall and CPU) with
    `count` programs live: each waits on a task that holds the only worker slot, so nothing
    else moves while it runs (the fleet's own sweep every `sweep_s` aside)."""
    from orchestrator.owner import Orchestrator

    await _flush()
    sf.start(orchestrators=1, worker_concurrency=1, workers=1)
    program = {"steps": [{"task": "hold", "pool": "parallel", "args": {"s": 600}}]}
    result = {}
    try:
        async with connected(sf.settings, "bench-growth") as (store, bus):
            assert isinstance(store, RedisStore)
            router = Router(sf.settings, store=store, bus=bus)
            sweeper = Orchestrator(sf.settings, range(SHARDS), store=store, bus=bus)
            submitted = 0
            for count in counts:
                while submitted < count:
                    batch = range(submitted, min(count, submitted + 50))
                    await asyncio.gather(*(router.submit(program) for _ in batch))
                    submitted += len(batch)
                for _ in range(1200):  # until every start is handled: the programs run
                    if not sum([(await bus.shard_queue_state(s) or (0, 0))[0]
                                for s in range(SHARDS)]):  # fmt: skip
                        break
                    await asyncio.sleep(0.5)
                wall, cpu = time.perf_counter(), time.process_time()
                await sweeper.sweep()
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                result[str(count)] = {
                    "live": await live_programs(store),
                    "sweep_wall_s": round(wall, 3),
                    "sweep_client_cpu_s": round(cpu, 3),
                    "orchestrator_rss_mb": orchestrator_rss(sf),
                }
                print(f"sweep with {count} live: {result[str(count)]}", flush=True)
    finally:
        sf.stop()
    return result


def ratios(sizes: dict[int, dict[str, Any]]) -> dict[str, dict[str, float]]:
    first = sizes[min(sizes)]
    keys = ("tasks_per_s", "latency_p50_ms", "latency_p99_ms", "cpu_s_per_1000_tasks",
            "orchestrator_rss_mb_max", "redis_bytes_per_live_program_at_peak")  # fmt: skip
    return {
        f"M{m}/M{min(sizes)}": {k: round(run[k] / first[k], 3) for k in keys}
        for m, run in sizes.items()
        if m != min(sizes)
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000", help="M of shape A, comma-separated")
    parser.add_argument("--iterations", type=int, default=10_000, help="0: no loop run")
    parser.add_argument("--sweep-s", type=float, default=None)
    parser.add_argument(
        "--sweep-live", default="", help="time one sweep with these many programs live: 1000,..."
    )
    parser.add_argument("--stamp", help="results' file name (default: growth-<date>)")
    parser.add_argument(
        "--queue-version", type=int, choices=(1, 2), default=None,
        help="classic queue version, by a policy on the vhost (default: the broker's)",
    )  # fmt: skip
    args = parser.parse_args()
    logs = ROOT / "bench" / "results" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    sf = Shardflow(logs)
    if args.queue_version is not None:
        queue_version("shardflow-bench", args.queue_version)
    if args.sweep_s is not None:
        sf.env["SHARDFLOW_SWEEP_S"] = str(args.sweep_s)
    report: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="minutes"),
        "machine": machine(),
        "command": "python bench/growth.py " + " ".join(sys.argv[1:]),
        "queue_version": args.queue_version or "the broker's default",
    }
    stamp = args.stamp or f"growth-{report['date'][:10]}"
    out = ROOT / "bench" / "results" / f"{stamp}.json"

    def save() -> None:  # after each part: a run cut short keeps what it measured
        out.write_text(json.dumps(report, indent=2) + "\n")

    try:
        sizes: dict[int, dict[str, Any]] = {}
        for m in (int(size) for size in args.sizes.split(",") if size):
            sizes[m] = await shape_a_at(sf, m)
            print(f"shape A M={m}: {json.dumps(sizes[m])}", flush=True)
            report["shape_a"] = {str(m): run for m, run in sizes.items()}
            if len(sizes) > 1:
                report["ratios"] = ratios(sizes)
            save()
        if args.iterations:
            report["loop"] = await long_loop(sf, args.iterations)
            print(f"loop: {json.dumps(report['loop'])}", flush=True)
            save()
        if args.sweep_live:
            counts = [int(count) for count in args.sweep_live.split(",")]
            report["sweep"] = await sweep_cost(sf, counts)
            save()
    finally:
        await asyncio.to_thread(drop_vhost, "shardflow-bench")
        await asyncio.to_thread(
            subprocess.run, ["redis-cli", "-n", "2", "flushdb"], capture_output=True
        )
    print(json.dumps(report.get("ratios", {}), indent=2))
    print(f"written to {out.relative_to(ROOT)}")


if __name__ == "__main__":
    asyncio.run(main())
