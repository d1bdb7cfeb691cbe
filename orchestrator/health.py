"""The HTTP endpoint of a long-running process: /metrics, /livez, /healthz and /readyz.

Served by the standard library's WSGI server (`wsgiref`) in a thread of its own, with
prometheus_client's WSGI app for /metrics: a scrape or a probe never waits on the event loop,
so a blocked loop is reported (503, "no heartbeat"), not hidden behind a probe's timeout.
What the answers say is sampled in the loop: a heartbeat coroutine measures the loop's lag and
reads RabbitMQ's connection state, a probe coroutine pings Redis with a timeout; the HTTP
thread only reads their latest results and how old they are.

/livez asks only whether the loop turns: the one fault a restart mends. RabbitMQ and Redis
clients reconnect by themselves, so an outage of either shows on /healthz and /readyz and
never makes a liveness probe kill a process (and the handlers it runs).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any, Protocol
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app

from orchestrator import delivery
from orchestrator.lifecycle import raise_if_cancelled
from orchestrator.metrics import DEPENDENCY_UP, LOOP_LAG
from orchestrator.settings import Settings

log = logging.getLogger(__name__)

BEAT_S = 0.25  # how often the heartbeat runs
PROBE_S = 1.0  # how often Redis is pinged
PING_TIMEOUT_S = 2.0
# A refusal of Redis (full, say) seen this recently makes the process unhealthy: its work waits.
REFUSAL_S = 10.0
# No heartbeat (or Redis answer) for this long: the loop is stuck, or Redis is.
STALE_S = 5.0
# The HTTP endpoint's bounds: a connection is dropped this long after it opened (a scrape or
# a probe takes milliseconds), and at most this many are served at a time, a thread each and
# its deadline's timer; one more is closed at once, with no thread. So half-sent requests, from
# whoever can reach the port, hold at most that many threads, for that long each.
HTTP_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 32

StartResponse = Callable[[str, list[tuple[str, str]]], Any]


class Consuming(Protocol):
    """A running part (a Service, or dev's group of them)."""

    @property
    def consuming(self) -> bool: ...


class Health:
    """The process's health, sampled in its event loop and read from any thread."""

    def __init__(
        self,
        ping: Callable[[], Awaitable[Any]],
        rabbitmq_up: Callable[[], bool],
        consuming: Callable[[], bool],
        *,
        blocked: Callable[[], bool] = lambda: False,
        rabbitmq_down: Callable[[], str] = lambda: "",
        stale_s: float = STALE_S,
    ) -> None:
        self._ping = ping
        self._rabbitmq_up = rabbitmq_up
        self._rabbitmq_down = rabbitmq_down  # why it is not connected, when known
        self._consuming = consuming
        self._blocked = blocked  # by a resource alarm of RabbitMQ's
        self._blocked_since: float | None = None
        self.stale_s = stale_s
        started = time.monotonic()
        # Plain attributes written by the loop and read by the HTTP threads: each is replaced
        # whole, so a reader sees an old value or a new one, never half of one.
        self._beat = started
        self._rabbitmq: bool | None = None  # not checked yet
        self._rabbitmq_why = ""
        self._ready = False
        self._redis: tuple[float, str] = (started, "not checked yet")  # (when, fault or "")

    async def run(self) -> None:
        """Heartbeat and Redis probe, until cancelled."""
        await asyncio.gather(self._heartbeat(), self._probe())

    async def _heartbeat(self) -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(BEAT_S)
            now = time.monotonic()
            LOOP_LAG.set(max(0.0, now - before - BEAT_S))
            self._rabbitmq = bool(self._rabbitmq_up())
            self._rabbitmq_why = "" if self._rabbitmq else self._rabbitmq_down()
            self._note_blocked(now)
            DEPENDENCY_UP.labels("rabbitmq").set(self._rabbitmq and self._blocked_since is None)
            self._ready = bool(self._consuming())
            self._beat = now

    def _note_blocked(self, now: float) -> None:
        """Follow a resource alarm's block, and say when it begins and ends: all else shows
        an idle process, its probes green, its queues still."""
        blocked = self._rabbitmq and bool(self._blocked())
        if blocked and self._blocked_since is None:
            self._blocked_since = now
            log.warning(
                "RabbitMQ blocks this process (a memory or disk alarm): its publishes and acks "
                "wait until the alarm clears; nothing is lost"
            )
        elif not blocked and self._blocked_since is not None:
            log.warning(
                "RabbitMQ blocked this process for %.0fs; it goes on", now - self._blocked_since
            )
            self._blocked_since = None

    async def _probe(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._ping(), PING_TIMEOUT_S)
                fault = ""
            except TimeoutError:
                fault = f"no answer in {PING_TIMEOUT_S}s"
            except Exception as exc:  # any failure to answer is the fault reported
                fault = f"{type(exc).__name__}: {exc}"[:300]
            self._redis = (time.monotonic(), fault)
            refused = _recent_refusal(time.monotonic())
            DEPENDENCY_UP.labels("redis").set(not fault and refused is None)
            raise_if_cancelled()
            await asyncio.sleep(PROBE_S)

    def not_live(self) -> list[str]:
        """Why a restart would help: the event loop stopped turning; empty while it turns."""
        late = time.monotonic() - self._beat
        return [f"event loop: no heartbeat for {late:.1f}s"] if late > self.stale_s else []

    def faults(self) -> list[str]:
        """Why the process is not healthy; empty when it is."""
        found = self.not_live()
        if not found:  # a stuck loop samples nothing: what it last saw is not news
            now = time.monotonic()
            if not self._rabbitmq:
                state = "not checked yet" if self._rabbitmq is None else "not connected"
                if why := self._rabbitmq_why:
                    state += f" ({why})"
                found.append(f"rabbitmq: {state}")
            elif (since := self._blocked_since) is not None:
                found.append(
                    f"rabbitmq: publishing blocked by the broker (a memory or disk alarm) for "
                    f"{now - since:.0f}s"
                )
            checked, fault = self._redis
            refused = _recent_refusal(now)  # PING is answered while Redis refuses writes
            if fault:
                found.append(f"redis: {fault}")
            elif refused is not None:
                found.append(f"redis: {refused}")
            elif now - checked > self.stale_s + PING_TIMEOUT_S:
                found.append(f"redis: no answer for {now - checked:.1f}s")
        return found

    def not_ready(self) -> list[str]:
        """Why the process should get no work; empty when it consumes and is healthy."""
        return self.faults() + ([] if self._ready else ["not consuming"])


def _recent_refusal(now: float) -> str | None:
    """What Redis refused in the last REFUSAL_S (delivery.waits_for_services noted it)."""
    refusal = delivery.last_refusal
    return refusal[1] if refusal is not None and now - refusal[0] < REFUSAL_S else None


def application(health: Health, registry: Any = None) -> Callable[..., Iterable[bytes]]:
    """The WSGI app: /metrics (Prometheus text), /livez, /healthz, /readyz (JSON), else 404."""
    metrics = make_wsgi_app(registry) if registry is not None else make_wsgi_app()
    checks = {"/livez": health.not_live, "/healthz": health.faults, "/readyz": health.not_ready}

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
            return _answer(start_response, "405 Method Not Allowed", {"error": "GET only"})
        if path == "/metrics":
            return metrics(environ, start_response)  # type: ignore[no-any-return]
        if path in checks:
            faults = checks[path]()
            status = "503 Service Unavailable" if faults else "200 OK"
            body = {"status": "unhealthy" if faults else "ok", "faults": faults}
            return _answer(start_response, status, body)
        return _answer(start_response, "404 Not Found", {"error": "no such path"})

    return app


def _answer(start_response: StartResponse, status: str, body: dict[str, Any]) -> list[bytes]:
    payload = json.dumps(body).encode()
    start_response(
        status,
        [("Content-Type", "application/json"), ("Content-Length", str(len(payload))),
         ("Cache-Control", "no-store")],
    )  # fmt: skip
    return [payload]


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a hanging client never holds the process at exit
    request_timeout_s: float | None = HTTP_TIMEOUT_S
    slots = threading.BoundedSemaphore(MAX_CONNECTIONS)  # serve() gives each server its own

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):  # full: closed now, no thread started
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread to give the slot back
            self.slots.release()
            self.shutdown_request(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that timed out or went away: not news, and no traceback on stderr.
        log.debug("http: a connection from %s ended: %r", client_address, sys.exc_info()[1])


class _Quiet(WSGIRequestHandler):
    server: _Server

    def setup(self) -> None:
        super().setup()
        timeout_s = self.server.request_timeout_s
        self.connection.settimeout(timeout_s)  # each read's and write's
        # ...and the whole connection's: a client sending a byte now and then would hold its
        # slot for good (32 such would keep every probe out, and the kubelet restarts the pod).
        self._deadline: threading.Timer | None = None
        if timeout_s is not None:
            self._deadline = threading.Timer(timeout_s, self._cut)
            self._deadline.daemon = True
            self._deadline.start()

    def _cut(self) -> None:
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)

    def finish(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        super().finish()

    def log_message(self, format: str, *args: Any) -> None:
        pass  # a probe every few seconds is not news


def serve(
    app: Callable[..., Iterable[bytes]],
    addr: str,
    port: int,
    *,
    timeout_s: float = HTTP_TIMEOUT_S,
    max_connections: int = MAX_CONNECTIONS,
) -> WSGIServer:
    """Serve `app` on addr:port from a daemon thread; the server is returned for shutdown.
    A connection is dropped `timeout_s` after it opened; past `max_connections` served at
    once, one more is closed at once."""
    family = socket.getaddrinfo(addr or None, port, type=socket.SOCK_STREAM,
                                flags=socket.AI_PASSIVE)[0][0]  # fmt: skip

    class Server(_Server):
        address_family = family
        request_timeout_s = timeout_s
        slots = threading.BoundedSemaphore(max_connections)

    server = make_server(addr, port, app, server_class=Server, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, name="shardflow-http", daemon=True).start()
    return server


@contextlib.asynccontextmanager
async def serving(
    settings: Settings, store: Any, bus: Any, service: Consuming
) -> AsyncIterator[Health | None]:
    """Serve /metrics, /livez, /healthz and /readyz on SHARDFLOW_METRICS_PORT while the block runs
    (port 0: nothing). `store` is a RedisStore (its client is pinged), `bus` a Bus."""
    if not settings.metrics_port:
        yield None
        return
    health = Health(
        store.client.ping,
        lambda: bus.is_connected,
        lambda: service.consuming,
        blocked=lambda: bus.publishing_blocked,
        rabbitmq_down=lambda: bus.down_reason,
    )
    try:
        server: WSGIServer | None = serve(
            application(health), settings.metrics_addr, settings.metrics_port
        )
    except OSError as exc:
        # Not fatal: the work goes on; the probes of a pod (or a scrape) will say so.
        choose = (
            "SHARDFLOW_METRICS_PORT (--metrics-port) to a free port"
            if exc.errno == errno.EADDRINUSE
            else "SHARDFLOW_METRICS_ADDR to an address of this host, and the port to one it may use"
        )
        log.error(
            "cannot serve metrics and health on %s:%d (%s): running on without them; set %s, "
            "or the port to 0 for none",
            settings.metrics_addr,
            settings.metrics_port,
            exc.strerror or exc,
            choose,
        )
        server = None
    if server is None:
        # Yielded outside the except clause: an error of the block would otherwise carry
        # the bind's OSError as its context ("During handling of ... Address already in use").
        yield None
        return
    log.info("serving /metrics, /livez, /healthz, /readyz on port %d", server.server_port)
    sampling = asyncio.create_task(health.run())
    try:
        yield health
    finally:
        sampling.cancel()
        await asyncio.gather(sampling, return_exceptions=True)
        await asyncio.to_thread(server.shutdown)
        server.server_close()
