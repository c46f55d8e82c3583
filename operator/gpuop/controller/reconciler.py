"""Reconciling GpuTrainings: parse -> render -> create or adopt -> derive status -> patch if changed.

Level-triggered on purpose. Every call looks at the latest GpuTraining, its job and its pods
as last seen, and makes the cluster match; it never asks "what changed since the last
event". So a restarted operator, a lost watch event or a failed request all heal the same
way: the next call (the next event, or the scrape tick every few seconds) does the work, and
a call with nothing new costs no write at all. An event that brings no object newer than the
last finished reconcile saw (the echo of our own write) is not even a call: what it could
change is in those objects, and what changes outside them (pods, reports, the clock) is the
tick's. That is also why Kopf's change-tracking
handlers are not used: they persist a diff base in every object (one more write per job) and
re-run on.create against stale bodies after a restart. Nor is an event a call while the
training's first status waits (jobsfirst), except a spec edit or its job's deletion: the
reconcile that writes that status sees it.

This module only sequences. The decisions live in pure modules (:mod:`gpuop.api.spec`,
:mod:`gpuop.backends`, :mod:`gpuop.observing`); the calls to the API server in
:mod:`~gpuop.controller.children`, :mod:`~gpuop.controller.pods` and
:mod:`~gpuop.controller.statuswriter`, through :mod:`gpuop.controller.kube`, the only module
that talks to the API.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Final

from gpuop.api.identity import TrainingKey
from gpuop.api.spec import GpuTraining
from gpuop.api.spec import warnings as spec_warnings
from gpuop.api.status import TERMINAL_PHASES, GpuTrainingStatus
from gpuop.backends import registry
from gpuop.backends.pod import ReportEndpoint
from gpuop.backends.registry import Choice, JobApi
from gpuop.controller import jobsfirst
from gpuop.controller.children import Children, wake_due
from gpuop.controller.discovery import ServedBackends
from gpuop.controller.kube import ApiError, Kube
from gpuop.controller.pods import PodReader
from gpuop.controller.settings import OperatorSettings
from gpuop.controller.statuswriter import StatusWriter
from gpuop.controller.table import SpecView, Table, Tracked, key_of, newer
from gpuop.controller.telemetry import OperatorMetrics
from gpuop.observing import derive, observe
from gpuop.observing.endpoint import ReportBook
from gpuop.observing.records import Event, Observation, ReceivedReport, Thresholds

log = logging.getLogger(__name__)

_ACTIVE_PHASES: Final = ("Created", "Running", "Restarting")
# Phases whose status the clock does not change: the tick reconciles such a training only when
# its pods or reports changed, or a wake is due. Not Running/Restarting (Stalled, Underutilized,
# gpuHours), Queued (Kueue's Workload is read at the tick), Pending (discovery is asked again).
_QUIET_PHASES: Final = ("Created", "Suspended")
_NO_ALARMS: Final = Thresholds(stall_timeout_seconds=0)
# Seconds a reading of which namespaces this replica leads gates its job events (_leads). Kopf
# pauses its watch of the trainings as soon as a peer outranks this replica; a job event may
# still be reconciled here that long after. Each reading is a GET per watched namespace.
LEADERSHIP_FRESH_SECONDS: Final = 2.0


def _uid(body: dict[str, Any]) -> str | None:
    uid = (body.get("metadata") or {}).get("uid")
    return str(uid) if uid else None


def _generation(body: dict[str, Any]) -> object:
    return (body.get("metadata") or {}).get("generation")


def _first_status_waits(tracked: Tracked) -> bool:
    """Whether a reconcile that writes the training's first status is on its way (jobsfirst), so
    that its events and the tick may leave everything to it. Only until its deadline: past it
    they reconcile again, so a status whose hand-over was lost (a DELETED of an older object of
    that name forgetting it, a hand-over thread gone) is written all the same."""
    return tracked.status_later and time.monotonic() < jobsfirst.deadline(tracked.first_seen)


def _now() -> datetime:
    return datetime.now(UTC)


class Reconciler:
    """The one reconcile routine over the state table, and the tick. Thread-safe."""

    def __init__(
        self,
        kube: Kube,
        settings: OperatorSettings,
        metrics: OperatorMetrics | None = None,
        *,
        clock: Callable[[], datetime] = _now,
        leadership: Callable[[], Callable[[str], bool]] = lambda: lambda _namespace: True,
        report_endpoint: ReportEndpoint | None = None,
        reports: ReportBook | None = None,
    ) -> None:
        self.kube = kube
        self.settings = settings
        self.metrics = metrics or OperatorMetrics()
        self.clock = clock
        self.leadership = leadership  # per tick: namespace -> whether this replica is active there
        # The last reading of it, and when (monotonic): the tick's, or a job event's (_leads).
        self._leading: tuple[Callable[[str], bool] | None, float] = (None, 0.0)
        self._leading_lock = threading.Lock()
        self._table = Table()
        self._children = Children(kube)
        self._pods = PodReader(kube, settings, self.metrics)
        self._status = StatusWriter(kube, self.metrics, clock)
        self._served = ServedBackends(kube)
        # Where trainers report (rendered into their pods), and what they reported so far.
        self.report_endpoint = report_endpoint
        self.reports = reports or ReportBook()
        # In a burst of new trainings, every job before any first status (jobsfirst's docstring).
        self._jobs_first = jobsfirst.JobsFirst(self.reconcile, settings.max_workers)

    # -- watch events ---------------------------------------------------------------------

    def training_event(self, event_type: str | None, body: dict[str, Any]) -> None:
        key = key_of(body)
        if event_type == "DELETED":
            tracked = self._table.get(key)
            if tracked is not None and _uid(tracked.body) not in (None, _uid(body)):
                return  # an older object of that name: the one re-created since stays
            self._table.forget(key)
            self.reports.forget(key)
            self._jobs_first.forget(key)
            return
        tracked = self._table.get_or_add(key, body)
        with tracked.lock:
            generation = _generation(tracked.body)
            if _uid(tracked.body) != _uid(body):
                tracked.body, tracked.child, tracked.pods = body, None, ()  # re-created under the same name
                tracked.status_later, tracked.first_seen = False, time.monotonic()
            elif newer(body, tracked.body):
                tracked.body = body
            if tracked.versions() == tracked.reconciled:
                return  # our own write echoed, or an older event: nothing the last reconcile did not see
            if _first_status_waits(tracked) and _generation(tracked.body) == generation:
                return  # its first status is on its way (jobsfirst), and that reconcile sees this too
            if tracked.child is None:
                self._jobs_first.waits(key)
        self.reconcile(key)

    def job_event(self, event_type: str | None, body: dict[str, Any]) -> None:
        parent = observe.training_of(body)
        if parent is None:
            return
        key = key_of(body, parent)
        tracked = self._table.get(key)
        if tracked is None:  # its GpuTraining's own event will come and reconcile
            return
        with tracked.lock:
            known = tracked.child
            if event_type == "DELETED":
                tracked.child, tracked.pods = None, ()
            elif tracked.child is None or newer(body, tracked.child):
                tracked.child, tracked.child_gone = observe.slim_job(body), False
            if event_type != "DELETED" and (
                # The job we made or patched, echoed: the reconcile that did it saw all of it (a
                # job we made is known as sent: a webhook's defaults make it news here).
                (tracked.versions() == tracked.reconciled and tracked.child == known)
                # Or its first status is on its way (jobsfirst), and the reconcile that writes it
                # sees this job as it is then. Each of these events left the status for later
                # again: 1.6-1.8 reconciles a training for nothing in a burst of 1,000
                # (bench/operator_scale.py, docs/benchmarks.md).
                or _first_status_waits(tracked)
            ):
                return
        if not self._leads(key[0]):
            return  # a standby only keeps what it knows up to date, for when it takes over
        if event_type == "DELETED" and not self._still_there(key):
            return  # the garbage collector took it with its GpuTraining: do not re-create it
        self.reconcile(key)

    def _leads(self, namespace: str) -> bool:
        """Whether this replica is the active one in ``namespace``: the jobs' watch, unlike Kopf's
        of the trainings, runs on a standby too. Read at most every :data:`LEADERSHIP_FRESH_SECONDS`
        (a peering object per watched namespace), so a replica that was outranked stops
        reconciling job events within that, where Kopf pauses its watch of the trainings."""
        with self._leading_lock:
            leading, read_at = self._leading
            if leading is None or time.monotonic() - read_at > LEADERSHIP_FRESH_SECONDS:
                leading = self.leadership()
                self._leading = (leading, time.monotonic())
        return leading(namespace)

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
        """Make one GpuTraining's world match its spec; returns what it did (for metrics, tests)."""
        tracked = self._table.get(key)
        if tracked is None:
            self._jobs_first.done(key)
            return "gone"
        started = time.monotonic()
        with tracked.lock:
            try:
                tracked.status_later = False
                generation = _generation(tracked.body)
                outcome = self._reconcile(tracked)
                tracked.failure = None
                # Done unless its first status waits for later, or our own write's reply brought
                # a spec edited meanwhile (its event, older than that reply, would be dropped).
                edited = _generation(tracked.body) != generation
                tracked.reconciled = None if tracked.status_later or edited else tracked.versions()
            except ApiError as exc:
                # Already retried with backoff; the next event or tick tries again.
                tracked.reconciled = None
                self.metrics.errors.inc()
                log.warning("gputraining %s/%s: %s; will retry", key[0], key[1], exc)
                outcome = "error"
            except Exception as exc:
                # A defect, or an input nothing upstream caught: it stops this GpuTraining, never
                # the others, and is said once (with the traceback) and on the object itself.
                tracked.reconciled = None
                self.metrics.errors.inc()
                outcome = "error"
                self._report_failure(tracked, exc)
            finally:
                self._jobs_first.done(key)  # its job made, or it could not be: it waits no more
        self.metrics.duration.observe(time.monotonic() - started)
        self.metrics.reconciles.labels(outcome=outcome).inc()
        return outcome

    def _report_failure(self, tracked: Tracked, exc: Exception) -> None:
        namespace, name = key_of(tracked.body)
        summary = f"{type(exc).__name__}: {exc}"[:500]
        if tracked.failure == summary:
            log.warning("gputraining %s/%s: still failing: %s", namespace, name, summary)
            return
        tracked.failure = summary
        log.exception("gputraining %s/%s: reconcile failed; other trainings go on", namespace, name)
        message = f"the operator cannot reconcile this GpuTraining ({summary}); it retries on every change"
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
        if written.body is not None and newer(written.body, tracked.body):
            tracked.body = written.body
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
        if previous.pytorch_job is None and previous.train_job is None:
            return False
        if not tracked.child_gone:
            tracked.child = self._children.find_ours(training, api)
            tracked.child_gone = tracked.child is None
        return tracked.child_gone

    def _reconcile(self, tracked: Tracked) -> str:
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

        if derive.stopped(previous):
            # Failed for good, its job stopped: nothing is made or patched again; a spec edit is
            # only acknowledged (observedGeneration).
            observation = Observation(now=now, generation=generation, workers_total=spec.workers,
                                      gpus=spec.total_gpus, job_api=api.facts)  # fmt: skip
            return "status" if self._write_status(tracked, previous, observation, _NO_ALARMS) else "finished"

        objects = view.objects(api, self.settings.trainer_image, self.report_endpoint)
        ensured = self._children.ensure(tracked.child, view.training, api, objects)
        tracked.child, outcome, conflict = ensured.child, ensured.outcome, ensured.conflict
        if tracked.child is not None:
            updated = self._children.update(tracked.child, view.training, api, objects[-1])
            if updated is not None:
                tracked.child = updated
                outcome = "updated" if outcome == "unchanged" else outcome
        if previous is None and conflict is None:
            key = key_of(tracked.body)
            self._jobs_first.done(key)
            if self._jobs_first.leave_for_later(key, tracked.first_seen):
                tracked.status_later = True  # written once no other training waits for its job
                return "later" if outcome == "unchanged" else outcome
        if (
            conflict is None
            and tracked.child is not None
            and wake_due(tracked.child, tracked.woken_at, api, now)
        ):
            woken = self._children.wake(tracked.child, api, now)
            tracked.woken_at = now  # or gone already: its DELETED event follows
            if woken is not None:
                tracked.child = woken
                outcome = "woken" if outcome == "unchanged" else outcome
        observation = self._observe(tracked, previous, view, api, choice, conflict, now, generation)
        stop = derive.stop_for(observation)
        if stop is not None and observation.job_stopped is None:
            # Stopped before Failed is written, and the job annotated with why: a stop that fails
            # (raises) leaves the training active for the next tick; a status write that fails
            # after it finds the annotation next time.
            stopped = self._children.stop(tracked.child, view.training, api, stop) if tracked.child else None
            if stopped is not None:
                tracked.child = stopped
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
        if api is None and tracked.child is not None:
            api = registry.of_kind(tracked.child.get("kind"))
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

    # -- the tick: scrape running jobs, retry what failed ---------------------------------

    def tick(self) -> None:
        """Scrape every active job's pods into its status; reconcile everything else again,
        but a training that nothing could have changed since its last reconcile (:meth:`_quiet`).

        One pod list per namespace per tick, however many jobs it holds.
        """
        leading = self.leadership()
        with self._leading_lock:
            self._leading = (leading, time.monotonic())
        items = [(key, tracked) for key, tracked in self._table.items() if leading(key[0])]
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
                if pods is not None:
                    with tracked.lock:
                        if pods != tracked.pods:
                            new_pods.add(key)
                        tracked.pods = pods
        for key, tracked in items:
            if _first_status_waits(tracked):
                continue  # the reconcile that writes its first status is on its way (jobsfirst)
            # A finished job changes only on an event (a spec edit, a deletion), which
            # reconciles it anyway, or at its TTL; everything else may need time (Stalled) or a
            # retry.
            if tracked.phase not in TERMINAL_PHASES:
                reports = self.reports.of(key)
                if self._quiet(tracked, reports, key in new_pods):
                    continue
                tracked.reports = reports
                self.reconcile(key)
            elif self._wake_due(tracked):  # a finished job's TTL, which no event announces
                self.reconcile(key)
        # Only what this replica serves: a standby's table is stale, and its counts would add
        # to the active replica's in a sum over pods.
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
            and not self._wake_due(tracked)
        )

    def _wake_due(self, tracked: Tracked) -> bool:
        child = tracked.child
        api = registry.of_kind(child.get("kind")) if child is not None else None
        return api is not None and wake_due(child, tracked.woken_at, api, self.clock())

    # -- introspection (probes, tests) ----------------------------------------------------

    def tracked(self) -> int:
        return len(self._table)

    def close(self) -> None:
        self._jobs_first.close()
        self._pods.close()
        self._status.close()
