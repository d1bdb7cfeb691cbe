"""The AMQP ingress: requests in, answers on reply_to, refusals parked with their reason."""

import asyncio
import json
import logging
from collections.abc import AsyncIterator

import aio_pika
import pytest
from pythonjsonlogger.json import JsonFormatter

from orchestrator import logs
from orchestrator.connections import connected
from orchestrator.settings import Settings
from router.client import Router
from router.ingress import Ingress

pytestmark = pytest.mark.e2e

GOOD = {"program": {"steps": [{"task": "add", "args": {"n": 2}}]}, "input": None}


@pytest.fixture
async def ingress(settings: Settings, cluster: Router) -> AsyncIterator[Router]:
    async with connected(settings, "test-router") as (store, bus):
        service = Ingress(
            settings, Router(settings, store=store, bus=bus, known_tasks={"add"}), bus
        )
        running = asyncio.create_task(service.run())
        yield cluster
        service.shutdown()
        await running


async def ask(settings: Settings, bodies: list[bytes]) -> list[dict]:
    """Send requests to the ingress queue; the answers, in the order of the requests."""
    async with await aio_pika.connect(settings.amqp_url) as connection:
        channel = await connection.channel()
        replies = await channel.declare_queue(exclusive=True)
        for n, body in enumerate(bodies):
            message = aio_pika.Message(body, reply_to=replies.name, correlation_id=str(n))
            await channel.default_exchange.publish(
                message, routing_key=f"{settings.prefix}.ingress"
            )
        answers: dict[str, dict] = {}
        async with replies.iterator() as iterator:
            async for message in iterator:
                await message.ack()
                answers[message.correlation_id or ""] = json.loads(message.body)
                if len(answers) == len(bodies):
                    break
    return [answers[str(n)] for n in range(len(bodies))]


async def test_requests_are_submitted_and_bad_ones_refused_with_the_fault(
    ingress: Router, settings: Settings
) -> None:
    requests = [
        json.dumps({**GOOD, "workflow_id": "via-amqp"}).encode(),
        b"not json at all",
        json.dumps({"program": {"steps": [{"task": "add"}, {"bag": []}]}}).encode(),
        json.dumps({"program": {"steps": [{"task": "nope"}]}}).encode(),
        json.dumps({**GOOD, "workflow_id": "bad id"}).encode(),
        json.dumps({**GOOD, "extra": 1}).encode(),
        json.dumps({**GOOD, "workflow_id": "via-amqp"}).encode(),
        b'{"program": {"steps": [{"task": "add"}]}, "input": 1, "input": 2}',
        json.dumps({**GOOD, "workflow_id": "urgent", "priority": 4}).encode(),
        json.dumps({**GOOD, "priority": 5}).encode(),
        json.dumps({**GOOD, "priority": "1"}).encode(),
    ]
    answers = await ask(settings, requests)
    assert answers[0] == {"workflow_id": "via-amqp", "shard": answers[0]["shard"],
                          "created": True, "status": "pending"}  # fmt: skip
    assert answers[1]["error"].startswith("request: Invalid JSON")
    assert answers[2] == {"error": "steps[1].bag: List should have at least 1 item after "
                                   "validation, not 0"}  # fmt: skip
    assert answers[3] == {"error": "steps[0].task: unknown task 'nope'"}
    assert answers[4]["error"].startswith("id: workflow id 'bad id': use 1-128")
    assert answers[5] == {"error": "extra: Extra inputs are not permitted"}
    assert answers[6]["created"] is False  # the same id again: never a second run
    # pydantic alone would keep the last "input"; two equal keys are refused, as in a program.
    assert answers[7] == {"error": "request: duplicate key 'input'"}
    assert answers[8]["created"] is True
    assert answers[9] == {"error": "priority: Input should be less than or equal to 4"}
    assert answers[10] == {"error": "priority: Input should be a valid integer"}
    assert (await ingress.explain("urgent") or {})["priority"] == 4
    assert (await ingress.wait("via-amqp", timeout_s=30))["result"] == 2
    async with connected(settings) as (_, bus):
        parked = await bus.peek_dead(10)
    reasons = sorted(headers["x-shardflow-reason"] for headers, _ in parked)
    assert len(reasons) == 8
    assert sorted(a["error"] for a in answers if "error" in a) == reasons


async def test_a_requeue_sends_each_letter_once_though_the_router_refuses_it_again(
    ingress: Router, settings: Settings
) -> None:
    """A letter sent back and refused again is parked behind the rest: `dead --requeue` read
    on until the queue was empty, so 3 letters went round hundreds of times in one run (a
    reply and a log line each) and `left` said 0 with 3 there."""
    from router.dead_letters import sent_back

    bad = [json.dumps({"program": {"steps": [{"task": f"nope{k}"}]}}).encode() for k in range(3)]
    async with connected(settings) as (_, bus):
        for body in bad:
            await bus.dead_letter(body, reason="Redis full", source=bus.names.ingress_queue)
        sent, kept, _ = await bus.resend_dead(lambda h, m: sent_back(bus.names, h, m), 100)
        assert (sent, kept) == (3, 0)
        for _ in range(200):  # the router parks each again
            parked = await bus.peek_dead(10)
            if len(parked) == 3:
                break
            await asyncio.sleep(0.05)
        assert sorted(body for _, body in parked) == sorted(bad)
        assert {h["x-shardflow-reason"] for h, _ in parked} == {
            f"steps[0].task: unknown task 'nope{k}'" for k in range(3)
        }
        again = await bus.resend_dead(lambda h, m: sent_back(bus.names, h, m), 100)
        assert again[:2] == (3, 0)  # once each again, not round and round
        # Refused again at once, every time: still once each (the router above may be slower
        # than the loop), and `left` counts them back there.
        straight_back = (bus.names.dead_queue, {})
        for _ in range(200):
            if len(await bus.peek_dead(10)) == 3:
                break
            await asyncio.sleep(0.05)
        assert await bus.resend_dead(lambda h, m: straight_back, 100) == (3, 0, 3)


async def test_signals_arrive_through_the_ingress_once_per_message(
    ingress: Router, settings: Settings
) -> None:
    program = {"steps": [{"signal": "go"}, {"task": "add", "args": {"n": 1}}]}
    wf = (await ingress.submit(program)).workflow_id
    # Sent twice with one signal id: one signal. (Without one, the id derives from the AMQP
    # message, so a redelivery of the same message is no second signal either.)
    signal = json.dumps({"signal": "go", "workflow_id": wf, "data": 41, "signal_id": "once"})
    answers = await ask(
        settings,
        [
            signal.encode(),
            signal.encode(),
            json.dumps({"signal": "stop", "workflow_id": wf}).encode(),
            json.dumps({"signal": "go", "workflow_id": wf, "extra": 1}).encode(),
        ],
    )
    assert answers[0] == {"workflow_id": wf, "signal": "go", "duplicate": False, "waiting": 1}
    assert answers[1]["duplicate"] is True
    assert answers[2]["error"].startswith(f"signal: program {wf!r} has no signal step 'stop'")
    assert answers[3]["error"] == "extra: Extra inputs are not permitted"
    status = await ingress.wait(wf, timeout_s=30)
    assert status["status"] == "completed" and status["result"] == 42


class Lines(logging.Handler):
    """Log records as `SHARDFLOW_LOG_FORMAT=json` writes them: with the fields bound to them."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.addFilter(logs._Fields())
        self.setFormatter(JsonFormatter("%(levelname)s %(name)s %(message)s"))
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


async def test_a_huge_workflow_id_is_refused_before_a_log_line_carries_it(
    ingress: Router, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    huge = "A" * 500_000
    lines = Lines()
    logging.getLogger().addHandler(lines)
    try:
        answers = await ask(
            settings,
            [
                json.dumps({**GOOD, "workflow_id": huge}).encode(),
                json.dumps({"signal": "go", "workflow_id": huge}).encode(),
            ],
        )
    finally:
        logging.getLogger().removeHandler(lines)
    for answer in answers:
        error = answer["error"]
        assert error.startswith("id: workflow id 'AAA") and "use 1-128 of" in error, error[:300]
        assert "' (500000 characters): use" in error and len(error) < 400
    assert any("dead-lettering" in line for line in lines.lines)
    assert max(map(len, lines.lines)) < 2000
