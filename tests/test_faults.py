"""Nothing lost, nothing run twice: real processes under kill -9, a Redis and a RabbitMQ restart.

Private RabbitMQ and Redis (AOF, appendfsync always) on free loopback ports; two orchestrator
processes per shard (one active, one standby), two workers per pool. While a few hundred
programs run (task, bag, loop with waits, task, signal, sleep, map, a bag of parallel branches,
task), random processes are killed
with SIGKILL and started again, Redis is killed and restarted once, RabbitMQ is stopped and
started once; half the programs get their signal before they wait for it, half during all that.
`SHARDFLOW_FAULT_PROGRAMS` / `SHARDFLOW_FAULT_SECONDS` run it longer.

The evidence is kept outside the system under test: every handler appends its start and end
(program, step, member, attempt, pid) to a list on the shared Redis, which nobody restarts, and
the test appends a marker at each kill. From that log and the programs' states the checks below
demand: every member of every step ran to its end; no step started again once its program had
moved on (at-least-once lets a redelivery re-run a member before the join, never after); each
step got exactly the output of the one before, a bag's or map's being its members' outputs in member
order; every program completed; and the kills landed while programs were mid-step. The unit
tests at the end feed each check a log with one planted fault, so none of them is vacuous.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aio_pika
import pytest
import redis
from redis.asyncio import Redis

from orchestrator.keys import Keys, Names
from orchestrator.redis_store import RedisStore
from orchestrator.settings import Settings
from orchestrator.store import TERMINAL, Store
from router.client import Router
from tests.app import fault_output
from tests.brokers import PrivateRabbit, PrivateRedis
from tests.ordering import assert_leaves_in_order
from tests.polling import until

ROOT = Path(__file__).parent.parent
PROGRAMS = int(os.environ.get("SHARDFLOW_FAULT_PROGRAMS", "200"))
CHAOS_S = float(os.environ.get("SHARDFLOW_FAULT_SECONDS", "30"))
SHARDS = 2
BAG = 5
LOOPS = 3  # the untiloop's iterations: until prev.iteration >= 2
MAP = 3  # the map's items


def program(k: int) -> dict:
    return {
        "name": f"fault-{k}",
        "steps": [
            # The serial pool runs one task at a time: this step paces the programs, so they
            # keep starting through the whole chaos and every kill finds some mid-step.
            {"task": "fault.step", "args": {"n": k, "sleep_s": 0.12}},
            {
                "bag": [
                    {"task": "fault.step", "args": {"n": i, "sleep_s": 0.05}} for i in range(BAG)
                ],
                "chunk": 1 + k % 3,  # one, two or three members per task message
            },
            {
                "until": f"prev.iteration >= {LOOPS - 1}",
                "max_iterations": LOOPS + 2,
                "interval_s": 0.02,  # a durable wait between iterations
                "steps": [
                    {"task": "fault.step", "pool": "parallel", "args": {"n": -k, "sleep_s": 0.02}}
                ],
            },
            {"task": "fault.step", "pool": "parallel", "args": {"n": 2 * k}},
            # Its data (sent before the program gets here, or during the chaos) passes a sleep.
            {"signal": "go", "timeout_s": 600},
            {"sleep_s": 0.05},
            # A map over a list made from the step before: each member's item is its n.
            {
                "map": f"[{', '.join(f'prev.n + {i}' for i in range(MAP))}]",
                "max_items": MAP,
                "task": "fault.step",
                "args": {"sleep_s": 0.03},
                "chunk": 2,
            },
            # A task beside two parallel branches (one sleeps between its tasks); the join
            # lists them in member order, whatever order they finished in.
            {
                "bag": [
                    {"task": "fault.step", "args": {"n": 7, "sleep_s": 0.02}},
                    {
                        "steps": [
                            {"task": "fault.step", "pool": "parallel", "args": {"n": 70}},
                            {"sleep_s": 0.02},
                            {"task": "fault.step", "pool": "parallel", "args": {"n": 71}},
                        ]
                    },
                    {
                        "steps": [
                            {"task": "fault.step", "pool": "parallel", "args": {"n": 72}},
                            {"task": "fault.step", "pool": "parallel", "args": {"n": 73}},
                        ]
                    },
                ]
            },
            {"task": "fault.step", "pool": "parallel", "args": {"n": 8}},
        ],
    }


@dataclass(frozen=True, slots=True)
class Leaf:
    """One leaf a program must run: its members (None for a single task), the input it must
    get and the output each member must give."""

    path: str
    prev: Any
    outputs: dict[int | None, Any]
    # The leaves that start only once this one is done (in parallel branches, more than one);
    # empty: the next one in the plan.
    then: tuple[str, ...] = ()

    @property
    def output(self) -> Any:
        """What the next leaf gets: a bag's outputs in member order, or the task's output."""
        if None in self.outputs:
            return self.outputs[None]
        return [self.outputs[i] for i in sorted(self.outputs)]  # type: ignore[type-var]


def signal_data(k: int) -> dict[str, int]:
    """The data of program k's signal: the map after it makes its list from `n`."""
    return {"n": 2 * k}


def plan(wf: str, k: int) -> list[Leaf]:
    """The leaves of program k in order, with every input and output (tests.app.fault_output)."""
    leaves: list[Leaf] = []
    prev: Any = None

    def add(path: str, iteration: int, members: dict[int | None, int]) -> None:
        nonlocal prev
        outputs = {i: fault_output(wf, path, i, iteration, n, prev) for i, n in members.items()}
        leaves.append(Leaf(path, prev, outputs))
        prev = leaves[-1].output

    add("0", 0, {None: k})
    add("1", 0, {i: i for i in range(BAG)})
    for j in range(LOOPS):
        add(f"2/iter:{j}/0", j, {None: -k})
    add("3", 0, {None: 2 * k})
    prev = signal_data(k)  # steps 4 and 5, a signal and a sleep, run no handler
    add("6", 0, {i: 2 * k + i for i in range(MAP)})
    # Step 7: member 0 a task, members 1 and 2 branches; each branch's first task gets the
    # bag's prev, the next one its branch's (a sleep passes it on); step 8 gets the join.
    mapped = leaves.pop()
    leaves.append(Leaf(mapped.path, mapped.prev, mapped.outputs, BAG_STARTS))
    bag_prev = prev
    add("7", 0, {0: 7})
    joined = [leaves[-1].outputs[0]]
    leaves.append(_then(leaves.pop(), "8"))
    for first, second, (n, m) in BRANCH_LEAVES:
        prev = bag_prev
        add(first, 0, {None: n})
        leaves.append(_then(leaves.pop(), second))
        add(second, 0, {None: m})
        leaves.append(_then(leaves.pop(), "8"))
        joined.append(leaves[-1].output)
    prev = joined
    add("8", 0, {None: 8})
    return leaves


def _then(leaf: Leaf, *then: str) -> Leaf:
    return Leaf(leaf.path, leaf.prev, leaf.outputs, then)


# The branches of step 7: (first leaf, second leaf, their n); the leaves the map is followed by.
BRANCH_LEAVES = [
    ("7/branch:1/0", "7/branch:1/2", (70, 71)),
    ("7/branch:2/0", "7/branch:2/1", (72, 73)),
]
BAG_STARTS = ("7", "7/branch:1/0", "7/branch:2/0")


def lanes(paths: list[str]) -> list[list[str]]:
    """The plan's leaves as chains that each run in one total order: the steps outside the
    branched bag, with its task member or one of its branches in its place."""
    outside = [p for p in paths if not p.startswith("7")]
    at = outside.index("8")
    chains = [["7"]] + [[first, second] for first, second, _ in BRANCH_LEAVES]
    return [outside[:at] + chain + outside[at:] for chain in chains]


# --- the checks: each answers a list of problems, empty when the log shows none ----------------

Log = list[dict[str, Any]]  # the execution log; an event's place in it is its order


def runs(log: Log) -> Iterator[tuple[int, dict[str, Any]]]:
    """The handlers' start and end events, with their place in the log."""
    return ((seq, e) for seq, e in enumerate(log) if e.get("event") in ("start", "end"))


def missing_members(log: Log, plans: dict[str, list[Leaf]]) -> list[str]:
    """Every member of every leaf of every program ran to its end at least once."""
    ended = {(e["wf"], e["path"], e["index"]) for _, e in runs(log) if e["event"] == "end"}
    started = {(e["wf"], e["path"], e["index"]) for _, e in runs(log) if e["event"] == "start"}
    problems = []
    for wf, leaves in plans.items():
        for leaf in leaves:
            for i in leaf.outputs:
                member = (wf, leaf.path, i)
                if member not in ended:
                    how = "started but never ended" if member in started else "never ran"
                    problems.append(f"{wf}: step {leaf.path} member {i} {how}")
    return problems


def late_runs(log: Log, plans: dict[str, list[Leaf]]) -> list[str]:
    """No step starts again once its program moved on: after the next leaf started, or (the
    last leaf) after the `settled` marker, put in the log once every program had ended.
    Runs of unknown programs or steps count too: a program started twice as two."""
    settled = next((seq for seq, e in enumerate(log) if e.get("event") == "settled"), None)
    first: dict[tuple[str, str], int] = {}
    for seq, e in runs(log):
        if e["event"] == "start":
            first.setdefault((e["wf"], e["path"]), seq)
    problems = []
    for seq, e in runs(log):
        if e["event"] != "start":
            continue
        wf, path = e["wf"], e["path"]
        paths = [leaf.path for leaf in plans.get(wf, [])]
        if path not in paths:
            problems.append(f"{wf}: step {path} ran (seq {seq}), not a step of any program run")
            continue
        at = paths.index(path)
        then = plans[wf][at].then or tuple(paths[at + 1 : at + 2])
        begun = sorted((first[(wf, p)], p) for p in then if (wf, p) in first)
        moved = begun[0][0] if begun else (None if then else settled)
        if moved is not None and seq > moved:
            after = f"step {begun[0][1]} started" if then else "it ended"
            problems.append(
                f"{wf}: step {path} member {e['index']} started again (seq {seq}, pid "
                f"{e['pid']}, attempt {e['attempt']}) after {after} (seq {moved})"
            )
    return problems


def wrong_inputs(log: Log, plans: dict[str, list[Leaf]]) -> list[str]:
    """Every run got the output of the leaf before it (for a bag: its members' outputs, in
    member order) and gave the output its place demands."""
    leaves = {(wf, leaf.path): (n, leaf) for wf, ls in plans.items() for n, leaf in enumerate(ls)}
    problems = []
    for seq, e in runs(log):
        found = leaves.get((e["wf"], e["path"]))
        if found is None:
            continue  # late_runs names it
        n, leaf = found
        if e["event"] == "start" and e["prev"] != leaf.prev:
            joins = n > 0 and None not in plans[e["wf"]][n - 1].outputs  # a bag before it
            what = "a join in the wrong order or of wrong outputs" if joins else "the wrong input"
            problems.append(
                f"{e['wf']}: step {e['path']} got {what} (seq {seq}): {e['prev']!r}, "
                f"expected {leaf.prev!r}"
            )
        if e["event"] == "end" and e["output"] != leaf.outputs.get(e["index"], e["output"]):
            problems.append(f"{e['wf']}: step {e['path']} gave {e['output']!r} (seq {seq})")
    return problems


def unended(statuses: dict[str, dict[str, str]], plans: dict[str, list[Leaf]]) -> list[str]:
    """Every program completed, with the last leaf's output as its result."""
    problems = []
    for wf, leaves in plans.items():
        state = statuses.get(wf) or {}
        if state.get("status") != "completed":
            problems.append(
                f"{wf}: {state.get('status', 'no state')} at {state.get('cursor', '?')}, not "
                f"completed: {state.get('error', '')}"
            )
        elif json.loads(state["result"]) != leaves[-1].output:
            problems.append(f"{wf}: completed with {state['result']}")
    return problems


@dataclass(frozen=True, slots=True)
class Reach:
    """What one kill hit: programs that had started and not ended, programs with a handler
    running, and the victim's own handlers it cut short."""

    victim: str
    running: int
    mid_step: int
    cut: int


def kill_reach(log: Log, last_path: str) -> list[Reach]:
    """For each kill marker in the log, what was in flight at that moment."""
    started: set[str] = set()
    ended: set[str] = set()
    open_runs: dict[tuple[str, str, Any, int], int] = Counter()
    reach = []
    for e in log:
        if e.get("event") == "start":
            started.add(e["wf"])
            open_runs[(e["wf"], e["path"], e["index"], e["pid"])] += 1
        elif e.get("event") == "end":
            key = (e["wf"], e["path"], e["index"], e["pid"])
            open_runs[key] = max(0, open_runs[key] - 1)
            if e["path"] == last_path:
                ended.add(e["wf"])
        elif e.get("event") == "kill":
            live = {key for key, count in open_runs.items() if count}
            cut = [key for key in live if key[3] == e["pid"]]
            reach.append(
                Reach(
                    victim=e["victim"],
                    running=len(started - ended),
                    mid_step=len({key[0] for key in live}),
                    cut=sum(open_runs[key] for key in cut),
                )
            )
            for key in cut:  # they died with the process: they will never end
                del open_runs[key]
    return reach


class Fleet:
    """The cluster's processes; each can be killed and started again by name."""

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.env = env
        self.logs = logs
        self.specs: dict[str, list[str]] = {}
        for shard in range(SHARDS):
            for replica in ("a", "b"):
                self.specs[f"orch{shard}{replica}"] = ["orchestrator", "--shards", str(shard)]
        for pool in ("serial", "parallel"):
            for replica in ("a", "b"):
                self.specs[f"{pool}{replica}"] = [
                    "worker", "--pool", pool, "--app", "tests.app", "--concurrency", "8"
                ]  # fmt: skip
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.started_at: dict[str, int] = {}  # log offset of each process's latest start
        self.kills = 0

    def start(self, name: str) -> None:
        path = self.logs / f"{name}.log"
        self.started_at[name] = path.stat().st_size if path.exists() else 0
        with path.open("ab") as log:
            self.processes[name] = subprocess.Popen(
                [sys.executable, "-m", "shardflow", *self.specs[name]],
                cwd=ROOT,
                env={**os.environ, **self.env},
                stdout=log,
                stderr=log,
            )

    def start_all(self) -> None:
        for name in self.specs:
            self.start(name)

    def kill(self, name: str) -> int:
        """SIGKILL the process; its pid."""
        process = self.processes[name]
        process.send_signal(signal.SIGKILL)
        process.wait()
        self.kills += 1
        return process.pid

    def ready(self, name: str) -> bool:
        with (self.logs / f"{name}.log").open("rb") as log:
            log.seek(self.started_at[name])
            return b": consuming " in log.read()

    def stop_all(self) -> list[int]:
        # A process still importing when SIGTERM comes dies of it (exit -15) holding nothing;
        # graceful stop is only tested on processes that got as far as consuming.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(map(self.ready, self.processes)):
            time.sleep(0.1)
        for process in self.processes.values():
            process.send_signal(signal.SIGTERM)
        return [process.wait(timeout=60) for process in self.processes.values()]

    def log_text(self) -> str:
        return "".join(path.read_text(errors="replace") for path in self.logs.glob("*.log"))


@pytest.fixture
def brokers() -> Iterator[tuple[PrivateRabbit, PrivateRedis]]:
    rabbit, redis = PrivateRabbit(), PrivateRedis()
    try:
        redis.start()
        rabbit.start()
        yield rabbit, redis
    finally:
        rabbit.close()
        redis.close()


async def poison(settings: Settings) -> int:
    """Publish messages no one can use: they must end in the dead-letter queue, and only they."""
    names = Names(settings.prefix)
    connection = await aio_pika.connect(settings.amqp_url)
    async with connection:
        channel = await connection.channel()
        bad = [
            (names.shard_queue(0), b"not json"),
            (names.shard_queue(1), b'{"kind": "next", "wf": "x"}'),
            (names.shard_queue(1), b'{"kind": "start", "wf": "no such {program}"}'),
            (names.task_queue("parallel"), b'{"wf": "x", "path": "0"}'),
            (names.task_queue("serial"), b"\xff\xfe"),
        ]
        for queue, body in bad:
            # Persistent, like everything shardflow sends: they must outlive the broker restart
            # (new work has the lower priority, so they may still be waiting then).
            message = aio_pika.Message(body, delivery_mode=aio_pika.DeliveryMode.PERSISTENT)
            await channel.default_exchange.publish(message, routing_key=queue)
    return len(bad)


async def dead_letters(settings: Settings) -> list[str]:
    names = Names(settings.prefix)
    connection = await aio_pika.connect(settings.amqp_url)
    async with connection:
        channel = await connection.channel()
        queue = await channel.get_queue(names.dead_queue)
        reasons = []
        while (message := await queue.get(no_ack=True, fail=False)) is not None:
            reasons.append(str((message.headers or {}).get("x-shardflow-reason")))
        return reasons


@dataclass(frozen=True, slots=True)
class ExecLog:
    """The handlers' execution log (tests.app.fault_step), a list on the shared Redis."""

    url: str
    key: str

    def as_input(self) -> dict[str, Any]:
        return {"exec_log": {"url": self.url, "key": self.key}}

    def mark(self, event: str, **fields: Any) -> None:
        """A marker of the test's own (a kill, the end), in order with the handlers' events."""
        with redis.Redis.from_url(self.url) as client:
            client.rpush(self.key, json.dumps({"event": event, **fields}))

    def read(self) -> Log:
        with redis.Redis.from_url(self.url) as client:
            return [json.loads(item) for item in client.lrange(self.key, 0, -1)]

    def drop(self) -> None:
        with redis.Redis.from_url(self.url) as client:
            client.delete(self.key)


async def chaos(
    fleet: Fleet, rabbit: PrivateRabbit, redis: PrivateRedis, log: ExecLog
) -> Counter[str]:
    """Kill random processes for CHAOS_S seconds; restart Redis and RabbitMQ once each."""
    rng = random.Random(os.environ.get("SHARDFLOW_FAULT_SEED"))
    restarts: Counter[str] = Counter()
    started = time.monotonic()
    while (elapsed := time.monotonic() - started) < CHAOS_S:
        if not restarts["redis"] and elapsed > CHAOS_S * 0.3:
            await asyncio.to_thread(redis.restart)
            restarts["redis"] += 1
        if not restarts["rabbitmq"] and elapsed > CHAOS_S * 0.6:
            await asyncio.to_thread(rabbit.restart)
            restarts["rabbitmq"] += 1
        victim = rng.choice(sorted(fleet.specs))
        # Marked after the kill: every event of the victim is already in the log.
        log.mark("kill", victim=victim, pid=fleet.kill(victim))
        await asyncio.sleep(rng.uniform(0.0, 0.3))
        fleet.start(victim)
        await asyncio.sleep(rng.uniform(0.2, 0.8))
    return restarts


async def signal_during_chaos(settings: Settings, store: Store, programs: dict[str, int]) -> int:
    """Send these programs their signal while processes die and the brokers restart, spread over
    the chaos; each is sent again under its signal id until it is kept (so a retry is never a
    second signal). Returns how many sends failed and were sent again."""
    from orchestrator.bus import Bus

    bus = Bus(settings)
    await bus.connect()
    router = Router(settings, store=store, bus=bus)
    again = 0
    try:
        for wf, k in programs.items():
            for _ in range(600):
                try:
                    await router.signal(wf, "go", signal_data(k), signal_id=f"{wf}-go")
                    break
                except (ValueError, LookupError):
                    raise  # refused: a real fault, not the chaos
                except Exception:  # a broker restarting under the send
                    again += 1
                    await asyncio.sleep(0.2)
            else:
                raise AssertionError(f"{wf}: its signal was never kept")
            await asyncio.sleep(CHAOS_S * 0.8 / max(1, len(programs)))
    finally:
        await bus.close()
    return again


@pytest.mark.fault
async def test_every_program_ends_once_in_order_through_kills_and_restarts(
    brokers: tuple[PrivateRabbit, PrivateRedis], redis_url: str, prefix: str, tmp_path: Path
) -> None:
    rabbit, redis = brokers
    settings = Settings(
        amqp_url=rabbit.url, redis_url=redis.url, shards=SHARDS, prefix=prefix, grace_s=2
    )
    env = {
        "SHARDFLOW_AMQP_URL": rabbit.url,
        "SHARDFLOW_REDIS_URL": redis.url,
        "SHARDFLOW_SHARDS": str(SHARDS),
        "SHARDFLOW_PREFIX": prefix,
        "SHARDFLOW_GRACE_S": "2",
        "SHARDFLOW_METRICS_PORT": "0",  # many processes on one host: no shared port
    }
    log = ExecLog(redis_url, f"{prefix}:exec")  # on the shared Redis, which nobody restarts
    fleet = Fleet(env, tmp_path)
    store = RedisStore(Redis.from_url(redis.url, decode_responses=True), Keys(settings.prefix))
    from orchestrator.bus import Bus

    bus = Bus(settings)
    await bus.connect()
    ids = [f"f{k}" for k in range(PROGRAMS)]
    plans = {wf: plan(wf, k) for k, wf in enumerate(ids)}
    try:
        router = Router(settings, store=store, bus=bus)
        fleet.start_all()
        poisoned = await poison(settings)
        for k, wf in enumerate(ids):
            await router.submit(program(k), log.as_input(), wf)
            if k % 2 == 0:  # kept before the program gets to its signal step
                await router.signal(wf, "go", signal_data(k), signal_id=f"{wf}-go")
        await bus.close()
        odd = {wf: k for k, wf in enumerate(ids) if k % 2}
        signalling = asyncio.create_task(signal_during_chaos(settings, store, odd))
        restarts = await chaos(fleet, rabbit, redis, log)
        resent = await signalling
        statuses = await _wait_all(store, ids, timeout_s=180)
        log.mark("settled")  # from here on no handler of these programs may start
    finally:
        await bus.close()
        exits = fleet.stop_all()
        await store.close()
    events = log.read()
    # Kept beside the processes' logs (pytest keeps the last runs' tmp_path) to reproduce.
    (tmp_path / "exec.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    log.drop()

    logs = fleet.log_text()
    ended = Counter(re.findall(r"(f\d+): ended ", logs))
    republished = len(re.findall(r"redelivered after a crash: published again", logs))
    ignored = len(re.findall(r"message for .* ignored \(", logs))
    dead = await dead_letters(settings)
    reach = kill_reach(events, plans[ids[0]][-1].path)
    runs_per_member = Counter(
        (e["wf"], e["path"], e["index"]) for e in events if e.get("event") == "start"
    )
    problems = {
        "unended": unended(statuses, plans),
        "missing members": missing_members(events, plans),
        "run again after moving on": late_runs(events, plans),
        "wrong input or join": wrong_inputs(events, plans),
    }
    mid = [r for r in reach if r.mid_step]
    print(
        f"\nfault summary: programs {len(ids)}, kills {fleet.kills}, restarts "
        f"redis {restarts['redis']} rabbitmq {restarts['rabbitmq']}, republished after "
        f"redelivery {republished}, duplicates ignored {ignored}, dead-lettered {len(dead)} "
        f"(poisoned {poisoned}), lost = {len(problems['unended'])}, signals sent again after "
        f"a broker error {resent}"
        f"\nkills mid-step {len(mid)} of {len(reach)} (programs running at a kill: median "
        f"{_median([r.running for r in reach])}, mid-step {_median([r.mid_step for r in reach])}"
        f"), kills that cut a handler {sum(1 for r in reach if r.cut)} "
        f"({sum(r.cut for r in reach)} handlers), re-run members "
        f"{sum(1 for n in runs_per_member.values() if n > 1)} of {len(runs_per_member)}, "
        f"problems {', '.join(f'{k} {len(v)}' for k, v in problems.items())}"
    )
    for kind, found in problems.items():
        assert not found, f"{kind}: {len(found)}:\n" + "\n".join(found[:10])
    assert max(ended.values(), default=0) == 1, ended.most_common(3)
    for lane in lanes([leaf.path for leaf in plans[ids[0]]]):
        assert_leaves_in_order([e for e in _trace(events) if e["path"] in lane], lane)
    # The kills must land on work in flight, or the test proves nothing about crashes.
    assert len(reach) == fleet.kills > 0
    assert len(mid) >= max(1, len(reach) // 2), reach
    assert any(r.cut for r in reach), reach
    assert len(dead) == poisoned, dead
    assert all(code == 0 for code in exits), exits


def _trace(events: Log) -> Log:
    """The execution log as tests.ordering reads a trace: start and end events with a seq."""
    return [{**e, "seq": seq} for seq, e in runs(events)]


def _median(values: list[int]) -> int:
    return sorted(values)[len(values) // 2] if values else 0


async def _stop(fleet: Fleet, bus: Any, store: RedisStore) -> list[int]:
    """Close the test's connections and stop every process; their exit codes."""
    await bus.close()
    exits = fleet.stop_all()
    await store.close()
    return exits


def _kept_log(log: ExecLog, tmp_path: Path) -> list[dict[str, Any]]:
    """The execution log, dropped from Redis and kept beside the processes' logs (pytest keeps
    the last runs' tmp_path) to reproduce a failure."""
    events = log.read()
    log.drop()
    (tmp_path / "exec.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return events


async def _wait_all(store: Store, ids: list[str], timeout_s: float) -> dict[str, dict[str, str]]:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            statuses = {wf: await store.state(wf) for wf in ids}
        except Exception:  # Redis may still be coming back
            statuses = {}
        if statuses and all(s.get("status") in TERMINAL for s in statuses.values()):
            return statuses
        if time.monotonic() > deadline:
            return statuses
        await asyncio.sleep(0.5)


# --- the checks on logs with one planted fault each: none of them can pass everything ---------


def _start(wf: str, leaf: Leaf, i: int | None, pid: int = 100) -> dict[str, Any]:
    return {"event": "start", "wf": wf, "path": leaf.path, "index": i, "attempt": 0, "pid": pid,
            "prev": leaf.prev}  # fmt: skip


def _end(wf: str, leaf: Leaf, i: int | None, pid: int = 100) -> dict[str, Any]:
    return {"event": "end", "wf": wf, "path": leaf.path, "index": i, "attempt": 0, "pid": pid,
            "output": leaf.outputs[i]}  # fmt: skip


def _clean(plans: dict[str, list[Leaf]]) -> Log:
    """The log of a run without faults: the programs' leaves interleaved, each leaf's members
    all started, then all ended; then the settled marker."""
    log: Log = []
    for n in range(len(next(iter(plans.values())))):
        for wf, leaves in plans.items():
            log += [_start(wf, leaves[n], i) for i in leaves[n].outputs]
            log += [_end(wf, leaves[n], i) for i in leaves[n].outputs]
    return [*log, {"event": "settled"}]


def _where(log: Log, event: str, wf: str, path: str) -> int:
    return next(
        seq for seq, e in enumerate(log) if (e.get("event"), e.get("wf"), e.get("path")) == (
            event, wf, path)
    )  # fmt: skip


@pytest.fixture
def plans() -> dict[str, list[Leaf]]:
    return {wf: plan(wf, k) for k, wf in enumerate(["f0", "f1", "f2"])}


def _completed(plans: dict[str, list[Leaf]]) -> dict[str, dict[str, str]]:
    return {
        wf: {"status": "completed", "result": json.dumps(leaves[-1].output)}
        for wf, leaves in plans.items()
    }


def test_a_clean_log_passes_with_the_reruns_at_least_once_allows(
    plans: dict[str, list[Leaf]],
) -> None:
    log = _clean(plans)
    bag = plans["f1"][1]
    # A worker killed before recording member 3: the redelivered member runs again before the
    # join, on another worker. So may a duplicate start before step 1 began.
    at = _where(log, "start", "f1", "2/iter:0/0")
    log[at:at] = [
        {"event": "kill", "victim": "parallela", "pid": 100},
        _start("f1", bag, 3, pid=200),
        _end("f1", bag, 3, pid=200),
    ]
    at = _where(log, "start", "f2", "1")
    log[at:at] = [_start("f2", plans["f2"][0], None, pid=300), _end("f2", plans["f2"][0], None)]
    assert missing_members(log, plans) == []
    assert late_runs(log, plans) == []
    assert wrong_inputs(log, plans) == []
    assert unended(_completed(plans), plans) == []
    for lane in lanes([leaf.path for leaf in plans["f0"]]):
        assert_leaves_in_order([e for e in _trace(log) if e["path"] in lane], lane)


def test_a_bag_member_that_never_ran_is_found(plans: dict[str, list[Leaf]]) -> None:
    log = [e for e in _clean(plans) if (e.get("wf"), e.get("path"), e.get("index")) != (
        "f1", "1", 3)]  # fmt: skip
    assert missing_members(log, plans) == ["f1: step 1 member 3 never ran"]
    log = [e for e in _clean(plans) if (e.get("event"), e.get("wf"), e.get("path")) != (
        "end", "f2", "3")]  # fmt: skip
    assert missing_members(log, plans) == ["f2: step 3 member None started but never ended"]


def test_a_step_run_again_after_its_program_moved_on_is_found(
    plans: dict[str, list[Leaf]],
) -> None:
    log = _clean(plans)
    # A bag member after the loop began: a second run after the join.
    at = _where(log, "end", "f1", "2/iter:0/0")
    log.insert(at, _start("f1", plans["f1"][1], 2, pid=200))
    [problem] = late_runs(log, plans)
    assert problem.startswith("f1: step 1 member 2 started again") and "step 2/iter:0/0" in problem
    # The whole program again (its first step after it ended), and a program nobody submitted.
    log = _clean(plans)
    log.append(_start("f0", plans["f0"][0], None))
    log.append({**_start("f0", plans["f0"][0], None), "wf": "f7"})
    assert [p.split(" (")[0] for p in late_runs(log, plans)] == [
        "f0: step 0 member None started again",
        "f7: step 0 ran",
    ]
    # The last step after the program ended.
    log = _clean(plans)
    log.append(_start("f2", plans["f2"][-1], None))
    [problem] = late_runs(log, plans)
    assert problem.startswith("f2: step 8 member None started again") and "it ended" in problem
    # A branch's first task after its second began; the map after one of the branches began.
    log = _clean(plans)
    second = _where(log, "end", "f1", "7/branch:2/1")
    log.insert(second, _start("f1", plans["f1"][-3], None, pid=200))
    [problem] = late_runs(log, plans)
    assert problem.startswith("f1: step 7/branch:2/0 member None started again"), problem
    assert "after step 7/branch:2/1 started" in problem
    log = _clean(plans)
    log.append(_start("f0", plans["f0"][6], 1))
    [problem] = late_runs(log, plans)
    assert problem.startswith("f0: step 6 member 1 started again"), problem


def test_a_bag_joined_with_wrong_outputs_is_found(plans: dict[str, list[Leaf]]) -> None:
    join = plans["f1"][2].prev
    swapped = [join[1], join[0], *join[2:]]
    elsewhere = [*join[:4], plans["f2"][1].outputs[4]]  # another program's member
    for wrong in (swapped, elsewhere, join[:4]):
        log = _clean(plans)
        at = _where(log, "start", "f1", "2/iter:0/0")
        log[at] = {**log[at], "prev": wrong}
        [problem] = wrong_inputs(log, plans)
        assert problem.startswith("f1: step 2/iter:0/0 got a join in the wrong order"), problem
    log = _clean(plans)
    at = _where(log, "end", "f0", "1")
    log[at] = {**log[at], "output": plans["f2"][1].outputs[log[at]["index"]]}
    [problem] = wrong_inputs(log, plans)
    assert problem.startswith("f0: step 1 gave"), problem


def test_branches_joined_in_the_wrong_order_are_found(plans: dict[str, list[Leaf]]) -> None:
    join = plans["f1"][-1].prev
    for wrong in ([join[0], join[2], join[1]], join[:2]):
        log = _clean(plans)
        at = _where(log, "start", "f1", "8")
        log[at] = {**log[at], "prev": wrong}
        [problem] = wrong_inputs(log, plans)
        assert problem.startswith("f1: step 8 got"), problem
    # A branch's second task given the bag's prev, not its branch's.
    log = _clean(plans)
    at = _where(log, "start", "f0", "7/branch:1/2")
    log[at] = {**log[at], "prev": plans["f0"][-6].prev}
    [problem] = wrong_inputs(log, plans)
    assert problem.startswith("f0: step 7/branch:1/2 got"), problem


def test_a_program_without_end_is_found(plans: dict[str, list[Leaf]]) -> None:
    statuses = _completed(plans)
    statuses["f0"] = {"status": "running", "cursor": "1"}
    statuses["f1"] = {**statuses["f1"], "result": json.dumps(plans["f2"][-1].output)}
    del statuses["f2"]
    found = unended(statuses, plans)
    expected = ["f0: running at 1, not completed", "f1: completed with {", "f2: no state at ?"]
    assert len(found) == len(expected), found
    assert all(p.startswith(e) for p, e in zip(found, expected, strict=True)), found


def test_kill_reach_counts_what_each_kill_cut(plans: dict[str, list[Leaf]]) -> None:
    leaf = plans["f0"][1]
    log: Log = [
        {"event": "kill", "victim": "orch0a", "pid": 1},  # nothing ran yet
        _start("f0", plans["f0"][0], None, pid=7),
        _end("f0", plans["f0"][0], None, pid=7),
        _start("f0", leaf, 0, pid=7),
        _start("f0", leaf, 1, pid=7),
        _start("f1", plans["f1"][0], None, pid=8),
        _end("f0", leaf, 1, pid=7),
        {"event": "kill", "victim": "seriala", "pid": 8},  # cuts f1's step 0
        {"event": "kill", "victim": "parallela", "pid": 7},  # cuts f0's member 0
        {"event": "kill", "victim": "parallelb", "pid": 9},  # nothing left running
    ]
    assert kill_reach(log, "3") == [
        Reach("orch0a", running=0, mid_step=0, cut=0),
        Reach("seriala", running=2, mid_step=2, cut=1),
        Reach("parallela", running=2, mid_step=1, cut=1),
        Reach("parallelb", running=2, mid_step=0, cut=0),
    ]


def small_fleet(
    settings: Settings,
    tmp_path: Path,
    orchestrators: tuple[str, ...],
    concurrency: int,
    **env: str,
) -> tuple[Fleet, ExecLog, RedisStore]:
    """Orchestrators over every shard and two parallel workers (`wa`, `wb`), not started yet;
    the execution log and a store to read the programs."""
    fleet = Fleet(
        {
            "SHARDFLOW_AMQP_URL": settings.amqp_url,
            "SHARDFLOW_REDIS_URL": settings.redis_url,
            "SHARDFLOW_SHARDS": str(settings.shards),
            "SHARDFLOW_PREFIX": settings.prefix,
            "SHARDFLOW_GRACE_S": "2",
            "SHARDFLOW_METRICS_PORT": "0",
            **env,
        },
        tmp_path,
    )
    shards = ",".join(map(str, range(settings.shards)))
    fleet.specs = {name: ["orchestrator", "--shards", shards] for name in orchestrators}
    for name in ("wa", "wb"):
        fleet.specs[name] = [
            "worker", "--pool", "parallel", "--app", "tests.app", "--concurrency",
            str(concurrency),
        ]  # fmt: skip
    log = ExecLog(settings.redis_url, f"{settings.prefix}:exec")
    store = RedisStore(
        Redis.from_url(settings.redis_url, decode_responses=True), Keys(settings.prefix)
    )
    return fleet, log, store


# --- a worker killed while it holds a slot of a per-key limit ---------------------------------

LEASE_S = 1.5  # the slot lease of this test's workers: a dead holder's slot is back this soon
HOLDERS = 6  # programs of one key, with a limit of 2


def holders_over_time(log: Log, key_of: dict[str, str]) -> list[tuple[str, int]]:
    """After each start of a task, how many tasks of its key were running: each start counts
    until its end or until the kill of its process (it died with it)."""
    open_runs: Counter[tuple[str, int]] = Counter()  # (key, pid) -> running
    seen = []
    for e in log:
        if e.get("event") == "kill":
            for held in [held for held in open_runs if held[1] == e["pid"]]:
                del open_runs[held]
        elif e.get("event") in ("start", "end") and e["wf"] in key_of:
            held = (key_of[e["wf"]], e["pid"])
            if e["event"] == "start":
                open_runs[held] += 1
                key = held[0]
                seen.append((key, sum(n for (k, _), n in open_runs.items() if k == key)))
            else:
                open_runs[held] = max(0, open_runs[held] - 1)
    return seen


def test_holders_over_time_closes_the_runs_of_a_killed_process() -> None:
    def run(event: str, wf: str, pid: int) -> dict[str, Any]:
        return {"event": event, "wf": wf, "path": "0", "index": None, "pid": pid}

    log: Log = [
        run("start", "a", 1),
        run("start", "b", 2),
        {"event": "kill", "pid": 1},
        run("start", "c", 2),
        run("start", "a", 2),
        run("end", "b", 2),
        run("start", "d", 3),
    ]
    key_of = {"a": "k", "b": "k", "c": "k", "d": "k"}
    assert holders_over_time(log, key_of) == [("k", 1), ("k", 2), ("k", 2), ("k", 3), ("k", 3)]


@pytest.mark.fault
async def test_a_slot_held_by_a_killed_worker_comes_back_and_the_limit_holds(
    settings: Settings, tmp_path: Path
) -> None:
    fleet, log, store = small_fleet(
        settings, tmp_path, ("orch",), 4, SHARDFLOW_KEY_LEASE_S=str(LEASE_S)
    )
    from orchestrator.bus import Bus

    bus = Bus(settings)
    await bus.connect()
    step = {
        "task": "fault.step",
        "pool": "parallel",
        "args": {"sleep_s": 1.0},
        "limit": {"key": "input.customer", "max": 2},
    }
    ids = [f"k{n}" for n in range(HOLDERS)] + ["other"]
    try:
        fleet.start_all()
        router = Router(settings, store=store, bus=bus)
        for wf in ids:
            customer = "solo" if wf == "other" else "acme"
            await router.submit({"steps": [step]}, {**log.as_input(), "customer": customer}, wf)
        # Kill the worker of the first task that started: it holds a slot of acme.
        deadline = time.monotonic() + 30
        while not (started := [e for e in log.read() if e.get("event") == "start"]):
            assert time.monotonic() < deadline, "no task started"
            await asyncio.sleep(0.02)
        pid = started[0]["pid"]
        [victim] = [name for name, p in fleet.processes.items() if p.pid == pid]
        fleet.kill(victim)
        log.mark("kill", victim=victim, pid=pid)
        killed_wf = started[0]["wf"]
        fleet.start(victim)
        statuses = await _wait_all(store, ids, timeout_s=60)
        # A duplicate run (a message redelivered after the kill while its copy waited) may
        # still be giving its slot back as its program completes: every slot is given back or
        # runs out within a lease.
        holders = store.keys.limit("acme")

        async def held() -> dict[str, Any]:
            return {"held": await store.client.zcard(holders)}

        await until(held, lambda h: h["held"] == 0, 2 * LEASE_S + 1)
    finally:
        exits = await _stop(fleet, bus, store)
    events = _kept_log(log, tmp_path)
    assert all(s.get("status") == "completed" for s in statuses.values()), statuses
    key_of = {wf: ("solo" if wf == "other" else "acme") for wf in ids}
    seen = holders_over_time(events, key_of)
    acme = [n for key, n in seen if key == "acme"]
    print(f"\nacme holders at each start: {acme}; killed {victim} running {killed_wf}")
    assert max(acme) == 2, seen  # reached, and never exceeded, kill or no kill
    # The killed task ran again to its end: its slot came back when its lease ran out.
    kill_at = next(n for n, e in enumerate(events) if e.get("event") == "kill")
    again = [e for e in events[kill_at:] if e.get("wf") == killed_wf and e.get("event") == "end"]
    assert again, f"{killed_wf} never ran to its end after the kill"
    assert all(code == 0 for code in exits), exits


SAGAS = 12


def saga_program(k: int) -> dict[str, Any]:
    """A task and a bag of three that name compensations, then a step that always fails: the
    saga undoes the bag (its three side by side) and then the task. The compensations are
    slow, so that a kill lands on them."""

    def undo(n: int) -> dict[str, Any]:
        return {"task": "fault.step", "args": {"n": n, "sleep_s": 0.4}, "pool": "parallel"}

    return {
        "name": f"saga-{k}",
        "steps": [
            {"task": "fault.step", "pool": "parallel", "args": {"n": k}, "compensate": undo(-k)},
            {
                "bag": [
                    {"task": "fault.step", "args": {"n": i}, "compensate": undo(100 + i)}
                    for i in range(3)
                ]
            },
            {"task": "boom", "pool": "parallel"},
        ],
    }


@pytest.mark.fault
async def test_compensations_cut_by_kill_9_run_again_and_every_saga_ends_in_order(
    settings: Settings, tmp_path: Path
) -> None:
    """kill -9 of the worker running a compensation, and of the active orchestrator, while
    sagas compensate: every compensation runs to its end, the bag's before the task's, none
    again once its saga moved on, and every program ends compensated."""
    fleet, log, store = small_fleet(settings, tmp_path, ("orcha", "orchb"), 8)
    from orchestrator.bus import Bus

    bus = Bus(settings)
    await bus.connect()
    ids = [f"s{k}" for k in range(SAGAS)]
    victims: list[str] = []
    try:
        fleet.start_all()
        router = Router(settings, store=store, bus=bus)
        for k, wf in enumerate(ids):
            await router.submit(saga_program(k), log.as_input(), wf)
        # Twice: the worker of a compensation that started (and is still running), then the
        # orchestrator that owns the shards (the standby takes over), each started again.
        for kind in ("worker", "orchestrator"):
            deadline = time.monotonic() + 30
            while True:
                events = log.read()
                ended = {
                    (e["wf"], e["path"], e["index"]) for e in events if e.get("event") == "end"
                }
                running = [
                    e
                    for e in events
                    if e.get("event") == "start"
                    and e["path"].startswith("saga:")
                    and (e["wf"], e["path"], e["index"]) not in ended
                ]
                if running:
                    break
                assert time.monotonic() < deadline, "no compensation started"
                await asyncio.sleep(0.02)
            if kind == "worker":
                pid = running[-1]["pid"]
                [victim] = [name for name, p in fleet.processes.items() if p.pid == pid]
            else:
                victim = "orcha" if "orcha" not in victims else "orchb"
            fleet.kill(victim)
            log.mark("kill", victim=victim, pid=fleet.processes[victim].pid)
            victims.append(victim)
            await asyncio.sleep(0.2)
            fleet.start(victim)
        statuses = await _wait_all(store, ids, timeout_s=90)
        log.mark("settled")
    finally:
        exits = await _stop(fleet, bus, store)
    events = _kept_log(log, tmp_path)
    assert all(s.get("status") == "compensated" for s in statuses.values()), statuses
    # The plan of each: its steps, then its compensations (the bag's, then the task's).
    plans = {
        wf: [
            Leaf("0", None, {None: k}),
            Leaf("1", None, {i: i for i in range(3)}),
            Leaf("saga:1", None, {i: 100 + i for i in range(3)}),
            Leaf("saga:0", None, {0: -k}),
        ]
        for k, wf in enumerate(ids)
    }
    problems = missing_members(events, plans) + late_runs(events, plans)
    assert not problems, "\n".join(problems[:10])
    reach = kill_reach(events, "saga:0")
    print(f"\nsaga kills: {victims}; {reach}")
    assert reach and reach[0].cut, reach  # the worker died running a compensation
    assert all(r.running for r in reach), reach  # every kill found sagas in flight
    assert all(code == 0 for code in exits), exits


def late_program(k: int) -> dict[str, Any]:
    """A bag whose member 0 is slow and names a compensation, and whose member 1 always fails:
    the program compensates while member 0 still runs, which must end and be undone. Slow
    enough that the test sees them compensating before they end: with the owner's window all
    eight start at once, so the moment is one member's run for all of them. Member 1 fails
    only once member 0 started (else the program may fail first, and member 0, never started,
    is rightly never run: nothing to kill), and each goes in a message of its own: in one
    chunk the failure would be reported only once member 0 ended."""
    undo = {"task": "fault.step", "args": {"n": 100 + k}, "pool": "parallel"}
    slow = {"task": "fault.step", "args": {"n": k, "sleep_s": 3.0}, "compensate": undo}
    boom = {"task": "fault.boom_after", "args": {"after": 0}}
    return {"name": f"late-{k}", "steps": [{"bag": [slow, boom], "chunk": 1}]}


@pytest.mark.fault
async def test_a_task_still_running_when_its_program_fails_survives_kill_9_and_is_undone(
    settings: Settings, tmp_path: Path
) -> None:
    """kill -9 of the worker running bag members that started before their programs failed:
    the redelivered members run again (lua/begin.lua), their outputs are recorded late, and
    only then do the compensations start; every program ends compensated, each member undone
    once, after its last run ended."""
    # 16 slots a worker: its 16 messages fit in either, so no failing member waits for a slot
    # behind the slow ones (its program would then compensate only once they ended).
    fleet, log, store = small_fleet(settings, tmp_path, ("orcha",), 16)
    from orchestrator.bus import Bus

    bus = Bus(settings)
    await bus.connect()
    ids = [f"l{k}" for k in range(8)]
    try:
        fleet.start_all()
        router = Router(settings, store=store, bus=bus)
        for k, wf in enumerate(ids):
            await router.submit(late_program(k), log.as_input(), wf)
        # Kill the worker running the most slow members once their programs compensate.
        deadline = time.monotonic() + 30
        while True:
            running = [e for e in log.read() if e.get("event") == "start" and e["path"] == "0"]
            states = [await store.state(e["wf"]) for e in running]
            compensating = [
                e for e, s in zip(running, states, strict=True) if s["status"] == "compensating"
            ]
            if len(compensating) >= 4:
                break
            assert time.monotonic() < deadline, f"no slow member ran in a failed bag: {states}"
            await asyncio.sleep(0.05)
        pids = Counter(e["pid"] for e in compensating)
        [victim] = [n for n, p in fleet.processes.items() if p.pid == pids.most_common(1)[0][0]]
        # Marked first: the other worker may start the redelivered members before kill returns.
        log.mark("kill", victim=victim)
        fleet.kill(victim)
        fleet.start(victim)
        statuses = await _wait_all(store, ids, timeout_s=60)
    finally:
        exits = await _stop(fleet, bus, store)
    events = _kept_log(log, tmp_path)
    assert all(s.get("status") == "compensated" for s in statuses.values()), statuses
    kill_at = next(n for n, e in enumerate(events) if e.get("event") == "kill")
    rerun = 0
    for wf in ids:
        mine = [(n, e) for n, e in enumerate(events) if e.get("wf") == wf]
        ends = [n for n, e in mine if e["path"] == "0" and e["event"] == "end"]
        undos = [(n, e) for n, e in mine if e["path"] == "saga:0" and e["event"] == "start"]
        assert ends, f"{wf}: its slow member never ended"
        assert len(undos) == 1, f"{wf}: undone {len(undos)} times"
        assert undos[0][0] > max(ends), f"{wf}: undone before its member's last run ended"
        assert undos[0][1]["prev"] is None and undos[0][1]["index"] == 0
        starts = [n for n, e in mine if e["path"] == "0" and e["event"] == "start"]
        rerun += any(n > kill_at for n in starts)
    assert rerun, "no member cut by the kill ran again"
    assert all(code == 0 for code in exits), exits
