"""Shape A on shardflow alone, with the CPU each process used: where a program's cost goes.

    .venv/bin/python bench/cpu.py [--programs 1000] [--chunk N] [--orchestrators 1]

Uses `bench/compare.py`'s setup (fresh vhost, Redis database 2). Prints the run's figures and
the cores each group of processes used over it (orchestrators, workers, RabbitMQ, Redis, this
client), from /proc/<pid>/stat. The helpers here are also `bench/compare.py`'s cost figures.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TICKS = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> list[str]:
    """/proc/<pid>/stat's fields after the command name (which may hold spaces)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cpu_s(pid: int) -> float:
    fields = _stat(pid)
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def pids(pattern: str) -> list[int]:
    found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout
    return [int(pid) for pid in found.split()]


@functools.cache  # the shared services keep their pids over a benchmark run
def listener(port: int) -> int:
    """The pid listening on a local TCP port: the shared RabbitMQ or Redis, not the private
    brokers tests start (a pattern such as "beam.smp" also matches those, and rabbitmqctl)."""
    out = subprocess.run(
        ["ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True, check=True
    ).stdout
    return int(out.split("pid=", 1)[1].split(",", 1)[0])


def children() -> dict[int, list[int]]:
    """Each live process's children, by parent pid (this kernel has no /proc/.../children)."""
    found: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                found.setdefault(int(_stat(int(entry.name))[1]), []).append(int(entry.name))
            except (FileNotFoundError, ProcessLookupError):
                continue  # ended while we looked
    return found


def tree_cpu_s(pid: int, kids: dict[int, list[int]]) -> float:
    """CPU seconds of `pid`, its live descendants, and the children it has reaped (cutime and
    cstime): an orchestrator's evaluator process, a Celery prefork pool's children."""
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        try:
            fields = _stat(current)
        except (FileNotFoundError, ProcessLookupError):
            continue
        total += sum(int(field) for field in fields[11:15]) / TICKS
        todo += kids.get(current, [])
    return total


def tree_syscalls(pid: int, kids: dict[int, list[int]]) -> int:
    """Read and write system calls (syscr + syscw in /proc/<pid>/io) of `pid` and its live
    descendants: on loopback a socket's send costs 10-30 us, so their count tells a cost that
    the machine's noise does not move."""
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        try:
            lines = Path(f"/proc/{current}/io").read_text().splitlines()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        fields = dict(line.split(": ", 1) for line in lines)
        total += int(fields["syscr"]) + int(fields["syscw"])
        todo += kids.get(current, [])
    return total


def machine_busy_s() -> float:
    """CPU seconds the whole machine was busy (all but idle and iowait), from /proc/stat."""
    fields = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(fields) - fields[3] - fields[4]) / TICKS


class Meter:
    """CPU seconds of groups of process trees over an interval (`start()`, then `used()`), with
    the shared RabbitMQ (beam.smp on 5672), the shared Redis (6379) and this client. The client
    is this process alone: the trees it spawned are the other groups."""

    def __init__(self, groups: dict[str, list[int]]) -> None:
        self.groups = {**groups, "rabbitmq": [listener(5672)], "redis": [listener(6379)]}
        self.before: dict[str, float] = {}
        self.calls_before: dict[str, int] = {}
        self.machine_s = 0.0  # the whole machine's busy CPU seconds over the interval

    def _now(self) -> dict[str, float]:
        kids = children()
        now = {
            name: sum(tree_cpu_s(root, kids) for root in roots)
            for name, roots in self.groups.items()
        }
        return {**now, "client": cpu_s(os.getpid())}

    def _calls(self) -> dict[str, int]:
        kids = children()
        now = {
            name: sum(tree_syscalls(root, kids) for root in roots)
            for name, roots in self.groups.items()
        }
        return {**now, "client": tree_syscalls(os.getpid(), {})}

    def start(self) -> None:
        self.before = self._now()
        self.calls_before = self._calls()
        self.machine_s = -machine_busy_s()

    def used(self) -> dict[str, float]:
        self.machine_s += machine_busy_s()
        return {name: value - self.before[name] for name, value in self._now().items()}

    def calls(self) -> dict[str, int]:
        """Read and write system calls of each group since `start()` (call after `used()`)."""
        return {name: value - self.calls_before[name] for name, value in self._calls().items()}


def cost(meter: Meter, started: float, tasks: int) -> dict[str, Any]:
    """What a run cost: CPU seconds per 1,000 tasks (in all, and by group), cores used."""
    used, wall = meter.used(), time.monotonic() - started
    calls = meter.calls()
    total = sum(used.values())
    return {
        "cpu_s_per_1000_tasks": round(total * 1000 / tasks, 3),
        "cpu_cores": round(total / wall, 2),
        # the whole machine, to see what the groups above leave out (kernel, other processes)
        "machine_cores": round(meter.machine_s / wall, 2),
        "cpu_s_per_1000_tasks_by_group": {k: round(v * 1000 / tasks, 3) for k, v in used.items()},
        # read and write system calls per task (/proc/<pid>/io), by group
        "syscalls_per_task_by_group": {k: round(v / tasks, 2) for k, v in calls.items()},
    }


async def main() -> None:
    from bench.compare import ROOT, Shardflow, check_a, shape_a  # compare imports this module

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, default=1000)
    parser.add_argument(
        "--chunk", type=int, default=None, help="the bag's chunk (default: none, adaptive)"
    )
    parser.add_argument("--orchestrators", type=int, default=1, help="with one worker")
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
        meter = Meter(sf.groups())
        meter.start()
        started = time.monotonic()
        figures = await sf.run(shape, args.programs, 12, check_a)
        wall = time.monotonic() - started
        used = meter.used()
    finally:
        sf.stop()
    print(f"shape A, M={args.programs}, chunk {args.chunk}: {figures}")
    print("cores used: " + ", ".join(f"{k} {v / wall:.2f}" for k, v in used.items()))


if __name__ == "__main__":
    asyncio.run(main())
