"""A local stand-in for a kubelet and the Deployment controller (tests/test_render_run.py).

It runs the pods of manifests rendered by `helm template` as local processes, each as the
kubelet would start its container: the image's ENTRYPOINT (from the Dockerfile) with the pod's
`command`/`args`, the image's ENV and then the container's `envFrom` and `env`, resolved from
the rendered ConfigMaps and Secrets, in the image's WORKDIR. It probes them as the pod spec
says (startup, liveness and readiness on their httpGet paths), restarts a container that exits
(`restartPolicy: Always`), and stops one as a kubelet does: SIGTERM, then SIGKILL after the
pod's `terminationGracePeriodSeconds`. A changed pod template rolls its Deployment as the
controller does: new pods up to `maxSurge`, an old one stopped only while `maxUnavailable`
allows, counting only ready pods.

What a process cannot have here: a network namespace of its own. Each pod gets a loopback
address (127.0.1.N) standing in for its pod IP, passed as SHARDFLOW_METRICS_ADDR: the one
variable a pod would not have. Readiness is probed every PROBE_S instead of `periodSeconds`,
and a restart waits RESTART_S, not the kubelet's 10 s doubling backoff; liveness and startup
failures count in the pod's own seconds (`periodSeconds * failureThreshold`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import itertools
import json
import math
import re
import shlex
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROBE_S = 0.25  # how often readiness is probed here (a kubelet: periodSeconds)
RESTART_S = 1.0  # pause before a container that exited is started again
WORKLOADS = {"Deployment"}
# Kinds that change nothing for processes on one machine (scheduling, RBAC, network rules).
INERT = {"ServiceAccount", "NetworkPolicy", "PodDisruptionBudget", "Service", "ServiceMonitor"}
_ADDRESSES = itertools.count(1)
_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


@dataclass(frozen=True)
class Image:
    """What the Dockerfile's last stage gives a container: ENTRYPOINT, CMD, ENV, WORKDIR."""

    entrypoint: list[str]
    cmd: list[str]
    env: dict[str, str]
    workdir: str

    @classmethod
    def from_dockerfile(cls, path: Path) -> Image:
        text = path.read_text().replace("\\\n", " ")
        final = re.split(r"^FROM .*$", text, flags=re.M)[-1]

        def one(instruction: str) -> str:
            found = re.findall(rf"^{instruction} (.+)$", final, flags=re.M)
            assert found, f"{path}: no {instruction} in the last stage"
            return str(found[-1]).strip()

        env: dict[str, str] = {}
        for line in re.findall(r"^ENV (.+)$", final, flags=re.M):
            for pair in shlex.split(line):
                name, _, value = pair.partition("=")
                env[name] = value
        return cls(json.loads(one("ENTRYPOINT")), json.loads(one("CMD")), env, one("WORKDIR"))


@dataclass
class Stopped:
    """How a stop ended: the exit code, and whether SIGKILL was needed."""

    pod: str
    code: int
    killed: bool
    seconds: float


@dataclass
class Pod:
    name: str
    owner: str  # the Deployment
    revision: str  # hash of the pod template it was made from
    spec: dict[str, Any]  # the pod spec
    ip: str
    log: Path
    tmp: Path
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None
    ready: bool = False
    terminating: bool = False
    exits: list[int] = field(default_factory=list)  # exit codes of the runs it restarted after
    liveness_kills: int = 0

    @property
    def container(self) -> dict[str, Any]:
        (only,) = self.spec["containers"]
        return only

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def memory(self) -> tuple[int, int]:
        """(the process's peak resident bytes so far, the container's memory limit in bytes)."""
        assert self.process is not None and self.running()
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        (peak_kb,) = re.findall(r"^VmHWM:\s+(\d+) kB$", status, flags=re.M)
        limit = self.container["resources"]["limits"]["memory"]
        return int(peak_kb) * 1024, _bytes(limit)


@dataclass
class Deployment:
    name: str
    doc: dict[str, Any]
    pods: list[Pod] = field(default_factory=list)

    @property
    def revision(self) -> str:
        return revision_of(self.doc)


def revision_of(doc: dict[str, Any]) -> str:
    template = json.dumps(doc["spec"]["template"], sort_keys=True).encode()
    return hashlib.sha256(template).hexdigest()[:10]


class Cluster:
    """Pods of rendered Deployments as local processes; `apply` is `helm upgrade --wait`."""

    def __init__(self, image: Image, *, install_root: tuple[str, Path], workdir: Path, logs: Path):
        self.image = image
        # (where the image installs shardflow, where it is installed here), e.g. the venv.
        self.install_root = install_root
        self.workdir = workdir
        self.logs = logs
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.deployments: dict[str, Deployment] = {}
        self.every_pod: list[Pod] = []  # deleted ones too
        self.ignored: set[str] = set()
        self.stops: list[Stopped] = []
        self._stopping: list[asyncio.Task[None]] = []
        self._keepers: list[asyncio.Task[None]] = []
        self._names = itertools.count()

    # --- the API server's part: what a release holds

    async def apply(self, documents: list[dict[str, Any]], timeout_s: float = 240) -> None:
        """Make the cluster hold these manifests (hooks aside) and wait for every rollout."""
        kinds = {doc["kind"] for doc in documents if not hook(doc)}
        unknown = kinds - WORKLOADS - INERT - {"ConfigMap", "Secret"}
        assert not unknown, f"kinds this stand-in cannot run: {unknown}"
        self.ignored |= kinds & INERT
        self.objects = {
            (doc["kind"], doc["metadata"]["name"]): doc
            for doc in documents
            if doc["kind"] in ("ConfigMap", "Secret")
        }
        wanted = {d["metadata"]["name"]: d for d in documents if d["kind"] in WORKLOADS}
        work = [self._delete(name) for name in set(self.deployments) - set(wanted)]
        work += [self._roll(doc) for doc in wanted.values()]
        try:
            await asyncio.wait_for(asyncio.gather(*work), timeout_s)
        except TimeoutError:
            raise AssertionError(f"rollout not done in {timeout_s}s:\n{self.report()}") from None

    def report(self) -> str:
        """Each pod, whether it is ready, its restarts, and the end of its log."""
        lines = []
        for deployment in self.deployments.values():
            for pod in deployment.pods:
                tail = pod.log.read_text(errors="replace")[-1500:] if pod.log.exists() else ""
                lines.append(f"--- {pod.name} ready={pod.ready} exits={pod.exits}\n{tail}")
        return "\n".join(lines)

    async def _delete(self, name: str) -> None:
        deployment = self.deployments.pop(name)
        for pod in deployment.pods:
            self._stop(pod)
        deployment.pods.clear()

    async def _roll(self, doc: dict[str, Any]) -> None:
        """The Deployment controller: create, scale, or roll to a new pod template."""
        name = doc["metadata"]["name"]
        deployment = self.deployments.setdefault(name, Deployment(name, doc))
        deployment.doc = doc
        replicas = int(doc["spec"].get("replicas", 1))
        strategy = doc["spec"].get("strategy") or {}
        assert strategy.get("type", "RollingUpdate") == "RollingUpdate", strategy
        rolling = strategy.get("rollingUpdate") or {}
        surge = _scaled(rolling.get("maxSurge", "25%"), replicas, math.ceil)
        unavailable = _scaled(rolling.get("maxUnavailable", "25%"), replicas, math.floor)
        if surge == 0 and unavailable == 0:
            unavailable = 1
        revision = deployment.revision
        while True:
            old = [p for p in deployment.pods if p.revision != revision]
            new = [p for p in deployment.pods if p.revision == revision]
            if not old and len(new) == replicas and all(p.ready for p in new):
                return
            while len(new) < replicas and len(old) + len(new) < replicas + surge:
                new.append(self._start(deployment))
            for extra in new[replicas:]:  # scaled down
                deployment.pods.remove(extra)
                self._stop(extra)
            ready = sum(p.ready for p in deployment.pods)
            for pod in sorted(old, key=lambda p: p.ready):  # not-ready ones go first
                if ready - pod.ready < replicas - unavailable:
                    break
                deployment.pods.remove(pod)
                self._stop(pod)
                ready -= pod.ready
            await asyncio.sleep(0.1)

    # --- the kubelet's part: one pod

    def _start(self, deployment: Deployment) -> Pod:
        revision = deployment.revision
        name = f"{deployment.name}-{revision[:8]}-{next(self._names)}"
        number = next(_ADDRESSES)
        ip = f"127.0.{1 + number // 250}.{1 + number % 250}"
        tmp = self.logs / "tmp" / name  # the pod's emptyDir at /tmp
        tmp.mkdir(parents=True)
        spec = deployment.doc["spec"]["template"]["spec"]
        pod = Pod(name, deployment.name, revision, spec, ip, self.logs / f"{name}.log", tmp)
        deployment.pods.append(pod)
        self.every_pod.append(pod)
        self._keepers.append(asyncio.create_task(self._keep(pod)))
        return pod

    def container_env(self, container: dict[str, Any], pod_name: str, tmp: Path) -> dict[str, str]:
        """The environment a kubelet gives this container: the image's ENV, then envFrom, then
        env, each `$(VAR)` expanded; a missing ConfigMap, Secret or key fails as it would."""
        root, here = self.install_root
        env = {
            name: value.replace(root, str(here)).replace("$PATH", "/usr/local/bin:/usr/bin:/bin")
            for name, value in self.image.env.items()
        }
        env["HOSTNAME"] = pod_name
        for name in ("HOME", "TMPDIR"):
            if env.get(name, "/tmp") == "/tmp":
                env[name] = str(tmp)  # the pod's /tmp is an emptyDir of its own
        for source in container.get("envFrom", []):
            prefix = source.get("prefix", "")
            if "configMapRef" in source:
                data = self._data("ConfigMap", source["configMapRef"])
            elif "secretRef" in source:
                data = self._data("Secret", source["secretRef"])
            else:
                raise AssertionError(f"envFrom {source} is not emulated")
            env.update({prefix + key: value for key, value in data.items()})
        for entry in container.get("env", []):
            if "value" in entry:
                env[entry["name"]] = _expand(entry["value"], env)
                continue
            ref = entry.get("valueFrom", {})
            if "configMapKeyRef" in ref:
                kind, key_ref = "ConfigMap", ref["configMapKeyRef"]
            elif "secretKeyRef" in ref:
                kind, key_ref = "Secret", ref["secretKeyRef"]
            else:
                raise AssertionError(f"env {entry['name']}: {ref} is not emulated")
            data = self._data(kind, key_ref)
            if key_ref["key"] in data:
                env[entry["name"]] = data[key_ref["key"]]
            else:
                assert key_ref.get("optional"), f"{kind} {key_ref['name']} has no {key_ref['key']}"
        return env

    def _data(self, kind: str, ref: dict[str, Any]) -> dict[str, str]:
        doc = self.objects.get((kind, ref["name"]))
        if doc is None:
            assert ref.get("optional"), f"no {kind} {ref['name']}: the pod would not start"
            return {}
        data = dict(doc.get("data") or {})
        if kind == "Secret":
            data = {key: base64.b64decode(value).decode() for key, value in data.items()}
            data.update(doc.get("stringData") or {})
        return {key: str(value) for key, value in data.items()}

    def argv(self, container: dict[str, Any], env: dict[str, str]) -> list[str]:
        """ENTRYPOINT and CMD of the image, replaced by the container's command and args."""
        if "command" in container:
            argv = [*container["command"], *container.get("args", [])]
        else:
            argv = [*self.image.entrypoint, *container.get("args", self.image.cmd)]
        argv = [_expand(str(arg), env) for arg in argv]
        found = shutil.which(argv[0], path=env.get("PATH", ""))
        assert found, f"{argv[0]}: executable not found in the container's PATH"
        return [found, *argv[1:]]

    def workdir_of(self, container: dict[str, Any]) -> Path:
        wanted = container.get("workingDir", self.image.workdir)
        assert wanted == self.image.workdir, f"workingDir {wanted} is not emulated"
        return self.workdir

    def _launch(self, pod: Pod) -> None:
        container = pod.container
        pod.env = self.container_env(container, pod.name, pod.tmp)
        pod.env["SHARDFLOW_METRICS_ADDR"] = pod.ip  # stands in for the pod's own network
        with pod.log.open("ab") as out:
            out.write(f"=== start {time.strftime('%H:%M:%S')} {pod.name} at {pod.ip}\n".encode())
            out.flush()
            pod.process = subprocess.Popen(
                self.argv(container, pod.env),
                env=pod.env,
                cwd=self.workdir_of(container),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a signal reaches this process only, like PID 1's
            )

    async def _keep(self, pod: Pod) -> None:
        """restartPolicy Always, and the probes."""
        while not pod.terminating:
            self._launch(pod)
            assert pod.process is not None
            await self._probe_until_exit(pod)
            pod.ready = False
            if pod.terminating:
                return
            code = pod.process.wait()
            pod.exits.append(code)
            with pod.log.open("ab") as out:
                out.write(f"=== exited {code}; restarting\n".encode())
            await asyncio.sleep(RESTART_S)

    async def _probe_until_exit(self, pod: Pod) -> None:
        container = pod.container
        startup = container.get("startupProbe")
        liveness = container.get("livenessProbe")
        readiness = container.get("readinessProbe")
        started_at = time.monotonic()
        started = startup is None
        failing_since: float | None = None
        while pod.running() and not pod.terminating:
            now = time.monotonic()
            if not started:
                assert startup is not None
                started = await self._check(pod, startup)
                if not started and now - started_at > _patience(startup):
                    await self._liveness_kill(pod, "startup")
                    return
            else:
                if liveness is not None:
                    if await self._check(pod, liveness):
                        failing_since = None
                    elif failing_since is None:
                        failing_since = now
                    elif now - failing_since > _patience(liveness):
                        await self._liveness_kill(pod, "liveness")
                        return
                ready = readiness is None or await self._check(pod, readiness)
                pod.ready = ready and pod.running() and not pod.terminating
            await asyncio.sleep(PROBE_S)

    async def _liveness_kill(self, pod: Pod, probe: str) -> None:
        pod.liveness_kills += 1
        with pod.log.open("ab") as out:
            out.write(f"=== {probe} probe failed: killing\n".encode())
        pod.ready = False
        await self._terminate(pod, record=False)

    async def _check(self, pod: Pod, probe: dict[str, Any]) -> bool:
        get = probe.get("httpGet")
        assert get is not None, f"probe {probe} is not emulated"
        port = get["port"]
        if isinstance(port, str):
            (port,) = [p["containerPort"] for p in pod.container["ports"] if p["name"] == port]
        timeout = float(probe.get("timeoutSeconds", 1))
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(pod.ip, port), timeout)
            try:
                writer.write(f"GET {get['path']} HTTP/1.0\r\nHost: {pod.ip}\r\n\r\n".encode())
                line = await asyncio.wait_for(reader.readline(), timeout)
            finally:
                writer.close()
            return 200 <= int(line.split()[1]) < 400
        except (OSError, TimeoutError, ValueError, IndexError):
            return False

    def _stop(self, pod: Pod) -> None:
        """Delete a pod: it stops being ready at once and terminates in the background."""
        pod.terminating = True
        pod.ready = False
        self._stopping.append(asyncio.create_task(self._terminate(pod)))

    async def _terminate(self, pod: Pod, record: bool = True) -> None:
        """SIGTERM, then SIGKILL after terminationGracePeriodSeconds."""
        if pod.process is None:
            return
        grace = float(pod.spec.get("terminationGracePeriodSeconds", 30))
        began = time.monotonic()
        killed = False
        with contextlib.suppress(ProcessLookupError):
            pod.process.send_signal(signal.SIGTERM)
        if not await _exited(pod.process, grace):
            killed = True
            pod.process.kill()
        code = await asyncio.to_thread(pod.process.wait)
        if record:
            self.stops.append(Stopped(pod.name, code, killed, time.monotonic() - began))

    # --- what the test does to the cluster

    def pods(self, deployment: str) -> list[Pod]:
        return list(self.deployments[deployment].pods)

    def pod_with_pid(self, pid: int) -> Pod | None:
        found = [p for d in self.deployments.values() for p in d.pods if p.pid == pid]
        return found[0] if found else None

    async def wait_ready(self, pod: Pod, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while not pod.ready:
            assert time.monotonic() < deadline, f"{pod.name} not ready:\n{self.report()}"
            await asyncio.sleep(0.1)

    async def wait_restarted(self, pod: Pod, times: int = 1, timeout_s: float = 60) -> None:
        """Until the pod's container was started again `times` times and is ready."""
        deadline = time.monotonic() + timeout_s
        while len(pod.exits) < times or not pod.ready:
            assert time.monotonic() < deadline, f"{pod.name} not back:\n{self.report()}"
            await asyncio.sleep(0.1)

    async def exec(
        self, deployment: str, *argv: str, timeout_s: float = 120
    ) -> tuple[int, str, str]:
        """`kubectl exec deploy/NAME -- ARGV`: in a ready pod's environment."""
        pod = next(p for p in self.deployments[deployment].pods if p.ready)
        return await self._run(argv, pod.env, self.workdir_of(pod.container), timeout_s)

    async def run_hook(self, doc: dict[str, Any], timeout_s: float = 120) -> tuple[int, str]:
        """A hook pod (`helm test`): its container run to the end; (exit code, output)."""
        assert doc["spec"].get("restartPolicy") == "Never", "a hook pod runs once"
        (container,) = doc["spec"]["containers"]
        name = doc["metadata"]["name"]
        tmp = self.logs / "tmp" / f"{name}-{next(self._names)}"
        tmp.mkdir(parents=True)
        env = self.container_env(container, name, tmp)
        code, out, err = await self._run(
            self.argv(container, env), env, self.workdir_of(container), timeout_s
        )
        return code, out + err

    async def _run(
        self, argv: Any, env: dict[str, str], cwd: Path, timeout_s: float
    ) -> tuple[int, str, str]:
        program = shutil.which(argv[0], path=env.get("PATH", "")) or argv[0]
        process = await asyncio.create_subprocess_exec(
            program, *argv[1:], env=env, cwd=cwd,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(process.communicate(), timeout_s)
        return await process.wait(), out.decode(), err.decode()

    async def uninstall(self) -> None:
        """Delete every Deployment and wait until every pod stopped."""
        for name in list(self.deployments):
            await self._delete(name)
        await self.settle()

    async def settle(self) -> None:
        """Wait for every pod that is terminating."""
        while self._stopping:
            await self._stopping.pop()

    def kill_all(self) -> None:
        """Last resort (a failed test): SIGKILL whatever still runs."""
        for deployment in self.deployments.values():
            for pod in deployment.pods:
                pod.terminating = True
                if pod.running():
                    assert pod.process is not None
                    pod.process.kill()
        for task in [*self._keepers, *self._stopping]:
            task.cancel()


def hook(doc: dict[str, Any]) -> str | None:
    return (doc.get("metadata", {}).get("annotations") or {}).get("helm.sh/hook")


def _scaled(value: int | str, replicas: int, rounding: Any) -> int:
    if isinstance(value, str) and value.endswith("%"):
        return int(rounding(replicas * int(value[:-1]) / 100))
    return int(value)


async def _exited(process: subprocess.Popen[bytes], within_s: float) -> bool:
    for _ in range(int(within_s / 0.05) + 1):
        if process.poll() is not None:
            return True
        await asyncio.sleep(0.05)
    return process.poll() is not None


def _bytes(quantity: str) -> int:
    """A Kubernetes memory quantity (`256Mi`, `1Gi`, `500M`, `1000000`) in bytes."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6,
             "G": 10**9, "T": 10**12}  # fmt: skip
    number, unit = re.fullmatch(r"(\d+)([KMGT]i|[kMGT])?", quantity).groups()  # type: ignore[union-attr]
    return int(number) * units.get(unit or "", 1)


def _patience(probe: dict[str, Any]) -> float:
    return float(probe.get("periodSeconds", 10)) * int(probe.get("failureThreshold", 3))


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` in env values, command and args (`$$` is a `$`; unknown stays)."""
    return _VAR.sub(lambda m: "$" if m.group(1) is None else env.get(m.group(1), m.group(0)), text)
