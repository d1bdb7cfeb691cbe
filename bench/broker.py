"""RabbitMQ's own CPU per message, by queue arguments and delivery mode, with no shardflow code.

    .venv/bin/python bench/broker.py [--messages 20000] [--in-flight 64] [--rounds 2]

One process keeps `--in-flight` messages going through one durable queue: each delivery is
acked and a new message published (through aiormq, with publisher confirms, as shardflow's
bus publishes), until `--messages` have passed. RabbitMQ's CPU seconds (beam.smp, from
/proc/<pid>/stat) over the messages give its cost per message. Variants: the priority levels
of the queue (none, 1 as a shard queue, 9 as a task queue), persistent or transient messages,
`mandatory`, shardflow's content type and headers, and one ack (`multiple`) for several
deliveries. Rounds alternate the variants, so a
machine whose speed drifts moves them alike. Writes bench/results/broker-<stamp>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any

import aio_pika
import aiormq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.cpu import cpu_s, listener  # noqa: E402
from bench.services import drop_vhost, vhost, write_result  # noqa: E402

VHOST = "shardflow-broker-bench"
BODY = b'{"wf": "0123456789abcdef", "path": "3", "output": {"k": 1}}' * 3
VARIANTS: dict[str, dict[str, Any]] = {
    "priorities 9, persistent": {"priorities": 9},
    "priorities 1, persistent": {"priorities": 1},
    "no priorities, persistent": {"priorities": 0},
    "priorities 9, transient": {"priorities": 9, "persistent": False},
    "priorities 9, persistent, mandatory, content type and headers": {
        "priorities": 9, "mandatory": True, "labelled": True,
    },
    "priorities 9, persistent, one ack (multiple) for every 8 deliveries": {
        "priorities": 9, "ack_every": 8,
    },
}  # fmt: skip


async def one(
    messages: int,
    in_flight: int,
    priorities: int = 0,
    persistent: bool = True,
    mandatory: bool = False,
    labelled: bool = False,
    ack_every: int = 1,
) -> dict[str, float]:
    """Messages a second, and the broker's CPU microseconds a message, for one variant."""
    broker = listener(5672)  # the shared broker, not a test's private one
    connection = await aio_pika.connect(vhost(VHOST))
    try:
        publisher = await connection.channel(publisher_confirms=True)
        consumer = await connection.channel()
        await consumer.set_qos(prefetch_count=in_flight)
        arguments = {"x-max-priority": priorities} if priorities else {}
        queue = await consumer.declare_queue("q", durable=True, arguments=arguments)
        underlay = await publisher.get_underlay_channel()
        labels: dict[str, Any] = {"content_type": "application/json", "headers": {}}
        properties = aiormq.spec.Basic.Properties(
            delivery_mode=2 if persistent else 1, priority=1, **(labels if labelled else {})
        )
        done = asyncio.Event()
        seen = 0
        # Deliveries finish out of order: one ack (multiple) covers the finished run of tags
        # from the last one acked, never a tag acked already (the broker closes the channel).
        acks = await consumer.get_underlay_channel()
        finished: set[int] = set()
        acked = 0

        async def send() -> None:
            await underlay.basic_publish(
                BODY, routing_key="q", properties=properties, mandatory=mandatory
            )

        async def on(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            nonlocal seen, acked
            seen += 1
            if seen + in_flight <= messages:
                await send()
            if ack_every == 1:
                await message.ack()
            else:
                finished.add(message.delivery_tag or 0)
                upto = acked
                while upto + 1 in finished:
                    upto += 1
                if upto - acked >= ack_every or upto == messages:
                    finished.difference_update(range(acked + 1, upto + 1))
                    acked = upto
                    await acks.basic_ack(upto, multiple=True)
            if seen == messages:
                done.set()

        await queue.consume(on)
        cpu, started = cpu_s(broker), time.monotonic()
        await asyncio.gather(*(send() for _ in range(min(in_flight, messages))))
        await done.wait()
        wall, used = time.monotonic() - started, cpu_s(broker) - cpu
    finally:
        await connection.close()
        drop_vhost(VHOST)
    return {
        "messages_per_s": round(messages / wall),
        "broker_cpu_us_per_message": round(used * 1e6 / messages),
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--stamp", default=date.today().isoformat(), help="results' file name")
    args = parser.parse_args()
    if not 1 <= args.in_flight <= 10_000 or not 1 <= args.messages <= 10_000_000:
        parser.error("--in-flight is 1..10000 and --messages 1..10000000")
    results: dict[str, list[dict[str, float]]] = {name: [] for name in VARIANTS}
    for number in range(args.rounds):
        names = list(VARIANTS) if number % 2 == 0 else list(VARIANTS)[::-1]
        for name in names:
            results[name].append(await one(args.messages, args.in_flight, **VARIANTS[name]))
            print(f"round {number + 1}: {name}: {results[name][-1]}", flush=True)
    write_result(f"broker-{args.stamp}", {"results": results})


if __name__ == "__main__":
    import uvloop

    uvloop.run(main())
