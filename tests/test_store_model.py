"""The model of the scripts and the real Lua agree: the same drawn calls, the same verdicts, and
the same keys with the same values after every call (timestamps compared by presence only).

`orchestrator/memory_store.py` is the executable specification of `lua/*.lua`; this test is
what keeps the two one. `scripts/mutants.py` plants differences in the Lua that it must catch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.asyncio import Redis

from orchestrator.keys import Keys
from orchestrator.memory_store import MemoryStore
from orchestrator.paths import scope_of
from orchestrator.redis_store import RedisStore
from orchestrator.store import Store, Verdict

WORKFLOWS = ["a", "b", "c"]  # a and b are submitted first; c only if drawn
PATHS = ["0", "1", "2/iter:0/0", "2/iter:1/0", "1/branch:1/0", "1/branch:1/1", "saga:1", "saga:0"]
# Leaves in parallel branches of the bag at step 1 (member 1, and a branch nested in it).
BRANCH_PATHS = ["1/branch:0/0", "1/branch:1/0/branch:0/0", "2/iter:0/0/branch:0/0"]
# Branch cursors an advance opens with its new leaf (scope, first leaf, its shape).
OPENED = [
    (),
    (("1/branch:1", "1/branch:1/0", "task"),),
    (("1/branch:0", "1/branch:0/0", "sleep"), ("1/branch:1", "1/branch:1/0", "bag:1")),
    (("1/branch:1/0/branch:0", "1/branch:1/0/branch:0/0", "task"),),
    (("2/iter:0/0/branch:0", "2/iter:0/0/branch:0/0", "signal"),),
]
PLANS = [
    json.dumps({"program": {"steps": [{"task": "t"}]}, "input": n, "owner": 0}) for n in (1, 2)
]
# Now and then an output over complete.lua's INLINE, which is then read back, not carried.
BIG = json.dumps("b" * 65536)
OUTPUTS = st.sampled_from(['"x"', "1", "[1, 2]", '{"v": 3}'] * 4 + [BIG])
RETENTION_MS = 3_600_000
SIGNALS = ["go", "stop"]
# The run a message belongs to: mostly the first (0), now and then a redriven one.
EPOCHS = st.sampled_from([0, 0, 0, 1, 2])
# Per-key limits: two keys, three holders, clocks (ms) far enough apart for leases to run out.
LIMIT_KEYS = ["k1", "k{2}"]
HOLDERS = ["h1", "h2", "h3"]
LEASE_MS = 5000
NOWS = st.sampled_from([1000, 3000, 6500, 9000, 14000])


def _outputs(size: int) -> st.SearchStrategy[dict[int | None, str]]:
    single = st.builds(lambda output: {None: output}, OUTPUTS)
    # mostly members of the bag; sometimes a hostile index outside it
    index = st.integers(0, size - 1) | st.sampled_from([-1, size])
    members = st.dictionaries(index, OUTPUTS, min_size=1, max_size=size)
    return single | members


Call = tuple[str, tuple[Any, ...]]


def calls(cursors: dict[str, list[str]]) -> st.SearchStrategy[Call]:
    """One call to a store. Paths are often the program's cursor as the model has it now (or
    an open branch's), so that drawn sequences reach deep states (a running leaf, a barrier, a
    last attempt, a branch's end filling its bag)."""

    def at(wf: str, paths: list[str]) -> st.SearchStrategy[str]:
        return st.sampled_from((cursors.get(wf) or [""]) * 3 + paths + BRANCH_PATHS)

    def record(wf: str) -> st.SearchStrategy[Call]:
        return st.tuples(at(wf, PATHS), st.integers(1, 3), EPOCHS).flatmap(
            lambda ps: _outputs(ps[1]).map(lambda out: ("record", (wf, ps[0], ps[1], out, ps[2])))
        )

    def advance(wf: str) -> st.SearchStrategy[Call]:
        # The scope is mostly the one the expected cursor runs in, as the owner passes it.
        scoped = at(wf, ["", *PATHS]).flatmap(
            lambda expected: st.tuples(
                st.just(expected),
                st.sampled_from(
                    [scope_of(expected)] * 4 + ["", "1/branch:1", "1/branch:0", "saga"]
                ),
            )
        ) | st.tuples(  # the saga's own moves: its start ("") and its groups, whatever the status
            st.sampled_from(["", "", "saga:0", "saga:1"]), st.just("saga")
        )
        return st.builds(
            lambda scoped, cursor, status, payload, leaf, drop, refs, epoch, opened, output: (
                "advance",
                (
                    wf,
                    scoped[0],
                    cursor,
                    status,
                    *payload,
                    leaf,
                    drop,
                    refs,
                    epoch,
                    *scoped[1:],
                    opened,
                    output,
                ),
            ),
            scoped,
            st.sampled_from(["", *PATHS, *BRANCH_PATHS]),
            st.sampled_from(
                ["running"] * 4
                + ["completed", "failed", "compensating", "compensated", "compensation_failed"]
            ),
            st.sampled_from([("", ""), ("result", "7"), ("error", "boom")]),
            st.sampled_from(["", "task", "bag:0", "bag:1", "bag:2", "bag:3", "sleep", "signal"]),
            # a loop iteration dropped as the loop moves on (keys under 2/iter:0/ go)
            st.sampled_from(["", "", "", "2/iter:0/", "2/iter:1/", "1"]),
            # outputs of steps read by id, recorded (latest wins) only when it applies
            st.sampled_from([(), (), (("a", '{"v": 1}'),), (("a", '"x"'), ("b2", "[1, 2]"))]),
            st.none() | EPOCHS,  # None: a start, whatever the run
            st.sampled_from(OPENED),
            # the finished task's output, carried by its worker: recorded only when it applies
            st.sampled_from([None, None, '{"o": 1}', '"o2"']),
        )

    def per_workflow(wf: str) -> st.SearchStrategy[Call]:
        submit = st.builds(
            lambda plan, owner, name, digest: ("submit", (wf, plan, owner, name, digest)),
            st.sampled_from(PLANS),
            st.integers(0, 3),
            st.sampled_from("xy"),
            st.sampled_from(["d1", "d2"]),
        )
        fail = st.builds(
            lambda path, index, attempt, error, most, epoch: (
                "fail",
                (wf, path, index, attempt, error, most, epoch),
            ),
            at(wf, PATHS),
            # Mostly reports that fit (so duplicates of one attempt are drawn often), and now
            # and then a hostile one: index -1 or past the bag, attempt and max out of range.
            st.sampled_from([None, 0, 1] * 3 + [2, -1]),
            st.sampled_from([0, 1] * 3 + [2, -1, 3]),
            st.sampled_from(["e1", "e2"]),
            st.sampled_from([2, 3] * 3 + [1, 0, 101]),
            EPOCHS,
        )
        cancel = st.builds(
            lambda status, epoch, compensates, stop: (
                "cancel",
                (wf, status, "r", epoch, compensates, stop),
            ),
            st.sampled_from(["cancelled", "failed"]),
            st.none() | EPOCHS,  # None: a user's cancel; a number: a deadline's run
            st.booleans(),  # the program names compensations: it turns compensating
            st.booleans(),  # --stop-compensations: a compensating program ends
        )
        redrive = st.builds(
            lambda epoch, rerun, prior, roots: (
                "redrive",
                (wf, epoch, rerun, prior, "failed\t1\t2\t0\tboom", roots),
            ),
            EPOCHS,
            st.sampled_from(["", *PATHS]),
            st.sampled_from(["", *PATHS]),
            st.lists(st.sampled_from(["0", "1", "2", "2/iter:0", "2/iter:1/0"]), max_size=3),
        )
        track = st.builds(
            lambda name, owner: (name, (wf, owner)),
            st.sampled_from(["track", "untrack"]),
            st.integers(0, 2),
        )
        stash = st.builds(
            lambda names, value: ("stash", (wf, dict.fromkeys(names, value))),
            st.lists(st.sampled_from(["input", *PATHS]), min_size=1, max_size=2, unique=True),
            st.sampled_from(['"s1"', '"s2"']),
        )
        purge = st.builds(
            lambda statuses, before: ("purge", (wf, statuses, before)),
            st.sampled_from(["completed,failed,cancelled", "cancelled", "completed"]),
            st.sampled_from([0, 2**62]),
        )
        signal = st.builds(
            lambda name, data, signal_id: ("signal", (wf, name, data, signal_id)),
            st.sampled_from(SIGNALS),
            st.sampled_from(['"d1"', '"d2"', "3"]),
            st.sampled_from(["", "", "i1", "i2", "i3"]),
        )
        take = st.builds(
            lambda path, name, epoch: ("take", (wf, path, name, epoch)),
            at(wf, PATHS),
            st.sampled_from(SIGNALS),
            st.none() | EPOCHS,  # None: not checked; a number: the run the owner read
        )
        begin = st.builds(  # tasks of a step that names compensations start (begin.lua)
            lambda path, indexes, epoch, attempt: ("begin", (wf, path, indexes, epoch, attempt)),
            at(wf, PATHS),
            st.lists(st.sampled_from([0, 1, 1, 2, -1]), min_size=1, max_size=3),
            EPOCHS,
            st.sampled_from([0, 0, 1, 2, -1]),  # fail's drawn attempts are 0..2 mostly
        )
        # Weighted toward the moves that change a live program; a cancel ends it.
        moves = {"advance": advance(wf), "record": record(wf), "fail": fail, "begin": begin}
        moves |= {"signal": signal, "take": take}
        others = {"submit": submit, "track": track, "cancel": cancel}
        others |= {"stash": stash, "purge": purge, "redrive": redrive}
        kinds = [*moves] * 4 + [*others]
        return st.sampled_from(kinds).flatmap(lambda kind: {**moves, **others}[kind])

    limit = st.one_of(
        st.builds(
            lambda key, holder, most, now: ("acquire", (key, holder, most, LEASE_MS, now)),
            st.sampled_from(LIMIT_KEYS),
            st.sampled_from(HOLDERS),
            st.sampled_from([1, 2, 2, 3]),
            NOWS,
        ),
        st.builds(
            lambda key, holder, now: ("renew", (key, holder, LEASE_MS, now)),
            st.sampled_from(LIMIT_KEYS),
            st.sampled_from(HOLDERS),
            NOWS,
        ),
        st.builds(
            lambda key, holder: ("release", (key, holder)),
            st.sampled_from(LIMIT_KEYS),
            st.sampled_from(HOLDERS),
        ),
    )
    # c is never submitted by the prelude: drawn now and then, for the missing verdicts
    programs = st.sampled_from(["a", "a", "b", "b", "c"]).flatmap(per_workflow)
    return st.sampled_from([programs] * 4 + [limit]).flatmap(lambda kind: kind)


def again(call: Call) -> Call:
    """The same call once more, with another payload where a re-run could bring one."""
    name, args = call
    if name == "fail":
        wf, path, index, attempt, error, most, epoch = args
        return name, (wf, path, index, attempt, "e2" if error == "e1" else "e1", most, epoch)
    if name == "record":
        wf, path, size, outputs, epoch = args
        return name, (wf, path, size, {index: '"rerun"' for index in outputs}, epoch)
    if name == "advance" and len(args) == 13 and args[-1] is not None:
        return name, (*args[:-1], '"rerun"')  # a carried output, from a task run again
    return call


async def dump(client: Redis, prefix: str) -> tuple[dict[str, Any], set[str]]:
    """Every key under the prefix, as the model holds it (hash, set, string or list), and the keys
    that carry an expiry."""
    keys = [key async for key in client.scan_iter(match=f"{prefix}:*", count=1000)]
    async with client.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.type(key)
        kinds = await pipe.execute()
        read = {"hash": pipe.hgetall, "set": pipe.smembers, "string": pipe.get}
        for key, kind in zip(keys, kinds, strict=True):
            if kind == "zset" and ":limit:" in key:  # holders with their lease expiry
                pipe.zrange(key, 0, -1, withscores=True)
            elif kind in ("list", "zset"):  # the model keeps a sorted set's members in order
                getattr(pipe, "lrange" if kind == "list" else "zrange")(key, 0, -1)
            else:
                read[kind](key)
        values = await pipe.execute()
        values = [
            {member: str(int(score)) for member, score in value}
            if ":limit:" in key and isinstance(value, list)
            else value
            for key, value in zip(keys, values, strict=True)
        ]
        for key in keys:
            pipe.pttl(key)
        ttls = await pipe.execute()
    expiring = {key for key, ttl in zip(keys, ttls, strict=True) if ttl > 0}
    return _normal(dict(zip(keys, values, strict=True))), expiring


def _normal(data: dict[str, Any]) -> dict[str, Any]:
    # Both take the time when they write; compare where a timestamp is, not its value.
    return {
        key: {f: ("<ms>" if f.endswith("_ms") else v) for f, v in value.items()}
        if isinstance(value, dict)
        else value
        for key, value in data.items()
    }


def _timeless(reply: Any) -> Any:
    """A reply with its step time (Verdict.elapsed_ms, from each one's clock) by presence."""
    if isinstance(reply, Verdict) and reply.elapsed_ms is not None:
        return dataclasses.replace(reply, elapsed_ms=0)
    return reply


def _verdict(name: str, reply: Any) -> Any:
    """What a call's reply says, as the scripts below name it."""
    if name == "submit":
        return "created" if reply.created else "exists"
    if name == "cancel":
        return "applied" if reply.now else "ended"
    if name == "stash":
        return "ok" if reply else "ended"
    return reply if isinstance(reply, str) else getattr(reply, "verdict", "")


async def _agree(
    model: MemoryStore,
    real: Store,
    client: Redis,
    script: list[tuple[Call, str]],
    *,
    expiry: bool = False,
) -> Any:
    """Each call of `script` on the model and on the real Lua: the same reply, the verdict
    the script names, then the same keys (and, with `expiry`, the same expiring ones); the
    last reply."""
    got: Any = None
    for n, ((name, args), verdict) in enumerate(script):
        expected = await getattr(model, name)(*args)
        got = await getattr(real, name)(*args)
        got, expected = _timeless(got), _timeless(expected)
        assert got == expected, f"call {n} {name}{args}: lua {got} != model {expected}"
        assert _verdict(name, got) == verdict, f"call {n} {name}{args}: {got}"
        state, expiring = await dump(client, model.keys.prefix)
        assert state == _normal(model.data), f"after call {n} {name}{args}"
        if expiry:
            assert expiring == set(model.ttl), f"expiry after call {n} {name}{args}"
    return got


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def test_the_model_and_the_lua_give_the_same_verdicts_and_state(
    keyspace: tuple[str, str], loop: asyncio.AbstractEventLoop
) -> None:
    redis_url, base = keyspace
    client = Redis.from_url(redis_url, decode_responses=True)

    @settings(max_examples=200)
    @given(data=st.data())
    def agree(data: st.DataObject) -> None:
        keys = Keys(f"{base}-{uuid.uuid4().hex[:8]}")
        real: Store = RedisStore(client, keys, RETENTION_MS)
        model = MemoryStore(keys, retention_ms=RETENTION_MS)
        for store in (real, model):  # low bounds, so that drawn calls reach them
            store.signals_waiting, store.signal_ids = 2, 2  # type: ignore[attr-defined]
        # Two programs submitted and started, so that most drawn calls meet a live one.
        prelude: list[Call] = [
            ("submit", ("a", PLANS[0], 1, "x", "d1")),
            ("submit", ("b", PLANS[0], 1, "x", "d1")),
            ("advance", ("a", "", "0", "running", "", "", "task")),
            ("advance", ("b", "", "1", "running", "", "", "bag:2", "", (), None, "", OPENED[1])),
        ]
        made: list[Call] = []
        for n in range(len(prelude) + data.draw(st.integers(1, 30), label="calls")):
            cursors = {
                wf: [
                    found.get("cursor", "")
                    for key, found in model.data.items()
                    if isinstance(found, dict)
                    and (key == keys.state(wf) or key.startswith(keys.branch(wf, "")))
                ]
                for wf in WORKFLOWS
            }
            if prelude:
                name, args = prelude.pop(0)
            elif made and data.draw(st.integers(0, 3), label=f"again {n}") == 0:
                # At least once means again: a call that took effect, redelivered (its payload
                # may differ, as a re-run task's output or error does).
                name, args = again(data.draw(st.sampled_from(made), label=f"call {n}"))
            else:
                name, args = data.draw(calls(cursors), label=f"call {n}")
            expected = loop.run_until_complete(getattr(model, name)(*args))
            got = loop.run_until_complete(getattr(real, name)(*args))
            got, expected = _timeless(got), _timeless(expected)
            assert got == expected, f"call {n} {name}{args}: lua {got} != model {expected}"
            if getattr(got, "verdict", None) not in ("stale", "missing", "invalid"):
                made.append((name, args))  # a call that changed something: worth repeating
            state, expiring = loop.run_until_complete(dump(client, keys.prefix))
            assert state == _normal(model.data), f"after call {n} {name}{args}"
            assert expiring == set(model.ttl), f"expiry after call {n} {name}{args}"
            for wf in WORKFLOWS:  # what a sweep reads of each program (Store.brief)
                briefs = [loop.run_until_complete(s.brief(wf)) for s in (real, model)]
                assert _normal({"b": briefs[0]}) == _normal({"b": briefs[1]}), f"brief {wf}"

    try:
        agree()
    finally:
        loop.run_until_complete(client.aclose())


def test_the_model_can_stand_in_for_redis_in_a_whole_run() -> None:
    """A program driven by hand through the model alone: the store a library user can test
    their own code against without Redis."""

    async def run() -> None:
        store = MemoryStore(Keys("m"))
        assert (await store.submit("w", PLANS[0], 2, "demo", "d")).created
        assert (await store.submit("w", PLANS[1], 2, "demo", "e")).conflict
        assert (await store.advance("w", "", "0", "running", leaf="bag:2")).verdict == "applied"
        assert (await store.record("w", "0", 2, {2: '"c"'})).verdict == "invalid"
        assert (await store.record("w", "0", 2, {1: '"b"'})).verdict == "wait"
        fired = await store.record("w", "0", 2, {0: '"a"', 1: '"late"'})
        assert (fired.verdict, fired.outputs) == ("fire", ['"a"', '"b"'])
        done = await store.advance("w", "0", "", "completed", "result", '["a", "b"]')
        assert (done.verdict, done.status) == ("applied", "completed")
        assert (await store.advance("w", "0", "", "completed")).verdict == "replay"
        assert (await store.cancel("w", "cancelled", "late")) is not None
        assert (await store.state("w"))["status"] == "completed"
        assert (await store.redrive("w", 0, "0", "", "", ["0"])).verdict == "refused"
        # A failed program runs again: a new epoch, the old run's messages stale.
        assert (await store.submit("f", PLANS[0], 2, "demo", "d")).created
        assert (await store.advance("f", "", "0", "running", leaf="task")).verdict == "applied"
        assert (await store.advance("f", "0", "", "failed", "error", "e")).verdict == "applied"
        assert (await store.redrive("f", 1, "0", "", "", ["0"])).verdict == "changed"
        again = await store.redrive("f", 0, "0", "", "failed\t\t\t0\te", ["0"])
        assert (again.verdict, again.status, again.epoch) == ("applied", "pending", 1)
        assert (await store.advance("f", "", "0", "running", leaf="task")).verdict == "applied"
        assert (await store.record("f", "0", 1, {None: "1"}, 0)).verdict == "stale"
        assert (await store.advance("f", "0", "", "completed", epoch=0)).verdict == "stale"
        assert (await store.record("f", "0", 1, {None: "1"}, 1)).verdict == "fire"
        assert (await store.state("f"))["run:0"] == "failed\t\t\t0\te"

    asyncio.run(run())


async def test_a_redrive_takes_out_the_keys_of_the_steps_it_reruns_and_keeps_the_rest(
    keyspace: tuple[str, str],
) -> None:
    """A bag that failed with one member done runs again from nothing after a redrive: its
    barrier and outputs go, so the rerun waits for every member, while the step before it keeps
    its output (the rerun's prev). The model and the real Lua, call by call."""
    redis_url, base = keyspace
    client = Redis.from_url(redis_url, decode_responses=True)
    keys = Keys(f"{base}-redrive")
    real: Store = RedisStore(client, keys, RETENTION_MS)
    model = MemoryStore(keys, retention_ms=RETENTION_MS)

    def moves(start: str, to: str, status: str, *payload: str, epoch: int = 0) -> Call:
        field, text = payload or ("", "")
        leaf = "bag:2" if to else ""
        return "advance", ("r", start, to, status, field, text, leaf, "", (), epoch)

    script: list[tuple[Call, str]] = [
        (("submit", ("r", PLANS[0], 1, "x", "d1")), "created"),
        (moves("", "0", "running"), "applied"),
        (("record", ("r", "0", 2, {0: '"a"', 1: '"b"'})), "fire"),
        (moves("0", "1", "running"), "applied"),
        (("record", ("r", "1", 2, {0: '"c"'})), "wait"),
        (moves("1", "", "failed", "error", "boom"), "applied"),
        (("redrive", ("r", 0, "1", "0", "failed\t\t\t0\tboom", ["1"])), "applied"),
        (moves("", "1", "running", epoch=1), "applied"),
        # Member 0's output of the failed run is gone: member 1 alone does not fill the bag.
        (("record", ("r", "1", 2, {1: '"d"'}, 1)), "wait"),
        (("record", ("r", "1", 2, {0: '"e"'}, 1)), "fire"),
    ]
    try:
        got = await _agree(model, real, client, script)
        assert got.outputs == ['"e"', '"d"']  # the rerun's own, in member order
        assert await real.leaf_outputs("r", [("0", 0), ("0", 1)]) == ['"a"', '"b"']
    finally:
        await client.aclose()


async def test_a_branch_member_is_never_completed_and_a_branch_moves_only_inside_its_bag(
    keyspace: tuple[str, str],
) -> None:
    """A completion for a bag member that is a branch is refused (the branch ends by its own
    advance); a branch's advance applies only while its bag is its outer scope's cursor, and
    its replays still answer replay; a bag inside a nested branch completes by the innermost
    branch's cursor. The model and the real Lua, call by call."""
    redis_url, base = keyspace
    client = Redis.from_url(redis_url, decode_responses=True)
    keys = Keys(f"{base}-fence")
    real: Store = RedisStore(client, keys, RETENTION_MS)
    model = MemoryStore(keys, retention_ms=RETENTION_MS)
    one = (("0/branch:1", "0/branch:1/0", "task"),)
    two = (("0/branch:0", "0/branch:0/0", "task"), ("0/branch:1", "0/branch:1/0", "task"))
    nested = (
        ("0/branch:0", "0/branch:0/0", "bag:1"),
        ("0/branch:0/0/branch:0", "0/branch:0/0/branch:0/0", "task"),
    )
    deep = (nested[0], ("0/branch:0/0/branch:0", "0/branch:0/0/branch:0/0", "bag:2"))

    def opens(wf: str, shape: str, opened: tuple[tuple[str, str, str], ...]) -> Call:
        return "advance", (wf, "", "0", "running", "", "", shape, "", (), None, "", opened)

    def moves(wf: str, path: str, to: str, status: str = "running", *payload: str) -> Call:
        """An advance in the scope `path` runs in: to `to` ("" ends the branch)."""
        field, text = payload or ("", "")
        leaf = "task" if to else ""
        return "advance", (wf, path, to, status, field, text, leaf, "", (), 0, scope_of(path))

    script: list[tuple[Call, str]] = [
        (("submit", ("w", PLANS[0], 1, "x", "d1")), "created"),
        (opens("w", "bag:3", one), "applied"),
        # A forged completion of the branch member, alone or beside a real member: refused,
        # nothing recorded (member 0 neither).
        (("record", ("w", "0", 3, {1: '"forged"'})), "invalid"),
        (("record", ("w", "0", 3, {0: '"a"', 1: '"forged"'})), "invalid"),
        (("record", ("w", "0", 3, {0: '"a"'})), "wait"),
        (("record", ("w", "0", 3, {2: '"c"'})), "wait"),
        # The branch's own end fills the barrier; a late completion of it is still refused.
        (moves("w", "0/branch:1/0", "", "running", "", '"b"'), "applied"),
        (("record", ("w", "0", 3, {1: '"late"'})), "invalid"),
        # A program moved past its bag (a stray `next`): its branches' advances are stale,
        # an end and a failure alike; a replay of a branch that ended before stays a replay.
        (("submit", ("f", PLANS[0], 1, "x", "d1")), "created"),
        (opens("f", "bag:2", two), "applied"),
        (moves("f", "0/branch:0/0", "", "running", "", '"x"'), "applied"),
        (moves("f", "0", "1"), "applied"),
        (moves("f", "0/branch:1/0", "", "running", "", '"y"'), "stale"),
        (moves("f", "0/branch:1/0", "", "failed", "error", "boom"), "stale"),
        (moves("f", "0/branch:0/0", "", "running", "", '"x"'), "replay"),
        # Nested: the outer scope is a branch, which moved past the inner bag.
        (("submit", ("n", PLANS[0], 1, "x", "d1")), "created"),
        (opens("n", "bag:1", nested), "applied"),
        (moves("n", "0/branch:0/0", "0/branch:0/1"), "applied"),
        (moves("n", "0/branch:0/0/branch:0/0", "", "running", "", '"z"'), "stale"),
        # A bag inside a nested branch: its members are taken by the innermost branch's cursor.
        (("submit", ("m", PLANS[0], 1, "x", "d1")), "created"),
        (opens("m", "bag:1", deep), "applied"),
        (("record", ("m", "0/branch:0/0/branch:0/0", 2, {0: '"p"'})), "wait"),
        (("record", ("m", "0/branch:0/0/branch:0/0", 2, {1: '"q"'})), "fire"),
    ]
    try:
        await _agree(model, real, client, script)
        assert model.data[keys.barrier("w", "0")] == {"0", "1", "2"}
        assert model.data[keys.output("w", "0", 1)] == '"b"'  # the branch's, not a forged one
        assert (await real.state("f"))["status"] == "running"
        assert await real.members("f", "0") == 1  # the stale end joined nothing
    finally:
        await client.aclose()


async def test_a_branch_leaf_whose_bag_was_left_takes_records_and_fails_nothing(
    keyspace: tuple[str, str],
) -> None:
    """A leaf in a branch whose bag was left (the scope around the bag moved on) is stale for
    take, complete and fail alike, nested branches too (advance.lua's fence): a late take
    consumes no signal, so the later step that waits for that name gets it. Inside an open
    bag the same calls count. The model and the real Lua, call by call."""
    redis_url, base = keyspace
    client = Redis.from_url(redis_url, decode_responses=True)
    keys = Keys(f"{base}-left")
    real: Store = RedisStore(client, keys, RETENTION_MS)
    model = MemoryStore(keys, retention_ms=RETENTION_MS)
    two = (("0/branch:0", "0/branch:0/0", "signal"), ("0/branch:1", "0/branch:1/0", "task"))
    nested = (
        ("0/branch:0", "0/branch:0/0", "bag:1"),
        ("0/branch:0/0/branch:0", "0/branch:0/0/branch:0/0", "signal"),
    )
    inner = "0/branch:0/0/branch:0/0"

    def opens(wf: str, shape: str, opened: tuple[tuple[str, str, str], ...]) -> Call:
        return "advance", (wf, "", "0", "running", "", "", shape, "", (), None, "", opened)

    def moves(wf: str, path: str, to: str, leaf: str = "task") -> Call:
        return "advance", (wf, path, to, "running", "", "", leaf, "", (), 0, scope_of(path))

    script: list[tuple[Call, str]] = [
        (("submit", ("s", PLANS[0], 1, "x", "d1")), "created"),
        (opens("s", "bag:2", two), "applied"),
        # Inside the open bag a branch's leaves count.
        (("take", ("s", "0/branch:0/0", "go")), "waiting"),
        (("fail", ("s", "0/branch:1/0", None, 0, "once", 3, 0)), "retry"),
        # A stray `next` moves the program past the bag to a signal step of the same name.
        (moves("s", "0", "1", "signal"), "applied"),
        (("signal", ("s", "go", '"for step 1"')), "kept"),
        (("take", ("s", "0/branch:0/0", "go")), "stale"),
        (("record", ("s", "0/branch:1/0", 1, {None: '"late"'})), "stale"),
        (("fail", ("s", "0/branch:1/0", None, 1, "late", 3, 0)), "stale"),
        (("fail", ("s", "0/branch:1/0", None, 0, "once", 3, 0)), "stale"),
        (("take", ("s", "1", "go")), "taken"),
        # Nested: the enclosing branch moved past the inner bag; then one still inside.
        (("submit", ("n", PLANS[0], 1, "x", "d1")), "created"),
        (opens("n", "bag:1", nested), "applied"),
        (("signal", ("n", "go", '"n"')), "kept"),
        (moves("n", "0/branch:0/0", "0/branch:0/1"), "applied"),
        (("take", ("n", inner, "go")), "stale"),
        (("submit", ("m", PLANS[0], 1, "x", "d1")), "created"),
        (opens("m", "bag:1", nested), "applied"),
        (("signal", ("m", "go", '"m"')), "kept"),
        (("take", ("m", inner, "go")), "taken"),
    ]
    try:
        await _agree(model, real, client, script)
        # The signal went to the step that waits for it, none to the abandoned branch.
        assert model.data[keys.output("s", "1")] == '"for step 1"'
        assert keys.output("s", "0/branch:0/0") not in model.data
        assert keys.output("s", "0/branch:1/0") not in model.data
        assert model.data[keys.failures("s", "0/branch:1/0")] == {"0:0": "once"}
        assert model.data[keys.signals("n", "go")] == ['"n"']  # kept, not taken
        assert model.data[keys.output("m", inner)] == '"m"'
    finally:
        await client.aclose()


async def test_a_saga_moves_only_while_compensating_in_its_own_scope(
    keyspace: tuple[str, str],
) -> None:
    """Saga compensation: a failure or a cancel turns the program compensating (no expiry),
    the saga's cursor (`cur:saga`) moves from "" group to group only while it is, reports of
    a compensation count only then, the end expires every key, and only a cancel that
    stops the compensations ends a compensating program (compensation_failed). The model and
    the real Lua, call by call."""
    redis_url, base = keyspace
    client = Redis.from_url(redis_url, decode_responses=True)
    keys = Keys(f"{base}-saga")
    real: Store = RedisStore(client, keys, RETENTION_MS)
    model = MemoryStore(keys, retention_ms=RETENTION_MS)

    def saga(wf: str, expected: str, to: str, status: str = "compensating", *more: str) -> Call:
        field, text = more or ("", "")
        leaf = "bag:2" if to else ""
        return "advance", (wf, expected, to, status, field, text, leaf, "", (), 0, "saga")

    script: list[tuple[Call, str]] = [
        (("submit", ("w", PLANS[0], 1, "x", "d1")), "created"),
        (("advance", ("w", "", "0", "running", "", "", "task")), "applied"),
        (("record", ("w", "0", 1, {None: '"booked"'})), "fire"),
        (("advance", ("w", "0", "1", "running", "", "", "task")), "applied"),
        # Not compensating yet: the saga does not move, its reports do not count.
        (saga("w", "", "saga:0"), "stale"),
        (("advance", ("w", "1", "", "compensating", "error", "boom", "")), "applied"),
        (("record", ("w", "1", 1, {None: '"late"'})), "stale"),
        (("advance", ("w", "1", "", "failed", "error", "boom", "")), "replay"),
        (saga("w", "", "saga:0"), "applied"),
        (saga("w", "", "saga:0"), "replay"),
        (("record", ("w", "saga:0", 2, {0: '"undone"'})), "wait"),
        (("fail", ("w", "saga:0", 1, 0, "busy", 2)), "retry"),
        (("fail", ("w", "saga:0", 1, 0, "busy", 2)), "again"),
        (("record", ("w", "saga:0", 2, {1: '"undone"'})), "fire"),
        (("record", ("w", "0", 1, {None: '"x"'})), "stale"),
        (saga("w", "saga:0", "", "compensated"), "applied"),
        (saga("w", "saga:0", "", "compensated"), "replay"),
        (("fail", ("w", "saga:0", 1, 1, "busy", 2)), "stale"),
        (("cancel", ("w", "cancelled", "late", None, True)), "ended"),
        (("redrive", ("w", 0, "0", "", "", ["0"])), "refused"),
        # A cancel turns it compensating; a deadline or a second cancel then leaves it so;
        # a cancel that stops the compensations ends it compensation_failed, every key
        # expiring.
        (("submit", ("c", PLANS[0], 1, "x", "d1")), "created"),
        (("advance", ("c", "", "0", "running", "", "", "bag:2")), "applied"),
        (("record", ("c", "0", 2, {0: '"a"'})), "wait"),
        (("cancel", ("c", "cancelled", "stop", None, True)), "applied"),
        (("record", ("c", "0", 2, {1: '"b"'})), "stale"),
        (("cancel", ("c", "failed", "deadline", 0, True)), "ended"),
        (saga("c", "", "saga:0"), "applied"),
        (("stash", ("c", {"input": '"big"'})), "ok"),
        (("purge", ("c", "completed,failed,cancelled", 2**62)), "live"),
        (("cancel", ("c", "cancelled", "again", None, True)), "ended"),
        (("cancel", ("c", "cancelled", "enough", None, True, True)), "applied"),
        (("record", ("c", "saga:0", 2, {0: '"a"'})), "stale"),
        (saga("c", "saga:0", "", "compensated"), "stale"),
        # Tasks that started before a failure run to their end: a late output is recorded
        # (to be undone), a late failure is never retried, and no new task starts.
        (("submit", ("l", PLANS[0], 1, "x", "d1")), "created"),
        (("advance", ("l", "", "0", "running", "", "", "bag:3")), "applied"),
        (("begin", ("l", "0", [0, 1], 0, 0)), "go"),
        (("record", ("l", "0", 3, {0: '"a"'})), "wait"),
        (("advance", ("l", "0", "", "compensating", "error", "boom", "")), "applied"),
        (("begin", ("l", "0", [2], 0, 0)), "stale"),
        (("begin", ("l", "0", [0, 1], 0, 0)), "go"),  # a redelivery of member 1 runs again
        (("record", ("l", "0", 3, {1: '"b"'})), "late"),
        (("record", ("l", "0", 3, {1: '"c"'})), "stale"),
        (("fail", ("l", "0", 1, 0, "e", 2)), "stale"),
        (("submit", ("m", PLANS[0], 1, "x", "d1")), "created"),
        (("advance", ("m", "", "0", "running", "", "", "task")), "applied"),
        (("begin", ("m", "0", [0], 0, 0)), "go"),
        (("fail", ("m", "0", None, 0, "e", 3)), "retry"),
        (("begin", ("m", "0", [0], 0, 1)), "go"),  # attempt 1 runs
        (("fail", ("m", "0", None, 0, "e", 3)), "again"),  # a late copy of attempt 0's report
        (("begin", ("m", "0", [0], 0, 0)), "go"),  # a late copy of attempt 0 runs, unmarked
        (("cancel", ("m", "cancelled", "stop", None, True)), "applied"),
        (("begin", ("m", "0", [0], 1, 1)), "stale"),
        (("begin", ("m", "0", [0], 0, 0)), "stale"),
        (("fail", ("m", "0", None, 0, "e", 3)), "stale"),  # attempt 1 is the one waited for
        (("fail", ("m", "0", None, 1, "e", 3)), "late"),
        (("fail", ("m", "0", None, 1, "e", 3)), "stale"),
        (("begin", ("m", "0", [0], 0, 1)), "stale"),
        # A single task that started before a cancel: its late output is recorded.
        (("submit", ("n", PLANS[0], 1, "x", "d1")), "created"),
        (("advance", ("n", "", "0", "running", "", "", "task")), "applied"),
        (("begin", ("n", "0", [0], 0, 0)), "go"),
        (("cancel", ("n", "cancelled", "stop", None, True)), "applied"),
        (("record", ("n", "0", 1, {None: '"late"'})), "late"),
        (("record", ("n", "0", 1, {None: '"again"'})), "stale"),
    ]
    try:
        await _agree(model, real, client, script, expiry=True)
        assert [await real.started("l", "0"), await model.started("l", "0")] == [0, 0]
        assert await real.leaf_outputs("n", [("0", None)]) == ['"late"']
        assert await real.leaf_outputs("l", [("0", 0), ("0", 1), ("0", 2)]) == ['"a"', '"b"', None]
        w, c = await real.state("w"), await real.state("c")
        assert (w["status"], w["cause"], w["from"], w["prior"]) == (
            "compensated",
            "failed",
            "1",
            "0",
        )
        assert (c["status"], c["cause"], c["error"]) == ("compensation_failed", "cancelled", "stop")
        assert c["saga_error"] == "compensations stopped by a cancel: enough"
    finally:
        await client.aclose()
