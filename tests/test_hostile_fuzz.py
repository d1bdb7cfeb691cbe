"""Drawn hostile input on a live cluster of real processes (issue #10, item 11).

Two `shardflow orchestrator` processes own four shards; a serial and a parallel `shardflow worker`
and `shardflow router` (the ingress) run beside them. Good programs (serial tasks, a chunked bag,
an untiloop, a bag with a retried member) are submitted all along, through the router and the
ingress queue, while hypothesis draws batches of malformed and adversarial messages and publishes
them to every shard queue (through the shard exchange and the default exchange), both task
queues, the ingress queue and the control exchange. After each batch, every message it should
have parked is in `<prefix>.dead` with the reason expected, and nothing else is. At the end:
every good program completed with its exact result and left in Redis exactly the keys and values
of a twin nobody attacked; programs that had ended before the attack are unchanged; no key exists
for a program that was never submitted; the queues are empty; Redis answered PING within 100 ms
all along (a separate process pings it every 20 ms); and every process is alive and stops with
exit 0.

Dead letters carry the body they were refused with (not the AMQP properties), so a published
message is matched to its dead letter by queue (`x-shardflow-from`) and body; each body is kept.

What each message must come to (`expect_shard`, `expect_task`, and the ingress and control
strategies decide it by these rules):

- does not decode (not JSON, not UTF-8, lone surrogate, wrong type, missing or extra field,
  number out of range, name or path or error too long, nested too deep, over the size limit):
  dead, from its queue, with the decoder's fault as the reason.
- shard message for a program never submitted: dead, "<wf>: no such program", but a
  `deadline`, `wake` or `signal` (timers and a hint, which may outlive their program): acked.
- shard message on a shard that does not own the program (any kind, any path, even the live
  cursor's): dead, "<wf>: owned by shard X, not by shard Y".
- `next` or `failed` naming a path that is no leaf of the program; `failed` naming a member
  outside the bag, or an attempt the task's retry policy does not have: dead.
- `deadline` for a program that names none: dead, "<wf>: a deadline, but its program names none".
- `start` for a recorded program; `deadline` (any time it names) for a program whose own deadline
  (a day) has not passed, live or ended; `next` or `failed` naming a leaf
  that is not the live cursor (an alias such as `00` or an Arabic-Indic zero, an iteration the
  loop never reaches, any leaf of an ended program): acked and ignored (stale, or a replay).
- a bundle of reports (a JSON array of 1 to MAX_BUNDLE `next` and `failed` messages, as a
  worker sends the reports of a bundle's tasks): each report as if it had come alone, parked
  alone (its body as `encode` writes it again) by the rules above, and the bundle acked; one
  that came back (the failures header) is split first, each report published again alone to
  the same queue. One that does not decode (empty, over MAX_BUNDLE or MAX_BUNDLE_BODY, a member
  that is no report, not JSON): dead whole, with the decoder's fault.
- task for a program never submitted: dead, "<wf>: no such program", before any handler runs
  (one that sleeps an hour on the serial queue must not hold the cluster's serial lane); but a
  retry (`attempt` > 0) or a wait for a slot (`limit.waits` > 0), which come back through the
  delay ladder and may outlive their program: acked, not run.
- task for a recorded program at a path that is not its live cursor: acked, not run (stale).
- ingress request refused (bad JSON, request, program, id, input, size, or an id taken by another
  program or input): dead with the refusal; its answer goes to `reply_to`, and one sent to a shard,
  task or the ingress queue itself is dead there in turn. A request repeating a recorded program
  exactly: acked.
- control message that is not `{"wf": <id>}`: each worker drops it with the warning "ignored a
  control message" (control queues are exclusive and consumed without acks: no dead letter).
  `{"wf": <id>}`: nothing happens to a program that has not ended (the workers ask Redis first).

Never drawn, since whoever may publish to the vhost is trusted that far (docs: the vhost's publish
permission is the trust boundary): a well-formed `next`, `failed` or task message for a good
program's live cursor, alone or in a bundle (each may end or move it). `expect_*` refuse to
publish such a message if a strategy ever drew one.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aio_pika
import pytest
import redis
from hypothesis import HealthCheck, Phase, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from pydantic import ValidationError

from orchestrator import messages
from orchestrator.connections import connected
from orchestrator.delivery import FAILURES, describe
from orchestrator.keys import Names
from orchestrator.messages import (
    MAX_BUNDLE,
    MAX_BUNDLE_BODY,
    MAX_ERROR,
    Cancelled,
    ShardMessage,
    TaskMessage,
    bundle,
    decode_reports,
    decode_shard_body,
    decode_shard_message,
    decode_task,
    decode_tasks,
    encode,
)
from orchestrator.program import MAX_BAG, SIGNAL_NAME
from orchestrator.settings import MAX_SHARDS, Settings
from orchestrator.store import MAX_ATTEMPTS, TERMINAL
from router.client import Router

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).parent.parent
SHARDS = 4
LIMIT = 3  # SHARDFLOW_DELIVERY_LIMIT: a message that keeps failing is parked after 3 tries
EXAMPLES = int(os.environ.get("SHARDFLOW_FUZZ_EXAMPLES", "120"))
MAX_GOOD = 40
PING_BOUND_S = 0.1
MAX_PROGRAM = 256 * 1024  # SHARDFLOW_MAX_PROGRAM_BYTES (default)
MAX_MESSAGE = int(getattr(messages, "MAX_MESSAGE_BYTES", 16 * 1024 * 1024))
HAS_STORED = "stored" in messages.Next.model_fields  # `next` may say its output is in Redis
T = TypeVar("T")

# --- the good programs ---------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    program: dict[str, Any]
    result: Any
    cursors: frozenset[str]  # every path the program's cursor takes on its way


INPUT = {"fuzz": True}
SHAPES = {
    "serial": Shape(
        {
            "name": "fuzz-serial",
            "deadline_s": 86400,  # a deadline message naming any time ends nothing before it
            "steps": [
                {"task": "add", "args": {"n": 1, "sleep_s": 0.05}},
                {"task": "add", "args": {"n": 2, "sleep_s": 0.05}},
                {"task": "echo", "pool": "parallel", "args": {"k": "end"}},
            ],
        },
        {"args": {"k": "end"}, "prev": 3},
        frozenset({"0", "1", "2"}),
    ),
    "bag": Shape(
        {
            "name": "fuzz-bag",
            "steps": [
                {"task": "add", "args": {"n": 1}},
                {
                    "bag": [{"task": "add", "args": {"n": i, "sleep_s": 0.05}} for i in range(6)],
                    "chunk": 4,
                },
                {"task": "add", "pool": "parallel", "args": {"n": 0}},
            ],
        },
        21,  # 1, then [1 .. 6], then their sum
        frozenset({"0", "1", "2"}),
    ),
    "loop": Shape(
        {
            "name": "fuzz-loop",
            "steps": [
                {
                    "until": "prev.iteration >= 2",
                    "max_iterations": 10,
                    "steps": [
                        {"task": "echo", "pool": "parallel", "args": {"sleep_s": 0.05}},
                        {"task": "counter"},
                    ],
                },
                {"task": "echo", "args": {"last": True}},
            ],
        },
        {"args": {"last": True}, "prev": {"iteration": 2}},
        frozenset({f"0/iter:{i}/{j}" for i in range(3) for j in range(2)} | {"1"}),
    ),
    "retry": Shape(
        {
            "name": "fuzz-retry",
            "steps": [
                {"task": "add", "args": {"n": 1}},
                {
                    "bag": [
                        {
                            "task": "flaky",
                            "args": {"fail_until": 1},
                            "retry": {"max_attempts": 2, "backoff_s": 0.05},
                        },
                        {"task": "add", "args": {"n": 5}},
                    ],
                    "chunk": 2,
                },
            ],
        },
        [{"attempt": 1}, 6],
        frozenset({"0", "1"}),
    ),
}
# Programs that end before the attack; forged messages may name any of their steps.
ENDED = {
    "ended-completed": {
        "steps": [
            {"task": "add", "args": {"n": 1}},
            {"bag": [{"task": "add", "args": {"n": i}} for i in range(3)], "chunk": 2},
            {"until": "prev.iteration >= 1", "max_iterations": 3, "steps": [{"task": "counter"}]},
        ]
    },
    "ended-failed": {
        "steps": [{"task": "add"}, {"task": "boom", "args": {"message": "ended"}}, {"task": "echo"}]
    },
    "ended-cancelled": {
        "deadline_s": 86400,
        "steps": [{"task": "echo", "pool": "parallel", "args": {"sleep_s": 30}}, {"task": "echo"}],
    },
}


def leaf_of(program: dict[str, Any], path: str) -> dict[str, Any] | None:
    """The task or bag a (wire-valid) path names, read as the engine reads paths: each part a
    number (leading zeros and any Unicode digits allowed), `iter:N` inside an untiloop; None when
    it names no leaf."""
    steps = program["steps"]
    parts = path.split("/")
    while parts:
        head, parts = parts[0], parts[1:]
        if not head.isdigit() or int(head) >= len(steps):
            return None
        step = steps[int(head)]
        if not parts:
            return None if "until" in step else step
        if "until" not in step or not parts[0].startswith("iter:"):
            return None
        steps, parts = step["steps"], parts[1:]
    return None


def real_paths(steps: list[dict[str, Any]], prefix: str = "") -> set[str]:
    """Every leaf path of a program, with loop iterations up to 3."""
    paths: set[str] = set()
    for n, step in enumerate(steps):
        if "until" in step:
            for i in range(min(3, step["max_iterations"])):
                paths |= real_paths(step["steps"], f"{prefix}{n}/iter:{i}/")
        else:
            paths.add(f"{prefix}{n}")
    return paths


# Other spellings of the same numbers: the wire pattern's \d is Unicode (pydantic's Rust regex).
_DIGITS = [
    str.maketrans("0123456789", "".join(chr(zero + n) for n in range(10)))
    for zero in (0x0660, 0xFF10)  # Arabic-Indic, fullwidth
]
# Paths that name no leaf of most programs (each program keeps those that name none of its own).
_ELSEWHERE = (
    "3", "4", "9", "99", str(10**25), "9" * 1000, "0/0", "1/0", "2/0", "0/iter:0/0",
    "1/iter:0/0", "2/iter:0/0", "0/iter:0/5", "0/iter:0/0/iter:0/0", "0/1/iter:0/0",
    "0" + "/0" * 499,
)  # fmt: skip


def never_cursor(program: dict[str, Any], cursors: frozenset[str]) -> tuple[str, ...]:
    """Paths a report may name for a live program without ever naming its cursor: aliases of its
    paths, loop iterations it never reaches, and paths that name no leaf."""
    paths: set[str] = set()
    for path in cursors:
        parts = path.split("/")
        paths |= {"0" + path, "/".join([*parts[:-1], "0" + parts[-1]])}
        paths |= {path.translate(table) for table in _DIGITS}
        if "/iter:" in path:
            head, _, rest = path.partition("/iter:")
            tail = rest.partition("/")[2]
            paths |= {f"{head}/iter:{n}/{tail}" for n in (3, 9, 10, 10**6, 10**20)}
            paths.add(path.replace("iter:", "iter:0"))
    paths |= {p for p in _ELSEWHERE if leaf_of(program, p) is None}
    return tuple(sorted(paths - cursors))


@dataclass(frozen=True)
class Known:
    """A program recorded in Redis: what a forged message may say about it."""

    wf: str
    program: dict[str, Any]
    input: Any
    owner: int
    ended: bool  # ended before the attack: every path is fair
    cursors: frozenset[str]
    safe: tuple[str, ...]  # never its cursor

    @classmethod
    def of(cls, wf: str, program: dict[str, Any], input: Any, owner: int, ended: bool) -> Known:
        cursors = frozenset(real_paths(program["steps"]))
        return cls(wf, program, input, owner, ended, cursors, never_cursor(program, cursors))


@dataclass(frozen=True)
class World:
    """What the strategies of one example may name."""

    n: int  # the example's number, for fresh ids
    names: Names
    good: tuple[Known, ...]
    ended: tuple[Known, ...]

    def known(self, wf: str) -> Known | None:
        return next((k for k in (*self.good, *self.ended) if k.wf == wf), None)


# --- hostile messages ----------------------------------------------------------------------


class Raw:
    """JSON text put into a body as it is: what json.dumps cannot write (lone surrogates,
    invalid UTF-8, NaN where a number is checked, nesting deeper than a parser takes)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __repr__(self) -> str:
        return f"Raw({self.data[:30]!r}.. {len(self.data)} bytes)"


def render(value: Any) -> bytes:
    if isinstance(value, Raw):
        return value.data
    if isinstance(value, dict):
        items = (render(str(k)) + b":" + render(v) for k, v in value.items())
        return b"{" + b",".join(items) + b"}"
    if isinstance(value, list):
        return b"[" + b",".join(render(v) for v in value) + b"]"
    return json.dumps(value).encode()


def big(n: int) -> Raw:
    return Raw(b'"' + b"x" * n + b'"')


def deep(depth: int) -> Raw:
    return Raw(b"[" * depth + b"]" * depth)


@dataclass(frozen=True, repr=False)
class Hostile:
    """One message to publish, and where it must end up."""

    label: str
    queue: str  # the queue it lands in (x-shardflow-from of its dead letter); "" for control
    exchange: str
    routing_key: str
    body: bytes
    props: dict[str, Any] = field(default_factory=dict)
    broken: bool = False  # built not to decode: the decoder must refuse it
    shard: int = -1
    # ingress: the refusal's reason contains this (None: acked, the program exists as sent)
    refusal: str | None = ""

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))  # hypothesis prints drawn values this way: never a whole body

    def __repr__(self) -> str:
        where = self.queue or self.exchange
        return f"<{self.label} -> {where}: {self.body[:160]!r} ({len(self.body)} bytes)>"


KEYS = st.text(max_size=6)
SMALL = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=3),
    max_leaves=8,
)
ODD = st.sampled_from(
    [big(65537), big(1 << 20), deep(150), Raw(b'{"a":' * 150 + b"1" + b"}" * 150),
     Raw(b"NaN"), Raw(b"-Infinity"), Raw(b"1e999"), Raw(b"1" * 400), Raw(b"-0.0"),
     Raw(b'"\\ud83d\\ude00 \\u0000"')]
)  # fmt: skip
HUGE = st.sampled_from([big(MAX_MESSAGE - 4096), big(MAX_MESSAGE + 1)])
VALUE = st.one_of(*[SMALL] * 6, ODD)
BIG_VALUE = st.one_of(*[VALUE] * 30, HUGE)  # now and then a message near or over its limit
ARGS = st.dictionaries(KEYS, SMALL, max_size=3)
# Values no JSON parser of ours accepts, wherever they stand.
BROKEN = st.sampled_from(
    [deep(300), Raw(b'"\\ud800"'), Raw(b'"x\\udc00"'), Raw(b'"\xff"'), Raw(b'"\xed\xa0\x80"'),
     Raw(b"[1,]"), Raw(b"{"), Raw(b"'x'"), Raw(b"undefined"), Raw(b"0x10"), Raw(b"01")]
)  # fmt: skip
GARBAGE = st.one_of(
    st.binary(max_size=64),
    st.text(max_size=64).map(str.encode),
    st.sampled_from([b"", b" ", b"null", b"[]", b"{}", b"0", b'"x"', b"true", b"\x1f\x8b\x08\x00"]),
)

# Values a field of each kind never accepts (wrong type, out of range, bad pattern).
BAD: dict[str, list[Any]] = {
    "kind": [None, 5, [], {}, "stop", "Start", "", "cancelled"],
    "wf": [None, 5, 1.5, [], {}, True, "", " a", "-a", ".a", "a b", "a" * 129, "é", "a\n",
           "{a}", "a/b"],
    "path": [None, 0, [], {}, "", "a", "0/", "/0", "0//0", "-1", "0/iter:/0", "0/iter:1/iter:2",
             "²", "0\n", " 0", "1" * 1001, "0/iter:0/"],
    "index": ["x", "1.5", [], {}, 1.5, -1, MAX_BAG, 10**7, -(10**20)],
    "attempt": ["x", [], {}, None, 1.5, -1, MAX_ATTEMPTS, 10**7],
    "report_task": [None, 5, [], "1abc", "a b", "a" * 129, "-x"],
    "task": [None, 5, [], "", "1abc", "a b", "a" * 129, "-x"],
    "error": [None, 5, [], "e" * (MAX_ERROR + 1)],
    "int": ["x", [], {}, None, 1.5],
    "iteration": ["x", [], {}, None, 1.5, -1],
    "deadline_s": ["x", [], {}, None, 0, -1, 30 * 86400 + 1, 1e308, Raw(b"NaN"), Raw(b"Infinity")],
    "size": ["x", [], None, 1.5, 0, -1, MAX_BAG + 1],
    "args": [[], "x", 5, None, [["a", 1]]],
    "owner": ["x", [], None, 1.5, -1, MAX_SHARDS, 10**6],
    "timeout_s": ["x", [], {}, 0, -1, 86401, Raw(b"NaN"), 1e308],
    "batch": ["x", {}, 5, [1], [None], [{"index": 0}], [{"task": "echo"}],
              [{"index": -1, "task": "echo"}], [{"index": 0, "task": "echo", "x": 1}],
              [{"index": 0, "task": "1x"}], [{"index": 0, "task": "echo", "timeout_s": 0}]],
    "stored": ["maybe", 2, [], {}],
    "signal_name": [None, 5, [], {}, "", "A", "1a", "a b", "a" * 65, "a/b", "é"],
}  # fmt: skip
FIELDS = {  # each message's fields: the kind of value each holds ("any": every JSON value)
    "start": {"kind": "kind", "wf": "wf"},
    "next": {"kind": "kind", "wf": "wf", "path": "path", "output": "any"}
    | ({"stored": "stored"} if HAS_STORED else {}),
    "failed": {"kind": "kind", "wf": "wf", "path": "path", "index": "index",
               "attempt": "attempt", "task": "report_task", "error": "error", "prev": "any",
               "iteration": "int"},
    "deadline": {"kind": "kind", "wf": "wf", "deadline_s": "deadline_s"},
    "signal": {"kind": "kind", "wf": "wf", "name": "signal_name"},
    "task": {"wf": "wf", "path": "path", "index": "index", "size": "size", "task": "task",
             "args": "args", "input": "any", "prev": "any", "iteration": "iteration",
             "attempt": "attempt", "owner": "owner", "timeout_s": "timeout_s", "batch": "batch"},
}  # fmt: skip
REQUIRED = {
    "start": ["kind", "wf"],
    "next": ["kind", "wf", "path"],
    "failed": ["kind", "wf", "path", "error"],
    "deadline": ["kind", "wf", "deadline_s"],
    "signal": ["kind", "wf", "name"],
    "task": ["wf", "path", "task", "owner"],
}
# Handlers of tests.app, and names no worker knows. None of them may run for a drawn task.
TASK_NAMES = st.sampled_from(["echo", "add", "counter", "blocking", "boom", "exits", "blob"]) | (
    st.from_regex(r"\Anope[A-Za-z0-9_.:-]{0,20}\Z")
)
# An hour of sleep, a gigabyte of output, a handler calling sys.exit: if one ran, it would show.
TASK_ARGS = ARGS | st.sampled_from([{"sleep_s": 3600}, {"n": 1 << 30}, {"code": 3}])


def pick(draw: st.DrawFn, choices: tuple[T, ...] | list[T]) -> T:
    """One of `choices`, drawn so that what hypothesis records does not depend on how many
    there are: the world grows while it draws, and its record of a run must stay valid."""
    return choices[draw(st.integers(0, 1 << 16)) % len(choices)]


@st.composite
def ghost_ids(draw: st.DrawFn, w: World) -> str:
    """Ids of programs that were never submitted (fresh for each example)."""
    k = draw(st.integers(0, 3))
    forms = [f"ghost-{w.n}-{k}", f"g{w.n}-{k}-".ljust(128, "x"), f"ghost:{w.n}@{k}.x"]
    forms.append(f"{pick(draw, w.good).wf}.ghost{w.n}")
    return draw(st.sampled_from(forms))


@dataclass(frozen=True)
class Address:
    wf: str
    shard: int
    known: Known | None
    paths: tuple[str, ...]  # what a well-formed report may name for it
    own_live: bool  # a live program on its own shard: no forged report for its cursor


GHOST_PATHS = ("0", "1", "2", "00", chr(0x0660), "1/iter:0/0", "2/iter:7/1", *_ELSEWHERE)


@st.composite
def addresses(
    draw: st.DrawFn, w: World, *, for_tasks: bool = False, shard: int | None = None
) -> Address:
    """Whom a message names, and the shard it goes to; `shard`: the queue is given (a bundle's
    other reports), and a program it owns is named when there is one (else it is foreign)."""
    ways = ["ghost"] * 2 + ["good"] * 2 + ["ended"]
    ways += [] if for_tasks else ["good-foreign", "ended-foreign"]
    way = draw(st.sampled_from(ways))
    if way == "ghost":
        to = draw(st.integers(0, SHARDS - 1)) if shard is None else shard
        return Address(draw(ghost_ids(w)), to, None, GHOST_PATHS, False)
    programs = w.good if way.startswith("good") else w.ended
    if shard is not None and not way.endswith("foreign"):
        programs = tuple(k for k in programs if k.owner == shard) or programs
    known = pick(draw, programs)
    every = (*sorted(known.cursors), *known.safe)
    if shard is None:
        shard = known.owner
        if way.endswith("foreign"):
            shard = (known.owner + draw(st.integers(1, SHARDS - 1))) % SHARDS
    if shard != known.owner:  # any path and kind: the shard must refuse it first
        return Address(known.wf, shard, known, every, False)
    if way.startswith("good"):
        return Address(known.wf, shard, known, known.safe, True)
    return Address(known.wf, shard, known, every, False)


def anywhere(address: Address) -> Address:
    """The address with every path of its program, its cursors too: for a message that must
    never decode (a live cursor's report spoilt)."""
    paths = address.known.cursors | set(address.paths) if address.known else address.paths
    return Address(address.wf, address.shard, address.known, tuple(sorted(paths)), False)


def _optional(draw: st.DrawFn, message: dict[str, Any], required: list[str]) -> dict[str, Any]:
    """Leave out some fields that have defaults."""
    return {k: v for k, v in message.items() if k in required or draw(st.integers(0, 3)) > 0}


@st.composite
def shard_bodies(
    draw: st.DrawFn, address: Address, kind: str, small: bool = False
) -> dict[str, Any]:
    """A well-formed shard message (for a shard that may not own it); `small`: its values and
    error of a few bytes (a hundred of them in a bundle stay under the bundle's bound)."""
    wf = address.wf
    if kind == "start":
        return {"kind": "start", "wf": wf}
    if kind == "deadline":
        deadline = draw(st.floats(min_value=0.001, max_value=30 * 86400) | st.just(30 * 86400))
        return {"kind": "deadline", "wf": wf, "deadline_s": deadline}
    if kind == "signal":  # the good programs wait for no signal: a hint that takes nothing
        name = draw(st.from_regex(SIGNAL_NAME, fullmatch=True))
        return {"kind": "signal", "wf": wf, "name": name}
    path = pick(draw, address.paths)
    if kind == "next":
        if HAS_STORED and draw(st.integers(0, 5)) == 0:
            return {"kind": "next", "wf": wf, "path": path, "stored": True}
        output = draw(SMALL if small else BIG_VALUE)
        return {"kind": "next", "wf": wf, "path": path, "output": output}
    error = draw(st.text(max_size=30) | st.just("e" * (30 if small else MAX_ERROR)))
    failed = {
        "kind": "failed",
        "wf": wf,
        "path": path,
        "index": draw(st.none() | st.integers(0, 8) | st.just(MAX_BAG - 1)),
        "attempt": draw(st.integers(0, 3) | st.just(MAX_ATTEMPTS - 1)),
        "task": draw(st.sampled_from(["", "echo", "flaky", "t" * 128])),
        "error": error,
        "prev": draw(SMALL if small else VALUE),
        "iteration": draw(st.integers()),
    }
    return _optional(draw, failed, REQUIRED["failed"])


@st.composite
def task_bodies(draw: st.DrawFn, address: Address) -> dict[str, Any]:
    """A well-formed task message: a single task or bag members."""
    bag = draw(st.booleans())
    size = draw(st.integers(1, 8) | st.just(MAX_BAG)) if bag else 1
    if not bag:
        indices = [0]
    elif size == MAX_BAG and draw(st.booleans()):
        indices = list(range(MAX_BAG))  # the largest chunk there is
    else:
        indices = [draw(st.integers(0, size - 1)) for _ in range(draw(st.integers(1, 3)))]
    members: list[dict[str, Any]] = []
    for index in indices:
        if len(members) < 3:  # a big chunk: the rest as the third
            name, args = draw(TASK_NAMES), draw(TASK_ARGS)
            timeout = draw(st.none() | st.floats(1e-6, 86400))
        members.append({"index": index, "task": name, "args": args, "timeout_s": timeout})
    first, rest = members[0], members[1:]
    owner = draw(st.integers(0, SHARDS - 1) | st.integers(SHARDS, MAX_SHARDS - 1))
    task = {
        "wf": address.wf,
        "path": pick(draw, address.paths),
        "index": first["index"] if bag else None,
        "size": size,
        "task": first["task"],
        "args": first["args"],
        "input": draw(BIG_VALUE),
        "prev": draw(VALUE),
        "iteration": draw(st.integers(0, 10**30)),
        "attempt": draw(st.integers(0, MAX_ATTEMPTS - 1)),
        "owner": owner,
        "timeout_s": first["timeout_s"],
        "batch": [_optional(draw, m, ["index", "task"]) for m in rest],
    }
    return _optional(draw, task, REQUIRED["task"] + (["index", "size"] if bag else []))


@st.composite
def broken(draw: st.DrawFn, message: dict[str, Any], kind: str) -> bytes:
    """The message spoiled so that no decoder may accept it."""
    fields = FIELDS[kind]
    spoil = draw(st.sampled_from(["drop", "extra", "bad", "raw", "body", "mismatch"]))
    message = dict(message)
    if spoil == "drop":
        del message[draw(st.sampled_from([k for k in REQUIRED[kind] if k in message]))]
    elif spoil == "extra":
        message["x_" + draw(st.text("abcxyz", max_size=6))] = draw(SMALL)
    elif spoil == "bad":
        name = draw(st.sampled_from([k for k, how in fields.items() if BAD.get(how)]))
        message[name] = draw(st.sampled_from(BAD[fields[name]]))
    elif spoil == "raw":
        message[draw(st.sampled_from(sorted(fields)))] = draw(BROKEN)
    elif spoil == "mismatch" and kind == "task":
        size = draw(st.integers(1, 5))
        message |= draw(
            st.sampled_from(
                [{"index": None, "size": 2}, {"index": size, "size": size},
                 {"index": None, "size": 1, "batch": [{"index": 0, "task": "echo"}]},
                 {"index": 0, "size": size, "batch": [{"index": size, "task": "echo"}]},
                 {"index": 0, "size": MAX_BAG,
                  "batch": [{"index": 0, "task": "echo"}] * (MAX_BAG + 1)}]
            )
        )  # fmt: skip
    elif spoil == "mismatch" and kind == "next" and HAS_STORED:
        message |= {"stored": True, "output": draw(SMALL.filter(lambda v: v is not None))}
    else:
        body = render(message)
        # A task, or a report, in a list is a bundle (orchestrator/bundling.py): broken only
        # with a stranger.
        listed = b"[" + body + (b",1]" if kind in ("task", "next", "failed") else b"]")
        return draw(
            st.sampled_from(
                [body[: len(body) // 2], body + b"x", body + b"}", b"\xef\xbb\xbf" + body,
                 listed, body + body,
                 json.dumps(body.decode(errors="replace")).encode(),
                 body + b"\x00"]
            )
        )  # fmt: skip
    return render(message)


def _dead_letter_props(draw: st.DrawFn, came_back: bool = False) -> dict[str, Any]:
    """AMQP properties for a message that must be parked: they change nothing about that.
    `came_back`: always the failures header (a bundle of reports that has it is split, each
    report then settled as if it had come alone)."""
    props: dict[str, Any] = {}
    if came_back or draw(st.integers(0, 3)) == 0:
        props["headers"] = {
            FAILURES: draw(st.sampled_from(["abc", -1, 0, 2, 2**62, 1.5, [1], {"a": 1}, True])),
            "x-shardflow-reason": "forged",
            draw(st.text("abc", min_size=1, max_size=5)): draw(st.text(max_size=20)),
        }
    if draw(st.booleans()):
        props["priority"] = draw(st.integers(0, 255))
    if draw(st.booleans()):
        props["message_id"] = draw(st.text(max_size=40))
        props["content_type"] = draw(st.sampled_from(["text/plain", "application/json", "x" * 100]))
    return props


# What a bundle of reports holds (a worker's reports of a bundle's tasks travel to their shard
# as one): well-formed reports of several programs, also in one that came back (split); as
# many as the bound, or one more; none; a member that is no report, or spoilt; its whole body
# spoilt; padded to its size bound, or a byte over it.
BUNDLES = ["mixed"] * 3 + ["returned"] * 2 + ["full", "over", "empty", "alien", "spoilt", "edge"]
ALIENS = ["start", "deadline", "signal", "wake", "task", "value", "bundle"]


def _decodes(body: bytes) -> bool:
    try:
        decode_shard_message(body)
    except messages.MessageError:
        return False
    return True


@st.composite
def reports(draw: st.DrawFn, address: Address, small: bool = False) -> bytes:
    """A `next` or `failed` for `address` that decodes: one that does not spoils its whole
    bundle, which a `spoilt` bundle draws on purpose."""
    for _ in range(3):
        kind = draw(st.sampled_from(["next", "failed"]))
        body = render(draw(shard_bodies(address, kind, small)))
        if _decodes(body):
            return body
    return render({"kind": "next", "wf": address.wf, "path": pick(draw, address.paths)})


@st.composite
def report_bundles(
    draw: st.DrawFn, w: World, first: Address
) -> tuple[str, bytes, dict[str, Any], bool]:
    """A bundle of reports for `first`'s shard, and more programs': its kind, body and AMQP
    properties, and whether it is built not to decode."""
    kind = draw(st.sampled_from(BUNDLES))
    small = kind in ("full", "over", "edge")
    at = [first, *draw(st.lists(addresses(w, shard=first.shard), max_size=3))]
    bodies = [draw(reports(a, small)) for a in at]
    over = kind == "edge" and draw(st.booleans())
    if kind in ("full", "over"):  # the first few again, up to the bound or one more
        bodies = list(itertools.islice(itertools.cycle(bodies), MAX_BUNDLE + (kind == "over")))
    elif kind == "empty":
        bodies = []
    elif kind == "alien":  # a shard message that is no report, or no shard message at all
        a, alien = draw(st.sampled_from(at)), draw(st.sampled_from(ALIENS))
        if alien in ("start", "deadline", "signal"):
            stranger = render(draw(shard_bodies(a, alien)))
        elif alien == "wake":
            stranger = render({"kind": "wake", "wf": a.wf, "path": pick(draw, a.paths)})
        elif alien == "task":
            stranger = render(draw(task_bodies(a)))
        elif alien == "value":
            stranger = render(draw(SMALL))
        else:
            stranger = bundle(bodies)
        bodies.insert(draw(st.integers(0, len(bodies))), stranger)
    elif kind == "spoilt" and draw(st.booleans()):
        # a member spoilt, even a report for a live cursor: the bundle must never decode
        i = draw(st.integers(0, len(bodies) - 1))
        report = draw(st.sampled_from(["next", "failed"]))
        bodies[i] = draw(broken(draw(shard_bodies(anywhere(at[i]), report)), report))
    elif kind == "spoilt":  # the whole body (with a space or a BOM first, it is no bundle)
        whole = bundle(bodies)
        cut = [whole[:-1], whole + b"x", whole[:-1] + b",]", b" " + whole, b"\xef\xbb\xbf" + whole]
        return kind, draw(st.sampled_from(cut)), _dead_letter_props(draw), True
    elif kind == "edge":  # its last report padded to the size bound, or a byte over it
        pad = {"kind": "next", "wf": first.wf, "path": pick(draw, first.paths), "output": ""}
        short = len(bundle([*bodies, render(pad)]))
        pad["output"] = "x" * (MAX_BUNDLE_BODY + over - short)
        bodies.append(render(pad))
    refused = kind in ("over", "empty", "alien", "spoilt") or over
    props = _dead_letter_props(draw) if refused else {}
    if kind == "returned":  # split: each report published again alone, then settled as such
        props = _dead_letter_props(draw, came_back=True)
    return kind, bundle(bodies), props, refused


@st.composite
def shard_messages(draw: st.DrawFn, w: World) -> Hostile:
    address = draw(addresses(w))
    kinds = ["start", "next", "failed", "signal", "deadline"]
    kind = draw(st.sampled_from(kinds))
    via_exchange = draw(st.booleans())
    queue = w.names.shard_queue(address.shard)
    how = draw(st.sampled_from(["wellformed"] * 3 + ["broken"] * 2 + ["garbage"] + ["bundle"] * 2))
    props: dict[str, Any] = {}
    spoilt = how == "broken"
    if how == "garbage":
        body, props = draw(GARBAGE), _dead_letter_props(draw)
    elif how == "broken":
        # anything may be spoiled, even a report for a live cursor: it must never decode
        body = draw(broken(draw(shard_bodies(anywhere(address), kind)), kind))
        props = _dead_letter_props(draw)
    elif how == "bundle":  # several programs' reports in one message, each settled on its own
        kind, body, props, spoilt = draw(report_bundles(w, address))
    else:
        body = render(draw(shard_bodies(address, kind)))
    return Hostile(
        f"{how} {kind} for {address.wf[:40]} on shard {address.shard}",
        queue,
        w.names.orchestrator_exchange if via_exchange else "",
        str(address.shard) if via_exchange else queue,
        body,
        props,
        broken=spoilt,
        shard=address.shard,
    )


@st.composite
def task_messages(draw: st.DrawFn, w: World) -> Hostile:
    address = draw(addresses(w, for_tasks=True))
    queue = w.names.task_queue(draw(st.sampled_from(["serial", "parallel"])))
    how = draw(st.sampled_from(["wellformed"] * 3 + ["broken"] * 2 + ["garbage", "bundle"]))
    props: dict[str, Any] = {}
    if how == "garbage":
        body, props = draw(GARBAGE), _dead_letter_props(draw)
    elif how == "broken":
        body, props = draw(broken(draw(task_bodies(address)), "task")), _dead_letter_props(draw)
    elif how == "bundle":  # several programs' tasks in one message, each settled on its own
        more = draw(st.lists(addresses(w, for_tasks=True), min_size=1, max_size=3))
        body = bundle([render(draw(task_bodies(a))) for a in [address, *more]])
    else:
        body = render(draw(task_bodies(address)))
        if address.known is None:
            props = _dead_letter_props(draw)
    return Hostile(
        f"{how} task for {address.wf[:40]}", queue, "", queue, body, props, how == "broken"
    )


OK_PROGRAM = {"steps": [{"task": "add"}]}
_DEEP_ARGS: dict[str, Any] = {}
for _ in range(100):
    _DEEP_ARGS = {"a": _DEEP_ARGS}
BAD_PROGRAMS = [
    ({"steps": []}, "steps: List should have at least 1 item"),
    ({"steps": [{"task": "no_such_task"}]}, "steps[0].task: unknown task 'no_such_task'"),
    ({"steps": [{"bag": []}]}, "steps[0].bag"),
    ({"steps": [{"bag": [{"task": "add"}], "chunk": 0}]}, "steps[0].chunk"),
    ({"steps": [{"bag": [{"task": "add"}], "chunk": MAX_BAG + 1}]}, "steps[0].chunk"),
    ({"steps": [{"until": "prev.(", "max_iterations": 2, "steps": [OK_PROGRAM["steps"][0]]}]},
     "steps[0].until: invalid CEL"),
    ({"steps": [{"until": "true", "max_iterations": 0, "steps": [{"task": "add"}]}]},
     "steps[0].max_iterations"),
    ({"steps": [{"task": "add", "bag": [{"task": "add"}]}]}, "a step needs exactly one"),
    ({"steps": [{"task": "1add"}]}, "steps[0].task"),
    ({"steps": [{"task": "add", "retry": {"max_attempts": 0}}]}, "max_attempts"),
    ({"steps": [{"task": "add"}], "deadline_s": -1}, "deadline_s"),
    ({"steps": [{"task": "add", "timeout_s": 0}]}, "steps[0].timeout_s"),
    ({"steps": [{"task": "add", "junk": 1}]}, "steps[0].junk: Extra inputs"),
    ({"steps": [{"task": "add", "args": {"x": "y" * 300_000}}]}, "more than the limit"),
    ({"steps": [{"task": "add", "args": _DEEP_ARGS}]}, "nested deeper than 64"),
    ({"steps": [{"task": "add", "pool": "GPU"}]}, "steps[0].pool: 'GPU' is not a pool name"),
    ({"steps": [{"bag": [{"task": "add"}], "pool": "serial"}]}, "steps[0].pool: a bag or map runs"),
    ({"steps": "add"}, "steps: Input should be a valid list"),
    ({}, "steps: Field required"),
]  # fmt: skip
BAD_INPUTS = [
    # The ingress parses the whole request strictly first (a duplicate key is refused too).
    (Raw(b"NaN"), "request: NaN is not JSON"),
    (Raw(b"1e999"), "request: number '1e999' is out of range"),
    (_DEEP_ARGS, "request: nested deeper than 64"),
    (big(300_000), "input: 300002 bytes, more than the limit"),
]


@st.composite
def ingress_messages(draw: st.DrawFn, w: World) -> Hostile:
    """A submit request the router must refuse, or one repeating a recorded program exactly."""
    queue = w.names.ingress_queue
    ghost = draw(ghost_ids(w))
    ways = ["garbage", "shape", "request", "id", "program", "input", "size", "raw", "body"]
    way = draw(st.sampled_from([*ways, "conflict", "existing"]))
    request: dict[str, Any] = {"program": OK_PROGRAM, "workflow_id": ghost}
    if draw(st.booleans()):
        request["input"] = draw(SMALL)
    refusal = ""  # any reason
    if way == "garbage":
        body = draw(GARBAGE)
    elif way == "shape":
        body = render(draw(st.sampled_from([[1], "x", 5, None, True, [request]])))
        refusal = "request: Input should be an object"
    elif way == "request":
        spoil = draw(st.sampled_from(["no program", "extra", "program type", "id type"]))
        if spoil == "no program":
            del request["program"]
            refusal = "program: Field required"
        elif spoil == "extra":
            request["x_" + draw(st.text("abc", max_size=4))] = draw(SMALL)
            refusal = "Extra inputs are not permitted"
        elif spoil == "program type":
            request["program"] = draw(st.sampled_from([[OK_PROGRAM], "x", 5, None, True]))
            refusal = "program: Input should be"
        else:
            request["workflow_id"] = draw(st.sampled_from([5, [], {}, True, 1.5]))
            refusal = "workflow_id: Input should be a valid string"
        body = render(request)
    elif way == "id":
        request["workflow_id"] = draw(
            st.sampled_from([" a", "-a", "a" * 129, "a b", "é", "a\n", "{x}", "a/b"])
        )
        body, refusal = render(request), "id: workflow id"
    elif way == "program":
        request["program"], refusal = draw(st.sampled_from(BAD_PROGRAMS))
        if draw(st.booleans()):
            del request["workflow_id"]  # an id derived from the message: never created either
        body = render(request)
    elif way == "input":
        request["input"], refusal = draw(st.sampled_from(BAD_INPUTS))
        body = render(request)
    elif way == "size":
        request["input"] = big(2 * MAX_PROGRAM + draw(st.integers(1, 1000)))
        body, refusal = render(request), "bytes, over the limit"
    elif way == "raw":
        request[draw(st.sampled_from(["program", "input", "workflow_id"]))] = draw(BROKEN)
        body, refusal = render(request), "request: Invalid JSON"
    elif way == "body":
        whole = render(request)
        body = draw(st.sampled_from([whole[:-1], whole + b"x", b"\xef\xbb\xbf" + whole]))
        refusal = "request: Invalid JSON"
    else:
        target = pick(draw, (*w.good, *w.ended))
        request = {"program": target.program, "input": target.input, "workflow_id": target.wf}
        if way == "conflict":
            if draw(st.booleans()):
                request["input"] = {"other": draw(SMALL)}
            else:
                request["program"] = OK_PROGRAM
            refusal = "exists with another program or input; use a new id"
        body = render(request)
    props = {} if way == "existing" else _dead_letter_props(draw)
    reply_to = draw(
        st.sampled_from(
            [None, f"{w.names.prefix}.nobody", w.names.shard_queue(draw(st.integers(0, 3))),
             w.names.task_queue("parallel"), queue]
        )
    )  # fmt: skip
    if reply_to is not None and way != "existing":  # an answer to the existing is not hostile
        props |= {"reply_to": reply_to, "correlation_id": draw(st.text(max_size=20))}
    return Hostile(
        f"ingress {way}",
        queue,
        "",
        queue,
        body,
        props,
        refusal=None if way == "existing" else refusal,
    )


@st.composite
def control_messages(draw: st.DrawFn, w: World) -> Hostile:
    way = draw(st.sampled_from(["garbage", "cancel", "cancel+", "bad id", "raw", "huge"]))
    if way == "garbage":
        body = draw(GARBAGE)
    elif way == "bad id":
        body = render({"wf": draw(st.sampled_from(BAD["wf"]))})
    elif way == "raw":
        body = render({"wf": draw(BROKEN)})
    elif way == "huge":
        body = render({"wf": big(1 << 20)})
    else:  # cancel a program never submitted, or one that ended (a valid message), or spoilt
        wf = pick(draw, (*[k.wf for k in (*w.good, *w.ended)], draw(ghost_ids(w))))
        body = render({"wf": wf, "x": 1} if way == "cancel+" else {"wf": wf})
    exchange = w.names.control_exchange
    return Hostile("control", "", exchange, draw(st.sampled_from(["", "x"])), body)


def hostile(w: World) -> st.SearchStrategy[Hostile]:
    return st.one_of(
        shard_messages(w), shard_messages(w), task_messages(w), task_messages(w),
        ingress_messages(w), control_messages(w),
    )  # fmt: skip


# --- what must become of each message ------------------------------------------------------


@dataclass(eq=False)
class Expect:
    """A dead letter that must arrive: from `source`, with this body (or, with `reply`, a
    router's answer `{"error": ...}`), and its reason."""

    label: str
    source: str
    body: bytes | None = None
    reason: str | None = None  # exactly this
    reason_has: str = ""  # else a reason containing this
    reply: bool = False

    def fits(self, source: str, body: bytes, parsed: Any) -> bool:
        """Whether a dead letter from `source` with `body` (`parsed`: its JSON, or None) is it."""
        if source != self.source:
            return False
        if self.body is not None:
            return body == self.body
        return self.reply and isinstance(parsed, dict) and set(parsed) == {"error"}

    def reason_fault(self, reason: str) -> str | None:
        if self.reason is not None and reason != self.reason:
            return f"reason {reason!r}, expected {self.reason!r}"
        if self.reason_has not in reason:
            return f"reason {reason!r} does not say {self.reason_has!r}"
        return None


Outcome = list[Expect]  # an empty list: acked, nothing parked


def expect_shard(h: Hostile, w: World) -> Outcome:
    try:
        found = decode_shard_body(h.body)
    except messages.MessageError as exc:
        return [Expect(h.label, h.queue, h.body, reason=describe(exc))]
    assert not h.broken, f"built not to decode, but the decoder accepts it: {h!r}"
    if not isinstance(found, list):
        return _expect_message(h, w, found, h.body)
    # Each of a bundle's reports is parked alone, as it would be had it come alone: so too once
    # the bundle came back, split, each published again alone to the same queue.
    return [e for report in found for e in _expect_message(h, w, report, encode(report))]


def bundle_fate(h: Hostile, outcome: Outcome) -> Counter[str]:
    """What became of a bundle of reports, for the summary: parked whole, or its reports
    parked alone and acked."""
    kind = h.label.split(" for ")[0].removeprefix("bundle ")
    if outcome and outcome[0].body == h.body:
        return Counter({f"{kind} parked whole": 1})
    reports = decode_reports(h.body) or []
    done = {"parked alone": len(outcome), "acked": len(reports) - len(outcome)}
    return Counter({f"{kind} settled": 1} | {f"reports {k}": n for k, n in done.items()})


def _expect_message(h: Hostile, w: World, message: ShardMessage, body: bytes) -> Outcome:
    wf, dead = message.wf, [Expect(h.label, h.queue, body)]
    known = w.known(wf)
    if known is None:
        if message.kind in ("deadline", "wake", "signal"):  # may outlive their program
            return []
        dead[0].reason = f"{wf}: no such program"
        return dead
    if known.owner != h.shard:
        dead[0].reason = f"{wf}: owned by shard {known.owner}, not by shard {h.shard}"
        return dead
    if message.kind in ("start", "signal"):  # a signal hint finds no signal step: kept
        return []
    if message.kind == "deadline":  # only a hint: the program's own deadline decides
        if "deadline_s" not in known.program:
            dead[0].reason = f"{wf}: a deadline, but its program names none"
            return dead
        return []
    path = message.path
    assert known.ended or path not in known.cursors, f"a forged report for a live step: {h!r}"
    step = leaf_of(known.program, path)
    if step is None:
        return dead  # no such leaf
    if message.kind == "next":
        return []
    index, attempt = message.index, message.attempt
    if "bag" in step:
        if index is None or not 0 <= index < len(step["bag"]):
            return dead
        step = step["bag"][index]
    retry = step.get("retry")
    tries = 1 if retry is None else retry.get("max_attempts", 3)
    if attempt >= tries:
        dead[0].reason = f"{wf}: attempt {attempt} of a task tried {tries}x"
        return dead
    return []


def expect_task(h: Hostile, w: World) -> Outcome:
    try:
        tasks = decode_tasks(h.body)
        message = decode_task(h.body) if tasks is None else None
    except messages.MessageError as exc:
        return [Expect(h.label, h.queue, h.body, reason=describe(exc))]
    assert not h.broken, f"built not to decode, but the decoder accepts it: {h!r}"
    if message is not None:
        return _expect_one(h, w, message, h.body)
    assert tasks is not None
    if h.queue == w.names.task_queue("serial"):
        reason = "a bundle of tasks on a lane, which runs one task at a time"
        return [Expect(h.label, h.queue, h.body, reason=reason)]
    # Each of a bundle's tasks is parked alone, as it would be had it come alone.
    return [e for task in tasks for e in _expect_one(h, w, task, encode(task))]


def _expect_one(h: Hostile, w: World, message: TaskMessage, body: bytes) -> Outcome:
    known = w.known(message.wf)
    waited = message.attempt > 0 or (message.limit is not None and message.limit.waits > 0)
    if known is None and waited:  # may outlive their program, as timers do
        return []
    if known is None:
        return [Expect(h.label, h.queue, body, reason=f"{message.wf}: no such program")]
    assert known.ended or message.path not in known.cursors, f"a forged live task: {h!r}"
    return []  # stale: not run


def expect_ingress(h: Hostile) -> Outcome:
    if h.refusal is None:
        return []
    parked = [Expect(h.label, h.queue, h.body, reason_has=h.refusal)]
    reply_to = h.props.get("reply_to")
    names = Names(h.queue.rsplit(".", 1)[0])
    # The answer lands in a queue of ours that cannot read it: parked there too.
    if reply_to in [names.ingress_queue, names.task_queue("parallel")] or (
        str(reply_to).startswith(names.orchestrator_exchange + ".")
    ):
        parked.append(Expect(h.label + " (its answer)", str(reply_to), reply=True))
    return parked


def control_is_valid(h: Hostile) -> bool:
    try:
        Cancelled.model_validate_json(h.body)
    except ValidationError:
        return False
    return True


# --- the cluster ---------------------------------------------------------------------------

PROCESSES = {  # name: (arguments, the log line that says it consumes, how many of them)
    "orch01": (["orchestrator", "--shards", "0,1"], "orchestrator: consuming", 2),
    "orch23": (["orchestrator", "--shards", "2,3"], "orchestrator: consuming", 2),
    "serial": (["worker", "--pool", "serial", "--app", "tests.app"], "consuming", 1),
    "parallel": (["worker", "--pool", "parallel", "--app", "tests.app"], "consuming", 1),
    "router": (["router", "--app", "tests.app"], "router: consuming", 1),
}
WORKERS = ("serial", "parallel")
IGNORED_CONTROL = "ignored a control message"

# Pings Redis every 20 ms on its own connection, in its own process (so nothing the test or the
# services do in Python can delay it), until its stdin closes; prints the slowest answers.
PINGER = """
import json, select, sys, time
import redis
client = redis.Redis.from_url(sys.argv[1], socket_timeout=5)
client.ping()
print("ready", flush=True)
slowest, count, errors = [], 0, 0
while not select.select([sys.stdin], [], [], 0.02)[0]:
    start = time.perf_counter()
    try:
        client.ping()
    except redis.RedisError:
        errors += 1
    slowest = sorted([*slowest, time.perf_counter() - start])[-5:]
    count += 1
print(json.dumps({"count": count, "errors": errors, "slowest": slowest}), flush=True)
"""


class Fleet:
    """The cluster's processes, each logging to its own file."""

    def __init__(self, settings: Settings, logs: Path) -> None:
        self.logs = logs
        self.env = {
            **os.environ,
            "SHARDFLOW_AMQP_URL": settings.amqp_url,
            "SHARDFLOW_REDIS_URL": settings.redis_url,
            "SHARDFLOW_PREFIX": settings.prefix,
            "SHARDFLOW_SHARDS": str(SHARDS),
            "SHARDFLOW_DELIVERY_LIMIT": str(LIMIT),
            "SHARDFLOW_GRACE_S": "2",
            "SHARDFLOW_METRICS_PORT": "0",
        }
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self._counted: dict[tuple[str, str], tuple[int, int]] = {}

    def start(self) -> None:
        for name, (args, _, _) in PROCESSES.items():
            with (self.logs / f"{name}.log").open("wb") as out:
                self.processes[name] = subprocess.Popen(
                    [sys.executable, "-m", "shardflow", *args],
                    cwd=ROOT, env=self.env, stdout=out, stderr=out,
                )  # fmt: skip
        deadline = time.monotonic() + 60
        for name, (_, ready, count) in PROCESSES.items():
            while self.log(name).count(ready) < count:
                assert not self.dead(), self.obituary()
                assert time.monotonic() < deadline, f"{name} never consumed:\n{self.log(name)}"
                time.sleep(0.05)

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def count(self, name: str, text: str) -> int:
        """How often `text` is in a log by now (reading only what was added since last time)."""
        offset, found = self._counted.get((name, text), (0, 0))
        with (self.logs / f"{name}.log").open("rb") as log:
            log.seek(offset)
            added = log.read()
        whole = added.rfind(b"\n") + 1  # whole lines only
        found += added[:whole].count(text.encode())
        self._counted[(name, text)] = (offset + whole, found)
        return found

    def dead(self) -> list[str]:
        return [name for name, p in self.processes.items() if p.poll() is not None]

    def obituary(self) -> str:
        return "\n".join(
            f"{name} exited {self.processes[name].returncode}:\n{self.log(name)[-3000:]}"
            for name in self.dead()
        )

    def stop(self) -> dict[str, int | None]:
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        codes: dict[str, int | None] = {}
        for name, process in self.processes.items():
            try:
                codes[name] = process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                codes[name] = None
        return codes


class Driver:
    """The test's own connections, in an event loop on a thread of its own: publishing,
    submitting, reading Redis, and draining the dead-letter queue all along."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.names = Names(settings.prefix)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.dead: list[tuple[dict[str, Any], bytes]] = []
        self.stack = contextlib.AsyncExitStack()
        self.call(self._open())

    def call(self, coroutine: Coroutine[Any, Any, T], timeout_s: float = 120) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    async def _open(self) -> None:
        self.store, self.bus = await self.stack.enter_async_context(
            connected(self.settings, "test-fuzz")
        )
        self.router = Router(self.settings, store=self.store, bus=self.bus)
        self.connection = connection = await aio_pika.connect(self.settings.amqp_url)
        self.stack.push_async_callback(connection.close)
        channel = await connection.channel(publisher_confirms=True)
        self.exchanges = {"": channel.default_exchange}
        for name in (self.names.orchestrator_exchange, self.names.control_exchange):
            self.exchanges[name] = await channel.get_exchange(name, ensure=False)
        dead = await (await connection.channel()).get_queue(self.names.dead_queue, ensure=True)
        await dead.consume(self._parked)

    async def _parked(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        self.dead.append((dict(message.headers or {}), message.body))
        await message.ack()

    async def publish(self, batch: list[Hostile]) -> None:
        for h in batch:
            message = aio_pika.Message(
                h.body, delivery_mode=aio_pika.DeliveryMode.PERSISTENT, **h.props
            )
            await self.exchanges[h.exchange].publish(message, routing_key=h.routing_key)

    async def ingress(self, request: dict[str, Any]) -> None:
        message = aio_pika.Message(json.dumps(request).encode())
        await self.exchanges[""].publish(message, routing_key=self.names.ingress_queue)

    async def recorded(self, wf: str, timeout_s: float = 30) -> dict[str, str]:
        deadline = time.monotonic() + timeout_s
        while not (state := await self.store.state(wf)):
            assert time.monotonic() < deadline, f"{wf} was never recorded"
            await asyncio.sleep(0.02)
        return state

    async def ready_counts(self, queues: list[str]) -> dict[str, int]:
        counts = {}
        for queue in queues:
            channel = await self.connection.channel()
            declared = await channel.declare_queue(queue, passive=True)
            counts[queue] = declared.declaration_result.message_count or 0
            await channel.close()
        return counts

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.call(self.stack.aclose(), 30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def _steady(value: str) -> Any:
    """A value without what differs between two runs of a program: its owner shard and times
    (`*_ms`), also inside a JSON object."""
    try:
        parsed = json.loads(value)
    except ValueError:
        return value
    if not isinstance(parsed, dict):
        return value
    return {k: v for k, v in parsed.items() if k != "owner" and not k.endswith("_ms")}


def footprint(client: redis.Redis, prefix: str, wf: str, *, exact: bool) -> dict[str, Any]:
    """A program's keys and values; unless `exact`, without what differs between two runs of
    the same program (owner shard, times), and with its id written as {wf}."""
    found: dict[str, Any] = {}
    tag = f"{{{wf}}}"
    for key in client.scan_iter(match=f"{prefix}:{tag}:*", count=1000):
        kind = client.type(key)
        if kind == "string":
            value: Any = client.get(key)
            if not exact:
                value = _steady(value)
        elif kind == "hash":
            value = client.hgetall(key)
            if not exact:
                value = {
                    k: _steady(v)
                    for k, v in value.items()
                    if k != "owner" and not k.endswith("_ms")
                }
        elif kind == "set":
            value = sorted(str(m).replace(tag, "{wf}") for m in client.smembers(key))
        else:
            value = kind
        found[key.split(tag, 1)[1]] = value
    return found


def wait_until(what: str, condition: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# --- the test ------------------------------------------------------------------------------


@dataclass
class Rig:
    fleet: Fleet
    driver: Driver
    pinger: subprocess.Popen[bytes]
    client: redis.Redis

    def pings(self) -> dict[str, Any]:
        """Stop the pinger; what it measured."""
        assert self.pinger.stdin is not None and self.pinger.stdout is not None
        self.pinger.stdin.close()
        return dict(json.loads(self.pinger.stdout.read()))


@pytest.fixture
def rig(settings: Settings, tmp_path: Path) -> Iterator[Rig]:
    settings = settings.model_copy(update={"shards": SHARDS, "delivery_limit": LIMIT})
    with (
        subprocess.Popen(
            [sys.executable, "-c", PINGER, settings.redis_url],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        ) as pinger,
        redis.Redis.from_url(settings.redis_url, decode_responses=True) as client,
    ):
        assert pinger.stdout is not None and pinger.stdout.readline().strip() == b"ready"
        fleet = Fleet(settings, tmp_path)
        try:
            fleet.start()
            driver = Driver(settings)
            try:
                yield Rig(fleet, driver, pinger, client)
            finally:
                driver.close()
        finally:
            fleet.stop()


class Ledger:
    """Dead letters against what must be parked."""

    def __init__(self, driver: Driver) -> None:
        self.driver = driver
        self.open: list[Expect] = []
        self.acked: dict[tuple[str, bytes], str] = {}
        self.seen = 0
        self.matched = 0

    def take(self) -> list[str]:
        """Match the dead letters that came since; the problems found."""
        problems = []
        while self.seen < len(self.driver.dead):
            headers, body = self.driver.dead[self.seen]
            self.seen += 1
            reason, source = headers.get("x-shardflow-reason"), headers.get("x-shardflow-from")
            shown = f"from {source}, reason {reason!r}: {body[:300]!r} ({len(body)} bytes)"
            if not isinstance(reason, str) or not reason:
                problems.append(f"a dead letter without a reason {shown}")
                continue
            try:
                parsed = json.loads(body) if len(body) < 1 << 20 else None
            except ValueError:
                parsed = None
            match = next((e for e in self.open if e.fits(str(source), body, parsed)), None)
            if match is None:
                acked = self.acked.get((str(source), body))
                why = f" (it should have been acked: {acked})" if acked else ""
                problems.append(f"an unexpected dead letter {shown}{why}")
                continue
            self.open.remove(match)
            self.matched += 1
            fault = match.reason_fault(reason)
            if fault:
                problems.append(f"{match.label}: {fault}: {body[:300]!r}")
        return problems


def test_drawn_hostile_messages_change_nothing_and_are_parked_with_a_reason(
    rig: Rig, settings: Settings
) -> None:
    cluster, driver, client = rig.fleet, rig.driver, rig.client
    started = time.monotonic()
    names, prefix = driver.names, settings.prefix

    # Programs that end before the attack, and one twin of each good shape that nobody attacks.
    router = driver.router
    ended: list[Known] = []
    for wf, program in ENDED.items():
        submitted = driver.call(router.submit(program, INPUT, wf))
        if wf == "ended-cancelled":
            driver.call(router.cancel(wf, "ended before the attack"))
        assert driver.call(router.wait(wf, 30))["status"] in TERMINAL
        ended.append(Known.of(wf, program, INPUT, submitted.shard, ended=True))
    before = {k.wf: footprint(client, prefix, k.wf, exact=True) for k in ended}
    twins = {name: f"twin-{name}" for name in SHAPES}
    for name, wf in twins.items():
        driver.call(router.submit(SHAPES[name].program, INPUT, wf))

    # Good programs keep coming while the attack goes on (one more every few batches), through
    # the router and the ingress. Not from a task of their own: publishing draws message ids
    # from `random`, which hypothesis must not see change while it draws.
    good: list[Known] = []
    shapes: dict[str, str] = {}

    async def submit_good() -> None:
        i = len(good)
        name = list(SHAPES)[i % len(SHAPES)]
        wf, program = f"good-{name}-{i}", SHAPES[name].program
        if i % 2:
            await driver.ingress({"program": program, "input": INPUT, "workflow_id": wf})
            owner = int((await driver.recorded(wf))["owner"])
        else:
            owner = (await router.submit(program, INPUT, wf)).shard
        shapes[wf] = name
        good.append(Known.of(wf, program, INPUT, owner, ended=False))

    for _ in range(2):
        driver.call(submit_good())

    ledger = Ledger(driver)
    published: Counter[str] = Counter()
    bundled: Counter[str] = Counter()  # what became of the bundles of reports
    bad_control = 0
    examples = itertools.count()

    def ignored_control() -> dict[str, int]:
        return {name: cluster.count(name, IGNORED_CONTROL) for name in WORKERS}

    @hypothesis_settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        phases=[Phase.generate],  # a cluster does not replay: each run sees a new world
        suppress_health_check=list(HealthCheck),
    )
    @given(st.data())
    def attack(data: st.DataObject) -> None:
        nonlocal bad_control
        world = World(next(examples), names, tuple(good), tuple(ended))
        batch = data.draw(st.lists(hostile(world), min_size=2, max_size=10), label="batch")
        expected: list[Expect] = []
        for h in batch:
            if h.exchange == names.control_exchange:
                bad_control += not control_is_valid(h)
                outcome: Outcome = []
            elif h.queue == names.ingress_queue:
                outcome = expect_ingress(h)
            elif h.shard >= 0:
                outcome = expect_shard(h, world)
                if h.label.startswith("bundle "):
                    bundled.update(bundle_fate(h, outcome))
            else:
                outcome = expect_task(h, world)
            expected += outcome
            if not outcome and h.queue:
                ledger.acked[(h.queue, h.body)] = h.label
            published[h.label.split(" for ")[0]] += 1
        ledger.open += expected
        if world.n % max(1, EXAMPLES // MAX_GOOD) == 0 and len(good) < MAX_GOOD:
            driver.call(submit_good())  # spread over the whole attack
        driver.call(driver.publish(batch))
        deadline = time.monotonic() + 60
        while True:
            problems = ledger.take()
            assert not problems, "\n".join(problems)
            assert not cluster.dead(), cluster.obituary()
            waiting = [e for e in expected if e in ledger.open]
            counts = ignored_control()
            if not waiting and all(c >= bad_control for c in counts.values()):
                break
            assert time.monotonic() < deadline, (
                f"never dead-lettered: {[e.label for e in waiting]}; control warnings "
                f"{counts}, expected {bad_control} each"
            )
            time.sleep(0.02)
        assert all(c == bad_control for c in counts.values()), (counts, bad_control)

    attack()

    # Every good program (and its twin) completed with its exact result.
    for known in good:
        status = driver.call(router.wait(known.wf, 60))
        assert (status["status"], status["error"]) == ("completed", None), status
        assert status["result"] == SHAPES[shapes[known.wf]].result, status
    for name, wf in twins.items():
        assert driver.call(router.wait(wf, 60))["result"] == SHAPES[name].result

    # Nothing left in any queue attacked, and nothing more parked than the ledger explains.
    queues = [names.shard_queue(s) for s in range(SHARDS)] + [names.ingress_queue]
    queues += [names.task_queue(pool) for pool in ("serial", "parallel")]
    wait_until(
        "empty queues", lambda: not any(driver.call(driver.ready_counts(queues)).values()), 60
    )
    time.sleep(1.0)  # anything still being handled is parked or acked by now
    assert not any(driver.call(driver.ready_counts(queues)).values())
    problems = ledger.take()
    assert not problems, "\n".join(problems)
    assert not ledger.open, [e.label for e in ledger.open]
    assert all(c == bad_control for c in ignored_control().values())

    # Redis: a good program's keys and values are its twin's; ended programs are untouched;
    # no key of a program never submitted; only programs submitted are counted in flight.
    for known in good:
        twin = twins[shapes[known.wf]]
        theirs = footprint(client, prefix, twin, exact=False)
        assert footprint(client, prefix, known.wf, exact=False) == theirs, known.wf
    for k in ended:
        assert footprint(client, prefix, k.wf, exact=True) == before[k.wf], k.wf
    ours = {k.wf for k in (*good, *ended)} | set(twins.values())
    tags = {
        key.split("{", 1)[1].split("}", 1)[0]
        for key in client.scan_iter(match=f"{prefix}:{{*", count=1000)
    }
    assert tags <= ours, sorted(tags - ours)[:10]
    for shard in range(SHARDS):
        live = set(client.smembers(f"{prefix}:live:{shard}"))
        assert live <= ours, sorted(live - ours)[:10]

    # Redis answered every PING within the bound, and no process died.
    pings = rig.pings()
    assert not cluster.dead(), cluster.obituary()
    codes = cluster.stop()
    print(
        f"\nhostile fuzz: {EXAMPLES} batches, published {sum(published.values())} "
        f"({dict(sorted(published.items()))}), dead-lettered {ledger.matched} as expected, "
        f"{len(ledger.acked)} acked, report bundles {dict(sorted(bundled.items()))}, "
        f"{bad_control} bad control messages ignored, good programs "
        f"{len(good)} + twins {len(twins)}, PING slowest {max(pings['slowest']) * 1000:.1f} ms "
        f"of {pings['count']}, {time.monotonic() - started:.0f} s"
    )
    assert pings["errors"] == 0 and max(pings["slowest"]) < PING_BOUND_S, pings
    assert codes == dict.fromkeys(PROCESSES, 0), {n: cluster.log(n)[-2000:] for n in codes}
