"""The floor of a chain step under the design card, with no shardflow code in the way.

    .venv/bin/python bench/floor.py [--chains 10] [--steps 20] [--stamp NAME]

A shardflow chain step is two broker crossings and two Redis round trips: the owner decides
the step (one script in Redis) and publishes the task; the worker checks that the step is
current (one read) and reports back to the owning shard. This runs exactly that between two
bare processes, as shardflow's own are set up (uvloop, aio-pika's consumers on a connection
that writes a turn's frames at once, publishes through aiormq, persistent messages,
publisher confirms, classic queues with priorities, ack after the confirm, one process a
side), and times a step as bench/compare.py's shape B does: a chain's wall time over its
steps, median of `--chains` chains. Then it runs 200 chains at once, as shape B at M=200,
over 4 shard queues, each side handling up to 16 messages of a queue at once (shardflow's
defaults), for tasks/s and the CPU seconds of every process involved per 1,000 tasks.

The figures are what shardflow cannot beat whatever its own Python does: its step over the
floor's is the cost of shardflow's code, and the floor's over Celery's step is the cost of
the design; the same for chains at M=200 (bench/compare.py prints each).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any, cast

import aio_pika
import aiormq
from redis.asyncio import Redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.services import chain_arguments, drop_vhost, vhost, write_result  # noqa: E402
from orchestrator.coalescing import CoalescingConnection  # noqa: E402

REDIS_URL = "redis://127.0.0.1:6379/2"
# The owner's compare-and-advance, reduced to its shape: read the cursor, move it, return it.
ADVANCE = """
local at = redis.call('HGET', KEYS[1], 'cursor')
if at ~= ARGV[1] then return {0, at} end
redis.call('HSET', KEYS[1], 'cursor', ARGV[2], 'updated_ms', ARGV[3])
return {1, ARGV[2]}
"""
# As shardflow declares them (orchestrator/bus.py): a shard queue has one active consumer and
# two priorities, a pool's task queue ten.
SHARD_QUEUE = {"x-max-priority": 1, "x-single-active-consumer": True}
TASK_QUEUE = {"x-max-priority": 9}
PREFETCH = 16  # messages each side holds at once, as shardflow's default prefetch and pool
LOADED_WAIT_S = 300.0
SHARDS = 4  # shard queues in the loaded run, as shardflow's default SHARDFLOW_SHARDS
LOADED = 200  # chains at once in the loaded run, as bench/compare.py's shape B at M=200


async def _connect(url: str) -> aio_pika.abc.AbstractRobustConnection:
    """A connection as shardflow's processes open one by default: the frames written in one
    event-loop turn go out in one write (orchestrator/coalescing.py)."""
    connection = CoalescingConnection(aio_pika.connection.make_url(url))
    await connection.connect()
    return connection


async def _publish(channel: aio_pika.abc.AbstractChannel, queue: str, body: bytes) -> None:
    """As shardflow's bus publishes: through aiormq, without waiting for the socket's drain,
    then for the broker's confirm."""
    underlay = await channel.get_underlay_channel()
    properties = aiormq.spec.Basic.Properties(delivery_mode=2, priority=1)
    await underlay.basic_publish(body, routing_key=queue, properties=properties, wait=False)


def _ack_later(
    pending: set[asyncio.Task[None]],
    publishing: Any,
    message: aio_pika.abc.AbstractIncomingMessage,
) -> None:
    """Ack once the publish is confirmed: in the background, as shardflow's processes go on
    with the next message while a confirm is on its way (held in `pending` until done)."""

    async def settle() -> None:
        if publishing is not None:
            await publishing
        await message.ack()

    task = asyncio.ensure_future(settle())
    pending.add(task)
    task.add_done_callback(pending.discard)


async def worker(url: str, prefix: str) -> None:
    """Take a task, check its step is current (one read), report to the owner's queue; up to
    PREFETCH tasks at once, each in a task of its own, as a shardflow worker runs them."""
    redis = Redis.from_url(REDIS_URL)
    async with await _connect(url) as connection:
        channel = await connection.channel(publisher_confirms=True)
        await channel.set_qos(prefetch_count=PREFETCH)
        tasks = await channel.declare_queue(f"{prefix}.tasks", durable=True, arguments=TASK_QUEUE)
        pending: set[asyncio.Task[None]] = set()

        async def run(message: aio_pika.abc.AbstractIncomingMessage, task: dict[str, Any]) -> None:
            cursor = await redis.hget(f"{prefix}:{task['wf']}", "cursor")
            if cursor is not None and cursor.decode() == task["path"]:
                report = {"wf": task["wf"], "path": task["path"], "output": {"k": 1}}
                shard = f"{prefix}.shard{task.get('shard', 0)}"
                await _publish(channel, shard, json.dumps(report).encode())
            await message.ack()

        async with tasks.iterator() as messages:
            async for message in messages:
                task = json.loads(message.body)
                if task.get("stop"):
                    await message.ack()
                    break
                _hold(pending, run(message, task))
        await asyncio.gather(*pending)
    await redis.aclose()


def _hold(pending: set[asyncio.Task[None]], work: Any) -> None:
    """Run `work` beside the consumer loop, held in `pending` until done."""
    task = asyncio.ensure_future(work)
    pending.add(task)
    task.add_done_callback(pending.discard)


async def owner(url: str, prefix: str, chains: int, steps: int) -> list[float]:
    """Start each chain, advance it on each report, publish its next task; per-step ms."""
    redis = Redis.from_url(REDIS_URL)
    advance = redis.register_script(ADVANCE)
    per_step = []
    async with await _connect(url) as connection:
        channel = await connection.channel(publisher_confirms=True)
        await channel.set_qos(prefetch_count=16)
        shard = await channel.declare_queue(f"{prefix}.shard0", durable=True, arguments=SHARD_QUEUE)
        await channel.declare_queue(f"{prefix}.tasks", durable=True, arguments=TASK_QUEUE)
        pending: set[asyncio.Task[None]] = set()
        async with shard.iterator() as messages:
            for _ in range(chains + 1):  # the first warms up
                wf = uuid.uuid4().hex
                key = f"{prefix}:{wf}"
                started = time.monotonic()
                await redis.hset(key, mapping={"cursor": "0", "updated_ms": "0"})
                first = json.dumps({"wf": wf, "path": "0"}).encode()
                await _publish(channel, f"{prefix}.tasks", first)
                async for message in messages:
                    report = json.loads(message.body)
                    k = int(report["path"])
                    done = k + 1 == steps
                    moved, _ = await advance(
                        keys=[key], args=[str(k), "end" if done else str(k + 1), time.time_ns()]
                    )
                    publishing = None
                    if moved and not done:
                        task = json.dumps({"wf": wf, "path": str(k + 1)}).encode()
                        publishing = _publish(channel, f"{prefix}.tasks", task)
                    _ack_later(pending, publishing, message)
                    if done:
                        break
                per_step.append((time.monotonic() - started) * 1000 / steps)
                await redis.delete(key)
        await asyncio.gather(*pending)
        await _publish(channel, f"{prefix}.tasks", b'{"stop": true}')
    await redis.aclose()
    return per_step[1:]


async def owner_loaded(
    url: str, prefix: str, m: int, steps: int, worker_pid: int
) -> dict[str, Any]:
    """`m` chains at once: each report handled in a task of its own (at most PREFETCH at
    once, as a shardflow owner), acked after the next task's confirm; tasks/s and the CPU of
    every process (this owner, the worker, RabbitMQ, Redis) per 1,000 tasks."""
    from bench.cpu import Meter, cost

    redis = Redis.from_url(REDIS_URL)
    advance = redis.register_script(ADVANCE)
    async with await _connect(url) as connection:
        channel = await connection.channel(publisher_confirms=True)
        await channel.declare_queue(f"{prefix}.tasks", durable=True, arguments=TASK_QUEUE)
        shards = []  # each shard's queue on a channel of its own, as a shardflow owner's
        for number in range(SHARDS):
            consuming = await connection.channel(publisher_confirms=False)
            await consuming.set_qos(prefetch_count=PREFETCH)
            shards.append(
                await consuming.declare_queue(
                    f"{prefix}.shard{number}", durable=True, arguments=SHARD_QUEUE
                )
            )
        pending: set[asyncio.Task[None]] = set()
        ended = asyncio.Event()
        left = m

        failures: list[BaseException] = []

        async def on_report(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            try:
                await advance_and_publish(message)
            except Exception as exc:  # end the run now, naming it, not at LOADED_WAIT_S
                failures.append(exc)
                ended.set()

        async def advance_and_publish(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            nonlocal left
            report = json.loads(message.body)
            k, last = int(report["path"]), int(report["path"]) + 1 == steps
            moved, _ = await advance(
                keys=[f"{prefix}:{report['wf']}"],
                args=[str(k), "end" if last else str(k + 1), time.time_ns()],
            )
            if moved and not last:
                task = {"wf": report["wf"], "path": str(k + 1), "shard": shard_of[report["wf"]]}
                await _publish(channel, f"{prefix}.tasks", json.dumps(task).encode())
            await message.ack()
            if moved and last:
                left -= 1
                if not left:
                    ended.set()

        async def consume(shard: aio_pika.abc.AbstractQueue) -> None:
            async with shard.iterator() as messages:
                async for message in messages:
                    _hold(pending, on_report(message))

        wfs = [uuid.uuid4().hex for _ in range(m)]
        shard_of = {wf: number % SHARDS for number, wf in enumerate(wfs)}
        for wf in wfs:
            await redis.hset(f"{prefix}:{wf}", mapping={"cursor": "0", "updated_ms": "0"})
        consumers = [asyncio.ensure_future(consume(shard)) for shard in shards]
        meter = Meter({"floor worker": [worker_pid]})
        meter.start()
        started = time.monotonic()
        await asyncio.gather(
            *(_publish(channel, f"{prefix}.tasks",
                       json.dumps({"wf": wf, "path": "0", "shard": shard_of[wf]}).encode())
              for wf in wfs)
        )  # fmt: skip
        await asyncio.wait_for(ended.wait(), LOADED_WAIT_S)
        if failures:
            raise failures[0]
        figures = {
            "tasks_per_s": round(m * steps / (time.monotonic() - started), 1),
            **cost(meter, started, m * steps),
        }
        for consumer in consumers:
            consumer.cancel()
        await asyncio.gather(*consumers, *pending, return_exceptions=True)
        await _publish(channel, f"{prefix}.tasks", b'{"stop": true}')
        await redis.delete(*(f"{prefix}:{wf}" for wf in wfs))
    await redis.aclose()
    return figures


async def run(chains: int, steps: int, loaded: int = 0) -> Any:
    """Both sides in their own processes, as a shardflow owner and worker are: `chains`
    chains one after another (per-step ms), or `loaded` chains at once (owner_loaded)."""
    name = "shardflow-floor"
    url = vhost(name)
    prefix = f"floor{uuid.uuid4().hex[:6]}"
    try:
        side = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--worker", url, prefix
        )
        await asyncio.sleep(1.5)  # imports and its queue declared
        try:
            if loaded:
                return await owner_loaded(url, prefix, loaded, steps, side.pid)
            return await owner(url, prefix, chains, steps)
        finally:
            try:
                await asyncio.wait_for(side.wait(), 30)
            except TimeoutError:  # the owner failed before it told the worker to stop
                side.kill()
                await side.wait()
    finally:
        drop_vhost(name)


def floor_step_ms(chains: int = 10, steps: int = 20) -> float:
    """The median floor step in ms (a fresh event loop: uvloop, as shardflow's processes)."""
    import uvloop

    return round(statistics.median(uvloop.run(run(chains, steps))), 3)


def floor_loaded(m: int = 200, steps: int = 20) -> dict[str, Any]:
    """`m` chains of `steps` at once on the floor: tasks/s and CPU-s per 1,000 tasks."""
    import uvloop

    return cast(dict[str, Any], uvloop.run(run(0, steps, loaded=m)))


def main() -> None:
    args = chain_arguments(__doc__)
    step = floor_step_ms(args.chains, args.steps)
    print(f"floor step, median of {args.chains} chains of {args.steps}: {step} ms")
    loaded = floor_loaded(LOADED, args.steps)
    print(f"floor, {LOADED} chains at once: {loaded}")
    figures = {"chains": args.chains, "steps": args.steps, "floor_step_ms": step,
               f"floor_M{LOADED}": loaded}  # fmt: skip
    write_result(f"floor-{args.stamp}", figures)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        import uvloop

        uvloop.run(worker(sys.argv[2], sys.argv[3]))
    else:
        main()
