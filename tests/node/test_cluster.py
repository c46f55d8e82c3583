"""`make cluster` and `make cluster-down` as a user runs them (``python -m support.cluster``): a
cluster up in one command, a GpuTraining through it to Succeeded, and a down that leaves
nothing of it on the machine.

Its own control plane and nodes, none of the suite's fixtures: it runs while no other module's
node or kube-proxy is up (module-scoped fixtures end with their module).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from support import specs
from support.cluster import left_on_machine
from support.images import build
from support.node.workloads import RENDEZVOUS
from support.paths import ROOT
from support.waiting import wait_for

pytestmark = pytest.mark.node


def cluster(command: str, state: Path, timeout: float) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests")}
    done = subprocess.run([sys.executable, "-m", "support.cluster", command, f"--dir={state}"], env=env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip
    return done, time.monotonic() - started


def kubectl(state: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(state / "bin" / "kubectl"), f"--kubeconfig={state / 'kubeconfig'}", *args],
                          capture_output=True, text=True, timeout=60)  # fmt: skip


@pytest.fixture
def state() -> Iterator[Path]:
    """A short state directory: a node's unix sockets lie deep under it (pytest's tmp_path is
    too deep for them)."""
    directory = Path(tempfile.mkdtemp(prefix="gpuop-cluster-", dir="/tmp"))
    yield directory / "state"
    shutil.rmtree(directory, ignore_errors=True)


def test_a_state_directory_too_deep_for_unix_sockets_is_refused_in_one_line(tmp_path: Path) -> None:
    deep = tmp_path / ("x" * 60) / "cluster"
    refused, _ = cluster("up", deep, timeout=60)
    assert refused.returncode == 1
    assert refused.stderr.startswith(f"error: {deep} is too deep for the nodes' unix sockets"), refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert not deep.exists()


def test_make_cluster_runs_a_gpu_training_and_cluster_down_leaves_nothing(state: Path) -> None:
    up, took = cluster("up", state, timeout=600)
    print(f"cluster up in {took:.1f}s:\n{up.stdout}")
    try:
        assert up.returncode == 0, f"{up.stdout}\n{up.stderr}\n{_tail(state)}"
        assert f"export KUBECONFIG={state / 'kubeconfig'}" in up.stdout
        assert "make cluster-down" in up.stdout
        nodes = json.loads(kubectl(state, "get", "nodes", "-o", "json").stdout)["items"]
        assert len(nodes) == 2, [n["metadata"]["name"] for n in nodes]
        for node in nodes:
            ready = {c["type"]: c["status"] for c in node["status"]["conditions"]}["Ready"]
            assert (ready, node["status"]["allocatable"]["nvidia.com/gpu"]) == ("True", "2"), node["status"]
        # The chart's defaults, from the image built here, serving the API.
        body = specs.training("hello", "default", image=build.chart_image(), command=["python", "-c", RENDEZVOUS],
                              workers=2, gpusPerWorker=1, resources={"cpu": "100m", "memory": "128Mi"})  # fmt: skip
        created = subprocess.run(
            [str(state / "bin" / "kubectl"), f"--kubeconfig={state / 'kubeconfig'}", "create", "-f", "-"],
            input=json.dumps(body), capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert created.returncode == 0, created.stderr

        def phase() -> str | None:
            got = kubectl(state, "get", "gtr", "hello", "-o", "jsonpath={.status.phase}").stdout
            return got if got in ("Succeeded", "Failed") else None

        assert wait_for("hello finished", phase, timeout=180, every=1) == "Succeeded", _describe(state)
        assert (
            kubectl(state, "get", "gtr", "hello", "-o", "jsonpath={.status.backend}").stdout == "pytorchjob"
        )

        # The master ends once the worker reached it; the worker, a moment after.
        def both_done() -> bool:
            got = kubectl(state, "get", "pods", "-l", "training.kubeflow.org/job-name=hello", "-o",
                          "jsonpath={.items[*].status.phase}").stdout.split()  # fmt: skip
            return got == ["Succeeded", "Succeeded"]

        wait_for("both pods Succeeded", both_done, timeout=120, every=1)
        # Each worker's log, as its node's kubelet wrote it (either node: no `kubectl logs` there).
        said = "".join(
            path.read_text()
            for path in sorted(state.glob("node-*/kubelet/pod-logs/default_hello-*/pytorch/*.log"))
        )
        for rank in (0, 1):
            assert f"rank {rank} devices GPU-standin-" in said, said
        assert "rank 1 devices GPU-standin-" in said.split("rank 0 devices ", 1)[1], (
            said
        )  # as the master heard it
    finally:
        down, took = cluster("down", state, timeout=600)
        print(f"cluster down in {took:.1f}s: {down.stdout}{down.stderr}")
    assert down.returncode == 0, f"{down.stdout}\n{down.stderr}"
    assert "nothing of it is left on the machine" in down.stdout
    assert not state.exists()
    assert left_on_machine(state) == []
    again, _ = cluster("down", state, timeout=60)
    assert (again.returncode, again.stdout.strip()) == (0, "no cluster was running")


def _tail(state: Path) -> str:
    log = state / "supervisor.log"
    return "\n".join(log.read_text().splitlines()[-40:]) if log.exists() else "(no supervisor log)"


def _describe(state: Path) -> dict[str, Any]:
    got = kubectl(state, "get", "gtr,pods", "-o", "json")
    return json.loads(got.stdout) if got.returncode == 0 else {"error": got.stderr}
