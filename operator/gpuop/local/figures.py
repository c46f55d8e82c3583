"""A local run's figures as text: the one-line figures and progress bar that ``gpuop run``
shows while it trains, and the summary with the curves in the terminal that it prints at the end.

Apart from the runner, which only gathers the figures: what a run looks like on a terminal is
changed here without reading how it runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from gpuop.api.status import GpuTrainingStatus, format_eta, parse_time
from gpuop.local.runner import LocalRun
from gpuop.observing.scrape import TrainerMetrics
from gputrain.contract import HISTORY_FILE, TENSORBOARD_DIR, HistoryPoint


def figures_text(metrics: TrainerMetrics) -> str:
    """A run's figures on one line; one the trainer has not published yet is left out, not 0."""
    parts = []
    if metrics.epoch is not None and metrics.total_epochs is not None:
        parts.append(f"epoch {metrics.epoch}/{metrics.total_epochs}")
    if metrics.step is not None and metrics.total_steps is not None:
        parts.append(f"step {metrics.step}/{metrics.total_steps}")
    if metrics.loss is not None:
        parts.append(f"loss {metrics.loss:.4f}")
    if metrics.accuracy is not None:
        parts.append(f"acc {metrics.accuracy:.3f}")
    if metrics.samples_per_second is not None:
        parts.append(f"{metrics.samples_per_second:,.0f} samples/s")
    return "  ".join(parts)


def progress_line(metrics: TrainerMetrics, width: int = 24) -> str:
    """One line of progress for a terminal (or a log: no cursor movement)."""
    percent = metrics.percent or 0.0
    filled = int(width * percent / 100)
    parts = [f"[{'#' * filled}{'-' * (width - filled)}] {percent:5.1f}%", figures_text(metrics)]
    eta = format_eta(metrics.estimated_remaining_seconds)
    if eta is not None:
        parts.append(f"eta {eta}")
    return "  ".join(p for p in parts if p)


def final_metrics(status: GpuTrainingStatus) -> TrainerMetrics | None:
    """The run's last figures as the status has them (from the trainer's final record)."""
    progress = status.progress
    if progress is None:
        return None
    return TrainerMetrics(
        epoch=progress.epoch, total_epochs=progress.total_epochs, step=progress.step,
        total_steps=progress.total_steps, percent=progress.percent, loss=progress.loss,
        accuracy=progress.accuracy, samples_per_second=progress.samples_per_second,
    )  # fmt: skip


_BARS: Final = "▁▂▃▄▅▆▇█"


def sparkline(values: Sequence[float], width: int = 40) -> str:
    """``values`` in ``width`` characters of ▁..█ (each the mean of its share of the points)."""
    if not values:
        return ""
    chunks = [values[i * len(values) // width : (i + 1) * len(values) // width] for i in range(width)]
    means = [sum(c) / len(c) for c in chunks if c]
    low, high = min(means), max(means)
    span = (high - low) or 1.0
    return "".join(_BARS[round((m - low) / span * (len(_BARS) - 1))] for m in means)


def summary(run: LocalRun, status: GpuTrainingStatus, points: Sequence[HistoryPoint]) -> list[str]:
    """What the run did, for the end of `gpuop run`: its outcome and final figures, how long it
    took, and its curves in the terminal."""
    final = final_metrics(status)
    figures = figures_text(final) if final is not None else ""
    took = ""
    if status.start_time and status.completion_time:
        seconds = (parse_time(status.completion_time) - parse_time(status.start_time)).total_seconds()
        took = f" in {format_eta(seconds)}"
    outcome = f"{run.training.name} {(status.phase or 'Unknown').lower()}{took}"
    lines = [f"{outcome}: {figures}" if figures else outcome]
    for label, field in (("loss", "loss"), ("accuracy", "accuracy"), ("samples/s", "samples_per_second"),
                         ("GPU util %", "gpu_utilization_percent")):  # fmt: skip
        values = [v for v in (getattr(p, field) for p in points) if v is not None]
        if len(values) >= 2:
            lines.append(f"  {label:<10} {values[0]:>9.4g} {sparkline(values)} {values[-1]:.4g}")
    if points:
        lines.append(f"  history: {run.output_dir / HISTORY_FILE}")
    board = run.output_dir / TENSORBOARD_DIR
    if board.is_dir():
        lines.append(f"  TensorBoard: tensorboard --logdir {board}")
    return lines
