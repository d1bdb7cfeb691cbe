"""Automatic pipelining: the Redis commands that callers issue in one event-loop turn go out
together, as one pipeline (one write, one read) instead of one round trip each.

Every command waits for the end of the turn it was issued in and goes with the turn's rest,
even when none is on its way: then the messages one turn handled get their replies from one
read, go on together, and publish in one write (orchestrator/coalescing.py), so the broker
gets them in one burst. A lone command (a chain's step) waits for the loop's next iteration
only. Sending it at once instead split a turn's work in two bursts: 0.90x the chains' tasks/s
at M=200, at 1.13x the CPU (bench/README.md, 2026-12-04).

On loopback most of a command's cost is the send system call and the wake-up it causes, so a
worker running many tasks at once, or an owner working on several shards, sends a fraction of
them. Each command is still its own: no MULTI, so one's error is only its caller's, and Redis
runs them in the order they were issued. A Lua script goes by EVALSHA and is loaded once on
NOSCRIPT (a pipeline holding scripts would otherwise ask SCRIPT EXISTS every time).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError

# Commands in one pipeline at most: a bound on one write's size and on one reply's wait.
MAX_BATCH = 256

Command = tuple[Any, ...]  # a command's name and arguments, as `execute_command` takes them


class Pipeliner:
    """Sends the commands issued in one loop turn as one pipeline on `client`."""

    def __init__(self, client: Redis, max_batch: int = MAX_BATCH) -> None:
        self.client = client
        self.max_batch = max_batch
        self._pending: list[tuple[Command, asyncio.Future[Any]]] = []
        self._flushes: set[asyncio.Task[None]] = set()
        self.sent = 0  # round trips (pipelines and single commands), and commands: for the tests
        self.commands = 0

    async def execute(self, *command: Any) -> Any:
        """Send one command (its name and arguments, as `client.execute_command` takes them)
        with the rest of the turn's, and return its reply."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        if not self._pending:
            loop.call_soon(self._flush_soon)
        self._pending.append((command, future))
        return await future

    async def script(self, script: AsyncScript, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        """Run a registered Lua script by its SHA; loaded and tried again once on NOSCRIPT."""
        command = ("EVALSHA", script.sha, len(keys), *keys, *args)
        try:
            return await self.execute(*command)
        except NoScriptError:
            await self.client.script_load(script.script)
            return await self.execute(*command)

    def _flush_soon(self) -> None:
        batch, self._pending = self._pending, []
        task = asyncio.get_running_loop().create_task(self._flush(batch))
        self._flushes.add(task)  # held until done: the loop keeps only weak references

        def done(_: asyncio.Task[None]) -> None:
            # Cancelled, even before it started: no caller waits for ever.
            self._flushes.discard(task)
            for _command, future in batch:
                if not future.done():
                    future.set_exception(RedisConnectionError("the pipeline was stopped"))

        task.add_done_callback(done)

    async def _flush(self, batch: list[tuple[Command, asyncio.Future[Any]]]) -> None:
        # Over the bound, in pipelines one after another: still in the order issued.
        for start in range(0, len(batch), self.max_batch):
            await self._send(batch[start : start + self.max_batch])

    async def _send(self, batch: list[tuple[Command, asyncio.Future[Any]]]) -> None:
        self.sent += 1
        self.commands += len(batch)
        try:
            if len(batch) == 1:  # a pipeline of one costs more than the command alone
                try:
                    replies = [await self.client.execute_command(*batch[0][0])]
                except (RedisError, ValueError) as exc:  # its own error, as a pipeline's
                    replies = [exc]
            else:
                async with self.client.pipeline(transaction=False) as pipe:
                    for command, _ in batch:
                        pipe.execute_command(*command)
                    replies = await pipe.execute(raise_on_error=False)
        except Exception as exc:  # the connection failed: each command of the batch fails
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        for (_, future), reply in zip(batch, replies, strict=True):
            if future.done():  # its caller was cancelled; the command ran all the same
                continue
            if isinstance(reply, Exception):
                future.set_exception(reply)
            else:
                future.set_result(reply)
