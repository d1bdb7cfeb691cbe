"""Queues and exchanges an operator deletes under running processes: no timer, report or
poison message is lost, and no queue wedges."""

from __future__ import annotations

import asyncio
import time

import aio_pika
import pytest
from prometheus_client import REGISTRY

from orchestrator.bus import ladder_ms
from orchestrator.connections import connected
from orchestrator.messages import Start, Wake, encode
from router.client import Router
from router.hashing import shard_for
from tests.app import Trace

pytestmark = pytest.mark.e2e

NAP = {"steps": [{"sleep_s": 0.2}, {"task": "echo"}]}


async def test_timers_outlive_the_orchestrator_exchange(cluster: Router) -> None:
    """A wake and a deadline wait in TTL queues that dead-letter straight to the owner shard's
    queue: with the `<prefix>.orchestrator` exchange deleted under running owners (who declare
    it only when a consumer starts), neither is dropped."""
    async with connected(cluster.settings) as (_, bus):
        await bus._publisher.exchange_delete(bus.names.orchestrator_exchange)  # type: ignore[union-attr]
    napping = {"steps": [{"sleep_s": 0.2}, {"task": "echo"}]}
    late = {"deadline_s": 0.2, "steps": [{"task": "echo", "args": {"sleep_s": 30}}]}
    woken = (await cluster.submit(napping)).workflow_id
    ended = (await cluster.submit(late)).workflow_id
    status = await cluster.wait(woken, timeout_s=15)
    assert status["status"] == "completed", status
    status = await cluster.wait(ended, timeout_s=15)
    assert (status["status"], status["error"]) == ("failed", "deadline of 0.2s exceeded")


async def test_a_timer_in_a_delay_queue_of_before_still_reaches_its_owner(
    cluster: Router,
) -> None:
    """The upgrade path: `<prefix>.delay.shard<N>.<ms>`, declared by a shardflow of before,
    dead-letters through the orchestrator exchange, which is still declared and bound."""
    wf = (await cluster.submit({"steps": [{"task": "echo"}]})).workflow_id
    await cluster.wait(wf, timeout_s=30)
    owner = (await cluster.status(wf))["owner"]  # type: ignore[index]
    async with connected(cluster.settings) as (_, bus):
        channel = bus._publisher
        assert channel is not None
        arguments = {
            "x-message-ttl": 10,
            "x-dead-letter-exchange": bus.names.orchestrator_exchange,
            "x-dead-letter-routing-key": str(owner),
        }
        old = await channel.declare_queue(
            bus.names.delay_queue(f"shard{owner}", 10), durable=True, arguments=arguments
        )
        await channel.default_exchange.publish(
            aio_pika.Message(encode(Wake(wf=wf, path="0"))), routing_key=old.name
        )
        deadline = time.monotonic() + 20
        while not (parked := await bus.peek_dead(5)):
            assert time.monotonic() < deadline, "never reached the owner"
            await asyncio.sleep(0.05)
        await old.delete()
    [(headers, _)] = parked
    assert headers["x-shardflow-reason"] == f"{wf}: step 0 is not a sleep"


async def test_a_deleted_dead_letter_queue_is_declared_again_and_wedges_nothing(
    cluster: Router,
) -> None:
    """A poison message with `<prefix>.dead` gone came back to its queue's head for good (the
    park was returned unroutable), and a shard behind it stalled: it is declared again."""
    shards = cluster.settings.shards
    wf = next(f"after-{i}" for i in range(1000) if shard_for(f"after-{i}", shards) == 0)
    async with connected(cluster.settings) as (_, bus):
        await bus._publisher.queue_delete(bus.names.dead_queue)  # type: ignore[union-attr]
        for n in range(3):  # starts of programs nobody submitted: poison
            await bus.publish_to_shard(0, encode(Start(wf=f"gone-{n}")))
        await cluster.submit({"steps": [{"task": "echo"}]}, workflow_id=wf)
        status = await cluster.wait(wf, timeout_s=15)
        assert status["status"] == "completed", status
        deadline = time.monotonic() + 15
        while len(parked := await bus.peek_dead(10)) < 3:
            assert time.monotonic() < deadline, f"parked only {parked}"
            await asyncio.sleep(0.05)
    assert sorted(h["x-shardflow-reason"] for h, _ in parked) == [
        f"gone-{n}: no such program" for n in range(3)
    ]


async def test_a_deleted_delay_queue_is_declared_again(cluster: Router) -> None:
    """A delay queue is declared once a process; with it deleted, every timer of that delay
    was returned unroutable until the process reconnected (the start failing its 20 tries)."""
    shards = cluster.settings.shards
    first = (await cluster.submit(NAP, workflow_id="nap-0")).workflow_id
    assert (await cluster.wait(first, timeout_s=15))["status"] == "completed"
    shard = shard_for(first, shards)
    again = next(f"nap-{i}" for i in range(1, 1000) if shard_for(f"nap-{i}", shards) == shard)
    async with connected(cluster.settings) as (_, bus):
        # The sleep's timer is early by a little (the time its step took to begin), so it
        # takes the ladder's next lower rung; delete every rung near 0.2 s.
        rungs = {ladder_ms(ms / 1000) for ms in range(100, 201)}
        for delay_ms in rungs:
            name = bus.names.delay_queue(f"shard{shard}.queue", delay_ms)
            await bus._publisher.queue_delete(name)  # type: ignore[union-attr]
    status = await cluster.wait(
        (await cluster.submit(NAP, workflow_id=again)).workflow_id, timeout_s=15
    )
    assert status["status"] == "completed", status


async def test_a_report_waits_for_its_deleted_shard_queue_to_come_back(cluster: Router) -> None:
    """A report no queue takes was parked at once, though its owner declares its queue again
    a second later: the program ran forever. It is tried again for a few seconds first."""
    program = {"steps": [{"task": "echo", "args": {"sleep_s": 0.5}}, {"task": "echo"}]}
    wf = (await cluster.submit(program)).workflow_id
    await asyncio.sleep(0.2)  # its first task runs
    owner = (await cluster.status(wf))["owner"]  # type: ignore[index]
    async with connected(cluster.settings) as (_, bus):
        await bus._publisher.queue_delete(bus.names.shard_queue(owner))  # type: ignore[union-attr]
        status = await cluster.wait(wf, timeout_s=20)
        assert await bus.peek_dead(5) == []
    assert status["status"] == "completed", status


async def test_a_cancel_stops_a_handler_after_the_control_exchange_was_deleted(
    cluster: Router, trace: Trace
) -> None:
    """With `<prefix>.control` deleted, a cancel's notice failed (404, failing publishes in
    flight beside it), and a worker's control queue stayed unbound until it reconnected: its
    handler ran on. The exchange is declared again, workers bind again, and every notice is
    sent again once they have."""
    async with connected(cluster.settings) as (_, bus):
        await bus._publisher.exchange_delete(bus.names.control_exchange)  # type: ignore[union-attr]
    cancelled = {"pool": "serial", "task": "echo", "outcome": "cancelled"}

    def stopped() -> float:
        return REGISTRY.get_sample_value("shardflow_task_duration_seconds_count", cancelled) or 0

    before = stopped()
    program = {"steps": [{"task": "echo", "args": {"sleep_s": 60}}]}
    wf = (await cluster.submit(program, trace.as_input())).workflow_id
    deadline = time.monotonic() + 15
    while not trace.events():  # its handler runs
        assert time.monotonic() < deadline, "never started"
        await asyncio.sleep(0.05)
    status = await cluster.cancel(wf)
    assert status["status"] == "cancelled", status
    deadline = time.monotonic() + 25  # the notice's repeat (bus.CONTROL_REPEAT_S), and room
    while stopped() == before:
        assert time.monotonic() < deadline, "the running handler was never stopped"
        await asyncio.sleep(0.1)
    assert [e["event"] for e in trace.events()] == ["start"]  # cut short, not run to its end
