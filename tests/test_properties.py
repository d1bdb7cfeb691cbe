"""Ordering you can trust: the real transitions, in a real Redis, under a hostile transport.

The state machine plays RabbitMQ. Its rules deliver the messages the system produced in any
order, deliver them twice, deliver old ones again, and crash a process between writing state
and publishing (after any number of its publishes). The orchestrator and worker code that
handles each message is the real one (`handle_shard_message`, `Worker.handle`) and so are the
Lua scripts; only the transport is simulated. A small model (tests/model.py) says what must
happen; invariants are checked after every rule, and at the end every message left is
delivered so that every program must have ended, as the model says.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from redis.asyncio import Redis

from orchestrator.keys import Keys
from orchestrator.memory_store import MemoryStore
from orchestrator.messages import TaskMessage, decode_task
from orchestrator.owner import handle_shard_message
from orchestrator.redis_store import RedisStore
from orchestrator.settings import Settings
from orchestrator.store import TERMINAL, Completion, Store, Verdict
from orchestrator.transitions import Plans, Transitions
from router.client import Router
from tests.model import Expected, expect, output_of, programs
from worker.context import TaskContext
from worker.pool import Worker
from worker.registry import Registry

MAX_IN_FLIGHT = 300


class Crash(BaseException):
    """A process dies here: nothing after this point of its work happens."""


@dataclass(frozen=True)
class Envelope:
    kind: str  # "shard" or "task"
    body: bytes
    redelivered: bool = False
    shard: int = -1  # the queue a shard message was published to


class FakeDelivery:
    def __init__(self, envelope: Envelope) -> None:
        self.body = envelope.body
        self.redelivered = envelope.redelivered
        self.headers: dict[str, Any] = {}
        self.priority = None
        self.acked = False
        self.nacked = False

    async def ack(self) -> None:
        self.acked = True

    async def nack(self, *, requeue: bool = True) -> None:
        self.nacked = True


class Transport:
    """Plays the broker: keeps what was published; may crash the publisher after N publishes."""

    def __init__(self, on_dispatch: Any) -> None:
        self.in_flight: list[Envelope] = []
        self.crash_after: int | None = None
        self.dead: list[str] = []
        self._on_dispatch = on_dispatch

    def _count(self) -> None:
        if self.crash_after is not None:
            if self.crash_after == 0:
                raise Crash
            self.crash_after -= 1

    async def publish_to_shard(self, owner: int, body: bytes, priority: int = 1) -> None:
        self._count()
        self.in_flight.append(Envelope("shard", body, shard=owner))

    async def publish_all(self, pool: str, bodies: list[bytes], priority: int = 1) -> None:
        for body in bodies:
            self._count()
            self._on_dispatch(decode_task(body))
            self.in_flight.append(Envelope("task", body))

    async def dead_letter(self, body: bytes, *, reason: str, source: str) -> None:
        self.dead.append(reason)

    async def requeue(self, queue: str, body: bytes, headers: Any, priority: Any) -> None:
        raise AssertionError(f"a handler failed on a good message: {headers}")


class RecordingStore:
    """A store (the real Lua in Redis, or its model), noting what each transition decided."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.keys = inner.keys
        self.recorded: dict[tuple[str, str], set[int]] = defaultdict(set)
        self.fired: Counter[tuple[str, str]] = Counter()
        self.ended: Counter[str] = Counter()
        self.violations: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def record(
        self, wf: str, path: str, size: int, outputs: Mapping[int | None, str]
    ) -> Completion:
        completion = await self.inner.record(wf, path, size, outputs)
        if completion.verdict != "stale":
            self.recorded[(wf, path)].update(index or 0 for index in outputs)
        if completion.verdict == "fire":
            self.fired[(wf, path)] += 1
            # A member that never finished has no output (JSON text is never empty).
            if len(completion.outputs) != size or not all(completion.outputs):
                self.violations.append(f"{wf} {path}: barrier fired before all {size} finished")
        return completion

    async def advance(
        self, wf: str, expected: str, cursor: str, status: str, *args: str, **kwargs: str
    ) -> Verdict:
        verdict = await self.inner.advance(wf, expected, cursor, status, *args, **kwargs)
        if verdict.verdict == "applied" and status in TERMINAL:
            self.ended[wf] += 1
        return verdict


async def work(ctx: TaskContext) -> dict[str, int]:
    return output_of(ctx.step, ctx.index)


async def boom(ctx: TaskContext) -> None:
    raise RuntimeError("boom")


class Cluster(RuleBasedStateMachine):
    """One or two drawn programs run by the real transition code over a hostile transport."""

    redis_url = ""
    prefix = ""
    store_kind = "redis"  # or "memory": the model of the scripts (orchestrator/memory_store.py)

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        keys = Keys(f"{self.prefix}-{uuid.uuid4().hex[:6]}")
        inner: Store
        if self.store_kind == "redis":
            inner = RedisStore(Redis.from_url(self.redis_url, decode_responses=True), keys)
        else:
            inner = MemoryStore(keys)
        self.store = RecordingStore(inner)
        self.transport = Transport(self._check_dispatch)
        self.transitions = Transitions(self.store, self.transport, Plans(self.store, 64))
        settings = Settings(prefix=keys.prefix)
        registry = Registry({"work": work, "boom": boom})
        self.worker = Worker(
            settings, registry, pool="parallel", store=self.store, bus=self.transport
        )
        self.router = Router(settings, store=self.store, bus=self.transport)
        self.expected: dict[str, Expected] = {}
        self.furthest: dict[str, int] = {}  # per program, the latest leaf dispatched so far
        self.history: list[Envelope] = []

    def run(self, coroutine: Any) -> Any:
        return self.loop.run_until_complete(coroutine)

    def teardown(self) -> None:
        try:
            self._drain()
            for wf, expected in self.expected.items():
                self._check_end(wf, expected)
        finally:
            self.run(self.store.close())
            self.loop.close()

    # --- what must always hold -------------------------------------------------------

    def _check_dispatch(self, task: TaskMessage) -> None:
        """Called as each task message is published: every earlier step must be complete."""
        expected = self.expected[task.wf]
        paths = [path for path, _ in expected.leaves]
        if task.path not in paths:
            self.store.violations.append(f"{task.wf}: dispatched {task.path}, not in {paths}")
            return
        position = paths.index(task.path)
        for path, size in expected.leaves[:position]:
            if len(self.store.recorded[(task.wf, path)]) < size:
                self.store.violations.append(
                    f"{task.wf}: {task.path} dispatched before {path} completed"
                )
        furthest = self.furthest.get(task.wf, -1)
        if position < furthest:
            self.store.violations.append(
                f"{task.wf}: {task.path} dispatched again after {paths[furthest]} was"
            )
        self.furthest[task.wf] = max(furthest, position)

    @invariant()
    def nothing_out_of_order(self) -> None:
        assert not self.store.violations, self.store.violations

    @invariant()
    def barriers_fire_at_most_once(self) -> None:
        assert all(count == 1 for count in self.store.fired.values()), self.store.fired

    @invariant()
    def programs_end_at_most_once_and_as_the_model_says(self) -> None:
        assert all(count == 1 for count in self.store.ended.values()), self.store.ended
        for wf in self.store.ended:
            self._check_end(wf, self.expected[wf])

    def _check_end(self, wf: str, expected: Expected) -> None:
        status = self.run(self.router.status(wf))
        assert status is not None and status["status"] in TERMINAL, (
            f"{wf} never ended: lost a message ({status})"
        )
        assert self.store.ended[wf] == 1
        assert status["status"] == expected.status, (status, expected)
        if expected.status == "completed":
            assert status["result"] == expected.result
        else:
            assert status["error"].startswith(expected.error_prefix), (status, expected)
        dispatched = {path for (w, path) in self.store.recorded if w == wf}
        finished = {path for path, _ in expected.leaves}
        if expected.status == "completed":
            # Every leaf ran, so loops ran exactly as many iterations as the model says.
            assert dispatched == finished, (dispatched, finished)

    # --- the transport's moves ---------------------------------------------------------

    @initialize(drawn=st.lists(programs(), min_size=1, max_size=2))
    def submit(self, drawn: list[dict[str, Any]]) -> None:
        for program in drawn:
            wf = f"w{uuid.uuid4().hex[:8]}"
            self.expected[wf] = expect(program)
            self.run(self.router.submit(program, None, wf))

    def _deliver(self, index: int, crash_after: int | None = None) -> None:
        envelope = self.transport.in_flight.pop(index)
        delivery = FakeDelivery(envelope)
        self.transport.crash_after = crash_after
        try:
            if envelope.kind == "shard":
                coroutine = handle_shard_message(
                    delivery, self.transitions, self.transport, envelope.shard, "s"
                )
            else:
                coroutine = self.worker.handle(delivery, "tasks")
            self.run(coroutine)
        except Crash:
            pass
        finally:
            self.transport.crash_after = None
        assert not delivery.nacked, "a handler raised: see the log"
        if delivery.acked:
            self.history.append(envelope)
        else:  # the process died holding it: the broker delivers it again, flagged
            self.transport.in_flight.append(replace(envelope, redelivered=True))

    def _pick(self, data: st.DataObject, items: list[Envelope]) -> int:
        return data.draw(st.integers(0, len(items) - 1), label="message")

    @precondition(lambda self: self.transport.in_flight)
    @rule(data=st.data())
    def deliver(self, data: st.DataObject) -> None:
        self._deliver(self._pick(data, self.transport.in_flight))

    @precondition(lambda self: self.transport.in_flight)
    @rule(data=st.data(), crash_after=st.integers(-1, 3))
    def crash(self, data: st.DataObject, crash_after: int) -> None:
        """The process dies after `crash_after` of its publishes (state already written),
        or with -1 before doing anything: the message comes back flagged as redelivered."""
        index = self._pick(data, self.transport.in_flight)
        if crash_after >= 0:
            self._deliver(index, crash_after)
        else:
            envelope = self.transport.in_flight.pop(index)
            self.transport.in_flight.append(replace(envelope, redelivered=True))

    @precondition(lambda self: 0 < len(self.transport.in_flight) < MAX_IN_FLIGHT)
    @rule(data=st.data())
    def duplicate(self, data: st.DataObject) -> None:
        """A publisher retried after a lost confirm: the same message twice."""
        original = self.transport.in_flight[self._pick(data, self.transport.in_flight)]
        self.transport.in_flight.append(replace(original, redelivered=False))

    @precondition(lambda self: self.history and len(self.transport.in_flight) < MAX_IN_FLIGHT)
    @rule(data=st.data(), redelivered=st.booleans())
    def stale(self, data: st.DataObject, redelivered: bool) -> None:
        """An old message, already handled (from an earlier step or iteration), comes back."""
        old = self.history[self._pick(data, self.history)]
        self.transport.in_flight.append(replace(old, redelivered=redelivered))

    def _drain(self) -> None:
        # A correct system needs about one delivery per message it still owes; allow plenty.
        owed = sum(size + 1 for expected in self.expected.values() for _, size in expected.leaves)
        for _ in range(4 * (owed + len(self.transport.in_flight)) + 100):
            if not self.transport.in_flight:
                return
            self._deliver(0)
            self.nothing_out_of_order()
        raise AssertionError("the system kept producing messages: a loop that never ends")


@pytest.mark.parametrize("store_kind", ["redis", "memory"])
def test_transitions_keep_order_under_duplicates_reordering_and_crashes(
    keyspace: tuple[str, str], store_kind: str
) -> None:
    Cluster.redis_url, Cluster.prefix = keyspace
    Cluster.store_kind = store_kind
    run_state_machine_as_test(Cluster)


@pytest.mark.parametrize("seed", [0])
def test_the_model_agrees_with_a_hand_worked_program(seed: int) -> None:
    program = {
        "steps": [
            {"task": "work"},
            {
                "until": "iteration >= 1",
                "max_iterations": 3,
                "steps": [{"bag": [{"task": "work"}] * 2}],
            },
        ]
    }
    expected = expect(program)
    assert expected.leaves == [("0", 1), ("1/iter:0/0", 2), ("1/iter:1/0", 2)]
    assert expected.result == [output_of("1/iter:1/0", 0), output_of("1/iter:1/0", 1)]
