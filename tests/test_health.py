"""/healthz and /readyz: a stopped Redis, a closed RabbitMQ connection, a blocked event loop and
a process that no longer consumes each turn them red, over real HTTP. /livez (the liveness
probe) turns red for a blocked event loop only: an outage of Redis or RabbitMQ leaves it green."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.asyncio

from orchestrator import health
from orchestrator.connections import connected
from orchestrator.settings import Settings
from router.client import Router
from tests.brokers import PrivateRedis
from tests.test_metrics import Running, environment, get, scrape, value, wait_until
from worker.pool import Worker
from worker.registry import Registry

PING_S = health.PING_TIMEOUT_S


def faults(port: int, path: str = "/healthz") -> tuple[int, list[str]]:
    status, body = get(port, path)
    return status, json.loads(body)["faults"] if body else ["no answer"]


@pytest.fixture
def private_redis() -> Iterator[PrivateRedis]:
    if shutil.which("redis-server") is None:
        pytest.skip("no redis-server")
    server = PrivateRedis()
    server.start()
    yield server
    server.close()


def test_health_turns_red_while_redis_is_stopped_and_green_when_it_is_back(
    settings: Settings, private_redis: PrivateRedis, tmp_path: Path
) -> None:
    env = environment(settings, SHARDFLOW_REDIS_URL=private_redis.url)
    worker = Running(
        ["worker", "--pool", "parallel", "--app", "tests.app"], env, tmp_path / "worker.log"
    )
    try:
        port = worker.port
        wait_until(lambda: faults(port) == (200, []), 60, "healthy at start")
        # Ready once it consumes too, which may come a moment after its connections (CI saw
        # `not consuming` right after the first healthy answer).
        wait_until(lambda: faults(port, "/readyz") == (200, []), 30, "ready at start")

        private_redis.kill()
        _, found = wait_until(
            lambda: (answer := faults(port))[0] == 503 and answer, 30, "unhealthy without Redis"
        )
        assert [fault for fault in found if fault.startswith("redis: ")], found
        assert faults(port, "/readyz")[0] == 503
        assert faults(port, "/livez") == (200, [])  # alive: no restart would bring Redis back
        assert value(scrape(port), "shardflow_dependency_up", dependency="redis") == 0
        assert value(scrape(port), "shardflow_dependency_up", dependency="rabbitmq") == 1

        private_redis.start()  # the same port: the worker's client reconnects by itself
        wait_until(lambda: faults(port) == (200, []), 30, "healthy once Redis is back")
        assert faults(port, "/readyz") == (200, [])
        worker.stop()
    finally:
        if worker.process.poll() is None:
            worker.process.kill()
            worker.process.wait()


def test_readyz_turns_red_when_the_process_stops_consuming(
    settings: Settings, tmp_path: Path
) -> None:
    """On SIGTERM a process stops taking work and finishes what it holds: not ready, still
    healthy, until it exits."""
    env = environment(settings, SHARDFLOW_GRACE_S="60")
    dev = Running(["dev", "--app", "tests.app"], env, tmp_path / "dev.log")
    try:
        port = dev.port
        wait_until(lambda: faults(port, "/readyz") == (200, []), 60, "ready at start")

        async def submit() -> None:
            async with connected(settings, "test-health") as (store, bus):
                program = {"steps": [{"task": "echo", "args": {"sleep_s": 4}}]}
                await Router(settings, store=store, bus=bus).submit(program)

        asyncio.run(submit())
        wait_until(
            lambda: value(scrape(port), "shardflow_tasks_running", pool="serial") == 1,
            30,
            "the task running",
        )
        dev.process.terminate()
        seen: list[tuple[int, list[str]]] = []

        def not_ready() -> bool:
            answer = faults(port, "/readyz")
            if answer not in seen:
                seen.append(answer)
            # Red for the reason under test; on a loaded machine a passing fault (a slow Redis
            # ping) may stand beside it for a moment. /healthz is asserted whole just after.
            return answer[0] == 503 and "not consuming" in answer[1]

        try:
            wait_until(not_ready, 30, "not ready")
        except pytest.fail.Exception:
            pytest.fail(f"readyz answered {seen}; the log: {dev.log.read_text()[-3000:]}")
        # Finishing its task: alive and well (once a passing fault, if any, has passed).
        wait_until(lambda: faults(port) == (200, []), 3, "healthy while it finishes")
        dev.process.wait(timeout=60)
        assert dev.process.returncode == 0, dev.log.read_text()[-3000:]
        assert get(port, "/healthz")[0] == 0  # the endpoint went with the process
    finally:
        if dev.process.poll() is None:
            dev.process.kill()
            dev.process.wait()


# --- in this process: the endpoint's parts, one fault at a time


class Serving:
    """A Health with its endpoint on a free loopback port; its samplers run in this loop."""

    def __init__(self, state: health.Health) -> None:
        self.health = state
        self.server = health.serve(health.application(state), "127.0.0.1", 0)
        self.port = self.server.server_port
        self.sampling = asyncio.create_task(state.run())

    async def get(self, path: str = "/healthz") -> tuple[int, list[str]]:
        return await asyncio.to_thread(faults, self.port, path)

    async def until(self, path: str, expected: tuple[int, list[str]], seconds: float) -> None:
        deadline = asyncio.get_running_loop().time() + seconds
        while (answer := await self.get(path)) != expected:
            if asyncio.get_running_loop().time() > deadline:
                pytest.fail(f"{path}: {answer}, not {expected}, after {seconds}s")
            await asyncio.sleep(0.05)

    async def until_fault(self, path: str, start: str, seconds: float) -> tuple[int, list[str]]:
        """The first answer whose faults hold one that starts with `start`."""
        deadline = asyncio.get_running_loop().time() + seconds
        while True:
            answer = await self.get(path)
            if any(fault.startswith(start) for fault in answer[1]):
                return answer
            if asyncio.get_running_loop().time() > deadline:
                pytest.fail(f"{path}: {answer}, no fault starting {start!r}, after {seconds}s")
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        self.sampling.cancel()
        await asyncio.gather(self.sampling, return_exceptions=True)
        await asyncio.to_thread(self.server.shutdown)
        self.server.server_close()


async def _pong() -> bool:
    return True


async def test_a_blocked_event_loop_is_reported_while_it_is_blocked() -> None:
    serving = Serving(health.Health(_pong, lambda: True, lambda: True, stale_s=0.5))
    try:
        await serving.until("/healthz", (200, []), 10)
        await serving.until("/livez", (200, []), 10)
        seen: list[tuple[int, list[str]]] = []
        live: list[tuple[int, list[str]]] = []
        unblock = threading.Event()

        def watch() -> None:  # another thread: the loop below is blocked meanwhile
            def red() -> bool:
                seen.append(faults(serving.port))
                return seen[-1][0] == 503

            try:
                wait_until(red, 20, "a 503 from the blocked process")
                live.append(faults(serving.port, "/livez"))  # still blocked: a restart helps
            finally:
                unblock.set()

        threading.Thread(target=watch, daemon=True).start()
        unblock.wait(30)  # blocks the event loop, as a handler that never yields would
        status, found = seen[-1]
        assert status == 503
        assert len(found) == 1 and found[0].startswith("event loop: no heartbeat for "), found
        [(status, found)] = live
        assert status == 503
        assert len(found) == 1 and found[0].startswith("event loop: no heartbeat for "), found
        await serving.until("/healthz", (200, []), 10)  # turning again
        await serving.until("/livez", (200, []), 10)
    finally:
        await serving.close()


async def test_a_redis_that_does_not_answer_in_time_is_a_fault() -> None:
    async def hangs() -> None:
        await asyncio.sleep(3600)

    serving = Serving(health.Health(hangs, lambda: True, lambda: True))
    try:
        await serving.until("/healthz", (503, [f"redis: no answer in {PING_S}s"]), 10)
    finally:
        await serving.close()


async def test_livez_stays_green_while_redis_and_rabbitmq_are_unreachable() -> None:
    """A Redis or RabbitMQ outage is no reason for a liveness probe to kill a process (and the
    handlers it runs): the clients reconnect by themselves. While the loop turns /livez says
    200, however long the outage, and /healthz and /readyz say 503 with the faults."""
    with socket.socket() as closed:  # a port nobody listens on: refused at once
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    client = redis.asyncio.Redis.from_url(f"redis://127.0.0.1:{port}")  # as RedisStore's
    serving = Serving(health.Health(client.ping, lambda: False, lambda: True))
    try:
        deadline = asyncio.get_running_loop().time() + 20
        while True:  # until both outages are seen: first "not checked yet"
            status, found = await serving.get()
            if found[:1] == ["rabbitmq: not connected"] and found[1:] != ["redis: not checked yet"]:
                break
            assert asyncio.get_running_loop().time() < deadline, found
            await asyncio.sleep(0.05)
        # The client retries, then gives up (ConnectionError) or outlasts the ping's bound.
        assert status == 503 and len(found) == 2 and found[1].startswith("redis: "), found
        # Past several heartbeats and Redis probes, the outage goes on and /livez stays green.
        until = asyncio.get_running_loop().time() + 3
        while asyncio.get_running_loop().time() < until:
            assert await serving.get("/livez") == (200, [])
            assert (await serving.get())[0] == 503
            assert (await serving.get("/readyz"))[0] == 503
            await asyncio.sleep(0.1)
    finally:
        await serving.close()
        await client.aclose()


async def test_readyz_waits_for_consuming_and_other_paths_are_refused() -> None:
    consuming = False
    serving = Serving(health.Health(_pong, lambda: True, lambda: consuming))
    try:
        await serving.until("/healthz", (200, []), 10)
        assert await serving.get("/readyz") == (503, ["not consuming"])
        consuming = True
        await serving.until("/readyz", (200, []), 10)
        assert (await asyncio.to_thread(get, serving.port, "/metricsz"))[0] == 404
        status, text = await asyncio.to_thread(get, serving.port, "/metrics")
        assert status == 200 and "shardflow_event_loop_lag_seconds " in text
    finally:
        await serving.close()


def test_idle_half_requests_hold_few_threads_and_only_until_the_timeout(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Clients that open a connection and send half a request (then nothing) hold at most
    `max_connections` threads, each for `timeout_s`; the rest are closed with no thread. A probe
    is answered while they still hold their sockets, and no traceback is printed for them."""
    state = health.Health(_pong, lambda: True, lambda: True, stale_s=600)
    before = threading.active_count()
    server = health.serve(
        health.application(state), "127.0.0.1", 0, timeout_s=1.0, max_connections=8
    )
    port = server.server_port
    idle: list[socket.socket] = []
    try:
        most = 0
        for _ in range(50):
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            idle[-1].sendall(b"GET /livez HTTP/1.1\r\n")  # and never the rest
            most = max(most, threading.active_count())
        time.sleep(0.3)  # the last ones accepted
        most = max(most, threading.active_count())
        # The server's thread, and per slot one and its deadline's timer.
        assert most <= before + 1 + 2 * 8, most
        # A probe gets a slot as soon as one is free (at the latest once the idle time out).
        wait_until(lambda: faults(port, "/livez")[0] == 200, 10, "/livez answered")
        wait_until(lambda: threading.active_count() <= before + 1, 10, "the idle dropped")
        assert faults(port, "/livez") == (200, [])
    finally:
        for sock in idle:
            sock.close()
        server.shutdown()
        server.server_close()
    assert "Traceback" not in capsys.readouterr().err


def test_a_client_that_trickles_its_request_is_cut_at_the_deadline() -> None:
    """A byte every 0.3 s never trips a read's timeout: only the connection's own deadline
    frees its slot (a few such clients held every slot, and probes, for good)."""
    state = health.Health(_pong, lambda: True, lambda: True, stale_s=600)
    server = health.serve(
        health.application(state), "127.0.0.1", 0, timeout_s=1.0, max_connections=2
    )
    client = socket.create_connection(("127.0.0.1", server.server_port), timeout=5)
    try:
        started, cut = time.monotonic(), False
        for byte in b"GET /livez HTTP/1.1\r\nX-Slow: " + b"a" * 40:
            try:
                client.sendall(bytes([byte]))
            except OSError:  # reset by the server
                cut = True
                break
            client.settimeout(0.3)
            try:
                if client.recv(1) == b"":  # closed by the server
                    cut = True
                    break
            except TimeoutError:
                pass
        assert cut, "the trickle was served for its whole length"
        assert time.monotonic() - started < 3, "cut at the deadline (1 s), not later"
    finally:
        client.close()
        server.shutdown()
        server.server_close()


def _rabbitmq_connection(name: str) -> str | None:
    """The broker's pid of the connection a process named `name`."""
    listed = subprocess.run(
        ["rabbitmqctl", "-q", "list_connections", "pid", "client_properties"],
        capture_output=True, text=True, timeout=60,
    ).stdout  # fmt: skip
    for line in listed.splitlines():
        if f'{{"connection_name","{name}"}}' in line:
            return line.split("\t")[0]
    return None


async def test_a_closed_rabbitmq_connection_is_a_fault_until_it_is_back(
    settings: Settings,
) -> None:
    if shutil.which("rabbitmqctl") is None:
        pytest.skip("no rabbitmqctl to close a connection with")
    name = f"test-health-{uuid.uuid4().hex[:8]}"
    async with connected(settings, name) as (store, bus):
        serving = Serving(
            health.Health(
                store.client.ping,
                lambda: bus.is_connected,
                lambda: True,
                rabbitmq_down=lambda: bus.down_reason,
            )
        )
        try:
            await serving.until("/healthz", (200, []), 10)
            pid = await asyncio.to_thread(
                wait_until, lambda: _rabbitmq_connection(name), 20, "the connection listed"
            )
            await asyncio.to_thread(
                subprocess.run,
                ["rabbitmqctl", "-q", "close_connection", pid, "closed by test_health"],
                check=True, capture_output=True, timeout=60,
            )  # fmt: skip
            # The reason is the broker's, as aio-pika got it: it was only in the logs.
            status, [fault] = await serving.until_fault("/healthz", "rabbitmq: not connected", 20)
            assert status == 503 and "CONNECTION_FORCED - closed by test_health" in fault, fault
            assert await serving.get("/livez") == (200, [])  # no restart: it reconnects
            await serving.until("/healthz", (200, []), 30)  # aio-pika reconnects by itself
        finally:
            await serving.close()


async def test_a_part_consumes_only_between_its_start_and_its_stop(
    settings: Settings, registry: Registry
) -> None:
    async with connected(settings, "test-health") as (store, bus):
        worker = Worker(settings, registry, pool="parallel", store=store, bus=bus)
        assert not worker.consuming
        running = asyncio.create_task(worker.run())
        deadline = asyncio.get_running_loop().time() + 20
        while not worker.consuming:
            assert asyncio.get_running_loop().time() < deadline, "never consumed"
            await asyncio.sleep(0.01)
        worker.shutdown()
        assert not worker.consuming
        await running
