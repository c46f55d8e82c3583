"""Reading a trainer's Prometheus endpoint into typed figures (its termination message is read
by :meth:`gputrain.contract.Result.from_json`).

Pure parsing, no I/O: the operator (in a cluster) and ``gpuop run`` (on a laptop) fetch the
text their own way and hand it here, so both read the trainer the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

from prometheus_client.parser import text_string_to_metric_families

from gputrain.contract import Metric, Progress, compile_mode


@dataclass(frozen=True)
class GpuFigures:
    index: str
    name: str | None  # the model, e.g. "NVIDIA H100 80GB HBM3"
    utilization_percent: float | None
    memory_used_bytes: int | None
    memory_total_bytes: int | None


@dataclass(frozen=True)
class TrainerMetrics(Progress):
    """One pod's scrape: the trainer's published progress (:class:`gputrain.contract.Progress`,
    the one definition both sides share) and the pod's own GPUs."""

    gpus: tuple[GpuFigures, ...] = ()


# A trainer with 8 GPUs serves about 2 KiB. Parsing costs about 0.2 ms per KiB (measured on a
# 2-core machine), so this bounds what one pod's answer can cost the operator to a few ms.
MAX_METRICS_BYTES: Final = 32 * 1024
# A GPU's model name, as NVML gives it, is under 100 characters.
_MAX_NAME: Final = 128


def parse_metrics(text: str) -> TrainerMetrics:
    """The trainer's figures from a Prometheus text exposition; other metrics are ignored.
    ValueError for a body over MAX_METRICS_BYTES: a pod's answer is untrusted input."""
    if len(text) > MAX_METRICS_BYTES:
        raise ValueError(f"metrics response over {MAX_METRICS_BYTES} bytes; not read")
    plain: dict[str, float] = {}
    per_gpu: dict[str, dict[str, float]] = {}
    names: dict[str, str] = {}
    mode: str | None = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if math.isnan(sample.value):
                continue
            gpu = sample.labels.get(Metric.GPU_LABEL)
            if sample.name == f"{Metric.COMPILE_INFO}_info":
                mode = sample.labels.get(Metric.COMPILE_MODE_LABEL)
            elif gpu is None:
                plain[sample.name] = sample.value
            elif sample.name == f"{Metric.GPU_INFO}_info":
                names[gpu] = sample.labels.get(Metric.GPU_NAME_LABEL, "")[:_MAX_NAME]
            else:
                per_gpu.setdefault(gpu, {})[sample.name] = sample.value

    def integer(name: str) -> int | None:
        value = plain.get(name)
        return None if value is None else int(value)

    gpus = tuple(
        GpuFigures(
            index=index,
            name=names.get(index) or None,
            utilization_percent=_percent(values.get(Metric.GPU_UTILIZATION_RATIO)),
            memory_used_bytes=_int(values.get(Metric.GPU_MEMORY_USED_BYTES)),
            memory_total_bytes=_int(values.get(Metric.GPU_MEMORY_TOTAL_BYTES)),
        )
        for index, values in ((i, per_gpu.get(i, {})) for i in sorted(per_gpu.keys() | names.keys()))
    )
    return TrainerMetrics(
        epoch=integer(Metric.EPOCH),
        total_epochs=integer(Metric.TOTAL_EPOCHS),
        step=integer(Metric.STEP),
        total_steps=integer(Metric.TOTAL_STEPS),
        percent=_percent(plain.get(Metric.PROGRESS_RATIO)),
        loss=plain.get(Metric.LOSS),
        accuracy=plain.get(Metric.ACCURACY),
        samples_per_second=plain.get(Metric.SAMPLES_PER_SECOND),
        estimated_remaining_seconds=plain.get(Metric.ESTIMATED_REMAINING_SECONDS),
        compile=compile_mode(mode),
        gpus=gpus,
    )


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)


def _percent(ratio: float | None) -> float | None:
    """A 0..1 ratio, as the status and people read it (percent)."""
    return None if ratio is None else ratio * 100
