"""Drawn programs on the real cluster: results as the model says, steps never out of order."""

import itertools

import pytest
from hypothesis import HealthCheck, given, settings

from router.client import Router
from tests.app import Trace
from tests.model import NAMED_POOL, SIGNAL, expect, programs, signal_data
from tests.ordering import leaf_order

pytestmark = pytest.mark.e2e


@pytest.fixture
def named_pools() -> list[str]:
    """The cluster also runs a worker for the named pool drawn programs use."""
    return [NAMED_POOL]


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(program=programs(max_bag=10, fail_rate=15, branches=False))  # one total order
async def test_drawn_programs_run_in_program_order(
    cluster: Router, trace: Trace, program: dict
) -> None:
    expected = expect(program)
    submitted = await cluster.submit(program, trace.as_input())
    for path in expected.signals:  # each signal step's own, in the order they will take them
        try:
            await cluster.signal(submitted.workflow_id, SIGNAL, signal_data(path), path)
        except ValueError as exc:  # it failed (or compensates) before it needed them all
            assert "has ended" in str(exc) or "is compensating" in str(exc), exc
    status = await cluster.wait(submitted.workflow_id, timeout_s=120)
    assert status["status"] == expected.status, (status, expected)
    if expected.status == "completed":
        assert status["result"] == expected.result
    else:
        assert status["error"].startswith(expected.error_prefix), (status, expected)

    ran = leaf_order([e for e in trace.events() if e["wf"] == submitted.workflow_id])
    leaves = ran[submitted.workflow_id]
    tasks = [path for path, size in expected.leaves if size and path not in expected.signals]
    assert [path for path, _, _ in leaves] == tasks
    for (before, _, done), (after, start, _) in itertools.pairwise(leaves):
        assert 0 <= done < start, f"{after} started (seq {start}) before {before} was done"
