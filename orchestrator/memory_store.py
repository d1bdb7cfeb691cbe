"""A pure-Python model of the Lua transitions: their executable specification.

`MemoryStore` keeps the same keys, with the same values, as the scripts keep in Redis, and
answers every call with the same verdict. `tests/test_store_model.py` drives it and the real
Lua with the same drawn calls and compares verdicts and every key after each call. It is also a
`Store` for tests that need no Redis. Read a method beside its script: they are meant to match
line for line.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, Literal

from orchestrator.keys import Keys
from orchestrator.paths import SAGA, live_status, parent_of, scope_of
from orchestrator.program import MAX_BAG
from orchestrator.store import (
    BRIEF,
    MAX_ATTEMPTS,
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
    purge_verdict,
    reopened,
)

# A list holds a Redis list, or a sorted set's members in score order (ids by sequence).
Value = str | dict[str, str] | set[str] | list[str]
# complete.lua's INLINE: outputs over it are read back by the owner, not carried.
INLINE = 65536


def _now_ms() -> str:
    return str(int(time.time() * 1000))


class MemoryStore:
    """Program state in a dict: key -> string, hash (dict), set or list, as Redis holds it."""

    # Bounds of lua/signal.lua (lowered by the model test, to reach them).
    signals_waiting = MAX_SIGNALS_WAITING
    signal_ids = MAX_SIGNAL_IDS

    def __init__(
        self, keys: Keys, clock: Callable[[], str] = _now_ms, retention_ms: int = 0
    ) -> None:
        self.keys = keys
        self.data: dict[str, Value] = {}
        # key -> retention set on it (the model does not expire keys: it records the PEXPIRE)
        self.ttl: dict[str, int] = {}
        self.retention_ms = retention_ms
        self._clock = clock

    async def load_scripts(self) -> None:
        pass

    async def close(self) -> None:
        pass

    # --- helpers: the few Redis commands the scripts use ----------------------------------

    def _hash(self, key: str) -> dict[str, str]:
        value = self.data.setdefault(key, {})
        assert isinstance(value, dict), f"{key}: not a hash"
        return value

    def _set(self, key: str) -> set[str]:
        value = self.data.setdefault(key, set())
        assert isinstance(value, set), f"{key}: not a set"
        return value

    def _list(self, key: str) -> list[str]:
        value = self.data.setdefault(key, [])
        assert isinstance(value, list), f"{key}: not a list"
        return value

    def _get(self, key: str) -> str | None:
        value = self.data.get(key)
        assert value is None or isinstance(value, str), f"{key}: not a string"
        return value

    def _drop_if_empty(self, key: str) -> None:
        # Redis deletes a hash or set whose last member went.
        if self.data.get(key) in ({}, set(), []):
            del self.data[key]

    def _register(self, wf: str, *keys: str) -> None:
        self._set(self.keys.registry(wf)).update(keys)

    def _expire_all(self, wf: str) -> None:
        """Every key of an ended program gets the retention (advance.lua, cancel.lua)."""
        if self.retention_ms <= 0:
            return
        owned = self.data.get(self.keys.registry(wf))
        names = set(owned) if isinstance(owned, set) else set()
        names |= {self.keys.registry(wf), self.keys.plan(wf), self.keys.state(wf)}
        for name in names:
            if name in self.data:
                self.ttl[name] = self.retention_ms

    def _delete(self, *names: str) -> None:
        for name in names:
            self.data.pop(name, None)
            self.ttl.pop(name, None)

    def _hmget(self, key: str, *fields: str) -> list[str | None]:
        found = self.data.get(key)
        held = found if isinstance(found, dict) else {}
        return [held.get(name) for name in fields]

    # --- the five transitions -------------------------------------------------------------

    async def submit(self, wf: str, plan: str, owner: int, name: str, digest: str) -> Recorded:
        """lua/submit.lua"""
        status, found_owner, found_digest = self._hmget(
            self.keys.state(wf), "status", "owner", "digest"
        )
        if status is not None:
            conflict = found_digest is not None and found_digest != digest
            return Recorded(False, status, int(found_owner or 0), conflict)
        self.data[self.keys.plan(wf)] = plan
        state = self._hash(self.keys.state(wf))
        state.update(status="pending", owner=str(owner), cursor="", name=name, digest=digest)
        state.update({"from": "", "created_ms": self._clock()})
        return Recorded(True, "pending", owner)

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
        """lua/advance.lua"""
        key = self.keys.state(wf)
        now_status, now_cursor, came_from, run, since = self._hmget(
            key, "status", "cursor", "from", "epoch", "updated_ms"
        )
        if now_status is None:
            return Verdict("missing", "", "")
        if epoch is not None and str(epoch) != (run or "0"):
            return Verdict("stale", now_status, now_cursor or "")
        main_cursor, main_from = now_cursor, came_from
        here = key  # the hash whose cursor moves
        bag, member, size, inside = "", 0, 0, True
        saga = scope == SAGA
        if saga:  # the compensations' cursor: "" until they start
            here = self.keys.branch(wf, scope)
            found_cursor, came_from, since = self._hmget(here, "cursor", "from", "updated_ms")
            now_cursor = found_cursor or ""
        elif scope:
            here = self.keys.branch(wf, scope)
            now_cursor, came_from, since = self._hmget(here, "cursor", "from", "updated_ms")
            if now_cursor is None:
                return Verdict("stale", now_status, "")  # no such branch was opened
            parent = parent_of(scope)
            if parent is None:
                return Verdict("stale", now_status, "")
            bag, member = parent
            outer = scope_of(bag)
            holder = self.keys.branch(wf, outer) if outer else key
            # the bag's size, and whether the scope around it still stands at the bag
            shape, outer_cursor = self._hmget(holder, "leaf", "cursor")
            size = int(shape[4:]) if shape and shape.startswith("bag:") else 0
            inside = outer_cursor == bag

        def joined() -> bool:
            if not scope or cursor or not size:
                return False
            found = self.data.get(self.keys.barrier(wf, bag))
            return isinstance(found, set) and len(found) >= size

        live = now_status in ("pending", "running")
        if saga:
            live = now_status == "compensating"
        # ends the program: its keys expire (compensating does not: the compensations run)
        ending = status not in ("running", "compensating")
        if live and now_cursor == expected:
            if not inside:  # the bag was left (a stray `next`): its branches move no more
                return Verdict("stale", now_status, now_cursor or "")
            now = self._clock()
            elapsed = max(int(now) - int(since), 0) if since else None
            self._hash(here).update(cursor=cursor, leaf=leaf, updated_ms=now)
            # A start of the program's own cursor comes from its `prior` (a redriven run's).
            start = not expected and not scope
            came = (self._hash(key).get("prior") or "") if start else expected
            self._hash(here)["from"] = came
            state = self._hash(key)
            if saga:
                self._register(wf, here)
                if ending:
                    state.update(status=status, updated_ms=now)
            elif not scope:
                state["status"] = status
            elif status != "running":  # a branch ends the program: from its outermost bag
                state.update(status=status, cursor="", leaf="", updated_ms=now)
                state["from"] = main_cursor or ""
                came_from = main_from
            elif not cursor:  # the branch is over: its output is its bag member's
                barrier = self._set(self.keys.barrier(wf, bag))
                if str(member) not in barrier:
                    barrier.add(str(member))
                    out = self.keys.output(wf, bag, member)
                    self.data[out] = payload
                    self._register(wf, self.keys.barrier(wf, bag), out)
                self._drop_if_empty(self.keys.barrier(wf, bag))
            if now_status == "pending":
                state["started_ms"] = now
            if field:
                state[field] = payload
            if ending:
                state["ended_ms"] = now
            if status != "running" and not saga:
                state["prior"] = came_from or ""
            if status == "compensating" and not saga:
                state["cause"] = "failed"
            registry = self.keys.registry(wf)
            base = self.keys.state(wf).removesuffix("state")
            for opened_scope, first, shape in opened:
                branch = self.keys.branch(wf, opened_scope)
                self.data[branch] = {
                    "cursor": first, "from": "", "leaf": shape, "updated_ms": now
                }  # fmt: skip
                self._register(wf, branch)
            for name, text in refs:  # the outputs of the steps it moved past, latest wins
                self.data[self.keys.ref(wf, name)] = text
                self._register(wf, self.keys.ref(wf, name))
            if output is not None:  # the finished task's own, latest wins
                self.data[self.keys.output(wf, expected)] = output
                self._register(wf, self.keys.output(wf, expected))
            if drop:
                for name in sorted(self._set(registry)):
                    path = name.removeprefix(base).partition(":")[2]
                    if (path + "/").startswith(drop):  # "3/iter:4" (a wait) goes too
                        self._delete(name)
                        self._set(registry).discard(name)
                self._drop_if_empty(registry)
                marks = self.data.get(base + "attempts")
                if isinstance(marks, dict):
                    for name in [name for name in marks if name.startswith(drop)]:
                        del marks[name]
                    self._drop_if_empty(base + "attempts")
            if ending:
                self._expire_all(wf)
            return Verdict("applied", status, cursor, joined(), elapsed)
        if came_from == expected:
            return Verdict("replay", now_status, now_cursor or "", joined())
        # A redriven run's start came from its `prior`: redelivered while the cursor stands
        # where it put it, a replay too.
        again = bool(not expected and not scope and now_cursor and now_cursor == cursor)
        if again and came_from == (self._hash(key).get("prior") or ""):
            return Verdict("replay", now_status, now_cursor or "", joined())
        return Verdict("stale", now_status, now_cursor or "")

    def _scoped(self, wf: str, path: str, *fields: str) -> list[str | None]:
        """The state's fields as a leaf at `path` sees them: a branch's cursor and leaf
        are its own (complete.lua, fail.lua, take.lua)."""
        found = self._hmget(self.keys.state(wf), *fields)
        scope = scope_of(path)
        if scope:
            mine = self._hmget(self.keys.branch(wf, scope), "cursor", "leaf")
            for name, value in zip(("cursor", "leaf"), mine, strict=True):
                if name in fields:
                    found[fields.index(name)] = value
        return found

    def _left(self, wf: str, path: str) -> bool:
        """Whether the bag of the branch a leaf at `path` runs in was left: the scope around
        the bag no longer stands at it (advance.lua's fence; complete.lua, fail.lua and
        take.lua apply it to a branch's leaf)."""
        scope = scope_of(path)
        parent = parent_of(scope) if scope and scope != SAGA else None
        if parent is None:
            return False
        bag = parent[0]
        outer = scope_of(bag)
        holder = self.keys.branch(wf, outer) if outer else self.keys.state(wf)
        return self._hmget(holder, "cursor")[0] != bag

    async def at(self, wf: str, path: str) -> dict[str, str]:
        state = await self.state(wf)
        scope = scope_of(path)
        if scope and state:
            fields = ("cursor", "from", "leaf", "updated_ms")
            found = self._hmget(self.keys.branch(wf, scope), *fields)
            state.update({k: v or "" for k, v in zip(fields, found, strict=True)})
        return state

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
        """lua/complete.lua"""
        status, cursor, leaf, run = self._scoped(wf, path, "status", "cursor", "leaf", "epoch")
        if status is None:
            return Completion("missing", [])
        if self._late(wf, path, epoch) and self._record_late(wf, path, size, outputs):
            return Completion("late", [])
        if status != live_status(path) or cursor != path or str(epoch) != (run or "0"):
            return Completion("stale", [])
        if self._left(wf, path):  # a branch's leaf whose bag was left
            return Completion("stale", [])
        leaf = leaf or ""  # "" for a program started before leaves were recorded
        if None in outputs:
            if leaf not in ("", "task"):
                return Completion("invalid", [f"step {path} is a {leaf}, not a single task"])
            key = self.keys.output(wf, path)
            fired = self._get(key) is None
            if fired:
                self.data[key] = outputs[None]
                self._register(wf, key)
            self._settled(wf, path, 0)
            value = self._get(key) or ""
            return Completion("fire" if fired else "again", [] if len(value) > INLINE else [value])
        if leaf not in ("", f"bag:{size}"):
            return Completion("invalid", [f"step {path} is a {leaf}, not a bag of {size}"])
        for index in outputs:
            if not isinstance(index, int) or not 0 <= index < size:
                reason = f"bag member {index}: a bag of {size} has 0..{size - 1}"
                return Completion("invalid", [reason])
            # a branch member (its cursor opened with the bag) ends by its own advance
            if self.keys.branch(wf, f"{path}/branch:{index}") in self.data:
                return Completion("invalid", [f"bag member {index} of step {path} is a branch"])
        barrier = self._set(self.keys.barrier(wf, path))
        fired = False
        for index, output in outputs.items():
            if str(index) not in barrier:
                barrier.add(str(index))
                self.data[self.keys.output(wf, path, index)] = output
                self._register(wf, self.keys.barrier(wf, path), self.keys.output(wf, path, index))
                fired = True
            self._settled(wf, path, index or 0)
        self._drop_if_empty(self.keys.barrier(wf, path))
        if len(barrier) < size:
            return Completion("wait", [])
        members = [self._get(self.keys.output(wf, path, i)) or "" for i in range(size)]
        inline = sum(map(len, members)) <= INLINE
        return Completion("fire" if fired else "again", members if inline else [])

    def _late(self, wf: str, path: str, epoch: int) -> bool:
        """Whether the program is compensating from the step at `path` (it failed or was
        cancelled there), in run `epoch`: its started members still report (begin.lua)."""
        status, start, run = self._hmget(self.keys.state(wf), "status", "from", "epoch")
        return status == "compensating" and start == path and str(epoch) == (run or "0")

    def _record_late(
        self, wf: str, path: str, size: int, outputs: Mapping[int | None, str]
    ) -> bool:
        """complete.lua's late path: the outputs of members that had started, recorded."""
        late = False
        for index, output in outputs.items():
            if index is not None and not (isinstance(index, int) and 0 <= index < size):
                continue
            if not self._settled(wf, path, index or 0):
                continue
            late = True
            if index is None:
                key = self.keys.output(wf, path)
                if self._get(key) is None:
                    self.data[key] = output
                    self._register(wf, key)
                continue
            barrier = self._set(self.keys.barrier(wf, path))
            if str(index) not in barrier:
                barrier.add(str(index))
                self.data[self.keys.output(wf, path, index)] = output
                self._register(wf, self.keys.barrier(wf, path), self.keys.output(wf, path, index))
            self._drop_if_empty(self.keys.barrier(wf, path))
        return late

    def _settled(self, wf: str, path: str, index: int) -> bool:
        """A member no compensation waits for any more: out of the step's started hash (HDEL);
        whether it was in."""
        key = self.keys.started(wf, path)
        started = self.data.get(key)
        if not isinstance(started, dict) or str(index) not in started:
            return False
        del started[str(index)]
        self._drop_if_empty(key)
        return True

    async def begin(
        self, wf: str, path: str, indexes: list[int], epoch: int = 0, attempt: int = 0
    ) -> Completion:
        """lua/begin.lua"""
        status, cursor, leaf, run, start = self._hmget(
            self.keys.state(wf), "status", "cursor", "leaf", "epoch", "from"
        )
        if status is None:
            return Completion("missing", [])
        if str(epoch) != (run or "0"):
            return Completion("stale", [status, cursor or ""])
        if attempt < 0:
            return Completion("invalid", [f"attempt {attempt}: a whole number from 0"])
        if len(indexes) > MAX_BAG:
            return Completion("invalid", [f"a message of more than {MAX_BAG} members"])
        key = self.keys.started(wf, path)
        if status == "running" and cursor == path:
            found = re.fullmatch(r"bag:(\d+)", leaf or "")
            size = int(found.group(1)) if found else 1
            for index in indexes:
                if not 0 <= index < size:
                    return Completion("invalid", [f"member {index}: step {path} has 0..{size - 1}"])
            marks = self._hash(key)
            for index in indexes:
                if attempt > int(marks.get(str(index), "-1")):  # not a late earlier copy
                    marks[str(index)] = str(attempt)
            self._drop_if_empty(key)
            if indexes:
                self._register(wf, key)
            return Completion("go", [str(i) for i in indexes])
        if status == "compensating" and start == path:
            marked = self._hmget(key, *(str(i) for i in indexes))
            going = [str(i) for i, at in zip(indexes, marked, strict=True) if at == str(attempt)]
            if going:
                return Completion("go", going)
        return Completion("stale", [status, cursor or ""])

    async def started(self, wf: str, path: str) -> int:
        started = self.data.get(self.keys.started(wf, path))
        return len(started) if isinstance(started, dict) else 0

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
        """lua/fail.lua"""
        status, cursor, leaf, run = self._scoped(wf, path, "status", "cursor", "leaf", "epoch")
        if status is None:
            return Completion("missing", [])
        latest = self._hmget(self.keys.started(wf, path), str(index or 0))[0] == str(attempt)
        if self._late(wf, path, epoch) and latest:
            # a member started before the failure or cancel: no compensation waits for it now
            self._settled(wf, path, index or 0)
            self._hash(self.keys.failures(wf, path)).setdefault(f"{index or 0}:{attempt}", error)
            self._register(wf, self.keys.failures(wf, path))
            return Completion("late", [])
        if status != live_status(path) or cursor != path or str(epoch) != (run or "0"):
            return Completion("stale", [])
        if self._left(wf, path):  # a branch's leaf whose bag was left
            return Completion("stale", [])
        if not 1 <= max_attempts <= MAX_ATTEMPTS:
            reason = f"max attempts {max_attempts}: from 1 to {MAX_ATTEMPTS}"
            return Completion("invalid", [reason])
        if not 0 <= attempt < max_attempts:
            return Completion("invalid", [f"attempt {attempt}: from 0 to {max_attempts - 1}"])
        member = index or 0
        leaf = leaf or ""
        if leaf in ("sleep", "signal"):
            return Completion("invalid", [f"step {path} is a {leaf}: no task to fail"])
        if leaf.startswith("bag:"):
            size = int(leaf.removeprefix("bag:"))
        else:
            size = member + 1 if leaf == "" else 1  # "": started before leaves were recorded
        if not 0 <= member < size:
            reason = f"member {member}: step {path} has 0..{size - 1}"
            return Completion("invalid", [reason])
        failures = self._hash(self.keys.failures(wf, path))
        first = f"{member}:{attempt}" not in failures
        failures.setdefault(f"{member}:{attempt}", error)
        self._register(wf, self.keys.failures(wf, path))
        if latest:  # this attempt ended (a retry starts anew); an earlier one's does not count
            self._settled(wf, path, member)
        if attempt + 1 < max_attempts:
            return Completion("retry" if first else "again", [])
        errors = [failures.get(f"{member}:{a}", "?") for a in range(attempt + 1)]
        return Completion("exhausted" if first else "again", errors)

    async def cancel(
        self,
        wf: str,
        status: str,
        reason: str,
        epoch: int | None = None,
        compensates: bool = False,
        stop: bool = False,
    ) -> Ended | None:
        """lua/cancel.lua"""
        key = self.keys.state(wf)
        now_status, cursor, owner, came_from, run = self._hmget(
            key, "status", "cursor", "owner", "from", "epoch"
        )
        if now_status is None:
            return None
        if now_status == "compensating" and stop:  # stops the compensations
            now = self._clock()
            self._hash(key).update(
                status="compensation_failed",
                saga_error=f"compensations stopped by a cancel: {reason}",
                updated_ms=now,
                ended_ms=now,
            )
            self._expire_all(wf)
            return Ended(True, "compensation_failed", int(owner or 0))
        if now_status not in ("pending", "running"):
            return Ended(False, now_status, int(owner or 0))
        if epoch is not None and str(epoch) != (run or "0"):
            return Ended(False, now_status, int(owner or 0), stale=True)
        now = self._clock()
        state = self._hash(key)
        if compensates:  # its compensations run first: live, no expiry yet
            state.update(status="compensating", cause=status, error=reason, cursor="")
            state.update({"from": cursor or "", "updated_ms": now, "prior": came_from or ""})
            return Ended(True, "compensating", int(owner or 0))
        state.update(status=status, error=reason, cursor="", updated_ms=now, ended_ms=now)
        state["from"] = cursor or ""
        state["prior"] = came_from or ""
        self._expire_all(wf)
        return Ended(True, status, int(owner or 0))

    async def redrive(
        self, wf: str, epoch: int, rerun: str, prior: str, record: str, roots: list[str]
    ) -> Redriven:
        """lua/redrive.lua"""
        key = self.keys.state(wf)
        status, run, owner = self._hmget(key, "status", "epoch", "owner")
        if status is None:
            return Redriven("missing", "", 0, 0)
        found = int(run or "0")
        if status not in ("failed", "cancelled"):
            return Redriven("refused", status, found, int(owner or 0))
        if found != epoch:
            return Redriven("changed", status, found, int(owner or 0))
        state = self._hash(key)
        state[f"run:{found}"] = record
        state.pop(f"run:{found - MAX_RUNS}", None)
        state.update(status="pending", epoch=str(found + 1), cursor="", rerun=rerun, prior=prior)
        state.update({"from": "", "updated_ms": self._clock()})
        for name in ("error", "result", "ended_ms"):
            state.pop(name, None)

        def goes(path: str) -> bool:
            return any(path == root or path.startswith(root + "/") for root in roots)

        base = key.removesuffix("state")
        registry = self.keys.registry(wf)
        for name in sorted(self._set(registry)):
            path = name.removeprefix(base).partition(":")[2]
            if name != base + "attempts" and goes(path):
                self._delete(name)
                self._set(registry).discard(name)
            else:
                self.ttl.pop(name, None)
        self._drop_if_empty(registry)
        marks = self.data.get(base + "attempts")
        if isinstance(marks, dict):
            for name in [name for name in marks if goes(name)]:
                del marks[name]
            self._drop_if_empty(base + "attempts")
        for name in (registry, self.keys.plan(wf), key):
            self.ttl.pop(name, None)
        return Redriven("applied", "pending", found + 1, int(owner or 0))

    async def stash(self, wf: str, blobs: Mapping[str, str]) -> bool:
        """lua/stash.lua"""
        (status,) = self._hmget(self.keys.state(wf), "status")
        if status not in ("pending", "running", "compensating"):
            return False
        for name, value in blobs.items():
            self.data.setdefault(self.keys.blob(wf, name), value)
            self._register(wf, self.keys.blob(wf, name))
        return True

    async def signal(self, wf: str, name: str, data: str, signal_id: str = "") -> Verdict:
        """lua/signal.lua"""
        (status,) = self._hmget(self.keys.state(wf), "status")
        if status is None:
            return Verdict("missing", "", "")
        ids = self._list(self.keys.signal_ids(wf))
        if signal_id and signal_id in ids:
            self._drop_if_empty(self.keys.signal_ids(wf))
            return Verdict("duplicate", "", "")
        if status not in ("pending", "running"):
            self._drop_if_empty(self.keys.signal_ids(wf))
            return Verdict("ended", status, "")
        waiting = self._list(self.keys.signals(wf, name))
        if len(waiting) >= self.signals_waiting:
            self._drop_if_empty(self.keys.signal_ids(wf))
            return Verdict("full", str(len(waiting)), "")
        if signal_id:
            state = self._hash(self.keys.state(wf))
            state["signals"] = str(int(state.get("signals", "0")) + 1)
            ids.append(signal_id)
            del ids[: max(0, len(ids) - self.signal_ids)]
            self._register(wf, self.keys.signal_ids(wf))
        self._drop_if_empty(self.keys.signal_ids(wf))
        waiting.append(data)
        self._register(wf, self.keys.signals(wf, name))
        return Verdict("kept", str(len(waiting)), "")

    async def take(self, wf: str, path: str, name: str, epoch: int | None = None) -> str:
        """lua/take.lua"""
        status, run = self._hmget(self.keys.state(wf), "status", "epoch")
        if status is None:
            return "missing"
        if epoch is not None and str(epoch) != (run or "0"):
            return "stale"
        if self.keys.output(wf, path) in self.data:
            return "taken"
        _, cursor, leaf = self._scoped(wf, path, "status", "cursor", "leaf")
        if status != "running" or cursor != path or leaf != "signal":
            return "stale"
        if self._left(wf, path):  # a late take would consume a later step's signal
            return "stale"
        waiting = self._list(self.keys.signals(wf, name))
        if not waiting:
            self._drop_if_empty(self.keys.signals(wf, name))
            return "waiting"
        self.data[self.keys.output(wf, path)] = waiting.pop(0)
        self._drop_if_empty(self.keys.signals(wf, name))
        self._register(wf, self.keys.output(wf, path))
        return "taken"

    # --- per-key limits: a sorted set kept as holder -> expiry ms (str) ----------------------

    def _holders(self, key: str) -> dict[str, str]:
        return self._hash(self.keys.limit(key))

    def _leased(self, key: str, held: dict[str, str], now: int) -> None:
        """The key expires with its last lease (PEXPIRE), or is gone with its last holder."""
        name = self.keys.limit(key)
        if held:
            self.ttl[name] = max(int(score) for score in held.values()) - now
        else:
            self._delete(name)

    async def acquire(
        self, key: str, holder: str, most: int, lease_ms: int, now_ms: int | None = None
    ) -> Slot:
        """lua/acquire.lua"""
        now = int(self._clock()) if now_ms is None else now_ms
        held = self._holders(key)
        for name in [name for name, score in held.items() if int(score) <= now]:
            del held[name]  # run out: the slot is free again
        verdict: Literal["acquired", "held"] = "acquired"
        if holder in held:
            verdict = "held"
        elif len(held) >= most:
            first = min(held.items(), key=lambda pair: (int(pair[1]), pair[0]))
            return Slot("busy", len(held), int(first[1]) - now)
        held[holder] = str(now + lease_ms)
        self._leased(key, held, now)
        return Slot(verdict, len(held))

    async def renew(self, key: str, holder: str, lease_ms: int, now_ms: int | None = None) -> Slot:
        """lua/renew.lua"""
        now = int(self._clock()) if now_ms is None else now_ms
        held = self._holders(key)
        if holder not in held:
            self._drop_if_empty(self.keys.limit(key))
            return Slot("lost")
        held[holder] = str(now + lease_ms)
        self._leased(key, held, now)
        return Slot("renewed")

    async def release(self, key: str, holder: str) -> Slot:
        """lua/release.lua"""
        held = self._holders(key)
        removed = held.pop(holder, None) is not None
        if not held:
            self._delete(self.keys.limit(key))
        return Slot("released" if removed else "gone", len(held))

    async def purge(self, wf: str, statuses: str, ended_before_ms: int) -> str:
        """lua/purge.lua"""
        status, ended = self._hmget(self.keys.state(wf), "status", "ended_ms")
        verdict = purge_verdict(status, ended, statuses.split(","), ended_before_ms)
        if verdict != "purged":
            return verdict
        owned = self.data.get(self.keys.registry(wf))
        self._delete(*(owned if isinstance(owned, set) else ()))
        self._delete(self.keys.registry(wf), self.keys.plan(wf), self.keys.state(wf))
        return "purged"

    async def purge_many(
        self, wfs: Sequence[str], statuses: str, ended_before_ms: int
    ) -> list[str]:
        return [await self.purge(wf, statuses, ended_before_ms) for wf in wfs]

    async def now(self) -> float:
        return int(self._clock()) / 1000  # the clock its stamps are on, as Redis's TIME

    async def ends(self, wfs: Sequence[str]) -> list[tuple[str | None, str | None]]:
        found = [self._hmget(self.keys.state(wf), "status", "ended_ms") for wf in wfs]
        return [(status, ended) for status, ended in found]

    # --- shard membership and plain reads ---------------------------------------------------

    async def members(self, wf: str, path: str) -> int:
        barrier = self.data.get(self.keys.barrier(wf, path))
        return len(barrier) if isinstance(barrier, set) else 0

    async def leaf_outputs(self, wf: str, leaves: list[tuple[str, int | None]]) -> list[str | None]:
        return [self._get(self.keys.output(wf, path, index)) for path, index in leaves]

    async def blobs(self, wf: str, names: list[str]) -> list[str | None]:
        return [self._get(self.keys.blob(wf, name)) for name in names]

    async def refs(self, wf: str, ids: list[str]) -> dict[str, str]:
        found = {name: self._get(self.keys.ref(wf, name)) for name in ids}
        return {name: text for name, text in found.items() if text is not None}

    async def outputs(self, wf: str, path: str, size: int | None, limit: int) -> Stored:
        if size is None:
            found = [self._get(self.keys.output(wf, path))]
        else:
            found = [self._get(self.keys.output(wf, path, i)) for i in range(size)]
        total = sum(len(value or "") for value in found)
        if total > limit or None in found:
            return Stored(None, total)
        return Stored([value or "" for value in found], total)

    async def programs(self) -> AsyncIterator[str]:
        start, end = len(self.keys.prefix) + 2, -len("}:state")
        for key in sorted(self.data):
            if key.startswith(f"{self.keys.prefix}:{{") and key.endswith("}:state"):
                yield key[start:end]

    async def track(self, wf: str, owner: int) -> None:
        self._set(self.keys.live(owner)).add(wf)
        self._set(self.keys.shards_used).add(str(owner))

    async def untrack(self, wf: str, owner: int) -> None:
        self._set(self.keys.live(owner)).discard(wf)
        self._drop_if_empty(self.keys.live(owner))
        if self.retention_ms > 0:  # the ended index, by time: a later call moves it last
            ended = self.data.setdefault(self.keys.index_ended, [])
            assert isinstance(ended, list)
            if wf in ended:
                ended.remove(wf)
            ended.append(wf)
        if reopened(self._hmget(self.keys.state(wf), "status", "owner"), owner):
            await self.track(wf, owner)

    async def in_flight(self, shard: int) -> int:
        live = self.data.get(self.keys.live(shard))
        return len(live) if isinstance(live, set) else 0

    async def live(self, shard: int) -> AsyncIterator[str]:
        for wf in sorted(self._set(self.keys.live(shard))):
            yield wf
        self._drop_if_empty(self.keys.live(shard))

    async def live_page(self, shard: int, cursor: str, count: int) -> tuple[str, list[str]]:
        """As SSCAN: the cursor is the last id returned (ids in order), "0" at either end."""
        after = cursor.removeprefix("after:") if cursor != "0" else None
        ids = sorted(self._set(self.keys.live(shard)))
        self._drop_if_empty(self.keys.live(shard))
        page = [wf for wf in ids if after is None or wf > after][: max(1, count)]
        done = not page or page[-1] == ids[-1]
        return ("0" if done else f"after:{page[-1]}"), page

    async def shards_used(self) -> set[int]:
        used = self.data.get(self.keys.shards_used)
        return {int(shard) for shard in used} if isinstance(used, set) else set()

    async def plan(self, wf: str) -> dict[str, Any] | None:
        text = self._get(self.keys.plan(wf))
        return None if text is None else json.loads(text)

    async def state(self, wf: str) -> dict[str, str]:
        found = self.data.get(self.keys.state(wf))
        return dict(found) if isinstance(found, dict) else {}

    async def brief(self, wf: str) -> dict[str, str]:
        state = await self.state(wf)
        if "status" not in state:  # as RedisStore's: no status, no such program
            return {}
        return {name: state[name] for name in BRIEF if name in state}
