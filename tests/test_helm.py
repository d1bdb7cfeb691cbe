"""The Helm chart: rendered by a real helm and checked against the Kubernetes schemas."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "shardflow"
HELM = os.environ.get("SHARDFLOW_HELM") or shutil.which("helm") or str(ROOT / ".tools" / "helm")

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

if not Path(HELM).exists():
    if os.environ.get("CI"):
        raise RuntimeError(f"no helm at {HELM}: run scripts/helm.sh")
    pytest.skip("no helm binary: run scripts/helm.sh", allow_module_level=True)


def render(*values: str) -> subprocess.CompletedProcess[str]:
    sets = [arg for value in values for arg in ("--set", value)]
    return subprocess.run(
        [HELM, "template", "demo", str(CHART), *sets], capture_output=True, text=True
    )


def manifests(*values: str) -> list[dict[str, Any]]:
    result = render(*values)
    assert result.returncode == 0, result.stderr
    documents = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    for doc in documents:
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
    return documents


def deployments(documents: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in documents if d["kind"] == "Deployment"}


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def test_the_chart_lints() -> None:
    result = subprocess.run([HELM, "lint", str(CHART)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_defaults_render_valid_manifests_for_every_part() -> None:
    documents = manifests()
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in documents)
    assert kinds == [
        ("ConfigMap", "demo-config"),
        *[("Deployment", f"demo-orchestrator-{shard}") for shard in range(4)],
        ("Deployment", "demo-router"),
        ("Deployment", "demo-worker-parallel"),
        ("Deployment", "demo-worker-serial"),
        ("Secret", "demo-connection"),
    ]


def test_one_deployment_per_shard_each_owning_its_shard_with_standbys() -> None:
    documents = manifests("shards=3", "orchestrator.replicasPerShard=3")
    config = next(d for d in documents if d["kind"] == "ConfigMap")
    assert config["data"]["SHARDFLOW_SHARDS"] == "3"
    found = deployments(documents)
    for shard in range(3):
        deployment = found[f"demo-orchestrator-{shard}"]
        assert deployment["spec"]["replicas"] == 3
        assert container(deployment)["args"] == ["orchestrator", "--shards", str(shard)]
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert "demo-orchestrator-3" not in found


def test_draining_shards_keep_orchestrators_outside_the_ring() -> None:
    found = deployments(manifests("shards=2", "drainShards={2,3}"))
    assert sorted(name for name in found if "orchestrator" in name) == [
        f"demo-orchestrator-{shard}" for shard in range(4)
    ]
    assert container(found["demo-orchestrator-3"])["args"] == ["orchestrator", "--shards", "3"]


@pytest.mark.parametrize(
    ("values", "fault"),
    [
        (["shards=0"], "shards: 0 is not a shard count from 1 to 1024"),
        (["shards=4", "drainShards={1}"], "drainShards: 1 is inside the ring 0..3"),
    ],
)
def test_bad_values_are_refused_naming_the_fault(values: list[str], fault: str) -> None:
    result = render(*values)
    assert result.returncode != 0
    assert fault in result.stderr


def test_workers_and_router_get_the_app_modules_and_connections() -> None:
    found = deployments(manifests("app={shop.tasks,shop.more}", "workers.parallel.replicas=5"))
    apps = ["--app", "shop.tasks", "--app", "shop.more"]
    assert container(found["demo-worker-serial"])["args"] == ["worker", "--pool", "serial", *apps]
    assert container(found["demo-worker-parallel"])["args"] == [
        "worker", "--pool", "parallel", *apps
    ]  # fmt: skip
    assert found["demo-worker-parallel"]["spec"]["replicas"] == 5
    assert container(found["demo-router"])["args"] == ["router", *apps]
    env = {
        e["name"]: e["valueFrom"]["secretKeyRef"] for e in container(found["demo-router"])["env"]
    }
    assert env["SHARDFLOW_AMQP_URL"] == {"name": "demo-connection", "key": "amqp-url"}


def test_an_existing_secret_is_used_and_none_is_made() -> None:
    documents = manifests("connection.existingSecret=prod-urls", "router.enabled=false")
    assert not [d for d in documents if d["kind"] == "Secret"]
    found = deployments(documents)
    assert "demo-router" not in found
    env = container(found["demo-worker-serial"])["env"]
    assert {e["valueFrom"]["secretKeyRef"]["name"] for e in env} == {"prod-urls"}


def test_the_config_matches_the_settings_shardflow_reads() -> None:
    from orchestrator.settings import Settings

    config = next(d for d in manifests() if d["kind"] == "ConfigMap")["data"]
    settings_env = {f"SHARDFLOW_{name.upper()}" for name in Settings.model_fields}
    unknown = set(config) - settings_env - {"SHARDFLOW_LOG_LEVEL"}
    assert not unknown, f"the chart sets variables shardflow does not read: {unknown}"
    values = {key.removeprefix("SHARDFLOW_").lower(): value for key, value in config.items()}
    values.pop("log_level")
    Settings(**values)  # every value the chart renders is one shardflow accepts
