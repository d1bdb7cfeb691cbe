"""Chains under load on one orchestrator and one worker, with the CPU of each process.

    .venv/bin/python bench/chainload.py [--programs 200] [--rounds 3] [--spy SECONDS]
                                        [--orchestrators 1] [--workers 1] [--concurrency 16]
                                        [--stamp NAME]

Starts one orchestrator (every shard) and one parallel worker, or `--orchestrators` splitting
the shards and `--workers` of `--concurrency` (bench/compare.py's fleet is 1 and 1), submits
`--programs` chains of 20 no-op tasks at once and waits for them all, `--rounds` times. Prints
each round's tasks/s and CPU seconds per 1,000 tasks by group (owners, workers, RabbitMQ,
Redis, this client), as bench/floor.py's loaded run does for the floor. `--spy S` also records
each process with py-spy for S seconds (200 samples a second, raw stacks) into
bench/results/logs/, for a profile of where a chain task's CPU goes. Writes
bench/results/chainload-<stamp>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.compare import MAX_WORKERS, spawn, stop  # noqa: E402
from bench.cpu import Meter, cost  # noqa: E402
from bench.services import drop_vhost, fleet, write_result  # noqa: E402
from orchestrator.settings import Settings  # noqa: E402

STEPS = 20
WAIT_S = 300.0


async def rounds(
    settings: Settings, programs: int, count: int, pids: dict[str, list[int]]
) -> list[Any]:
    from orchestrator.connections import connected
    from router.client import Router

    program = {"name": "B", "steps": [{"task": "step", "pool": "parallel"}] * STEPS}
    found = []
    async with connected(settings, "bench-chainload") as (store, bus):
        router = Router(settings, store=store, bus=bus)
        for number in range(count):
            meter = Meter(pids)
            meter.start()
            started = time.monotonic()
            ids = [(await router.submit(program)).workflow_id for _ in range(programs)]
            for wf in ids:
                status = await router.wait(wf, timeout_s=WAIT_S)
                assert status["status"] == "completed", status
            tasks = programs * STEPS
            wall = time.monotonic() - started
            figures = {"tasks_per_s": round(tasks / wall, 1), **cost(meter, started, tasks)}
            print(f"round {number + 1}: {figures}", flush=True)
            found.append(figures)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--programs", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--spy", type=int, default=0, help="py-spy seconds (0: none)")
    parser.add_argument("--orchestrators", type=int, default=1, help="the shards split among")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=16, help="each worker's tasks at once")
    parser.add_argument("--stamp", default=date.today().isoformat(), help="results' file name")
    args = parser.parse_args()
    ring = Settings().shards
    if not (1 <= args.orchestrators <= ring and 1 <= args.workers <= MAX_WORKERS):
        parser.error(f"--orchestrators: 1 to {ring}; --workers: 1 to {MAX_WORKERS}")
    if not 1 <= args.concurrency <= 1000:  # as SHARDFLOW_PARALLEL_CONCURRENCY
        parser.error("--concurrency: 1 to 1000")
    name = "shardflow-chainload"
    settings, env = fleet(name, "sfc")
    logs = ROOT / "bench" / "results" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    cli = [sys.executable, "-m", "shardflow"]
    shards = list(range(settings.shards))
    worker = [*cli, "worker", "--pool", "parallel", "--app", "bench.tasks"]
    worker += ["--concurrency", str(args.concurrency)]
    processes = {
        f"owner{i}": spawn(
            [*cli, "orchestrator", "--shards", ",".join(map(str, shards[i :: args.orchestrators]))],
            env,
            logs / "chainload-owner.log",
        )
        for i in range(args.orchestrators)
    } | {
        f"worker{i}": spawn(worker, env, logs / "chainload-worker.log") for i in range(args.workers)
    }
    spies = []
    try:
        time.sleep(2.5)  # imports and connections
        if args.spy:
            spy = str(Path(sys.executable).with_name("py-spy"))
            spies = [
                subprocess.Popen(
                    [
                        spy,
                        "record",
                        "-d",
                        str(args.spy),
                        "-r",
                        "200",
                        "-f",
                        "raw",
                        "-o",
                        str(logs / f"chainload-{args.stamp}-{part}.txt"),
                        "-p",
                        str(process.pid),
                    ],
                    stdout=subprocess.DEVNULL,
                )
                for part, process in processes.items()
            ]
        pids: dict[str, list[int]] = {"owner": [], "worker": []}
        for part, process in processes.items():
            pids[part.rstrip("0123456789")].append(process.pid)
        found = asyncio.run(rounds(settings, args.programs, args.rounds, pids))
        for process in spies:
            process.wait()
    finally:
        stop(list(processes.values()))
        subprocess.run(["redis-cli", "-n", "2", "flushdb"], capture_output=True)
        drop_vhost(name)
    write_result(
        f"chainload-{args.stamp}",
        {
            "programs": args.programs,
            "orchestrators": args.orchestrators,
            "workers": args.workers,
            "concurrency": args.concurrency,
            "rounds": found,
        },
    )


if __name__ == "__main__":
    main()
