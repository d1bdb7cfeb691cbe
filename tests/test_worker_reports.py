"""What a worker reports after it recorded a bag member's output: the step's `next` once, from
the member that filled the barrier, and again only from a redelivered message (its earlier run
may have recorded and died before reporting). Over the model of the scripts."""

from __future__ import annotations

import json

from orchestrator.messages import decode_task
from tests.test_carry import Delivery, _started, _worker

BAG = {"steps": [{"bag": [{"task": "work"}, {"task": "work"}]}]}


async def test_a_member_of_a_complete_step_reports_it_again_only_when_redelivered() -> None:
    store, bus, _, _ = await _started("again-bag", BAG)
    worker = _worker(store, bus)
    first, second = bus.tasks
    wf = decode_task(first).wf
    expected = {"kind": "next", "wf": wf, "path": "0", "output": ["done", "done"], "stored": False}
    await worker.handle(Delivery(first, {}), "q")
    assert bus.shard == []  # the barrier waits for the other member
    await worker.handle(Delivery(second, {}), "q")
    assert [json.loads(body) for body in bus.shard] == [expected]
    bus.shard.clear()
    # Copies at another worker, which knows nothing of that run (this one acks them unrun:
    # tests/test_given_back.py). Delivered for the first time (a duplicate publish): the step
    # was reported.
    other = _worker(store, bus)
    await other.handle(Delivery(second, {}), "q")
    assert bus.shard == [] and other.counts["again"] == 1
    # Redelivered: its earlier run may be the one that recorded and died before reporting.
    await other.handle(Delivery(second, {}, redelivered=True), "q")
    assert [json.loads(body) for body in bus.shard] == [expected]
