"""End to end on kind, CPU/gloo: the images, the Kubeflow training-operator and Trainer v2, `helm install`,
`kubectl apply -f examples/kind-cpu.yaml`, a real 2-pod DDP run to Succeeded, and deletion.

Needs Docker, kind, kubectl and network access (Kubeflow's manifests); skips with the reason
where any is missing, as on a laptop without Docker. Only `make e2e` runs it (no lane of `make
test` names tests/e2e: a runner with Docker would otherwise build images for an hour); CI runs
it in its own job.

A cluster named `gpuop` that was already there is used and left in place; one this test created
is deleted at the end (GPUOP_E2E_KEEP=1 keeps it). When a test failed, the cluster's state is
written to GPUOP_E2E_DIAGNOSTICS (default .e2e-diagnostics/) before anything is torn down.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from support.paths import ROOT
from support.tools.helm import CHART, helm_binary
from support.waiting import wait_for

pytestmark = pytest.mark.e2e

CLUSTER = "gpuop"  # kind-config.yaml's name
KUBEFLOW = "github.com/kubeflow/trainer.git/manifests/overlays/standalone?ref=v1.9.4"
# Kubeflow Trainer v2 with its JobSet (manifests/third-party/jobset), beside the v1 operator: a
# cluster that serves both, where auto picks PyTorchJob and backend: trainjob picks Trainer.
TRAINER_V2 = "github.com/kubeflow/trainer.git/manifests/overlays/manager?ref=v2.3.0"
OPERATOR_IMAGE = "gpu-training-operator/operator:e2e"
TRAINER_IMAGE = "gpu-training-operator/trainer-cpu:dev"  # what examples/kind-cpu.yaml names
NAMESPACE = "gpuop-system"


def _missing() -> str | None:
    for tool in ("docker", "kind", "kubectl"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    if subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode != 0:
        return "no Docker engine answers (`docker info` fails)"
    return None


def sh(*args: str, timeout: float = 600, input: str | None = None) -> str:
    result = subprocess.run(args, capture_output=True, text=True, timeout=timeout, input=input)
    if result.returncode != 0:
        raise AssertionError(
            f"{' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
        )
    return result.stdout


def kubectl(*args: str, **kwargs: Any) -> str:
    return sh("kubectl", "--context", f"kind-{CLUSTER}", *args, **kwargs)


def wait_until(what: str, check: Callable[[], Any], timeout: float) -> Any:
    """Poll every 5 s; a kubectl that fails meanwhile is 'not yet'."""
    return wait_for(what, check, timeout, every=5.0, tolerate=(AssertionError,))


# What a failed run leaves for people to read: `kubectl` commands, each to a file of its own.
DIAGNOSTICS: dict[str, tuple[str, ...]] = {
    "objects.txt": ("get", "gputrainings,pytorchjobs,trainjobs,jobsets,jobs,pods,events", "-A", "-o", "wide"),
    "gputrainings.yaml": ("get", "gputrainings", "-A", "-o", "yaml"),
    "operator.log": ("-n", NAMESPACE, "logs", "-l", "app.kubernetes.io/name=gpu-training-operator",
                     "--tail=-1", "--all-containers", "--prefix"),
    "trainers.log": ("logs", "-l", "gpuop.io/gputraining", "--tail=500", "--all-containers", "--prefix"),
    "training-operator.log": ("-n", "kubeflow", "logs", "deployment/training-operator", "--tail=500"),
    "trainer-v2.log": ("-n", "kubeflow-system", "logs", "deployment/kubeflow-trainer-controller-manager",
                       "--tail=500"),
}  # fmt: skip


def collect_diagnostics(into: Path) -> None:
    """The cluster's state, while it is still there; each command on its own (one that fails
    writes its error instead)."""
    into.mkdir(parents=True, exist_ok=True)
    for name, args in DIAGNOSTICS.items():
        result = subprocess.run(["kubectl", "--context", f"kind-{CLUSTER}", *args], capture_output=True,
                                text=True, timeout=120)  # fmt: skip
        (into / name).write_text(result.stdout + result.stderr)


def wait_for_kubeflow_webhooks() -> None:
    """A rollout being done does not mean the admission webhooks answer (their Service, the
    certificate): a server-side dry run of our own rendered objects goes through them, and the
    first real create does not race them."""
    for backend, kind in (("pytorchjob", "PyTorchJob"), ("trainjob", "TrainingRuntime")):
        rendered = sh(str(ROOT / ".venv" / "bin" / "gpuop"), "render", "--backend", backend,
                      "-f", str(ROOT / "examples" / "kind-cpu.yaml"))  # fmt: skip
        (probe,) = [o for o in yaml.safe_load_all(rendered) if o and o["kind"] == kind]
        wait_until(f"Kubeflow's {kind} webhook", lambda probe=probe: kubectl(
            "create", "--dry-run=server", "-f", "-", input=yaml.safe_dump(probe)), 300)  # fmt: skip


@pytest.fixture(scope="module")
def kind_cluster(request: pytest.FixtureRequest) -> Iterator[None]:
    reason = _missing()
    if reason is not None:
        pytest.skip(f"kind e2e needs Docker and kind: {reason}")
    created = CLUSTER not in sh("kind", "get", "clusters").split()
    if created:
        sh("kind", "create", "cluster", "--config", str(ROOT / "kind-config.yaml"), "--wait", "180s",
           timeout=900)  # fmt: skip
    failed_before = request.session.testsfailed
    ready = False
    try:
        for dockerfile, tag in (
            ("operator.Dockerfile", OPERATOR_IMAGE),
            ("trainer-cpu.Dockerfile", TRAINER_IMAGE),
        ):
            sh("docker", "build", "-f", str(ROOT / "images" / dockerfile), "-t", tag, str(ROOT), timeout=1800)
            sh("kind", "load", "docker-image", tag, "--name", CLUSTER, timeout=600)
        kubectl("apply", "--server-side", "-k", KUBEFLOW, timeout=300)
        kubectl("-n", "kubeflow", "rollout", "status", "deployment/training-operator", "--timeout=300s",
                timeout=330)  # fmt: skip
        kubectl("apply", "--server-side", "-k", TRAINER_V2, timeout=300)
        for deployment in ("kubeflow-trainer-controller-manager", "jobset-controller-manager"):
            kubectl("-n", "kubeflow-system", "rollout", "status", f"deployment/{deployment}", "--timeout=300s",
                    timeout=330)  # fmt: skip
        wait_for_kubeflow_webhooks()
        ready = True
        yield
    finally:
        if not ready or request.session.testsfailed > failed_before:
            collect_diagnostics(_diagnostics_dir())
        if created and not os.environ.get("GPUOP_E2E_KEEP"):
            sh("kind", "delete", "cluster", "--name", CLUSTER, timeout=300)


def _diagnostics_dir() -> Path:
    return Path(os.environ.get("GPUOP_E2E_DIAGNOSTICS") or ROOT / ".e2e-diagnostics")


@pytest.mark.parametrize("backend", ["auto", "trainjob"])
def test_install_train_on_cpu_and_delete(kind_cluster: None, backend: str) -> None:
    """The kind example on either Kubeflow: auto (PyTorchJob, the cluster serving both) and
    backend trainjob (Trainer v2's TrainJob), each from helm install to helm uninstall."""
    sh(
        # upgrade --install: a rerun on a kept cluster, or after a failed run, is not refused.
        str(helm_binary()), "--kube-context", f"kind-{CLUSTER}", "upgrade", "--install", "gpuop", str(CHART),
        "--namespace", NAMESPACE, "--create-namespace", "--wait", "--timeout", "5m",
        "--set", "image.repository=gpu-training-operator/operator", "--set", "image.tag=e2e",
        "--set", "image.pullPolicy=Never", "--set", "replicaCount=2", "--set", "operator.scrapeInterval=5",
        timeout=400,
    )  # fmt: skip
    example = yaml.safe_load((ROOT / "examples" / "kind-cpu.yaml").read_text())
    example["spec"]["backend"] = backend
    name = example["metadata"]["name"]
    kubectl("apply", "-f", "-", input=yaml.safe_dump(example))
    kind = "trainjobs" if backend == "trainjob" else "pytorchjobs"

    def status() -> dict[str, Any]:
        return dict(json.loads(kubectl("get", "gputraining", name, "-o", "json")).get("status") or {})

    wait_until("progress in status", lambda: status().get("progress", {}).get("step"), 900)
    final = wait_until("Succeeded", lambda: (s := status()).get("phase") == "Succeeded" and s, 1200)
    assert final["progress"]["percent"] == 100, final
    assert final["completionTime"], final
    assert final["backend"] == ("trainjob" if backend == "trainjob" else "pytorchjob"), final

    table = kubectl("get", "gputrainings", name)
    crd = yaml.safe_load((ROOT / "crds" / "gputraining.yaml").read_text())
    columns = ["NAME"] + [
        c["name"].upper()
        for c in crd["spec"]["versions"][0]["additionalPrinterColumns"]
        if not c.get("priority")
    ]
    assert table.splitlines()[0].split() == columns, table
    assert "Succeeded" in table.splitlines()[1]

    kubectl("delete", "gputraining", name, "--wait=true", timeout=300)
    wait_until("the job gone", lambda: kubectl("get", kind, "-o", "name").strip() == "", 300)
    wait_until(
        "the pods gone",
        lambda: kubectl("get", "pods", "-l", f"gpuop.io/gputraining={name}", "-o", "name").strip() == "",
        300,
    )

    sh(
        str(helm_binary()),
        "--kube-context",
        f"kind-{CLUSTER}",
        "uninstall",
        "gpuop",
        "--namespace",
        NAMESPACE,
        "--wait",
        timeout=300,
    )
    assert "gputrainings.gpuop.io" in kubectl("get", "crd", "-o", "name")  # kept on uninstall
