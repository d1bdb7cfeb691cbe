"""The CEL evaluator process: conditions run here, so a runaway one can be stopped.

The `cel` extension holds the GIL while it evaluates, so a thread with a timeout could neither
keep an event loop turning nor stop it: each process that evaluates conditions has one small
evaluator process (`python -P orchestrator/evaluator.py`, loading only the native extension),
started on first use. A request over its budget kills it (SIGKILL) and a fresh one starts at
once. It also limits itself (kernel rlimits): CPU time per evaluation (budget + 2 s), so a
runaway ends even if its parent died, and `MEMORY_BYTES` of address space.
See orchestrator/conditions.py for what is evaluated and the bounds on it.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Any

MEMORY_BYTES = 1 << 30  # address space of the evaluator process


class EvaluatorError(ValueError):
    """The evaluation did not give an answer: over its budget, or the process failed."""


def _native_cel() -> ModuleType | None:
    """The `cel` extension alone: its package's __init__ imports the package's command line
    (typer, prompt_toolkit: 0.3 s), which the evaluator process does without (30 ms)."""
    import importlib.machinery as machinery
    import importlib.util as util

    try:
        spec = util.find_spec("cel")
        for folder in (spec and spec.submodule_search_locations) or []:
            for name in os.listdir(folder):
                if name.startswith("cel.") and name.endswith(tuple(machinery.EXTENSION_SUFFIXES)):
                    loader = machinery.ExtensionFileLoader("cel.cel", os.path.join(folder, name))
                    found = util.spec_from_loader("cel.cel", loader)
                    if found is not None:
                        module = util.module_from_spec(found)
                        loader.exec_module(module)
                        return module
    except (ImportError, OSError):
        pass
    return None  # `import cel` then loads the whole package: slower, the same functions


def load_cel() -> ModuleType:
    """The `cel` module, its extension alone where found: registered as `cel`, so any later
    `import cel` in the process is this one (a PyO3 extension initialises once a process)."""
    loaded = sys.modules.get("cel")
    if loaded is not None:
        return loaded
    native = _native_cel()
    if native is None:
        import cel

        return cel
    sys.modules["cel"] = native
    return native


# --- The evaluator process -------------------------------------------------------------------

# Not part of any budget: starting the evaluator, and decoding and converting the values
# (linear in their size, bounded by the size limits on inputs and outputs: ~0.1 s per MB).
_START_TIMEOUT_S = 30.0
_PREPARE_TIMEOUT_S = 10.0


class _Evaluator:
    """The parent's side: one evaluator process, one request at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # held for a whole request
        self._executor_lock = threading.Lock()  # never held long: event loops take it
        self._process: subprocess.Popen[bytes] | None = None
        self._ready = False
        self._buffer = b""
        self._spawn_error: OSError | None = None
        self._pid = os.getpid()
        self._executor: ThreadPoolExecutor | None = None

    def executor(self) -> ThreadPoolExecutor:
        """One thread for async callers: evaluations run one at a time anyway."""
        self._after_fork()
        with self._executor_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="cel-evaluator")
            return self._executor

    def run(self, request: bytes, budget_s: float) -> dict[str, Any]:
        """Send one request; its reply, or EvaluatorError when over budget or crashed."""
        self._after_fork()
        with self._lock:
            self._start()
            try:
                self._write(request)
            except OSError:  # it died between requests: this request never started
                self._stop()
                self._start()
                try:
                    self._write(request)
                except OSError as exc:  # again, on this request: its fault, not a service's
                    code = self._restart()
                    raise EvaluatorError(
                        f"the evaluator process died reading the request (exit code {code}): {exc}"
                    ) from None
            # First the values are decoded and converted, then the budget starts.
            try:
                converted = self._read_line(_PREPARE_TIMEOUT_S) == b"converted\n"
            except TimeoutError:
                self._restart()
                raise EvaluatorError(
                    f"input and prev took over {_PREPARE_TIMEOUT_S:g} s to convert: too large"
                ) from None
            try:
                line = self._read_line(budget_s) if converted else b""
            except TimeoutError:
                self._restart()
                raise EvaluatorError(f"exceeded its time budget of {budget_s:g} s") from None
            if not line:
                code = self._restart()
                raise EvaluatorError(
                    f"the evaluator process died (exit code {code}): out of memory?"
                )
            reply: dict[str, Any] = json.loads(line)
            return reply

    def _restart(self) -> int | None:
        """Kill the evaluator and start the next one at once (ready by the next call, or
        nearly); the old one's exit code."""
        code = self._stop()
        self._spawn()
        return code

    def _start(self) -> None:
        if self._process is None:
            self._spawn()
        if self._process is None:
            raise EvaluatorError(f"the CEL evaluator process cannot start: {self._spawn_error}")
        if not self._ready:
            try:
                ready = self._read_line(_START_TIMEOUT_S)
            except TimeoutError:
                ready = b""
            if ready != b"ready\n":
                self._stop()
                raise EvaluatorError("the CEL evaluator process did not start")
            self._ready = True

    def _spawn(self) -> None:
        self._ready, self._buffer = False, b""
        try:
            self._process = subprocess.Popen(
                # -P: not the script's folder first on sys.path (it holds orchestrator modules).
                [sys.executable, "-P", os.path.abspath(__file__)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                bufsize=0,
            )
        except OSError as exc:  # out of processes or file descriptors: the next call retries
            self._process, self._spawn_error = None, exc

    def _stop(self) -> int | None:
        process, self._process, self._ready, self._buffer = self._process, None, False, b""
        if process is None:
            return None
        process.kill()
        for pipe in (process.stdin, process.stdout):
            if pipe is not None:
                pipe.close()
        return process.wait()

    def _write(self, data: bytes) -> None:
        assert self._process is not None and self._process.stdin is not None
        fd, view = self._process.stdin.fileno(), memoryview(data)
        while view:
            view = view[os.write(fd, view) :]

    def _read_line(self, timeout_s: float) -> bytes:
        """The next line (b"" if the process ended); TimeoutError when none came in time."""
        assert self._process is not None and self._process.stdout is not None
        fd = self._process.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not poller.poll(left * 1000):
                raise TimeoutError
            chunk = os.read(fd, 65536)
            if not chunk:
                return b""
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line + b"\n"

    def close(self) -> None:
        """At exit: end the evaluator (it would end anyway, on end of input)."""
        if os.getpid() == self._pid:
            with self._lock:
                self._stop()

    def _after_fork(self) -> None:
        # A forked child must not share its parent's evaluator, pipes or lock.
        if os.getpid() != self._pid:
            self.__init__()  # type: ignore[misc]


EVALUATOR = _Evaluator()
atexit.register(EVALUATOR.close)


def _serve() -> None:
    """The evaluator process: one JSON request per line on stdin; per request, a line
    `converted` once the values are CEL values, then the reply line."""
    import resource
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the parent, which ends us
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    if hard == resource.RLIM_INFINITY or hard > MEMORY_BYTES:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, hard))
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything else printed goes to stderr, not into the replies
    cel = load_cel()

    programs: dict[str, Any] = {}
    replies.write(b"ready\n")
    replies.flush()
    for line in sys.stdin.buffer:
        reply: dict[str, Any]
        converted = False
        try:
            request = json.loads(line)
            context = cel.Context(variables=request["context"])
            replies.write(b"converted\n")
            replies.flush()
            converted = True
            _limit_cpu(request["budget_s"])
            source = request["source"]
            if source not in programs:
                if len(programs) >= 512:
                    programs.clear()
                programs[source] = cel.compile(source)
            value = programs[source].execute(context)
            if "max_items" in request:  # a map step's list, bounded before it is copied
                reply = _list_reply(value, request["max_items"], request["max_bytes"])
            elif "max_value_bytes" in request:  # an argument's value (args_from)
                reply = _value_reply(value, request["max_value_bytes"])
            elif isinstance(value, bool):
                reply = {"value": value}
            else:
                reply = {"gave": type(value).__name__, "repr": repr(value)[:1000]}
        except Exception as exc:  # the CEL runtime raises TypeError/RuntimeError/ValueError...
            reply = {"error": type(exc).__name__, "message": str(exc)[:10_000]}
        if not converted:
            replies.write(b"converted\n")
        replies.write(json.dumps(reply).encode() + b"\n")
        replies.flush()


def _list_reply(value: Any, max_items: int, max_bytes: int) -> dict[str, Any]:
    """A list as JSON, or why not: not a list, too many items, too large, not JSON."""
    if not isinstance(value, list):
        return {"gave": type(value).__name__, "repr": repr(value)[:1000]}
    if len(value) > max_items:
        return {"too_many": len(value)}
    reply = _value_reply(value, max_bytes)
    if "error" in reply:
        return {**reply, "message": f"its items are {reply['message']}"}
    return {"items": value} if "json" in reply else reply


def _value_reply(value: Any, max_bytes: int) -> dict[str, Any]:
    """Any JSON value, as JSON text, or why not: not JSON, too large."""
    try:
        text = json.dumps(value, allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError) as exc:  # bytes, timestamps, durations, NaN
        return {"error": "NotJSON", "message": f"not JSON: {exc}"}
    if len(text.encode()) > max_bytes:
        return {"too_large": len(text.encode())}
    return {"json": text}


def _limit_cpu(budget_s: float) -> None:
    # The kernel stops this process (SIGXCPU) a little after the budget even if nobody is
    # left to kill it: a parent that died mid-evaluation leaves no runaway behind.
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = int(usage.ru_utime + usage.ru_stime + budget_s) + 2
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    if hard == resource.RLIM_INFINITY or soft <= hard:
        resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


if __name__ == "__main__":
    _serve()
