"""Monitoring for real: the chart's ServiceMonitor, trainer PodMonitor and PrometheusRule,
applied by ``helm upgrade`` with monitoring on as a user turns it on, made into Prometheus's
configuration by the real prometheus-operator, and the real Prometheus scraping the operator
and the trainer pods over the pod network (:mod:`support.monitoring`; the images are stand-ins
holding the real binaries). Every query of both dashboards is evaluated by Prometheus on the
series of a running training, and each alert is driven into its state, seen firing, and seen
resolved.

The dashboards read the operator's per-training series, which its status fills for any code.
Their GPU panels (:data:`GPU_ONLY`) have figures only for a training that holds GPUs: the kind
example holds none, so there they are evaluated and come back empty, and they are checked to
answer for the Underutilized training below, whose GPU figures come from dcgm-exporter.

GpuTrainingUnderutilized is fed, as for any image in a cluster, by dcgm-exporter's figures for
the training's pod, here from the exporter STAND-IN (:mod:`support.dcgm_standin`: no GPU) behind
the Service the chart names; the device plugin that hands the pod its GPU is the node suite's
stand-in.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from pathlib import Path
from typing import Any, Final

import pytest
import yaml

from support import chain, dcgm_standin
from support.controllers import kueue
from support.monitoring import Prometheus
from support.node.pool import Pool
from support.paths import ROOT
from support.plane.cluster import Api, ready_operator_pod
from support.plane.controlplane import ControlPlane
from support.tools.helm import RELEASE_NAMESPACE
from support.waiting import wait_for

pytestmark = pytest.mark.e2e_local

DASHBOARDS: Final = ROOT / "charts" / "gpu-training-operator" / "dashboards"
# The panels whose series only a training holding GPUs has (status.gpu).
GPU_ONLY: Final = frozenset({"GPU utilization per pod", "GPU memory in use per pod", "GPU models"})
# Code that trains without a word until stopped. It is the container's PID 1, for which the
# kernel ignores a signal left at its default: it ends on SIGTERM itself, as training code
# does, or every deleted pod would wait out its 120 s grace period.
SILENT: Final = (
    "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(143)); time.sleep(600)"
)
# The held training's spec.stallTimeoutSeconds: Stalled this long after the gate stops it.
STALL_SECONDS: Final = 5


def panel_queries(dashboard: str, variables: dict[str, str]) -> list[tuple[str, str]]:
    """(panel title, expression with Grafana's variables filled in) for every target."""
    model = json.loads((DASHBOARDS / dashboard).read_text())
    found = []
    for panel in model["panels"]:
        for target in panel.get("targets", []):
            expression = target["expr"]
            for name, value in variables.items():
                expression = expression.replace(f"${name}", value)
            found.append((panel["title"], expression))
    return found


def _own_code_training(plane: ControlPlane, tmp_path: Path, name: str, program: str, **spec: Any) -> None:
    """A one-worker training of the own-code image running ``python -c program``: code of a
    team's own that reports nothing. A PyTorchJob whatever else the package's cluster serves
    (``auto`` picks TrainJob once Trainer v2 runs, as it does after test_kueue)."""
    body = {
        "image": chain.OWN_CODE_IMAGE, "command": ["python", "-c", program], "workers": 1,
        "gpusPerWorker": 0, "resources": {"cpu": "250m", "memory": "512Mi"}, "backend": "pytorchjob",
        **spec,
    }  # fmt: skip
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": "gpuop.io/v1alpha1", "kind": "GpuTraining",
                                    "metadata": {"name": name}, "spec": body}))  # fmt: skip
    plane.kubectl("apply", "-n", chain.NAMESPACE, "-f", str(path))


def _delete(plane: ControlPlane, name: str) -> None:
    plane.kubectl("delete", "gtr", name, "-n", chain.NAMESPACE, "--wait=true", "--timeout=90s")


def _grafana_variables(name: str) -> dict[str, str]:
    """Grafana's variables as the trainings dashboard sets them for one training."""
    return {"namespace": chain.NAMESPACE, "training": name, "__rate_interval": "30s", "__range": "5m"}


def _conditions_holding(plane: ControlPlane, name: str) -> set[str]:
    status = (chain.get(plane, "gtr", name) or {}).get("status", {})
    return {c["type"] for c in status.get("conditions", []) if c["status"] == "True"}


def _waited(what: str, check: Any, timeout: float, said: Any) -> None:
    """``wait_for``, failing with what ``said()`` tells of the cluster then (a wait in this
    module that passed alone failed inside the package once, and its message said nothing)."""
    try:
        wait_for(what, check, timeout=timeout, every=1)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{said()}") from None


def _pods_said(plane: ControlPlane, name: str) -> str:
    pods = plane.kubectl("describe", "pods", "-n", chain.NAMESPACE, "-l", f"gpuop.io/gputraining={name}",
                         check=False).stdout  # fmt: skip
    nodes = plane.kubectl("describe", "nodes", check=False).stdout
    allocated = [line for line in nodes.splitlines() if "nvidia.com/gpu" in line or line.startswith("Name:")]
    return f"{name}: {json.dumps((chain.get(plane, 'gtr', name) or {}).get('status'))}\n{pods}\n" + "\n".join(
        allocated
    )


@pytest.mark.usefixtures("kubeflow")
def test_prometheus_scrapes_the_chain_answers_every_dashboard_query_and_a_stall_fires_and_resolves(
    plane: ControlPlane,
    monitored: Prometheus,
    claims: chain.Claims,
    timelines: list[chain.Timeline],
    tmp_path: Path,
) -> None:
    """The kind example, held at a step: Prometheus finds the operator and both trainer pods
    through the chart's monitors, the PodMonitor's relabeling names the training on every
    trainer series, every dashboard query answers for it; held past its stall timeout, it is
    Stalled and GpuTrainingStalled fires; released, it finishes and the alert resolves."""
    name = "monitored"
    gate = chain.gate(claims, f"{name}-checkpoints")
    spec = chain.variant(
        tmp_path, name, training={"epochs": 40}, checkpoint={"volume": {"claimName": gate.claim}},
        env=gate.env, stallTimeoutSeconds=STALL_SECONDS,
    )  # fmt: skip
    timelines.append(chain.Timeline(plane, name))
    plane.kubectl("apply", "-n", chain.NAMESPACE, "-f", str(spec))
    gate.wait_held(lambda: chain.phase(plane, name) not in ("Failed", "Succeeded"))

    # The targets, as prometheus-operator wrote them from the chart's monitors: the operator's
    # Service, and each trainer pod with the training's name as a label of its own.
    pods = {p["metadata"]["name"] for p in chain.pods_of(plane, name)}

    def scraped() -> bool:
        trainers = {t["labels"].get("pod") for t in monitored.targets()
                    if t["labels"].get("gputraining") == name and t["health"] == "up"}  # fmt: skip
        return trainers == pods and bool(monitored.query(f'gputrain_step{{gputraining="{name}"}}'))

    wait_for("both trainer pods scraped through the PodMonitor", scraped, timeout=60, every=1)
    operator_up = monitored.query(f'up{{namespace="{RELEASE_NAMESPACE}"}} == 1')
    assert operator_up, monitored.targets()
    series = monitored.query(f'gputrain_progress_ratio{{gputraining="{name}"}}')
    assert {s["metric"]["pod"] for s in series} == pods, series
    assert all(s["metric"]["namespace"] == chain.NAMESPACE for s in series), series

    # Every panel of both dashboards, as Grafana would ask for this training.
    variables = _grafana_variables(name)
    queries = panel_queries("trainings.json", variables) + panel_queries(
        "operator.json", {**variables, "namespace": RELEASE_NAMESPACE}
    )

    def unanswered() -> set[str]:
        return {title for title, expression in queries if not monitored.query(expression)}

    # A rate() needs two scrapes in its window: asked right after the first, it has one.
    with contextlib.suppress(AssertionError):  # said with the queries below
        wait_for(
            "every panel but the GPU ones answered", lambda: unanswered() == GPU_ONLY, timeout=30, every=1
        )
    empty = unanswered()
    assert empty == GPU_ONLY, {t: e for t, e in queries if t in empty}

    # Held past its stall timeout: Stalled, and then the alert fires for it. Status first: a
    # slow start can stall the training for a moment before the gate, and the alert that
    # fired then may still be firing a second after its condition cleared.
    def stalled() -> bool:
        return "Stalled" in _conditions_holding(plane, name)

    wait_for(f"{name} Stalled at the gate", stalled, timeout=STALL_SECONDS + 60, every=0.5)
    wait_for(
        "GpuTrainingStalled firing",
        lambda: monitored.firing("GpuTrainingStalled", namespace=chain.NAMESPACE, gputraining=name),
        timeout=30, every=1,
    )  # fmt: skip
    assert stalled()
    gate.release()
    assert chain.wait_finished(plane, name) == "Succeeded"
    wait_for("GpuTrainingStalled resolved",
             lambda: not monitored.alerting("GpuTrainingStalled", gputraining=name), timeout=30, every=1)  # fmt: skip
    _delete(plane, name)


@pytest.mark.usefixtures("kubeflow")
def test_a_failed_a_silent_training_and_a_stopped_operator_each_fire_their_alert_and_resolve(
    plane: ControlPlane,
    api: Api,
    nodes: Pool,
    monitored: Prometheus,
    timelines: list[chain.Timeline],
    tmp_path: Path,
) -> None:
    """A team's own code that exits 1 at once (no restarts): GpuTrainingFailed until it is
    deleted. Code that trains without a word for longer than the threshold:
    GpuTrainingNoProgressReport until it is deleted. The operator's process frozen (SIGSTOP,
    as a hung process is): its scrape fails and GpuTrainingOperatorDown fires; thawed, it
    resolves."""
    failing, silent = "fails-at-once", "says-nothing"
    timelines += [chain.Timeline(plane, failing), chain.Timeline(plane, silent)]
    _own_code_training(plane, tmp_path, failing, "raise SystemExit(1)", runPolicy={"backoffLimit": 0})
    _own_code_training(plane, tmp_path, silent, SILENT)
    assert chain.wait_finished(plane, failing, timeout=180) == "Failed"
    wait_for("GpuTrainingFailed firing",
             lambda: monitored.firing("GpuTrainingFailed", namespace=chain.NAMESPACE, gputraining=failing),
             timeout=30, every=1)  # fmt: skip
    wait_for("GpuTrainingNoProgressReport firing",
             lambda: monitored.firing("GpuTrainingNoProgressReport", namespace=chain.NAMESPACE,
                                      gputraining=silent),
             timeout=120, every=1)  # fmt: skip
    assert chain.phase(plane, silent) == "Running"
    for name, alert in ((failing, "GpuTrainingFailed"), (silent, "GpuTrainingNoProgressReport")):
        _delete(plane, name)
        wait_for(f"{alert} resolved", lambda: not monitored.alerting(alert, gputraining=name),  # noqa: B023
                 timeout=30, every=1)  # fmt: skip

    pod = ready_operator_pod(api)
    assert pod is not None
    # Every process of its container (the reconciler and its report endpoint's child).
    pids = nodes.of(pod).container_pids(pod, pod["spec"]["containers"][0]["name"])
    assert pids
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        wait_for("GpuTrainingOperatorDown firing", lambda: monitored.firing("GpuTrainingOperatorDown"),
                 timeout=30, every=1)  # fmt: skip
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    wait_for("GpuTrainingOperatorDown resolved", lambda: not monitored.alerting("GpuTrainingOperatorDown"),
             timeout=30, every=1)  # fmt: skip


@pytest.mark.usefixtures("kubeflow")
def test_gpus_the_exporter_says_are_idle_fire_underutilized_until_the_training_goes(
    plane: ControlPlane,
    api: Api,
    monitored: Prometheus,
    timelines: list[chain.Timeline],
    tmp_path: Path,
) -> None:
    """A team's own code holding a GPU (the node's stand-in device plugin gives it one), which
    dcgm-exporter says is 4% busy: the operator reads that from the exporter's Service as the
    chart points it there (``gpuMetrics.dcgmExporter.service``), the training is Underutilized
    after the chain's 5 s, and GpuTrainingUnderutilized fires; deleted, the alert resolves."""
    name, exporter_namespace, service = "idles-its-gpu", "gpu-operator", "nvidia-dcgm-exporter"
    standin = dcgm_standin.node("gpu-node", count=2)
    with dcgm_standin.dcgm_exporter(standin, host=plane.advertise_address) as exporter:
        # The exporter's Service as the GPU Operator names it, its endpoint this host's stand-in.
        plane.kubectl("create", "namespace", exporter_namespace)
        try:
            plane.kubectl("apply", "-n", exporter_namespace, "-f", "-", input=json.dumps({
                "apiVersion": "v1", "kind": "List", "items": [
                    {"apiVersion": "v1", "kind": "Service", "metadata": {"name": service},
                     "spec": {"ports": [{"name": "metrics", "port": 9400}]}},
                    {"apiVersion": "v1", "kind": "Endpoints", "metadata": {"name": service},
                     "subsets": [{"addresses": [{"ip": plane.advertise_address}],
                                  "ports": [{"name": "metrics", "port": exporter.port}]}]},
                ],
            }))  # fmt: skip
            timelines.append(chain.Timeline(plane, name))
            _own_code_training(plane, tmp_path, name, SILENT, gpusPerWorker=1)
            _waited(f"{name} Running", lambda: chain.phase(plane, name) == "Running", 120,
                    lambda: _pods_said(plane, name))  # fmt: skip
            pod = chain.pods_of(plane, name)[0]
            gpu = standin.gpus[0].hold(chain.NAMESPACE, pod["metadata"]["name"])
            gpu.utilization_percent = 4
            _waited("GpuTrainingUnderutilized firing",
                    lambda: monitored.firing("GpuTrainingUnderutilized", namespace=chain.NAMESPACE, gputraining=name),
                    90, lambda: f"exporter asked {exporter.requests} times; {_pods_said(plane, name)}")  # fmt: skip
            holding = _conditions_holding(plane, name)
            assert "Underutilized" in holding, holding
            assert exporter.requests > 0
            # The dashboards' GPU panels, from the exporter's figures through the status.
            gpu_panels = {
                t: e for t, e in panel_queries("trainings.json", _grafana_variables(name)) if t in GPU_ONLY
            }
            assert set(gpu_panels) == GPU_ONLY
            wait_for("the GPU panels answered", lambda: all(monitored.query(e) for e in gpu_panels.values()),
                     timeout=30, every=1)  # fmt: skip
            utilization = monitored.query(gpu_panels["GPU utilization per pod"])
            assert [float(s["value"][1]) for s in utilization] == [0.04], utilization
            _delete(plane, name)
            wait_for("GpuTrainingUnderutilized resolved",
                     lambda: not monitored.alerting("GpuTrainingUnderutilized", gputraining=name),
                     timeout=30, every=1)  # fmt: skip
        finally:
            plane.kubectl("delete", "namespace", exporter_namespace, "--wait=false", check=False)


@pytest.mark.usefixtures("kubeflow")
def test_reconciles_a_quota_refuses_fire_not_reconciling_until_the_quota_goes(
    plane: ControlPlane, monitored: Prometheus, timelines: list[chain.Timeline], tmp_path: Path
) -> None:
    """A namespace quota that allows no PyTorchJob: every reconcile of the new training fails
    on the API server's 403, more than half of them over the chain's 20 s window, and
    GpuTrainingOperatorNotReconciling fires; the quota lifted, the job is made, the failures
    leave the window, and the alert resolves."""
    name, quota = "refused-by-quota", "no-pytorchjobs"
    plane.kubectl("apply", "-n", chain.NAMESPACE, "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": quota},
        "spec": {"hard": {"count/pytorchjobs.kubeflow.org": "0"}},
    }))  # fmt: skip

    def said() -> str:
        unfinished = plane.kubectl("get", "gtr", "-A", check=False).stdout
        rates = monitored.query("sum by (outcome) (rate(gpuop_reconciles_total[20s]))")
        return f"trainings:\n{unfinished}\nreconciles/s by outcome: {rates}"

    try:
        # Admission enforces a quota once the quota controller has counted what it covers.
        wait_for("the quota counted",
                 lambda: (chain.get(plane, "resourcequota", quota) or {}).get("status", {}).get("hard"),
                 timeout=30, every=0.5)  # fmt: skip
        timelines.append(chain.Timeline(plane, name))
        _own_code_training(plane, tmp_path, name, SILENT)
        _waited("GpuTrainingOperatorNotReconciling firing",
                lambda: monitored.firing("GpuTrainingOperatorNotReconciling"), 90, said)  # fmt: skip
        assert chain.get(plane, "pytorchjob", name) is None
    finally:
        plane.kubectl("delete", "resourcequota", quota, "-n", chain.NAMESPACE, "--ignore-not-found")
    wait_for(f"{name}'s PyTorchJob made", lambda: chain.get(plane, "pytorchjob", name) is not None,
             timeout=60, every=0.5)  # fmt: skip
    wait_for("GpuTrainingOperatorNotReconciling resolved",
             lambda: not monitored.alerting("GpuTrainingOperatorNotReconciling"), timeout=60, every=1)  # fmt: skip
    _delete(plane, name)


@pytest.mark.usefixtures("kubeflow", "queueing")
def test_a_training_queued_past_the_threshold_fires_queued_too_long_until_it_goes(
    plane: ControlPlane, monitored: Prometheus, timelines: list[chain.Timeline], tmp_path: Path
) -> None:
    """The real Kueue with a queue of no quota: the training waits Queued, and past the chain's
    5 s threshold GpuTrainingQueuedTooLong fires (measured from when it entered Queued, which
    the operator exports, not by the alert's `for`); deleted, the alert resolves. Last in the
    module: Kueue runs from here to the module's end."""
    name, queue = "waits-in-line", "starved"
    for obj in kueue.queues(queue, chain.NAMESPACE, {"cpu": "0", "memory": "0"}):
        plane.kubectl("apply", "-f", "-", input=json.dumps(obj))
    timelines.append(chain.Timeline(plane, name))
    _own_code_training(plane, tmp_path, name, SILENT, scheduling={"queueName": queue})
    wait_for(f"{name} Queued", lambda: chain.phase(plane, name) == "Queued", timeout=60, every=0.5)
    wait_for("GpuTrainingQueuedTooLong firing",
             lambda: monitored.firing("GpuTrainingQueuedTooLong", namespace=chain.NAMESPACE, gputraining=name),
             timeout=60, every=1)  # fmt: skip
    assert chain.phase(plane, name) == "Queued"
    _delete(plane, name)
    wait_for("GpuTrainingQueuedTooLong resolved",
             lambda: not monitored.alerting("GpuTrainingQueuedTooLong", gputraining=name), timeout=30, every=1)  # fmt: skip
