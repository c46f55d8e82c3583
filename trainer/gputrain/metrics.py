"""The trainer's Prometheus endpoint: progress, loss, throughput, and GPU figures from NVML.

One endpoint per pod (served by local rank 0), on the contract's port, with the names in
:class:`gputrain.contract.Metric`; the operator and ``gpuop run`` scrape it. Values are
set at logging intervals from figures already reduced across ranks, so every pod reports
the job's progress, and its own GPUs.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, start_http_server

from gputrain.contract import Metric, Progress

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuReading:
    index: int
    utilization_percent: float
    memory_used_bytes: int
    memory_total_bytes: int


class GpuMonitor:
    """Utilization and memory of this pod's visible GPUs, through NVML.

    Without an NVIDIA driver, ``nvmlInit`` raises ``NVMLError_LibraryNotFound``: that means
    "no GPU metrics here", not an error.
    """

    def __init__(self) -> None:
        self._handles: list[tuple[int, Any]] = []
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception as exc:  # no driver, no library, no devices
            log.info("no GPU metrics: %s", exc)
            return
        self._nvml = pynvml
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        count = pynvml.nvmlDeviceGetCount()
        indices = list(range(count))
        if visible:
            try:
                indices = [int(i) for i in visible.split(",") if i.strip()]
            except ValueError:  # GPU UUIDs: NVML's order is not theirs; report them all
                indices = list(range(count))
        self._handles = [(i, pynvml.nvmlDeviceGetHandleByIndex(i)) for i in indices if i < count]

    def read(self) -> list[GpuReading]:
        readings = []
        for index, handle in self._handles:
            try:
                util = self._nvml.nvmlDeviceGetUtilizationRates(handle)
                memory = self._nvml.nvmlDeviceGetMemoryInfo(handle)
            except Exception as exc:  # a GPU that fell off the bus must not stop training
                log.warning("NVML read of GPU %d failed: %s", index, exc)
                continue
            readings.append(GpuReading(index, float(util.gpu), int(memory.used), int(memory.total)))
        return readings


class MetricsServer:
    """The Prometheus gauges, served over HTTP when a port is given (0 picks a free one)."""

    def __init__(self, port: int | None, addr: str = "0.0.0.0") -> None:
        self.registry = CollectorRegistry()

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, doc, labels, registry=self.registry)

        self.epoch = gauge(Metric.EPOCH, "Current epoch, from 1")
        self.total_epochs = gauge(Metric.TOTAL_EPOCHS, "Epochs in the run")
        self.step = gauge(Metric.STEP, "Optimizer steps done")
        self.total_steps = gauge(Metric.TOTAL_STEPS, "Optimizer steps in the run")
        self.percent = gauge(Metric.PROGRESS_PERCENT, "Progress in percent of the run's data")
        self.loss = gauge(Metric.LOSS, "Training loss over the last logging interval")
        self.accuracy = gauge(Metric.ACCURACY, "Accuracy on the evaluation split after the last epoch")
        self.samples = gauge(Metric.SAMPLES_PER_SECOND, "Training samples per second, whole job")
        self.eta = gauge(Metric.ESTIMATED_REMAINING_SECONDS, "Estimated seconds to completion")
        gpu = (Metric.GPU_LABEL,)
        self.gpu_util = gauge(Metric.GPU_UTILIZATION_PERCENT, "GPU utilization, percent", gpu)
        self.gpu_used = gauge(Metric.GPU_MEMORY_USED_BYTES, "GPU memory in use, bytes", gpu)
        self.gpu_total = gauge(Metric.GPU_MEMORY_TOTAL_BYTES, "GPU memory in all, bytes", gpu)
        # A gauge that was never set reads 0, and a status would say "loss 0" before the first
        # report: each starts as NaN, which readers (the operator's among them) skip as absent.
        for unset in (self.epoch, self.total_epochs, self.step, self.total_steps, self.percent,
                      self.loss, self.accuracy, self.samples, self.eta):  # fmt: skip
            unset.set(math.nan)
        self.gpus = GpuMonitor()
        self.port: int | None = None
        self._server: Any = None
        if port is not None:
            self._server, _thread = start_http_server(port, addr=addr, registry=self.registry)
            self.port = int(self._server.server_port)

    def update(self, progress: Progress) -> None:
        """Publish ``progress``; a figure it does not have keeps its last value (NaN at first)."""
        percent = progress.percent
        if percent is None and progress.step is not None and progress.total_steps:
            percent = 100.0 * progress.step / progress.total_steps
        for gauge, value in (
            (self.epoch, progress.epoch),
            (self.total_epochs, progress.total_epochs),
            (self.step, progress.step),
            (self.total_steps, progress.total_steps),
            (self.percent, percent),
            (self.loss, progress.loss),
            (self.accuracy, progress.accuracy),
            (self.samples, progress.samples_per_second),
            (self.eta, progress.estimated_remaining_seconds),
        ):
            if value is not None:
                gauge.set(value)
        for reading in self.gpus.read():
            label = str(reading.index)
            self.gpu_util.labels(label).set(reading.utilization_percent)
            self.gpu_used.labels(label).set(reading.memory_used_bytes)
            self.gpu_total.labels(label).set(reading.memory_total_bytes)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
