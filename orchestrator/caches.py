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
# Bytes of the JSON text the kept programs were parsed from (parsed, a few times that).
MAX_PROGRAM_BYTES = 8 << 20

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
        # By the text's digest: what its text reads back as (when exact), and what was made.
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
        self._programs.put(key, (json.loads(text) if exact else None, parsed), len(text))
        return parsed

    def _made(self, source: Any) -> T:
        made = self._make(source)
        self.made += 1
        return made


class Lru(Generic[K, T]):
    """The values used last, at most `size` of them and `max_bytes` of their costs (the one
    put last is kept whatever its cost)."""

    def __init__(self, size: int, max_bytes: int) -> None:
        self._size = size
        self._max_bytes = max_bytes
        self._values: OrderedDict[K, tuple[T, int]] = OrderedDict()
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
        self.bytes += cost
        while len(self._values) > 1 and (
            len(self._values) > self._size or self.bytes > self._max_bytes
        ):
            self.bytes -= self._values.popitem(last=False)[1][1]

    def pop(self, key: K) -> None:
        found = self._values.pop(key, None)
        if found is not None:
            self.bytes -= found[1]


def _text(source: Any) -> bytes:
    if isinstance(source, bytes):
        return source
    return (source if isinstance(source, str) else json.dumps(source)).encode()
