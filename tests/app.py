"""Task handlers for the tests. Each records when it starts and ends, in one Redis sequence.

A trace orders events with one INCR counter, so "did step k+1 start after step k ended" never
depends on clocks. The input names the trace: `{"trace": {"url": ..., "key": ...}}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import time
from dataclasses import dataclass
from functools import cache
from typing import Any

import redis

from worker import TaskContext, task


@cache
def _client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, decode_responses=True)


@dataclass(frozen=True)
class Trace:
    """Where tasks record their start and end events."""

    url: str
    key: str

    def as_input(self, **extra: Any) -> dict[str, Any]:
        return {"trace": {"url": self.url, "key": self.key}, **extra}

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(item) for item in _client(self.url).lrange(self.key, 0, -1)]


def _record(ctx: TaskContext, event: str) -> None:
    where = ctx.input.get("trace") if isinstance(ctx.input, dict) else None
    if not where:
        return
    client = _client(where["url"])
    seq = client.incr(where["key"] + ":seq")
    client.rpush(
        where["key"],
        json.dumps(
            {
                "wf": ctx.workflow_id,
                "path": ctx.step,
                "index": ctx.index,
                "event": event,
                "seq": seq,
            }
        ),
    )


async def _traced(ctx: TaskContext, result: Any, sleep_s: float = 0.0) -> Any:
    _record(ctx, "start")
    await asyncio.sleep(ctx.args.get("sleep_s", sleep_s))
    _record(ctx, "end")
    return result


@task()
async def echo(ctx: TaskContext) -> Any:
    """Returns what it was given: its args and prev."""
    return await _traced(ctx, {"args": ctx.args, "prev": ctx.prev})


@task()
async def undo(ctx: TaskContext) -> dict[str, Any]:
    """A compensation: returns what it undoes (its item) and its args; fails its first
    `fail_first` attempts (all of them with a large number)."""
    if ctx.attempt < ctx.args.get("fail_first", 0):
        _record(ctx, "start")
        raise RuntimeError(f"undo attempt {ctx.attempt} fails")
    return await _traced(ctx, {"undid": ctx.item, "args": ctx.args, "attempt": ctx.attempt})


@task()
async def add(ctx: TaskContext) -> int:
    """prev (a number, or the sum of a list of numbers) plus args.n."""
    prev = ctx.prev if ctx.prev is not None else 0
    base = sum(prev) if isinstance(prev, list) else prev
    return await _traced(ctx, base + ctx.args.get("n", 1))


@task()
async def counter(ctx: TaskContext) -> dict[str, int]:
    """For untiloops: reports which iteration it ran in."""
    return await _traced(ctx, {"iteration": ctx.iteration})


@task()
def blocking(ctx: TaskContext) -> str:
    """A plain function: runs in a thread."""
    _record(ctx, "start")
    _record(ctx, "end")
    return f"thread:{ctx.args.get('name', '')}"


@task()
async def boom(ctx: TaskContext) -> None:
    """Always fails."""
    _record(ctx, "start")
    raise RuntimeError(ctx.args.get("message", "boom"))


@task(name="ctx.identity")
async def identity(ctx: TaskContext) -> dict[str, Any]:
    """Returns the task's identity as the worker gave it."""
    return {
        "workflow_id": ctx.workflow_id,
        "step": ctx.step,
        "iteration": ctx.iteration,
        "index": ctx.index,
        "attempt": ctx.attempt,
        "idempotency_key": ctx.idempotency_key,
    }


@task()
async def work(ctx: TaskContext) -> dict[str, Any]:
    """For drawn programs: an output that depends only on where the task runs."""
    from tests.model import output_of

    return await _traced(ctx, output_of(ctx.step, ctx.index))


@task()
async def flaky(ctx: TaskContext) -> dict[str, int]:
    """Fails until attempt `fail_until`."""
    if ctx.attempt < ctx.args["fail_until"]:
        raise RuntimeError(f"attempt {ctx.attempt} fails")
    return {"attempt": ctx.attempt}


@task()
async def item(ctx: TaskContext) -> dict[str, Any]:
    """A map member: its item and index; fails its first attempt when the item says so, and
    sleeps `sleep_s` from its args."""
    if isinstance(ctx.item, dict) and ctx.item.get("fail_once") and ctx.attempt == 0:
        raise RuntimeError(f"item {ctx.index} fails once")
    await asyncio.sleep(ctx.args.get("sleep_s", 0))
    return {"item": ctx.item, "index": ctx.index, "attempt": ctx.attempt}


@task()
async def blob(ctx: TaskContext) -> str:
    """An output of `n` bytes (and two quotes)."""
    return "x" * ctx.args["n"]


@task(name="not_json")
async def not_json(ctx: TaskContext) -> float:
    return float("nan")  # Python's json writes NaN; no JSON parser should read it


@task()
def exits(ctx: TaskContext) -> None:
    """Calls sys.exit: it must fail the task, never stop the worker."""
    raise SystemExit(ctx.args.get("code", 3))


def fault_output(wf: str, step: str, index: int | None, iteration: int, n: int, prev: Any) -> Any:
    """The fault test's output: it names the program, step and member, and digests its input, so
    a joined list in the wrong order, or with another program's outputs, changes what follows."""
    digest = hashlib.sha256(json.dumps(prev, sort_keys=True).encode()).hexdigest()[:12]
    return {"wf": wf, "step": step, "index": index, "iteration": iteration, "n": n, "prev": digest}


@task(name="fault.step")
async def fault_step(ctx: TaskContext) -> Any:
    """Appends each execution's start and end (with its pid and attempt) to a Redis list outside
    the system under test: the fault test's evidence of what ran, where and how often."""
    where = ctx.input["exec_log"]
    client = _client(where["url"])
    who = {
        "wf": ctx.workflow_id,
        "path": ctx.step,
        "index": ctx.index,
        "attempt": ctx.attempt,
        "pid": os.getpid(),
    }
    client.rpush(where["key"], json.dumps({"event": "start", **who, "prev": ctx.prev}))
    await asyncio.sleep(ctx.args.get("sleep_s", 0.0))
    n = ctx.item if ctx.item is not None else ctx.args.get("n", 0)  # a map member: its item
    output = fault_output(ctx.workflow_id, ctx.step, ctx.index, ctx.iteration, n, ctx.prev)
    client.rpush(where["key"], json.dumps({"event": "end", **who, "output": output}))
    return output


@task(name="fault.boom_after")
async def fault_boom_after(ctx: TaskContext) -> None:
    """Fails once its program's bag member `args.after` has started (the execution log says
    so; at most 10 s): a failure that lands while that member runs, however the two race."""
    where = ctx.input["exec_log"]
    client = _client(where["url"])
    for _ in range(500):
        for raw in client.lrange(where["key"], 0, -1):
            event = json.loads(raw)
            if (event["event"], event["wf"], event["index"]) == (
                "start",
                ctx.workflow_id,
                ctx.args["after"],
            ):
                raise RuntimeError("boom")
        await asyncio.sleep(0.02)
    raise RuntimeError("boom, and the member it waited for never started")


@task()
async def shaky(ctx: TaskContext) -> dict[str, Any]:
    """Fails its first attempt; then returns its args and attempt (a retry's args are the
    first attempt's)."""
    if ctx.attempt == 0:
        raise RuntimeError("the first attempt fails")
    return {"args": ctx.args, "attempt": ctx.attempt}


@task()
async def gated(ctx: TaskContext) -> dict[str, Any]:
    """Fails while the Redis key `args.gate` exists, from loop iteration `args.from` on; then
    waits while `args.hold` exists (at most 30 s). For redrive: fail a run, then let the next
    one pass. Returns its prev, iteration and index."""
    _record(ctx, "start")
    client = _client(ctx.input["trace"]["url"])
    if ctx.iteration >= ctx.args.get("from", 0) and client.exists(ctx.args["gate"]):
        raise RuntimeError("the gate is closed")
    for _ in range(600):
        if not ctx.args.get("hold") or not client.exists(ctx.args["hold"]):
            break
        await asyncio.sleep(0.05)
    _record(ctx, "end")
    return {"prev": ctx.prev, "iteration": ctx.iteration, "index": ctx.index}


class Unprintable(Exception):
    """An exception whose text cannot be made (a __str__ that parses a body it did not get)."""

    def __str__(self) -> str:
        raise AttributeError("no body to read")


@task()
async def unprintable(ctx: TaskContext) -> None:
    _record(ctx, "start")
    raise Unprintable()


@task()
async def deaf(ctx: TaskContext) -> str:
    """Catches every cancel and runs on, for `for_s` (so a test ends it)."""
    _record(ctx, "start")
    until = asyncio.get_running_loop().time() + ctx.args.get("for_s", 3)
    while asyncio.get_running_loop().time() < until:
        with contextlib.suppress(asyncio.CancelledError):  # what the handler does wrong
            await asyncio.sleep(0.05)
    _record(ctx, "end")
    return "late"


@task()
async def pops(ctx: TaskContext) -> Any:
    """Fails its first attempt after taking the last of prev's items away (a handler that
    changes what it was given): the next attempt must see them all again."""
    items = ctx.prev["args"]["items"]  # an echo's output
    seen = list(items)
    items.pop()
    if ctx.attempt == 0:
        raise RuntimeError("first attempt fails")
    return seen


@task()
async def self_cancelled(ctx: TaskContext) -> None:
    """Awaits an inner task that something else cancels: its own code raises CancelledError."""
    _record(ctx, "start")
    inner = asyncio.ensure_future(asyncio.sleep(10))
    asyncio.get_running_loop().call_later(0.05, inner.cancel)
    await inner


@task()
def plain_fault(ctx: TaskContext) -> None:
    """A plain function raising what asyncio mishandles from a thread: `stop` (next() of an
    empty iterator) or `cancel`."""
    _record(ctx, "start")
    if ctx.args["raise"] == "stop":
        next(iter([]))
    raise asyncio.CancelledError("from a thread")


@task()
async def odd_text(ctx: TaskContext) -> Any:
    """Returns, or raises with, a lone surrogate (a file name os.listdir decoded with
    surrogateescape), or returns a value nested `depth` levels deep."""
    _record(ctx, "start")
    if ctx.args.get("depth"):
        value: Any = 1
        for _ in range(ctx.args["depth"]):
            value = [value]
        return [value, "x" * ctx.args["pad"]] if ctx.args.get("pad") else value
    text = "report-\udce9.csv"
    if ctx.args.get("raise"):
        raise ValueError(f"cannot parse {text}")
    return {"files": [text], "pad": "x" * ctx.args.get("pad", 0)}


@task()
async def grouped(ctx: TaskContext) -> None:
    """A TaskGroup whose one task fails: its group's own text names only how many failed."""

    async def lookup() -> None:
        raise KeyError("customer 2 missing")

    async with asyncio.TaskGroup() as group:
        group.create_task(lookup())


@task()
def plain_sleep(ctx: TaskContext) -> str:
    """A plain function that sleeps `for_s` (its thread runs on past a timeout), then raises
    if told to (`fail`)."""
    _record(ctx, "start")
    time.sleep(ctx.args["for_s"])
    _record(ctx, "end")
    if ctx.args.get("fail"):
        raise RuntimeError("failed after its sleep")
    return "slept"
