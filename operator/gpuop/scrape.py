"""Reading a trainer's Prometheus endpoint and termination message into typed figures.

Pure parsing, no I/O: the operator (in a cluster) and ``gpuop run`` (on a laptop) fetch the
text their own way and hand it here, so both read the trainer the same way.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Final

from prometheus_client.parser import text_string_to_metric_families

from gputrain.contract import RESULT_KEYS, Metric


@dataclass(frozen=True)
class GpuFigures:
    index: str
    utilization_percent: float | None
    memory_used_bytes: int | None
    memory_total_bytes: int | None


@dataclass(frozen=True)
class TrainerMetrics:
    """One pod's scrape. A figure the trainer has not published yet is None."""

    epoch: int | None
    total_epochs: int | None
    step: int | None
    total_steps: int | None
    percent: float | None
    loss: float | None
    accuracy: float | None
    samples_per_second: float | None
    estimated_remaining_seconds: float | None
    gpus: tuple[GpuFigures, ...]


def parse_metrics(text: str) -> TrainerMetrics:
    """The trainer's figures from a Prometheus text exposition; other metrics are ignored."""
    plain: dict[str, float] = {}
    per_gpu: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if math.isnan(sample.value):
                continue
            gpu = sample.labels.get(Metric.GPU_LABEL)
            if gpu is None:
                plain[sample.name] = sample.value
            else:
                per_gpu.setdefault(gpu, {})[sample.name] = sample.value

    def integer(name: str) -> int | None:
        value = plain.get(name)
        return None if value is None else int(value)

    gpus = tuple(
        GpuFigures(
            index=index,
            utilization_percent=values.get(Metric.GPU_UTILIZATION_PERCENT),
            memory_used_bytes=_int(values.get(Metric.GPU_MEMORY_USED_BYTES)),
            memory_total_bytes=_int(values.get(Metric.GPU_MEMORY_TOTAL_BYTES)),
        )
        for index, values in sorted(per_gpu.items())
    )
    return TrainerMetrics(
        epoch=integer(Metric.EPOCH),
        total_epochs=integer(Metric.TOTAL_EPOCHS),
        step=integer(Metric.STEP),
        total_steps=integer(Metric.TOTAL_STEPS),
        percent=plain.get(Metric.PROGRESS_PERCENT),
        loss=plain.get(Metric.LOSS),
        accuracy=plain.get(Metric.ACCURACY),
        samples_per_second=plain.get(Metric.SAMPLES_PER_SECOND),
        estimated_remaining_seconds=plain.get(Metric.ESTIMATED_REMAINING_SECONDS),
        gpus=gpus,
    )


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)


def parse_result(text: str) -> dict[str, Any] | None:
    """The trainer's final record (termination message or result.json); None if it is none.

    ``phase`` is Succeeded (with the final figures) or Failed (with reason and message). A
    termination message may instead hold the last log lines of a crashed trainer
    (``FallbackToLogsOnError``): that is not an error here, just not a record.
    """
    try:
        data = json.loads(text)
    except ValueError:
        return None
    if not isinstance(data, dict) or data.get("phase") not in ("Succeeded", "Failed"):
        return None
    # The message is the container's to write (a custom image's too): a value of the wrong
    # type is dropped here, at the edge, rather than break the status derivation later.
    record: dict[str, Any] = {}
    for key in RESULT_KEYS:
        value = data.get(key)
        if key in _TEXT_KEYS:
            record[key] = value[:1024] if isinstance(value, str) else None
        elif isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            record[key] = value
        else:
            record[key] = None
    return record


_TEXT_KEYS: Final = frozenset({"phase", "reason", "message"})
