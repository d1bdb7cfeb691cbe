"""`until` conditions are CEL, evaluated over input, prev and iteration."""

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from orchestrator import conditions, evaluator
from orchestrator.conditions import (
    ConditionError,
    compile_condition,
    evaluate,
    evaluate_async,
    quote,
)


def test_conditions_see_input_prev_and_iteration() -> None:
    assert evaluate("prev.ready == true", input=None, prev={"ready": True}, iteration=0)
    assert not evaluate("prev.ready == true", input=None, prev={"ready": False}, iteration=0)
    assert evaluate("iteration >= input.rounds", input={"rounds": 2}, prev=None, iteration=2)
    assert evaluate("prev.all(x, x > 1)", input=None, prev=[2, 3], iteration=0)
    assert not evaluate("size(prev) > 2", input=None, prev=[1, 2], iteration=0)


def test_a_condition_must_give_a_bool() -> None:
    with pytest.raises(ConditionError, match="gave int 3, not a bool"):
        evaluate("prev + 1", input=None, prev=2, iteration=0)


def test_runtime_errors_are_condition_errors() -> None:
    with pytest.raises(ConditionError, match="No such overload"):
        evaluate("prev.x == 1", input=None, prev=None, iteration=0)


def test_unknown_variables_and_bad_syntax_are_refused_at_compile_time() -> None:
    with pytest.raises(ConditionError, match="unknown variable 'count'"):
        compile_condition("count > 2")
    with pytest.raises(ConditionError, match="Syntax error"):
        compile_condition("prev ==")


def test_python_is_not_evaluated() -> None:
    with pytest.raises(ConditionError, match="unknown function '__import__', 'system'"):
        compile_condition("__import__('os').system('true')")


def test_standard_functions_macros_and_type_names_are_allowed() -> None:
    source = 'has(prev.x) && prev.x.startsWith("a") && type(prev.y) == list'
    assert evaluate(source, input=None, prev={"x": "ab", "y": [1]}, iteration=0)
    assert evaluate(
        "prev.filter(v, v > 1).map(w, w * 2) == [4]", input=None, prev=[1, 2], iteration=0
    )


# --- Bounds: size at validation, time at evaluation -------------------------------------------

RUNAWAY = "prev.all(a, prev.all(b, prev.all(c, a + b + c >= 0)))"  # n^3: ~10 s over 300 items


def test_long_and_deeply_nested_conditions_are_refused_naming_the_limit() -> None:
    with pytest.raises(ConditionError, match=r"^1001 characters, more than the limit of 1000$"):
        compile_condition("prev == 1" + " " * 992)
    with pytest.raises(ConditionError, match=r"^brackets nested deeper than 32 levels$"):
        compile_condition("(" * 33 + "true" + ")" * 33)
    assert compile_condition("[" * 32 + "1" + "]" * 32 + " != []")
    with pytest.raises(ConditionError, match=r"comprehensions \(all, exists, exists_one, map"):
        compile_condition("prev.all(a, a.all(b, b.all(c, c.exists(d, d > 0))))")
    assert compile_condition("prev.all(a, a.all(b, b.all(c, c > 0)))")
    with pytest.raises(ConditionError, match="comprehensions"):  # a comment hides nothing
        compile_condition("prev.all // a\n (a, a.all(b, b.all(c, c.exists(d, d > 0))))")


def test_brackets_in_strings_and_comments_do_not_count_as_nesting() -> None:
    for quoted in ['"((((((("', "'[[[[[['", '"""((((\n(((("""', 'r"\\((((((("', 'b"{{{{{{{"']:
        strings = " + ".join([quoted] * 6)
        source = f"prev == {strings} // ((((((((((((((((((((((((((((((((((((\n || true"
        assert compile_condition(source), source


def test_names_bound_by_comprehensions_are_found_outside_strings_only() -> None:
    assert evaluate("prev.exists(item, item.ok)", input=None, prev=[{"ok": True}], iteration=0)
    with pytest.raises(ConditionError, match="unknown variable 'y'"):
        compile_condition('prev == "x.all(y, true)" || y')


def test_a_runaway_condition_fails_within_its_budget_and_the_evaluator_comes_back() -> None:
    started = time.monotonic()
    with pytest.raises(ConditionError, match=r"^exceeded its time budget of 0\.1 s$"):
        evaluate(RUNAWAY, input=None, prev=list(range(300)), iteration=0)
    assert time.monotonic() - started < 2  # was ~10 s, on the caller's thread
    assert evaluate("prev.ready", input=None, prev={"ready": True}, iteration=0)


def test_a_runaway_is_killed_not_left_burning_cpu() -> None:
    evaluate("true", input=None, prev=None, iteration=0)
    process = evaluator.EVALUATOR._process
    assert process is not None
    with pytest.raises(ConditionError, match="exceeded its time budget"):
        evaluate(RUNAWAY, input=None, prev=list(range(300)), iteration=0)
    assert process.returncode == -signal.SIGKILL
    with pytest.raises(ProcessLookupError):
        os.kill(process.pid, 0)  # gone and reaped


async def test_an_event_loop_keeps_serving_while_a_condition_runs() -> None:
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.005)
            ticks += 1

    await evaluate_async("true", input=None, prev=None, iteration=0)  # evaluator started
    running = asyncio.create_task(ticker())
    try:
        started = time.monotonic()
        with pytest.raises(ConditionError, match=r"exceeded its time budget of 0\.1 s"):
            await evaluate_async(RUNAWAY, input=None, prev=list(range(300)), iteration=0)
        assert time.monotonic() - started < 2
        assert ticks >= 5  # in-process evaluation holds the GIL: the loop would see none
    finally:
        running.cancel()
    assert await evaluate_async("iteration >= 2", input=None, prev=None, iteration=3)


def test_the_budget_is_an_argument_and_a_module_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    slow = "prev.all(a, prev.all(b, a + b >= 0))"  # ~40 ms over 400 items
    assert evaluate(slow, input=None, prev=list(range(400)), iteration=0, budget_s=10)
    with pytest.raises(ConditionError, match=r"exceeded its time budget of 0\.001 s"):
        evaluate(slow, input=None, prev=list(range(400)), iteration=0, budget_s=0.001)
    monkeypatch.setattr(conditions, "BUDGET_S", 0.002)
    with pytest.raises(ConditionError, match=r"exceeded its time budget of 0\.002 s"):
        evaluate(slow, input=None, prev=list(range(400)), iteration=0)


def test_converting_large_values_is_not_charged_to_the_budget() -> None:
    prev = {"items": [{"id": i, "name": "x" * 20} for i in range(10_000)]}  # ~0.5 MB
    assert evaluate("size(prev.items) == 10000", input=prev, prev=prev, iteration=0)


def test_an_evaluator_that_died_between_calls_is_replaced() -> None:
    evaluate("true", input=None, prev=None, iteration=0)
    process = evaluator.EVALUATOR._process
    assert process is not None
    process.kill()
    process.wait()
    assert evaluate("iteration == 1", input=None, prev=None, iteration=1)


def test_an_evaluator_that_dies_mid_evaluation_fails_that_condition_only() -> None:
    evaluate("true", input=None, prev=None, iteration=0)
    process = evaluator.EVALUATOR._process
    assert process is not None
    killer = threading.Timer(0.3, process.kill)  # as the kernel's OOM killer would
    killer.start()
    with pytest.raises(ConditionError, match=r"^the evaluator process died \(exit code -9\)"):
        evaluate(RUNAWAY, input=None, prev=list(range(300)), iteration=0, budget_s=30)
    killer.join()
    assert evaluate("iteration == 2", input=None, prev=None, iteration=2)


def test_errors_quote_at_most_80_characters_of_an_expression() -> None:
    source = "prev.x == " + " + ".join(["1"] * 220) + " +"  # 889 characters, a syntax error
    with pytest.raises(ConditionError) as caught:
        compile_condition(source)
    message = str(caught.value)
    assert message.startswith("Failed to parse expression 'prev.x == 1 + 1")
    assert f"… ({len(source)} characters)" in message
    assert len(message) <= 300 and "\n" not in message
    assert quote("prev.ready") == "'prev.ready'"
    assert quote("x" * 500) == f"'{'x' * 80}'… (500 characters)"


def test_conditions_load_cel_without_its_command_line() -> None:
    """`import cel` loads the package's command line (typer, prompt_toolkit): 70-300 ms at
    every start of every command, for nothing. The extension alone is what compiles."""
    check = (
        "import sys, orchestrator.conditions as c; "
        "print(c.compile_condition('1 == 1') is not None, 'prompt_toolkit' in sys.modules)"
    )
    found = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert found.stdout.split() == ["True", "False"], found.stderr
