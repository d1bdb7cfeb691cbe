"""Fast/slow isolation: fast programs' latency with and without a burst of slow programs.

Runs a whole cluster in this process (every shard, both pools, parallel concurrency C) on the
local RabbitMQ and Redis under a fresh prefix. Fast programs: three no-op steps on the
parallel pool, submitted at a steady rate. Slow programs: one task that sleeps SLOW_S.
Three runs in one process: no burst (the baseline), a burst that fills half the parallel
pool, and a burst twice the pool (there fast programs must queue: the pools' capacity).

    .venv/bin/python bench/isolation.py [--concurrency 32] [--fast 300] [--rate 60] [--fair-share F]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import uuid
from datetime import date
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.services import drop_keys, drop_vhost, machine, vhost  # noqa: E402
from orchestrator.connections import connected  # noqa: E402
from orchestrator.program import parse_program  # noqa: E402
from orchestrator.settings import Settings  # noqa: E402
from orchestrator.shares import share_of  # noqa: E402
from router.client import Router  # noqa: E402
from shardflow.dev import Dev  # noqa: E402
from worker.registry import Registry  # noqa: E402

SLOW_S = 3.0
FAST = {"steps": [{"task": "add", "pool": "parallel", "args": {"n": 1}}] * 3}
SLOW = {"steps": [{"task": "add", "pool": "parallel", "args": {"n": 1, "sleep_s": SLOW_S}}]}


async def run(router: Router, fast: int, rate: float, slow: int) -> list[tuple[float, float]]:
    """Submit `slow` slow programs, then `fast` fast ones at `rate`/s.

    Returns each fast program's (submitted, latency) in ms, submitted counted from the
    scenario's first submit (so the slowest can be set beside the burst's waves)."""
    start_ms = time.time() * 1000  # Redis's clock stamps created_ms: the same host's here
    for _ in range(slow):
        await router.submit(SLOW)
    ids = []
    for _ in range(fast):
        ids.append((await router.submit(FAST)).workflow_id)
        await asyncio.sleep(1 / rate)
    timings = []
    for wf in ids:
        status = await router.wait(wf, timeout_s=120)
        assert status["status"] == "completed", status
        timings.append((status["created_ms"] - start_ms, status["ended_ms"] - status["created_ms"]))
    return timings


def summary(timings: list[tuple[float, float]]) -> dict[str, Any]:
    cuts = statistics.quantiles([latency for _, latency in timings], n=100)
    slowest = sorted(timings, key=lambda t: -t[1])[:5]
    return {
        "p50_ms": round(cuts[49], 1),
        "p99_ms": round(cuts[98], 1),
        # (submitted ms after the scenario's first submit, latency ms) of the five slowest
        "slowest": [[round(at), round(latency)] for at, latency in slowest],
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--fast", type=int, default=300)
    parser.add_argument("--rate", type=float, default=60.0)
    parser.add_argument(
        "--fair-share", type=float, default=Settings().fair_share,
        help="SHARDFLOW_FAIR_SHARE: the most of a worker's slots one kind of program holds "
        "(1: no reserve)",
    )  # fmt: skip
    args = parser.parse_args()
    settings = Settings(
        amqp_url=vhost("shardflow-isolation"),
        prefix=f"bench{uuid.uuid4().hex[:6]}",
        shards=4,
        fair_share=args.fair_share,
    )
    registry = Registry.from_modules(["tests.app"])
    results: dict[str, Any] = {}
    async with connected(settings, "bench-isolation") as (store, bus):
        dev = Dev(settings, registry, store=store, bus=bus, concurrency=args.concurrency)
        running = asyncio.create_task(dev.run())
        router = Router(settings, store=store, bus=bus)
        await run(router, 50, args.rate, 0)  # warm up
        scenarios = {
            "no burst": 0,
            "slow burst, half the pool": args.concurrency // 2,
            "slow burst, twice the pool": args.concurrency * 2,
        }
        for name, slow in scenarios.items():
            started = time.monotonic()
            results[name] = {
                "slow_programs": slow,
                **summary(await run(router, args.fast, args.rate, slow)),
            }
            await asyncio.sleep(SLOW_S + 0.5)  # let the burst finish before the next scenario
            print(f"{name}: done in {time.monotonic() - started:.1f}s", file=sys.stderr)
        dev.shutdown()
        await running
        await drop_keys(store.client, settings.prefix)
    await asyncio.to_thread(drop_vhost, "shardflow-isolation")
    base = results["no burst"]
    ratios = {
        f"{name} / no burst": {
            "p50": round(r["p50_ms"] / base["p50_ms"], 2),
            "p99": round(r["p99_ms"] / base["p99_ms"], 2),
        }
        for name, r in results.items() if name != "no burst"
    }  # fmt: skip
    report = {
        "date": date.today().isoformat(),
        "machine": machine(),
        "command": "python bench/isolation.py " + " ".join(sys.argv[1:]),
        "parallel_concurrency": args.concurrency,
        "fair_share": args.fair_share,
        # Which of the pool's queues each kind goes to: the same one would share its slots.
        "shares": {"fast": share_of(parse_program(FAST)), "slow": share_of(parse_program(SLOW))},
        "fast_programs": args.fast,
        "rate_per_s": args.rate,
        "slow_task_s": SLOW_S,
        "scenarios": results,
        "ratios": ratios,
    }
    stamp = "" if args.fair_share == Settings().fair_share else f"-share{args.fair_share}"
    out = ROOT / "bench" / "results" / f"isolation-{report['date']}{stamp}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'scenario':32} {'slow':>5} {'p50 ms':>8} {'p99 ms':>8}")
    for name, r in results.items():
        print(f"{name:32} {r['slow_programs']:>5} {r['p50_ms']:>8} {r['p99_ms']:>8}")
        print(f"{'':32} slowest (submitted at ms, latency ms): {r['slowest']}")
    for name, ratio in ratios.items():
        print(f"{name}: p50 x{ratio['p50']}, p99 x{ratio['p99']}")
    print(f"written to {out.relative_to(ROOT)}")


if __name__ == "__main__":
    import uvloop

    uvloop.run(main())
