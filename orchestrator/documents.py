"""Strict JSON documents: a program's text, an input, an ingress request.

Stricter than Python's json module, because whatever arrives is untrusted: no duplicate keys,
NaN or infinities, no lone surrogates, nesting bounded by MAX_DEPTH, size bounded by the
caller. Every fault is a ProgramError whose message names the document and the fault.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from typing import Any

# A key of a refused document named in its reason as it is up to this long (else cut, quoted).
MAX_KEY_SHOWN = 100

# Deepest nesting of arrays and objects in a program's JSON, and in an input. A task inside
# ten nested untiloops has its args at level 24; deeper documents mostly serve to exhaust a
# parser's stack (RecursionError).
MAX_DEPTH = 64


class ProgramError(ValueError):
    """An invalid program or input; `str()` is one line per fault, each naming its path."""

    def __init__(self, faults: list[str]) -> None:
        self.faults = faults
        super().__init__("; ".join(faults))


def parse_input(text: str | bytes, *, max_bytes: int = 256 * 1024) -> Any:
    """Parse a program's input (any JSON value), as strictly as a program's JSON."""
    return load(text, "input", max_bytes)


def parse_document(text: str | bytes, *, what: str, max_bytes: int) -> Any:
    """Parse any JSON text as strictly as a program: `what` names it in the errors."""
    return load(text, what, max_bytes)


def check_input(value: Any, *, max_bytes: int = 256 * 1024) -> None:
    """Refuse an input given as a value (the Python API, the ingress) that JSON text could not
    carry: NaN, lone surrogates, more than MAX_DEPTH levels, more than `max_bytes`."""
    check_value(value, "input", max_bytes)


def check_numbers(text: bytes, what: str) -> None:
    """Refuse JSON text holding a number JSON cannot carry: NaN, an infinity, one out of a
    double's range (1e400), an integer of more digits than Python converts. Nothing else: for
    text whose every other rule another parser checks (the queues' messages, whose values
    are nested a level or two below a user's, so MAX_DEPTH is not theirs)."""
    try:
        json.loads(text, parse_constant=_no_constant, parse_float=_finite_float, parse_int=_integer)
    except RecursionError:  # the C parser recurses once per level, to about 1,000
        raise ProgramError([f"{what}: nested too deep to read"]) from None
    except _NotAllowed as exc:
        raise ProgramError([f"{what}: {exc}"]) from None
    except ValueError as exc:  # not JSON, or bytes that are not UTF-8
        raise ProgramError([f"{what}: not JSON: {exc}"]) from None


class _NotAllowed(ValueError):
    """Valid for Python's json module, refused here (its message names the fault)."""


def load(text: str | bytes, what: str, max_bytes: int) -> Any:
    """Strict JSON: no duplicate keys, NaN or infinities, no lone surrogates, bounded depth."""
    try:
        data = text.encode() if isinstance(text, str) else text
    except UnicodeEncodeError as exc:
        raise ProgramError([f"{what}: not UTF-8 text: {unicode_fault(exc)}"]) from None
    if len(data) > max_bytes:
        raise ProgramError([f"{what}: {len(data)} bytes, more than the limit of {max_bytes}"])
    try:
        value = json.loads(
            data,
            object_pairs_hook=_unique_keys,
            parse_constant=_no_constant,
            parse_float=_finite_float,
            parse_int=_integer,
        )
    except RecursionError:  # the C parser recurses once per level
        raise ProgramError([f"{what}: nested deeper than {MAX_DEPTH} levels"]) from None
    except _NotAllowed as exc:
        raise ProgramError([f"{what}: {exc}"]) from None
    except ValueError as exc:  # not JSON, or bytes that are not UTF-8
        raise ProgramError([f"{what}: not JSON: {exc}"]) from None
    check_value(value, what, None)  # its size was the text's
    return value


def check_value(value: Any, what: str, max_bytes: int | None) -> None:
    """Refuse what JSON text cannot carry, or what is too deep or too large."""
    if deeper_than(value, MAX_DEPTH):
        raise ProgramError([f"{what}: nested deeper than {MAX_DEPTH} levels"])
    try:
        size = len(json.dumps(value, ensure_ascii=False, allow_nan=False).encode())
    except UnicodeEncodeError as exc:  # a lone surrogate, e.g. from a "\udcff" escape
        raise ProgramError([f"{what}: not UTF-8 text: {unicode_fault(exc)}"]) from None
    except ValueError:
        raise ProgramError([f"{what}: NaN and infinities are not JSON"]) from None
    except TypeError as exc:  # a set, bytes, an object...
        raise ProgramError([f"{what}: not JSON: {exc}"]) from None
    if max_bytes is not None and size > max_bytes:
        raise ProgramError([f"{what}: {size} bytes, more than the limit of {max_bytes}"])


def deeper_than(value: Any, limit: int) -> bool:
    """Whether `value` nests arrays and objects more than `limit` levels deep. Iterative, and
    stops at the limit: safe on any depth, even on a cycle."""
    stack = [(value, 1)] if isinstance(value, dict | list | tuple) else []
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        stack.extend(
            (child, depth + 1) for child in children if isinstance(child, dict | list | tuple)
        )
    return False


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    value = dict(pairs)
    if len(value) != len(pairs):
        key = next(key for key, count in Counter(key for key, _ in pairs).items() if count > 1)
        raise _NotAllowed(f"duplicate key {short(key)}")
    return value


def _no_constant(name: str) -> Any:
    raise _NotAllowed(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):
        raise _NotAllowed(f"number {short(text)} is out of range")
    return number


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:  # more digits than sys.get_int_max_str_digits()
        raise _NotAllowed(f"number {short(text)} has too many digits") from None


def short(text: str) -> str:
    return repr(text) if len(text) <= 40 else f"{text[:40]!r}…"


def printable(text: str) -> str:
    """`text` as one line a log or a terminal takes as text: what is not printable (control
    characters, C1 ones too, line and paragraph separators, bidi overrides and isolates)
    escaped as repr() escapes it, the rest as it is."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def key_name(key: str) -> str:
    """A key of an untrusted document, for a reason: as it is when printable and not long
    (`steps`, `args_from`, a user's argument name), else quoted as repr() shows it, cut."""
    return key if key.isprintable() and len(key) <= MAX_KEY_SHOWN else short(key)


def unicode_fault(exc: UnicodeEncodeError) -> str:
    """What a UTF-8 encode refused: the lone surrogate, quoted."""
    return f"a lone surrogate {exc.object[exc.start : exc.end]!r}"
