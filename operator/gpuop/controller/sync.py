"""One GpuTraining's reconcile: observe what is there, decide, act, write the status.

:class:`TrainingSync` is what a worker runs for a key the work queue gave it
(:mod:`~gpuop.controller.reconciler` owns the queue, the watches' intake and the tick). It parses
the spec, picks the job API, makes or adopts the job, patches its mutable fields, wakes or
stops it when due, derives the status from everything seen and patches it when it changed. The
decisions are the pure modules' (:mod:`gpuop.api.spec`, :mod:`gpuop.backends`,
:mod:`gpuop.observing`); the API calls go through :mod:`~gpuop.controller.children`,
:mod:`~gpuop.controller.pods` and :mod:`~gpuop.controller.statuswriter`. What those return is
kept in the training's table entry here and nowhere else.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from datetime import datetime
from typing import Final

from gpuop.api.spec import GpuTraining
from gpuop.api.spec import warnings as spec_warnings
from gpuop.api.status import TERMINAL_PHASES, GpuTrainingStatus
from gpuop.backends import registry
from gpuop.backends.contract import JobApi
from gpuop.backends.registry import Choice
from gpuop.backends.reportwiring import ReportEndpoint
from gpuop.controller.children import Children, wake_due
from gpuop.controller.discovery import ServedBackends
from gpuop.controller.kube import Kube
from gpuop.controller.pods import PodReader
from gpuop.controller.settings import OperatorSettings
from gpuop.controller.statuswriter import StatusWriter
from gpuop.controller.table import SpecView, Tracked, key_of
from gpuop.observing import diagnosis, observe
from gpuop.observing.endpoint import ReportBook
from gpuop.observing.records import Event, Observation, Thresholds

log = logging.getLogger(__name__)

_NO_ALARMS: Final = Thresholds(stall_timeout_seconds=0)


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
        first_status_later: Callable[[Tracked, object], bool],
    ) -> None:
        self.kube = kube
        self.settings = settings
        self.clock = clock
        self._children = Children(kube)
        self._pods = pods
        self._status = status
        self._served = ServedBackends(kube)
        self.report_endpoint = report_endpoint  # rendered into the trainers' pods
        self.reports = reports
        # Whether a new training's first status waits (jobsfirst), given the spec generation
        # worked; the reconciler queues it again then.
        self._first_status_later = first_status_later

    def report_failure(self, tracked: Tracked, exc: Exception) -> None:
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

    def run(self, tracked: Tracked) -> str:
        """Reconcile one training (its key worked by this caller alone); what it did."""
        meta = tracked.body.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            return "deleting"  # the garbage collector removes the job; nothing to write
        previous = tracked.status()
        now = self.clock()
        generation = meta.get("generation") if isinstance(meta.get("generation"), int) else None
        view = tracked.spec_view()
        if view.training is None:
            # Got past the CRD (applied before the CRD was upgraded, or CRD validation off).
            # Failed with the parser's words, once: the next call derives the same status.
            observation = Observation(
                now=now, generation=generation, workers_total=0, gpus=0, invalid_spec=view.invalid
            )
            self._write_status(tracked, previous, observation, _NO_ALARMS)
            return "invalid"
        spec = view.training.spec
        api, choice = self._backend(tracked, previous, view.training)
        if api is None:
            # No job API here can run it: said once in status, then only discovery is asked again.
            assert choice is not None
            observation = Observation(
                now=now, generation=generation, workers_total=spec.workers, gpus=spec.total_gpus,
                backend_unavailable=(choice.reason, choice.message),
            )  # fmt: skip
            return "status" if self._write_status(tracked, previous, observation, _NO_ALARMS) else "waiting"
        if self._finished_and_gone(tracked, previous, view.training, api):
            observation = Observation(
                now=now, generation=generation, workers_total=spec.workers, gpus=spec.total_gpus,
                job_api=api.facts, job_deleted=True,
            )  # fmt: skip
            return "status" if self._write_status(tracked, previous, observation, _NO_ALARMS) else "finished"

        if diagnosis.stopped(previous):
            # Failed for good, its job stopped: nothing is made or patched again; a spec edit is
            # only acknowledged (observedGeneration).
            observation = Observation(now=now, generation=generation, workers_total=spec.workers,
                                      gpus=spec.total_gpus, job_api=api.facts)  # fmt: skip
            return "status" if self._write_status(tracked, previous, observation, _NO_ALARMS) else "finished"

        objects = view.objects(api, self.settings.trainer_image, self.report_endpoint)
        ensured = self._children.ensure(tracked.child, view.training, api, objects)
        outcome, conflict = ensured.outcome, ensured.conflict
        tracked.keep_job(ensured.child)
        # Each use reads tracked.child once: the job watch may set it (to None, on a DELETED)
        # between two reads.
        if (child := tracked.child) is not None:
            updated = self._children.update(child, view.training, api, objects[-1])
            if updated is not None:
                tracked.keep_job(updated)
                outcome = "updated" if outcome == "unchanged" else outcome
        if (
            previous is None
            and conflict is None
            and self._first_status_later(tracked, meta.get("generation"))
        ):
            return "later" if outcome == "unchanged" else outcome
        if (
            conflict is None
            and (child := tracked.child) is not None
            and wake_due(child, tracked.woken_at, api, now)
        ):
            woken = self._children.wake(child, api, now)
            tracked.woken_at = now  # or gone already: its DELETED event follows
            if woken is not None:
                tracked.keep_job(woken)
                outcome = "woken" if outcome == "unchanged" else outcome
        observation = self._observe(tracked, previous, view, api, choice, conflict, now, generation)
        stop = diagnosis.stop_for(observation)
        if stop is not None and observation.job_stopped is None:
            # Stopped before Failed is written, and the job annotated with why: a stop that fails
            # (raises) leaves the training active for the next tick; a status write that fails
            # after it finds the annotation next time.
            child = tracked.child
            stopped = self._children.stop(child, view.training, api, stop) if child is not None else None
            if stopped is not None:
                tracked.keep_job(stopped)
                observation = dataclasses.replace(observation, job_stopped=stop)
                outcome = "stopped"
            else:  # it cannot be stopped: said as a restart, as before (Restarting, the pod's line)
                observation = dataclasses.replace(
                    observation, pods=tuple(dataclasses.replace(p, needs_fix=None) for p in observation.pods)
                )
        thresholds = Thresholds(
            stall_timeout_seconds=spec.stall_timeout_seconds,
            underutilized_percent=self.settings.underutilized_percent,
            underutilized_seconds=self.settings.underutilized_seconds,
        )
        wrote = self._write_status(tracked, previous, observation, thresholds)
        return outcome if outcome != "unchanged" or not wrote else "status"

    def _observe(
        self,
        tracked: Tracked,
        previous: GpuTrainingStatus | None,
        view: SpecView,
        api: JobApi,
        choice: Choice | None,
        conflict: str | None,
        now: datetime,
        generation: int | None,
    ) -> Observation:
        """Everything known of a training with a job (or a name conflict), at ``now``."""
        assert view.training is not None
        training, spec = view.training, view.training.spec
        child = tracked.child if conflict is None else None
        if (
            child is not None
            and observe.finished(api.conditions(child))
            and (previous is None or previous.phase not in TERMINAL_PHASES)
        ):
            tracked.reports = self.reports.of(key_of(tracked.body))  # the last, sent as the code ended
            if not any(p.result for p in tracked.pods):
                tracked.pods = self._pods.final(training)
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

    def _backend(
        self, tracked: Tracked, previous: GpuTrainingStatus | None, training: GpuTraining
    ) -> tuple[JobApi | None, Choice | None]:
        """The job API this training runs on, and the choice when it is made now.

        Chosen once: a training whose status (or job) names its backend keeps it, whatever the
        cluster serves since; a training on it never moves mid-run. None (and why) when no
        backend here can run it, or when it names a Kueue queue and the cluster serves no Kueue.
        """
        api = registry.recorded(previous)
        if api is None and (child := tracked.child) is not None:
            api = registry.of_kind(child.get("kind"))
        choice = None
        spec = training.spec
        if api is None:
            choice = registry.choose(spec.backend, self._served(), registry.gaps(spec))
            api = registry.APIS[choice.backend] if choice.backend is not None else None
        queue = spec.scheduling.queue_name
        finished = previous is not None and previous.phase in TERMINAL_PHASES
        # Asked only before its job is made (last, so discovery is asked only then): a job once
        # made stays Kueue's, whatever befalls Kueue.
        if (
            api is not None and queue is not None and tracked.child is None and not finished
            and not self._served.kueue()
        ):  # fmt: skip
            return None, registry.without_kueue(api, queue)
        return api, choice
