"""A worker: consumes one pool's task queue, runs handlers, records outputs, reports back."""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from collections.abc import Coroutine
from typing import Any, Literal

from pydantic import ValidationError

from orchestrator.bus import Transport
from orchestrator.delivery import Delivery, Poison, process, redelivered
from orchestrator.lifecycle import Service, format_counts
from orchestrator.messages import (
    MAX_ERROR,
    Cancelled,
    Failed,
    Next,
    TaskMessage,
    decode_task,
    encode,
)
from orchestrator.settings import Settings
from orchestrator.store import Store
from worker.context import TaskContext
from worker.registry import Registry, UnknownTask

log = logging.getLogger(__name__)

Pool = Literal["serial", "parallel"]
Report = Next | Failed


class Worker(Service):
    """Runs up to `concurrency` tasks at once from one pool (the serial pool: exactly one)."""

    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        *,
        pool: Pool,
        store: Store,
        bus: Transport,
        concurrency: int | None = None,
    ) -> None:
        super().__init__(settings.grace_s)
        if pool == "serial":
            concurrency = 1  # one lane for the whole cluster
        self.name = f"worker[{pool}]"
        self.settings = settings
        self.registry = registry
        self.pool = pool
        self.concurrency = concurrency or settings.parallel_concurrency
        self.store = store
        self.bus = bus
        self.counts: Counter[str] = Counter()
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
            self.cancel_program(wf)

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
        iterator = self._track(await self.bus.consume(queue, self.concurrency))
        log.info("%s: consuming %s with concurrency %d", self.name, queue, self.concurrency)
        async for message in iterator:
            # The prefetch bounds how many of these run at once.
            self._spawn(self.handle(message, queue))

    async def handle(self, delivery: Delivery, source: str) -> None:
        """Run one task message; ack only after the report to the owner is confirmed."""
        async with process(delivery, self.bus, source, limit=self.settings.delivery_limit):
            task = decode_task(delivery.body)
            reports = await self.run_tasks(task.split(), redelivered=redelivered(delivery))
            for report in reports:
                await self.bus.publish_to_shard(task.owner, encode(report))

    async def run_tasks(self, tasks: list[TaskMessage], *, redelivered: bool) -> list[Report]:
        """Run one message's tasks side by side and record their outputs in one call; the
        reports for the owner: failures, and `next` when this completed the step."""
        if len(tasks) == 1:  # the common case, without gather's extra task
            outcomes = [await self._attempt(tasks[0])]
        else:
            outcomes = await asyncio.gather(*(self._attempt(task) for task in tasks))
        reports: list[Report] = [outcome for outcome in outcomes if isinstance(outcome, Failed)]
        outputs = {
            t.index: out for t, out in zip(tasks, outcomes, strict=True) if isinstance(out, str)
        }
        if not outputs:
            return reports
        task = tasks[0]  # a message's tasks share program, step and bag
        completion = await self.store.record(task.wf, task.path, task.size, outputs)
        if completion.verdict in ("missing", "invalid"):
            raise Poison(f"{task.wf}: {', '.join(completion.outputs) or 'no such program'}")
        self.counts[completion.verdict] += len(outputs)
        # Only a redelivered task may be the one whose report a crash cut short.
        if completion.verdict == "fire" or (completion.verdict == "again" and redelivered):
            values = [json.loads(out) for out in completion.outputs]
            output = values if task.index is not None else values[0]
            reports.append(Next(wf=task.wf, path=task.path, output=output))
        return reports

    async def _attempt(self, task: TaskMessage) -> str | Failed | None:
        """Run one handler: its output as JSON, its failure, or None when it was cancelled."""
        ctx = TaskContext(
            input=task.input,
            args=task.args,
            prev=task.prev,
            workflow_id=task.wf,
            step=task.path,
            iteration=task.iteration,
            index=task.index,
            attempt=task.attempt,
        )
        try:
            return await self._output(task, ctx)
        except asyncio.CancelledError:
            raise
        except _ProgramCancelled:
            self.counts["cancelled"] += 1
            return None
        except Exception as exc:
            self.counts["failed"] += 1
            plain = isinstance(exc, _TaskError | UnknownTask)
            return Failed(
                wf=task.wf,
                path=task.path,
                index=task.index,
                attempt=task.attempt,
                task=task.task,
                error=_cut(str(exc) if plain else f"{type(exc).__name__}: {exc}"),
                prev=task.prev,
                iteration=task.iteration,
            )

    async def _output(self, task: TaskMessage, ctx: TaskContext) -> str:
        # The handler runs in a task of its own, so a cancelled program can stop just it.
        handler = asyncio.create_task(_guarded(self.registry.run(task.task, ctx)))
        running = self._running.setdefault(task.wf, set())
        running.add(handler)
        try:
            done, _ = await asyncio.wait({handler}, timeout=task.timeout_s)
        finally:
            if not handler.done():  # timed out, or this worker is stopping
                handler.cancel()
                await asyncio.gather(handler, return_exceptions=True)
            running.discard(handler)
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
