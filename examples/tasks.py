"""Tasks for the example programs (examples/*.json); the demo runs examples/thumbnails.json."""

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


# --- examples/album.json: a map over a list only known at run time ---------------------------


@task()
async def list_photos(ctx: TaskContext) -> dict:
    count = ctx.input["count"]
    photos = [{"name": f"{ctx.input['album']}-{n}.jpg", "bytes": 1000 * n} for n in range(count)]
    return {"photos": photos}


@task()
async def thumbnail(ctx: TaskContext) -> dict:
    # ctx.item: this member's photo; ctx.index: its place in the list.
    await asyncio.sleep(0.05)
    photo = ctx.item
    return {"name": photo["name"], "bytes": photo["bytes"] * ctx.args["width"] // 1024}


@task()
async def summarize(ctx: TaskContext) -> dict:
    return {
        "album": ctx.input["album"],
        "thumbnails": [t["name"] for t in ctx.prev],
        "bytes": sum(t["bytes"] for t in ctx.prev),
    }


# --- examples/etl.json: map over partitions, poll with a durable wait, then choose -------------


@task(name="etl.partitions")
async def partitions(ctx: TaskContext) -> dict:
    return {"partitions": [f"{ctx.input['table']}/p{n}" for n in range(ctx.input["parts"])]}


@task(name="etl.transform")
async def transform(ctx: TaskContext) -> dict:
    await asyncio.sleep(0.05)
    return {"partition": ctx.item, "rows": 100 * (ctx.index + 1)}


@task(name="etl.poll")
def poll_load(ctx: TaskContext) -> dict:
    # The warehouse reports the load done on the third poll; the loop waits between polls.
    rows = sum(p["rows"] for p in ctx.prev) if isinstance(ctx.prev, list) else ctx.prev["rows"]
    return {"ready": ctx.iteration >= 2, "rows": rows, "polls": ctx.iteration + 1}


@task(name="etl.publish")
async def publish_table(ctx: TaskContext) -> dict:
    return {"published": ctx.input["table"], "rows": ctx.prev["rows"], "polls": ctx.prev["polls"]}


@task(name="etl.alert")
async def alert(ctx: TaskContext) -> dict:
    return {"alert": f"{ctx.input['table']}: no rows"}


# --- examples/approval.json: a refund waits for a person's decision (a signal) ----------------


@task(name="refund.quote")
async def quote(ctx: TaskContext) -> dict:
    return {"order": ctx.input["order"], "amount": ctx.input["amount"]}


@task(name="refund.pay")
async def pay(ctx: TaskContext) -> dict:
    return {"paid": ctx.input["amount"], "order": ctx.input["order"], "by": ctx.prev["by"]}


@task(name="refund.decline")
async def decline(ctx: TaskContext) -> dict:
    return {"declined": ctx.input["order"], "reason": ctx.prev.get("reason", "")}


# --- examples/report.json: later steps read earlier ones by id (`steps.<id>`) -----------------


@task(name="report.fetch")
async def fetch_region(ctx: TaskContext) -> dict:
    region = ctx.input["region"]
    stores = [{"store": f"{region}-{n}"} for n in range(ctx.input["stores"])]
    return {"region": region, "currency": "EUR", "stores": stores}


@task(name="report.tally")
async def tally(ctx: TaskContext) -> dict:
    # ctx.item: a store from steps.fetch.stores; args.currency: from steps.fetch.currency.
    await asyncio.sleep(0.05)
    return {
        "store": ctx.item["store"],
        "rows": 10 * (ctx.index + 1),
        "currency": ctx.args["currency"],
    }


@task(name="report.load")
def load_rows(ctx: TaskContext) -> dict:
    # args.rows: every store's rows (steps.stores); the warehouse is ready on the second poll.
    return {
        "ready": ctx.iteration >= 1,
        "loaded": sum(ctx.args["rows"]),
        "polls": ctx.iteration + 1,
    }


@task(name="report.publish")
async def publish_report(ctx: TaskContext) -> dict:
    # prev: the loop's last output; region, stores and polls come from steps far behind.
    return {
        "region": ctx.args["region"],
        "stores": ctx.args["stores"],
        "loaded": ctx.prev["loaded"],
        "polls": ctx.args["polls"],
    }


# --- examples/partitions.json: each partition fetched, transformed, validated in its branch --


@task(name="part.plan")
async def plan_load(ctx: TaskContext) -> dict:
    return {"table": ctx.input["table"], "day": ctx.input["day"]}


@task(name="part.fetch")
async def fetch_partition(ctx: TaskContext) -> dict:
    # prev: the bag's prev (part.plan's output), as every branch's first step gets it.
    await asyncio.sleep(0.05)
    rows = {"eu": 120, "us": 300, "apac": 80}[ctx.args["partition"]]
    return {"partition": ctx.args["partition"], "day": ctx.prev["day"], "rows": rows}


@task(name="part.transform")
async def transform_partition(ctx: TaskContext) -> dict:
    # prev: this branch's fetch; the branches run side by side.
    await asyncio.sleep(0.05)
    return {**ctx.prev, "rows": ctx.prev["rows"] - ctx.prev["rows"] // 10, "cleaned": True}


@task(name="part.validate")
def validate_partition(ctx: TaskContext) -> dict:
    # Checks pass on the second look (the loop waits its interval between looks).
    partition = ctx.prev if "partition" in ctx.prev else ctx.prev["of"]
    return {"valid": ctx.iteration >= 1, "checks": ctx.iteration + 1, "of": partition}


@task(name="part.snapshot")
async def snapshot(ctx: TaskContext) -> dict:
    # A single task beside the branches: the bag's prev, like a branch's first step.
    return {"snapshot": f"{ctx.args['table']}@{ctx.prev['day']}"}


@task(name="part.publish")
async def publish_partitions(ctx: TaskContext) -> dict:
    # prev: the bag's output, its members in order (each branch's last output, the snapshot).
    *branches, snap = ctx.prev
    return {
        "table": ctx.args["table"],
        "partitions": {b["of"]["partition"]: b["of"]["rows"] for b in branches},
        "checks": sum(b["checks"] for b in branches),
        "snapshot": snap["snapshot"],
    }


# --- examples/booking.json: a saga; a declined card undoes the reservations ---------------------
# Each reservation names the task that undoes it (`compensate`). When the charge fails for good,
# the program runs those of the steps that completed, last first (the hotel and the car side by
# side), then ends `compensated`. A compensation gets the output of what it undoes as ctx.item.


@task(name="booking.reserve_flight")
async def reserve_flight(ctx: TaskContext) -> dict:
    return {"flight": f"FL-{ctx.input['trip']}", "seat": "12A"}


@task(name="booking.reserve_hotel")
async def reserve_hotel(ctx: TaskContext) -> dict:
    return {"hotel": f"HT-{ctx.input['trip']}", "nights": ctx.input.get("nights", 2)}


@task(name="booking.reserve_car")
async def reserve_car(ctx: TaskContext) -> dict:
    return {"car": f"CR-{ctx.input['trip']}"}


@task(name="booking.charge_card")
async def charge_card(ctx: TaskContext) -> dict:
    if ctx.input["card"].endswith("0000"):
        raise RuntimeError(f"card {ctx.input['card']} declined")
    return {"charged": ctx.input["amount"], "card": ctx.input["card"]}


@task(name="booking.release_flight")
async def release_flight(ctx: TaskContext) -> dict:
    return {"released": ctx.item["flight"]}


@task(name="booking.release_hotel")
async def release_hotel(ctx: TaskContext) -> dict:
    return {"released": ctx.item["hotel"]}


@task(name="booking.release_car")
async def release_car(ctx: TaskContext) -> dict:
    return {"released": ctx.item["car"]}
