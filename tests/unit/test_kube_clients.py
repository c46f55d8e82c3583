"""The operator's API client works with every kubernetes client version it declares.

pyproject.toml says ``kubernetes>=29.0``; the Kubeflow SDK pins ``kubernetes<36``. Before,
gpuop.controller.kube called ``ApiClient.param_serialize`` (clients 36+ only), and with 35.0.0
every request failed. Here each version, installed once into a cache of its own (pip's
``--target``, with what that version pulls in, first on the path of this venv's Python), drives Kube against the API
emulator over HTTP: discovery, create, a 409, get, merge patch, a status patch, a labelled
list, an Event.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.emulator.server import ApiServer, RunningApiServer
from support.plane.gobuild import cache_root

# The oldest version pyproject.toml allows, and the newest the Kubeflow SDK (kubeflow 0.5.0) allows.
VERSIONS = ["29.0.0", "35.0.0"]

SCRIPT = """
import json, sys
from datetime import UTC, datetime
import kubernetes
from kubernetes import client as k8s_client
from gpuop.controller.apiclient import ApiError, Backoff
from gpuop.controller.kube import Kube

configuration = k8s_client.Configuration()
configuration.host = sys.argv[1]
kube = Kube(k8s_client.ApiClient(configuration), backoff=Backoff(attempts=2, base_seconds=0.001))
job = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
       "metadata": {"name": "j", "namespace": "default", "labels": {"gpuop.io/gputraining": "t"}}, "spec": {}}
seen = {"client": kubernetes.__version__}
seen["served"] = sorted(kube.served_resources("kubeflow.org/v1"))
seen["created"] = kube.create_object(job, "pytorchjobs")["metadata"]["name"]
try:
    kube.create_object(job, "pytorchjobs")
except ApiError as exc:
    seen["again"] = exc.status
patched = kube.patch_object("kubeflow.org/v1", "pytorchjobs", "default", "j", {"spec": {"runPolicy": {"suspend": True}}})
seen["patched"] = patched["spec"]["runPolicy"]
seen["got"] = kube.get_object("kubeflow.org/v1", "pytorchjobs", "default", "j")["spec"]["runPolicy"]
seen["missing"] = kube.get_object("kubeflow.org/v1", "pytorchjobs", "default", "nothing")
training = {"apiVersion": "gpuop.io/v1alpha1", "kind": "GpuTraining",
            "metadata": {"name": "t", "namespace": "default"}, "spec": {}}
kube.create_object(training, "gputrainings")
seen["status"] = (kube.patch_training_status("default", "t", {"status": {"phase": "Running"}}) or {})["status"]
pod = {"apiVersion": "v1", "kind": "Pod",
       "metadata": {"name": "p", "namespace": "default", "labels": {"gpuop.io/gputraining": "t"}}, "spec": {}}
kube._request("POST", "/api/v1/namespaces/default/pods", body=pod)
seen["pods"] = [p["metadata"]["name"] for p in kube.list_training_pods("default")]
kube.post_event(kube.get_training("default", "t"), "Normal", "Checked", "from an old client", datetime.now(UTC))
print(json.dumps(seen))
"""


def _client(version: str) -> Path:
    """kubernetes==version with its own dependencies (six, for the older ones), installed once."""
    target = cache_root() / "kubernetes-clients" / version
    if not (target / "kubernetes" / "__init__.py").is_file():
        partial = target.with_name(f"{version}.partial-{os.getpid()}")
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--target", str(partial), f"kubernetes=={version}"],
            check=True, timeout=300,
        )  # fmt: skip
        if not target.exists():  # another process may have finished first
            partial.rename(target)
    return target


@pytest.fixture
def emulator() -> Iterator[RunningApiServer]:
    with RunningApiServer(ApiServer()) as running:
        yield running


@pytest.mark.parametrize("version", VERSIONS)
def test_kube_works_with_the_kubernetes_client(version: str, emulator: RunningApiServer) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(_client(version)), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, emulator.url],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout)
    assert seen == {
        "client": version,
        "served": seen["served"],  # what the emulator serves: checked below
        "created": "j",
        "again": 409,
        "patched": {"suspend": True},
        "got": {"suspend": True},
        "missing": None,
        "status": {"phase": "Running"},
        "pods": ["p"],
    }
    assert "pytorchjobs" in seen["served"]
