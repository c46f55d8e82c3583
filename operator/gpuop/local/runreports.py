"""A ``gpuop run``'s progress reports: the operator's endpoint, on loopback, for the one run,
and what the reports it receives become (the progress bar's figures, the run's history).

The run's processes get Kubeflow's three variables as they would in a pod, so Hugging Face's
KubeflowCallback, the Kubeflow SDK and ``gpureport`` report to it with no change: plain HTTP on
127.0.0.1 (nothing leaves the machine, so no certificate), and a random token in a file only
this user can read, instead of a projected ServiceAccount token and a TokenReview.
"""

from __future__ import annotations

import contextlib
import hmac
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from gpuop.api.identity import REPORT_TOKEN_ENV, REPORT_URL_ENV, TrainingKey, report_path
from gpuop.observing.endpoint import Limits, RefusalError, ReportBook, ReportServer
from gpuop.observing.records import ReceivedReport
from gpuop.observing.reports import TrainerReport
from gpuop.observing.scrape import TrainerMetrics
from gputrain.contract import HistoryPoint


class LocalGate:
    """Accepts the run's own token, for its own training, as its one pod."""

    def __init__(self, key: TrainingKey, token: str, pod: str) -> None:
        self.key, self.token, self.pod = key, token, pod
        self.limits = Limits()

    def authenticate(self, key: TrainingKey, token: str) -> str:
        if key != self.key or not hmac.compare_digest(token.encode(), self.token.encode()):
            raise RefusalError(401, "unauthenticated", "not this run's token")
        return self.pod

    def close(self) -> None:
        pass  # nothing runs beside the requests


@dataclass(frozen=True)
class LocalEndpoint:
    """The running endpoint: what the run's processes are told, and what they reported."""

    env: dict[str, str]
    book: ReportBook
    key: TrainingKey

    def latest(self) -> ReceivedReport | None:
        return max(self.book.of(self.key), key=lambda r: r.received_at, default=None)


@contextlib.contextmanager
def serving(namespace: str, name: str, run_dir: Path, pod: str) -> Iterator[LocalEndpoint]:
    """The endpoint on a free loopback port for as long as the run lasts."""
    token = secrets.token_urlsafe(32)
    token_file = run_dir / "report-token"
    token_file.unlink(missing_ok=True)
    descriptor = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(token)
    key = (namespace, name)
    book = ReportBook()
    server = ReportServer(LocalGate(key, token, pod), book, port=0, tls_dir=None, host="127.0.0.1")
    server.start()
    try:
        url = f"http://127.0.0.1:{server.port}{report_path(namespace, name)}"
        yield LocalEndpoint({REPORT_URL_ENV: url, REPORT_TOKEN_ENV: str(token_file)}, book, key)
    finally:
        server.close()
        token_file.unlink(missing_ok=True)


def as_metrics(report: TrainerReport) -> TrainerMetrics:
    """A report's figures in the shape the progress bar shows."""
    percent = report.percent
    if percent is None and report.step is not None and report.total_steps:
        percent = 100.0 * report.step / report.total_steps
    return TrainerMetrics(
        epoch=report.epoch, total_epochs=report.total_epochs, step=report.step,
        total_steps=report.total_steps, percent=percent, loss=report.loss, accuracy=report.accuracy,
        samples_per_second=report.samples_per_second,
        estimated_remaining_seconds=report.estimated_remaining_seconds,
    )  # fmt: skip


def history_point(received: ReceivedReport) -> HistoryPoint | None:
    """A report as a line of the run's metric history (None: it carries no step to plot by)."""
    report = received.report
    if report.step is None:
        return None
    learning_rate = dict(report.other).get("learning_rate")
    try:
        rate = float(learning_rate) if learning_rate is not None else None
    except ValueError:
        rate = None
    return HistoryPoint(
        time=received.received_at.timestamp(), step=report.step, epoch=report.epoch or 1,
        percent=report.percent, loss=report.loss, accuracy=report.accuracy, learning_rate=rate,
        samples_per_second=report.samples_per_second,
    )  # fmt: skip
