"""Automatic pipelining alone: CPU and latency of a worker's Redis calls, with and without it.

    .venv/bin/python bench/pipelining.py [--seconds 5]

C coroutines each repeat what a worker does per task message: read the program's state hash,
then run a short Lua script, on the local Redis (database 2, a fresh prefix). For C = 1, 4, 16
and 64, with `RedisStore`'s Pipeliner and with plain calls, alternating: calls per second,
CPU seconds per 1000 calls (this process and the Redis server), the median latency of a call,
and for the Pipeliner the commands per round trip.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import uuid
from datetime import date
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from redis.asyncio import Redis  # noqa: E402

from bench.cpu import cpu_s, listener  # noqa: E402
from bench.services import write_result  # noqa: E402
from orchestrator.pipelining import Pipeliner  # noqa: E402

SCRIPT = "return redis.call('HINCRBY', KEYS[1], 'n', 1)"


async def measure(
    client: Redis, prefix: str, c: int, pipelined: bool, seconds: float
) -> dict[str, Any]:
    pipeliner = Pipeliner(client)
    script = client.register_script(SCRIPT)
    await client.script_load(SCRIPT)
    latencies: list[float] = []

    async def call(*command: Any) -> Any:
        if pipelined:
            return await pipeliner.execute(*command)
        return await client.execute_command(*command)

    async def one(k: int, until: float) -> int:
        key = f"{prefix}:{{wf{k}}}:state"
        await client.hset(key, mapping={"status": "running", "cursor": "0", "epoch": "0"})
        done = 0
        while time.monotonic() < until:
            started = time.perf_counter()
            await call("HGETALL", key)
            await call("EVALSHA", script.sha, 1, key)
            latencies.append((time.perf_counter() - started) / 2)
            done += 2
        return done

    redis_pid = listener(6379)
    cpu_before = cpu_s(os.getpid()), cpu_s(redis_pid)
    started = time.monotonic()
    calls = sum(await asyncio.gather(*(one(k, started + seconds) for k in range(c))))
    wall = time.monotonic() - started
    cpu_after = cpu_s(os.getpid()), cpu_s(redis_pid)
    client_s, redis_s = (cpu_after[0] - cpu_before[0]), (cpu_after[1] - cpu_before[1])
    return {
        "calls_per_s": round(calls / wall),
        "cpu_s_per_1000_calls": round(1000 * (client_s + redis_s) / calls, 4),
        "client_cpu_s_per_1000": round(1000 * client_s / calls, 4),
        "redis_cpu_s_per_1000": round(1000 * redis_s / calls, 4),
        "latency_p50_us": round(statistics.median(latencies) * 1e6, 1),
        "commands_per_round_trip": (
            round(pipeliner.commands / pipeliner.sent, 2) if pipelined and pipeliner.sent else 1
        ),
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    client = Redis.from_url("redis://127.0.0.1:6379/2", decode_responses=True)
    prefix = f"bpl{uuid.uuid4().hex[:6]}"
    results: dict[str, Any] = {}
    try:
        for c in (1, 4, 16, 64):
            for pipelined in (False, True, False, True):  # alternating, two of each
                name = f"C={c} {'pipelined' if pipelined else 'plain'}"
                got = await measure(client, prefix, c, pipelined, args.seconds)
                results.setdefault(name, []).append(got)
                print(name, got, flush=True)
    finally:
        keys = [key async for key in client.scan_iter(match=f"{prefix}:*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()
    write_result(f"pipelining-{date.today().isoformat()}", {"runs": results})


if __name__ == "__main__":
    import uvloop

    uvloop.run(main())
