"""What an orchestrator does with one shard message: decide, compare-and-advance, publish.

No program state is kept here between messages: plans are immutable and only cached.
"""

from __future__ import annotations

import json
import logging
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any

from orchestrator import machine
from orchestrator.bus import Publisher
from orchestrator.messages import Failed, Next, Start, TaskMessage, encode
from orchestrator.program import Bag, Program, parse_program
from orchestrator.store import Store

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Plan:
    """A recorded program with its input and owner: immutable once submitted."""

    program: Program
    input: Any
    owner: int


class Plans:
    """A bounded cache of plans, so a transition costs one Redis call, not two."""

    def __init__(self, store: Store, size: int) -> None:
        self._store = store
        self._size = size
        self._cache: OrderedDict[str, Plan] = OrderedDict()

    async def get(self, wf: str) -> Plan | None:
        plan = self._cache.get(wf)
        if plan is not None:
            self._cache.move_to_end(wf)
            return plan
        raw = await self._store.plan(wf)
        if raw is None:
            return None
        plan = Plan(parse_program(raw["program"], max_bytes=1 << 30), raw["input"], raw["owner"])
        self._cache[wf] = plan
        if len(self._cache) > self._size:
            self._cache.popitem(last=False)
        return plan

    def forget(self, wf: str) -> None:
        self._cache.pop(wf, None)


def task_messages(wf: str, plan: Plan, leaf: machine.Leaf) -> tuple[str, list[bytes]]:
    """The pool and the task messages that run one leaf."""
    step = leaf.step
    common = {
        "wf": wf,
        "path": leaf.path,
        "input": plan.input,
        "prev": leaf.prev,
        "iteration": leaf.iteration,
        "owner": plan.owner,
    }
    if isinstance(step, Bag):
        size = len(step.bag)
        bodies = [
            encode(
                TaskMessage(
                    **common,
                    index=i,
                    size=size,
                    task=member.task,
                    args=member.args,
                    timeout_s=member.timeout_s,
                )
            )
            for i, member in enumerate(step.bag)
        ]
        return "parallel", bodies
    body = TaskMessage(**common, task=step.task, args=step.args, timeout_s=step.timeout_s)
    return step.pool, [encode(body)]


class Transitions:
    """Applies start / next / failed messages of the shards this process owns."""

    def __init__(self, store: Store, bus: Publisher, plans: Plans) -> None:
        self.store = store
        self.bus = bus
        self.plans = plans
        self.counts: Counter[str] = Counter()

    async def apply(self, message: Start | Next | Failed, *, redelivered: bool) -> str:
        """Apply one message; return the verdict (applied, replay, stale, missing)."""
        plan = await self.plans.get(message.wf)
        if plan is None:
            self.counts["missing"] += 1
            log.warning("%s: no such program; message dropped", message.wf)
            return "missing"
        if isinstance(message, Start):
            expected, outcome = "", machine.first(plan.program)
        elif isinstance(message, Next):
            expected = message.path
            outcome = machine.after(plan.program, message.path, message.output, plan.input)
        else:
            expected = message.path
            where = message.path if message.index is None else f"{message.path}/bag:{message.index}"
            outcome = machine.Failed(f"step {where}: task {message.task!r}: {message.error}")
        verdict = await self._advance(message.wf, expected, outcome)
        self.counts[verdict.verdict] += 1
        # A redelivered message may be the one whose publishing a crash cut short.
        if verdict.verdict == "applied" or (verdict.verdict == "replay" and redelivered):
            await self._publish(message.wf, plan, outcome)
        if verdict.status in ("completed", "failed", "cancelled"):
            self.plans.forget(message.wf)
        return verdict.verdict

    async def _advance(self, wf: str, expected: str, outcome: machine.Outcome) -> Any:
        if isinstance(outcome, machine.Leaf):
            return await self.store.advance(wf, expected, outcome.path, "running")
        if isinstance(outcome, machine.Done):
            return await self.store.advance(
                wf, expected, "", "completed", "result", json.dumps(outcome.result)
            )
        return await self.store.advance(wf, expected, "", "failed", "error", outcome.error)

    async def _publish(self, wf: str, plan: Plan, outcome: machine.Outcome) -> None:
        if isinstance(outcome, machine.Leaf):
            pool, bodies = task_messages(wf, plan, outcome)
            await self.bus.publish_all(pool, bodies)
