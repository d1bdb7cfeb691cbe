"""shardflow's no-op tasks for the benchmark shapes."""

import asyncio
import time
from typing import Any

from worker import TaskContext, task


@task()
async def begin(ctx: TaskContext) -> dict[str, Any]:
    return {"v": 1}


@task()
async def member(ctx: TaskContext) -> dict[str, Any]:
    return {"i": ctx.args["i"], "v": ctx.prev["v"]}


@task()
async def finish(ctx: TaskContext) -> dict[str, Any]:
    return {"order": [out["i"] for out in ctx.prev], "t": time.time()}


@task()
async def step(ctx: TaskContext) -> dict[str, Any]:
    return {"k": (ctx.prev or {"k": 0})["k"] + 1, "t": time.time()}


@task()
async def hold(ctx: TaskContext) -> None:
    await asyncio.sleep(ctx.args["s"])
