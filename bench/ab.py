"""Settings against each other in one run, alternating, shardflow alone: for each round and
each value, bench/compare.py's fleet (1 orchestrator owning 4 shards, 1 worker of 16) runs
shape A at M programs (no chunk: the default, unless --chunk), shape B (a 20-task chain) at
M=200, and shape B at M=1 ten times (per-step latency). Medians over the rounds at the end.

    .venv/bin/python bench/ab.py --set SHARDFLOW_PREFETCH=1,16 [--rounds 3] [--programs 400]
    .venv/bin/python bench/ab.py --set SHARDFLOW_AMQP_COALESCING=false,true --chunk 1
    .venv/bin/python bench/ab.py --ref HEAD~3 [--set ...]    # that commit's code against this
    .venv/bin/python bench/ab.py --set fleet=2x2,1x1         # orchestrators x workers

`fleet` is no setting but the fleet's shape: orchestrators (splitting the shards) x workers;
bench/compare.py's (1x1) unless set.

Every value is a whole configuration: the other `--set`s keep their first value, and a
`--set` of several names (`--set A,B=1:2,3:4`) moves them together. `--ref REF` runs each
configuration twice, the fleet on REF's code (a git worktree under /tmp) and on this
checkout's; the client is this checkout's either way (the wire format is the same).

This machine's speed moves between runs (bench/README.md), so only figures of one run are
compared; read and write system calls per task (/proc/<pid>/io) move much less than CPU
seconds. Writes bench/results/ab-<stamp>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import statistics
import subprocess
from pathlib import Path
from typing import Any

from bench.compare import (
    MAX_WORKERS,
    ORCHESTRATORS,
    ROOT,
    SHAPE_B,
    SHARDS,
    WORKERS,
    Shardflow,
    _per_step,
    check_a,
    check_b,
    shape_a,
)


def _line(name: str, r: dict[str, Any]) -> str:
    by = r["cpu_s_per_1000_tasks_by_group"]
    calls = r["syscalls_per_task_by_group"]
    return (
        f"{name:10} tasks/s {r['tasks_per_s']:7.1f}  CPU-s/1000 {r['cpu_s_per_1000_tasks']:.2f} "
        f"(orch {by['orchestrators']:.2f}, workers {by['workers']:.2f}, rabbit "
        f"{by['rabbitmq']:.2f})  syscalls/task orch {calls['orchestrators']:.2f} workers "
        f"{calls['workers']:.2f}  p50 {r['latency_p50_ms']:6.0f} ms  machine "
        f"{r['machine_cores']}"
    )


def _configurations(sets: list[str]) -> list[dict[str, str]]:
    """The configurations to alternate: the values of one `--set` each, the others first."""
    parsed = []
    for item in sets:
        names, _, values = item.partition("=")
        keys = names.split(",")
        options = [dict(zip(keys, v.split(":"), strict=True)) for v in values.split(",")]
        parsed.append(options)
    base: dict[str, str] = {k: v for options in parsed for k, v in options[0].items()}
    found = [base]
    for options in parsed:
        found += [{**base, **option} for option in options[1:]]
    return found


def _fleet(text: str) -> tuple[int, int]:
    """`fleet=OxW`: orchestrators (1 to the shards) and workers (1 to MAX_WORKERS)."""
    try:
        orchestrators, workers = (int(part) for part in text.split("x"))
    except ValueError:
        raise SystemExit(f"fleet={text!r}: expected OxW, such as 2x2") from None
    if not (1 <= orchestrators <= SHARDS and 1 <= workers <= MAX_WORKERS):
        raise SystemExit(f"fleet={text!r}: 1 to {SHARDS} orchestrators, 1 to {MAX_WORKERS} workers")
    return orchestrators, workers


def _worktree(ref: str) -> Path:
    """A checkout of `ref` beside this one (made once, kept for the next run)."""
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", ref],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    path = Path("/tmp") / f"shardflow-ab-{commit}"
    if not path.exists():
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), commit],
            check=True, capture_output=True,
        )  # fmt: skip
    return path


def _median(runs: list[dict[str, Any]], *path: str) -> float:
    values = []
    for run in runs:
        value: Any = run
        for key in path:
            value = value[key]
        values.append(value)
    return round(statistics.median(values), 3)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", action="append", default=[], help="NAME=V1,V2[,...]")
    parser.add_argument("--ref", help="also run each configuration on this commit's code")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--programs", type=int, default=400, help="M of shape A")
    parser.add_argument("--chunk", type=int, default=None, help="shape A's chunk")
    parser.add_argument("--no-chains", action="store_true", help="shape A only")
    parser.add_argument("--stamp", default=datetime.date.today().isoformat())
    args = parser.parse_args()
    configurations = _configurations(args.set) if args.set else [{}]
    if args.ref:  # the baseline first: the commit's code, then this checkout's
        tree = str(_worktree(args.ref))
        configurations = [c for base in configurations for c in ({**base, "tree": tree}, base)]
    default_fleet = f"{ORCHESTRATORS}x{WORKERS}"
    fleets = [_fleet(c.get("fleet", default_fleet)) for c in configurations]  # checked first
    logs = ROOT / "bench" / "results" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        for configuration, (orchestrators, workers) in zip(configurations, fleets, strict=True):
            await asyncio.to_thread(
                subprocess.run, ["redis-cli", "-n", "2", "flushdb"], check=True, capture_output=True
            )
            settings = {k: v for k, v in configuration.items() if k not in ("tree", "fleet")}
            os.environ.update(settings)  # the fleet inherits it
            sf = Shardflow(logs, Path(configuration.get("tree", ROOT)))
            sf.start(orchestrators=orchestrators, workers=workers)
            fleet = f"{orchestrators}x{workers}"  # recorded even when not set
            run: dict[str, Any] = {"round": round_ + 1, "set": configuration, "fleet": fleet}
            try:
                run["A"] = await sf.run(shape_a(args.chunk), args.programs, 12, check_a)
                if not args.no_chains:
                    run["B_M200"] = await sf.run(SHAPE_B, 200, 20, check_b)
                    b1 = [await sf.run(SHAPE_B, 1, 20, check_b) for _ in range(10)]
                    run["B_M1"] = _per_step(b1)
            finally:
                sf.stop()
            print(f"round {round_ + 1}, {configuration}:", flush=True)
            print("  " + _line(f"A M={args.programs}", run["A"]), flush=True)
            if not args.no_chains:
                print("  " + _line("B M=200", run["B_M200"]), flush=True)
                print(f"  B M=1 step p50 {run['B_M1']['step_p50_ms']} ms", flush=True)
            runs.append(run)
    medians = []
    for configuration, (orchestrators, workers) in zip(configurations, fleets, strict=True):
        mine = [run for run in runs if run["set"] == configuration]
        row: dict[str, Any] = {"set": configuration, "fleet": f"{orchestrators}x{workers}"}
        for part in ("A", "B_M200") if not args.no_chains else ("A",):
            row[part] = {
                "tasks_per_s": _median(mine, part, "tasks_per_s"),
                "cpu_s_per_1000_tasks": _median(mine, part, "cpu_s_per_1000_tasks"),
                "latency_p50_ms": _median(mine, part, "latency_p50_ms"),
            }
        if not args.no_chains:
            row["B_M1_step_p50_ms"] = _median(mine, "B_M1", "step_p50_ms")
        medians.append(row)
        print(f"median of {args.rounds}, {configuration}: {json.dumps(row)}", flush=True)
    path = ROOT / "bench" / "results" / f"ab-{args.stamp}.json"
    found = {"command": "bench/ab.py", "args": vars(args), "medians": medians, "runs": runs}
    path.write_text(json.dumps(found, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    asyncio.run(main())
