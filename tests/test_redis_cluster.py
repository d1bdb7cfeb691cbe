"""The end-to-end tests again, with program state on a 3-master Redis Cluster.

Every key of a program carries the hash tag `{<workflow_id>}`, so each Lua transition touches
one slot; the results must be the same as on a single Redis.
"""

from collections.abc import Iterator

import pytest

from orchestrator.redis_store import RedisStore
from tests.brokers import PrivateRedisCluster
from tests.test_e2e import (  # noqa: F401  (collected again here, on the cluster)
    test_a_bag_output_is_its_members_outputs_in_bag_order,
    test_a_failing_task_fails_its_program_with_the_error,
    test_a_task_is_retried_with_backoff_until_it_succeeds,
    test_cancel_stops_running_tasks_and_dispatches_nothing_more,
    test_fifty_programs_at_once_over_four_shards_all_complete,
    test_submitting_an_existing_id_returns_it_and_never_runs_it_twice,
    test_task_bag_and_untiloop_give_the_right_result_in_order,
)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    cluster = PrivateRedisCluster()
    try:
        cluster.start()
        yield cluster.url
    finally:
        cluster.close()


@pytest.fixture
def redis_cluster() -> bool:
    return True


async def test_a_programs_keys_spread_over_the_cluster_but_each_stays_in_one_slot(
    store: RedisStore,
) -> None:
    from redis.asyncio.cluster import RedisCluster

    assert isinstance(store.client, RedisCluster)
    owners = set()
    for n in range(30):
        wf = f"slot-{n}"
        await store.submit(wf, '{"program": {"steps": [{"task": "a"}]}, "input": null}', 0, "", "d")
        node = store.client.get_node_from_key(store.keys.state(wf))
        assert store.client.get_node_from_key(store.keys.plan(wf)) == node
        owners.add(node.port)
    assert len(owners) == 3  # programs land on every master
