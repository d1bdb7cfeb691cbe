"""Programs drawn by hypothesis, and a tiny independent model of what running one must give.

Drawn programs use two tasks: `work`, whose output is a fixed function of where it runs
(`output_of`), and `boom`, which always fails. With `faults`, a third: `flaky`, whose
`args.fails` says how each attempt ends ("error": it raises, "timeout": it hangs past its
`timeout_s`) until an attempt past the list succeeds as `work` does; flaky tasks may carry a
retry policy, and programs a deadline. Conditions, and the lists maps run over, come from
templates whose meaning the model computes in plain Python, so the model shares no code with
the system.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st


def output_of(path: str, index: int | None) -> dict[str, Any]:
    """What `work` returns at a step path (and bag index): the same on every run, and
    different at every path (an output read back from another iteration shows)."""
    return {"v": zlib.crc32(f"{path}#{index}".encode()) % 5, "at": f"{path}#{index}"}


# A hanging attempt is cut off by the worker after this long (a real wait, kept tiny).
TIMEOUT_S = 0.001


def signal_data(path: str) -> dict[str, str]:
    """The data of the signal the signal step at `path` must take: signals are taken in the
    order sent, so the property test sends them in the order the model runs the steps."""
    return {"signal": path}


def attempt_error(kind: str, attempt: int) -> str:
    """The error a failing attempt of `flaky` reports (the worker's wording for a timeout)."""
    if kind == "timeout":
        return f"timed out after {TIMEOUT_S}s"
    return f"RuntimeError: attempt {attempt} fails"


def _task(pool: str | None, failing: bool) -> dict[str, Any]:
    step: dict[str, Any] = {"task": "boom" if failing else "work"}
    if pool is not None:
        step["pool"] = pool
    return step


def _flaky(pool: str | None, fails: list[str], retry: dict[str, Any] | None) -> dict[str, Any]:
    # No fails and no retry: the plain `work`, where a flaky task shrinks to.
    step: dict[str, Any] = {"task": "work"}
    if fails or retry:
        step = {"task": "flaky", "args": {"fails": fails}}
    if "timeout" in fails:
        step["timeout_s"] = TIMEOUT_S
    if retry is not None:
        step["retry"] = retry
    if pool is not None:
        step["pool"] = pool
    return step


def _flakies(pool: st.SearchStrategy[str | None]) -> st.SearchStrategy[dict[str, Any]]:
    """Tasks that fail some attempts (an error or a timeout), most of them then retried (time
    is abstract in the property test: delays vary the messages, never an order). A task
    fails for good only when it fails every attempt it has, a few times in ten."""

    def policy(most: int) -> st.SearchStrategy[dict[str, Any] | None]:
        retry = st.fixed_dictionaries(
            {
                "max_attempts": st.just(most),
                "backoff_s": st.sampled_from([0.0, 0.5, 30.0]),
                "factor": st.sampled_from([1.0, 2.0]),
            }
        )
        return st.none() | retry if most == 1 else retry

    fails = st.sampled_from(["error", "timeout"])
    return st.integers(1, 4).flatmap(
        lambda most: st.builds(_flaky, pool, st.lists(fails, max_size=most), policy(most))
    )


# A named pool: tests/test_drawn_programs.py runs a worker for it beside serial and parallel.
NAMED_POOL = "drawn"


def _bag(members: list[dict[str, Any]], chunk: int, pool: str | None) -> dict[str, Any]:
    # chunk 1 (one message per member) is the default, and where a bag shrinks to; so is
    # the bag's pool (parallel).
    bag: dict[str, Any] = {"bag": members, "chunk": chunk} if chunk > 1 else {"bag": members}
    if pool is not None:
        bag["pool"] = pool
    return bag


# Shorter than Redis's clock step (1 ms): a wake is always due when it comes, so the state
# machine never depends on real time (hypothesis replays a case and must see the same run).
SLEEP_S = 0.0001
SIGNAL = "go"
# A map's list: `k` items more than the loop's iteration (outside loops: k), at most 5.
MAP_LIST = "[0, 1, 2, 3, 4].filter(x, x < iteration + {k})"


@st.composite
def _maps(draw: st.DrawFn, member: st.SearchStrategy[dict[str, Any]]) -> dict[str, Any]:
    k = draw(st.integers(0, 3))
    # Mostly room for the list; now and then one item short, which fails the program.
    room = draw(st.sampled_from([2, 1, 3, -1]))
    step = {**draw(member), "map": MAP_LIST.format(k=k), "max_items": max(1, k + room)}
    chunk = draw(st.integers(1, 3))
    return {**step, "chunk": chunk} if chunk > 1 else step


def _items(source: str, iteration: int) -> int:
    """How many items a drawn map's list has (see MAP_LIST)."""
    if match := re.fullmatch(r"\[0, 1, 2, 3, 4\]\.filter\(x, x < iteration \+ (\d+)\)", source):
        return min(5, iteration + int(match[1]))
    raise AssertionError(f"no model for {source!r}")


def steps(
    depth: int = 0,
    max_bag: int = 50,
    fail_rate: int = 25,
    faults: bool = False,
    newer: bool = False,
    branches: bool = True,
    signals: bool = True,
    branchy: bool = False,
) -> st.SearchStrategy[list[Any]]:
    """A list of 1-4 steps; untiloops, choices and bags with parallel branches nest up to two
    deep. Shrinks toward plain passing tasks.

    Bags inside loops hold at most 5 members, so that a drawn program stays small to run.
    With `faults`, tasks and members are also drawn flaky (see `_flakies`). Branches hold no
    signal step: two waiting side by side would take the signals sent in either order.
    `branchy`: mostly bags of branches, nested too, for their bugs.
    """
    # 0 is where integers shrink to: make it mean "does not fail".
    fails = st.integers(0, fail_rate).map(lambda drawn: drawn == fail_rate)
    pools = st.sampled_from([None, "serial", "parallel", NAMED_POOL])
    bag_pools = st.sampled_from([None, NAMED_POOL, "parallel"])  # a bag's, or a member's own
    task = st.builds(_task, pools, fails)
    member = st.builds(_task, bag_pools, fails)
    if faults:  # one in three flaky
        task = st.one_of(task, task, _flakies(pools))
        member = st.one_of(member, member, _flakies(bag_pools))
    bag_size = max_bag if depth == 0 else min(max_bag, 5)
    bag = st.builds(
        _bag, st.lists(member, min_size=1, max_size=bag_size), st.integers(1, 4), bag_pools
    )  # fmt: skip
    mapped = _maps(member)
    # A durable timer: its output is its prev. Kept tiny, as the property test waits for it.
    sleep = st.just({"sleep_s": SLEEP_S})
    # Waits for a signal, which the property test sends at any time (see `signal_data`).
    signal = st.just({"signal": SIGNAL})
    # `newer`: mostly maps, sleeps and signals, in loops (with waits) more often, for their bugs.
    kinds = [mapped, mapped, sleep, signal, task] if newer else [task, bag, mapped, sleep, signal]
    if not signals:
        kinds.remove(signal)
    if depth < 2:
        flags = (faults, newer, branches, signals)
        kinds.append(untiloops(depth + 1, max_bag, fail_rate, *flags))
        kinds.append(choices(depth + 1, max_bag, fail_rate, *flags))
        if branches:
            fork = branched(depth + 1, member, max_bag, fail_rate, faults, newer, branchy)
            kinds += [fork] * (4 if branchy else 1)
    return st.lists(st.one_of(kinds), min_size=1, max_size=4 if depth == 0 else 2)


@st.composite
def branched(
    draw: st.DrawFn,
    depth: int,
    member: st.SearchStrategy[dict[str, Any]],
    max_bag: int,
    fail_rate: int,
    faults: bool,
    newer: bool,
    branchy: bool = False,
) -> dict[str, Any]:
    """A bag of 1-3 members, most of them parallel branches of steps (any kinds but signals,
    loops and nested branches included), the others single tasks."""
    members = []
    for _ in range(draw(st.integers(1, 3))):
        if draw(st.integers(0, 3)):
            inner = steps(depth, max_bag, fail_rate, faults, newer, signals=False, branchy=branchy)
            members.append({"steps": draw(inner)})
        else:
            members.append(draw(member))
    return {"bag": members}


@st.composite
def untiloops(
    draw: st.DrawFn,
    depth: int,
    max_bag: int,
    fail_rate: int,
    faults: bool = False,
    newer: bool = False,
    branches: bool = True,
    signals: bool = True,
) -> dict[str, Any]:
    body = draw(steps(depth, max_bag, fail_rate, faults, newer, branches, signals))
    single = "task" in body[-1] and "map" not in body[-1]  # its prev is {"v": ...}
    templates = ["iteration >= {k}"] + (["prev.v % {m} == 0"] if single else [])
    until = draw(st.sampled_from(templates)).format(
        k=draw(st.integers(0, 3)), m=draw(st.integers(1, 3))
    )
    loop = {"until": until, "max_iterations": draw(st.integers(1, 4)), "steps": body}
    if draw(st.integers(0, 3)) >= (2 if newer else 3):  # now and then a wait between them
        loop["interval_s"] = SLEEP_S
    return loop


@st.composite
def choices(
    draw: st.DrawFn,
    depth: int,
    max_bag: int,
    fail_rate: int,
    faults: bool,
    newer: bool,
    branches: bool = True,
    signals: bool = True,
) -> dict[str, Any]:
    """A choice of 1-3 cases over the loop iteration (some never or always hold), and now and
    then an otherwise; with neither holding, the program fails."""
    inner = steps(depth, max_bag, fail_rate, faults, newer, branches, signals)
    cases = []
    for _ in range(draw(st.integers(1, 3))):
        when = draw(st.sampled_from(["iteration >= {k}", "false", "true"]))
        body = draw(inner)
        cases.append({"when": when.format(k=draw(st.integers(0, 2))), "steps": body})
    step: dict[str, Any] = {"choice": cases}
    if draw(st.booleans()):
        step["otherwise"] = draw(inner)
    return step


@st.composite
def _with_refs(draw: st.DrawFn, drawn: list[Any]) -> list[Any]:
    """The same steps, now and then with an `id`, and tasks, bag members and maps reading an
    earlier step's output (`args_from: {"ref": "steps.<id>"}`, as a step may: one before it in
    its own list or in a list enclosing it, or in the top list of a loop's body once the loop
    is over). Most steps get both, so that a loop's step read after the loop (its latest
    iteration's output, read back from the store) is common. Shrinks to no ids and no
    references, and a reference to the nearest step first."""
    counter = iter(range(1000))
    often = st.integers(0, 3).map(bool)  # three times in four; shrinks to False

    def reading(member: dict[str, Any], visible: list[str]) -> dict[str, Any]:
        if not visible or not draw(often):
            return member
        name = draw(st.sampled_from(visible[::-1]))
        return {**member, "args_from": {"ref": f"steps.{name}"}}

    def walk(steps: list[Any], visible: list[str]) -> tuple[list[Any], list[str]]:
        """The steps with ids and references; the ids visible after them."""
        out = []
        for step in steps:
            step = dict(step)
            if "bag" in step:
                members, after = [], visible
                for member in step["bag"]:
                    if "steps" in member:  # a branch reads its own list and those around it
                        inner, _ = walk(member["steps"], visible)
                        members.append({"steps": inner})
                        after = after + [s["id"] for s in inner if "id" in s]
                    else:
                        members.append(reading(member, visible))
                step["bag"] = members
                visible = after  # the join waited for every branch: their own lists' steps
            elif "task" in step:  # a task or a map
                step = reading(step, visible)
            elif "until" in step:
                step["steps"], _ = walk(step["steps"], visible)
                body = [inner["id"] for inner in step["steps"] if "id" in inner]
                visible = visible + body  # the body ran at least once: its last run counts
            elif "choice" in step:
                step["choice"] = [
                    {**case, "steps": walk(case["steps"], visible)[0]} for case in step["choice"]
                ]
                if "otherwise" in step:
                    step["otherwise"] = walk(step["otherwise"], visible)[0]
            if draw(often):
                step = {"id": f"s{next(counter)}", **step}
                visible = [*visible, step["id"]]
            out.append(step)
        return out, visible

    return walk(drawn, [])[0]


def programs(
    max_bag: int = 50,
    fail_rate: int = 25,
    faults: bool = False,
    newer: bool = False,
    branches: bool = True,
    branchy: bool = False,
) -> st.SearchStrategy[dict[str, Any]]:
    """Whole programs of the grammar: tasks, bags of 1..max_bag, maps, sleeps, nested
    untiloops (some with waits between iterations), choices, bags with parallel branches,
    serial, parallel and a named pool (bags and members too), step ids and arguments read
    from earlier steps by id; with `faults`, also flaky tasks with retry policies and
    timeouts, and deadlines. `newer` draws mostly the newer kinds (maps, sleeps, waits);
    `branches=False` none (for checks that need one total order of leaves), `branchy` mostly
    bags of parallel branches."""
    drawn = (
        steps(0, max_bag, fail_rate, faults, newer, branches, branchy=branchy)
        .flatmap(_with_refs)
        .map(lambda s: {"name": "drawn", "steps": s})
    )
    if not faults:
        return drawn
    # Now and then a deadline: one of 1 ms is due whenever it comes, so it may end a program at
    # any point of its life; one of 60 s never is in a test (its message is sent on, delayed).
    deadline = st.sampled_from([None, None, None, None, 0.001, 60.0])
    return st.tuples(drawn, deadline).map(
        lambda pd: pd[0] if pd[1] is None else {**pd[0], "deadline_s": pd[1]}
    )


@dataclass
class Expected:
    """What the system must do: run `leaves` (path, size) in this order, then end so."""

    leaves: list[tuple[str, int]] = field(default_factory=list)
    status: str = "completed"
    result: Any = None
    error_prefix: str = ""
    # When it fails: every error it may end with, exactly (a bag ends with whichever of its
    # failing members is reported first).
    errors: list[str] = field(default_factory=list)
    # (path, bag index or None) -> the attempts a member may have, for every leaf it runs
    attempts: dict[tuple[str, int | None], int] = field(default_factory=dict)
    # The signal steps it runs, in order: each takes the next signal sent (signal_data).
    signals: list[str] = field(default_factory=list)
    # (path, bag index or None) -> the args its task messages carry (args_from included)
    args: dict[tuple[str, int | None], dict[str, Any]] = field(default_factory=dict)
    # the latest output of each step with an id, as the program goes
    refs: dict[str, Any] = field(default_factory=dict)
    # the input it is submitted with (tests/model.py's input_of), which limit keys read
    input: Any = None
    # (path, bag index or None) -> (key, max) of a limited task's slot (see with_limits)
    keys: dict[tuple[str, int | None], tuple[str, int]] = field(default_factory=dict)
    # leaf path -> the parallel branches it runs in, outermost first: (bag path, member)
    within: dict[str, tuple[tuple[str, int], ...]] = field(default_factory=dict)

    def position(self, path: str) -> int:
        return [leaf for leaf, _ in self.leaves].index(path)

    def side_by_side(self, first: str, then: str) -> bool:
        """Whether two leaves may run in either order (`first` listed before `then`): they
        are in different branches of one bag, or `then` is in a branch of the bag `first`
        (whose task members run beside its branches); else `first` ends before `then` starts."""
        mine, theirs = self.within.get(first, ()), self.within.get(then, ())
        if any(bag == first for bag, _ in theirs):
            return True
        member = dict(theirs)
        return any(bag in member and member[bag] != i for bag, i in mine)


class _Stop(Exception):
    pass


def expect(program: dict[str, Any]) -> Expected:
    """Interpret a drawn program the slow, obvious way."""
    expected = Expected(input=input_of(program))
    try:
        expected.result = _run(program["steps"], None, "", expected, 0)
    except _Stop:
        expected.result = None
    return expected


def _run(
    steps: list[Any],
    prev: Any,
    prefix: str,
    expected: Expected,
    iteration: int,
    within: tuple[tuple[str, int], ...] = (),
) -> Any:
    for k, step in enumerate(steps):
        path = f"{prefix}{k}"
        before = len(expected.leaves)
        try:
            if "choice" in step:
                held = [
                    k
                    for k, case in enumerate(step["choice"])
                    if _holds(case["when"], prev, iteration)
                ]
                if held:
                    k, branch = held[0], step["choice"][held[0]]["steps"]
                elif "otherwise" in step:
                    k, branch = len(step["choice"]), step["otherwise"]
                else:
                    error = f"step {path}: no case of the choice held, and it has no otherwise"
                    _fail(expected, error, [error])
                prev = _run(branch, prev, f"{path}/case:{k}/", expected, iteration, within)
            elif "sleep_s" in step:
                expected.leaves.append((path, 0))  # a leaf that runs no task; prev goes on
            elif "signal" in step:
                expected.leaves.append((path, 1))  # done when it took its signal
                expected.signals.append(path)
                prev = signal_data(path)
            elif "map" in step:
                size = _items(step["map"], iteration)
                if size > step["max_items"]:
                    error = (
                        f"step {path}: map {step['map']!r}: gave {size} items, more than "
                        f"max_items={step['max_items']}"
                    )
                    _fail(expected, error, [error])
                expected.leaves.append((path, size))
                errors = [_member(step, path, i, expected) for i in range(size)]
                if any(errors):
                    _fail(expected, f"step {path}/bag:", [e for e in errors if e is not None])
                prev = [output_of(path, i) for i in range(size)]
            elif "task" in step:
                expected.leaves.append((path, 1))
                error = _member(step, path, None, expected)
                if error is not None:
                    _fail(expected, error, [error])
                prev = output_of(path, None)
            elif "bag" in step and any("steps" in member for member in step["bag"]):
                prev = _branches(step["bag"], prev, path, expected, iteration, within)
            elif "bag" in step:
                members = step["bag"]
                expected.leaves.append((path, len(members)))
                errors = [_member(member, path, i, expected) for i, member in enumerate(members)]
                if any(errors):
                    _fail(expected, f"step {path}/bag:", [e for e in errors if e is not None])
                prev = [output_of(path, i) for i in range(len(members))]
            else:
                for n in range(step["max_iterations"]):
                    if n and "interval_s" in step:  # the wait before an iteration: a leaf
                        expected.leaves.append((f"{path}/iter:{n}", 0))
                    prev = _run(step["steps"], prev, f"{path}/iter:{n}/", expected, n, within)
                    if _holds(step["until"], prev, n):
                        break
                else:
                    error = (
                        f"step {path}: until {step['until']!r} not met after "
                        f"max_iterations={step['max_iterations']}"
                    )
                    _fail(expected, error, [error])
        finally:  # a failing step's leaves too
            for leaf, _ in expected.leaves[before:]:
                expected.within.setdefault(leaf, within)
        if "id" in step:  # it finished: later steps read its output (the latest, in a loop)
            expected.refs[step["id"]] = prev
    return prev


def _branches(
    members: list[Any],
    prev: Any,
    path: str,
    expected: Expected,
    iteration: int,
    within: tuple[tuple[str, int], ...],
) -> list[Any]:
    """A bag with parallel branches: every member runs (a failing one ends the program, but
    the others run side by side meanwhile, so any of their errors may be the one it ends
    with); the output lists the members' and branches' outputs in member order."""
    expected.leaves.append((path, len(members)))
    errors: list[str] = []
    outputs = []
    for i, member in enumerate(members):
        if "steps" not in member:
            error = _member(member, path, i, expected)
            errors += [error] if error is not None else []
            outputs.append(output_of(path, i))
            continue
        inner = (*within, (path, i))
        try:
            outputs.append(
                _run(member["steps"], prev, f"{path}/branch:{i}/", expected, iteration, inner)
            )
        except _Stop:
            errors += expected.errors
            expected.status, expected.errors, expected.error_prefix = "completed", [], ""
    if errors:
        _fail(expected, f"step {path}/", errors)
    return outputs


def _member(step: dict[str, Any], path: str, index: int | None, expected: Expected) -> str | None:
    """The error a task (or bag member) ends with after its last attempt, or None if it
    succeeds; notes how many attempts it may have, and the args it gets."""
    most = step["retry"]["max_attempts"] if "retry" in step else 1
    expected.attempts[(path, index)] = most
    args = dict(step.get("args", {}))
    for name, source in step.get("args_from", {}).items():
        args[name] = expected.refs[source.removeprefix("steps.")]
    expected.args[(path, index)] = args
    if "limit" in step:  # a map's items are 0, 1, ... (see MAP_LIST)
        item = index if "map" in step else None
        expected.keys[(path, index)] = key_of(step, expected.input, args, item)
    if step["task"] == "boom":
        errors = ["RuntimeError: boom"] * most
    elif step["task"] == "flaky" and len(step["args"]["fails"]) >= most:
        errors = [attempt_error(kind, n) for n, kind in enumerate(step["args"]["fails"][:most])]
    else:
        return None
    where = path if index is None else f"{path}/bag:{index}"
    if len(errors) == 1:
        return f"step {where}: task {step['task']!r}: {errors[0]}"
    tries = "; ".join(f"#{n}: {error}" for n, error in enumerate(errors, 1))
    return f"step {where}: task {step['task']!r} failed {len(errors)} attempts: {tries}"


def _holds(until: str, prev: Any, iteration: int) -> bool:
    if until in ("true", "false"):
        return until == "true"
    if match := re.fullmatch(r"iteration >= (\d+)", until):
        return iteration >= int(match[1])
    if match := re.fullmatch(r"prev\.v % (\d+) == 0", until):
        return bool(prev["v"] % int(match[1]) == 0)
    raise AssertionError(f"no model for {until!r}")


def _fail(expected: Expected, error_prefix: str, errors: list[str]) -> None:
    expected.status = "failed"
    expected.error_prefix = error_prefix
    expected.errors = errors
    raise _Stop


# --- per-key limits (#15 item 3) -----------------------------------------------------------
# A drawn program's input names a tenant (a fixed function of the program, so a replay submits
# the same); keys come from it, from `args.k` and from a map's item, so that programs (and the
# members of one map) share keys. Each key names its max ("m1:" or "m2:"): one max per key.
TENANTS = ("t0", "t1")
KEY_ARGS = ("a", "b")


def input_of(program: dict[str, Any]) -> dict[str, str]:
    """The input the property test submits a drawn program with."""
    digest = zlib.crc32(repr(program).encode())
    return {"tenant": TENANTS[digest % len(TENANTS)]}


# CEL key -> (max, the key in plain Python over input, args and item: the model's own)
LIMIT_KEYS: dict[str, tuple[int, Any]] = {
    "'m1:' + input.tenant": (1, lambda input, args, item: "m1:" + input["tenant"]),
    "'m2:' + input.tenant": (2, lambda input, args, item: "m2:" + input["tenant"]),
    "'m1:' + args.k": (1, lambda input, args, item: "m1:" + args["k"]),
    "'m2:' + input.tenant + args.k": (
        2,
        lambda input, args, item: f"m2:{input['tenant']}{args['k']}",
    ),
    "'m1:i' + string(item % 2)": (1, lambda input, args, item: f"m1:i{item % 2}"),
}
_ITEM_KEYS = ["'m1:i' + string(item % 2)"]


@st.composite
def _with_limits(draw: st.DrawFn, program: dict[str, Any]) -> dict[str, Any]:
    """The same program with a per-key limit on some tasks, bag members and maps (one in
    three; shrinks to none). A key over `args.k` gives the step that argument."""
    sometimes = st.integers(0, 2).map(lambda n: n == 2)

    def limited(member: dict[str, Any], mapped: bool) -> dict[str, Any]:
        if not draw(sometimes):
            return member
        key = draw(st.sampled_from([*LIMIT_KEYS][:4] + (_ITEM_KEYS if mapped else [])))
        member = {**member, "limit": {"key": key, "max": LIMIT_KEYS[key][0]}}
        if "args." in key:
            member["args"] = {**member.get("args", {}), "k": draw(st.sampled_from(KEY_ARGS))}
        return member

    def walk(steps: list[Any]) -> list[Any]:
        out = []
        for step in steps:
            step = dict(step)
            if "bag" in step:  # a branch member is no task: its own steps may be limited
                step["bag"] = [
                    {**member, "steps": walk(member["steps"])}
                    if "steps" in member
                    else limited(member, False)
                    for member in step["bag"]
                ]
            elif "task" in step:  # a task or a map
                step = limited(step, "map" in step)
            elif "until" in step:
                step["steps"] = walk(step["steps"])
            elif "choice" in step:
                step["choice"] = [{**case, "steps": walk(case["steps"])} for case in step["choice"]]
                if "otherwise" in step:
                    step["otherwise"] = walk(step["otherwise"])
            out.append(step)
        return out

    return {**program, "steps": walk(program["steps"])}


def with_limits(drawn: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    """Drawn programs, some of whose tasks, members and maps hold a slot of a per-key limit
    (max 1 or 2) while they run; submit them with `input_of(program)`."""
    return drawn.flatmap(_with_limits)


def key_of(step: dict[str, Any], input: Any, args: dict[str, Any], item: Any) -> tuple[str, int]:
    """The key (and max) the model computes for a limited task, bag member or map item."""
    most, compute = LIMIT_KEYS[step["limit"]["key"]]
    return compute(input, args, item), most


# --- saga compensation (#14 item 7) --------------------------------------------------------
# Top-level tasks and task members of top-level bags may name a compensation: mostly `work`
# (it succeeds; its output names the saga leaf it ran at), now and then `flaky` failing once
# and retried, or `boom` (the program then ends compensation_failed when it runs).


@st.composite
def _with_compensations(
    draw: st.DrawFn, program: dict[str, Any], often: bool = False
) -> dict[str, Any]:
    """The same program with a compensation on some top-level tasks and bag task members (one
    in three, or with `often` three in four; shrinks to none)."""
    sometimes = st.integers(0, 3 if often else 2).map(lambda n: n >= (1 if often else 2))
    undo = st.sampled_from(
        [
            {"task": "work"},
            {"task": "work"},
            {"task": "flaky", "args": {"fails": ["error"]}, "retry": {"max_attempts": 2}},
            {"task": "boom"},
        ]
    )

    def compensated(member: dict[str, Any]) -> dict[str, Any]:
        if "map" in member or not draw(sometimes):
            return member
        return {**member, "compensate": draw(undo)}

    steps = []
    for step in program["steps"]:
        if "bag" in step:
            step = {
                **step,
                "bag": [m if "steps" in m else compensated(m) for m in step["bag"]],
            }
        elif "task" in step:
            step = compensated(step)
        steps.append(step)
    return {**program, "steps": steps}


def with_compensations(
    drawn: st.SearchStrategy[dict[str, Any]], often: bool = False
) -> st.SearchStrategy[dict[str, Any]]:
    """Drawn programs, some of whose top-level tasks and bag members name a compensation
    (`often`: most of them)."""
    return drawn.flatmap(lambda program: _with_compensations(program, often))


def compensations(program: dict[str, Any]) -> list[tuple[int, list[tuple[int | None, str]]]]:
    """The steps that name compensations, in step order: (step, [(member or None, task)])."""
    found = []
    for n, step in enumerate(program["steps"]):
        if "bag" in step:
            members = [
                (i, m["compensate"]["task"]) for i, m in enumerate(step["bag"]) if "compensate" in m
            ]
            if members:
                found.append((n, members))
        elif "compensate" in step:
            found.append((n, [(None, step["compensate"]["task"])]))
    return found


def saga_plan(
    program: dict[str, Any], completed: Mapping[str, set[int]]
) -> list[tuple[str, list[tuple[int | None, str]]]]:
    """The groups a compensating program must run, last step first: per step with completed
    members that name a compensation, its leaf (`saga:<step>`) and those members (in member
    order) with their compensating task. `completed`: step path -> the members recorded (0
    for a single task)."""
    plan = []
    for n, members in reversed(compensations(program)):
        done = [(i, task) for i, task in members if (i or 0) in completed.get(str(n), set())]
        if done:
            plan.append((f"saga:{n}", done))
    return plan
