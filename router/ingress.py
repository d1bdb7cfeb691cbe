"""`shardflow router`: submits programs that arrive as messages on the ingress queue.

Body: `{"program": {...}, "input": ..., "workflow_id": "..."}` (input and id optional), or a
signal: `{"signal": NAME, "workflow_id": "...", "data": ..., "signal_id": "..."}` (data and
signal id optional; without one, the id derives from the message, so a redelivery is no second
signal). With `reply_to` set, the answer goes there with the same `correlation_id`:
`{"workflow_id", "shard", "created", "status"}` (a signal: `{"workflow_id", "signal",
"duplicate", "waiting"}`), or `{"error": "..."}` for a refused request, which is also parked
in the dead-letter queue with the reason.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from orchestrator import logs, metrics
from orchestrator.bus import Bus
from orchestrator.consuming import Deliveries
from orchestrator.delivery import Delivery, Poison, first_error, process, sent_id
from orchestrator.documents import ProgramError, parse_document
from orchestrator.keys import check_workflow_id
from orchestrator.lifecycle import Service, format_counts
from orchestrator.program import MAX_PRIORITY
from orchestrator.settings import Settings
from router.client import Router

log = logging.getLogger(__name__)

INGRESS_PREFETCH = 32


class Request(BaseModel):
    """One submit request."""

    model_config = ConfigDict(extra="forbid")

    program: dict[str, Any]
    input: Any = None
    workflow_id: str | None = None
    priority: int = Field(default=0, ge=0, le=MAX_PRIORITY, strict=True)


class SignalRequest(BaseModel):
    """One signal for a program's signal step."""

    model_config = ConfigDict(extra="forbid")

    signal: str
    workflow_id: str
    data: Any = None
    signal_id: str | None = None


class Ingress(Service):
    """Consumes the ingress queue; submits are idempotent, so several run at once."""

    name = "router"

    def __init__(self, settings: Settings, router: Router, bus: Bus) -> None:
        super().__init__(settings.grace_s)
        self.settings = settings
        self.router = router
        self.bus = bus
        self.counts: Counter[str] = Counter()

    def summary(self) -> str:
        return format_counts(self.counts)

    async def _start(self) -> list[Coroutine[Any, Any, None]]:
        return [self._consume()]

    async def _consume(self) -> None:
        queue = self.bus.names.ingress_queue

        async def start() -> Deliveries:
            iterator = await self.bus.consume_ingress(INGRESS_PREFETCH)
            log.info("router: consuming %s", queue)
            return iterator

        async for message in self._messages(start, self.bus.stop_consuming):
            self._spawn(
                self.handle(message, message.reply_to, message.correlation_id, message.message_id)
            )

    async def handle(
        self,
        delivery: Delivery,
        reply_to: str | None,
        correlation_id: str | None,
        message_id: str | None = None,
    ) -> None:
        """Submit one request; a refused one is answered and parked with its reason.

        A request without `workflow_id` gets an id derived from the message (its AMQP
        `message_id`, else its body), so a redelivery submits the same program, never a second.
        """

        async def answer(body: dict[str, Any]) -> None:
            if reply_to:
                await self.bus.reply(reply_to, correlation_id, json.dumps(body).encode())

        async def refused(reason: str) -> None:
            self.counts["refused"] += 1
            metrics.SUBMITTED.labels("refused").inc()
            await answer({"error": reason})

        source = self.bus.names.ingress_queue
        message_id = sent_id(delivery, message_id)
        limit = self.settings.delivery_limit
        async with process(
            delivery, self.bus, source, poison=(ProgramError,), on_poison=refused, limit=limit
        ):
            # The program and its input, each up to SHARDFLOW_MAX_PROGRAM_BYTES.
            if len(delivery.body) > 2 * self.settings.max_program_bytes:
                raise Poison(f"request: {len(delivery.body)} bytes, over the limit")
            try:
                request = Request.model_validate_json(delivery.body)
            except ValidationError as exc:
                fault = first_error(exc, root="request")
                try:
                    document = parse_document(
                        delivery.body, what="request", max_bytes=len(delivery.body)
                    )
                except ProgramError as strict:
                    # JSON to pydantic but not to the program format (NaN, a duplicate key):
                    # that is the fault, not the fields a request of another kind would need.
                    if exc.errors()[0]["type"] != "json_invalid":
                        fault = str(strict)
                    document = None
                if not isinstance(document, dict) or "signal" not in document:
                    raise Poison(fault) from None
                await self._signal(document, derived_id(message_id, delivery.body), answer)
                return
            # pydantic keeps the last of two equal keys; the program format refuses them.
            parse_document(delivery.body, what="request", max_bytes=len(delivery.body))
            workflow_id = checked_id(request.workflow_id or derived_id(message_id, delivery.body))
            logs.bind(workflow_id=workflow_id)
            submitted = await self.router.submit(
                request.program, request.input, workflow_id, request.priority
            )
            self.counts["created" if submitted.created else "existing"] += 1
            metrics.SUBMITTED.labels("created" if submitted.created else "existing").inc()
            await answer(
                {
                    "workflow_id": submitted.workflow_id,
                    "shard": submitted.shard,
                    "created": submitted.created,
                    "status": submitted.status,
                }
            )

    async def _signal(
        self,
        document: dict[str, Any],
        derived: str,
        answer: Callable[[dict[str, Any]], Awaitable[None]],
    ) -> None:
        try:
            request = SignalRequest.model_validate(document)
        except ValidationError as exc:
            raise Poison(first_error(exc, root="request")) from None
        logs.bind(workflow_id=checked_id(request.workflow_id))
        try:
            sent = await self.router.signal(
                request.workflow_id,
                request.signal,
                request.data,
                derived if request.signal_id is None else request.signal_id,  # "" is refused
            )
        except (LookupError, ValueError) as exc:
            raise Poison(f"signal: {exc}") from None
        self.counts["signal duplicate" if sent["duplicate"] else "signal kept"] += 1
        await answer(sent)


def checked_id(workflow_id: str) -> str:
    """The id a request names, checked before a log line carries it; else Poison naming its
    fault (check_workflow_id quotes a bounded part of it)."""
    try:
        return check_workflow_id(workflow_id)
    except ValueError as exc:
        raise Poison(f"id: {exc}") from None


def derived_id(message_id: str | None, body: bytes) -> str:
    """The workflow id of a request that names none: the same for every delivery of it."""
    seed = f"message:{message_id}".encode() if message_id else b"body:" + body
    return "ingress-" + hashlib.sha256(seed).hexdigest()[:32]
