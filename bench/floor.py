"""The floor of a chain step under the design card, with no shardflow code in the way.

    .venv/bin/python bench/floor.py [--chains 10] [--steps 20] [--stamp NAME]

A shardflow chain step is two broker crossings and two Redis round trips: the owner decides
the step (one script in Redis) and publishes the task; the worker checks that the step is
current (one read) and reports back to the owning shard. This runs exactly that between two
bare processes, as shardflow's own are set up (uvloop, aio-pika's consumers, publishes
through aiormq, persistent messages, publisher confirms, classic queues with priorities, ack
after the confirm, one process a side), and times a step as bench/compare.py's shape B does:
a chain's wall time over its steps, median of `--chains` chains.

The figure is what a step cannot go below whatever shardflow's own Python does: shardflow's
step over it is the cost of shardflow's code, and it over Celery's step is the cost of the
design (bench/compare.py prints both).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import aio_pika
import aiormq
from redis.asyncio import Redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.services import chain_arguments, drop_vhost, vhost, write_result  # noqa: E402

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
    """Take a task, check its step is current (one read), report to the owner's queue."""
    redis = Redis.from_url(REDIS_URL)
    async with await aio_pika.connect(url) as connection:
        channel = await connection.channel(publisher_confirms=True)
        await channel.set_qos(prefetch_count=16)
        tasks = await channel.declare_queue(f"{prefix}.tasks", durable=True, arguments=TASK_QUEUE)
        pending: set[asyncio.Task[None]] = set()
        async with tasks.iterator() as messages:
            async for message in messages:
                task = json.loads(message.body)
                if task.get("stop"):
                    await message.ack()
                    break
                cursor = await redis.hget(f"{prefix}:{task['wf']}", "cursor")
                publishing = None
                if cursor is not None and cursor.decode() == task["path"]:
                    report = {"wf": task["wf"], "path": task["path"], "output": {"k": 1}}
                    publishing = _publish(channel, f"{prefix}.shard", json.dumps(report).encode())
                _ack_later(pending, publishing, message)
        await asyncio.gather(*pending)
    await redis.aclose()


async def owner(url: str, prefix: str, chains: int, steps: int) -> list[float]:
    """Start each chain, advance it on each report, publish its next task; per-step ms."""
    redis = Redis.from_url(REDIS_URL)
    advance = redis.register_script(ADVANCE)
    per_step = []
    async with await aio_pika.connect(url) as connection:
        channel = await connection.channel(publisher_confirms=True)
        await channel.set_qos(prefetch_count=16)
        shard = await channel.declare_queue(f"{prefix}.shard", durable=True, arguments=SHARD_QUEUE)
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


async def run(chains: int, steps: int) -> list[float]:
    """Both sides in their own processes, as a shardflow owner and worker are."""
    name = "shardflow-floor"
    url = vhost(name)
    prefix = f"floor{uuid.uuid4().hex[:6]}"
    try:
        side = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--worker", url, prefix
        )
        await asyncio.sleep(1.5)  # imports and its queue declared
        try:
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


def main() -> None:
    args = chain_arguments(__doc__)
    step = floor_step_ms(args.chains, args.steps)
    print(f"floor step, median of {args.chains} chains of {args.steps}: {step} ms")
    figures = {"chains": args.chains, "steps": args.steps, "floor_step_ms": step}
    write_result(f"floor-{args.stamp}", figures)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        import uvloop

        uvloop.run(worker(sys.argv[2], sys.argv[3]))
    else:
        main()
