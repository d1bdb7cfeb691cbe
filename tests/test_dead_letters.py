"""What a dead letter's untrusted headers may send back where (router/dead_letters.py)."""

from __future__ import annotations

from orchestrator.keys import Names
from router.dead_letters import our_queue, sent_back

NAMES = Names("p")


def test_only_this_clusters_consumed_queues_take_letters_back() -> None:
    ours = ["p.ingress", "p.orchestrator.3", "p.tasks.parallel", "p.tasks.parallel.7",
            "p.tasks.serial-x", "p.tasks.reports.2"]  # fmt: skip
    others = ["p.dead", "p.control", "p.tasks.", "p.orchestrator.", "p.orchestrator.x",
              "x.tasks.parallel", "p.delay.parallel.100", "p.tasks.Bad Pool",
              "p.orchestrator.99999999"]  # fmt: skip
    assert [q for q in ours if not our_queue(NAMES, q)] == []
    assert [q for q in others if our_queue(NAMES, q)] == []


def test_a_header_of_thousands_of_digits_is_no_queue_and_no_crash() -> None:
    """int() of over 4,300 digits raises: a hostile `x-shardflow-from` stopped `--requeue`."""
    for queue in ("p.orchestrator." + "9" * 5000, "p.tasks.parallel." + "9" * 5000):
        assert not our_queue(NAMES, queue)
        assert sent_back(NAMES, {"x-shardflow-from": queue}) is None
