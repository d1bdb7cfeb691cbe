"""Tasks for the demo program (examples/thumbnails.json)."""

import asyncio

from worker import TaskContext, task


@task()
async def fetch(ctx: TaskContext) -> dict:
    await asyncio.sleep(0.05)
    return {"url": ctx.args["url"], "bytes": 1024 * len(ctx.args["url"])}


@task()
async def resize(ctx: TaskContext) -> dict:
    await asyncio.sleep(0.05)
    return {"width": ctx.args["width"], "bytes": ctx.prev["bytes"] * ctx.args["width"] // 1024}


@task()
def poll(ctx: TaskContext) -> dict:
    # A plain function runs in a thread. Ready on the third poll (iterations count from 0).
    return {"ready": ctx.iteration >= 2, "polls": ctx.iteration + 1}


@task()
async def publish(ctx: TaskContext) -> dict:
    return {"published": ctx.input["album"], "after_polls": ctx.prev["polls"]}
