"""Every CEL function a condition may call works, in the form it is offered, and gives the
right answer; the forms the library lacks are refused when the program is validated."""

from typing import Any

import pytest

from orchestrator import conditions
from orchestrator.conditions import ConditionError, compile_condition, evaluate

AT = "2024-03-05T06:07:08.009Z"  # a Tuesday, the 65th day of a leap year
T = "timestamp(prev.at)"
D = 'duration("3723s")'  # 1 h 2 min 3 s; its accessors give totals (62 min), as cel-go does
DUE = {"done_at": AT, "due": "2024-01-01T00:00:00Z"}

# (function, condition, prev, expected): each function once where it holds, once where not.
CASES: list[tuple[str, str, Any, bool]] = [
    ("size", "size(prev.items) == 2 && prev.items.size() == 2", {"items": [1, 2]}, True),
    ("size", 'size(prev.name) > 3 || size({"a": 1}) != 1', {"name": "abc"}, False),
    ("contains", 'prev.message.contains("ready")', {"message": "job is ready"}, True),
    ("contains", 'prev.message.contains("ready")', {"message": "job is queued"}, False),
    ("startsWith", 'prev.url.startsWith("https://")', {"url": "https://example.org"}, True),
    ("startsWith", 'prev.url.startsWith("https://")', {"url": "http://example.org"}, False),
    ("endsWith", 'prev.file.endsWith(".png")', {"file": "a/b/thumb.png"}, True),
    ("endsWith", 'prev.file.endsWith(".png")', {"file": "a/b/thumb.jpg"}, False),
    ("matches", r'prev.version.matches("^v[0-9]+\\.[0-9]+$")', {"version": "v2.13"}, True),
    ("matches", r'prev.version.matches("^v[0-9]+\\.[0-9]+$")', {"version": "v2.13-rc"}, False),
    ("int", "int(prev.count) >= 3 && int(2.9) == 2", {"count": "3"}, True),
    ("int", "int(prev.count) >= 3", {"count": "2"}, False),
    ("uint", "uint(prev.n) == 7u", {"n": 7}, True),
    ("uint", 'uint("8") == 7u', None, False),
    ("double", "double(prev.ratio) > 0.5 && double(1) == 1.0", {"ratio": "0.75"}, True),
    ("double", "double(prev.ratio) > 0.5", {"ratio": "0.25"}, False),
    ("string", 'string(prev.code) == "200" && string(b"ok") == "ok"', {"code": 200}, True),
    ("string", 'string(prev.code) == "200"', {"code": 404}, False),
    ("bytes", 'bytes(prev.token) == b"ab"', {"token": "ab"}, True),
    ("bytes", 'bytes(prev.token) == b"ab"', {"token": "ba"}, False),
    ("type", "type(prev) == map && type(prev.items) == list", {"items": []}, True),
    ("type", "type(prev.items) == string", {"items": []}, False),
    ("dyn", "dyn(prev.n) == 7", {"n": 7}, True),
    ("dyn", "dyn(prev.n) == 7", {"n": 8}, False),
    ("duration", 'duration(prev.elapsed) > duration("1m30s")', {"elapsed": "95s"}, True),
    ("duration", 'duration(prev.elapsed) > duration("1m30s")', {"elapsed": "85s"}, False),
    ("timestamp", "timestamp(prev.done_at) > timestamp(prev.due)", DUE, True),
    ("timestamp", "timestamp(prev.done_at) < timestamp(prev.due)", DUE, False),
    ("getFullYear", f"{T}.getFullYear() == 2024", {"at": AT}, True),
    ("getFullYear", f"{T}.getFullYear() == 2023", {"at": AT}, False),
    ("getMonth", f"{T}.getMonth() == 2", {"at": AT}, True),  # from 0: March
    ("getMonth", f"{T}.getMonth() == 3", {"at": AT}, False),
    ("getDate", f"{T}.getDate() == 5", {"at": AT}, True),  # from 1
    ("getDate", f"{T}.getDate() == 4", {"at": AT}, False),
    ("getDayOfMonth", f"{T}.getDayOfMonth() == 4", {"at": AT}, True),  # from 0
    ("getDayOfMonth", f"{T}.getDayOfMonth() == 5", {"at": AT}, False),
    ("getDayOfWeek", f"{T}.getDayOfWeek() == 2", {"at": AT}, True),  # Sunday 0
    ("getDayOfWeek", f"{T}.getDayOfWeek() == 1", {"at": AT}, False),
    ("getDayOfYear", f"{T}.getDayOfYear() == 64", {"at": AT}, True),  # from 0
    ("getDayOfYear", f"{T}.getDayOfYear() == 65", {"at": AT}, False),
    ("getHours", f"{T}.getHours() == 6 && {D}.getHours() == 1", {"at": AT}, True),
    ("getHours", f"{T}.getHours() == 7", {"at": AT}, False),
    ("getMinutes", f"{T}.getMinutes() == 7 && {D}.getMinutes() == 62", {"at": AT}, True),
    ("getMinutes", f"{T}.getMinutes() == 8", {"at": AT}, False),
    ("getSeconds", f"{T}.getSeconds() == 8 && {D}.getSeconds() == 3723", {"at": AT}, True),
    ("getSeconds", f"{T}.getSeconds() == 9", {"at": AT}, False),
    (
        "getMilliseconds",
        f"{T}.getMilliseconds() == 9 && {D}.getMilliseconds() == 3723000",
        {"at": AT},
        True,
    ),
    ("getMilliseconds", f"{T}.getMilliseconds() == 10", {"at": AT}, False),
]


@pytest.mark.parametrize(("function", "source", "prev", "expected"), CASES)
def test_each_offered_function_gives_the_right_answer(
    function: str, source: str, prev: Any, expected: bool
) -> None:
    assert function in compile_condition(source).functions()
    assert evaluate(source, input=None, prev=prev, iteration=0) is expected


def test_every_offered_function_is_tested_above() -> None:
    assert {function for function, *_ in CASES} == conditions._FUNCTIONS


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("has(prev.ready) && !has(prev.missing)", True),
        ("prev.items.all(x, x > 0) && prev.items.exists(x, x > 2)", True),
        ("prev.items.exists_one(x, x == 2)", True),
        ("prev.items.filter(x, x > 1).map(x, x * 10) == [20, 30]", True),
        ("prev.items.all(x, x > 1)", False),
    ],
)
def test_macros_work(source: str, expected: bool) -> None:
    prev = {"ready": True, "items": [1, 2, 3]}
    assert evaluate(source, input=None, prev=prev, iteration=0) is expected


@pytest.mark.parametrize(
    ("source", "error"),
    [
        ('bool("true")', "unknown function 'bool'"),  # not implemented by the library
        ('matches(prev, "a")', r"matches\(\) is a method: write x\.matches\(\.\.\.\)"),
        ('contains(prev, "a")', r"contains\(\) is a method"),
        ('prev.startsWith ("a") && startsWith(prev, "a")', r"startsWith\(\) is a method"),
        ("prev.int() == 1", r"int\(\) is a function: write int\(x\)"),
        ('"1s".duration() > duration("0s")', r"duration\(\) is a function"),
        ('timestamp(prev).getHours("Europe/Paris") == 1', r"getHours\(\) takes no time zone"),
        ("min([1, 2]) == 1", "unknown function 'min'"),
    ],
)
def test_forms_the_library_lacks_are_refused_at_compile_time(source: str, error: str) -> None:
    with pytest.raises(ConditionError, match=error):
        compile_condition(source)
