"""A shard owner handles messages of different programs side by side and each program's one at a
time in delivery order (orchestrator/ordering.py): pure, with stand-in work."""

import asyncio
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.ordering import ProgramOrder


class _Log:
    """Records when each message's work starts and ends, and how many run at once."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, int]] = []
        self.running: set[str] = set()
        self.most = 0

    async def work(self, key: str, n: int, pauses: int) -> None:
        assert key not in self.running, f"{key}: message {n} began while another of it ran"
        self.running.add(key)
        self.most = max(self.most, len(self.running))
        self.events.append(("begin", key, n))
        for _ in range(pauses):
            await asyncio.sleep(0)
        self.events.append(("end", key, n))
        self.running.discard(key)


def _started(log: _Log, key: str) -> list[int]:
    return [n for what, k, n in log.events if what == "begin" and k == key]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from("abcd"), st.integers(min_value=0, max_value=5)),
        min_size=1,
        max_size=40,
    )
)
def test_each_program_in_order_others_side_by_side(messages: list[tuple[str, int]]) -> None:
    async def main() -> _Log:
        log, order = _Log(), ProgramOrder()
        tasks = []
        for n, (key, pauses) in enumerate(messages):
            tasks.append(asyncio.create_task(order.run(key, log.work(key, n, pauses))))
            if n % 3 == 0:  # messages arrive between turns too
                await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        assert len(order) == 0, "an ended program's entry was kept"
        return log

    log = asyncio.run(main())
    for key in {key for key, _ in messages}:
        sent = [n for n, (k, _) in enumerate(messages) if k == key]
        assert _started(log, key) == sent, f"{key}: not in delivery order"
    assert len([e for e in log.events if e[0] == "end"]) == len(messages)


async def test_two_programs_run_at_once_and_one_waits_for_its_earlier_message() -> None:
    order = ProgramOrder()
    release = asyncio.Event()
    seen: list[str] = []

    async def slow() -> None:
        seen.append("a1 began")
        await release.wait()
        seen.append("a1 ended")

    async def quick(name: str) -> None:
        seen.append(name)

    a1 = asyncio.create_task(order.run("a", slow()))
    a2 = asyncio.create_task(order.run("a", quick("a2")))
    b1 = asyncio.create_task(order.run("b", quick("b1")))
    await asyncio.wait_for(b1, 1)  # another program's message is not held up by a1
    assert seen == ["a1 began", "b1"]
    assert not a2.done()  # the same program's later message waits for a1
    release.set()
    await asyncio.gather(a1, a2)
    assert seen == ["a1 began", "b1", "a1 ended", "a2"]


async def test_a_message_cancelled_while_it_waits_never_runs_and_keeps_the_order() -> None:
    order = ProgramOrder()
    release = asyncio.Event()
    seen: list[str] = []

    async def first() -> None:
        await release.wait()
        seen.append("1")

    async def named(name: str) -> None:
        seen.append(name)

    one = asyncio.create_task(order.run("a", first()))
    two = asyncio.create_task(order.run("a", named("2")))
    await asyncio.sleep(0)
    two.cancel()  # a hard stop while it waits for the first
    await asyncio.sleep(0)
    three = asyncio.create_task(order.run("a", named("3")))
    await asyncio.sleep(0)
    assert seen == [] and not three.done(), "a later message overtook one still running"
    release.set()
    await asyncio.gather(one, three)
    assert two.cancelled()
    assert seen == ["1", "3"]
    assert len(order) == 0


async def test_a_failing_message_releases_the_next_of_its_program() -> None:
    order = ProgramOrder()
    seen: list[str] = []

    async def fails() -> None:
        raise RuntimeError("boom")

    async def named(name: str) -> None:
        seen.append(name)

    bad = asyncio.create_task(order.run("a", fails()))
    good = asyncio.create_task(order.run("a", named("after")))
    results = await asyncio.gather(bad, good, return_exceptions=True)
    assert isinstance(results[0], RuntimeError)
    assert seen == ["after"]


def test_many_programs_overlap() -> None:
    """The point of it: with work in hand for several programs, they run at once."""

    async def main() -> int:
        log, order = _Log(), ProgramOrder()
        rng = random.Random(7)
        keys = [f"wf{rng.randrange(8)}" for _ in range(64)]
        await asyncio.gather(*(order.run(k, log.work(k, n, 3)) for n, k in enumerate(keys)))
        return log.most

    assert asyncio.run(main()) > 1
