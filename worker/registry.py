"""Task handlers: the `@task()` decorator marks functions; a Registry collects them from modules."""

from __future__ import annotations

import asyncio
import importlib
import inspect
from collections.abc import Callable, Iterable
from typing import Any, TypeVar, overload

from worker.context import TaskContext
from worker.threads import HandlerThreads

Handler = Callable[[TaskContext], Any]
F = TypeVar("F", bound=Handler)
_MARK = "__shardflow_task__"


@overload
def task(name: F) -> F: ...


@overload
def task(name: str | None = None) -> Callable[[F], F]: ...


def task(name: str | Handler | None = None) -> Any:
    """Mark a handler `async def h(ctx)` (or a plain function, run in a thread) as a task:
    `@task()`, `@task(name="...")`, or `@task` alone.

    The name defaults to the function's name. Marking registers nothing globally: a worker
    collects marked functions from the modules it is told to import (`--app`).
    """
    if callable(name):  # `@task` without its parentheses: it was silently no task at all
        return task()(name)
    if name is not None and not isinstance(name, str):
        raise TypeError(f"@task(name=...) takes a string, got {name!r}")

    def mark(function: F) -> F:
        if not callable(function):
            raise TypeError(f"@task() needs a function, got {function!r}")
        setattr(function, _MARK, name or function.__name__)
        return function

    return mark


class UnknownTask(LookupError):
    """No handler of that name in this worker."""


class Registry:
    """Task names to handlers."""

    def __init__(self, handlers: dict[str, Handler] | None = None) -> None:
        self.handlers: dict[str, Handler] = dict(handlers or {})

    @classmethod
    def from_modules(cls, modules: Iterable[str]) -> Registry:
        """Import each module and collect its `@task()` functions."""
        registry = cls()
        for module_name in modules:
            module = importlib.import_module(module_name)
            for value in vars(module).values():
                name = getattr(value, _MARK, None)
                if isinstance(name, str):
                    registry.add(name, value)
        return registry

    def add(self, name: str, handler: Handler) -> None:
        existing = self.handlers.get(name)
        if existing is not None and existing is not handler:
            raise ValueError(
                f"task {name!r} is defined twice: {_where(existing)} and {_where(handler)}"
            )
        self.handlers[name] = handler

    def names(self) -> set[str]:
        return set(self.handlers)

    async def run(self, name: str, ctx: TaskContext, threads: HandlerThreads | None = None) -> Any:
        """Run a handler: coroutine functions on the loop, plain functions in a thread (of
        `threads`, else asyncio's default executor)."""
        handler = self.handlers.get(name)
        if handler is None:
            known = ", ".join(sorted(self.handlers)) or "none (was it started without --app?)"
            raise UnknownTask(f"unknown task {name!r} (this worker knows: {known})")
        if inspect.iscoroutinefunction(handler):
            return await handler(ctx)
        if threads is not None:
            result = await threads.run(handler, ctx)
        else:
            result = await asyncio.to_thread(handler, ctx)
        if inspect.isawaitable(result):
            return await result
        return result


def _where(handler: Handler) -> str:
    """A handler's module and name, as a developer finds it."""
    module = getattr(handler, "__module__", None) or "?"
    return f"{module}.{getattr(handler, '__qualname__', repr(handler))}"
