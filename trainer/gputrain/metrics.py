"""The trainer's Prometheus endpoint: progress, loss, throughput, and GPU figures from NVML.

One endpoint per pod (served by local rank 0), on the contract's port, with the names in
:class:`gputrain.contract.Metric`; the operator and ``gpuop run`` scrape it. Values are
set at logging intervals from figures already reduced across ranks, so every pod reports
the job's progress, and its own GPUs.

A series appears once it has a value: a gauge that was never set would read 0, and "loss 0"
before the first report is a lie that dashboards and the operator's status would repeat.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    start_http_server,
)
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
)
from prometheus_client.metrics_core import (
    Metric as Family,
)
from prometheus_client.registry import Collector

from gputrain.contract import Metric, Progress

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuReading:
    index: int
    name: str  # the model, as NVML names it: "NVIDIA H100 80GB HBM3"
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
                name = self._nvml.nvmlDeviceGetName(handle)
            except Exception as exc:  # a GPU that fell off the bus must not stop training
                log.warning("NVML read of GPU %d failed: %s", index, exc)
                continue
            # Older nvidia-ml-py returns bytes; the name is for people and dashboards.
            text = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
            readings.append(GpuReading(index, text, float(util.gpu), int(memory.used), int(memory.total)))
        return readings


# Progress fields -> (metric name, help, scale from the report's unit to the metric's).
_GAUGES: dict[str, tuple[str, str, float]] = {
    "epoch": (Metric.EPOCH, "Current epoch, from 1.", 1.0),
    "total_epochs": (Metric.TOTAL_EPOCHS, "Epochs in the run.", 1.0),
    "step": (Metric.STEP, "Optimizer steps done, over every attempt (set back on a resume).", 1.0),
    "total_steps": (Metric.TOTAL_STEPS, "Optimizer steps in the run at the current world size.", 1.0),
    "percent": (Metric.PROGRESS_RATIO, "Share of the run's data done (epochs x the training split), 0..1.",
                0.01),
    "loss": (Metric.LOSS, "Training loss over the last logging interval.", 1.0),
    "accuracy": (Metric.ACCURACY, "Accuracy on the evaluation split after the last epoch, 0..1.", 1.0),
    "samples_per_second": (Metric.SAMPLES_PER_SECOND,
                           "Training samples per second of the whole job, over the last logging interval.",
                           1.0),
    "estimated_remaining_seconds": (Metric.ESTIMATED_REMAINING_SECONDS, "Estimated seconds to completion.",
                                    1.0),
}  # fmt: skip


class TrainerCollector(Collector):
    """The trainer's figures as Prometheus families, each only once it has a value.

    It owns the latest report and this process's counts; the HTTP thread reads them under a
    lock while the training loop writes them (a few times a minute, so the lock costs nothing).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._progress = Progress()
        self._steps = 0
        self._samples = 0.0
        self._gpus: tuple[GpuReading, ...] = ()

    def update(self, progress: Progress, gpus: Sequence[GpuReading]) -> None:
        """Publish ``progress``; a figure it does not have keeps its last value."""
        with self._lock:
            published = {f.name: getattr(progress, f.name) for f in fields(progress)}
            self._progress = replace(self._progress, **{k: v for k, v in published.items() if v is not None})
            if gpus:
                self._gpus = tuple(gpus)

    def count(self, steps: int, samples: float) -> None:
        """Add one logging interval's optimizer steps and samples (the whole job's)."""
        with self._lock:
            self._steps += steps
            self._samples += samples

    def gpu_utilization_percent(self) -> float | None:
        with self._lock:
            gpus = self._gpus
        return sum(g.utilization_percent for g in gpus) / len(gpus) if gpus else None

    def collect(self) -> Iterator[Family]:
        with self._lock:
            progress, steps, samples, gpus = self._progress, self._steps, self._samples, self._gpus
        for field, (name, documentation, scale) in _GAUGES.items():
            value = getattr(progress, field)
            if value is not None:
                yield GaugeMetricFamily(name, documentation, value=value * scale)
        if progress.compile is not None:
            mode = InfoMetricFamily(Metric.COMPILE_INFO, "How the model runs: compiled (cache hit or miss) "
                                    "or eager, and why.", labels=[Metric.COMPILE_MODE_LABEL])  # fmt: skip
            mode.add_metric([progress.compile], {})
            yield mode
        yield CounterMetricFamily(
            Metric.STEPS, "Optimizer steps this process has taken (from 0 at its start; rate() is steps/s).",
            value=steps,
        )  # fmt: skip
        yield CounterMetricFamily(
            Metric.SAMPLES,
            "Training samples the whole job has processed since this process started (every pod reports "
            "the job's count: take max by training, not sum).",
            value=samples,
        )
        if not gpus:
            return
        gpu = [Metric.GPU_LABEL]
        info = InfoMetricFamily(Metric.GPU_INFO, "The GPUs this pod sees, with their model name.",
                                labels=gpu)  # fmt: skip
        utilization = GaugeMetricFamily(Metric.GPU_UTILIZATION_RATIO, "GPU utilization (NVML), 0..1.",
                                        labels=gpu)  # fmt: skip
        used = GaugeMetricFamily(Metric.GPU_MEMORY_USED_BYTES, "GPU memory in use, bytes.", labels=gpu)
        total = GaugeMetricFamily(Metric.GPU_MEMORY_TOTAL_BYTES, "GPU memory in all, bytes.", labels=gpu)
        for reading in gpus:
            index = [str(reading.index)]
            info.add_metric(index, {Metric.GPU_NAME_LABEL: reading.name})
            utilization.add_metric(index, reading.utilization_percent / 100)
            used.add_metric(index, reading.memory_used_bytes)
            total.add_metric(index, reading.memory_total_bytes)
        yield from (info, utilization, used, total)


class MetricsServer:
    """The trainer's endpoint: its figures, NVML's GPUs, and the process and Python runtime
    collectors every Python exporter serves; over HTTP when a port is given (0 picks a free one)."""

    def __init__(self, port: int | None, addr: str = "0.0.0.0") -> None:
        self.registry = CollectorRegistry()
        self.figures = TrainerCollector()
        self.registry.register(self.figures)
        for runtime in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            self.registry.register(runtime)
        self.gpus = GpuMonitor()
        self.port: int | None = None
        self._server: Any = None
        if port is not None:
            try:
                self._server, _thread = start_http_server(port, addr=addr, registry=self.registry)
            except OSError as exc:
                # The endpoint is for Prometheus (and older operators' scrape); progress reaches
                # status by the trainer's reports. A port taken by another process (a local run
                # on a busy machine: the port was free when `gpuop run` chose it) costs the
                # scrape, not the training.
                log.warning("metrics endpoint not served: port %s: %s; training goes on", port, exc.strerror)
            else:
                self.port = int(self._server.server_port)

    def update(self, progress: Progress, gpus: Sequence[GpuReading] | None = None) -> None:
        """Publish ``progress`` with the GPUs' figures (read from NVML unless given)."""
        if progress.percent is None and progress.step is not None and progress.total_steps:
            progress = replace(progress, percent=100.0 * progress.step / progress.total_steps)
        self.figures.update(progress, self.gpus.read() if gpus is None else gpus)

    def count(self, steps: int, samples: float) -> None:
        self.figures.count(steps, samples)

    def gpu_utilization_percent(self) -> float | None:
        """Mean utilization of this pod's GPUs at the last update (None without NVML)."""
        return self.figures.gpu_utilization_percent()

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
