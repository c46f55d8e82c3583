"""Reconciling GpuTrainings: parse -> render -> create or adopt -> derive status -> patch if changed.

Level-triggered on purpose. Every call looks at the latest GpuTraining, its job and its pods
as last seen, and makes the cluster match; it never asks "what changed since the last
event". So a restarted operator, a lost watch event or a failed request all heal the same
way: the next call (the next event, or the scrape tick every few seconds) does the work, and
a call with nothing new costs no write at all. That is also why Kopf's change-tracking
handlers are not used: they persist a diff base in every object (one more write per job) and
re-run on.create against stale bodies after a restart.

One way in: every source of work only adds the training's key to the work queue
(:mod:`~gpuop.controller.workqueue`): Kopf's events of the trainings, the job watch's events, the
scrape tick, the first statuses left for later (:mod:`~gpuop.controller.jobsfirst`), the
retries after an error, and the clocks a reconcile found running (a wake its job's controller
needs, an alarm's deadline: :class:`~gpuop.controller.sync.Synced`, queued with ``add_after``).
Workers take the keys; one training is never worked by two at once. A key taken with nothing
new since its last reconcile (:meth:`Reconciler._has_news`: the echo of our own write, a job
event while its first status waits) is put down without a reconcile; the tick's keys are always
worked, since what it brings (pods, reports) is not in the objects' versions.

This module is the intake and the workers; what a worker runs for a key, the reconcile of one
training, is :mod:`~gpuop.controller.sync`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import Any, Final

from gpuop.api.identity import TrainingKey
from gpuop.api.status import TERMINAL_PHASES
from gpuop.backends.reportwiring import ReportEndpoint
from gpuop.controller.apiclient import ApiError
from gpuop.controller.children import finished
from gpuop.controller.jobsfirst import JobsFirst
from gpuop.controller.kube import Kube
from gpuop.controller.pods import PodReader
from gpuop.controller.settings import OperatorSettings
from gpuop.controller.statuswriter import StatusWriter
from gpuop.controller.sync import TrainingSync
from gpuop.controller.table import Table, Tracked, key_of
from gpuop.controller.telemetry import OperatorMetrics
from gpuop.controller.workqueue import WorkQueue
from gpuop.observing import observe
from gpuop.observing.endpoint import ReportBook
from gpuop.observing.records import ReceivedReport

log = logging.getLogger(__name__)

_ACTIVE_PHASES: Final = ("Created", "Running", "Restarting")
# Phases whose status only what the tick reads can change: it reconciles such a training only
# when its pods or reports changed (a clock, such as a wake its job's controller needs, is the
# reconcile's own add_after). Not Running/Restarting (their pods' figures and gpuHours, read each
# tick), Queued (Kueue's Workload is read at the reconcile), Pending (discovery is asked again).
_QUIET_PHASES: Final = ("Created", "Suspended")
# Seconds close() waits for the workers to finish the reconciles they are in.
CLOSE_SECONDS: Final = 5.0


def _uid(body: dict[str, Any]) -> str | None:
    uid = (body.get("metadata") or {}).get("uid")
    return str(uid) if uid else None


def _now() -> datetime:
    return datetime.now(UTC)


class Reconciler:
    """The work queue into the one reconcile routine, its workers, and the tick. Thread-safe."""

    def __init__(
        self,
        kube: Kube,
        settings: OperatorSettings,
        metrics: OperatorMetrics | None = None,
        *,
        clock: Callable[[], datetime] = _now,
        timer: Callable[[], float] = time.monotonic,
        leading: Callable[[], bool] = lambda: True,
        report_endpoint: ReportEndpoint | None = None,
        reports: ReportBook | None = None,
    ) -> None:
        self.kube = kube
        self.settings = settings
        self.metrics = metrics or OperatorMetrics()
        self.clock = clock
        self.leading = leading  # whether this replica acts now (its Lease; a standby does not)
        self._table = Table()
        self._pods = PodReader(kube, settings, self.metrics)
        self._status = StatusWriter(kube, self.metrics, clock)
        # What trainers reported so far (read by the tick).
        self.reports = reports or ReportBook()
        self._sync = TrainingSync(
            kube, settings, self._pods, self._status, clock, report_endpoint=report_endpoint,
            reports=self.reports, first_status_later=self._first_status_later,
        )  # fmt: skip
        self._queue: WorkQueue[TrainingKey] = WorkQueue(clock=timer)  # monotonic, or a test's
        self._due = _DueKeys(timer)
        self._jobs_first = JobsFirst()
        self._workers: list[threading.Thread] = []
        self.metrics.queue_depth.set_function(self.queued)

    # -- the queue and its workers ----------------------------------------------------------

    def start(self, workers: int | None = None) -> None:
        """Start the workers (settings.max_workers of them): until then keys only queue up
        (:meth:`run_pending` works them in the caller's thread)."""
        for index in range(workers or self.settings.max_workers):
            worker = threading.Thread(target=self._work_forever, name=f"reconcile-{index}", daemon=True)
            worker.start()
            self._workers.append(worker)

    def _work_forever(self) -> None:
        while (key := self._queue.get()) is not None:
            try:
                self._work(key)
            except Exception:  # a defect outside the reconcile's own guard: this key, not the worker
                log.exception("working %s/%s", key[0], key[1])
            finally:
                self._queue.done(key)

    def run_pending(self) -> int:
        """Work every key that is ready now, in the caller's thread; how many were taken. For a
        reconciler without workers (tests, one-shot tools)."""
        taken = 0
        while (key := self._queue.take_ready()) is not None:
            taken += 1
            try:
                self._work(key)
            finally:
                self._queue.done(key)
        return taken

    def _work(self, key: TrainingKey) -> None:
        tracked = self._table.get(key)
        try:
            due = self._due.take(key)
            # A standby keeps its table, and reconciles nothing: a key it queued is put down
            # (taking over queues every key again, take_over).
            if tracked is not None and (due or self._has_news(key, tracked)) and self.leading():
                self.reconcile(key)
        finally:
            self._queue_statuses(self._jobs_first.settled(key))

    def _queue_statuses(self, keys: Iterable[TrainingKey]) -> None:
        """First statuses left for later, handed back: behind every training that waits for
        its job, even one that arrives after them."""
        for key in keys:
            self._queue.add_low(key)

    def _has_news(self, key: TrainingKey, tracked: Tracked) -> bool:
        """Whether a reconcile could see anything its last one did not: the GpuTraining or its
        job changed since (not our own write echoed), and its first status is not left for
        later with the very spec it was left with (that reconcile will see the rest), unless its
        job has ended (:meth:`_first_status_later`). Asked as an event comes, and again as its
        key is taken, since the event may have come while the reconcile that made the change was
        still running."""
        if (
            tracked.child is not None
            and self._jobs_first.waits(key, tracked.generation)
            and not finished(tracked.child)  # read only while it waits: every job event asks
        ):
            return False
        return tracked.versions() != tracked.reconciled

    # -- watch events: keep what they tell, queue the key --------------------------------------

    def training_event(self, event_type: str | None, body: dict[str, Any]) -> None:
        key = key_of(body)
        if event_type == "DELETED":
            tracked = self._table.get(key)
            if tracked is not None and _uid(tracked.body) not in (None, _uid(body)):
                return  # an older object of that name: the one re-created since stays
            self._table.forget(key)
            self.reports.forget(key)
            self._queue.forget(key)  # its retry backoff
            self._due.clock(key, None)
            self._queue_statuses(self._jobs_first.forget(key))
            return
        tracked = self._table.get_or_add(key, body)
        tracked.see_training(body)
        if not self._has_news(key, tracked):
            return
        if tracked.child is None:
            self._jobs_first.awaits(key)
        self._queue.add(key)

    def job_event(self, event_type: str | None, body: dict[str, Any]) -> None:
        parent = observe.training_of(body)
        if parent is None or (body.get("metadata") or {}).get("name") != parent:
            # Every backend names its job after the training; a job named otherwise is another
            # controller's that copied our labels (a TrainJob's JobSet makes batch/v1 Jobs).
            return
        key = key_of(body, parent)
        tracked = self._table.get(key)
        if tracked is None:  # its GpuTraining's own event will come and queue it
            return
        tracked.see_job(event_type, body)
        if not self._has_news(key, tracked):
            return  # the job we made or patched, echoed, or its first status waits
        if not self.leading():
            return  # a standby only keeps what it knows up to date, for when it takes over
        if event_type == "DELETED" and not self._still_there(key):
            return  # the garbage collector took it with its GpuTraining: do not re-create it
        self._queue.add(key)

    def take_over(self) -> None:
        """This replica leads from now: every training it knows is reconciled, since a standby
        reconciled none (level-triggered, so what the last leader left half-done is finished
        and what it did is seen as done)."""
        keys = [key for key, _ in self._table.items()]
        log.info("taking over %d trainings", len(keys))
        for key in keys:
            self._queue.add(key)

    def _still_there(self, key: TrainingKey) -> bool:
        """Whether the GpuTraining exists, asked of the API server.

        A child's DELETED event can overtake its owner's (separate watch streams), and
        re-creating the job for a GpuTraining that is gone would leave an orphan behind.
        """
        try:
            body = self.kube.get_training(*key)
        except ApiError:
            return True  # unknown: let the reconcile decide, it re-checks on the next tick
        if body is None:
            self._table.forget(key)
            return False
        return True

    # -- the reconcile --------------------------------------------------------------------

    def reconcile(self, key: TrainingKey) -> str:
        """Make one GpuTraining's world match its spec (:mod:`~gpuop.controller.sync`), and queue
        its key as that asks; returns what it did (for metrics, tests). Only ever called for one
        key by one worker at a time (the work queue)."""
        tracked = self._table.get(key)
        if tracked is None:
            return "gone"
        started = time.monotonic()
        synced = self._sync.reconcile(tracked)
        if synced.failed:
            self.metrics.errors.inc()
            delay = self._queue.retry(key)
            if synced.api_error is not None:  # retried with backoff within the call already
                log.warning("gputraining %s/%s: %s; will retry in %gs", key[0], key[1],
                            synced.api_error, delay)  # fmt: skip
        else:
            self._queue.forget(key)  # its backoff, a retry it waited for, an earlier clock
            self._due.clock(key, None if synced.status_left else synced.again_in)
            if synced.again_in is not None:  # a clock, or its first status: queued by then
                self._queue.add_after(key, synced.again_in)
            if synced.again_now:
                self._queue.add(key)
        self.metrics.duration.observe(time.monotonic() - started)
        self.metrics.reconciles.labels(outcome=synced.outcome).inc()
        return synced.outcome

    def _first_status_later(self, tracked: Tracked, generation: object) -> float | None:
        """Seconds a new training's first status, its job made, waits for the other jobs of a
        burst (jobsfirst), or None: now. Its key is queued again by then, or once none waits.
        Never for a job that has ended: a short program's job may end within the burst, and its
        TTL delete it, before the last other job is made (the result would be lost with it)."""
        key = key_of(tracked.body)
        if finished(tracked.child):
            self._jobs_first.write_now(key)
            return None
        return self._jobs_first.leave_for_later(key, tracked.first_seen, generation)

    # -- the tick: scrape running jobs, retry what failed ---------------------------------

    def tick(self) -> None:
        """Scrape every active job's pods; queue every training for a reconcile, but one that
        nothing could have changed since its last reconcile (:meth:`_quiet`).

        One pod list per namespace per tick, however many jobs it holds.
        """
        if not self.leading():  # a standby scrapes nothing, writes nothing and counts nothing
            self.metrics.observe_trainings([], self.clock())
            return
        items = list(self._table.items())
        active: dict[str, list[tuple[TrainingKey, Tracked]]] = {}
        for key, tracked in items:
            if tracked.child is not None and tracked.phase in _ACTIVE_PHASES:
                active.setdefault(key[0], []).append((key, tracked))
        observed = self._pods.observe(
            {namespace: [key[1] for key, _ in group] for namespace, group in active.items()}
        )
        new_pods: set[TrainingKey] = set()
        for namespace, group in active.items():
            in_namespace = observed.get(namespace)
            if in_namespace is None:
                continue  # its pods could not be listed: what was seen stays
            for key, tracked in group:
                pods = in_namespace.get(key[1])
                if pods is not None and tracked.see_pods(pods):
                    new_pods.add(key)
        due: list[TrainingKey] = []
        for key, tracked in items:
            if self._jobs_first.waits(key, tracked.generation):
                continue  # the reconcile that writes its first status is queued (jobsfirst)
            # A finished job changes only on an event (a spec edit, a deletion), which reconciles
            # it anyway, or at its TTL, which its last reconcile queued itself for (add_after).
            if tracked.phase in TERMINAL_PHASES:
                continue
            reports = self.reports.of(key)
            if self._quiet(tracked, reports, key in new_pods):
                continue
            tracked.see_reports(reports)
            due.append(key)
        self._due.tick(due)
        for key in due:
            entry = self._table.get(key)
            if entry is not None and entry.phase is None:
                self._queue.add_low(key)  # a first status: behind any training waiting for its job
            else:
                self._queue.add(key)
        self.metrics.observe_trainings(items, self.clock())

    def _quiet(self, tracked: Tracked, reports: tuple[ReceivedReport, ...], new_pods: bool) -> bool:
        """Whether the tick may pass over a training: a reconcile would see what the last one saw.
        A burst of 1,000 new trainings (Created, their pods not yet made) spent a reconcile each
        every tick on nothing, beside the watch events the burst queues (bench/operator_scale.py)."""
        return (
            tracked.phase in _QUIET_PHASES
            and not new_pods
            and reports == tracked.reports
            # None (never equal): its last reconcile failed or left work for later.
            and tracked.reconciled == tracked.versions()
        )

    # -- introspection (probes, tests) ----------------------------------------------------

    def tracked(self) -> int:
        return len(self._table)

    def queued(self) -> int:
        """Keys waiting for a worker, now or at a later time."""
        return len(self._queue) + self._queue.delayed()

    def stop(self) -> None:
        """Stop the workers once the reconciles they are in are over; keys still queued are
        dropped (a replica that takes over reconciles every training anyway). Again is harmless."""
        self._queue.shut_down()
        deadline = time.monotonic() + CLOSE_SECONDS
        for worker in self._workers:
            worker.join(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        """:meth:`stop`, then the pools the reconcile calls through."""
        self.stop()
        self._pods.close()
        self._status.close()


class _DueKeys:
    """The keys worked when taken even with no news in the objects' versions: those the tick
    queued (what it brings, pods and reports, is not in them), and those whose clock
    (:attr:`~gpuop.controller.sync.Synced.again_in`) has come. Thread-safe."""

    def __init__(self, timer: Callable[[], float]) -> None:
        self._timer = timer  # the work queue's clock
        self._lock = threading.Lock()
        self._ticked: set[TrainingKey] = set()
        self._clocks: dict[TrainingKey, float] = {}  # the key's clock, by the timer

    def tick(self, keys: Iterable[TrainingKey]) -> None:
        with self._lock:
            self._ticked.update(keys)

    def clock(self, key: TrainingKey, seconds: float | None) -> None:
        """``key``'s clock comes in ``seconds``; None: it has none (an earlier one is void)."""
        with self._lock:
            if seconds is None:
                self._clocks.pop(key, None)
            else:
                self._clocks[key] = self._timer() + seconds

    def take(self, key: TrainingKey) -> bool:
        """Whether ``key``, taken now, is due whatever the versions say; it is so once."""
        with self._lock:
            due = key in self._ticked or self._timer() >= self._clocks.get(key, float("inf"))
            self._ticked.discard(key)
            if due:
                self._clocks.pop(key, None)
            return due
