"""`make cluster` and `make cluster-down` as a user runs them (``python -m support.cluster``): a
cluster up in one command, the kind example with no image through it to Succeeded with its
progress reported all the way, and a down that leaves nothing of it on the machine.

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
import yaml

from support import registry, specs
from support.cluster import left_on_machine
from support.paths import ROOT
from support.plane import controlplane
from support.training import put_hooks
from support.waiting import wait_for

pytestmark = pytest.mark.node

KIND_CPU = ROOT / "examples" / "kind-cpu.yaml"
# README's first training, run as README says to on a cluster without GPUs.
FIRST_TRAINING = ROOT / "examples" / "first-training.yaml"
# A user's own loop that reports through gpureport (in the trainer image, as `pip install`
# would put it): 15 steps of 2 s.
PLAIN_LOOP = """
import time, gpureport
total = 15
for step in range(1, total + 1):
    time.sleep(2)
    gpureport.report(step=step, total_steps=total, loss=1.0 / step)
gpureport.finish(step=total, total_steps=total, loss=1.0 / total)
"""


def cluster(command: str, state: Path, timeout: float) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests")}
    done = subprocess.run([sys.executable, "-m", "support.cluster", command, f"--dir={state}"], env=env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip
    return done, time.monotonic() - started


def kubectl(state: Path, *args: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(state / "bin" / "kubectl"), f"--kubeconfig={state / 'kubeconfig'}", *args],
                          input=input, capture_output=True, text=True, timeout=60)  # fmt: skip


def _claim(name: str, folder: Path) -> list[dict[str, Any]]:
    """A ReadWriteMany claim in ``default`` bound to a hostPath volume of ``folder``: both nodes
    are this machine, so every pod of a training shares it wherever it runs."""
    return [
        {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"default-{name}"},
         "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"], "storageClassName": "",
                  "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": str(folder), "type": "Directory"},
                  "claimRef": {"namespace": "default", "name": name}}},
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name, "namespace": "default"},
         "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "", "volumeName": f"default-{name}",
                  "resources": {"requests": {"storage": "1Gi"}}}},
    ]  # fmt: skip


@pytest.fixture
def state() -> Iterator[Path]:
    """A short state directory: a node's unix sockets lie deep under it (pytest's tmp_path is
    too deep for them)."""
    directory = Path(tempfile.mkdtemp(prefix="gpuop-cluster-", dir="/tmp"))
    yield directory / "state"
    # A test stopped mid-way (Ctrl-C, the lanes' SIGINT) leaves the detached supervisor running,
    # its start perhaps under way: it goes first, or removing its state kills its pieces under it.
    controlplane.stop_supervisor(directory / "state", timeout=300)
    shutil.rmtree(directory, ignore_errors=True)


def test_a_state_directory_too_deep_for_unix_sockets_is_refused_in_one_line(tmp_path: Path) -> None:
    deep = tmp_path / ("x" * 60) / "cluster"
    refused, _ = cluster("up", deep, timeout=60)
    assert refused.returncode == 1
    assert refused.stderr.startswith(f"error: {deep} is too deep for the nodes' unix sockets"), refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert not deep.exists()


def test_make_cluster_trains_the_first_example_and_the_kind_example_and_cluster_down_leaves_nothing(
    state: Path,
) -> None:
    """The whole chain as a user meets it, every pod a container: the chart installed from the
    registry `make release` pushed to (`helm install oci://...`, its defaults), the operator's
    image pulled by the node; the operator renders the jobs with its default trainer image (which
    the release pushed and each node's kubelet pulls), the real training-operator makes the
    pods, the kubelets run torchrun -m gputrain (README's first training with its GPU count set to 0; the kind example,
    whose DDP workers meet over gloo by the master's name through CoreDNS, on Trainer v2 and
    JobSet) and a user's plain loop; each status follows its training while it runs, the
    user's loop through its own reports alone."""
    up, took = cluster("up", state, timeout=600)
    print(f"cluster up in {took:.1f}s:\n{up.stdout}")
    try:
        assert up.returncode == 0, f"{up.stdout}\n{up.stderr}\n{_tail(state)}"
        assert f"export KUBECONFIG={state / 'kubeconfig'}" in up.stdout
        assert "make cluster-down" in up.stdout
        # The registry the chart came from, where a user's tools find it.
        address = registry.read(state).address
        assert (state / "registry-ca.crt").read_text().startswith("-----BEGIN CERTIFICATE-----")
        operator = json.loads(kubectl(state, "get", "pods", "-n", "gpuop-system", "-o", "json").stdout)[
            "items"
        ][0]
        assert operator["spec"]["containers"][0]["image"].startswith(f"{address}/operator:"), operator["spec"]
        events = kubectl(
            state, "get", "events", "-n", "gpuop-system", "--field-selector", "reason=Pulled"
        ).stdout
        assert f'Successfully pulled image "{address}/operator:' in events, events
        nodes = json.loads(kubectl(state, "get", "nodes", "-o", "json").stdout)["items"]
        assert len(nodes) == 2, [n["metadata"]["name"] for n in nodes]
        for node in nodes:
            ready = {c["type"]: c["status"] for c in node["status"]["conditions"]}["Ready"]
            assert (ready, node["status"]["allocatable"]["nvidia.com/gpu"]) == ("True", "2"), node["status"]
        # Three trainings at once, none with an `image` (the default trainer image, on both
        # nodes): README's first training, the kind example on Trainer v2, and a user's plain
        # loop on our report API. Paced (GPUOP_TEST_STEP_SECONDS), long enough to be seen
        # reporting however fast the machine (a report goes every 5 s at most).
        # The pacing hooks on a claim of a folder here (no image carries them), mounted as the
        # trainings' output, as the cluster's shared storage would give it.
        hooks = state.parent / "hooks"
        hooks.mkdir(mode=0o777)
        hooks.chmod(0o777)  # the trainers write their outputs there as uid 1000
        site = put_hooks(hooks)
        for body in _claim("hooks", hooks):
            created = kubectl(state, "create", "-f", "-", input=json.dumps(body))
            assert created.returncode == 0, created.stderr
        pacing = [{"name": "PYTHONPATH", "value": f"/output/{site}"}]
        output = {"volume": {"claimName": "hooks"}}
        first = yaml.safe_load(FIRST_TRAINING.read_text())
        # As its comment says for a cluster without GPUs: no GPU, about 10 epochs (5 here:
        # 225 steps of 0.2 s).
        first["spec"]["gpusPerWorker"] = 0
        first["spec"]["training"]["epochs"] = 5
        first["spec"]["resources"] = {"cpu": "500m", "memory": "1Gi"}
        first["spec"]["env"] = [*pacing, {"name": "GPUOP_TEST_STEP_SECONDS", "value": "0.2"}]
        first["spec"]["output"] = output
        kind = yaml.safe_load(KIND_CPU.read_text())
        del kind["spec"]["image"]
        # Half a CPU a worker, so that the three workers fit on the two nodes' four CPUs beside
        # the operator and CoreDNS; 0.4 s a step (115 steps: 46 s or more).
        kind["spec"]["resources"]["cpu"] = "500m"
        kind["spec"]["env"] = [*pacing, {"name": "GPUOP_TEST_STEP_SECONDS", "value": "0.4"}]
        kind["spec"]["output"] = output
        kind_v2 = {
            **kind,
            "metadata": {"name": "kind-cpu-v2"},
            "spec": {**kind["spec"], "backend": "trainjob"},
        }
        loop = specs.training("plain-loop", "default", command=["python", "-c", PLAIN_LOOP], workers=1,
                              gpusPerWorker=0, resources={"cpu": "100m", "memory": "256Mi"})  # fmt: skip
        backends = {"first-training": "pytorchjob", "kind-cpu-v2": "trainjob", "plain-loop": "pytorchjob"}
        for body in (first, kind_v2, loop):
            created = subprocess.run(
                [str(state / "bin" / "kubectl"), f"--kubeconfig={state / 'kubeconfig'}", "create", "-f", "-"],
                input=json.dumps(body), capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert created.returncode == 0, created.stderr
        seen: dict[str, list[dict[str, Any]]] = {name: [] for name in backends}

        def finished() -> bool:
            got = kubectl(state, "get", "gtr", "-A", "-o", "json")
            for item in json.loads(got.stdout)["items"] if got.returncode == 0 else []:
                seen[item["metadata"]["name"]].append(item.get("status") or {})
            return all(s and s[-1].get("phase") in ("Succeeded", "Failed") for s in seen.values())

        started = time.monotonic()
        try:
            wait_for("the trainings finished", finished, timeout=300, every=0.5)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{_describe(state)}\n{_logs(state)}") from None
        print(f"all finished {time.monotonic() - started:.1f}s after create")
        # The trainer image came from the registry: each node's kubelet pulled it for the
        # first pod that ran it there, and said how long that took.
        events = json.loads(kubectl(state, "get", "events", "-n", "default", "-o", "json").stdout)["items"]
        pulls = [
            f"{e['involvedObject']['name']}: {e['message']}"
            for e in events
            if e["reason"] == "Pulled" and f'Successfully pulled image "{address}/trainer:' in e["message"]
        ]
        print("the kubelets' word:\n  " + "\n  ".join(pulls))
        assert pulls, kubectl(state, "get", "events", "-n", "default").stdout
        for name, statuses in seen.items():
            status = statuses[-1]
            assert status["phase"] == "Succeeded", f"{name}: {json.dumps(status, indent=1)}\n{_logs(state)}"
            assert status["backend"] == backends[name], status
            assert status["progress"]["percent"] == 100, status
            # While it ran, the status followed: steps moving, a loss each time.
            running = [
                s["progress"]
                for s in statuses
                if s.get("phase") == "Running" and s.get("progress", {}).get("step")
            ]
            steps = sorted({p["step"] for p in running})
            sources = sorted({p["source"] for p in running})
            print(f"{name}: steps in status while Running: {steps}, from {sources}")
            assert len(steps) >= 2, (
                f"{name}: the status did not follow the training: {running}\n{_logs(state)}"
            )
            assert all(p.get("loss") is not None for p in running), running
        for name in ("first-training", "kind-cpu-v2"):
            assert seen[name][-1]["progress"]["accuracy"] > 0.9, seen[name][-1]
        # The user's loop gives reports only, so every figure it showed came through them
        # (Kubeflow's protocol, to the operator's Service, with the pod's projected token). The
        # built-in trainer reports the same way but is also scraped, and a tick shows whichever
        # is further on (figures.py): which one a given tick shows depends on where the 5 s
        # report throttle falls against the tick, so its sources are printed, not asserted.
        assert {p["source"] for s in seen["plain-loop"] if s.get("phase") == "Running"
                for p in [s.get("progress") or {}] if p.get("step")} == {"TrainerStatus"}  # fmt: skip
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


def _logs(state: Path) -> str:
    """The operator's log and the trainers', as their nodes' kubelets wrote them (tails)."""
    said = []
    for path in sorted(state.glob("node-*/kubelet/pod-logs/*/*/*.log")):
        if "gpuop-system_" in str(path) or "/pytorch/" in str(path):
            lines = [line for line in path.read_text(errors="replace").splitlines() if "/healthz" not in line]
            said.append(f"-- {path.relative_to(state)}:\n" + "\n".join(lines[-40:]))
    return "\n".join(said)


def _describe(state: Path) -> dict[str, Any]:
    got = kubectl(state, "get", "gtr,pods", "-o", "json")
    return json.loads(got.stdout) if got.returncode == 0 else {"error": got.stderr}
