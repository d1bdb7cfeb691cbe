"""The creation index's prune, which every owner runs each sweep: the most memory one prune
holds at once (tracemalloc's peak, in this process under uvloop as an owner runs), checking
PRUNE_SCAN entries in one pipeline against pages of PRUNE_PAGE.

    .venv/bin/python bench/prune.py [--entries 5000] [--rounds 3]

Bytes are counted, not timed, so the figure does not move with the machine's load. Uses
Redis database 2 under a fresh prefix, dropped after.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import tracemalloc
import uuid
from pathlib import Path

import uvloop
from redis.asyncio import Redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.services import drop_keys, machine  # noqa: E402
from orchestrator.keys import Keys  # noqa: E402
from orchestrator.marks import INDEX_GRACE_MS, PRUNE_PAGE, PRUNE_SCAN, Marks  # noqa: E402
from orchestrator.redis_store import RedisStore  # noqa: E402


async def peak(marks: Marks, page: int) -> int:
    """The most bytes traced at once during one prune that drops nothing."""
    tracemalloc.reset_peak()
    before = tracemalloc.get_traced_memory()[0]
    assert await marks.prune_index(page=page) == 0
    return tracemalloc.get_traced_memory()[1] - before


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=PRUNE_SCAN)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    client = Redis.from_url("redis://127.0.0.1:6379/2", decode_responses=True)
    keys = Keys(f"sfprune-{uuid.uuid4().hex[:8]}")
    marks = Marks(RedisStore(client, keys, 3_600_000))
    try:
        # Live programs, old enough to be checked: each prune reads every one and keeps it.
        old = time.time() * 1000 - 2 * INDEX_GRACE_MS
        names = [f"w{i}" for i in range(args.entries)]
        await client.zadd(keys.index_created, {wf: old + i for i, wf in enumerate(names)})
        async with client.pipeline(transaction=False) as pipe:
            for wf in names:
                pipe.hset(keys.state(wf), "status", "running")
            await pipe.execute()
        tracemalloc.start()
        figures: dict[str, list[int]] = {"one pipeline": [], f"pages of {PRUNE_PAGE}": []}
        for _ in range(args.rounds):  # alternating, so both see the same process
            figures["one pipeline"].append(await peak(marks, PRUNE_SCAN))
            figures[f"pages of {PRUNE_PAGE}"].append(await peak(marks, PRUNE_PAGE))
        tracemalloc.stop()
        best = {name: min(values) for name, values in figures.items()}
        report = {
            "machine": machine(),
            "command": "python bench/prune.py " + " ".join(sys.argv[1:]),
            "entries": args.entries,
            "peak_traced_bytes": best,
            "ratio": round(best[f"pages of {PRUNE_PAGE}"] / best["one pipeline"], 3),
        }
        print(json.dumps(report, indent=2))
    finally:
        await drop_keys(client, keys.prefix)
        await client.aclose()


if __name__ == "__main__":
    uvloop.run(main())
