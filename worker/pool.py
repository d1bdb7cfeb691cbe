"""A worker: consumes one pool's task queue, runs handlers, records outputs, reports back."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from collections.abc import Coroutine
from typing import Any

from pydantic import ValidationError

from orchestrator import logs, metrics
from orchestrator.bus import Transport
from orchestrator.delivery import Delivery, Poison, process, redelivered
from orchestrator.lifecycle import Service, format_counts
from orchestrator.marks import Marks
from orchestrator.messages import (
    MAX_ERROR,
    Cancelled,
    Failed,
    Next,
    TaskMessage,
    decode_task,
    encode,
)
from orchestrator.program import check_pool_name, is_lane
from orchestrator.settings import Settings
from orchestrator.store import TERMINAL, Store
from worker.context import TaskContext
from worker.registry import Registry, UnknownTask

log = logging.getLogger(__name__)

Report = Next | Failed


class Worker(Service):
    """Runs up to `concurrency` tasks at once from one pool (a serial lane: exactly one):
    serial, parallel, a named pool (its queue declared here if new), or a named lane
    (`serial-<name>`)."""

    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        *,
        pool: str,
        store: Store,
        bus: Transport,
        concurrency: int | None = None,
    ) -> None:
        super().__init__(settings.grace_s)
        check_pool_name(pool)
        if is_lane(pool):
            concurrency = 1  # one lane for the whole cluster
        self.name = f"worker[{pool}]"
        self.settings = settings
        self.registry = registry
        self.pool = pool
        self.concurrency = concurrency or settings.parallel_concurrency
        self.store = store
        self.bus = bus
        self.counts: Counter[str] = Counter()
        self.marks = Marks(store)  # who holds the serial lane, for `explain`
        self._running: dict[str, set[asyncio.Task[Any]]] = {}

    def summary(self) -> str:
        return format_counts(self.counts)

    async def _start(self) -> list[Coroutine[Any, Any, None]]:
        return [self._consume(), self._listen()]

    async def _listen(self) -> None:
        """Stop the running tasks of programs that were cancelled or ran out of time."""
        async for message in self._track(await self.bus.consume_control()):
            try:
                wf = Cancelled.model_validate_json(message.body).wf
            except ValidationError:
                log.warning("%s: ignored a control message: %r", self.name, message.body[:200])
                continue
            # Anyone on the vhost can publish here: only a program that really ended stops.
            if wf in self._running and (await self.store.state(wf)).get("status") in TERMINAL:
                self.cancel_program(wf)
            elif wf in self._running:
                log.warning("%s: ignored a cancel of %s, which has not ended", self.name, wf)

    def cancel_program(self, wf: str) -> int:
        """Cancel this worker's running handlers of a program; how many there were."""
        handlers = self._running.get(wf, set())
        for handler in handlers:
            handler.cancel()
        if handlers:
            log.info("%s: %s cancelled: stopped %d running task(s)", self.name, wf, len(handlers))
        return len(handlers)

    async def _consume(self) -> None:
        queue = self.bus.names.task_queue(self.pool)
        iterator = self._track(await self.bus.consume_pool(self.pool, self.concurrency))
        log.info("%s: consuming %s with concurrency %d", self.name, queue, self.concurrency)
        async for message in iterator:
            # The prefetch bounds how many of these run at once.
            self._spawn(self.handle(message, queue))

    async def handle(self, delivery: Delivery, source: str) -> None:
        """Run one task message; ack only after the report to the owner is confirmed."""
        async with process(delivery, self.bus, source, limit=self.settings.delivery_limit):
            task = decode_task(delivery.body)
            if is_lane(self.pool):
                await self.marks.lane(task.wf, task.path, task.task, self.pool)
            reports = await self.run_tasks(task.split(), redelivered=redelivered(delivery))
            for report in reports:
                await self.bus.publish_to_shard(task.owner, encode(report))

    async def run_tasks(self, tasks: list[TaskMessage], *, redelivered: bool) -> list[Report]:
        """Run one message's tasks side by side and record their outputs in one call; the
        reports for the owner: failures, and `next` when this completed the step."""
        # A step its program has left (a late copy from a replay, or a redelivery after a crash
        # past the report) is not run again: nothing it could record would count.
        state = await self.store.state(tasks[0].wf)
        if not state:  # never run a handler for a program nobody submitted
            raise Poison(f"{tasks[0].wf}: no such program")
        if (
            state.get("status") != "running"
            or state.get("cursor") != tasks[0].path
            or int(state.get("epoch") or 0) != tasks[0].epoch  # a run before a redrive
        ):
            self.counts["stale"] += len(tasks)
            return []
        values = await self._values(tasks[0])  # a message's tasks share input and prev
        if len(tasks) == 1:  # the common case, without gather's extra task
            outcomes = [await self._attempt(tasks[0], *values)]
        else:
            outcomes = await asyncio.gather(*(self._attempt(task, *values) for task in tasks))
        reports: list[Report] = [outcome for outcome in outcomes if isinstance(outcome, Failed)]
        outputs = {
            t.index: out for t, out in zip(tasks, outcomes, strict=True) if isinstance(out, str)
        }
        if not outputs:
            return reports
        task = tasks[0]  # a message's tasks share program, step and bag
        completion = await self.store.record(task.wf, task.path, task.size, outputs, task.epoch)
        if completion.verdict in ("missing", "invalid"):
            raise Poison(f"{task.wf}: {', '.join(completion.outputs) or 'no such program'}")
        self.counts[completion.verdict] += len(outputs)
        metrics.recorded(completion.verdict, redelivered=redelivered)
        # Only a redelivered task may be the one whose report a crash cut short.
        if completion.verdict == "fire" or (completion.verdict == "again" and redelivered):
            if not completion.outputs:  # too large to carry: the owner reads them in Redis
                reports.append(Next(wf=task.wf, path=task.path, stored=True, epoch=task.epoch))
                return reports
            joined = [json.loads(out) for out in completion.outputs]
            output = joined if task.index is not None else joined[0]
            reports.append(Next(wf=task.wf, path=task.path, output=output, epoch=task.epoch))
        return reports

    async def _values(self, task: TaskMessage) -> tuple[Any, Any]:
        """The task's input and prev: carried, or read once from where the owner kept them."""
        names = ["input"] * task.input_ref + [task.path] * task.prev_ref
        found: dict[str, Any] = {}
        for name, text in zip(names, await self.store.blobs(task.wf, names), strict=True):
            if text is None:
                raise Poison(f"{task.wf}: {name} is no longer stored (did the program end?)")
            found[name] = json.loads(text)
        input = found["input"] if task.input_ref else task.input
        prev = found[task.path] if task.prev_ref else task.prev
        return input, prev

    async def _attempt(self, task: TaskMessage, input: Any, prev: Any) -> str | Failed | None:
        """Run one handler: its output as JSON, its failure, or None when it was cancelled."""
        ctx = TaskContext(
            input=input,
            args=task.args,
            prev=prev,
            workflow_id=task.wf,
            step=task.path,
            iteration=task.iteration,
            index=task.index,
            attempt=task.attempt,
            item=task.item,
        )
        logs.bind(workflow_id=task.wf, step=task.path, task=task.task, attempt=task.attempt)
        started = time.monotonic()
        try:
            output = await self._output(task, ctx)
            metrics.task_ended(self.pool, task.task, self.registry.handlers, "completed", started)
            return output
        except asyncio.CancelledError:
            raise
        except _ProgramCancelled:
            self.counts["cancelled"] += 1
            metrics.task_ended(self.pool, task.task, self.registry.handlers, "cancelled", started)
            return None
        except Exception as exc:
            self.counts["failed"] += 1
            metrics.task_ended(self.pool, task.task, self.registry.handlers, "failed", started)
            plain = isinstance(exc, _TaskError | UnknownTask)
            return Failed(
                wf=task.wf,
                path=task.path,
                index=task.index,
                attempt=task.attempt,
                task=task.task,
                error=_cut(str(exc) if plain else f"{type(exc).__name__}: {exc}"),
                prev=task.prev,
                prev_ref=task.prev_ref,
                iteration=task.iteration,
                item=task.item,
                epoch=task.epoch,
            )

    async def _output(self, task: TaskMessage, ctx: TaskContext) -> str:
        # The handler runs in a task of its own, so a cancelled program can stop just it.
        handler = asyncio.create_task(_guarded(self.registry.run(task.task, ctx)))
        running = self._running.setdefault(task.wf, set())
        running.add(handler)
        metrics.TASKS_RUNNING.labels(self.pool).inc()
        try:
            done, _ = await asyncio.wait({handler}, timeout=task.timeout_s)
        finally:
            if not handler.done():  # timed out, or this worker is stopping
                handler.cancel()
                await asyncio.gather(handler, return_exceptions=True)
            running.discard(handler)
            metrics.TASKS_RUNNING.labels(self.pool).dec()
            if not running:
                del self._running[task.wf]
        if not done:
            raise _TaskError(f"timed out after {task.timeout_s}s")
        if handler.cancelled():
            raise _ProgramCancelled
        output = handler.result()
        try:
            text = json.dumps(output)
        except (TypeError, ValueError) as exc:
            raise _TaskError(f"output is not JSON: {exc}") from None
        if len(text) > self.settings.max_output_bytes:
            raise _TaskError(
                f"output of {len(text)} bytes is over the limit of "
                f"{self.settings.max_output_bytes} (SHARDFLOW_MAX_OUTPUT_BYTES)"
            )
        return text


async def _guarded(run: Coroutine[Any, Any, Any]) -> Any:
    """A handler's outcome, where any exception but cancellation fails the task: SystemExit or
    KeyboardInterrupt raised by a handler must not stop the worker (asyncio would re-raise them
    out of the event loop)."""
    try:
        return await run
    except (asyncio.CancelledError, Exception):
        raise
    except BaseException as exc:
        raise _TaskError(f"{type(exc).__name__}: {exc}") from None


def _cut(error: str) -> str:
    """An error text short enough for the failure report (and Redis)."""
    return error if len(error) <= MAX_ERROR else error[: MAX_ERROR - 20] + " ... (cut)"


class _TaskError(Exception):
    """A task failure whose message is already the whole story."""


class _ProgramCancelled(Exception):
    """The program was cancelled while this task ran: nothing to report."""
