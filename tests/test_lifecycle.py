"""A consumer that fails or ends under a broker restart is stopped and started again
(orchestrator/lifecycle.py): pure, with stand-in iterators."""

import asyncio
from collections.abc import Coroutine
from typing import Any

import pytest

from orchestrator import lifecycle
from orchestrator.lifecycle import Service


class _Iterator:
    """Yields its messages, then raises `fail` (or ends, as a closed one does)."""

    def __init__(self, messages: list[str], fail: BaseException | None = None) -> None:
        self.messages, self.fail = list(messages), fail

    def __aiter__(self) -> "_Iterator":
        return self

    async def __anext__(self) -> str:
        if self.messages:
            return self.messages.pop(0)
        if self.fail is not None:
            raise self.fail
        raise StopAsyncIteration

    async def close(self) -> None:
        pass


class _Reader(Service):
    def __init__(self, iterators: list[_Iterator]) -> None:
        super().__init__(grace_s=1)
        self.iterators, self.got, self.stopped = iterators, [], []  # type: ignore[var-annotated]

    async def _start(self) -> list[Coroutine[Any, Any, None]]:
        return [self._read()]

    async def _read(self) -> None:
        async def start() -> Any:
            return self.iterators.pop(0)

        async def stop(iterator: Any) -> None:
            self.stopped.append(iterator)

        async for message in self._messages(start, stop):
            self.got.append(message)
            if message == "last":
                self.shutdown()
                await asyncio.Event().wait()  # run() cancels this loop on stop


async def test_a_consumer_that_fails_or_ends_is_started_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(lifecycle, "RECONSUME_S", 0)
    failing = _Iterator(["a"], ConnectionResetError("broker gone"))
    ended = _Iterator(["b"])  # closed as the broker went down, not by us
    last = _Iterator(["c", "last"])
    reader = _Reader([failing, ended, last])
    await asyncio.wait_for(reader.run(), 5)
    assert reader.got == ["a", "b", "c", "last"]
    assert reader.stopped == [failing, ended]  # their channels closed, never restored


async def test_an_error_that_is_no_lost_connection_still_stops_the_service(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(lifecycle, "RECONSUME_S", 0)
    reader = _Reader([_Iterator(["a"], ValueError("a bug"))])
    with pytest.raises(ValueError, match="a bug"):
        await asyncio.wait_for(reader.run(), 5)
