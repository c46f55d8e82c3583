"""A cluster for operator tests: the API emulator, the real operator process, kubectl, and the
test playing the training-operator and the kubelet.

The operator runs as ``gpuop operator`` in a subprocess, logged in through a kubeconfig like
any user's, so a test can kill it with SIGKILL at any moment and start it again. Trainer
pods get IPs on 127.N.0.x (N is the session's: support.samples) where the trainer's own
metrics server (``gputrain.metrics``) serves on the contract's port.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from gpuop.controller.apiclient import WRITE_VERBS
from gputrain.contract import Progress
from support.emulator.server import ApiServer, RunningApiServer
from support.plane.controlplane import ensure_binaries
from support.samples import StandInTrainers

TRAININGS = "gpuop.io/v1alpha1/gputrainings"
JOBS = "kubeflow.org/v1/pytorchjobs"
PODS = "v1/pods"
NODES = "v1/nodes"
EVENTS = "v1/events"
GPUOP = str(Path(sys.executable).with_name("gpuop"))
# The kubectl built with the control plane: a machine need not have one installed.
KUBECTL = str(ensure_binaries() / "kubectl")
STAMP = "%Y-%m-%dT%H:%M:%SZ"


def admit_all(server: ApiServer) -> None:
    """Admission as in a cluster with our CRD and Kubeflow's training-operator."""
    server.validate_gputrainings()
    server.validate_pytorchjobs()


def stranger_job(name: str) -> dict[str, Any]:
    """A PyTorchJob someone else made: no owner, no operator label."""
    return {
        "apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"pytorchReplicaSpecs": {"Master": {"replicas": 1, "template": {"spec": {
            "containers": [{"name": "pytorch", "image": "someone/else"}]}}}}},
    }  # fmt: skip


class Cluster:
    def __init__(self, api: RunningApiServer, workdir: Path) -> None:
        self.api = api
        self.server: ApiServer = api.server
        self.kubeconfig = api.kubeconfig(workdir / "kubeconfig")
        self.workdir = workdir
        self.operator: subprocess.Popen[bytes] | None = None
        self.replicas: list[subprocess.Popen[bytes]] = []
        self.operator_args: list[str] = []
        self.operator_env: dict[str, str] = {}  # the operator's own, beside KUBECONFIG
        self.trainers = StandInTrainers(first_ip=2)
        self._log_index = 0

    # -- the operator ---------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig), "PYTHONUNBUFFERED": "1"}

    def start_operator(self, *args: str, lease_namespace: str | None = None) -> subprocess.Popen[bytes]:
        """Start ``gpuop operator`` (standalone unless the namespace of a Lease to lead by is
        given); a restart without arguments reuses the last ones. The newest process is
        ``self.operator``."""
        if args or lease_namespace is not None:
            lease = ["--lease-namespace", lease_namespace] if lease_namespace else ["--standalone"]
            self.operator_args = [*args, *lease]
        elif not self.operator_args:
            self.operator_args = ["--standalone"]
        self._log_index += 1
        log = (self.workdir / f"operator-{self._log_index}.log").open("wb")
        self.operator = subprocess.Popen(
            [GPUOP, "operator", "--metrics-port", "0", "--health-port", "0",
             "--scrape-interval", "1", "--scrape-timeout", "0.5", *self.operator_args],
            env={**self.env(), **self.operator_env}, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.replicas.append(self.operator)
        return self.operator

    def kill_operator(self, process: subprocess.Popen[bytes] | None = None) -> None:
        process = process or self.operator
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGKILL)
            process.wait(10)

    def stop_operator(self, process: subprocess.Popen[bytes] | None = None) -> None:
        """SIGTERM, as the kubelet sends: the operator gives its Lease up on its way out."""
        process = process or self.operator
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                self.kill_operator(process)

    def operator_log(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.workdir.glob("operator-*.log")))

    # -- kubectl --------------------------------------------------------------------------

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [KUBECTL, *args], env=self.env(), input=input, capture_output=True, text=True, timeout=30
        )
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {result.stderr}")
        return result

    def apply(self, body: dict[str, Any]) -> None:
        # --validate=false: kubectl's client-side schema download needs the server's OpenAPI
        # documents, which the emulator does not serve; the emulator's admission validates.
        self.kubectl("apply", "--validate=false", "-f", "-", input=json.dumps(body))

    # -- reading the store ----------------------------------------------------------------

    def get(self, key: str, name: str, namespace: str | None = "default") -> dict[str, Any] | None:
        result: dict[str, Any] | None = self.api.call(self.server.get, key, namespace, name)
        return result

    def status(self, name: str, namespace: str = "default") -> dict[str, Any]:
        obj = self.get(TRAININGS, name, namespace) or {}
        return obj.get("status") or {}

    def objects(self, key: str, namespace: str | None = None) -> list[dict[str, Any]]:
        return list(self.api.iter_objects(key, namespace))

    def events(self, name: str) -> list[tuple[str, str]]:
        return [
            (e["type"], e["reason"])
            for e in sorted(self.objects(EVENTS), key=lambda e: int(e["metadata"]["resourceVersion"]))
            if e["involvedObject"]["name"] == name
        ]

    def condition(self, name: str, kind: str) -> dict[str, Any] | None:
        for c in self.status(name).get("conditions", []):
            if c["type"] == kind:
                return dict(c)
        return None

    def writes(self, agent: str = "gpuop") -> dict[str, int]:
        out: dict[str, int] = {}
        for (who, verb, key), count in dict(self.server.counts).items():
            if who == agent and verb in WRITE_VERBS:
                out[f"{verb} {key}"] = out.get(f"{verb} {key}", 0) + count
        return out

    # -- playing the training-operator and the kubelet ------------------------------------

    def job_condition(self, name: str, *conditions: str, **status: Any) -> None:
        """Set the PyTorchJob's conditions (each True) and other status fields."""
        now = time.strftime(STAMP, time.gmtime())
        body = {
            "status": {
                "conditions": [
                    {"type": c, "status": "True", "reason": f"PyTorchJob{c}", "message": f"job is {c.lower()}",
                     "lastTransitionTime": now}
                    for c in conditions
                ],
                **status,
            }
        }  # fmt: skip
        self.api.call(self.server.patch, JOBS, "default", name, body, True)

    def start_pods(self, job: str, count: int, progress: Progress, gpu_percent: float | None) -> list[str]:
        """Create ``count`` running pods of a job, each with a live trainer metrics endpoint."""
        names = []
        for index in range(count):
            role = "master" if index == 0 else "worker"
            pod_name = f"{job}-{role}-{index if index == 0 else index - 1}"
            ip = self.trainers.start(pod_name, progress, gpu_percent)
            pod = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": pod_name,
                    "namespace": "default",
                    "labels": {"gpuop.io/gputraining": job, "training.kubeflow.org/job-name": job},
                },
                "spec": {"containers": [{"name": "pytorch", "image": "trainer"}]},
            }
            self.api.call(self.server.create, PODS, pod)
            self.api.call(
                self.server.patch, PODS, "default", pod_name,
                {"status": {"phase": "Running", "podIP": ip,
                            "conditions": [{"type": "Ready", "status": "True"}]}},
                True,
            )  # fmt: skip
            names.append(pod_name)
        return names

    def lose_node(self, pod: str, node: str) -> None:
        """``pod`` runs on ``node``, and the node is lost: its kubelet stopped posting long ago,
        and the node controller marked its pod not ready."""
        self.api.call(self.server.create, NODES, {
            "apiVersion": "v1", "kind": "Node", "metadata": {"name": node},
            "status": {"conditions": [{"type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown",
                                       "lastTransitionTime": "2026-01-01T00:00:00Z"}]},
        })  # fmt: skip
        self.api.call(self.server.patch, PODS, "default", pod, {"spec": {"nodeName": node}})
        self.api.call(
            self.server.patch, PODS, "default", pod,
            {"status": {"conditions": [{"type": "Ready", "status": "False"}]}}, True,
        )  # fmt: skip

    def progress(self, pod: str, progress: Progress, gpu_percent: float | None = None) -> None:
        self.trainers.report(pod, progress, gpu_percent)

    def finish_pod(self, pod: str, record: dict[str, Any], phase: str = "Succeeded") -> None:
        """The trainer exits: its metrics endpoint goes, its termination message stays."""
        self.trainers.stop(pod)
        terminated = {"exitCode": 0 if phase == "Succeeded" else 1, "message": json.dumps(record)}
        self.api.call(
            self.server.patch, PODS, "default", pod,
            {"status": {"phase": phase, "podIP": None, "conditions": [{"type": "Ready", "status": "False"}],
                        "containerStatuses": [{"name": "pytorch", "state": {"terminated": terminated}}]}},
            True,
        )  # fmt: skip

    def close(self) -> None:
        for process in self.replicas:
            self.stop_operator(process)
        self.trainers.close()


@contextlib.contextmanager
def cluster(workdir: Path, configure: Callable[[ApiServer], None] | None = None) -> Iterator[Cluster]:
    """A started emulator (with admission as configured) and a Cluster around it."""
    server = ApiServer()
    if configure is not None:
        configure(server)
    with RunningApiServer(server) as api:
        env = Cluster(api, workdir)
        try:
            yield env
        finally:
            env.close()
