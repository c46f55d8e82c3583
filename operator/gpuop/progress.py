"""`gpuop run`'s progress on stderr: rich's live bar on a terminal, a line per 10% elsewhere.

rich handles what a hand-drawn bar got wrong: the terminal's width (and its changes), redraws
in place without leaving a line per redraw, and the end. On a file or a CI log a live bar
would be noise or nothing, so there each tenth of the run is one plain line; both end with the
run's final figures, 100% for a finished run (the last scrape may come before the trainer's
last step: the final status, read from the trainer's record, is what is shown last).
"""

from __future__ import annotations

import sys
from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TaskProgressColumn, TextColumn, TimeElapsedColumn

from gpuop.local import progress_line
from gpuop.scrape import TrainerMetrics
from gpuop.status import GpuTrainingStatus


def figures_text(metrics: TrainerMetrics) -> str:
    """The figures beside the bar; one the trainer has not published yet is left out, not 0."""
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
        parts.append(f"{metrics.samples_per_second:,.0f}/s")
    return "  ".join(parts)


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


class Display:
    """Shows a run's progress; ``show`` per scrape, ``finish`` with the final status."""

    def __init__(self, name: str, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        self.name = name
        self._shown_decile = -1
        self._bar: Progress | None = None
        self._task: TaskID | None = None
        if self.console.is_terminal:
            self._bar = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), TaskProgressColumn(),
                TimeElapsedColumn(), TextColumn("{task.fields[figures]}"),
                console=self.console, transient=False,
            )  # fmt: skip
            self._task = self._bar.add_task(name, total=100.0, figures="starting")

    def __enter__(self) -> Display:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self._bar is not None:
            self._bar.stop()

    def show(self, metrics: TrainerMetrics) -> None:
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, completed=metrics.percent or 0.0, figures=figures_text(metrics))
            return
        decile = int((metrics.percent or 0.0) // 10)
        if decile != self._shown_decile:
            self._shown_decile = decile
            print(progress_line(metrics), file=sys.stderr, flush=True)

    def finish(self, status: GpuTrainingStatus) -> None:
        """The final figures: 100% for a finished run, where the run stopped otherwise."""
        metrics = final_metrics(status)
        if metrics is None:
            return
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, completed=metrics.percent or 0.0, figures=figures_text(metrics))
            return
        print(progress_line(metrics), file=sys.stderr, flush=True)
