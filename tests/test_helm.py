"""The Helm chart: rendered by a real helm and checked against the Kubernetes schemas."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from orchestrator.keys import Names
from orchestrator.program import PARALLEL
from orchestrator.settings import Settings
from orchestrator.shares import SHARES, share_pool
from router.client import Router

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "shardflow"
HELM = os.environ.get("SHARDFLOW_HELM") or shutil.which("helm") or str(ROOT / ".tools" / "helm")
CHECKOV = ROOT / ".tools" / "checkov" / "bin" / "checkov"
UID = 10001
# Kinds of optional features whose schemas (CRDs) kubernetes-validate does not know.
CUSTOM_KINDS = {"ServiceMonitor", "PrometheusRule", "ScaledObject", "TriggerAuthentication"}

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

if not Path(HELM).exists():
    if os.environ.get("CI"):
        raise RuntimeError(f"no helm at {HELM}: run scripts/helm.sh")
    pytest.skip("no helm binary: run scripts/helm.sh", allow_module_level=True)


def _unusable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


def render(
    *values: str,
    release: str = "demo",
    extra: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    sets = [arg for value in values for arg in ("--set", value)]
    return subprocess.run(
        [HELM, "template", release, str(CHART), *sets, *extra],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def manifests(*values: str, release: str = "demo") -> list[dict[str, Any]]:
    result = render(*values, release=release)
    assert result.returncode == 0, result.stderr
    documents = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    for doc in documents:
        if doc["kind"] not in CUSTOM_KINDS:
            kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
    return documents


def deployments(documents: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in documents if d["kind"] == "Deployment"}


def of_kind(documents: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in documents if d["kind"] == kind}


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def pod_specs(documents: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every pod the chart makes: the Deployments' templates and the `helm test` pod."""
    specs = {name: d["spec"]["template"]["spec"] for name, d in deployments(documents).items()}
    specs.update({name: d["spec"] for name, d in of_kind(documents, "Pod").items()})
    return specs


def config(documents: list[dict[str, Any]]) -> dict[str, str]:
    return next(d for d in documents if d["kind"] == "ConfigMap")["data"]


def test_the_chart_lints() -> None:
    result = subprocess.run([HELM, "lint", "--strict", str(CHART)], capture_output=True, text=True)
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
        ("NetworkPolicy", "demo"),
        ("Pod", "demo-test-shards"),
        *[("PodDisruptionBudget", f"demo-orchestrator-{shard}") for shard in range(4)],
        ("PodDisruptionBudget", "demo-worker-serial"),
        ("Secret", "demo-connection"),
        ("ServiceAccount", "demo"),
    ]
    assert {d["metadata"]["namespace"] for d in documents} == {"default"}


def test_one_deployment_per_shard_each_owning_its_shard_with_standbys() -> None:
    documents = manifests("shards=3", "orchestrator.replicasPerShard=3")
    assert config(documents)["SHARDFLOW_SHARDS"] == "3"
    found = deployments(documents)
    for shard in range(3):
        deployment = found[f"demo-orchestrator-{shard}"]
        assert deployment["spec"]["replicas"] == 3
        assert container(deployment)["args"] == ["orchestrator", "--shards", str(shard)]
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert "demo-orchestrator-3" not in found


def test_decimals_given_with_set_are_taken() -> None:
    """`--set` passes a decimal as a string; the schema used to refuse it (want number)."""
    [config] = of_kind(
        manifests("workers.fairShare=0.5", "workers.keyLeaseSeconds=0.5"), "ConfigMap"
    ).values()
    assert config["data"]["SHARDFLOW_FAIR_SHARE"] == "0.5"
    assert config["data"]["SHARDFLOW_KEY_LEASE_S"] == "0.5"


def test_draining_shards_keep_orchestrators_outside_the_ring() -> None:
    found = deployments(manifests("shards=2", "drainShards={2,3}"))
    assert sorted(name for name in found if "orchestrator" in name) == [
        f"demo-orchestrator-{shard}" for shard in range(4)
    ]
    assert container(found["demo-orchestrator-3"])["args"] == ["orchestrator", "--shards", "3"]


@pytest.mark.parametrize(
    ("values", "fault"),
    [
        # refused by the chart's templates
        (["shards=4", "drainShards={1}"], "drainShards: 1 is inside the ring 0..3"),
        (["workers.keyLeaseSeconds=0.1"], "workers.keyLeaseSeconds: 0.1 is outside 0.3..3600"),
        (
            [
                "workers.parallel.autoscaling.enabled=true",
                "workers.parallel.autoscaling.maxReplicas=1",
                "workers.parallel.autoscaling.minReplicas=3",
            ],
            "maxReplicas 1 is below minReplicas 3",
        ),
        # refused by values.schema.json, naming the value
        (["shards=0"], "at '/shards': minimum: got 0, want 1"),
        (["shards=1025"], "at '/shards': maximum: got 1,025, want 1,024"),
        (["drainShards={-1}"], "at '/drainShards/0': minimum: got -1, want 0"),
        (["queueType=foo"], "at '/queueType': value must be one of 'classic', 'quorum'"),
        (["logLevel=verbose"], "at '/logLevel': value must be one of 'DEBUG', 'INFO'"),
        (["prefix=Shop"], "at '/prefix': 'Shop' does not match pattern"),
        (["image.tag=1.0:x"], "at '/image/tag': '1.0:x' does not match pattern"),
        (["image.repository="], "at '/image/repository': minLength: got 0, want 1"),
        (["image.pullPolicy=Sometimes"], "at '/image/pullPolicy': value must be one of"),
        (["app={}"], "at '/app/0': '' does not match pattern"),
        (["deliveryLimit=0"], "at '/deliveryLimit': minimum: got 0, want 1"),
        (["gracePeriodSeconds=-1"], "at '/gracePeriodSeconds': minimum: got -1, want 0"),
        (["orchestrator.replicasPerShard=0"], "at '/orchestrator/replicasPerShard': minimum"),
        (["orchestrator.podAntiAffinity=always"], "at '/orchestrator/podAntiAffinity': value must"),
        (["workers.parallel.concurrency=1001"], "at '/workers/parallel/concurrency': maximum"),
        (["workers.fairShare=1.5"], "at '/workers/fairShare'"),
        (["workers.fairShare=half"], "at '/workers/fairShare'"),
        (["workers.keyLeaseSeconds=5000"], "at '/workers/keyLeaseSeconds'"),
        (["connection.amqpUrl=http://rabbitmq/"], "at '/connection/amqpUrl': 'http://rabbitmq/'"),
        (
            ["orchestrator.resources.limits.memory=lots"],
            "at '/orchestrator/resources/limits/memory'",
        ),
        (["queuetype=quorum"], "additional properties 'queuetype' not allowed"),
    ],
)
def test_bad_values_are_refused_naming_the_fault(values: list[str], fault: str) -> None:
    result = render(*values)
    assert result.returncode != 0
    assert fault in result.stderr


def test_the_prefix_pattern_is_the_one_shardflow_accepts() -> None:
    for prefix in ["sf", "a" * 32, "a" * 33, "shop-flows_2", "Sf", "2sf", "s.f", "-sf", "s f"]:
        try:
            Settings(prefix=prefix)
            accepted = True
        except ValueError:
            accepted = False
        result = render(f"prefix={prefix}")
        assert (result.returncode == 0) == accepted, (prefix, accepted, result.stderr)


def test_the_default_prefix_carries_the_release_name() -> None:
    assert config(manifests())["SHARDFLOW_PREFIX"] == "sf-demo"
    assert config(manifests("prefix=sf"))["SHARDFLOW_PREFIX"] == "sf"  # an explicit one is kept
    long = "a-rather-long-release-name-for-the-shop-flows-"
    prefixes = {config(manifests(release=long + end))["SHARDFLOW_PREFIX"] for end in ("one", "two")}
    assert len(prefixes) == 2, "two long release names must not share queues"
    for prefix in prefixes:
        assert Settings(prefix=prefix).prefix == prefix


def test_the_image_tag_defaults_to_the_app_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    found = deployments(manifests())
    assert container(found["demo-router"])["image"] == f"shardflow:{chart['appVersion']}"
    found = deployments(manifests("image.repository=reg.example/flows", "image.tag=1.4.0"))
    assert container(found["demo-router"])["image"] == "reg.example/flows:1.4.0"


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


def test_named_pools_get_a_deployment_each_defaulting_to_the_parallel_workers() -> None:
    found = deployments(
        manifests(
            "workers.pools[0].name=reports",
            "workers.pools[0].replicas=1",
            "workers.pools[0].concurrency=4",
            "workers.pools[0].resources.limits.memory=4Gi",
            "workers.pools[0].nodeSelector.pool=batch",
            "workers.pools[1].name=gpu-2",
            "workers.parallel.replicas=3",
        )
    )
    apps = ["--app", "tasks"]
    reports, gpu = found["demo-worker-reports"], found["demo-worker-gpu-2"]
    assert container(reports)["args"] == [
        "worker", "--pool", "reports", "--concurrency", "4", *apps
    ]  # fmt: skip
    assert container(gpu)["args"] == ["worker", "--pool", "gpu-2", "--concurrency", "16", *apps]
    assert (reports["spec"]["replicas"], gpu["spec"]["replicas"]) == (1, 3)
    assert container(reports)["resources"]["limits"] == {"memory": "4Gi"}
    parallel = container(found["demo-worker-parallel"])["resources"]
    assert container(gpu)["resources"] == parallel
    assert reports["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "batch"}
    labels = reports["spec"]["template"]["metadata"]["labels"]
    assert labels["app.kubernetes.io/component"] == "worker-reports"
    assert len(found) == 4 + 2 + 2 + 1  # shards, serial and parallel, named, the router


def test_unknown_pools_are_refused_when_asked_with_the_chart_s_pools() -> None:
    assert "SHARDFLOW_POOLS" not in config(manifests("workers.pools[0].name=gpu"))
    data = config(
        manifests(
            "workers.refuseUnknownPools=true",
            "workers.pools[0].name=gpu",
            "workers.pools[1].name=serial-billing",
        )
    )
    assert data["SHARDFLOW_POOLS"] == "serial,parallel,gpu,serial-billing"
    allowed = Settings(pools=data["SHARDFLOW_POOLS"]).allowed_pools
    assert allowed == {"serial", "parallel", "gpu", "serial-billing"}
    only = config(manifests("workers.refuseUnknownPools=true"))["SHARDFLOW_POOLS"]
    assert Settings(pools=only).allowed_pools == {"serial", "parallel"}


def test_a_named_lane_defaults_to_the_serial_workers() -> None:
    """A `serial-<name>` pool is a lane: one task at a time, standbys kept on other nodes and
    by a PDB, as the serial pool's; it used to render as a parallel pool (--concurrency 16)."""
    documents = manifests("workers.pools[0].name=serial-billing", "workers.parallel.replicas=5")
    lane = deployments(documents)["demo-worker-serial-billing"]
    assert container(lane)["args"] == ["worker", "--pool", "serial-billing", "--app", "tasks"]
    assert lane["spec"]["replicas"] == 2  # workers.serial's, not the parallel pool's 5
    spread = lane["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    [term] = spread["preferredDuringSchedulingIgnoredDuringExecution"]
    labels = term["podAffinityTerm"]["labelSelector"]["matchLabels"]
    assert labels["app.kubernetes.io/component"] == "worker-serial-billing"
    budgets = of_kind(documents, "PodDisruptionBudget")
    assert budgets["demo-worker-serial-billing"]["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/instance": "demo",
        "app.kubernetes.io/component": "worker-serial-billing",
    }


@pytest.mark.parametrize(
    ("values", "fault"),
    [
        (["workers.pools[0].name=serial"], "at '/workers/pools/0/name'"),
        (["workers.pools[0].name=shard1"], "at '/workers/pools/0/name'"),
        (["workers.pools[0].name=long_tasks"], "at '/workers/pools/0/name'"),
        (["workers.pools[0].replicas=2"], "at '/workers/pools/0': missing property 'name'"),
        (["workers.pools[0].name=a", "workers.pools[0].speed=9"], "'speed' not allowed"),
        (["workers.pools[0].name=a", "workers.pools[1].name=a"], '"a" is named twice'),
    ],
)
def test_bad_named_pools_are_refused(values: list[str], fault: str) -> None:
    result = render(*values)
    assert result.returncode != 0
    assert fault in result.stderr, result.stderr


def test_an_existing_secret_is_used_and_none_is_made() -> None:
    documents = manifests("connection.existingSecret=prod-urls", "router.enabled=false")
    assert not [d for d in documents if d["kind"] == "Secret"]
    found = deployments(documents)
    assert "demo-router" not in found
    env = container(found["demo-worker-serial"])["env"]
    assert {e["valueFrom"]["secretKeyRef"]["name"] for e in env} == {"prod-urls"}


def test_the_config_matches_the_settings_shardflow_reads() -> None:
    data = config(manifests())
    settings_env = {f"SHARDFLOW_{name.upper()}" for name in Settings.model_fields}
    unknown = set(data) - settings_env - {"SHARDFLOW_LOG_LEVEL"}
    assert not unknown, f"the chart sets variables shardflow does not read: {unknown}"
    values = {key.removeprefix("SHARDFLOW_").lower(): value for key, value in data.items()}
    values.pop("log_level")
    Settings.model_validate(values)  # every value the chart renders is one shardflow accepts


def test_every_pod_meets_pod_security_restricted() -> None:
    documents = manifests()
    (account,) = of_kind(documents, "ServiceAccount").values()
    assert account["automountServiceAccountToken"] is False
    specs = pod_specs(documents)
    assert len(specs) == 8  # 4 shards, 2 pools, the router, the helm test
    for name, spec in specs.items():
        assert spec["serviceAccountName"] == "demo", name
        assert spec["automountServiceAccountToken"] is False, name
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] == UID, name
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}, name
        (only,) = spec["containers"]
        box = only["securityContext"]
        assert box["allowPrivilegeEscalation"] is False, name
        assert box["capabilities"] == {"drop": ["ALL"]}, name
        assert box["readOnlyRootFilesystem"] is True, name
        assert box["runAsNonRoot"] is True and box["seccompProfile"]["type"] == "RuntimeDefault"
        assert only["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}], name
        assert spec["volumes"] == [{"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}}], name
        resources = only["resources"]
        for kind in ("requests", "limits"):
            assert set(resources[kind]) == {"cpu", "memory"}, (name, kind)


def test_a_shards_owner_and_standby_prefer_different_nodes() -> None:
    found = deployments(manifests())
    anti = found["demo-orchestrator-2"]["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    (preferred,) = anti["preferredDuringSchedulingIgnoredDuringExecution"]
    term = preferred["podAffinityTerm"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"] == {
        "app.kubernetes.io/instance": "demo",
        "app.kubernetes.io/component": "orchestrator",
        "shardflow/shard": "2",
    }
    assert "affinity" in found["demo-worker-serial"]["spec"]["template"]["spec"]
    assert "affinity" not in found["demo-worker-parallel"]["spec"]["template"]["spec"]

    found = deployments(manifests("orchestrator.podAntiAffinity=required"))
    anti = found["demo-orchestrator-0"]["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    (required,) = anti["requiredDuringSchedulingIgnoredDuringExecution"]
    assert required["labelSelector"]["matchLabels"]["shardflow/shard"] == "0"

    found = deployments(manifests("orchestrator.podAntiAffinity=none"))
    assert "affinity" not in found["demo-orchestrator-0"]["spec"]["template"]["spec"]


def test_placement_is_per_component_over_top_level_defaults() -> None:
    found = deployments(
        manifests(
            "nodeSelector.pool=general",
            "orchestrator.nodeSelector.pool=core",
            "tolerations[0].key=dedicated",
            "tolerations[0].operator=Exists",
            "priorityClassName=flows-high",
            "orchestrator.topologySpreadConstraints[0].maxSkew=1",
            "orchestrator.topologySpreadConstraints[0].topologyKey=topology.kubernetes.io/zone",
            "orchestrator.topologySpreadConstraints[0].whenUnsatisfiable=ScheduleAnyway",
            "router.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
            ".nodeSelectorTerms[0].matchExpressions[0].key=kubernetes.io/arch",
            "router.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
            ".nodeSelectorTerms[0].matchExpressions[0].operator=Exists",
        )
    )
    orchestrator = found["demo-orchestrator-1"]["spec"]["template"]["spec"]
    worker = found["demo-worker-serial"]["spec"]["template"]["spec"]
    router = found["demo-router"]["spec"]["template"]["spec"]
    assert orchestrator["nodeSelector"] == {"pool": "core"}
    assert worker["nodeSelector"] == {"pool": "general"}
    assert (
        orchestrator["tolerations"]
        == worker["tolerations"]
        == [{"key": "dedicated", "operator": "Exists"}]
    )
    assert {spec["priorityClassName"] for spec in (orchestrator, worker, router)} == {"flows-high"}
    (spread,) = orchestrator["topologySpreadConstraints"]
    assert spread["labelSelector"]["matchLabels"]["shardflow/shard"] == "1"
    assert "nodeAffinity" in router["affinity"] and "podAntiAffinity" not in router["affinity"]


def test_a_disruption_budget_per_shard_and_for_the_serial_lane() -> None:
    budgets = of_kind(manifests("shards=2", "drainShards={2}"), "PodDisruptionBudget")
    assert sorted(budgets) == [
        "demo-orchestrator-0", "demo-orchestrator-1", "demo-orchestrator-2", "demo-worker-serial"
    ]  # fmt: skip
    assert budgets["demo-orchestrator-2"]["spec"] == {
        "maxUnavailable": 1,
        "selector": {
            "matchLabels": {
                "app.kubernetes.io/instance": "demo",
                "app.kubernetes.io/component": "orchestrator",
                "shardflow/shard": "2",
            }
        },
    }
    assert not of_kind(manifests("podDisruptionBudget.enabled=false"), "PodDisruptionBudget")


def test_a_change_of_settings_or_secret_restarts_every_pod() -> None:
    def checksums(*values: str) -> dict[str, dict[str, str]]:
        return {
            name: d["spec"]["template"]["metadata"]["annotations"]
            for name, d in deployments(manifests(*values)).items()
        }

    before = checksums()
    after_secret = checksums("connection.redisUrl=redis://other:6379/0")
    after_config = checksums("logLevel=DEBUG")
    for name in before:
        assert before[name]["checksum/secret"] != after_secret[name]["checksum/secret"], name
        assert before[name]["checksum/config"] == after_secret[name]["checksum/config"], name
        assert before[name]["checksum/config"] != after_config[name]["checksum/config"], name


def test_kedas_trigger_authentication_takes_a_private_ca_and_client_certificates() -> None:
    """KEDA's RabbitMQ scaler reads the chart's `amqp-url`; with `amqps://` and a CA of one's
    own it also needs `tls` and `ca` from a Secret, which the chart had no way to give it."""
    refs = [
        {"parameter": "tls", "name": "rabbitmq-tls", "key": "enabled"},
        {"parameter": "ca", "name": "rabbitmq-tls", "key": "ca.crt"},
    ]
    documents = manifests(
        "workers.parallel.autoscaling.enabled=true",
        *(f"workers.parallel.autoscaling.extraSecretTargetRefs[{i}].{field}={ref[field]}"
          for i, ref in enumerate(refs) for field in ref),
    )  # fmt: skip
    (auth,) = of_kind(documents, "TriggerAuthentication").values()
    assert auth["spec"]["secretTargetRef"] == [
        {"parameter": "host", "name": "demo-connection", "key": "amqp-url"},
        *refs,
    ]
    # The host stays the chart's: another would scale on another broker's queues.
    host = "workers.parallel.autoscaling.extraSecretTargetRefs[0]"
    result = render("workers.parallel.autoscaling.enabled=true", f"{host}.parameter=host",
                    f"{host}.name=other", f"{host}.key=url")  # fmt: skip
    assert result.returncode != 0 and "parameter" in result.stderr, result.stderr
    missing = render("workers.parallel.autoscaling.enabled=true", f"{host}.parameter=ca")
    assert missing.returncode != 0 and "missing propert" in missing.stderr, missing.stderr


def test_keda_and_the_service_monitor_are_optional() -> None:
    kinds = {d["kind"] for d in manifests()}
    assert not kinds & (CUSTOM_KINDS | {"Service"})
    documents = manifests(
        "workers.parallel.autoscaling.enabled=true",
        "workers.parallel.autoscaling.maxReplicas=20",
        "metrics.serviceMonitor.enabled=true",
        "prefix=shop",
    )
    (scaled,) = of_kind(documents, "ScaledObject").values()
    assert scaled["spec"]["scaleTargetRef"] == {"name": "demo-worker-parallel"}
    assert scaled["spec"]["maxReplicaCount"] == 20
    # One trigger for each of the pool's fair-share queues: a backlog in any of them counts.
    triggers = scaled["spec"]["triggers"]
    names = Names("shop")
    assert [t["metadata"]["queueName"] for t in triggers] == [
        names.task_queue(share_pool(PARALLEL, share)) for share in range(SHARES)
    ]
    assert {(t["type"], t["metadata"]["mode"], t["metadata"]["protocol"]) for t in triggers} == {
        ("rabbitmq", "QueueLength", "amqp")
    }
    (auth,) = of_kind(documents, "TriggerAuthentication").values()
    assert auth["spec"]["secretTargetRef"] == [
        {"parameter": "host", "name": "demo-connection", "key": "amqp-url"}
    ]
    assert "replicas" not in deployments(documents)["demo-worker-parallel"]["spec"]  # KEDA's
    (monitor,) = of_kind(documents, "ServiceMonitor").values()
    (service,) = of_kind(documents, "Service").values()
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert container(deployments(documents)["demo-router"])["ports"] == [
        {"name": "metrics", "containerPort": 9464}
    ]


# --- render-time checks that need the cluster: helm's `lookup` against a stand-in API server


class _FakeApiServer:
    """Answers helm's discovery and GETs on 127.0.0.1 as a cluster holding one release would:
    its ConfigMap (`data`) is there, every other object is not. Nothing is ever written."""

    GROUPS: dict[str, list[tuple[str, str]]] = {
        "": [("configmaps", "ConfigMap"), ("secrets", "Secret"),
             ("serviceaccounts", "ServiceAccount"), ("pods", "Pod"), ("services", "Service")],
        "apps": [("deployments", "Deployment")],
        "policy": [("poddisruptionbudgets", "PodDisruptionBudget")],
        "networking.k8s.io": [("networkpolicies", "NetworkPolicy")],
    }  # fmt: skip

    def __init__(self) -> None:
        self.data: dict[str, str] | None = None
        self.paths: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.paths.append(self.path)
                code, body = outer.answer(self.path.split("?")[0])
                payload = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def answer(self, path: str) -> tuple[int, dict[str, Any]]:
        if path == "/version":
            return 200, {"major": "1", "minor": "33", "gitVersion": "v1.33.0"}
        if path == "/api":
            return 200, {"kind": "APIVersions", "versions": ["v1"]}
        if path == "/apis":
            groups = [
                {"name": g, "versions": [{"groupVersion": f"{g}/v1", "version": "v1"}],
                 "preferredVersion": {"groupVersion": f"{g}/v1", "version": "v1"}}
                for g in self.GROUPS if g
            ]  # fmt: skip
            return 200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}
        group = {"/api/v1": ""} | {f"/apis/{g}/v1": g for g in self.GROUPS if g}
        if path in group:
            resources = [
                {"name": plural, "singularName": plural[:-1], "namespaced": True, "kind": kind,
                 "verbs": ["get", "list"]}
                for plural, kind in self.GROUPS[group[path]]
            ]  # fmt: skip
            version = "v1" if path == "/api/v1" else path.removeprefix("/apis/")
            return 200, {"kind": "APIResourceList", "groupVersion": version, "resources": resources}
        if path == "/api/v1/namespaces/default/configmaps/demo-config" and self.data is not None:
            meta = {
                "name": "demo-config",
                "namespace": "default",
                "labels": {"app.kubernetes.io/managed-by": "Helm"},
                "annotations": {
                    "meta.helm.sh/release-name": "demo",
                    "meta.helm.sh/release-namespace": "default",
                },
            }
            return 200, {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": meta,
                "data": self.data,
            }
        return 404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404}

    def kubeconfig(self, directory: Path) -> Path:
        port = self.server.server_port
        path = directory / "kubeconfig"
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "fake", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
                    "users": [{"name": "fake", "user": {"token": "fake"}}],
                    "contexts": [
                        {"name": "fake", "context": {"cluster": "fake", "user": "fake",
                                                     "namespace": "default"}}
                    ],
                    "current-context": "fake",
                }
            )
        )  # fmt: skip
        return path


@pytest.fixture
def cluster_api(tmp_path: Path) -> Iterator[tuple[_FakeApiServer, dict[str, str]]]:
    server = _FakeApiServer()
    env = {**os.environ, "KUBECONFIG": str(server.kubeconfig(tmp_path))}
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        env.pop(name, None)  # the stand-in is on loopback; nothing may go elsewhere
    yield server, env
    server.server.shutdown()
    server.server.server_close()


def upgrade_render(
    api: tuple[_FakeApiServer, dict[str, str]], *values: str
) -> subprocess.CompletedProcess[str]:
    """`helm template` as an upgrade would render: with the cluster, so `lookup` answers."""
    extra = ("--dry-run=server", "--disable-openapi-validation")
    return render(*values, extra=extra, env=api[1])


def test_an_upgrade_that_drops_shards_without_draining_them_is_refused(
    cluster_api: tuple[_FakeApiServer, dict[str, str]],
) -> None:
    server, _ = cluster_api
    server.data = {"SHARDFLOW_SHARDS": "6", "SHARDFLOW_PREFIX": "sf-demo"}
    refused = upgrade_render(cluster_api, "shards=4")
    assert refused.returncode != 0
    assert (
        "shards: going from 6 to 4 shards would strand the programs of shards 4, 5; "
        "add them to drainShards (--set 'drainShards={4,5}')"
    ) in refused.stderr
    assert "/api/v1/namespaces/default/configmaps/demo-config" in server.paths
    partly = upgrade_render(cluster_api, "shards=3", "drainShards={4,5}")
    assert "would strand the programs of shards 3; add them to drainShards (--set " in (
        partly.stderr
    )
    assert "drainShards={4,5,3}" in partly.stderr

    for values in (
        ["shards=4", "drainShards={4,5}"],
        ["shards=4", "allowShrinkWithoutDrain=true"],
        ["shards=6"],
        ["shards=8"],
    ):
        result = upgrade_render(cluster_api, *values)
        assert result.returncode == 0, (values, result.stderr)
    drained = upgrade_render(cluster_api, "shards=4", "drainShards={4,5}")
    names = {d["metadata"]["name"] for d in yaml.safe_load_all(drained.stdout) if d}
    assert {"demo-orchestrator-4", "demo-orchestrator-5"} <= names


def test_an_upgrade_that_renames_the_queues_is_refused(
    cluster_api: tuple[_FakeApiServer, dict[str, str]],
) -> None:
    server, _ = cluster_api
    server.data = {"SHARDFLOW_SHARDS": "4", "SHARDFLOW_PREFIX": "sf"}  # an install from before
    refused = upgrade_render(cluster_api)
    assert refused.returncode != 0
    assert "keep them with --set prefix=sf" in refused.stderr
    assert upgrade_render(cluster_api, "prefix=sf").returncode == 0
    assert upgrade_render(cluster_api, "allowPrefixChange=true").returncode == 0


def test_a_first_install_has_nothing_to_compare(
    cluster_api: tuple[_FakeApiServer, dict[str, str]],
) -> None:
    result = upgrade_render(cluster_api, "shards=2")
    assert result.returncode == 0, result.stderr


# --- `helm test`: the pod's script, run here against real RabbitMQ and Redis


def _helm_test_script() -> str:
    (pod,) = of_kind(manifests(), "Pod").values()
    command = pod["spec"]["containers"][0]["command"]
    assert command[:2] == ["python3", "-c"]
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    return str(command[2])


async def _run_helm_test(settings: Settings, wait_s: float) -> tuple[int, str]:
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "SHARDFLOW_AMQP_URL": settings.amqp_url,
        "SHARDFLOW_REDIS_URL": settings.redis_url,
        "SHARDFLOW_PREFIX": settings.prefix,
        "SHARDFLOW_SHARDS": str(settings.shards),
        "SHARDFLOW_TEST_DRAIN": "",
        "SHARDFLOW_TEST_WAIT_S": str(wait_s),
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _helm_test_script(), env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(process.communicate(), 120)
    return await process.wait(), out.decode()


async def test_the_helm_test_passes_when_every_shard_has_a_consumer(
    cluster: Router, settings: Settings
) -> None:
    code, out = await _run_helm_test(settings, wait_s=30)
    assert code == 0, out
    assert f"every one of the {settings.shards} shards has a consumer" in out


async def test_the_helm_test_fails_naming_the_shards_without_one(settings: Settings) -> None:
    code, out = await _run_helm_test(settings, wait_s=0)
    assert code == 1, out
    assert "no consumer on shards [0, 1, 2, 3]" in out


# --- the policy scan and the documentation


@pytest.fixture(scope="module")
def checkov() -> Path:
    installed = subprocess.run(
        ["bash", str(ROOT / "scripts" / "checkov.sh")], capture_output=True, text=True, timeout=900
    )
    if installed.returncode != 0 or not CHECKOV.exists():
        _unusable(f"no checkov: scripts/checkov.sh failed: {installed.stderr[-1500:]}")
    return CHECKOV


# Every check the chart skips, and where its reason is written (a checkov.io/skip annotation).
EXPLAINED = {"CKV_K8S_8", "CKV_K8S_9", "CKV_K8S_35", "CKV_K8S_43", "CKV_K8S_15", "CKV_K8S_21"}


def test_the_policy_scan_of_the_default_render_has_no_unexplained_finding(
    checkov: Path, tmp_path: Path
) -> None:
    rendered = render()
    assert rendered.returncode == 0, rendered.stderr
    (tmp_path / "shardflow.yaml").write_text(rendered.stdout)
    # Offline: no download of checkov's guidelines, and a dead proxy for anything else.
    dead = "http://127.0.0.1:9"
    env = {**os.environ, "HTTPS_PROXY": dead, "HTTP_PROXY": dead, "https_proxy": dead}
    scan = subprocess.run(
        [str(checkov), "--file", str(tmp_path / "shardflow.yaml"), "--framework", "kubernetes",
         "--skip-download", "--compact", "--output", "json"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    report = json.loads(scan.stdout)
    results = report["results"]
    failed = [f"{c['check_id']} {c['check_name']}: {c['resource']}" for c in
              results["failed_checks"]]  # fmt: skip
    assert not failed, "\n".join(failed)
    # Every skip is one the chart explains, with its reason carried in the annotation.
    skipped = {(c["check_id"], c["check_result"].get("suppress_comment", "")) for c in
               results["skipped_checks"]}  # fmt: skip
    assert {check for check, _ in skipped} == EXPLAINED
    assert all(len(reason) >= 20 for _, reason in skipped), skipped
    assert report["summary"]["passed"] > 500 and report["summary"]["parsing_errors"] == 0
    readme = (ROOT / "helm" / "README.md").read_text()
    for check in EXPLAINED:
        assert check in readme, f"helm/README.md does not explain the {check} skip"


def _leaves(values: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in values.items():
        if isinstance(value, dict) and value and key not in {
            "resources", "podSecurityContext", "securityContext"
        }:  # fmt: skip
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def test_every_value_is_in_the_schema_and_the_readme_table() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())
    for path, _ in _leaves(values):
        node = schema
        for key in path.split("."):
            assert key in node.get("properties", {}), f"{path} is not in values.schema.json"
            node = node["properties"][key]
    check = subprocess.run(
        [sys.executable, str(ROOT / "helm" / "values_table.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    table = [line for line in (ROOT / "helm" / "README.md").read_text().splitlines()
             if line.startswith("| `")]  # fmt: skip
    undescribed = [line for line in table if line.rstrip().endswith("|  |")]
    assert not undescribed, f"values without a '# -- ' description in values.yaml: {undescribed}"


def _settings(
    schema: dict[str, Any], values: dict[str, Any], path: str = ""
) -> Iterator[tuple[str, dict[str, Any], list[str]]]:
    """Each object of settings in the schema, with the keys of its defaults that are settings:
    a scalar, or an object of settings (not resources, labels or annotations: maps a user may
    empty)."""
    props = schema.get("properties", {})
    keys = [key for key in props if key in values and (
        isinstance(values[key], bool | int | float | str)
        or (isinstance(values[key], dict) and "properties" in props[key]
            and key not in {"resources", "labels", "annotations"})
    )]  # fmt: skip
    yield path or "<top>", schema, keys
    for key in keys:
        if isinstance(values[key], dict):
            yield from _settings(props[key], values[key], f"{path}{key}.")


def test_every_setting_is_required_so_values_from_an_older_chart_are_refused() -> None:
    """`helm upgrade --reuse-values` renders with the last release's values and none of this
    chart's defaults: a setting added since came out `<nil>` or 0 and stopped every pod."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())
    # Set to null (which removes a key) these mean their default, which the templates give.
    optional = {"<top>": {"prefix", "priorityClassName"}, "serviceAccount.": {"name"}}
    for path, node, keys in _settings(schema, values):
        wanted = sorted(set(keys) - optional.get(path, set()))
        assert sorted(node.get("required", [])) == wanted, path
    for value in ("prefix=null", "priorityClassName=null", "serviceAccount.name=null"):
        assert render(value).returncode == 0, value
    older = values  # as a release installed before the setting existed has them
    del older["orchestrator"]["prefetch"], older["workers"]["parallel"]["autoscaling"]["enabled"]
    with tempfile.TemporaryDirectory() as scratch:
        chart = Path(scratch) / "shardflow"
        shutil.copytree(CHART, chart)
        (chart / "values.yaml").write_text(yaml.safe_dump(older))
        result = subprocess.run(
            [HELM, "template", "demo", str(chart)], capture_output=True, text=True, timeout=120
        )
    assert result.returncode != 0
    assert "at '/orchestrator': missing property 'prefetch'" in result.stderr, result.stderr
    assert "at '/workers/parallel/autoscaling': missing property 'enabled'" in result.stderr


# --- health probes, the metrics port and the dashboard


def test_every_process_serves_metrics_and_health_on_one_port_and_is_probed_there() -> None:
    documents = manifests()
    assert config(documents)["SHARDFLOW_METRICS_PORT"] == "9464"
    found = deployments(documents)
    assert len(found) == 7  # 4 shards, 2 pools, the router
    for name, deployment in found.items():
        only = container(deployment)
        assert only["ports"] == [{"name": "metrics", "containerPort": 9464}], name
        # Liveness asks only that the event loop turns: a RabbitMQ or Redis outage restarts
        # nothing (the clients reconnect). A process serves nothing before it reached both, so
        # startup asks /livez too: on /healthz, an outage just after the start killed the pod.
        for probe, path in (("startupProbe", "/livez"), ("livenessProbe", "/livez"),
                            ("readinessProbe", "/readyz")):  # fmt: skip
            assert only[probe]["httpGet"] == {"path": path, "port": "metrics"}, (name, probe)
        assert only["livenessProbe"]["failureThreshold"] == 6
        # The startup probe outlasts the process's own wait for RabbitMQ and Redis.
        startup = only["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] > Settings().startup_wait_s
    (test_pod,) = of_kind(documents, "Pod").values()
    assert "livenessProbe" not in test_pod["spec"]["containers"][0]  # it runs once and exits

    found = deployments(
        manifests(
            "metrics.port=9999",
            "probes.periodSeconds=20",
            "probes.livenessFailureThreshold=3",
            "probes.readinessFailureThreshold=4",
            "probes.startupSeconds=61",
        )
    )
    only = container(found["demo-worker-serial"])
    assert only["ports"] == [{"name": "metrics", "containerPort": 9999}]
    assert only["livenessProbe"]["periodSeconds"] == only["readinessProbe"]["periodSeconds"] == 20
    assert only["livenessProbe"]["failureThreshold"] == 3
    assert only["readinessProbe"]["failureThreshold"] == 4
    assert only["startupProbe"]["failureThreshold"] == 13  # 61 s in probes 5 s apart


def test_the_port_the_chart_sets_is_the_one_shardflow_serves_on() -> None:
    data = config(manifests("metrics.port=9999"))
    settings = Settings.model_validate({"metrics_port": data["SHARDFLOW_METRICS_PORT"]})
    assert settings.metrics_port == 9999
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["metrics"]["port"] == Settings().metrics_port  # the same default


def test_probes_can_be_turned_off_and_the_policy_skips_then_say_why() -> None:
    found = deployments(manifests("probes.enabled=false"))
    for name, deployment in found.items():
        only = container(deployment)
        assert not {"startupProbe", "livenessProbe", "readinessProbe"} & set(only), name
        assert only["ports"] == [{"name": "metrics", "containerPort": 9464}], name
        skips = deployment["metadata"]["annotations"]
        assert skips["checkov.io/skip1"].startswith("CKV_K8S_8=no liveness probe"), name
    for name, deployment in deployments(manifests()).items():
        assert "checkov.io/skip1" not in deployment["metadata"]["annotations"], name


@pytest.mark.parametrize(
    ("values", "fault"),
    [
        (["metrics.port=0"], "at '/metrics/port': minimum: got 0, want 1"),
        (["probes.periodSeconds=0"], "at '/probes/periodSeconds': minimum: got 0, want 1"),
        (["probes.startupSeconds=4"], "at '/probes/startupSeconds': minimum: got 4, want 5"),
        (["probes.enabled=yes"], "at '/probes/enabled': got string, want boolean"),
        (["probes.httpPath=/x"], "additional properties 'httpPath' not allowed"),
        (["dashboard.enabled=1"], "at '/dashboard/enabled': got number, want boolean"),
    ],
)
def test_bad_probe_metrics_and_dashboard_values_are_refused(values: list[str], fault: str) -> None:
    result = render(*values)
    assert result.returncode != 0
    assert fault in result.stderr


def test_the_service_monitor_scrapes_the_pods_metrics_port() -> None:
    documents = manifests("metrics.serviceMonitor.enabled=true", "metrics.port=9500")
    (monitor,) = of_kind(documents, "ServiceMonitor").values()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    (service,) = of_kind(documents, "Service").values()
    assert service["spec"]["ports"] == [{"name": "metrics", "port": 9500, "targetPort": "metrics"}]
    for name, deployment in deployments(documents).items():
        assert container(deployment)["ports"] == [{"name": "metrics", "containerPort": 9500}]
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items(), name


def test_the_alert_rules_ask_for_this_releases_exported_metrics() -> None:
    """metrics.prometheusRule: each rule's expression names metrics the code exports, on this
    release's series only, and one counts every shard of the ring by name."""
    import re

    from orchestrator import metrics

    assert "PrometheusRule" not in {d["kind"] for d in manifests()}
    documents = manifests(
        "metrics.prometheusRule.enabled=true",
        "metrics.serviceMonitor.enabled=true",
        "metrics.prometheusRule.labels.release=kps",
        "metrics.prometheusRule.alertLabels.team=flows",
        "metrics.prometheusRule.extraRules[0].alert=Mine",
        "metrics.prometheusRule.extraRules[0].expr=vector(1)",
        "shards=3",
    )
    (rules,) = of_kind(documents, "PrometheusRule").values()
    assert rules["metadata"]["labels"]["release"] == "kps"
    (group,) = rules["spec"]["groups"]
    *ours, mine = group["rules"]
    assert mine == {"alert": "Mine", "expr": "vector(1)"}
    exported = metrics.names()
    assert len(ours) >= 8
    for rule in ours:
        named = set(re.findall(r"\bshardflow_[a-z0-9_]+", rule["expr"]))
        assert named and named <= exported, (rule["alert"], named - exported)
        for name in named:  # each series of this release only
            assert re.search(name + r'\{namespace="default", job="demo-metrics"', rule["expr"])
        assert rule["labels"]["team"] == "flows" and rule["labels"]["severity"]
        assert rule["annotations"]["summary"], rule["alert"]
    [shards] = [r["expr"] for r in ours if r["alert"] == "ShardflowShardWithoutOrchestrator"]
    assert 'shard=~"0|1|2"' in shards and shards.endswith("< 3")
    # Scraped by their own means (no ServiceMonitor): by namespace alone.
    (plain,) = of_kind(manifests("metrics.prometheusRule.enabled=true"), "PrometheusRule").values()
    first = plain["spec"]["groups"][0]["rules"][0]["expr"]
    assert 'shardflow_dependency_up{namespace="default"})' in first


def admitted(documents: list[dict[str, Any]]) -> dict[str, list[tuple[int | None, Any]]]:
    """What the NetworkPolicy lets in to each Deployment's pods: (port, peers) per ingress rule
    port, a named port resolved to the pod's number; port None means every port, peers None
    anyone. A pod the policy does not select is left out (nothing refuses its traffic)."""
    (policy,) = of_kind(documents, "NetworkPolicy").values()
    spec = policy["spec"]
    assert "Ingress" in spec["policyTypes"]
    found = {}
    for name, deployment in deployments(documents).items():
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        if not spec["podSelector"].get("matchLabels", {}).items() <= labels.items():
            continue
        named = {port["name"]: port["containerPort"] for port in container(deployment)["ports"]}
        found[name] = [
            (None if port is None else named.get(port["port"], port["port"]), rule.get("from"))
            for rule in spec.get("ingress") or []
            for port in rule.get("ports") or [None]
        ]
    return found


def test_the_network_policy_lets_in_metrics_only_from_the_given_peers_or_anyone() -> None:
    """values.yaml: all ingress refused but metrics, which `networkPolicy.metricsFrom` may scrape
    (empty: anyone), be the scraper Prometheus's ServiceMonitor, annotations or own config."""
    for monitor in ("false", "true"):
        found = admitted(manifests(f"metrics.serviceMonitor.enabled={monitor}"))
        assert len(found) == 7, found  # every pod: 4 shards, 2 pools, the router
        assert all(rules == [(9464, None)] for rules in found.values()), (monitor, found)
    peers = [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}},
        {"podSelector": {"matchLabels": {"app": "prometheus"}}},
    ]
    found = admitted(
        manifests(
            "metrics.port=9500",
            r"networkPolicy.metricsFrom[0].namespaceSelector.matchLabels.kubernetes\.io/metadata\.name=monitoring",
            "networkPolicy.metricsFrom[1].podSelector.matchLabels.app=prometheus",
        )
    )
    assert len(found) == 7, found
    assert all(rules == [(9500, peers)] for rules in found.values()), found
    assert "NetworkPolicy" not in {d["kind"] for d in manifests("networkPolicy.enabled=false")}


def test_the_grafana_dashboard_is_an_optional_config_map_of_the_shipped_json() -> None:
    assert "demo-dashboard" not in of_kind(manifests(), "ConfigMap")
    shipped = json.loads((CHART / "files" / "dashboard.json").read_text())
    (dashboard,) = [
        d for name, d in of_kind(manifests("dashboard.enabled=true"), "ConfigMap").items()
        if name == "demo-dashboard"
    ]  # fmt: skip
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["shardflow.json"]) == shipped
    relabelled = of_kind(
        manifests(
            "dashboard.enabled=true",
            "dashboard.labels.team=flows",
            "dashboard.annotations.grafana_folder=Shop",
        ),
        "ConfigMap",
    )["demo-dashboard"]
    assert relabelled["metadata"]["labels"]["team"] == "flows"
    assert relabelled["metadata"]["annotations"]["grafana_folder"] == "Shop"


def test_the_policy_scan_with_the_dashboard_monitor_and_no_probes_is_clean(
    checkov: Path, tmp_path: Path
) -> None:
    rendered = render(
        "dashboard.enabled=true",
        "metrics.serviceMonitor.enabled=true",
        "metrics.prometheusRule.enabled=true",
        "probes.enabled=false",
    )
    assert rendered.returncode == 0, rendered.stderr
    (tmp_path / "optional.yaml").write_text(rendered.stdout)
    dead = "http://127.0.0.1:9"  # offline, as the default render's scan
    env = {**os.environ, "HTTPS_PROXY": dead, "HTTP_PROXY": dead, "https_proxy": dead}
    scan = subprocess.run(
        [str(checkov), "--file", str(tmp_path / "optional.yaml"), "--framework", "kubernetes",
         "--skip-download", "--compact", "--output", "json"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    results = json.loads(scan.stdout)["results"]
    failed = [f"{c['check_id']}: {c['resource']}" for c in results["failed_checks"]]
    assert not failed, "\n".join(failed)
    skipped = {(c["check_id"], c["resource"]) for c in results["skipped_checks"]}
    assert {check for check, _ in skipped} == EXPLAINED
    # Without probes every Deployment says so, not only the helm test pod.
    probe_skips = {resource for check, resource in skipped if check == "CKV_K8S_8"}
    assert "Deployment.default.demo-router" in probe_skips
    scanned = {c["resource"] for c in results["passed_checks"]} | {r for _, r in skipped}
    assert {"ConfigMap.default.demo-dashboard", "Service.default.demo-metrics"} <= scanned


def test_extra_volumes_reach_every_pod_for_a_private_ca() -> None:
    """amqps:// and rediss:// with a private CA name a file (`?cafile=`, `?ssl_ca_certs=`);
    the root filesystem is read-only, and no value could mount one."""
    documents = manifests(
        "extraVolumes[0].name=ca",
        "extraVolumes[0].secret.secretName=broker-ca",
        "extraVolumeMounts[0].name=ca",
        "extraVolumeMounts[0].mountPath=/etc/shardflow/ca",
        "extraVolumeMounts[0].readOnly=true",
    )
    found = deployments(documents)
    assert found
    for name, deployment in found.items():
        pod = deployment["spec"]["template"]["spec"]
        assert {"name": "ca", "secret": {"secretName": "broker-ca"}} in pod["volumes"], name
        for container in pod["containers"]:
            assert {"name": "ca", "mountPath": "/etc/shardflow/ca", "readOnly": True} in (
                container["volumeMounts"]
            ), name
    test_pod = next(doc for doc in documents if doc["kind"] == "Pod")  # `helm test`'s
    assert {"name": "ca", "secret": {"secretName": "broker-ca"}} in test_pod["spec"]["volumes"]
    assert all(
        {"name": "ca", "mountPath": "/etc/shardflow/ca", "readOnly": True} in c["volumeMounts"]
        for c in test_pod["spec"]["containers"]
    )
    refused = render("extraVolumeMounts[0].name=ca")  # no mountPath
    assert refused.returncode != 0 and "mountPath" in refused.stderr, refused.stderr
