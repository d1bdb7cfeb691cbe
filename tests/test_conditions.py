"""`until` conditions are CEL, evaluated over input, prev and iteration."""

import pytest

from orchestrator.conditions import ConditionError, compile_condition, evaluate


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
