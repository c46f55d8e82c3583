"""The Reporter: one process's progress reports (what each says, the throttle, the ETA's
baseline, the pauses and the checkpoint); :mod:`gpureport._outbox` sends them, and
:mod:`gpureport` says what a training loop can rely on, and makes one per process."""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from gpureport._bounds import (
    checkpoint_metrics,
    fraction_done,
    metric_list,
    progress_status,
    whole_seconds,
)
from gpureport._outbox import Outbox
from gpureport._sending import Endpoint

URL_ENV = "KUBEFLOW_TRAINER_SERVER_URL"
CA_ENV = "KUBEFLOW_TRAINER_SERVER_CA_CERT"
TOKEN_ENV = "KUBEFLOW_TRAINER_SERVER_TOKEN"

log = logging.getLogger("gpureport")

# Pause reports (a start and its end each) a burst may hold; refilled at one a second.
PAUSE_BURST = 4


class Pace:
    """Seconds left at the pace since the first report. Not thread-safe: its reporter's lock
    guards it."""

    def __init__(self) -> None:
        self._baseline: tuple[float, float] | None = None  # (clock, fraction done) when first seen

    def eta(self, now: float, fraction: float | None) -> int | None:
        """The ETA at ``now`` (clock seconds) with ``fraction`` done; None until a second report
        shows a pace."""
        if fraction is None:
            return None
        if self._baseline is None or fraction < self._baseline[1]:
            self._baseline = (now, fraction)  # the first report, or a run that started over
            return None
        started, first = self._baseline
        if fraction <= first or now <= started:
            return None
        return whole_seconds((now - started) * (1.0 - fraction) / (fraction - first))


class Reporter:
    """One process's progress reports: what each says, the throttle and the ETA's baseline.

    Configured from ``environ`` (``os.environ`` by default) once, at construction. ``clock``
    (monotonic seconds) paces the throttle, the ETA and the token's cache; tests give a fake
    one. Waits (``finish``, ``flush``) use real time.
    """

    def __init__(
        self,
        environ: Mapping[str, str] | None = None,
        *,
        min_interval: float = 5.0,
        request_timeout: float = 3.0,
        final_timeout: float = 5.0,
        token_ttl: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        retries: int = 4,
        retry_delay: float = 1.0,
    ) -> None:
        env = os.environ if environ is None else environ
        self.url = env.get(URL_ENV, "").strip()
        self.ca_file = env.get(CA_ENV) or None
        self.token_file = env.get(TOKEN_ENV) or None
        self.min_interval = min_interval
        self.final_timeout = final_timeout
        self._clock = clock
        # The sender thread's own.
        self._endpoint = Endpoint(self.url, self.ca_file, self.token_file, request_timeout=request_timeout,
                                  token_ttl=token_ttl, clock=clock)  # fmt: skip
        # Rank 0 alone speaks for the job: the other ranks' figures are the same run's.
        self.enabled = self._endpoint.usable and env.get("RANK", "").strip() in ("", "0")

        # Guarded by _changed (shared with the outbox): the throttle, the ETA's baseline, the
        # pause under way, the checkpoint and the pauses' bucket.
        self._changed = threading.Condition(threading.Lock())
        # A refused report (429, 5xx, no connection) is tried again after 1 s, 2 s, 4 s, ... (at
        # most min_interval apart), while no newer report replaces it.
        self._outbox = Outbox(
            self._endpoint, self._changed, retries=retries, retry_delay=retry_delay,
            min_interval=min_interval, idle=self._unsaid_report, wants_idle=lambda: self._unsaid,
        )  # fmt: skip
        self._last_queued_at: float | None = None
        self._pace = Pace()
        self._activity: str | None = None  # the pause under way, when its start was sent
        self._checkpoint: list[tuple[str, str]] = []  # the last complete one's metrics, in every report
        self._unsaid = False  # whether no report has carried the last checkpoint yet
        # Pause reports spend from a bucket of PAUSE_BURST refilled at one a second, the
        # server's rate per pod less the step reports' share: a save right before an
        # evaluation is said whole, a loop that pauses every batch is not a flood.
        self._pause_reports = float(PAUSE_BURST)
        self._pause_reports_at: float | None = None

    @property
    def delivered(self) -> int:
        """Reports the server answered 200."""
        return self._endpoint.delivered

    @property
    def failures(self) -> int:
        """Reports it did not (or never got), and token files that could not be read."""
        return self._endpoint.failures

    # -------------------------------------------------------------------------------------
    # What the training code calls

    def report(
        self,
        step: Any = None,
        total_steps: Any = None,
        loss: Any = None,
        *,
        epoch: Any = None,
        total_epochs: Any = None,
        percent: Any = None,
        eta_seconds: Any = None,
        samples_per_second: Any = None,
        final: bool = False,
        **metrics: Any,
    ) -> bool:
        """Send where training stands; True when the report was queued (or, when ``final``,
        answered 200 within ``final_timeout``).

        ``percent`` (0..100) defaults to ``step / total_steps``; ``eta_seconds`` to the time
        left at the pace since the first report. Every keyword beyond the named ones is sent
        as a metric under its own name (``accuracy=0.93``, ``learning_rate=3e-4``).
        """
        return self.report_metrics(
            metrics, step=step, total_steps=total_steps, loss=loss, epoch=epoch, total_epochs=total_epochs,
            percent=percent, eta_seconds=eta_seconds, samples_per_second=samples_per_second, final=final,
        )  # fmt: skip

    def finish(self, step: Any = None, total_steps: Any = None, loss: Any = None, **figures: Any) -> bool:
        """The final report: 100 % and an ETA of 0, past the throttle; waits for the answer."""
        figures.pop("final", None)
        return self.report(step, total_steps, loss, final=True, **figures)

    @contextlib.contextmanager
    def pause(self, activity: str) -> Iterator[None]:
        """Say, while the ``with`` block runs, that the code is ``activity`` ("evaluating",
        "saving", "loading" or "compiling") rather than taking optimizer steps: the operator
        does not count that time against the stall timeout. Never raises into the block."""
        said = self._say_activity(activity)
        try:
            yield
        finally:
            if said:
                self._say_activity(None)

    def _say_activity(self, activity: str | None) -> bool:
        """Queue a report of the activity (None: training again) past the report throttle; a
        pause's start only while the bucket holds its two reports, and none inside another."""
        if not self.enabled or self._outbox.closed:
            return False
        try:
            now = self._clock()
            with self._changed:
                if activity is not None:
                    if self._activity is not None:
                        return False  # nested: the outer pause stands until it ends
                    if not self._take_pause_reports(now, 2):  # its start and its end, always said
                        return False  # not said, nor its end: the server would refuse some
                self._activity = activity
                said = [("activity", activity or "training"), *self._checkpoint]
            self._enqueue(_body({"metrics": metric_list(said)}))
            return True
        except Exception:  # whatever it was given, training goes on
            log.debug("gpureport: an activity report was dropped", exc_info=True)
            return False

    def checkpointed(self, step: Any, uri: Any = None, *, time: Any = None) -> bool:
        """Say that the checkpoint of ``step`` is complete, and where it is (``uri``: a path
        or an ``s3://`` key, up to 1,024 characters; a longer one is not sent); ``time`` (a
        datetime, naive meaning local, or RFC 3339 text) defaults to now. True when it is said
        at once: queued now, or, inside a ``pause()``, with the pause's end (always sent); it
        also goes with every later report. Call it once the checkpoint is whole: a scheduler
        may take it as the point a preempted training resumes from. Never raises."""
        if not self.enabled or self._outbox.closed:
            return False
        try:
            moment = time if time is not None else datetime.datetime.now(datetime.timezone.utc)
            metrics = checkpoint_metrics(step, uri, moment)
            if metrics is None:
                return False
            now = self._clock()
            with self._changed:
                self._checkpoint = metrics
                if self._activity is not None:
                    return True  # the pause's end says it, right after
                # From the pauses' bucket: a loop that checkpoints every step is said as often
                # as the server takes it. One not said now is said by the sender thread once the
                # bucket has room (a second), unless a report carries it first: a loop that stops
                # reporting (held, hung, in a long evaluation) still has its checkpoint said.
                unsaid = not self._take_pause_reports(now, 1)
                self._unsaid = self._unsaid or unsaid
                said = [("activity", "training"), *metrics]
            if unsaid:
                self._outbox.nudge()
                return False
            self._enqueue(_body({"metrics": metric_list(said)}))
            return True
        except Exception:  # whatever it was given, training goes on
            log.debug("gpureport: a checkpoint report was dropped", exc_info=True)
            return False

    def _take_pause_reports(self, now: float, count: int) -> bool:
        """Spend ``count`` from the bucket of reports sent past the throttle (with _changed held)."""
        at = self._pause_reports_at if self._pause_reports_at is not None else now
        self._pause_reports = min(PAUSE_BURST, self._pause_reports + max(0.0, now - at))
        self._pause_reports_at = now
        if self._pause_reports < count:
            return False
        self._pause_reports -= count
        return True

    def due(self, final: bool = False) -> bool:
        """Whether a report now would be sent rather than throttled (False when disabled).

        For callers whose figures cost something to gather (a GPU tensor's ``float()`` waits
        for the device): ask first, gather only when due.
        """
        if not self.enabled:
            return False
        with self._changed:
            if self._outbox.closed:
                return False
            last = self._last_queued_at
        return final or last is None or self._clock() - last >= self.min_interval

    def report_metrics(
        self,
        metrics: Mapping[str, Any],
        *,
        step: Any = None,
        total_steps: Any = None,
        loss: Any = None,
        epoch: Any = None,
        total_epochs: Any = None,
        percent: Any = None,
        eta_seconds: Any = None,
        samples_per_second: Any = None,
        final: bool = False,
    ) -> bool:
        """:meth:`report` with the extra metrics as a mapping, for names that are not valid
        keywords or that clash with its parameters (``"val/acc"``, ``"epoch"``)."""
        if not self.enabled or self._outbox.closed:
            return False
        try:
            body = self._body_if_due(
                metrics, step, total_steps, loss, epoch, total_epochs,
                percent, eta_seconds, samples_per_second, bool(final),
            )  # fmt: skip
            if body is None:
                return False
            sequence = self._enqueue(body)
            return self._outbox.wait_for(sequence, self.final_timeout) if final else True
        except Exception:  # whatever it was given, training goes on
            log.debug("gpureport: a report was dropped", exc_info=True)
            return False

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait (up to ``timeout`` seconds) until every report queued so far was tried; whether
        the last one tried was answered 200."""
        return self._outbox.flush(timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the sender thread once what is queued was tried (waiting up to ``timeout``
        seconds); later reports are dropped. A process that exits needs no close: the thread
        is a daemon."""
        self._outbox.close(timeout)

    # -------------------------------------------------------------------------------------
    # The body, on the caller's thread (once per min_interval: about 0.1 ms for 256 metrics)

    def _body_if_due(
        self,
        metrics: Mapping[str, Any],
        step: Any,
        total_steps: Any,
        loss: Any,
        epoch: Any,
        total_epochs: Any,
        percent: Any,
        eta_seconds: Any,
        samples_per_second: Any,
        final: bool,
    ) -> bytes | None:
        now = self._clock()
        with self._changed:
            last = self._last_queued_at
            if not final and last is not None and now - last < self.min_interval:
                return None  # before touching any figure: a throttled call reads no tensor
            self._last_queued_at = now
        fraction = fraction_done(step, total_steps, percent)
        eta = 0 if final else whole_seconds(eta_seconds)
        if eta is None:
            with self._changed:
                eta = self._pace.eta(now, fraction)
        with self._changed:
            checkpoint = self._checkpoint
        named = (
            ("current_step", step),
            ("total_steps", total_steps),
            ("current_epoch", epoch),
            ("total_epochs", total_epochs),
            ("loss", loss),
            ("samples_per_second", samples_per_second),
            # Every report says the pause under way, or it would end it (one without is training).
            ("activity", self._activity),
        )
        return _body(progress_status(fraction, eta, final, [*named, *checkpoint, *metrics.items()]))

    # -------------------------------------------------------------------------------------
    # What the outbox sends

    def _enqueue(self, body: bytes) -> int:
        """Hand ``body`` to the outbox (latest wins); its sequence number."""
        with self._changed:
            self._unsaid = self._unsaid and b'"checkpoint_step"' not in body
        return self._outbox.put(body)

    def _unsaid_report(self, closing: bool) -> bytes | None:
        """The checkpoint no report has said yet, when the bucket has room, or whatever the
        bucket when ``closing`` (the outbox asks, with _changed held, when nothing waits)."""
        if not self._unsaid:
            return None
        if closing:
            self._pause_reports = max(self._pause_reports, 1.0)
        if not self._take_pause_reports(self._clock(), 1):
            return None
        self._unsaid = False
        said = [("activity", self._activity or "training"), *self._checkpoint]
        return _body({"metrics": metric_list(said)})


def _body(status: dict[str, Any]) -> bytes:
    """A report's body: ``status`` as the protocol's trainerStatus, stamped with the time now."""
    status["lastUpdatedTime"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return json.dumps({"trainerStatus": status}, allow_nan=False, separators=(",", ":")).encode()
