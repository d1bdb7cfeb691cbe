"""Workflow ids: the same full match in Python (keys.py) and in pydantic (messages.py)."""

from typing import Annotated

import pytest
from pydantic import Field, TypeAdapter, ValidationError

from orchestrator.keys import WORKFLOW_ID, check_workflow_id

BY_PYDANTIC = TypeAdapter(Annotated[str, Field(pattern=WORKFLOW_ID.pattern)])


@pytest.mark.parametrize("good", ["abc", "A", "a" * 128, "order-17:retry@2.x_y"])
def test_valid_ids_pass_both_checks(good: str) -> None:
    assert check_workflow_id(good) == good
    assert BY_PYDANTIC.validate_python(good) == good


@pytest.mark.parametrize("bad", ["abc\n", "abc\r\n", "\nabc", "a" * 129, "", "-abc", "a b", "é"])
def test_invalid_ids_fail_both_checks(bad: str) -> None:
    # `$` in Python's re also matches before a trailing newline: "abc\n" used to pass here.
    with pytest.raises(ValueError, match="use 1-128 of"):
        check_workflow_id(bad)
    with pytest.raises(ValidationError):
        BY_PYDANTIC.validate_python(bad)
