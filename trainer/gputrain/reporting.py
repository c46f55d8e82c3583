"""Where a rank's figures go: the pod's metrics endpoint, the run's history, the log, and
progress reports.

Every rank reports; what each one reaches depends on where it sits: local rank 0 serves its
pod's endpoint (and reads NVML), rank 0 alone keeps the history and logs. The figures come
already reduced across ranks, so every pod's endpoint reports the whole job.

Where ``KUBEFLOW_TRAINER_SERVER_URL`` is set, rank 0 also sends each logging interval (and
the end of the run) to it through :mod:`gpureport`, the client any training code can use;
without it nothing is made and nothing changes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import gpureport

from gputrain.checkpoint import Saved
from gputrain.contract import COMPILE_METRIC, CompileMode, HistoryPoint, Progress, TrainerSettings
from gputrain.distributed import Cluster
from gputrain.history import History
from gputrain.metrics import MetricsServer
from gputrain.state import Figures

log = logging.getLogger("gputrain")


@dataclass(frozen=True)
class Standing:
    """Where the run stands, as a report tells it."""

    epoch: int  # the position's, from 0
    epochs: int
    step: int
    total_steps: int
    percent: float  # of the run's data

    @property
    def shown_epoch(self) -> int:
        """From 1; once the last epoch is done, still the last (not "4 of 3")."""
        return min(self.epoch + 1, self.epochs)


@dataclass(frozen=True)
class Interval:
    """One logging interval's work, of all ranks together."""

    steps: int
    samples: float
    seconds: float
    learning_rate: float

    @property
    def rate(self) -> float:
        return self.samples / self.seconds

    def eta(self, at: Standing) -> float:
        """Seconds to the end, at this interval's pace."""
        return (at.total_steps - at.step) * self.seconds / max(self.steps, 1)


class RankOutlets:
    """Where one rank's figures go: it publishes, records and logs that rank's view of the run."""

    def __init__(self, settings: TrainerSettings, cluster: Cluster) -> None:
        self.logs = cluster.is_main
        # One endpoint per pod: the other local ranks neither serve nor read NVML.
        self.metrics = MetricsServer(settings.metrics_port) if cluster.is_local_main else None
        # The curves, kept with the outputs: rank 0 writes them for the job.
        self.history = History(settings.output_dir) if cluster.is_main else None
        # Progress reports (Kubeflow Trainer's protocol), from rank 0 only; report() returns
        # at once and POSTs on its own thread, at most every 5 s.
        wanted = cluster.is_main and bool(os.environ.get(gpureport.URL_ENV))
        self.progress = gpureport.Reporter() if wanted else None
        self.compile: CompileMode | None = None  # how the model runs, once gputrain.compiling knows

    def compiled(self, mode: CompileMode) -> None:
        """Say how the model runs from now on: every report and the endpoint carry it."""
        self.compile = mode
        if self.metrics is not None:
            self.metrics.update(Progress(compile=mode))

    def publish(
        self, at: Standing, figures: Figures, rate: float | None = None, eta: float | None = None
    ) -> None:
        """Set the endpoint's progress; a figure given as None keeps its last value there."""
        if self.metrics is None:
            return
        self.metrics.update(
            Progress(
                epoch=at.shown_epoch,
                total_epochs=at.epochs,
                step=at.step,
                total_steps=at.total_steps,
                percent=at.percent,
                loss=figures.loss,
                accuracy=figures.accuracy,
                samples_per_second=rate,
                estimated_remaining_seconds=eta,
                compile=self.compile,
            )
        )

    def interval(self, at: Standing, figures: Figures, interval: Interval) -> None:
        """Report a logging interval, after ``figures`` counted it."""
        eta = interval.eta(at)
        if self.metrics is not None:
            self.metrics.count(interval.steps, interval.samples)
        self.publish(at, figures, interval.rate, eta)
        if self.progress is not None:
            self.progress.report(
                at.step, at.total_steps, figures.loss, epoch=at.shown_epoch, total_epochs=at.epochs,
                percent=at.percent, eta_seconds=eta, samples_per_second=interval.rate,
                accuracy=figures.accuracy, learning_rate=interval.learning_rate, **self._compile_metric(),
            )  # fmt: skip
        self._remember(at, loss=figures.loss, samples_per_second=interval.rate,
                       learning_rate=interval.learning_rate)  # fmt: skip
        if self.logs:
            log.info(
                "epoch %d/%d step %d/%d loss %.4f lr %.3g %.0f samples/s eta %.0fs",
                at.epoch + 1,
                at.epochs,
                at.step,
                at.total_steps,
                figures.loss,
                interval.learning_rate,
                interval.rate,
                eta,
            )

    def pause(self, activity: str) -> contextlib.AbstractContextManager[None]:
        """Tell the operator, while the block runs, that rank 0 is ``activity`` ("evaluating",
        "saving") rather than stepping: not a stall however long it takes."""
        return self.progress.pause(activity) if self.progress is not None else contextlib.nullcontext()

    def checkpointed(self, saved: Saved) -> None:
        """Say the checkpoint ``saved`` is complete (written whole, or resumed from): the
        operator shows it as status.checkpoint."""
        if self.progress is not None:
            self.progress.checkpointed(saved.step, saved.uri, time=saved.time)

    def evaluated(self, at: Standing, figures: Figures) -> None:
        """Report an evaluation, after ``figures`` took its results."""
        self._remember(at, accuracy=figures.accuracy)
        if self.logs:
            log.info("epoch %d/%d test loss %.4f accuracy %.4f",
                     at.epoch + 1, at.epochs, figures.test_loss, figures.accuracy)  # fmt: skip

    def finished(self, at: Standing, figures: Figures) -> None:
        """The run's final progress report (100 %, its figures), once its result is written;
        waits up to 5 s for the report to be answered."""
        if self.progress is not None:
            self.progress.finish(
                at.step, at.total_steps, figures.loss, epoch=at.shown_epoch, total_epochs=at.epochs,
                samples_per_second=figures.samples_per_second, accuracy=figures.accuracy,
                **self._compile_metric(),
            )  # fmt: skip

    def _compile_metric(self) -> dict[str, Any]:
        return {COMPILE_METRIC: self.compile} if self.compile is not None else {}

    def _remember(self, at: Standing, **figures: float | None) -> None:
        if self.history is None:
            return
        gpu = self.metrics.gpu_utilization_percent() if self.metrics is not None else None
        self.history.add(HistoryPoint(
            time=time.time(), step=at.step, epoch=at.shown_epoch, percent=at.percent,
            gpu_utilization_percent=gpu, **figures,
        ))  # fmt: skip

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
        if self.metrics is not None:
            self.metrics.close()
        if self.history is not None:
            self.history.close()
