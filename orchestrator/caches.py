"""Bounded caches: the values used last, bounded in count and in bytes (`Lru`), and what is
made of a JSON value once per distinct text of it (`ByText`: a parsed program, by the owner
and the router alike)."""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Generic, TypeVar

# Distinct programs kept parsed (deployments run tens of kinds). A constant, not a setting:
# each may be up to a program's limit, which MAX_PROGRAM_BYTES bounds in all.
MAX_PROGRAMS = 256
# What the kept programs hold parsed, by `json_bytes` (their text was counted before: a parse
# holds 12-40 times its text, so 8 MiB of text could hold 300 MB).
MAX_PROGRAM_BYTES = 32 << 20
# What a JSON value holds once read (`json_bytes`), besides its text: each object or array
# (a dict 200-250 bytes, a list 56 and more), each item (a comma: a number or a short string
# in a list takes 35-80), each key (a colon: its string and the dict's slot). A parsed program
# (`program_bytes`) holds a pydantic model for each object too: about 4 KB whatever its size,
# and 500-1,200 bytes a step. 1-4 times what tracemalloc measures (tests/test_plans.py); a
# program whose args hold many objects, up to 5.
VALUE_BYTES = 128
OBJECT_BYTES = 200
ITEM_BYTES = 72
KEY_BYTES = 120
PROGRAM_BYTES = 4096
MODEL_BYTES = 500

K = TypeVar("K")
T = TypeVar("T")


class ByText(Generic[T]):
    """`make(source)` once per distinct JSON text of `source` (a value, or the text itself),
    the MAX_PROGRAMS used last kept: for what is made of a program, by the owner and the
    router alike. The text, not a normal form: key order inside `args` is the user's, and a
    handler sees it. `exact`: sources may be a caller's values, which `json` may write as the
    text of another (an int key as a string, a tuple as a list): a hit must also equal the
    value its text reads back as, else it is made anew (and `make` names the fault)."""

    def __init__(self, make: Callable[[Any], T], *, exact: bool = False) -> None:
        self._make = make
        self._exact = exact
        # By the text's digest: what its text reads back as (when exact), and what was made,
        # charged what a program parsed from it holds.
        self._programs: Lru[bytes, tuple[Any, T]] = Lru(MAX_PROGRAMS, MAX_PROGRAM_BYTES)
        self.made = 0

    def __len__(self) -> int:
        return len(self._programs)

    def get(self, source: Any) -> T:
        try:  # a tenth of a parse's cost (bench/README); a digest keeps the table small
            text = _text(source)
            key = hashlib.blake2b(text, digest_size=32).digest()
        except (RecursionError, TypeError, ValueError):  # not JSON: `make` names the fault
            return self._made(source)
        exact = self._exact and not isinstance(source, str | bytes)
        found = self._programs.get(key)
        if found is not None and (not exact or found[0] == source):
            return found[1]
        parsed = self._made(source)
        # What was made holds a program parsed; an exact one also holds the value read back.
        cost = program_bytes(text) + (json_bytes(text) if exact else 0)
        self._programs.put(key, (json.loads(text) if exact else None, parsed), cost)
        return parsed

    def _made(self, source: Any) -> T:
        made = self._make(source)
        self.made += 1
        return made


class Lru(Generic[K, T]):
    """The values used last, at most `size` of them and `max_bytes` of their costs (the one
    put last is kept whatever its cost). `shared(value)`: a part of it that values may share
    and what that part holds, charged once while any value kept holds it (a parsed program
    that the plans of one program text share)."""

    def __init__(
        self,
        size: int,
        max_bytes: int,
        shared: Callable[[T], tuple[object, int]] | None = None,
    ) -> None:
        self._size = size
        self._max_bytes = max_bytes
        self._shared = shared
        self._values: OrderedDict[K, tuple[T, int]] = OrderedDict()
        self._holders: dict[int, int] = {}  # id of a shared part: values kept that hold it
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._values)

    def get(self, key: K) -> T | None:
        found = self._values.get(key)
        if found is None:
            return None
        self._values.move_to_end(key)
        return found[0]

    def put(self, key: K, value: T, cost: int) -> None:
        self.pop(key)
        self._values[key] = (value, cost)
        self.bytes += cost + self._hold(value)
        while len(self._values) > 1 and (
            len(self._values) > self._size or self.bytes > self._max_bytes
        ):
            old, old_cost = self._values.popitem(last=False)[1]
            self.bytes -= old_cost + self._release(old)

    def pop(self, key: K) -> None:
        found = self._values.pop(key, None)
        if found is not None:
            self.bytes -= found[1] + self._release(found[0])

    def _hold(self, value: T) -> int:
        """What holding `value`'s shared part adds: its cost when no value kept held it."""
        if self._shared is None:
            return 0
        part, cost = self._shared(value)
        held = self._holders.get(id(part), 0)  # a part held is alive: its id is its own
        self._holders[id(part)] = held + 1
        return 0 if held else cost

    def _release(self, value: T) -> int:
        """What letting go of `value` frees of its shared part: its cost when it held it last."""
        if self._shared is None:
            return 0
        part, cost = self._shared(value)
        left = self._holders[id(part)] - 1
        if left:
            self._holders[id(part)] = left
            return 0
        del self._holders[id(part)]
        return cost


def json_bytes(text: bytes) -> int:
    """About what a JSON text holds once read, in bytes: its text, each object and array, each
    item and key. 1-4 times what tracemalloc measures (tests/test_plans.py); a brace, a comma
    or a colon inside a string is counted too, which only ever counts more."""
    objects = text.count(b"{") + text.count(b"[")
    return (
        VALUE_BYTES
        + len(text)
        + OBJECT_BYTES * objects
        + ITEM_BYTES * text.count(b",")
        + KEY_BYTES * text.count(b":")
    )


def program_bytes(text: bytes) -> int:
    """About what a program parsed from this JSON text holds: its value's and its models'
    (an object in `args` is counted as one too, which only ever counts more)."""
    return PROGRAM_BYTES + json_bytes(text) + MODEL_BYTES * text.count(b"{")


def _text(source: Any) -> bytes:
    if isinstance(source, bytes):
        return source
    return (source if isinstance(source, str) else json.dumps(source)).encode()
