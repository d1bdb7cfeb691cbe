"""The shard owner's window: messages of different programs handled side by side (up to
`SHARDFLOW_PREFETCH` a shard) against one at a time, shardflow alone, in one run: for each
setting, alternating, the fleet of bench/compare.py (2 orchestrators over 4 shards, 2 workers
of 16) runs shape A (no chunk: the default) at M programs, shape B (a 20-task chain) at M=200,
and shape B at M=1 ten times (per-step latency).

    .venv/bin/python bench/window.py [--prefetch 1,16] [--rounds 2] [--programs 400]

Prints, per run, tasks/s, CPU-seconds per 1,000 tasks (every process) with the orchestrators'
share, p50 latency and the machine's busy cores; writes bench/results/window-<date>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import subprocess
from typing import Any

from bench.compare import ROOT, SHAPE_A, SHAPE_B, Shardflow, _per_step, check_a, check_b


def _line(name: str, r: dict[str, Any]) -> str:
    by = r["cpu_s_per_1000_tasks_by_group"]
    return (
        f"{name:16} tasks/s {r['tasks_per_s']:7.1f}  CPU-s/1000 {r['cpu_s_per_1000_tasks']:.2f} "
        f"(orchestrators {by['orchestrators']:.2f})  p50 {r['latency_p50_ms']:7.0f} ms  "
        f"machine {r['machine_cores']} cores"
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefetch", default="1,16", help="settings to alternate")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--programs", type=int, default=400, help="M of shape A")
    args = parser.parse_args()
    settings = [int(p) for p in args.prefetch.split(",")]
    logs = ROOT / "bench" / "results" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        for prefetch in settings:
            await asyncio.to_thread(
                subprocess.run, ["redis-cli", "-n", "2", "flushdb"], check=True, capture_output=True
            )
            os.environ["SHARDFLOW_PREFETCH"] = str(prefetch)  # the fleet inherits it
            sf = Shardflow(logs)
            sf.start(orchestrators=2)
            try:
                a = await sf.run(SHAPE_A, args.programs, 12, check_a)
                b = await sf.run(SHAPE_B, 200, 20, check_b)
                steps = _per_step([await sf.run(SHAPE_B, 1, 20, check_b) for _ in range(10)])
            finally:
                sf.stop()
            print(f"round {round_ + 1}, prefetch {prefetch}:", flush=True)
            print("  " + _line(f"A M={args.programs}", a), flush=True)
            print("  " + _line("B M=200", b), flush=True)
            print(f"  B M=1 step p50 {steps['step_p50_ms']} ms", flush=True)
            runs.append({"round": round_ + 1, "prefetch": prefetch, "A": a, "B_M200": b,
                         "B_M1": steps})  # fmt: skip
    stamp = datetime.date.today().isoformat()
    path = ROOT / "bench" / "results" / f"window-{stamp}.json"
    path.write_text(json.dumps({"command": "bench/window.py", "args": vars(args),
                                "runs": runs}, indent=1))  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    asyncio.run(main())
