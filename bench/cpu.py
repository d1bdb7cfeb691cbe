"""Shape A on shardflow alone, with the CPU each process used: where a program's cost goes.

    .venv/bin/python bench/cpu.py [--programs 1000] [--chunk 1] [--orchestrators 2]

Uses `bench/compare.py`'s setup (fresh vhost, Redis database 2). Prints the run's figures and
the cores each group of processes used over it (orchestrators, workers, RabbitMQ, Redis, this
client), from /proc/<pid>/stat.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.compare import ROOT, Shardflow, check_a, shape_a

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def pids(pattern: str) -> list[int]:
    found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout
    return [int(pid) for pid in found.split()]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, default=1000)
    parser.add_argument("--chunk", type=int, default=1, help="the bag's chunk")
    parser.add_argument("--orchestrators", type=int, default=2)
    args = parser.parse_args()
    shape = shape_a(args.chunk)
    await asyncio.to_thread(
        subprocess.run, ["redis-cli", "-n", "2", "flushdb"], check=True, capture_output=True
    )
    logs = ROOT / "bench" / "results" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    sf = Shardflow(logs)
    sf.start(orchestrators=args.orchestrators)
    try:
        groups = {
            "orchestrators": [p.pid for p in sf.orchestrators],
            "workers": [p.pid for p in sf.processes[len(sf.orchestrators) :]],
            "rabbitmq": pids("beam.smp"),
            "redis": pids("redis-server"),
            "client": [os.getpid()],
        }
        before = {name: sum(map(cpu_s, group)) for name, group in groups.items()}
        started = time.monotonic()
        figures = await sf.run(shape, args.programs, 12, check_a)
        wall = time.monotonic() - started
        used = {name: sum(map(cpu_s, group)) - before[name] for name, group in groups.items()}
    finally:
        sf.stop()
    print(f"shape A, M={args.programs}, chunk {args.chunk}: {figures}")
    print("cores used: " + ", ".join(f"{k} {v / wall:.2f}" for k, v in used.items()))


if __name__ == "__main__":
    asyncio.run(main())
