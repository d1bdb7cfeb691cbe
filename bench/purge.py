"""`shardflow purge` on a keyspace of many kept programs and another prefix's keys: the time
and the Redis round trips of a purge that purges nothing (`--older-than 2h`, every program
ended 1 h ago) and of one that purges them all.

    .venv/bin/python bench/purge.py [--programs 5000] [--others 20000]

On a private redis-server (no persistence) on a free port, so its counters are this run's
alone: round trips are its read events (INFO stats total_reads_processed). To compare with
an older commit: `git archive <commit> | tar -x -C /tmp/old` and run this file with
PYTHONPATH=/tmp/old.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from redis.asyncio import Redis

ROOT = Path(os.environ.get("PYTHONPATH") or Path(__file__).resolve().parent.parent)
sys.path.insert(0, str(ROOT))

from orchestrator.keys import Keys  # noqa: E402
from orchestrator.redis_store import RedisStore  # noqa: E402
from router.retention import purge  # noqa: E402


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def fill(client: Redis, keys: Keys, programs: int, others: int) -> None:
    """Programs ended 1 h ago (state, plan, registry naming two outputs, both index entries)
    and `others` keys of another prefix."""
    ended = int(time.time() * 1000) - 3_600_000
    for start in range(0, programs, 1000):
        async with client.pipeline(transaction=False) as pipe:
            for i in range(start, min(start + 1000, programs)):
                wf = f"w{i}"
                pipe.hset(keys.state(wf), mapping={"status": "completed", "ended_ms": ended})
                pipe.set(keys.plan(wf), "{}")
                outputs = [keys.output(wf, "0"), keys.output(wf, "1")]
                for name in outputs:
                    pipe.set(name, "1")
                pipe.sadd(keys.registry(wf), *outputs)
                pipe.zadd(keys.index_created, {wf: ended - 1000})
                pipe.zadd(keys.index_ended, {wf: ended})
            await pipe.execute()
    for start in range(0, others, 1000):
        async with client.pipeline(transaction=False) as pipe:
            for i in range(start, min(start + 1000, others)):
                pipe.hset(f"other:{{x{i}}}:state", "status", "completed")
            await pipe.execute()


async def measured(client: Redis, store: RedisStore, **options: float) -> dict[str, object]:
    before = await client.info("stats")
    started = time.perf_counter()
    counts = await purge(store, **options)  # type: ignore[arg-type]
    seconds = time.perf_counter() - started
    after = await client.info("stats")
    return {
        "seconds": round(seconds, 3),
        "counts": dict(counts),
        "round_trips": after["total_reads_processed"] - before["total_reads_processed"] - 1,
        "commands": after["total_commands_processed"] - before["total_commands_processed"] - 1,
    }


async def run(port: int, programs: int, others: int) -> dict[str, object]:
    client = Redis(port=port, decode_responses=True)
    try:
        for _ in range(100):
            try:
                await client.ping()
                break
            except OSError:
                await asyncio.sleep(0.05)
        keys = Keys("bp")
        await fill(client, keys, programs, others)
        store = RedisStore(Redis(port=port, decode_responses=True), keys)
        await store.load_scripts()
        try:
            return {
                "code": str(ROOT),
                "keys": await client.dbsize(),
                "purges_nothing": await measured(client, store, older_than_s=7200),
                "purges_all": await measured(client, store),
                "left": await client.dbsize(),
            }
        finally:
            await store.close()
    finally:
        await client.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, default=5000)
    parser.add_argument("--others", type=int, default=20000)
    args = parser.parse_args()
    port, where = free_port(), tempfile.mkdtemp(prefix="sf-bench-purge-")
    server = subprocess.Popen(
        ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--dir", where,
         "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        print(json.dumps(asyncio.run(run(port, args.programs, args.others)), indent=2))
    finally:
        server.terminate()
        server.wait()
        shutil.rmtree(where, ignore_errors=True)


if __name__ == "__main__":
    main()
