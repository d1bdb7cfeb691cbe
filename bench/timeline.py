"""Where a chain step's time goes: a timeline of one step across the owner and the worker.

    .venv/bin/python bench/timeline.py [--chains 10] [--steps 20] [--stamp NAME]

Runs one orchestrator process (every shard) and one parallel worker process, each started
through this file with probes around the calls a step makes (wall clock, one host, so the two
processes' stamps compare), then runs `--chains` chains of `--steps` no-op tasks one after
another, as bench/compare.py's shape B with M=1. Each step k is then cut into its parts:

    owner   got the report of step k-1 .. compare-and-advance .. publish of task k (to confirm)
    broker  the owner's publish began .. the worker got task k
    worker  got task k .. current? .. handler .. record .. publish of the report (to confirm)
    broker  the worker's publish began .. the owner got the report of step k

Each crossing is also cut in three: the publish up to its frames handed to the socket; the
broker, both kernels and the receiver's connection reader up to its channel's handling of
the delivery frame; and from there through aio-pika and shardflow's consumer loop to the
handler (`handle` or `handle_shard_message`).

Prints each part's median in microseconds, and writes bench/results/timeline-<date>.json.
The probes cost a few microseconds each; the step's total is also measured without them
(from the programs' own timestamps) to show what they add.
"""

from __future__ import annotations

import asyncio
import atexit
import bisect
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROBES_ENV = "SHARDFLOW_TIMELINE_OUT"  # where a probed process writes its stamps at exit


def _install_probes(out: str) -> None:
    """Wrap the calls a step makes with stamps (kind, start ns, end ns, path)."""
    from orchestrator import owner
    from orchestrator.bus import Bus
    from orchestrator.redis_store import RedisStore
    from worker.pool import Worker

    stamps: list[tuple[str, int, int, str]] = []

    def path_of(body: bytes) -> str:
        try:
            return str(json.loads(body).get("path", ""))
        except ValueError:
            return ""

    def probe(holder: Any, name: str, kind: str, path: Callable[..., str]) -> None:
        inner = getattr(holder, name)

        async def probed(*args: Any, **kwargs: Any) -> Any:
            started = time.time_ns()
            try:
                return await inner(*args, **kwargs)
            finally:
                stamps.append((kind, started, time.time_ns(), path(*args, **kwargs)))

        setattr(holder, name, probed)

    probe(owner, "handle_shard_message", "owner", lambda d, *a, **k: path_of(d.body))
    probe(RedisStore, "advance", "advance", lambda *a, **k: a[2] if len(a) > 2 else "")
    probe(Bus, "publish_all", "owner publish", lambda *a, **k: path_of(a[2][0]))
    probe(Worker, "handle", "worker", lambda s, d, *a, **k: path_of(d.body))
    probe(RedisStore, "at", "current?", lambda s, wf, path: path)
    probe(Worker, "_attempt", "handler", lambda s, task, *a, **k: task.path)
    probe(RedisStore, "record", "record", lambda s, wf, path, *a, **k: path)
    probe(Bus, "publish_to_shard", "worker publish", lambda s, o, body, *a, **k: path_of(body))

    # Two moments inside a crossing: the publish's frames handed to the socket, and the
    # delivery's frame read by aiormq (private names: a bench probe, not product code).
    side = "owner" if "orchestrator" in sys.argv else "worker"
    from aiormq.channel import Channel

    from orchestrator.coalescing import CoalescingTransport

    flush = CoalescingTransport.flush

    def flushed(self: CoalescingTransport) -> None:
        if self._held:
            now = time.time_ns()
            stamps.append((f"{side} socket write", now, now, ""))
        flush(self)

    CoalescingTransport.flush = flushed  # type: ignore[method-assign]
    deliver = Channel._on_deliver_frame

    async def delivered(self: Channel, frame: Any) -> None:
        now = time.time_ns()
        stamps.append((f"{side} delivery frame", now, now, ""))
        await deliver(self, frame)

    Channel._on_deliver_frame = delivered  # type: ignore[method-assign]

    def dump() -> None:
        Path(out).write_text(json.dumps(stamps))

    atexit.register(dump)


def parts(stamps: list[tuple[str, int, int, str]], steps: int) -> dict[str, list[float]]:
    """Each step's parts in microseconds, from both processes' stamps of one chain at a time
    (chains run one after another, so a step's stamps are the ones between its neighbours')."""
    by: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for kind, start, end, path in stamps:
        by.setdefault((kind, path), []).append((start, end))
    moments: dict[str, list[int]] = {}  # the crossings' moments (no path), by kind
    for kind, start, _, _ in stamps:
        if kind.endswith(("socket write", "delivery frame")):
            moments.setdefault(kind, []).append(start)
    for times in moments.values():
        times.sort()
    cut: dict[str, list[float]] = {}

    def first(kind: str, after: int) -> int | None:
        """The first moment of `kind` at or after `after` (ns)."""
        times = moments.get(kind, [])
        found = bisect.bisect_left(times, after)
        return times[found] if found < len(times) else None

    def crossing(sender: str, receiver: str, published: int, got: int) -> None:
        """A crossing in three parts (see the module's docstring)."""
        written = first(f"{sender} socket write", published)
        read = first(f"{receiver} delivery frame", written) if written is not None else None
        if written is None or read is None or read > got:
            return
        add(f"  {sender}: publish .. frames to the socket", written - published)
        add(f"  broker: socket .. {receiver}'s delivery frame", read - written)
        add(f"  {receiver}: delivery frame .. handler", got - read)

    def add(name: str, ns: float) -> None:
        cut.setdefault(name, []).append(ns / 1000)

    for k in range(1, steps):
        here, before = str(k), str(k - 1)
        # The owner's turn that started step k handled the report of step k-1.
        turns = sorted(by.get(("owner", before), []))
        advances = sorted(by.get(("advance", before), []))
        publishes = sorted(by.get(("owner publish", here), []))
        taken = sorted(by.get(("worker", here), []))
        checks = sorted(by.get(("current?", here), []))
        runs = sorted(by.get(("handler", here), []))
        records = sorted(by.get(("record", here), []))
        reports = sorted(by.get(("worker publish", here), []))
        nexts = sorted(by.get(("owner", here), []))
        rows = (turns, advances, publishes, taken, checks, runs, reports, nexts)
        for turn, adv, pub, got, chk, run, rep, nxt in zip(*rows, strict=False):
            # A single task's output travels with its report (docs/architecture.md): a
            # worker records it first only where its owner does not (an output over 64 KiB).
            rec = next((r for r in records if run[1] <= r[0] <= rep[0]), None)
            add("owner: got report .. advance", adv[0] - turn[0])
            add("owner: advance (Redis)", adv[1] - adv[0])
            add("owner: advance .. publish", pub[0] - adv[1])
            add("broker: owner's publish .. worker got task", got[0] - pub[0])
            crossing("owner", "worker", pub[0], got[0])
            add("owner: publish .. confirmed", pub[1] - pub[0])
            add("worker: got task .. current?", chk[0] - got[0])
            add("worker: current? (Redis)", chk[1] - chk[0])
            add("worker: current? .. handler", run[0] - chk[1])
            add("worker: handler", run[1] - run[0])
            if rec is None:
                add("worker: handler .. publish (the output carried)", rep[0] - run[1])
            else:
                add("worker: handler .. record", rec[0] - run[1])
                add("worker: record (Redis)", rec[1] - rec[0])
                add("worker: record .. publish", rep[0] - rec[1])
            add("broker: worker's publish .. owner got report", nxt[0] - rep[0])
            crossing("worker", "owner", rep[0], nxt[0])
            add("worker: publish .. confirmed", rep[1] - rep[0])
            add("step: owner got report k-1 .. owner got report k", nxt[0] - turn[0])
    return cut


async def drive(chains: int, steps: int, settings: Any) -> list[float]:
    """Run the chains one after another; each one's per-step wall time (ms) from its own
    timestamps (created to ended, as bench/compare.py's shape B)."""
    from orchestrator.connections import connected
    from router.client import Router

    program = {"name": "B", "steps": [{"task": "step", "pool": "parallel"}] * steps}
    per_step = []
    async with connected(settings, "bench-timeline") as (store, bus):
        router = Router(settings, store=store, bus=bus)
        for _ in range(chains + 1):  # the first warms up
            wf = (await router.submit(program)).workflow_id
            status = await router.wait(wf, timeout_s=60)
            assert status["status"] == "completed", status
            per_step.append((status["ended_ms"] - status["created_ms"]) / steps)
    return per_step[1:]


def main() -> None:
    from bench.compare import spawn, stop
    from bench.services import chain_arguments, drop_vhost, fleet, write_result

    args = chain_arguments(__doc__)
    settings, env = fleet("shardflow-timeline", "sft")
    logs = ROOT / "bench" / "results" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    for probed in (False, True):
        outs = [f"/tmp/shardflow-timeline-{uuid.uuid4().hex}.json" for _ in range(2)]
        here = (
            [sys.executable, __file__, "--probed"]
            if probed
            else [sys.executable, "-m", "shardflow"]
        )
        processes = [
            spawn([*here, "orchestrator", "--shards", ",".join(map(str, range(settings.shards)))],
                  {**env, PROBES_ENV: outs[0]}, logs / "timeline-orchestrator.log"),
            spawn([*here, "worker", "--pool", "parallel", "--app", "bench.tasks"],
                  {**env, PROBES_ENV: outs[1]}, logs / "timeline-worker.log"),
        ]  # fmt: skip
        try:
            time.sleep(2.5)  # imports and connections
            per_step = asyncio.run(drive(args.chains, args.steps, settings))
        finally:
            stop(processes)
        name = "probed" if probed else "plain"
        results[f"step_ms_{name}"] = round(statistics.median(per_step), 3)
        if probed:
            stamps = [s for out in outs for s in json.loads(Path(out).read_text())]
            for out in outs:
                os.unlink(out)
            cut = parts(stamps, args.steps)
            results["parts_us_median"] = {k: round(statistics.median(v), 1) for k, v in cut.items()}
            results["samples"] = len(
                cut.get("step: owner got report k-1 .. owner got report k", [])
            )
    subprocess.run(["redis-cli", "-n", "2", "flushdb"], capture_output=True)
    drop_vhost("shardflow-timeline")
    print(f"per step, median of {args.chains} chains: {results['step_ms_plain']} ms without "
          f"probes, {results['step_ms_probed']} ms with them")  # fmt: skip
    for part, us in results["parts_us_median"].items():
        print(f"  {part:52} {us:>8.1f} us")
    write_result(f"timeline-{args.stamp}", {"chains": args.chains, "steps": args.steps, **results})


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--probed":
        _install_probes(os.environ[PROBES_ENV])
        from shardflow.cli import main as cli

        cli(sys.argv[2:])
    main()
