"""What the end-to-end chain's tests (tests/e2e_local) share: the in-cluster operator, shared
claims, and what the tests read and do as a user would: ``kubectl get --watch`` of a training into
a :class:`Timeline`, the examples varied, the trainer gate on a claim, and below the API only a
node's logs, a container's processes and a claim's checkpoints. Imported as a namespace
(``chain.get``, ``chain.Timeline``); the chain's conftest makes the fixtures."""

from __future__ import annotations

import fnmatch
import json
import subprocess
import textwrap
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import yaml

from gpuop.api.spec import parse
from gpuop.backends.contract import JobApi
from gputrain.contract import complete_checkpoint_step
from support import oci
from support.node.images import full_reference
from support.node.node import Node
from support.node.pool import Pool, enough_disk
from support.objectstore import S3Server
from support.paths import ROOT
from support.plane import controlplane
from support.plane.controlplane import ControlPlane
from support.registry import Registry
from support.tools.helm import RELEASE_NAMESPACE
from support.training import HOOKS_FOLDER, hold_env, put_hooks, release, wait_held
from support.waiting import wait_for

# The image the kind examples name: a user of kind builds it and loads it into the nodes.
EXAMPLE_IMAGE: Final = yaml.safe_load((ROOT / "examples" / "kind-cpu.yaml").read_text())["spec"]["image"]
# The name the custom-code trainings give a team's own image (examples/own-code.Dockerfile on
# the released trainer image): built and pushed to the session's registry, pulled by the nodes
# and known to them by this name too, as a team's registry would serve it.
OWN_CODE_IMAGE: Final = "registry.example.com/team/own-code:1"
# The namespace the chain's trainings run in.
NAMESPACE: Final = "e2e"
# The label of the volumes :class:`Claims` makes, to find them again.
CLAIMS_LABEL: Final = "gpuop.io/test-claim"


@dataclass(frozen=True)
class InClusterOperator:
    """The operator's pod, and the report URL its Deployment tells it to give the trainers."""

    pod: dict[str, Any]
    report_url: str

    def log(self, plane: controlplane.ControlPlane) -> str:
        """Its log; when there is none, a line saying why (a pod evicted and replaced since
        shows as "not found", never as an operator that said nothing)."""
        said = plane.kubectl("logs", "-n", RELEASE_NAMESPACE, self.pod["metadata"]["name"], check=False)
        if said.returncode != 0:
            return f"(no log of pod {self.pod['metadata']['name']}: {said.stderr.strip()[-300:]})"
        return said.stdout


@dataclass(frozen=True)
class Claims:
    """ReadWriteMany claims the way a cluster's shared storage gives them, here a hostPath
    PersistentVolume per claim: both nodes are this machine, so a folder is shared by every pod
    of a training, wherever it runs, and by the test, which reads the checkpoints in it."""

    root: Path
    plane: controlplane.ControlPlane

    def make(self, namespace: str, claim: str) -> Path:
        """The claim, bound to a volume of its own; the volume's folder as this host sees it."""
        folder = self.root / namespace / claim
        folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(0o777)  # the trainers run as the image's user, not root
        volume = f"{namespace}-{claim}"
        self.plane.kubectl("apply", "-f", "-", input=json.dumps({
            "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": volume, "labels": {CLAIMS_LABEL: "1"}},
            "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"], "storageClassName": "",
                     "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": str(folder), "type": "Directory"},
                     "claimRef": {"namespace": namespace, "name": claim}},
        }))  # fmt: skip
        self.plane.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps({
            "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": claim},
            "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "", "volumeName": volume,
                     "resources": {"requests": {"storage": "1Gi"}}},
        }))  # fmt: skip
        return folder


KIND_CPU = ROOT / "examples" / "kind-cpu.yaml"
KIND_CPU_ELASTIC = ROOT / "examples" / "kind-cpu-elastic.yaml"
# Where a training's checkpoint claim is mounted (spec.checkpoint.path's default).
CHECKPOINTS = "/checkpoints"
# Where a training's output claim is mounted (spec.output.path's default).
OUTPUTS = "/output"
# The chain's checkpoints in the session's S3 store (support.objectstore): the bucket, the
# prefix (each training writes under <prefix>/<name>), the Secret its credentials are in.
BUCKET = "checkpoints"
BUCKET_PREFIX = "chain"
OUTPUT_PREFIX = "chain-models"
DATA_PREFIX = "chain-data/mnist"
STORE_SECRET = "store-credentials"
# The kind example's digits on 2 workers of batch 32 are 23 steps an epoch: by step 50, in the
# third epoch, two epoch-end checkpoints are written.
HOLD_AT_STEP = 50
# spec.stallTimeoutSeconds of the trainings a test pauses (a suspend, Kueue's preemption), and
# the pause is held longer than that after its pods are gone: a stall clock that ran through the
# pause would find the last step older than that at the resume, and raise Stalled before the
# first step after it. 60 s is above what a resumed pod takes here to its first step (pod
# start, torch's import, the checkpoint's download: 15-30 s on the chain's 2 cores).
PAUSE_STALL_SECONDS = 60


def hold_pause(plane: ControlPlane, name: str, since: float) -> None:
    """Keep the pause going until :data:`PAUSE_STALL_SECONDS` and a margin have passed since
    ``since`` (monotonic: when its pods were gone, the last moment they could report). Prints the
    progress its status shows then, which the stall clock is read from."""
    time.sleep(max(0.0, since + PAUSE_STALL_SECONDS + 10 - time.monotonic()))
    progress = ((get(plane, "gtr", name) or {}).get("status") or {}).get("progress")
    print(f"{name}: paused {time.monotonic() - since:.0f} s since its pods went; status.progress {progress}")


def preload(pool: Pool, registry: Registry, aliases: dict[str, str]) -> dict[str, float]:
    """Each image of ``aliases`` (a reference in ``registry``) pulled by every node's containerd,
    both nodes at once, before any test, and known there by its alias too: as ``kind load``
    puts an image on kind's nodes under the name the examples give, so the kubelet runs it
    without a pull (pulled by the kubelet, it would have to pull it again under another name,
    to check the pod may). The seconds each node took. One the disk cannot hold is refused
    before it starts."""
    client = oci.Client(registry.address.split("/")[0], registry.ca)
    layers: dict[str, list[str]] = {}
    sizes: dict[str, int] = {}
    for image in aliases:
        reference = oci.Reference.parse(image)
        _, manifest = client.manifest(reference.repository, reference.tag)
        if "manifests" in manifest:  # an index: its image for this machine
            (platform,) = [
                m for m in manifest["manifests"] if m.get("platform", {}).get("architecture") == "amd64"
            ]
            _, manifest = client.manifest(reference.repository, platform["digest"])
        layers[image] = [layer["digest"] for layer in manifest["layers"]]
        sizes |= {layer["digest"]: layer["size"] for layer in manifest["layers"]}
    # Unpacked, zstd's layers take about twice their size, and the blob is there too until then.
    enough_disk(pool.nodes, 3 * sum(sizes.values()), f"pulling {', '.join(aliases)}")
    seconds: dict[str, float] = {}
    failed: list[BaseException] = []

    def load(node: Node) -> None:
        try:
            started = time.monotonic()
            for image, alias in aliases.items():
                node.containerd.pull(image, layers[image])
                node.containerd.ctr("images", "tag", "--force", image, full_reference(alias))
            seconds[node.name] = time.monotonic() - started
        except BaseException as exc:  # raised below, in the caller's thread
            failed.append(exc)

    threads = [threading.Thread(target=load, args=(node,), name=f"pull-{node.name}") for node in pool.nodes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failed:
        raise failed[0]
    return seconds


def get(plane: ControlPlane, kind: str, name: str) -> dict[str, Any] | None:
    result = plane.kubectl("get", kind, name, "-n", NAMESPACE, "-o", "json", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


def names(plane: ControlPlane, kind: str, selector: str) -> list[str]:
    out = plane.kubectl("get", kind, "-n", NAMESPACE, "-l", selector, "-o", "name").stdout
    return sorted(out.split())


def controller_env_missing(
    plane: ControlPlane, api: JobApi, example: Path, selector: str
) -> dict[str, frozenset[str]]:
    """Per pod the selector finds, what of ``api.controller_env`` (the variables a spec's $(VAR)
    may name, tests/unit/test_backend_env.py) its controller did not put in the trainer container.

    One list, not a get per name: a worker still running when the job ends is deleted by the
    controller (cleanPodPolicy Running) between any list and a later get (seen in CI)."""
    wanted = api.controller_env(parse(yaml.safe_load(example.read_text())).spec)
    out = plane.kubectl("get", "pods", "-n", NAMESPACE, "-l", selector, "-o", "json").stdout
    return {
        f"pod/{pod['metadata']['name']}": wanted
        - {e["name"] for e in pod["spec"]["containers"][0].get("env") or []}
        for pod in json.loads(out)["items"]
    }


class Timeline:
    """Every status of the training NAME in order, as ``kubectl get gtr --watch`` shows them: one
    watch in a thread, until closed. Each status the operator writes comes once, none missed
    between two reads; a kubectl started every half second instead would cost the chain a sixth
    of a core all along (a tenth of a CPU-second each, here)."""

    def __init__(self, plane: ControlPlane, name: str) -> None:
        self.plane, self.name = plane, name
        self.seen: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._watch: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()  # between close() and a watch being started
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # A field selector, not the name: a watch of a name not yet created would end at once.
        command = [str(self.plane.binary("kubectl")), f"--kubeconfig={self.plane.kubeconfig}", "get", "gtr",
                   "-n", NAMESPACE, "--field-selector", f"metadata.name={self.name}", "-o", "json", "--watch"]  # fmt: skip
        while not self._stop.is_set():
            with self._lock:
                if self._stop.is_set():
                    return
                self._watch = watch = subprocess.Popen(
                    command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
                )
            assert watch.stdout is not None
            document: list[str] = []
            for line in watch.stdout:  # each object indented, its closing brace alone at column 0
                document.append(line)
                if line.rstrip("\n") == "}":
                    self.seen.append(json.loads("".join(document)).get("status", {}))
                    document = []
            watch.wait()
            self._stop.wait(0.5)  # the server ended the watch (its timeout): watch again

    def phases(self) -> list[str]:
        """The phases in order, repeats collapsed."""
        out: list[str] = []
        for status in self.seen:
            if status.get("phase") and (not out or out[-1] != status["phase"]):
                out.append(status["phase"])
        return out

    def caught_up(self, phase: str, timeout: float = 10.0) -> list[str]:
        """:meth:`phases` once the watch has recorded ``phase`` last: it can lag a phase that a
        direct read has just seen by the moment kubectl takes to print it."""
        wait_for(f"the timeline to record {phase}", lambda: self.phases()[-1:] == [phase], timeout=timeout)
        return self.phases()

    def conditions(self) -> set[str]:
        return {c["type"] for s in self.seen for c in s.get("conditions", []) if c["status"] == "True"}

    def close(self) -> None:
        with self._lock:
            self._stop.set()
            if self._watch is not None:
                self._watch.terminate()
        self._thread.join(5)


def variant(tmp: Path, name: str, source: Path = KIND_CPU, **spec: Any) -> Path:
    """The example under another name with some spec fields replaced (a longer run, a PVC)."""
    doc = yaml.safe_load(source.read_text())
    doc["metadata"]["name"] = name
    for key, value in spec.items():
        doc["spec"][key] = {**doc["spec"].get(key, {}), **value} if isinstance(value, dict) else value
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@dataclass(frozen=True)
class Gate:
    """The trainer gate of support.training (trainer_hold) in a training's pods: each rank waits
    at HOLD_AT_STEP until :meth:`release` or a stop signal (SIGTERM, as pods are deleted). So
    the test kills, suspends or preempts a run that cannot have finished meanwhile, however
    slowly it got there: a free 40-epoch run is some 15 s of training here.

    spec.env refuses GPUTRAIN_* (the operator's names): PYTHONPATH brings in a sitecustomize
    on the claim that sets the gate's variables and runs the gate. The claim is the training's
    checkpoint volume, or, for checkpoints in a bucket, its output volume (:data:`OUTPUTS`)."""

    claim: str
    folder: Path  # the claim's folder as this host sees it: the checkpoints (on a volume), the gate
    env: list[dict[str, str]]  # for spec.env

    @property
    def directory(self) -> Path:
        return self.folder / "hold"

    def wait_held(self, alive: Callable[[], bool]) -> int:
        """The step both ranks wait at, once they do."""
        return wait_held(self.directory, 2, alive, timeout=240)

    def release(self) -> None:
        release(self.directory)


def gate(claims: Claims, claim: str, mount: str = CHECKPOINTS) -> Gate:
    """``claim``, made for a training's checkpoints (or outputs), with a gate on it: the claim's
    folder is shared by its pods wherever they run and seen by this host; ``mount`` is where
    the pods have it."""
    shared = claims.make(NAMESPACE, claim)
    site = shared / "hold-site"
    site.mkdir(parents=True, exist_ok=True)
    # Made here, writable by all: the trainers run as the pod's user, and a release before they
    # get there makes it too (as root, closed to them otherwise).
    (shared / "hold").mkdir(parents=True, exist_ok=True)
    (shared / "hold").chmod(0o777)
    variables = hold_env(Path(mount) / "hold", HOLD_AT_STEP)
    del variables["PYTHONPATH"]  # this host's; the pods get theirs from spec.env
    # The gate itself is in the hooks on the claim (no image carries them), which pace_env's use too.
    put_hooks(shared)
    (site / "sitecustomize.py").write_text(textwrap.dedent(f"""\
        import importlib.util
        import os
        import sys

        os.environ.update({variables!r})
        _spec = importlib.util.spec_from_file_location("trainer_hold", "{mount}/{HOOKS_FOLDER}/sitecustomize.py")
        _gate = importlib.util.module_from_spec(_spec)
        sys.modules[_spec.name] = _gate
        _spec.loader.exec_module(_gate)
        """))  # fmt: skip
    return Gate(claim, shared, [{"name": "PYTHONPATH", "value": f"{mount}/hold-site"}])


def paced_own_code(plane: ControlPlane, name: str, tmp: Path, hooks: str, step_seconds: float,
                   **spec: Any) -> Timeline:  # fmt: skip
    """A training of the user's own code in :data:`OWN_CODE_IMAGE` (``spec`` gives its command),
    each step at least ``step_seconds`` (the pacing hooks in folder ``hooks`` of the claim
    ``<name>-hooks``, mounted as its output); applied as a user does, with a timeline."""
    env = [{"name": "PYTHONPATH", "value": f"{OUTPUTS}/{hooks}"},
           {"name": "GPUOP_TEST_STEP_SECONDS", "value": str(step_seconds)}]  # fmt: skip
    body = {"image": OWN_CODE_IMAGE, "env": env, "output": {"volume": {"claimName": f"{name}-hooks"}}, **spec}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": "gpuop.io/v1alpha1", "kind": "GpuTraining",
                                    "metadata": {"name": name}, "spec": body}))  # fmt: skip
    timeline = Timeline(plane, name)
    plane.kubectl("apply", "-n", NAMESPACE, "-f", str(path))
    return timeline


def start_long_training(plane: ControlPlane, name: str, tmp: Path, gate: Gate, **spec: Any) -> Timeline:
    """The kind example for 40 epochs (about 15 s of training here), its checkpoints on the
    gate's claim so that they outlive its pods (or as ``spec`` says: :func:`in_bucket`), held at
    HOLD_AT_STEP by ``gate``; applied, with a timeline of its status."""
    spec = variant(tmp, name, **{"training": {"epochs": 40}, "checkpoint": {"volume": {"claimName": gate.claim}},
                                 "env": gate.env, **spec})  # fmt: skip
    timeline = Timeline(plane, name)
    plane.kubectl("apply", "-n", NAMESPACE, "-f", str(spec))
    return timeline


def phase(plane: ControlPlane, name: str) -> str | None:
    found = get(plane, "gtr", name)
    return found.get("status", {}).get("phase") if found else None


def wait_finished(plane: ControlPlane, name: str, timeout: float = 240.0) -> str:
    """The training's phase once it is Succeeded or Failed (polled every half second). A training
    that never finishes fails with its pods' last lines, those of a restarted container's
    previous run too: the pod that hangs or the rank that died says why before the test's
    cleanup deletes them."""

    def ended() -> str | None:
        found = phase(plane, name)
        return found if found in ("Succeeded", "Failed") else None

    try:
        return str(wait_for(f"{name} finished", ended, timeout=timeout, every=0.5))
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{pod_logs(plane, name)}") from None


def pod_logs(plane: ControlPlane, name: str, lines: int = 60) -> str:
    """The last lines of each of the training's pods, with each restarted container's previous
    run, for a failure's message."""
    said = []
    for pod in pods_of(plane, name):
        pod_name = pod["metadata"]["name"]
        restarted = any(
            c.get("restartCount") for c in (pod.get("status") or {}).get("containerStatuses") or ()
        )
        for previous in (True, False) if restarted else (False,):
            args = ["logs", "-n", NAMESPACE, pod_name, "--all-containers", f"--tail={lines}"]
            result = plane.kubectl(*args, *(["--previous"] if previous else []), check=False)
            run = "previous run" if previous else "current run"
            said.append(f"--- {pod_name} ({run}, on {pod['spec'].get('nodeName')}):\n"
                        f"{result.stdout or result.stderr}")  # fmt: skip
    return "\n".join(said) or "(no pods)"


def pods_named(plane: ControlPlane, pattern: str) -> list[dict[str, Any]]:
    """The namespace's pods whose names match ``pattern`` (JobSet's Jobs name each attempt's
    pod anew)."""
    listed = json.loads(plane.kubectl("get", "pods", "-n", NAMESPACE, "-o", "json").stdout)["items"]
    return [p for p in listed if fnmatch.fnmatchcase(p["metadata"]["name"], pattern)]


def trainer_pid(plane: ControlPlane, pool: Pool, pod: str) -> int | None:
    """The gputrain process torchrun started in the pod's trainer container (not torchrun
    itself), from the container's cgroup on its node."""
    found = get(plane, "pod", pod)
    if found is None or not found["spec"].get("nodeName"):
        return None
    for pid in pool.of(found).container_pids(found, found["spec"]["containers"][0]["name"]):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"gputrain" in argv and not any(a.endswith(b"torchrun") for a in argv):
            return pid
    return None


def logs(plane: ControlPlane, pool: Pool, pattern: str) -> str:
    """Every attempt of the trainer containers of the pods ``pattern`` names, as their nodes'
    kubelets wrote them (a deleted pod's logs go with it)."""
    return "".join(
        pool.of(pod).log_of(pod, container["name"])
        for pod in pods_named(plane, pattern)
        if pod["spec"].get("nodeName")  # a pod not yet placed has no log
        for container in pod["spec"]["containers"]
    )


def resumed_steps(plane: ControlPlane, pool: Pool, pod: str) -> list[int]:
    """The steps the trainer said it resumed from, in every attempt of the pod's containers."""
    steps = []
    for line in logs(plane, pool, pod).splitlines():
        if " resumed from " in line:
            steps.append(int(line.rsplit("step ", 1)[1].split()[0].rstrip(",")))
    return steps


def in_bucket(plane: ControlPlane, store: S3Server, gate: Gate) -> dict[str, Any]:
    """The spec fields that put a training's checkpoints and its final outputs in the session's
    bucket (under :data:`BUCKET_PREFIX` and :data:`OUTPUT_PREFIX`), with the store's credentials
    in a Secret (made here) and the gate on the output claim."""
    plane.kubectl("apply", "-n", NAMESPACE, "-f", "-", input=json.dumps(store.secret(STORE_SECRET)))
    return {"checkpoint": {"uri": f"s3://{BUCKET}/{BUCKET_PREFIX}", "secretName": STORE_SECRET},
            "output": {"volume": {"claimName": gate.claim}, "uri": f"s3://{BUCKET}/{OUTPUT_PREFIX}",
                       "secretName": STORE_SECRET}}  # fmt: skip


def bucket_steps(store: S3Server, name: str) -> list[int]:
    """The steps of the complete checkpoints of training ``name`` in the bucket (:func:`in_bucket`)."""
    steps = (complete_checkpoint_step(n) for n in store.names(BUCKET, f"{BUCKET_PREFIX}/{name}"))
    return sorted(step for step in steps if step is not None)


def made_by_training_operator(plane: ControlPlane, name: str) -> list[str]:
    """What the training-operator says it created for the job ``name``, from its events
    (``Created pod: kind-cpu-master-0``, ``Created service: ...``), sorted. Under cleanPodPolicy
    Running (the default) a replica still running when the job ends is deleted, its Service
    with it, so what is left after the end is not what was made."""
    listed = plane.kubectl("get", "events", "-n", NAMESPACE, "--field-selector", f"involvedObject.name={name}",
                           "-o", "json").stdout  # fmt: skip
    return sorted(
        e["message"] for e in json.loads(listed)["items"] if e["reason"].startswith("SuccessfulCreate")
    )


def children_gone(plane: ControlPlane, name: str) -> bool:
    selector = f"training.kubeflow.org/job-name={name}"
    return (get(plane, "pytorchjob", name) is None and not names(plane, "pods", selector)
            and not names(plane, "services", selector))  # fmt: skip


def pods_of(plane: ControlPlane, name: str) -> list[dict[str, Any]]:
    out = plane.kubectl("get", "pods", "-n", NAMESPACE, "-l", f"gpuop.io/gputraining={name}",
                        "-o", "json").stdout  # fmt: skip
    items: list[dict[str, Any]] = json.loads(out)["items"]
    return items


def rank0_pod(name: str, backend: str) -> str:
    """The rank-0 pod's name, as a pattern for :func:`logs`: Kubeflow v1 names it
    once; JobSet's Job gives each attempt a new random suffix."""
    return f"{name}-master-0" if backend == "pytorchjob" else f"{name}-node-0-0-*"
