"""Program state in Redis: one typed wrapper per Lua transition (`lua/`), plus plain reads."""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from importlib import resources
from typing import Any

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

from orchestrator.keys import Keys
from orchestrator.paths import scope_of
from orchestrator.pipelining import Pipeliner
from orchestrator.settings import Settings
from orchestrator.store import (
    BRIEF,
    MAX_RUNS,
    MAX_SIGNAL_IDS,
    MAX_SIGNALS_WAITING,
    Completion,
    Ended,
    Recorded,
    Redriven,
    Slot,
    Stored,
    Verdict,
    reopened,
)

log = logging.getLogger(__name__)

# Keys the server walks per SCAN call: its MATCH keeps only ours, so most calls send back few.
SCAN_COUNT = 1000
# A command waits this long at most for a connection of a full pool, then fails as a Redis
# that cannot be reached does (waited for and tried again where a service waits for Redis).
REDIS_POOL_WAIT_S = 20.0


def _carried(reply: list[str], verdicts: tuple[str, ...]) -> list[str]:
    """What a script's reply carries after its verdict, for the verdicts that carry any."""
    return list(reply[1:]) if reply[0] in verdicts else []


def _script(client: Redis | RedisCluster, name: str) -> AsyncScript:
    source = resources.files("lua").joinpath(f"{name}.lua").read_text()
    return client.register_script(source)  # type: ignore[return-value]


Transition = Callable[..., Awaitable[Any]]


class RedisStore:
    """Redis state of programs (a `Store`). The client is owned by the caller of `connect`."""

    # Bounds of lua/signal.lua (lowered by the model test, to reach them).
    signals_waiting = MAX_SIGNALS_WAITING
    signal_ids = MAX_SIGNAL_IDS

    def __init__(
        self,
        client: Redis | RedisCluster,
        keys: Keys,
        retention_ms: int = 0,
        pipelined: bool = True,
    ) -> None:
        """`pipelined`: send the commands of one loop turn together (orchestrator/pipelining.py;
        a cluster client sends each on its own)."""
        self.client = client
        self.keys = keys
        # How long an ended program's keys stay (0: forever); set by the scripts that end it.
        self.retention_ms = retention_ms
        self.pipeliner = (
            Pipeliner(client) if pipelined and not isinstance(client, RedisCluster) else None
        )
        self._scripts: list[AsyncScript] = []
        self._by_name: dict[str, AsyncScript] = {}
        self._submit = self._transition("submit")
        self._advance = self._transition("advance")
        self._complete = self._transition("complete")
        self._fail = self._transition("fail")
        self._begin = self._transition("begin")
        self._cancel = self._transition("cancel")
        self._stash = self._transition("stash")
        self._purge = self._transition("purge")
        self._signal = self._transition("signal")
        self._take = self._transition("take")
        self._redrive = self._transition("redrive")
        self._acquire = self._transition("acquire")
        self._renew = self._transition("renew")
        self._release = self._transition("release")
        self._mark = self._transition("mark")
        self._unindex = self._transition("unindex")
        self._reindex = self._transition("reindex")

    def _transition(self, name: str) -> Transition:
        """The Lua script `lua/<name>.lua`, called as `(keys=..., args=...)`."""
        script = _script(self.client, name)
        self._scripts.append(script)
        self._by_name[name] = script
        pipeliner = self.pipeliner
        if pipeliner is None:
            return script

        async def run(keys: Sequence[Any], args: Sequence[Any]) -> Any:
            return await pipeliner.script(script, keys, args)

        return run

    @classmethod
    def connect(cls, settings: Settings) -> RedisStore:
        """A store on a new client; no I/O happens until the first call."""
        client: Redis | RedisCluster
        if settings.redis_cluster:
            client = RedisCluster.from_url(settings.redis_url, decode_responses=True)
        elif settings.redis_max_connections:
            # A command past the bound waits for a connection: redis-py's own pool opens one
            # for every command in flight, each a client of Redis's maxclients (a managed
            # Redis may allow a few hundred). A bound in the URL (?max_connections=) wins.
            pool = BlockingConnectionPool.from_url(
                settings.redis_url,
                decode_responses=True,
                max_connections=settings.redis_max_connections,
                timeout=REDIS_POOL_WAIT_S,
            )
            client = Redis.from_pool(pool)
        else:
            client = Redis.from_url(settings.redis_url, decode_responses=True)
        retention_ms = math.ceil(settings.retention_s * 1000)  # 0 is forever: 0.0005 is not
        return cls(client, Keys(settings.prefix), retention_ms, settings.redis_pipelining)

    async def load_scripts(self) -> None:
        """SCRIPT LOAD every transition up front; calls still reload on NOSCRIPT."""
        for script in self._scripts:
            await self.client.script_load(script.script)

    async def close(self) -> None:
        await self.client.aclose()

    async def durability_faults(self) -> list[str]:
        """What in Redis's configuration can lose a program, one line each; none when all is
        well, or when Redis does not let us read it (CONFIG renamed or denied, as managed
        services do)."""
        try:
            config: dict[str, str] = {}
            for name in ("appendonly", "appendfsync", "maxmemory-policy"):
                found = await self.client.config_get(name)
                config.update({str(key): str(value) for key, value in found.items()})
        except Exception as exc:  # not ours to read: say so at debug level only
            log.debug("Redis's configuration could not be read: %r", exc)
            return []
        faults = []
        if config.get("appendonly", "yes") != "yes":
            faults.append(
                "Redis keeps no append-only file (appendonly no): a Redis restart loses what "
                "was written since its last snapshot, programs with it; set appendonly yes"
            )
        elif config.get("appendfsync", "always") != "always":
            faults.append(
                f"Redis syncs its append-only file to disk less than at every write (appendfsync "
                f"{config['appendfsync']}): a crash of its machine can lose the last second's "
                "transitions, and the programs they belonged to; set appendfsync always"
            )
        policy = config.get("maxmemory-policy", "noeviction")
        if policy != "noeviction":
            faults.append(
                f"Redis may evict keys (maxmemory-policy {policy}): an evicted key is a lost "
                "program; set maxmemory-policy noeviction"
            )
        return faults

    async def submit(self, wf: str, plan: str, owner: int, name: str, digest: str) -> Recorded:
        """Record a new program once, or report the one that exists."""
        keys = self.keys
        verdict, status, found_owner = await self._submit(
            keys=[keys.state(wf), keys.plan(wf)], args=[plan, owner, name, digest]
        )
        return Recorded(verdict == "created", status, int(found_owner), verdict == "conflict")

    async def advance(
        self,
        wf: str,
        expected: str,
        cursor: str,
        status: str,
        field: str = "",
        payload: str = "",
        leaf: str = "",
        drop: str = "",
        refs: Sequence[tuple[str, str]] = (),
        epoch: int | None = None,
        scope: str = "",
        opened: Sequence[tuple[str, str, str]] = (),
        output: str | None = None,
    ) -> Verdict:
        """Compare-and-advance the cursor (see lua/advance.lua)."""
        args: list[str | int] = [expected, cursor, status, field, payload, leaf]
        args += [self.retention_ms, drop, "" if epoch is None else epoch]
        args += [scope, json.dumps([list(branch) for branch in opened])]
        args += [text for _, text in refs]
        keys = [self.keys.state(wf), *(self.keys.ref(wf, name) for name, _ in refs)]
        if output is not None:  # the finished task's own, written as the refs are
            keys.append(self.keys.output(wf, expected))
            args.append(output)
        reply = await self._advance(keys=keys, args=args)
        joined = len(reply) > 3 and reply[3] == "1"
        elapsed = int(reply[4]) if len(reply) > 4 and reply[4] else None
        return Verdict(reply[0], reply[1], reply[2], joined, elapsed)

    async def at(self, wf: str, path: str) -> dict[str, str]:
        """The state as the leaf at `path` sees it (its branch's cursor, in a branch)."""
        scope = scope_of(path)
        if not scope:
            return await self.state(wf)
        fields = ["cursor", "from", "leaf", "updated_ms"]
        async with self.client.pipeline(transaction=False) as pipe:  # one round trip
            pipe.hgetall(self.keys.state(wf))
            pipe.hmget(self.keys.branch(wf, scope), fields)
            state, found = await pipe.execute()
        if state:
            state.update({k: v or "" for k, v in zip(fields, found, strict=True)})
        return dict(state)

    async def complete(
        self, wf: str, path: str, index: int | None, size: int, output: str, epoch: int = 0
    ) -> Completion:
        """Record one output; for a bag of `size`, also its place in the barrier."""
        return await self.record(wf, path, size, {index: output}, epoch)

    async def record(
        self,
        wf: str,
        path: str,
        size: int,
        outputs: Mapping[int | None, str],
        epoch: int = 0,
    ) -> Completion:
        """Record a single task's output (key None), or any members' of a bag of `size`
        (keys: their indices), in one call (see lua/complete.lua)."""
        keys = self.keys
        if None in outputs:
            script_keys = [keys.state(wf), keys.output(wf, path)]
            args = [path, str(epoch), outputs[None]]
        else:
            members = [keys.output(wf, path, i) for i in range(size)]
            script_keys = [keys.state(wf), keys.barrier(wf, path), *members]
            args = [path, str(epoch)]
            for index, output in outputs.items():
                args += [str(index), output]
        reply = await self._complete(keys=script_keys, args=args)
        return Completion(reply[0], _carried(reply, ("fire", "again", "invalid")))

    async def fail(
        self,
        wf: str,
        path: str,
        index: int | None,
        attempt: int,
        error: str,
        max_attempts: int,
        epoch: int = 0,
    ) -> Completion:
        """Record a failed attempt once: retry, exhausted (with every error), again or stale."""
        reply = await self._fail(
            keys=[self.keys.state(wf), self.keys.failures(wf, path)],
            args=[path, index or 0, attempt, error, max_attempts, epoch],
        )
        return Completion(reply[0], _carried(reply, ("exhausted", "again", "invalid")))

    async def cancel(
        self,
        wf: str,
        status: str,
        reason: str,
        epoch: int | None = None,
        compensates: bool = False,
        stop: bool = False,
    ) -> Ended | None:
        """End a live program now (see lua/cancel.lua); None when there is no such program."""
        run: str | int = "" if epoch is None else epoch
        args: list[str | int] = [status, reason, self.retention_ms, run, str(int(compensates))]
        args.append(str(int(stop)))
        verdict, now_status, owner = await self._cancel(keys=[self.keys.state(wf)], args=args)
        if verdict == "missing":
            return None
        return Ended(verdict == "applied", now_status, int(owner), verdict == "stale")

    async def redrive(
        self, wf: str, epoch: int, rerun: str, prior: str, record: str, roots: list[str]
    ) -> Redriven:
        """Open an ended program for a new run (see lua/redrive.lua)."""
        args: list[str | int] = [epoch, rerun, prior, record, MAX_RUNS, " ".join(roots)]
        verdict, status, now_epoch, owner = await self._redrive(
            keys=[self.keys.state(wf)], args=args
        )
        if verdict == "missing":
            return Redriven("missing", "", 0, 0)
        return Redriven(verdict, status, int(now_epoch), int(owner))

    async def members(self, wf: str, path: str) -> int:
        return int(await self.client.scard(self.keys.barrier(wf, path)))  # type: ignore[misc]

    async def begin(
        self, wf: str, path: str, indexes: list[int], epoch: int = 0, attempt: int = 0
    ) -> Completion:
        reply = await self._begin(
            keys=[self.keys.state(wf), self.keys.started(wf, path)],
            args=[path, epoch, attempt, *indexes],
        )
        return Completion(reply[0], _carried(reply, ("go", "invalid", "stale")))

    async def started(self, wf: str, path: str) -> int:
        return int(await self.client.hlen(self.keys.started(wf, path)))  # type: ignore[misc]

    async def stash(self, wf: str, blobs: Mapping[str, str]) -> bool:
        """Keep large values under the program (see lua/stash.lua)."""
        keys = [self.keys.state(wf), *(self.keys.blob(wf, name) for name in blobs)]
        return await self._stash(keys=keys, args=list(blobs.values())) == "ok"

    async def signal(self, wf: str, name: str, data: str, signal_id: str = "") -> Verdict:
        """Keep a signal for the program's step of that name (see lua/signal.lua)."""
        keys = [self.keys.state(wf), self.keys.signals(wf, name), self.keys.signal_ids(wf)]
        args: list[str | int] = [data, signal_id, self.signals_waiting, self.signal_ids]
        verdict, detail = await self._signal(keys=keys, args=args)
        return Verdict(verdict, str(detail), "")

    async def take(self, wf: str, path: str, name: str, epoch: int | None = None) -> str:
        """The signal step at `path` takes its signal (see lua/take.lua)."""
        keys = [self.keys.state(wf), self.keys.output(wf, path), self.keys.signals(wf, name)]
        run = "" if epoch is None else str(epoch)
        [verdict] = await self._take(keys=keys, args=[path, run])
        return str(verdict)

    async def acquire(
        self, key: str, holder: str, most: int, lease_ms: int, now_ms: int | None = None
    ) -> Slot:
        """Take a slot of a per-key limit (see lua/acquire.lua)."""
        now: str | int = "" if now_ms is None else now_ms
        reply = await self._acquire(keys=[self.keys.limit(key)], args=[holder, most, lease_ms, now])
        left = int(float(reply[2])) if len(reply) > 2 else None
        return Slot(reply[0], int(reply[1]), left)

    async def renew(self, key: str, holder: str, lease_ms: int, now_ms: int | None = None) -> Slot:
        """Start a holder's lease again (see lua/renew.lua)."""
        now: str | int = "" if now_ms is None else now_ms
        [verdict] = await self._renew(keys=[self.keys.limit(key)], args=[holder, lease_ms, now])
        return Slot(verdict)

    async def release(self, key: str, holder: str) -> Slot:
        """Give a holder's slot back (see lua/release.lua)."""
        verdict, held = await self._release(keys=[self.keys.limit(key)], args=[holder])
        return Slot(verdict, int(held))

    async def leaf_outputs(self, wf: str, leaves: list[tuple[str, int | None]]) -> list[str | None]:
        if not leaves:
            return []
        found = await self.client.mget([self.keys.output(wf, p, i) for p, i in leaves])
        return [None if value is None else str(value) for value in found]

    async def blobs(self, wf: str, names: list[str]) -> list[str | None]:
        if not names:
            return []
        found = await self.client.mget([self.keys.blob(wf, name) for name in names])
        return [None if value is None else str(value) for value in found]

    async def refs(self, wf: str, ids: list[str]) -> dict[str, str]:
        """The recorded outputs of the steps with these ids (one MGET)."""
        if not ids:
            return {}
        found = await self.client.mget([self.keys.ref(wf, name) for name in ids])
        return {
            name: str(value) for name, value in zip(ids, found, strict=True) if value is not None
        }

    async def outputs(self, wf: str, path: str, size: int | None, limit: int) -> Stored:
        """A step's recorded outputs: their sizes first, so a step over `limit` is never read."""
        if size is None:
            names = [self.keys.output(wf, path)]
        else:
            names = [self.keys.output(wf, path, i) for i in range(size)]
        if not names:  # a map over no items
            return Stored([], 0)
        async with self.client.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.strlen(name)
            lengths = await pipe.execute()
        total = sum(lengths)
        if total > limit or 0 in lengths:  # outputs are JSON: never empty once recorded
            return Stored(None, total)
        values = await self.client.mget(names)
        if any(value is None for value in values):
            return Stored(None, total)
        return Stored([str(value) for value in values], total)

    async def purge(self, wf: str, statuses: str, ended_before_ms: int) -> str:
        """Delete an ended program now (see lua/purge.lua)."""
        reply: str = await self._purge(keys=[self.keys.state(wf)], args=[statuses, ended_before_ms])
        return reply

    async def purge_many(
        self, wfs: Sequence[str], statuses: str, ended_before_ms: int
    ) -> list[str]:
        """`purge` each of `wfs` in one pipeline (on a cluster, one per node: each call has
        its program's keys only): one round trip for the page, not one per program."""
        script = self._by_name["purge"]
        replies: list[Any] = [None] * len(wfs)
        todo = list(range(len(wfs)))
        for _ in range(2):  # again once, for those that met a node without the script
            async with self.client.pipeline(transaction=False) as pipe:
                for i in todo:
                    pipe.execute_command(
                        "EVALSHA", script.sha, 1, self.keys.state(wfs[i]), statuses, ended_before_ms
                    )
                found = await pipe.execute(raise_on_error=False)
            for i, reply in zip(todo, found, strict=True):
                replies[i] = reply
            todo = [i for i in todo if isinstance(replies[i], NoScriptError)]
            if not todo:
                break
            await self.client.script_load(script.script)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return [str(reply) for reply in replies]

    async def mark(self, wf: str, key: str, field: str, value: str) -> bool:
        """Write a field of one of the program's marks (a hash it names in its registry), only
        while the program is there (see lua/mark.lua); whether it was."""
        reply = await self._mark(keys=[self.keys.state(wf), key], args=[field, value])
        return bool(reply == "marked")

    async def unindex(self, key: str, bounds: Mapping[str, float]) -> int:
        """Take ids out of an index where each one's score is still at most its bound (see
        lua/unindex.lua); how many."""
        args = [part for wf, bound in bounds.items() for part in (wf, bound)]
        return int(await self._unindex(keys=[key], args=args)) if args else 0

    async def reindex(self, key: str, at: Mapping[str, int], slack_ms: int = 0) -> int:
        """Put ids in an index at these times where an entry is missing or older by more
        than `slack_ms` (see lua/reindex.lua); how many were written."""
        args = [part for wf, ms in at.items() for part in (wf, ms)]
        return int(await self._reindex(keys=[key], args=[slack_ms, *args])) if args else 0

    async def now(self) -> float:
        seconds, micros = await self.client.time()  # a cluster's: its default node's
        return float(seconds) + int(micros) / 1e6

    async def ends(self, wfs: Sequence[str]) -> list[tuple[str | None, str | None]]:
        async with self.client.pipeline(transaction=False) as pipe:  # split per node on a cluster
            for wf in wfs:
                pipe.hmget(self.keys.state(wf), "status", "ended_ms")
            found = await pipe.execute()
        return [(status, ended) for status, ended in found]

    async def programs(self) -> AsyncIterator[str]:
        """Every program of this prefix: SCAN MATCHes our state keys only (the server still
        walks every key, COUNT at a time, but sends back only ours), one reply held at a time."""
        pattern = self.keys.state("*")
        start = len(self.keys.prefix) + 2
        async for key in self.client.scan_iter(match=pattern, count=SCAN_COUNT, _type="HASH"):
            yield key[start : -len("}:state")]

    async def track(self, wf: str, owner: int) -> None:
        """Count a program as in flight on its owner shard (before it is recorded)."""
        async with self.client.pipeline(transaction=False) as pipe:  # one round trip
            pipe.sadd(self.keys.live(owner), wf)
            pipe.sadd(self.keys.shards_used, str(owner))
            await pipe.execute()

    async def untrack(self, wf: str, owner: int) -> None:
        """The program ended: idempotent, so every redelivery of its end may call it. Noted in
        the ended index, by when (a later call moves it later: the prune only ever comes
        later for it; no GT, which needs Redis 6.2) when programs are kept for a time. A
        program redriven since the caller read it (the router tracks it before and after its
        script) is counted again, as `reopened` decides."""
        state = self.keys.state(wf)
        cluster = isinstance(self.client, RedisCluster)  # its pipelines keep no order
        async with self.client.pipeline(transaction=False) as pipe:  # keys of several slots
            pipe.srem(self.keys.live(owner), wf)
            if self.retention_ms > 0:  # kept for good: so is its entry in the creation index
                pipe.zadd(self.keys.index_ended, {wf: time.time() * 1000})
            if not cluster:  # read after the SREM, in the same round trip
                pipe.hmget(state, "status", "owner")
            replies = await pipe.execute()
        found: list[str | None] = (
            await self.client.hmget(state, "status", "owner")  # type: ignore[misc,assignment]
            if cluster
            else replies[-1]
        )
        if reopened(found, owner):
            await self.track(wf, owner)

    async def in_flight(self, shard: int) -> int:
        return int(await self.client.scard(self.keys.live(shard)))  # type: ignore[misc]

    async def live(self, shard: int) -> AsyncIterator[str]:
        async for wf in self.client.sscan_iter(self.keys.live(shard), count=500):
            yield wf

    async def live_page(self, shard: int, cursor: str, count: int) -> tuple[str, list[str]]:
        found, wfs = await self.client.sscan(self.keys.live(shard), int(cursor), count=count)  # type: ignore[misc]
        return str(found), [wf if isinstance(wf, str) else wf.decode() for wf in wfs]

    async def shards_used(self) -> set[int]:
        return {int(s) for s in await self.client.smembers(self.keys.shards_used)}  # type: ignore[misc]

    async def plan(self, wf: str) -> dict[str, Any] | None:
        """The recorded program, input and owner."""
        text = await self.client.get(self.keys.plan(wf))
        return None if text is None else json.loads(text)

    async def state(self, wf: str) -> dict[str, str]:
        """The program's state hash (empty when there is no such program)."""
        if self.pipeliner is not None:  # the worker's check before every task
            found: dict[str, str] = await self.pipeliner.execute("HGETALL", self.keys.state(wf))
            return found
        state: dict[str, str] = await self.client.hgetall(self.keys.state(wf))  # type: ignore[assignment]
        return state

    async def brief(self, wf: str) -> dict[str, str]:
        key = self.keys.state(wf)
        if self.pipeliner is not None:
            found = await self.pipeliner.execute("HMGET", key, *BRIEF)
        else:
            found = await self.client.hmget(key, BRIEF)  # type: ignore[misc]
        if found[0] is None:  # no status: no such program
            return {}
        return {name: value for name, value in zip(BRIEF, found, strict=True) if value is not None}
