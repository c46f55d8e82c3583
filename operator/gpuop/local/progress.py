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

from gpuop.api.status import GpuTrainingStatus
from gpuop.local.figures import figures_text, final_metrics, progress_line
from gpuop.observing.scrape import TrainerMetrics


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
