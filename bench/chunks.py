"""Adaptive chunks against a chunk named in the program, shardflow alone: shape A at M programs
with no chunk (the default, adaptive), `"chunk": 1` (the default before) and `"chunk": 10`, each
twice, in one run on one cluster (bench/compare.py's fleet).

    .venv/bin/python bench/chunks.py [M]      (default M=400; about a minute)

Prints tasks/s, CPU-seconds per 1,000 tasks (every process), p50 latency, the machine's busy
cores, and the parallel queue's depth (max / mean) for each run.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

from bench.compare import A_VARIANTS, ROOT, Shardflow, check_a


async def main() -> None:
    m = int(sys.argv[1]) if len(sys.argv) > 1 else 400
    await asyncio.to_thread(
        subprocess.run, ["redis-cli", "-n", "2", "flushdb"], check=True, capture_output=True
    )
    logs = ROOT / "bench" / "results" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    sf = Shardflow(logs)
    sf.start()
    try:
        for _ in range(2):
            for variant, shape in A_VARIANTS:
                r = await sf.run(shape, m, 12, check_a, sample=True)
                depth = r["shards"]["queue_depth"]["tasks.parallel"]
                print(
                    f"{variant or 'default':9} tasks/s {r['tasks_per_s']:7.1f}  CPU-s/1000 "
                    f"{r['cpu_s_per_1000_tasks']:.2f}  p50 {r['latency_p50_ms']:7.0f} ms  "
                    f"machine {r['machine_cores']} cores  queue {depth['max']} / {depth['mean']}",
                    flush=True,
                )
    finally:
        sf.stop()


if __name__ == "__main__":
    asyncio.run(main())
