"""The `@task` decorator and the registry a worker builds from `--app` modules."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator

import pytest

from worker.context import TaskContext
from worker.registry import Registry, task


@pytest.fixture
def modules() -> Iterator[dict[str, types.ModuleType]]:
    made: dict[str, types.ModuleType] = {}
    yield made
    for name in made:
        sys.modules.pop(name, None)


def _module(made: dict[str, types.ModuleType], name: str, **values: object) -> str:
    module = types.ModuleType(name)
    vars(module).update(values)
    sys.modules[name] = made[name] = module
    return name


async def test_task_without_its_parentheses_marks_the_function_as_with_them(
    modules: dict[str, types.ModuleType],
) -> None:
    """`@task` alone made the function `task.<locals>.mark`, and no task: a program naming it
    failed later with `unknown task`."""

    @task
    async def bare(ctx: TaskContext) -> str:
        return "bare"

    @task()
    def called(ctx: TaskContext) -> str:
        return "called"

    registry = Registry.from_modules([_module(modules, "sf_bare", bare=bare, called=called)])
    assert registry.names() == {"bare", "called"}
    assert bare.__name__ == "bare"
    ctx = TaskContext(
        input=None,
        args={},
        prev=None,
        workflow_id="w",
        step="0",
        iteration=0,
        index=None,
        attempt=0,
    )
    assert await registry.run("bare", ctx) == "bare"


def test_a_name_that_is_no_string_and_a_name_defined_twice_are_refused_naming_both() -> None:
    with pytest.raises(TypeError, match="takes a string, got 3"):
        task(3)  # type: ignore[call-overload]

    @task(name="same")
    def one(ctx: TaskContext) -> None: ...

    @task(name="same")
    def other(ctx: TaskContext) -> None: ...

    registry = Registry()
    registry.add("same", one)
    with pytest.raises(ValueError, match=r"defined twice: tests\.test_registry\.test_a_name"):
        registry.add("same", other)
