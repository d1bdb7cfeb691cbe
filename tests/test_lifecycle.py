"""A consumer that fails or ends under a broker restart is stopped and started again
(orchestrator/lifecycle.py): pure, with stand-in iterators."""

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any

import pytest
from aiormq.exceptions import ChannelNotFoundEntity

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
    def __init__(self, iterators: list[_Iterator | None]) -> None:
        super().__init__(grace_s=1)
        self.iterators, self.got, self.stopped = iterators, [], []  # type: ignore[var-annotated]

    async def _start(self) -> list[Coroutine[Any, Any, None]]:
        return [self._read()]

    async def _read(self) -> None:
        async def start() -> Any:
            found = self.iterators.pop(0)
            if found is None:  # a start the broker never answers
                await asyncio.Event().wait()
            return found

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


async def test_a_start_that_never_answers_is_given_up_and_tried_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(lifecycle, "RECONSUME_S", 0)
    monkeypatch.setattr(lifecycle, "CONSUMER_RPC_TIMEOUT_S", 0.05)
    reader = _Reader([None, _Iterator(["a", "last"])])
    await asyncio.wait_for(reader.run(), 5)
    assert reader.got == ["a", "last"]


async def test_a_stop_that_never_answers_does_not_hold_the_service(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(lifecycle, "CONSUMER_RPC_TIMEOUT_S", 0.05)

    class _Stuck(_Iterator):
        async def close(self) -> None:
            await asyncio.Event().wait()

    reader = _Reader([_Stuck(["a", "last"])])
    await asyncio.wait_for(reader.run(), 5)
    assert reader.got == ["a", "last"]


async def test_consumers_start_one_at_a_time() -> None:
    starting = running = 0

    class _Many(Service):
        async def _start(self) -> list[Coroutine[Any, Any, None]]:
            return [self._read() for _ in range(4)]

        async def _read(self) -> None:
            async def start() -> Any:
                nonlocal starting, running
                starting += 1
                running = max(running, starting)
                await asyncio.sleep(0.01)
                starting -= 1
                return _Iterator([])

            async def stop(iterator: Any) -> None:
                pass

            async for _ in self._messages(start, stop):
                pass

    many = _Many(grace_s=1)
    serving = asyncio.create_task(many.run())
    await asyncio.sleep(0.2)
    many.shutdown()
    await asyncio.wait_for(serving, 5)
    assert running == 1


async def test_a_loop_that_refuses_its_cancel_is_left_behind_not_waited_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(lifecycle, "LOOP_END_S", 0.05)
    forever = asyncio.Event()

    class _Stubborn(Service):
        async def _start(self) -> list[Coroutine[Any, Any, None]]:
            return [self._loop()]

        async def _loop(self) -> None:
            while not forever.is_set():  # as aio-pika's iterator: a cancel, then a close
                with contextlib.suppress(asyncio.CancelledError):  # that never answers
                    await forever.wait()

    stubborn = _Stubborn(grace_s=0)
    serving = asyncio.create_task(stubborn.run())
    await asyncio.sleep(0.01)
    stubborn.shutdown()
    await asyncio.wait_for(serving, 5)
    left = [t for t in asyncio.all_tasks() if t.get_coro().__qualname__.endswith("_loop")]
    assert len(left) == 1 and not left[0].done()
    forever.set()  # the test's loop must end before its event loop closes
    await asyncio.wait_for(left[0], 5)


async def test_within_gives_up_on_a_call_that_ignores_its_cancel() -> None:
    release = asyncio.Event()

    async def stubborn() -> str:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.Event().wait()
        await release.wait()
        return "late"

    with pytest.raises(TimeoutError):
        await asyncio.wait_for(lifecycle.within(stubborn(), 0.05), 5)
    release.set()


async def test_a_start_given_up_that_opens_its_consumer_late_is_stopped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(lifecycle, "CONSUMER_RPC_TIMEOUT_S", 0.05)
    monkeypatch.setattr(lifecycle, "LOOP_END_S", 0.01)
    late, opened = _Iterator([]), asyncio.Event()
    stopped: list[Any] = []

    async def start() -> Any:  # as an aio-pika RPC that finishes although cancelled
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(10)
        await opened.wait()
        return late

    async def stop(iterator: Any) -> None:
        stopped.append(iterator)

    with pytest.raises(TimeoutError):
        await lifecycle._started(start, stop)
    assert stopped == []
    opened.set()
    for _ in range(100):
        if stopped:
            break
        await asyncio.sleep(0.01)
    assert stopped == [late]


class _Refusing(_Reader):
    """Starts that raise, or iterators, in turn."""

    def __init__(self, starts: list[BaseException | _Iterator]) -> None:
        super().__init__([])
        self.starts = starts

    async def _read(self) -> None:
        async def start() -> Any:
            found = self.starts.pop(0)
            if isinstance(found, BaseException):
                raise found
            return found

        async def stop(iterator: Any) -> None:
            pass

        async for message in self._messages(start, stop):
            self.got.append(message)
            if message == "last":
                self.shutdown()
                await asyncio.Event().wait()


async def test_a_queue_that_refuses_each_start_is_tried_again_later_and_later(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """404 at each start (the queue's cluster node is down): each try opens a channel, of which
    aio-pika keeps 4.3 KB, so the pause doubles up to REFUSED_MAX_S; any other failure, and a
    start that worked, set it back to RECONSUME_S."""
    monkeypatch.setattr(lifecycle, "RECONSUME_S", 0.01)
    monkeypatch.setattr(lifecycle, "REFUSED_MAX_S", 0.04)
    refused = ChannelNotFoundEntity("NOT_FOUND - home node of queue 'q' is down")
    monkeypatch.setattr(lifecycle, "REFUSED_MAX_S", 0.0)
    many: list[BaseException | _Iterator] = [*[refused] * 1100, _Iterator(["last"])]
    reader = _Refusing(many)
    await asyncio.wait_for(reader.run(), 20)  # 2 ** 1024 was no float: the service crashed
    assert reader.got == ["last"]
    monkeypatch.setattr(lifecycle, "REFUSED_MAX_S", 0.04)
    caplog.clear()
    starts: list[BaseException | _Iterator] = [
        *[refused] * 4,
        ConnectionRefusedError("broker gone"),
        refused,
        _Iterator(["a"], ConnectionResetError("broker gone")),
        refused,
        _Iterator(["last"]),
    ]

    caplog.set_level("WARNING", logger="orchestrator.lifecycle")
    reader = _Refusing(starts)
    await asyncio.wait_for(reader.run(), 5)
    assert reader.got == ["a", "last"]
    pauses = [float(r.getMessage().rsplit(" in ", 1)[1].rstrip("s")) for r in caplog.records
              if "did not start" in r.getMessage()]  # fmt: skip
    assert pauses == [0.01, 0.02, 0.04, 0.04, 0.01, 0.01, 0.01]


class _Waiting:
    """A consumer that started and waits for messages (none come)."""

    def __aiter__(self) -> "_Waiting":
        return self

    async def __anext__(self) -> str:
        await asyncio.Event().wait()
        raise StopAsyncIteration

    async def close(self) -> None:
        pass


class _Two(Service):
    """Two consumers: one that starts, one refused (404) until `let` is set."""

    def __init__(self) -> None:
        super().__init__(grace_s=0.1)
        self.let = asyncio.Event()

    async def _start(self) -> list[Coroutine[Any, Any, None]]:
        async def fine() -> Any:
            return _Waiting()

        async def refused() -> Any:
            if not self.let.is_set():
                raise ChannelNotFoundEntity("NOT_FOUND - home node of queue 'q2' is down")
            return _Waiting()

        return [self._read(fine), self._read(refused)]

    async def _read(self, start: Any) -> None:
        async def stop(iterator: Any) -> None:
            pass

        async for _ in self._messages(start, stop):
            pass


async def test_a_part_with_a_consumer_that_cannot_start_is_not_consuming(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One of its consumers refused for good: it counted as consuming (so /readyz was green)
    as long as any other one ran."""
    monkeypatch.setattr(lifecycle, "RECONSUME_S", 0.01)
    monkeypatch.setattr(lifecycle, "REFUSED_MAX_S", 0.02)
    part = _Two()
    running = asyncio.create_task(part.run())
    try:
        await asyncio.sleep(0.2)  # the first started long ago; the second is refused still
        assert len(part._iterators) == 1 and not part.consuming
        part.let.set()
        for _ in range(100):
            if part.consuming:
                break
            await asyncio.sleep(0.01)
        assert part.consuming and len(part._iterators) == 2
    finally:
        part.shutdown()
        await asyncio.wait_for(running, 5)
    assert not part.consuming


class _Taken(_Waiting):
    """A started consumer the broker may take back (`live` False) while nobody reads it."""

    live = True


class _One(Service):
    def __init__(self) -> None:
        super().__init__(grace_s=0.1)
        self.consumer = _Taken()

    async def _start(self) -> list[Coroutine[Any, Any, None]]:
        async def start() -> Any:
            return self.consumer

        async def stop(iterator: Any) -> None:
            pass

        async def read() -> None:
            async for _ in self._messages(start, stop):
                pass

        return [read()]


async def test_a_part_whose_consumer_the_broker_took_back_is_not_consuming() -> None:
    """Its loop waiting for a slot, not reading: it stayed ready with no consumer left."""
    part = _One()
    running = asyncio.create_task(part.run())
    try:
        for _ in range(100):
            if part.consuming:
                break
            await asyncio.sleep(0.01)
        assert part.consuming
        part.consumer.live = False
        assert not part.consuming
    finally:
        part.shutdown()
        await asyncio.wait_for(running, 5)
