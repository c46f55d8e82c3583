"""One GpuTraining's reconcile: observe what is there, decide, act, write the status.

:class:`TrainingSync` is what a worker runs for a key the work queue gave it
(:mod:`~gpuop.controller.reconciler` owns the queue, the watches' intake and the tick). It parses
the spec, picks the job API, makes or adopts the job, patches its mutable fields, wakes or
stops it when due, deletes its pods when a node it ran on is lost (for its job's controller to
make them again), derives the status from everything seen and patches it when it changed. The
decisions are the pure modules' (:mod:`gpuop.api.spec`, :mod:`gpuop.backends`,
:mod:`gpuop.observing`); the API calls go through :mod:`~gpuop.controller.children`,
:mod:`~gpuop.controller.pods` and :mod:`~gpuop.controller.statuswriter`. What those return is
kept in the training's table entry here and nowhere else: this module is the one writer of a
training's state (:class:`~gpuop.controller.table.Tracked`) besides the watches' own methods.
What the reconcile asks of the work queue (a retry, a deadline) it returns as :class:`Synced`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from gpuop.api.spec import GpuTraining
from gpuop.api.spec import warnings as spec_warnings
from gpuop.api.status import TERMINAL_PHASES, GpuTrainingStatus
from gpuop.backends.contract import JobApi
from gpuop.backends.registry import Choice
from gpuop.backends.reportwiring import ReportEndpoint
from gpuop.controller.apiclient import ApiError
from gpuop.controller.children import Children, next_wake, wake_due
from gpuop.controller.discovery import ServedBackends
from gpuop.controller.gang import GangRestarts, restart_at
from gpuop.controller.kube import Kube
from gpuop.controller.pods import PodReader
from gpuop.controller.settings import OperatorSettings
from gpuop.controller.statuswriter import StatusWriter
from gpuop.controller.table import SpecView, Tracked, key_of
from gpuop.observing import alarms, diagnosis, nodeloss, observe
from gpuop.observing.endpoint import ReportBook
from gpuop.observing.records import Event, Observation, Thresholds

log = logging.getLogger(__name__)

_NO_ALARMS: Final = Thresholds(stall_timeout_seconds=0)
MIN_CLOCK_SECONDS: Final = 1.0

# Whether a new training's first status waits for the other jobs of a burst: given the training
# and the spec generation worked, the seconds it may wait (None: write it now).
FirstStatusLater = Callable[[Tracked, object], float | None]


@dataclass(frozen=True)
class Synced:
    """What one reconcile did, and what it asks of the work queue."""

    outcome: str  # "created", "status", "unchanged", "error", ... (for the metrics and tests)
    # The key comes back within this many seconds: the clock alone will change what the training
    # needs then (its job's controller to wake, an alarm), or its first status was left for later.
    again_in: float | None = None
    status_left: bool = False  # its first status was left for later: this reconcile is not done
    again_now: bool = False  # the spec was edited while it ran: the key comes back at once
    failed: bool = False  # the key comes back after its retry backoff
    api_error: ApiError | None = None  # why, when the API server failed it (the caller says so)


class TrainingSync:
    """The reconcile of one training at a time, and the API callers it needs."""

    def __init__(
        self,
        kube: Kube,
        settings: OperatorSettings,
        pods: PodReader,
        status: StatusWriter,
        clock: Callable[[], datetime],
        *,
        report_endpoint: ReportEndpoint | None,
        reports: ReportBook,
        first_status_later: FirstStatusLater,
    ) -> None:
        self.kube = kube
        self.settings = settings
        self.clock = clock
        self._children = Children(kube)
        self._pods = pods
        self._status = status
        self._served = ServedBackends(kube)
        self._gangs = GangRestarts(kube, status)
        self.report_endpoint = report_endpoint  # rendered into the trainers' pods
        self.reports = reports
        # Whether a new training's first status waits (jobsfirst), given the spec generation
        # worked; the reconciler queues it again then.
        self._first_status_later = first_status_later

    def reconcile(self, tracked: Tracked) -> Synced:
        """Reconcile one training (its key worked by this caller alone), and remember what it saw.

        A failure stops this GpuTraining, never the others: an API error (already retried
        within the call) is handed back for a retry after the key's backoff; anything else, a
        defect or an input nothing upstream caught, is said once with its traceback and on the
        object itself, and retried the same way.
        """
        tracked.begin()
        generation = tracked.generation
        try:
            synced = self.run(tracked)
        except ApiError as exc:
            tracked.reconciled = None
            return Synced("error", failed=True, api_error=exc)
        except Exception as exc:
            tracked.reconciled = None
            self._report_failure(tracked, exc)
            return Synced("error", failed=True)
        tracked.failure = None
        # Done unless its first status waits for later, or our own write's reply brought a spec
        # edited meanwhile (its event, older than that reply, would be taken for an echo).
        edited = tracked.generation != generation
        tracked.reconciled = None if synced.status_left or edited else tracked.seen_versions
        return dataclasses.replace(synced, again_now=edited)

    def _report_failure(self, tracked: Tracked, exc: Exception) -> None:
        namespace, name = key_of(tracked.body)
        summary = f"{type(exc).__name__}: {exc}"[:500]
        if tracked.failure == summary:
            log.warning("gputraining %s/%s: still failing: %s", namespace, name, summary)
            return
        tracked.failure = summary
        log.exception("gputraining %s/%s: reconcile failed; other trainings go on", namespace, name)
        message = (
            f"the operator cannot reconcile this GpuTraining ({summary}); it retries after a growing "
            "pause, and on every change"
        )
        self._status.emit(tracked.body, Event("Warning", "ReconcileError", message), self.clock())

    def _write_status(
        self,
        tracked: Tracked,
        previous: GpuTrainingStatus | None,
        observation: Observation,
        thresholds: Thresholds,
    ) -> bool:
        """Whether a status was written; the GpuTraining kept as the write's reply gave it."""
        written = self._status.write(tracked.body, previous, observation, thresholds)
        if written is None:
            return False
        if written.body is not None:
            tracked.keep_training(written.body)
        return True

    def _finished_and_gone(
        self, tracked: Tracked, previous: GpuTrainingStatus | None, training: GpuTraining, api: JobApi
    ) -> bool:
        """Whether this GpuTraining finished with a job that is gone since.

        Unseen is not gone: after a restart the GpuTraining's event can come before its job's,
        so the job is asked for once before it counts as deleted.
        """
        if previous is None or previous.phase not in TERMINAL_PHASES or tracked.child is not None:
            return False
        if previous.job_name is None:
            return False
        if not tracked.child_gone:
            tracked.keep_job(self._children.find_ours(training, api))
            tracked.child_gone = tracked.child is None
        return tracked.child_gone

    @staticmethod
    def _ended_unseen(
        tracked: Tracked, previous: GpuTrainingStatus | None, api: JobApi
    ) -> dict[str, Any] | None:
        """The last state of a job deleted once it had ended, before a status said it had
        ended; None where there is none (a job deleted mid-run is made again)."""
        ended = tracked.deleted_job
        if ended is None or tracked.child is not None:
            return None
        if previous is not None and previous.phase in TERMINAL_PHASES:
            return None  # its end is written: _finished_and_gone says the job went
        return ended if observe.finished(api.conditions(ended)) else None

    def run(self, tracked: Tracked) -> Synced:
        """Observe, decide, act, write the status: one pass, for the state as last seen."""
        meta = tracked.body.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            return Synced("deleting")  # the garbage collector removes the job; nothing to write
        previous = tracked.status()
        now = self.clock()
        generation = meta.get("generation") if isinstance(meta.get("generation"), int) else None
        view = tracked.spec_view()
        settled = self._without_a_job(tracked, previous, view, now, generation)
        if isinstance(settled, Synced):
            return settled
        api, choice = settled
        assert view.training is not None  # _without_a_job settles a spec that did not parse
        ended = self._ended_unseen(tracked, previous, api)
        if ended is None:
            objects = view.objects(api, self.settings.trainer_image, self.report_endpoint)
            outcome, conflict = self._make_and_patch(tracked, view.training, api, objects)
        else:  # it ran to its end: its end is written below, and nothing is made again
            outcome, conflict = "unchanged", None
        if previous is None and conflict is None:
            later = self._first_status_later(tracked, meta.get("generation"))
            if later is not None:
                outcome = "later" if outcome == "unchanged" else outcome
                return Synced(outcome, again_in=later, status_left=True)
        if conflict is None and self._wake_if_due(tracked, api, now):
            outcome = "woken" if outcome == "unchanged" else outcome
        child = (tracked.child or ended) if conflict is None else None
        observation = self._observe(tracked, child, previous, view, api, choice, conflict, now, generation)
        stop = diagnosis.stop_for(observation)
        if stop is not None and observation.job_stopped is None:
            observation = self._stop(tracked, view.training, api, stop, observation)
            outcome = "stopped" if observation.job_stopped is not None else outcome
        spec = view.training.spec
        thresholds = Thresholds(
            stall_timeout_seconds=spec.stall_timeout_seconds,
            underutilized_percent=self.settings.underutilized_percent,
            underutilized_seconds=self.settings.underutilized_seconds,
            node_loss_timeout_seconds=spec.node_loss_timeout_seconds,
        )
        tracked.deleted_pods &= {p.uid for p in tracked.pods if p.uid is not None}  # still listed
        gang = nodeloss.gang(tracked.pods, observation.job_created_at, tracked.deleted_pods)
        restart = restart_at(gang, observation, spec.node_loss_timeout_seconds, now)
        if restart is not None and restart <= now:
            tracked.deleted_pods |= self._gangs.restart(tracked.body, api, gang, now)
            outcome, restart = "restarted", None
        wrote = self._write_status(tracked, previous, observation, thresholds)
        outcome = outcome if outcome != "unchanged" or not wrote else "status"
        if ended is not None:  # written as ended: its next pass finds the job gone and says so
            return Synced(outcome, again_in=0.0)
        return Synced(outcome, again_in=clock_due_in(tracked, api, conflict, thresholds, now, restart))

    def _without_a_job(
        self,
        tracked: Tracked,
        previous: GpuTrainingStatus | None,
        view: SpecView,
        now: datetime,
        generation: int | None,
    ) -> Synced | tuple[JobApi, Choice | None]:
        """The reconcile of a training that gets no job made or patched (a spec that does not
        parse, no backend to run it, finished with its job gone, failed for good), settled here
        with its status alone; else the job API it runs on, and the choice made now."""
        if view.training is None:
            # Got past the CRD (applied before the CRD was upgraded, or CRD validation off).
            # Failed with the parser's words, once: the next call derives the same status.
            observation = Observation(
                now=now, generation=generation, workers_total=0, gpus=0, invalid_spec=view.invalid
            )
            self._write_status(tracked, previous, observation, _NO_ALARMS)
            return Synced("invalid")
        spec = view.training.spec
        api, choice = self._served.backend_for(view.training, previous, tracked.child)
        facts: dict[str, Any] = {}
        if api is None:
            # No job API here can run it: said once in status, then only discovery is asked again.
            assert choice is not None
            facts, quiet = {"backend_unavailable": (choice.reason, choice.message)}, "waiting"
        elif self._finished_and_gone(tracked, previous, view.training, api):
            facts, quiet = {"job_api": api.facts, "job_deleted": True}, "finished"
        elif diagnosis.stopped(previous):
            # Failed for good, its job stopped: nothing is made or patched again; a spec edit is
            # only acknowledged (observedGeneration).
            facts, quiet = {"job_api": api.facts}, "finished"
        else:
            return api, choice
        observation = Observation(
            now=now, generation=generation, workers_total=spec.workers, gpus=spec.total_gpus, **facts
        )
        return Synced("status" if self._write_status(tracked, previous, observation, _NO_ALARMS) else quiet)

    def _make_and_patch(
        self, tracked: Tracked, training: GpuTraining, api: JobApi, objects: list[dict[str, Any]]
    ) -> tuple[str, str | None]:
        """Make or adopt the job, then bring its mutable fields to the spec's; what was done, and
        why there is no job of ours (a stranger holds its name), if so."""
        ensured = self._children.ensure(tracked.child, training, api, objects)
        outcome = ensured.outcome
        tracked.keep_job(ensured.child)
        # Each use reads tracked.child once: the job watch may set it (to None, on a DELETED)
        # between two reads.
        if (child := tracked.child) is not None:
            updated = self._children.update(child, training, api, objects[-1])
            if updated is not None:
                tracked.keep_job(updated)
                outcome = "updated" if outcome == "unchanged" else outcome
        return outcome, ensured.conflict

    def _wake_if_due(self, tracked: Tracked, api: JobApi, now: datetime) -> bool:
        """Touch the job when a clock its controller sleeps through has come; whether it was."""
        child = tracked.child
        if child is None or not wake_due(child, tracked.woken_at, api, now):
            return False
        woken = self._children.wake(child, api, now)
        tracked.woken_at = now  # or gone already: its DELETED event follows
        if woken is None:
            return False
        tracked.keep_job(woken)
        return True

    def _stop(
        self,
        tracked: Tracked,
        training: GpuTraining,
        api: JobApi,
        stop: tuple[str, str, str],
        observation: Observation,
    ) -> Observation:
        """Stop the job before Failed is written, annotated with why (``stop``): a stop that fails
        (raises) leaves the training active for the next tick; a status write that fails after
        it finds the annotation next time. The observation to derive the status from."""
        child = tracked.child
        stopped = self._children.stop(child, training, api, stop) if child is not None else None
        if stopped is not None:
            tracked.keep_job(stopped)
            return dataclasses.replace(observation, job_stopped=stop)
        # It cannot be stopped: said as a restart, as before (Restarting, the pod's line).
        return dataclasses.replace(
            observation, pods=tuple(dataclasses.replace(p, needs_fix=None) for p in observation.pods)
        )

    def _observe(
        self,
        tracked: Tracked,
        child: dict[str, Any] | None,
        previous: GpuTrainingStatus | None,
        view: SpecView,
        api: JobApi,
        choice: Choice | None,
        conflict: str | None,
        now: datetime,
        generation: int | None,
    ) -> Observation:
        """Everything known of a training with a job (``child``, or a name conflict), at ``now``."""
        assert view.training is not None
        training, spec = view.training, view.training.spec
        if (
            child is not None
            and observe.finished(api.conditions(child))
            and (previous is None or previous.phase not in TERMINAL_PHASES)
        ):
            tracked.see_reports(self.reports.of(key_of(tracked.body)))  # the last, sent as the code ended
            if not any(p.result for p in tracked.pods):
                tracked.see_pods(self._pods.final(training))
        start, completion = api.times(child)
        queue = None
        suspended = api.suspended(child)
        if spec.scheduling.queue_name is not None and child is not None and suspended:
            # Only while Kueue holds it: one list per tick per queued training, none once admitted.
            workloads = self.kube.list_workloads(
                training.namespace or "default", str(child["metadata"].get("uid"))
            )
            queue = observe.queue_state(workloads) if workloads is not None else None
        reports = tracked.reports if child is not None else ()
        return Observation(
            now=now,
            generation=generation,
            workers_total=spec.workers,
            gpus=spec.total_gpus,
            name_conflict=conflict,
            spec_not_applied=view.not_applied_to(child),
            job_api=api.facts,
            backend_choice=(choice.reason, choice.message) if choice is not None else None,
            job_name=training.name if child is not None else None,
            job_conditions=api.conditions(child),
            job_start_time=start,
            job_completion_time=completion,
            job_created_at=observe.created_at(child),
            job_stopped=observe.job_stop(child),
            pods=tracked.pods if child is not None else (),
            reports_progress=spec.command is None or bool(reports),
            reports=reports,
            queue_name=spec.scheduling.queue_name,
            queue=queue,
            job_suspended=suspended,
            spec_warnings=tuple(str(w) for w in spec_warnings(spec)),
        )


def clock_due_in(
    tracked: Tracked,
    api: JobApi,
    conflict: str | None,
    thresholds: Thresholds,
    now: datetime,
    restart: datetime | None,
) -> float | None:
    """Seconds until the clock alone changes what this training needs (its job's controller to
    wake, an alarm to raise, a gang to restart for a lost node), from the status as now written;
    None: no clock runs. The work queue holds the key until then (add_after): no tick has to look
    for it. ``restart``: when the gang is to be restarted for a lost node."""
    times = [alarms.next_alarm_at(tracked.status(), thresholds, now), restart]
    if conflict is None:
        times.append(next_wake(tracked.child, tracked.woken_at, api, now))
    due = min((t for t in times if t is not None), default=None)
    # A second at least: a clock whose reconcile cannot act on it yet (a status write that keeps
    # failing is retried with backoff anyway) must not spin the key.
    return None if due is None else max(MIN_CLOCK_SECONDS, (due - now).total_seconds())
