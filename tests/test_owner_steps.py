"""The owner's transitions step by step over the model of the scripts: moments the property
test reaches only at its long budget (a wake redelivered after a crash), and forged reports."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from prometheus_client import REGISTRY

from orchestrator.delivery import Poison
from orchestrator.keys import Keys
from orchestrator.memory_store import MemoryStore
from orchestrator.messages import (
    Deadline,
    Failed,
    Next,
    Signalled,
    Start,
    Wake,
    decode_shard_message,
    decode_task,
)
from orchestrator.plans import Plans
from orchestrator.settings import Settings
from orchestrator.transitions import Transitions
from router.client import Router


class Crash(Exception):
    """The process died after its state was written, before its publish."""


class Recorder:
    """A publisher that keeps what it is given; `crash` makes the next task publish die."""

    def __init__(self) -> None:
        self.shard: list[bytes] = []
        self.later: list[bytes] = []
        self.tasks: list[bytes] = []
        self.crash = False

    async def publish_to_shard(
        self, owner: int, body: bytes, priority: int = 1, most: int = 1
    ) -> None:
        self.shard.append(body)

    async def publish_to_shard_later(self, owner: int, body: bytes, delay_s: float) -> None:
        self.later.append(body)

    async def publish_all(
        self,
        pool: str,
        bodies: list[bytes],
        priority: int = 1,
        headers: Any = None,
        most: int = 1,
    ) -> None:
        if self.crash:
            self.crash = False
            raise Crash
        self.tasks.extend(bodies)

    async def publish_later(
        self, pool: str, body: bytes, delay_s: float, priority: int = 1, headers: Any = None
    ) -> None:
        self.tasks.append(body)

    async def publish_control(self, body: bytes) -> None: ...

    async def dead_letter(self, body: bytes, *, reason: str, source: str, **_: Any) -> None:
        raise AssertionError(f"dead-lettered: {reason}")

    async def requeue(
        self, queue: str, body: bytes, headers: Any, priority: Any, **_: Any
    ) -> None: ...


async def test_a_redelivered_wake_republishes_the_step_a_crash_cut_short() -> None:
    store = MemoryStore(Keys("wake"))
    bus = Recorder()
    transitions = Transitions(store, bus, Plans(store, 8))
    router = Router(Settings(prefix="wake"), store=store, bus=bus)
    program = {"steps": [{"sleep_s": 0.0001}, {"task": "work"}]}
    submitted = await router.submit(program, None, "napper")
    owner = submitted.shard
    start = decode_shard_message(bus.shard.pop())
    assert isinstance(start, Start)
    assert await transitions.apply(start, redelivered=False, shard=owner) == "applied"
    wake = decode_shard_message(bus.later.pop())
    assert wake == Wake(wf="napper", path="0")
    # Due: the owner advances to step 1, then dies before its task is published.
    bus.crash = True
    try:
        await transitions.apply(wake, redelivered=False, shard=owner)
    except Crash:
        pass
    else:
        raise AssertionError("the publish did not run")
    assert (await store.state("napper"))["cursor"] == "1" and not bus.tasks
    # The broker delivers the wake again, flagged: what the crash cut short is published.
    assert await transitions.apply(wake, redelivered=True, shard=owner) == "replay"
    [task] = [decode_task(body) for body in bus.tasks]
    assert (task.path, task.task, task.prev) == ("1", "work", None)


async def test_a_failure_report_with_an_item_over_a_maps_bound_is_refused() -> None:
    store = MemoryStore(Keys("item"))
    bus = Recorder()
    transitions = Transitions(store, bus, Plans(store, 8))
    router = Router(Settings(prefix="item"), store=store, bus=bus)
    retry = {"max_attempts": 2}
    program = {"steps": [{"map": "input", "task": "work", "max_items": 3, "retry": retry}]}
    owner = (await router.submit(program, ["a", "b"], "mapper")).shard
    start = decode_shard_message(bus.shard.pop())
    await transitions.apply(start, redelivered=False, shard=owner)
    [first, _] = [decode_task(body) for body in bus.tasks]
    # A forged report would have the retry carry a 70 KB item the map itself refuses.
    forged = Failed(wf="mapper", path="0", index=0, task="work", error="no", item="x" * 70_000)
    with pytest.raises(Poison, match="over a map item's limit"):
        await transitions.apply(forged, redelivered=False, shard=owner)
    report = Failed(wf="mapper", path="0", index=0, task="work", error="no", item=first.item)
    assert await transitions.apply(report, redelivered=False, shard=owner) == "retried"
    assert decode_task(bus.tasks[-1]).item == "a"


async def test_a_signal_stays_for_the_later_step_when_the_branch_that_waited_was_left() -> None:
    """A branch's signal step whose bag was left (a stray `next` moved the program on) takes
    nothing when its timer comes due: the signal stays for the later step of that name."""
    store = MemoryStore(Keys("left"))
    bus = Recorder()
    transitions = Transitions(store, bus, Plans(store, 8))
    router = Router(Settings(prefix="left"), store=store, bus=bus)
    waits = {"steps": [{"signal": "go", "timeout_s": 0.001}]}
    program = {"steps": [{"bag": [waits, {"task": "work"}]}, {"signal": "go"}]}
    owner = (await router.submit(program, None, "abandoned")).shard
    start = decode_shard_message(bus.shard.pop())
    assert await transitions.apply(start, redelivered=False, shard=owner) == "applied"
    timer = decode_shard_message(bus.later.pop())
    assert timer == Wake(wf="abandoned", path="0/branch:0/0")
    stray = Next(wf="abandoned", path="0", output=["a", "b"])
    assert await transitions.apply(stray, redelivered=False, shard=owner) == "applied"
    await router.signal("abandoned", "go", "for step 1")
    hint = decode_shard_message(bus.shard.pop())
    # The branch's timer is due after the bag was left: stale, nothing taken.
    assert await transitions.apply(timer, redelivered=False, shard=owner) == "stale"
    assert not bus.shard
    # The hint finds step 1 waiting: it takes the signal, and the program ends with it.
    assert await transitions.apply(hint, redelivered=False, shard=owner) == "taken"
    done = decode_shard_message(bus.shard.pop())
    assert await transitions.apply(done, redelivered=False, shard=owner) == "applied"
    state = await store.state("abandoned")
    assert (state["status"], state["result"]) == ("completed", '"for step 1"')


async def test_a_replayed_advance_into_a_bag_republishes_only_branches_still_at_their_start() -> (
    None
):
    """A start delivered again after one branch of its bag moved on: the replay republishes
    the bag's own member and the branch still at its first leaf, not the one that moved (its
    later leaf is already out; the old first leaf would run again, only to be refused)."""
    store = MemoryStore(Keys("rebag"))
    bus = Recorder()
    transitions = Transitions(store, bus, Plans(store, 8))
    router = Router(Settings(prefix="rebag"), store=store, bus=bus)
    two = {"steps": [{"task": "work"}, {"task": "work"}]}
    program = {"steps": [{"bag": [two, {"steps": [{"task": "work"}]}, {"task": "work"}]}]}
    owner = (await router.submit(program, None, "rebag")).shard
    start = decode_shard_message(bus.shard.pop())
    assert await transitions.apply(start, redelivered=False, shard=owner) == "applied"

    def sent() -> set[tuple[str, int | None]]:
        found = {(task.path, task.index) for task in map(decode_task, bus.tasks)}
        bus.tasks.clear()
        return found

    assert sent() == {("0/branch:0/0", None), ("0/branch:1/0", None), ("0", 2)}
    moved = Next(wf="rebag", path="0/branch:0/0", output="a")
    assert await transitions.apply(moved, redelivered=False, shard=owner) == "applied"
    assert sent() == {("0/branch:0/1", None)}
    assert await transitions.apply(start, redelivered=True, shard=owner) == "replay"
    assert sent() == {("0/branch:1/0", None), ("0", 2)}


async def test_a_redelivered_start_of_a_redriven_run_republishes_its_step() -> None:
    """A redriven run's start comes from its `prior`, not from "": its redelivery was stale, so
    a crash between its advance and its publish lost the run (found by the property test)."""
    await _redriven_start_replays(Settings(prefix="redriven"), MemoryStore(Keys("redriven")))


async def test_the_lua_replays_a_redelivered_start_of_a_redriven_run(
    settings: Settings, store: Any
) -> None:
    await _redriven_start_replays(settings, store)


async def _redriven_start_replays(settings: Settings, store: Any) -> None:
    bus = Recorder()
    transitions = Transitions(store, bus, Plans(store, 8))
    router = Router(settings, store=store, bus=bus)
    program = {"steps": [{"task": "work"}, {"task": "work"}]}
    owner = (await router.submit(program, None, "again")).shard
    start = decode_shard_message(bus.shard.pop())
    assert await transitions.apply(start, redelivered=False, shard=owner) == "applied"
    report = Next(wf="again", path="0", output="first")
    assert await transitions.apply(report, redelivered=False, shard=owner) == "applied"
    failed = Failed(wf="again", path="1", task="work", error="no")
    await transitions.apply(failed, redelivered=False, shard=owner)
    assert (await store.state("again"))["status"] == "failed"
    bus.tasks.clear()
    await router.redrive("again")  # from the failed step 1, with step 0's output as its prev
    rerun = decode_shard_message(bus.shard.pop())
    assert isinstance(rerun, Start)
    # The owner advances the new run to step 1, then dies before its task is published.
    bus.crash = True
    with pytest.raises(Crash):
        await transitions.apply(rerun, redelivered=False, shard=owner)
    assert (await store.state("again"))["cursor"] == "1" and not bus.tasks
    # The broker delivers the start again, flagged: what the crash cut short is published.
    assert await transitions.apply(rerun, redelivered=True, shard=owner) == "replay"
    [task] = [decode_task(body) for body in bus.tasks]
    assert (task.path, task.prev, task.epoch) == ("1", "first", 1)
    # A start not flagged, or one after the run moved on, owes nothing.
    bus.tasks.clear()
    assert await transitions.apply(rerun, redelivered=False, shard=owner) == "replay"
    assert not bus.tasks


async def test_a_start_that_stalled_before_its_advance_leaves_a_redriven_run_alone() -> None:
    await _stalled_start_is_stale(Settings(prefix="stalled"), MemoryStore(Keys("stalled")))


async def test_the_lua_leaves_a_redriven_run_alone_for_a_stalled_start(
    settings: Settings, store: Any
) -> None:
    await _stalled_start_is_stale(settings, store)


async def _stalled_start_is_stale(settings: Settings, store: Any) -> None:
    """An owner reads a start's run, then stalls (a pause longer than the broker's patience);
    the start goes to a standby, the run fails and is redriven. The stalled advance must not
    move the new run: it did, to a step of the old run that every worker refuses, and the
    redrive's own start was then stale: a running program with nothing in flight."""
    stalled_bus, standby_bus = Recorder(), Recorder()
    stalled = Transitions(store, stalled_bus, Plans(store, 8))
    standby = Transitions(store, standby_bus, Plans(store, 8))
    router = Router(settings, store=store, bus=standby_bus)
    program = {"steps": [{"task": "work"}, {"task": "work"}]}
    owner = (await router.submit(program, None, "paused")).shard
    start = decode_shard_message(standby_bus.shard.pop())
    gate = asyncio.Event()
    advance = stalled._advance

    async def paused(*args: Any, **kwargs: Any) -> Any:
        await gate.wait()  # after the state was read, before the script
        return await advance(*args, **kwargs)

    stalled._advance = paused  # type: ignore[method-assign]
    late = asyncio.create_task(stalled.apply(start, redelivered=False, shard=owner))
    await asyncio.sleep(0.05)
    assert await standby.apply(start, redelivered=True, shard=owner) == "applied"
    report = Next(wf="paused", path="0", output="first")
    assert await standby.apply(report, redelivered=False, shard=owner) == "applied"
    failed = Failed(wf="paused", path="1", task="work", error="no")
    await standby.apply(failed, redelivered=False, shard=owner)
    await router.redrive("paused")
    rerun = decode_shard_message(standby_bus.shard.pop())
    gate.set()
    assert await late == "stale" and not stalled_bus.tasks
    standby_bus.tasks.clear()
    assert await standby.apply(rerun, redelivered=False, shard=owner) == "applied"
    [task] = [decode_task(body) for body in standby_bus.tasks]
    assert (task.path, task.prev, task.epoch) == ("1", "first", 1)
    state = await store.state("paused")
    assert (state["status"], state["cursor"], state["epoch"]) == ("running", "1", "1")


async def test_a_signal_handler_that_stalled_takes_nothing_from_a_redriven_run() -> None:
    await _stalled_take_is_stale(Settings(prefix="stalled"), MemoryStore(Keys("stalled")))


async def test_the_lua_takes_no_signal_for_a_stalled_handler_of_an_earlier_run(
    settings: Settings, store: Any
) -> None:
    await _stalled_take_is_stale(settings, store)


async def _stalled_take_is_stale(settings: Settings, store: Any) -> None:
    """A signal's handler reads the run at its signal step, then stalls; the program is
    cancelled and redriven to that step again. The late take must leave the signal kept: it
    took it for the new run with a `next` of the old one (stale), and the step waited on."""
    stalled_bus, standby_bus = Recorder(), Recorder()
    stalled = Transitions(store, stalled_bus, Plans(store, 8))
    standby = Transitions(store, standby_bus, Plans(store, 8))
    router = Router(settings, store=store, bus=standby_bus)
    program = {"steps": [{"signal": "go"}, {"task": "work"}]}
    owner = (await router.submit(program, None, "held")).shard
    start = decode_shard_message(standby_bus.shard.pop())
    assert await standby.apply(start, redelivered=False, shard=owner) == "applied"
    await router.signal("held", "go", "yes")
    signalled = decode_shard_message(standby_bus.shard.pop())
    gate = asyncio.Event()
    take = stalled._take

    async def paused(*args: Any, **kwargs: Any) -> str:
        await gate.wait()  # the run was read at the signal step; the take is yet to come
        return await take(*args, **kwargs)

    stalled._take = paused  # type: ignore[method-assign]
    late = asyncio.create_task(stalled.apply(signalled, redelivered=False, shard=owner))
    await asyncio.sleep(0.05)
    await router.cancel("held")
    await router.redrive("held")
    rerun = decode_shard_message(standby_bus.shard.pop())
    assert await standby.apply(rerun, redelivered=False, shard=owner) == "applied"
    gate.set()
    assert await late == "stale" and not stalled_bus.shard
    assert await standby.apply(signalled, redelivered=True, shard=owner) == "taken"
    report = decode_shard_message(standby_bus.shard.pop())
    standby_bus.tasks.clear()
    assert await standby.apply(report, redelivered=False, shard=owner) == "applied"
    [task] = [decode_task(body) for body in standby_bus.tasks]
    assert (task.path, task.prev, task.epoch) == ("1", "yes", 1)


async def test_a_late_untrack_leaves_a_program_redriven_meanwhile_counted() -> None:
    await _late_untrack_keeps_a_redriven_program(Settings(prefix="late"), MemoryStore(Keys("late")))


async def test_redis_counts_again_a_program_redriven_before_a_late_untrack(
    settings: Settings, store: Any
) -> None:
    await _late_untrack_keeps_a_redriven_program(settings, store)


async def _late_untrack_keeps_a_redriven_program(settings: Settings, store: Any) -> None:
    """A sweep read a program failed, and untracks it only after a redrive opened it again:
    it dropped out of its shard's live set while it ran (`shards` undercounted it, and no
    sweep would start it again had its start been lost)."""
    bus = Recorder()
    transitions = Transitions(store, bus, Plans(store, 8))
    router = Router(settings, store=store, bus=bus)
    owner = (await router.submit({"steps": [{"task": "work"}]}, None, "late")).shard
    start = decode_shard_message(bus.shard.pop())
    assert await transitions.apply(start, redelivered=False, shard=owner) == "applied"
    failed = Failed(wf="late", path="0", task="work", error="no")
    await transitions.apply(failed, redelivered=False, shard=owner)
    assert [wf async for wf in store.live(owner)] == []
    await router.redrive("late")
    await store.untrack("late", owner)  # the sweep's, of what it read before the redrive
    assert [wf async for wf in store.live(owner)] == ["late"]
    await router.cancel("late")  # ended for real: no longer counted
    assert [wf async for wf in store.live(owner)] == []


async def test_timers_of_a_purged_program_whose_plan_is_cached_are_gone_once_each() -> None:
    """A deadline or a signal for a program deleted under it, its plan still in the owner's
    cache, is ignored as `gone` (counted once, as a metric too), never kept or dead-lettered."""
    store = MemoryStore(Keys("purged"))
    bus = Recorder()
    transitions = Transitions(store, bus, Plans(store, 8))
    router = Router(Settings(prefix="purged"), store=store, bus=bus)
    program = {"deadline_s": 60, "steps": [{"signal": "go"}]}
    owner = (await router.submit(program, None, "purged")).shard
    start = decode_shard_message(bus.shard.pop())
    await transitions.apply(start, redelivered=False, shard=owner)
    assert await store.cancel("purged", "cancelled", "by hand", None, False, False)
    assert await store.purge("purged", "cancelled", 2**62) == "purged"
    before = REGISTRY.get_sample_value("shardflow_gone_ignored_total", {"part": "orchestrator"})
    for message in (Deadline(wf="purged", deadline_s=60), Signalled(wf="purged", name="go")):
        assert await transitions.apply(message, redelivered=False, shard=owner) == "gone"
    assert transitions.counts["gone"] == 2 and "kept" not in transitions.counts
    after = REGISTRY.get_sample_value("shardflow_gone_ignored_total", {"part": "orchestrator"})
    assert (after or 0) - (before or 0) == 2
