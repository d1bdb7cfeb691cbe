"""Redis footprint: keys and bytes per finished program, per live looping program, and what
retention leaves.

Runs a whole cluster in this process on the local RabbitMQ and Redis under a fresh prefix:

- shape A (begin -> bag of 10 -> finish), N programs: keys and bytes (MEMORY USAGE) per
  finished program, then again once their retention (5 s here) has passed;
- an untiloop of 2,000 iterations of one task: the most keys it held while live and its
  keys and bytes at the end, with `keep_iterations` 1 (the default) and, as the same run's
  baseline, with every iteration kept (`keep_iterations` = 1000 on 2,000 iterations keeps
  1000, the old behaviour's order of size).

    .venv/bin/python bench/footprint.py [--programs 200] [--iterations 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import uuid
from datetime import date
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.services import drop_keys, drop_vhost, machine, vhost  # noqa: E402
from orchestrator.connections import connected  # noqa: E402
from orchestrator.redis_store import RedisStore  # noqa: E402
from orchestrator.settings import Settings  # noqa: E402
from router.client import Router  # noqa: E402
from shardflow.dev import Dev  # noqa: E402
from worker.registry import Registry  # noqa: E402

RETENTION_S = 5.0
SHAPE_A = {
    "steps": [
        {"task": "begin", "pool": "parallel"},
        {"bag": [{"task": "member", "args": {"i": i}} for i in range(10)]},
        {"task": "finish", "pool": "parallel"},
    ]
}


def loop(iterations: int, keep: int) -> dict[str, Any]:
    return {
        "steps": [
            {
                "until": f"prev.k >= {iterations}",
                "max_iterations": iterations,
                "keep_iterations": keep,
                "steps": [{"task": "step", "pool": "parallel"}],
            }
        ]
    }


async def footprint(store: RedisStore, wf: str) -> tuple[int, int]:
    """Keys and bytes (MEMORY USAGE) of one program, read while nothing moves it."""
    keys = [key async for key in store.client.scan_iter(match=store.keys.pattern(wf), count=1000)]
    sizes = [await store.client.memory_usage(key) or 0 for key in keys]
    return len(keys), sum(sizes)


async def shape_a(router: Router, store: RedisStore, programs: int) -> dict[str, Any]:
    ids = [(await router.submit(SHAPE_A)).workflow_id for _ in range(programs)]
    for wf in ids:
        assert (await router.wait(wf, timeout_s=120))["status"] == "completed"
    measured = [await footprint(store, wf) for wf in ids]
    await asyncio.sleep(RETENTION_S + 1.0)
    left = [await footprint(store, wf) for wf in ids]
    return {
        "programs": programs,
        "keys_per_finished_program": sum(k for k, _ in measured) / programs,
        "bytes_per_finished_program": round(sum(b for _, b in measured) / programs),
        "keys_left_after_retention": sum(k for k, _ in left),
    }


async def long_loop(
    router: Router, store: RedisStore, iterations: int, keep: int
) -> dict[str, Any]:
    wf = (await router.submit(loop(iterations, keep))).workflow_id
    most = 0
    while (await router.status(wf) or {}).get("status") in ("pending", "running"):
        # The registry names every key beyond state and plan, read in one call.
        most = max(most, 2 + await store.client.scard(store.keys.registry(wf)) + 1)
        await asyncio.sleep(0.05)
    status = await router.wait(wf, timeout_s=600)
    assert status["status"] == "completed", status
    keys, size = await footprint(store, wf)
    return {
        "keep_iterations": keep,
        "most_keys_live": most,
        "keys_at_end": keys,
        "bytes_at_end": size,
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, default=200)
    parser.add_argument("--iterations", type=int, default=2000)
    args = parser.parse_args()
    settings = Settings(
        amqp_url=vhost("shardflow-footprint"),
        prefix=f"bench{uuid.uuid4().hex[:6]}",
        shards=4,
        retention_s=RETENTION_S,
    )
    registry = Registry.from_modules(["bench.tasks"])
    async with connected(settings, "bench-footprint") as (store, bus):
        assert isinstance(store, RedisStore)
        dev = Dev(settings, registry, store=store, bus=bus, concurrency=32)
        running = asyncio.create_task(dev.run())
        router = Router(settings, store=store, bus=bus)
        results = {"shape_a": await shape_a(router, store, args.programs)}
        # measured at once after the end, well within the retention
        results["loop_keep_1"] = await long_loop(router, store, args.iterations, 1)
        results["loop_keep_all"] = await long_loop(
            router, store, args.iterations, min(1000, args.iterations)
        )
        dev.shutdown()
        await running
        await drop_keys(store.client, settings.prefix)
    await asyncio.to_thread(drop_vhost, "shardflow-footprint")
    one, every = results["loop_keep_1"], results["loop_keep_all"]
    report = {
        "date": date.today().isoformat(),
        "machine": machine(),
        "command": "python bench/footprint.py " + " ".join(sys.argv[1:]),
        "iterations": args.iterations,
        **results,
        "ratios": {
            "loop keys at end, keep 1 / keep all": round(
                one["keys_at_end"] / every["keys_at_end"], 4
            ),
            "loop bytes at end, keep 1 / keep all": round(
                one["bytes_at_end"] / every["bytes_at_end"], 4
            ),
        },
    }
    out = ROOT / "bench" / "results" / f"footprint-{report['date']}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    print(f"written to {out.relative_to(ROOT)}")


if __name__ == "__main__":
    import uvloop

    uvloop.run(main())
