"""The shard owner: the orchestrator process that consumes its shards' queues, each program's
messages one at a time in delivery order, and so owns the ordering of their programs."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Coroutine, Sequence
from typing import Any

from orchestrator import logs, metrics
from orchestrator.backlog import Backlog
from orchestrator.bus import NEW, Bus, Publisher
from orchestrator.consuming import Deliveries, Incoming
from orchestrator.delivery import (
    UNREACHABLE,
    Delivery,
    Part,
    Requeues,
    fault,
    process,
    redelivered,
    settle,
    split,
    split_headers,
    waits_for_services,
)
from orchestrator.lifecycle import Service, format_counts, raise_if_cancelled
from orchestrator.machine import PathError
from orchestrator.marks import Marks
from orchestrator.messages import (
    MAX_BUNDLE_BODY,
    Failed,
    MessageError,
    Next,
    ShardMessage,
    Start,
    bundle,
    decode_shard_body,
    encode,
)
from orchestrator.ordering import ProgramOrder
from orchestrator.paths import SAGA
from orchestrator.plans import Plans
from orchestrator.program import ProgramError
from orchestrator.settings import Settings
from orchestrator.store import TERMINAL, Store
from orchestrator.transitions import Transitions

log = logging.getLogger(__name__)
# Live programs whose states a sweep reads side by side.
SWEEP_PAGE = 256
# Live programs a sweep reads per shard, at most: it goes on where the last one stopped, so its
# cost is a constant whatever the number of live programs (0.08 ms of CPU each here: a
# shard with a million live programs is swept whole every 245 sweeps, about 2 hours).
SWEEP_BUDGET = 4096

# Retrying cannot help these (nor a MessageError): the plan or the path a message names is bad.
SHARD_POISON = (ProgramError, PathError)


async def handle_shard_message(
    delivery: Delivery,
    transitions: Transitions,
    bus: Publisher,
    shard: int,
    source: str,
    limit: int = 20,
    decoded: ShardMessage | None = None,
) -> None:
    """Apply one message of `shard` (`decoded`: its body, already parsed); ack only after
    what it publishes is confirmed."""
    async with process(delivery, bus, source, poison=SHARD_POISON, limit=limit):
        if decoded is None:  # raises the fault, a bundle's too
            found = decode_shard_body(delivery.body)
            if isinstance(found, list):
                raise MessageError("a bundle of reports, where one message was expected")
            decoded = found
        logs.bind(workflow_id=decoded.wf, step=getattr(decoded, "path", None), shard=shard)
        await transitions.apply(decoded, redelivered=redelivered(delivery), shard=shard)


def _parsed(body: bytes) -> ShardMessage | list[Next | Failed] | None:
    """The message (or a bundle's reports), or None when it is malformed (handled, and
    dead-lettered, on its own)."""
    try:
        return decode_shard_body(body)
    except MessageError:
        return None


async def send_on(whole: Delivery, bus: Requeues, queue: str, bodies: list[bytes]) -> None:
    """Publish again, counted as redelivered, reports a bundle carried that were not settled
    in its try: as one bundle, which the next owner splits (published whole or not at all, so
    none goes twice), or each alone when they no longer fit in one (a bundle some other sender
    wrote can be longer written again: 1e15 comes back as 1000000000000000.0)."""
    log.info("%s: %d report(s) of a bundle go on", queue, len(bodies))
    body = bundle(bodies)
    if len(body) > MAX_BUNDLE_BODY:
        await split(whole, bus, queue, bodies)
        return
    await bus.requeue(queue, body, split_headers(whole), whole.priority)


class ShardError(ValueError):
    """Shards an orchestrator cannot own."""


class Orchestrator(Service):
    """Owns the ordering of the programs on the shards it consumes; any replica may take over."""

    name = "orchestrator"

    def __init__(
        self,
        settings: Settings,
        owned: Sequence[int],
        *,
        store: Store,
        bus: Bus,
        drain: bool = False,
    ) -> None:
        """Consume the shards in `owned`; with `drain`, also every shard outside the ring
        (0..settings.shards-1) that owned programs."""
        super().__init__(settings.grace_s)
        if not owned or min(owned) < 0:
            raise ValueError(f"{list(owned)}: name one or more shards, from 0")
        self.settings = settings
        self.owned = sorted(set(owned))
        self.store = store
        self.bus = bus
        self.drain = drain
        self.limit = settings.delivery_limit
        # Ids in a shard's live set without a state, seen in the last whole scan of it and in
        # this one so far: seen in two scans, they are no submit between its two writes.
        self._unrecorded: dict[int, set[str]] = {}
        self._unrecorded_now: dict[int, set[str]] = {}
        self._cursors: dict[int, str] = {}  # where each shard's scan goes on
        self.marks = Marks(store)  # for `list` and `explain` only
        plans = Plans(store, settings.plan_cache_size)
        self.backlog = Backlog(
            bus.queue_state,
            settings.auto_chunk,
            queue_of=bus.names.task_queue,
            upstream=[bus.names.shard_queue(shard) for shard in self.owned],
        )
        self.transitions = Transitions(
            store,
            bus,
            plans,
            settings.max_join_bytes,
            backlog=self.backlog,
            bundles=settings.bundle_tasks,
        )

    async def run(self) -> None:
        try:
            await super().run()
        finally:
            await self.backlog.close()

    def summary(self) -> str:
        return format_counts(self.transitions.counts)

    async def _start(self) -> list[Coroutine[Any, Any, None]]:
        ring = self.settings.shards
        if self.drain:
            used = await self.store.shards_used()
            self.owned = sorted(set(self.owned) | {shard for shard in used if shard >= ring})
        outside = [shard for shard in self.owned if shard >= ring]
        if outside:
            # After the shard count went down, old shards are drained, never invented.
            used = await self.store.shards_used()
            empty = [shard for shard in outside if shard not in used]
            # No process ever declared its queue: it was in no ring, a typo.
            unknown = [shard for shard in empty if await self.bus.shard_queue_state(shard) is None]
            if unknown:
                raise ShardError(
                    f"shards {unknown} are outside the ring 0..{ring - 1} "
                    f"(SHARDFLOW_SHARDS={ring}) and never owned a program"
                )
            if empty:
                # Nothing to drain, but exiting would crash-loop a Deployment, and a router on
                # the old count may still send here: stay up and consume, ready.
                log.warning(
                    "orchestrator: shards %s left the ring and never held a program: nothing "
                    "to drain; remove them from drainShards (or --shards)",
                    empty,
                )
            log.info("orchestrator: draining shards %s, outside the ring 0..%d", outside, ring - 1)
        counting = metrics.count_in_flight(self.store, self.owned)
        return [*(self._consume(shard) for shard in self.owned), self._sweep_every(), counting]

    async def _sweep_every(self) -> None:
        while True:
            try:
                started = await self.sweep()
                if started:
                    log.warning("orchestrator: started %d program(s) that never started", started)
            except Exception as exc:
                if not (isinstance(exc, UNREACHABLE) or waits_for_services(exc)):
                    # e.g. aio-pika's channel() while it reconnects: try next time
                    log.exception("orchestrator: sweep failed; the next one tries again")
                else:  # a service away, or Redis refusing work (BUSY, say): one line
                    log.warning("orchestrator: sweep skipped: %s", fault(exc))
            raise_if_cancelled()
            await asyncio.sleep(self.settings.sweep_s)

    async def sweep(self) -> int:
        """Start the programs of the owned shards that were recorded but never started (their
        client or router died in between) once their shard's queue is empty, and stop
        counting ids that were never recorded (seen in two scans of the shard: a submit may
        be between its two writes). Reads at most SWEEP_BUDGET live programs per shard, from
        where the last sweep stopped. Idempotent: starting twice is a stale
        compare-and-advance. Returns how many it started."""
        started = 0
        # On Redis's clock, as created_ms and updated_ms are: an owner behind it started late.
        old_ms = (await self.transitions.clock.now() - self.settings.sweep_s) * 1000
        indexed: dict[str, int] = {}  # repairs the creation index (router/listing.py)
        for shard in self.owned:
            # A pending program's start may still wait in a busy queue: under a backlog, a
            # sweep would only double the starts. An empty queue holds no start for anyone.
            queue = await self.bus.shard_queue_state(shard)
            waiting = bool(queue and queue[0])
            async for wf, state in self._states(shard):
                if state:
                    indexed[wf] = int(state.get("created_ms") or 0)
                if len(indexed) >= SWEEP_PAGE:  # a page at a time: one huge ZADD stalls Redis
                    await self.marks.index(indexed)
                    indexed = {}
                if not state:
                    if wf in self._unrecorded.get(shard, ()):
                        await self.store.untrack(wf, shard)
                    else:
                        self._unrecorded_now.setdefault(shard, set()).add(wf)
                elif state["status"] in TERMINAL or int(state["owner"]) != shard:
                    await self.store.untrack(wf, shard)
                elif waiting:
                    continue
                elif (
                    state["status"] == "pending" and int(state.get("created_ms") or 0) < old_ms
                ) or (
                    state["status"] == "compensating" and await self._unstarted(wf, state, old_ms)
                ):
                    await self.bus.publish_to_shard(shard, encode(Start(wf=wf)), NEW)
                    started += 1
        await self.marks.index(indexed)
        await self.marks.prune_ended()
        await self.marks.prune_index()
        return started

    async def _states(self, shard: int) -> AsyncIterator[tuple[str, dict[str, str]]]:
        """Up to SWEEP_BUDGET live programs of a shard, from where the last sweep stopped, with
        their brief states, read a page at a time side by side (pipelined:
        orchestrator/pipelining.py): one read after another cost 0.3 ms of CPU per live
        program every sweep (bench/growth.py). A scan that reaches the end of the live set
        starts the next one over."""
        cursor, seen = self._cursors.get(shard, "0"), 0
        while True:  # at most SWEEP_BUDGET / SWEEP_PAGE + 1 pages
            cursor, page = await self.store.live_page(shard, cursor, SWEEP_PAGE)
            for found in zip(page, await self._read(page), strict=True):
                yield found
            seen += len(page)
            if cursor == "0":  # the whole set seen: what was unrecorded in it is now "before"
                self._unrecorded[shard] = self._unrecorded_now.pop(shard, set())
                break
            if seen >= SWEEP_BUDGET:
                break
        self._cursors[shard] = cursor

    async def _read(self, page: list[str]) -> list[dict[str, str]]:
        return list(await asyncio.gather(*(self.store.brief(wf) for wf in page)))

    async def _unstarted(self, wf: str, state: dict[str, str], old_ms: float) -> bool:
        """Whether a compensating program's compensations never started (a crash between its
        failure or cancel and the `start` that runs them), for longer than a sweep."""
        at = await self.store.at(wf, f"{SAGA}:0")  # the saga's cursor: "" before its start
        return not at.get("cursor") and int(state.get("updated_ms") or 0) < old_ms

    async def _consume(self, shard: int) -> None:
        queue = self.bus.names.shard_queue(shard)

        owning = False  # whether this consumer had a delivery since it (re)started

        async def start() -> Deliveries:
            nonlocal owning
            owning = False
            iterator = await self.bus.consume_shard(shard, self.settings.prefetch)
            log.info("orchestrator: consuming %s", queue)
            return iterator

        # Up to `prefetch` messages at once, each program's one at a time in delivery order
        # (orchestrator/ordering.py); a slot is held until its message settled. A bundle of
        # reports takes one slot, so its reports also take one of `prefetch` turns to work,
        # held through a failure's pause: a broken dependency is tried at most `prefetch` times
        # a pause. A turn is taken after the program's earlier messages ended: whoever holds
        # one waits for nobody else's.
        slots = asyncio.Semaphore(self.settings.prefetch)
        turns = asyncio.Semaphore(self.settings.prefetch)
        order = ProgramOrder()

        async def handle(message: Delivery, decoded: ShardMessage | None) -> None:
            async def begin() -> None:
                async with turns:
                    if self._stop.is_set():  # stopping: never begun, handed back now, in order
                        await settle(message, ok=False)
                        return
                    await handle_shard_message(
                        message, self.transitions, self.bus, shard, queue, self.limit, decoded
                    )

            # A malformed message has no program to wait for: it is dead-lettered at once.
            await (order.run(decoded.wf, begin()) if decoded else begin())

        def settled(task: asyncio.Task[None]) -> None:
            slots.release()  # also for a task cancelled before it began
            if not task.cancelled() and task.exception() is not None:
                log.error("orchestrator: a message's work failed", exc_info=task.exception())

        async for message in self._messages(start, self.bus.stop_consuming):
            if not owning:
                # The first delivery since the consumer (re)started: the moment this process
                # became the shard's owner (a standby's consumer starts long before). Another
                # owned it meanwhile, where an id may have ended, been purged and come back
                # with another program: the plans kept from before are not trusted.
                owning = True
                self.transitions.plans.forget_shard(shard)
            await self.marks.owner(shard)  # who owns the shard, for `explain`
            await slots.acquire()
            decoded = _parsed(message.body)
            # Spawned: a stop cancels this loop, never a message's work (it gets the grace).
            if not isinstance(decoded, list):
                self._spawn(handle(message, decoded)).add_done_callback(settled)
            elif redelivered(message):
                self._spawn(self._split(message, decoded, queue)).add_done_callback(settled)
            else:
                # Each report is one program's message, in its place in that program's order:
                # spawned now, in delivery order, before the next message's work.
                parts = [Part(message, functools.partial(encode, report)) for report in decoded]
                runs = [self._spawn(handle(p, r)) for p, r in zip(parts, decoded, strict=True)]
                settling = self._settle_bundle(message, parts, runs, queue)
                self._spawn(settling).add_done_callback(settled)

    async def _settle_bundle(
        self, whole: Incoming, parts: list[Part], runs: list[asyncio.Task[None]], queue: str
    ) -> None:
        """Ack a bundle of reports once each was settled on its own. Those handed back (not
        begun at a stop, the broker away as one was settled) or whose work ended in an error
        go on in one message, which the owner then splits (it carries the failures header), so
        the reports already applied are not sent again: they would publish their steps' tasks
        again. One message: published whole or not at all, never some of them twice. If even
        that fails, the delivery policy sends the bundle again (or hands it back) whole. A hard
        stop cancels this task in the gather: nothing is settled, the channel's close hands
        the bundle back."""
        outcomes = await asyncio.gather(*runs, return_exceptions=True)
        back = []
        for part, outcome in zip(parts, outcomes, strict=True):
            if isinstance(outcome, BaseException):  # a run cancelled alone: sent on too
                log.error("orchestrator: a bundled report's work failed", exc_info=outcome)
            if isinstance(outcome, BaseException) or part.handed_back:
                back.append(part.body)
        if not back:
            await settle(whole, ok=True)
            return
        async with process(whole, self.bus, queue, limit=self.limit):
            await send_on(whole, self.bus, queue, back)

    async def _split(self, message: Incoming, reports: list[Next | Failed], queue: str) -> None:
        """A bundle of reports that came back: each goes on alone (delivery.split)."""
        async with process(message, self.bus, queue, limit=self.limit):
            await split(message, self.bus, queue, [encode(report) for report in reports])
