"""GPU figures for a training of any image: the operator's pod reader asks dcgm-exporter (here
its stand-in, served over real HTTP: no GPU on this machine) for the training's pods, and the
status derivation turns them into ``status.gpu`` (the GPU-Util column) and Underutilized, with
nothing of ours inside the image."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from gpuop.controller.pods import PodReader
from gpuop.controller.settings import OperatorSettings
from gpuop.controller.telemetry import OperatorMetrics
from gpuop.observing.derive import derive_status
from gpuop.observing.records import JobCondition, Observation, Thresholds
from support.dcgm_standin import dcgm_exporter, node

NAMESPACE = "team-a"
TRAINING = "llm"
PODS = (f"{TRAINING}-master-0", f"{TRAINING}-worker-0")


def _pod(name: str, ip: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": {"gpuop.io/gputraining": TRAINING}},
        "status": {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]},
    }


class _Cluster:
    """What the pod reader asks the API server: the training's pods and the exporter's Endpoints."""

    in_cluster = True

    def __init__(self, exporter_port: int) -> None:
        self.endpoints = {
            "subsets": [{"addresses": [{"ip": "127.0.0.1"}], "ports": [{"port": exporter_port}]}]
        }
        self.endpoint_reads = 0

    def list_training_pods(self, namespace: str) -> list[dict[str, Any]]:
        # Loopback addresses nothing serves (a custom image has no metrics endpoint of ours);
        # no test sends traffic off this machine.
        return [_pod(PODS[0], "127.255.0.1"), _pod(PODS[1], "127.255.0.2")]

    def get_endpoints(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        assert (namespace, name) == ("gpu-operator", "nvidia-dcgm-exporter")
        self.endpoint_reads += 1
        return self.endpoints


def _observation(pods: Any, now: datetime) -> Observation:
    return Observation(
        now=now, generation=1, workers_total=2, gpus=4, job_name=TRAINING,
        job_conditions=(JobCondition("Created", "True"), JobCondition("Running", "True")),
        pods=pods, reports_progress=False,
    )  # fmt: skip


def test_a_custom_images_gpus_come_from_the_exporter_into_status_and_underutilized() -> None:
    gpu_node = node("gpu-node-a", count=4)
    for gpu, pod in zip(gpu_node.gpus, (PODS[0], PODS[0], PODS[1], PODS[1]), strict=True):
        gpu.hold(NAMESPACE, pod)
        gpu.utilization_percent, gpu.memory_used_mib = 12.0, 40_000
    gpu_node.gpus[0].utilization_percent = 20.0
    with dcgm_exporter(gpu_node) as exporter:
        port = int(exporter.url.rsplit(":", 1)[1])
        cluster = _Cluster(port)
        settings = OperatorSettings(gpu_metrics="dcgm-exporter", scrape_timeout_seconds=2.0)
        reader = PodReader(cluster, settings, OperatorMetrics())  # type: ignore[arg-type]
        try:
            observed = (reader.observe({NAMESPACE: [TRAINING]})[NAMESPACE] or {})[TRAINING]
            again = (reader.observe({NAMESPACE: [TRAINING]})[NAMESPACE] or {})[TRAINING]
        finally:
            reader.close()
    assert observed is not None
    assert again is not None
    assert cluster.endpoint_reads == 1  # the exporters' addresses are asked for every 30 s, not every tick
    by_pod = {p.name: p for p in observed}
    assert [g.index for g in by_pod[PODS[0]].exporter_gpus or ()] == ["0", "1"]
    assert [g.index for g in by_pod[PODS[1]].exporter_gpus or ()] == ["2", "3"]
    assert all(p.metrics is None for p in observed)  # a custom image serves no metrics of ours

    thresholds = Thresholds(stall_timeout_seconds=0, underutilized_percent=30, underutilized_seconds=600)
    start = datetime(2026, 11, 23, 12, 0, tzinfo=UTC)
    status = derive_status(None, _observation(observed, start), thresholds)
    assert status.gpu is not None
    assert status.gpu.source == "DcgmExporter"
    assert status.gpu.utilization_percent == 14.0  # (20 + 12 + 12 + 12) / 4, over GPUs
    assert status.gpu.utilization_text == "14%"
    assert status.gpu.model == "NVIDIA H100 80GB HBM3"
    assert status.gpu.memory_used_bytes == 4 * 40_000 * 2**20
    assert [(w.pod, w.utilization_percent) for w in status.gpu.per_worker] == [
        (PODS[0], 16.0),
        (PODS[1], 12.0),
    ]
    assert status.gpu.underutilized_since is not None
    assert not any(c.type == "Underutilized" and c.status == "True" for c in status.conditions)
    later = derive_status(status, _observation(again, start + timedelta(seconds=601)), thresholds)
    underutilized = next(c for c in later.conditions if c.type == "Underutilized")
    assert underutilized.status == "True"
    assert "14%" in underutilized.message
