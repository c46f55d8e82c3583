"""Reconciling GpuTrainings: parse -> render -> create or adopt -> derive status -> patch if changed.

Level-triggered on purpose. Every call looks at the latest GpuTraining, its PyTorchJob and
its pods as last seen, and makes the cluster match; it never asks "what changed since the
last event". So a restarted operator, a lost watch event or a failed request all heal the
same way: the next call (the next event, or the scrape tick every few seconds) does the
work, and a call with nothing new costs no write at all. That is also why Kopf's
change-tracking handlers are not used: they persist a diff base in every object (one more
write per job) and re-run on.create against stale bodies after a restart.

The decisions live in pure modules (:mod:`gpuop.api.spec`, :mod:`gpuop.backends.pod`,
:mod:`gpuop.observing.derive`, :mod:`gpuop.observing.observe`); this module sequences them and calls
:mod:`gpuop.controller.kube`, the only one that talks to the API.
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

from gpuop._kits.schema import SpecError
from gpuop.api.spec import GpuTraining, fixed_spec_changes, parse
from gpuop.api.spec import warnings as spec_warnings
from gpuop.api.status import GpuTrainingStatus
from gpuop.backends import registry
from gpuop.backends.registry import Choice, JobApi
from gpuop.controller.kube import ApiError, Kube
from gpuop.controller.settings import OperatorSettings
from gpuop.controller.telemetry import OperatorMetrics
from gpuop.observing import observe
from gpuop.observing.derive import derive_status, events, status_from_json, status_patch
from gpuop.observing.records import Event, Observation, PodObservation, Thresholds
from gpuop.observing.scrape import MAX_METRICS_BYTES, TrainerMetrics, parse_metrics
from gputrain.contract import METRICS_PORT

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (namespace, name)
_ACTIVE_PHASES: Final = ("Created", "Running", "Restarting")
# How long a discovery answer (which job APIs the cluster serves) is trusted. It is only asked
# while some training has no job yet, so a Kubeflow installed meanwhile is found this soon.
DISCOVERY_TTL_SECONDS: Final = 30.0


@dataclass(frozen=True)
class _SpecView:
    """What one generation of a GpuTraining's spec yields; kept, since a job's life runs
    dozens of reconciles (watch events, ticks) over the same few generations."""

    version: tuple[str, int] | None  # uid, metadata.generation (None: not cacheable)
    training: GpuTraining | None
    invalid: str | None  # the parse error, when it did not parse
    # The objects to create per backend (the job last), rendered when first asked for.
    rendered: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    # Fixed fields changed, by the child's created-from record: filled in as records are met.
    not_applied: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def objects(self, api: JobApi, default_image: str) -> list[dict[str, Any]]:
        assert self.training is not None  # rendered only when it parsed
        if api.backend not in self.rendered:
            self.rendered[api.backend] = api.render(self.training, default_image=default_image)
        return self.rendered[api.backend]


@dataclass
class Tracked:
    """What the operator last saw of one GpuTraining and its children."""

    body: dict[str, Any]
    child: dict[str, Any] | None = None
    pods: tuple[PodObservation, ...] = ()
    lock: threading.Lock = field(default_factory=threading.Lock)
    view: _SpecView | None = None
    failure: str | None = None  # the last unexpected error, said once
    child_gone: bool = False  # asked for and not found, after the training finished

    @property
    def phase(self) -> str | None:
        phase = (self.body.get("status") or {}).get("phase")
        return phase if isinstance(phase, str) else None


def _key(obj: Mapping[str, Any], name: str | None = None) -> Key:
    meta = obj.get("metadata") or {}
    return str(meta.get("namespace") or "default"), str(name or meta.get("name"))


def _newer(candidate: Mapping[str, Any], current: Mapping[str, Any]) -> bool:
    """False when ``candidate`` is an older version than ``current``.

    resourceVersions are opaque by contract but integers in every API server; an event
    queued before our own status patch must not overwrite the patch's reply. Anything
    that is not two integers counts as newer.
    """
    a = str((candidate.get("metadata") or {}).get("resourceVersion", ""))
    b = str((current.get("metadata") or {}).get("resourceVersion", ""))
    return not (a.isdigit() and b.isdigit() and int(a) < int(b))


def _now() -> datetime:
    return datetime.now(UTC)


class Reconciler:
    """The operator's state table and the one reconcile routine. Thread-safe."""

    def __init__(
        self,
        kube: Kube,
        settings: OperatorSettings,
        metrics: OperatorMetrics | None = None,
        *,
        clock: Callable[[], datetime] = _now,
        leadership: Callable[[], Callable[[str], bool]] = lambda: lambda _namespace: True,
    ) -> None:
        self.kube = kube
        self.settings = settings
        self.metrics = metrics or OperatorMetrics()
        self.clock = clock
        self.leadership = leadership  # per tick: namespace -> whether this replica is active there
        self._table: dict[Key, Tracked] = {}
        self._table_lock = threading.Lock()
        self._scrapers = ThreadPoolExecutor(settings.max_workers, thread_name_prefix="scrape")
        # Events are posted off the reconcile path: they are best effort, and a burst of new
        # GpuTrainings should get its PyTorchJobs before its "created" Events.
        self._events = ThreadPoolExecutor(2, thread_name_prefix="events")
        self._via_proxy = settings.scrapes_via_proxy(kube.in_cluster)
        self._served: tuple[float, frozenset[str]] | None = None  # (monotonic time, answer)
        self._served_lock = threading.Lock()

    # -- watch events ---------------------------------------------------------------------

    def training_event(self, event_type: str | None, body: dict[str, Any]) -> None:
        key = _key(body)
        if event_type == "DELETED":
            with self._table_lock:
                self._table.pop(key, None)
            return
        with self._table_lock:
            tracked = self._table.get(key)
            if tracked is None:
                tracked = self._table[key] = Tracked(body=body)
        with tracked.lock:
            if (tracked.body.get("metadata") or {}).get("uid") != (body.get("metadata") or {}).get("uid"):
                tracked.body, tracked.child, tracked.pods = body, None, ()  # re-created under the same name
            elif _newer(body, tracked.body):
                tracked.body = body
        self.reconcile(key)

    def job_event(self, event_type: str | None, body: dict[str, Any]) -> None:
        parent = observe.training_of(body)
        if parent is None:
            return
        key = _key(body, parent)
        with self._table_lock:
            tracked = self._table.get(key)
        if tracked is None:  # its GpuTraining's own event will come and reconcile
            return
        with tracked.lock:
            if event_type == "DELETED":
                tracked.child, tracked.pods = None, ()
            elif tracked.child is None or _newer(body, tracked.child):
                tracked.child, tracked.child_gone = observe.slim_job(body), False
        if event_type == "DELETED" and not self._still_there(key):
            return  # the garbage collector took it with its GpuTraining: do not re-create it
        self.reconcile(key)

    def _still_there(self, key: Key) -> bool:
        """Whether the GpuTraining exists, asked of the API server.

        A child's DELETED event can overtake its owner's (separate watch streams), and
        re-creating the job for a GpuTraining that is gone would leave an orphan behind.
        """
        try:
            body = self.kube.get_training(*key)
        except ApiError:
            return True  # unknown: let the reconcile decide, it re-checks on the next tick
        if body is None:
            with self._table_lock:
                self._table.pop(key, None)
            return False
        return True

    # -- the reconcile --------------------------------------------------------------------

    def reconcile(self, key: Key) -> str:
        """Make one GpuTraining's world match its spec; returns what it did (for metrics, tests)."""
        with self._table_lock:
            tracked = self._table.get(key)
        if tracked is None:
            return "gone"
        started = time.monotonic()
        with tracked.lock:
            try:
                outcome = self._reconcile(tracked)
                tracked.failure = None
            except ApiError as exc:
                # Already retried with backoff; the next event or tick tries again.
                self.metrics.errors.inc()
                log.warning("gputraining %s/%s: %s; will retry", key[0], key[1], exc)
                outcome = "error"
            except Exception as exc:
                # A defect, or an input nothing upstream caught: it stops this GpuTraining, never
                # the others, and is said once (with the traceback) and on the object itself.
                self.metrics.errors.inc()
                outcome = "error"
                self._report_failure(tracked, exc)
        self.metrics.duration.observe(time.monotonic() - started)
        self.metrics.reconciles.labels(outcome=outcome).inc()
        return outcome

    def _report_failure(self, tracked: Tracked, exc: Exception) -> None:
        namespace, name = _key(tracked.body)
        summary = f"{type(exc).__name__}: {exc}"[:500]
        if tracked.failure == summary:
            log.warning("gputraining %s/%s: still failing: %s", namespace, name, summary)
            return
        tracked.failure = summary
        log.exception("gputraining %s/%s: reconcile failed; other trainings go on", namespace, name)
        message = f"the operator cannot reconcile this GpuTraining ({summary}); it retries on every change"
        self._emit(tracked.body, Event("Warning", "ReconcileError", message), self.clock())

    def _reconcile(self, tracked: Tracked) -> str:
        body = tracked.body
        meta = body.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            return "deleting"  # the garbage collector removes the PyTorchJob; nothing to write
        previous = status_from_json(body.get("status"))
        now = self.clock()
        generation = meta.get("generation") if isinstance(meta.get("generation"), int) else None
        view = self._view(tracked)
        if view.training is None:
            # Got past the CRD (applied before the CRD was upgraded, or CRD validation off).
            # Failed with the parser's words, once: the next call derives the same status.
            observation = Observation(
                now=now, generation=generation, workers_total=0, gpus=0, invalid_spec=view.invalid
            )
            self._write_status(tracked, previous, observation, Thresholds(stall_timeout_seconds=0))
            return "invalid"
        training = view.training
        spec = training.spec
        api, choice = self._backend(tracked, previous, training)
        if api is None:
            # No job API here can run it: said once in status, then only discovery is asked again.
            assert choice is not None
            observation = Observation(
                now=now, generation=generation, workers_total=spec.workers, gpus=spec.total_gpus,
                backend_unavailable=(choice.reason, choice.message),
            )  # fmt: skip
            wrote = self._write_status(tracked, previous, observation, Thresholds(stall_timeout_seconds=0))
            return "status" if wrote else "waiting"
        if self._finished_and_gone(tracked, previous, training, api):
            observation = Observation(
                now=now, generation=generation, workers_total=spec.workers, gpus=spec.total_gpus,
                job_api=api.facts, job_deleted=True,
            )  # fmt: skip
            wrote = self._write_status(tracked, previous, observation, Thresholds(stall_timeout_seconds=0))
            return "status" if wrote else "finished"

        objects = view.objects(api, self.settings.trainer_image)
        outcome, conflict = self._ensure_child(tracked, training, api, objects)
        child = tracked.child if conflict is None else None
        pods = tracked.pods
        if (
            child is not None
            and observe.finished(api.conditions(child))
            and (previous is None or previous.phase not in ("Succeeded", "Failed"))
            and not any(p.result for p in pods)
        ):
            pods = tracked.pods = self._final_pods(training)
        start, completion = api.times(child)
        not_applied = self._not_applied(view, child)
        queue_name = spec.scheduling.queue_name
        queue = None
        suspended = api.suspended(child)
        if queue_name is not None and child is not None and suspended:
            # Only while Kueue holds it: one list per tick per queued training, none once admitted.
            workloads = self.kube.list_workloads(
                training.namespace or "default", str(child["metadata"].get("uid"))
            )
            queue = observe.queue_state(workloads) if workloads is not None else None
        observation = Observation(
            now=now,
            generation=generation,
            workers_total=spec.workers,
            gpus=spec.total_gpus,
            name_conflict=conflict,
            spec_not_applied=not_applied,
            job_api=api.facts,
            backend_choice=(choice.reason, choice.message) if choice is not None else None,
            job_name=training.name if child is not None else None,
            job_conditions=api.conditions(child),
            job_start_time=start,
            job_completion_time=completion,
            pods=pods if child is not None else (),
            reports_progress=spec.command is None,
            queue_name=queue_name,
            queue=queue,
            job_suspended=suspended,
            spec_warnings=tuple(str(w) for w in spec_warnings(spec)),
        )
        thresholds = Thresholds(
            stall_timeout_seconds=spec.stall_timeout_seconds,
            underutilized_percent=self.settings.underutilized_percent,
            underutilized_seconds=self.settings.underutilized_seconds,
        )
        wrote = self._write_status(tracked, previous, observation, thresholds)
        return outcome if outcome != "unchanged" or not wrote else "status"

    def _backend(
        self, tracked: Tracked, previous: GpuTrainingStatus | None, training: GpuTraining
    ) -> tuple[JobApi | None, Choice | None]:
        """The job API this training runs on, and the choice when it is made now.

        Chosen once: a training whose status (or job) names its backend keeps it, whatever the
        cluster serves since; a training on it never moves mid-run.
        """
        api = registry.recorded(previous)
        if api is None and tracked.child is not None:
            api = registry.of_kind(tracked.child.get("kind"))
        if api is not None:
            return api, None
        spec = training.spec
        choice = registry.choose(spec.backend, self._served_backends(), registry.gaps(spec))
        return (registry.APIS[choice.backend] if choice.backend is not None else None), choice

    def _served_backends(self) -> frozenset[str]:
        """The backends the cluster serves, from discovery, asked at most every DISCOVERY_TTL_SECONDS."""
        with self._served_lock:
            cached = self._served
            if cached is not None and time.monotonic() - cached[0] < DISCOVERY_TTL_SECONDS:
                return cached[1]
        answer = registry.served(self.kube.served_resources)
        with self._served_lock:
            self._served = (time.monotonic(), answer)
        return answer

    def _finished_and_gone(
        self, tracked: Tracked, previous: GpuTrainingStatus | None, training: GpuTraining, api: JobApi
    ) -> bool:
        """Whether this GpuTraining finished with a job that is gone since.

        Unseen is not gone: after a restart the GpuTraining's event can come before its job's,
        so the job is asked for once before it counts as deleted.
        """
        if previous is None or previous.phase not in ("Succeeded", "Failed"):
            return False
        if previous.pytorch_job is None and previous.train_job is None:
            return False
        if tracked.child is not None:
            return False
        if not tracked.child_gone:
            namespace = training.namespace or "default"
            found = self.kube.get_object(api.api_version, api.plural, namespace, training.name)
            if found is not None and observe.owner_uid(found) == training.uid:
                tracked.child = observe.slim_job(found)
                return False
            tracked.child_gone = True
        return True

    def _view(self, tracked: Tracked) -> _SpecView:
        """Parse the GpuTraining, or reuse what its current generation gave."""
        meta = tracked.body.get("metadata") or {}
        uid, generation = meta.get("uid"), meta.get("generation")
        version = (str(uid), generation) if uid and isinstance(generation, int) else None
        if version is not None and tracked.view is not None and tracked.view.version == version:
            return tracked.view
        try:
            view = _SpecView(version, parse(tracked.body), None)
        except SpecError as exc:
            view = _SpecView(version, None, "; ".join(str(p) for p in exc.problems))
        if version is not None:
            tracked.view = view
        return view

    @staticmethod
    def _not_applied(view: _SpecView, child: Mapping[str, Any] | None) -> tuple[str, ...]:
        """Fixed fields changed since the child was made (remembered per record and generation)."""
        record = observe.created_from(child)
        if view.training is None or record is None:
            return ()
        if record not in view.not_applied:
            view.not_applied[record] = fixed_spec_changes(record, view.training.spec)
        return view.not_applied[record]

    def _create_or_adopt(
        self, api_version: str, plural: str, desired: dict[str, Any]
    ) -> tuple[dict[str, Any], str]:
        """Create an object, or find the one of its name (ours from an earlier life: the operator
        restarted mid-reconcile, or a retried create had succeeded; or someone else's)."""
        meta = desired["metadata"]
        try:
            return self.kube.create_object(desired, plural), "created"
        except ApiError as exc:
            if exc.status != 409:
                raise
            found = self.kube.get_object(api_version, plural, meta["namespace"], meta["name"])
            if found is None:  # deleted in between: the next call creates it
                raise
            return found, "adopted"

    def _ensure_child(
        self, tracked: Tracked, training: GpuTraining, api: JobApi, objects: list[dict[str, Any]]
    ) -> tuple[str, str | None]:
        """Create the job (a TrainJob after its TrainingRuntime), adopt ours, or refuse a
        stranger's. Returns (outcome, conflict)."""
        uid = training.uid
        namespace, name = objects[-1]["metadata"].get("namespace") or "default", training.name
        for obj in objects:
            obj["metadata"]["namespace"] = namespace
        desired = objects[-1]
        outcome = "unchanged"
        if tracked.child is None:
            for companion in objects[:-1]:  # e.g. the TrainJob's runtime: its webhook wants it first
                plural = api.companion_plurals[companion["kind"]]
                made, _ = self._create_or_adopt(companion["apiVersion"], plural, companion)
                if observe.owner_uid(made) != uid:
                    return "conflict", _conflict(str(made.get("kind")), name)
            made, outcome = self._create_or_adopt(api.api_version, api.plural, desired)
            tracked.child = observe.slim_job(made)
            if outcome == "created":
                log.info("gputraining %s/%s: created %s %s", namespace, name, api.kind, name)
        child = tracked.child
        if observe.owner_uid(child) != uid:
            # Forget it: a stranger may not carry our label, so no event would say it left;
            # each tick asks again (409 + GET) until the name is free.
            tracked.child = None
            return "conflict", _conflict(api.kind, name)
        if not observe.finished(api.conditions(child)):
            owned_by_kueue = training.spec.scheduling.queue_name is not None
            patch = api.mutable_patch(desired, child, skip=("suspend",) if owned_by_kueue else ())
            if patch is not None:
                tracked.child = observe.slim_job(
                    self.kube.patch_object(api.api_version, api.plural, namespace, name, patch)
                )
                log.info("gputraining %s/%s: updated the %s: %s", namespace, name, api.kind, patch)
                outcome = "updated" if outcome == "unchanged" else outcome
        return outcome, None

    def _write_status(
        self,
        tracked: Tracked,
        previous: GpuTrainingStatus | None,
        observation: Observation,
        thresholds: Thresholds,
    ) -> bool:
        new = derive_status(previous, observation, thresholds)
        patch = status_patch(previous, new)
        if patch is None:
            return False
        namespace, name = _key(tracked.body)
        updated = self.kube.patch_training_status(namespace, name, patch)
        self.metrics.status_patches.inc()
        if updated is None:  # deleted meanwhile
            return True
        if _newer(updated, tracked.body):
            tracked.body = updated
        for event in events(previous, new):
            self._emit(updated, event, observation.now)
        return True

    def _emit(self, training: dict[str, Any], event: Event, now: datetime) -> None:
        """Post an event off the reconcile's thread. Once the operator is stopping (SIGTERM: the
        pool is shut down while a last reconcile finishes) it is dropped: the status it reports
        is written, and the next replica reads it."""
        try:
            self._events.submit(self._post_event, training, event, now)
        except RuntimeError:  # "cannot schedule new futures after shutdown"
            log.debug("stopping: event %s %s not posted", event.type, event.reason)

    def _post_event(self, training: dict[str, Any], event: Event, now: datetime) -> None:
        try:
            self.kube.post_event(training, event.type, event.reason, event.message, now)
        except ApiError as exc:  # an event is worth less than the reconcile it reports
            meta = training.get("metadata") or {}
            log.warning("gputraining %s/%s: event %s not posted: %s", meta.get("namespace"), meta.get("name"),
                        event.reason, exc)  # fmt: skip

    # -- the tick: scrape running jobs, retry what failed ---------------------------------

    def tick(self) -> None:
        """Scrape every active job's pods into its status; reconcile everything else again.

        One pod list per namespace per tick, however many jobs it holds; metrics requests
        run concurrently with a timeout each, so one hung pod costs one timeout, not a tick.
        """
        with self._table_lock:
            items = list(self._table.items())
        leading = self.leadership()
        items = [(key, tracked) for key, tracked in items if leading(key[0])]
        active: dict[str, list[tuple[Key, Tracked]]] = {}
        for key, tracked in items:
            if tracked.child is not None and tracked.phase in _ACTIVE_PHASES:
                active.setdefault(key[0], []).append((key, tracked))
        for namespace, group in active.items():
            try:
                pods = self.kube.list_training_pods(namespace)
            except ApiError as exc:
                log.warning("listing training pods in %s: %s", namespace, exc)
                continue
            by_training: dict[str, list[dict[str, Any]]] = {}
            for pod in pods:
                owner = observe.training_of(pod)
                if owner is not None:
                    by_training.setdefault(owner, []).append(pod)
            futures = {
                key: [(pod, self._scrapers.submit(self._scrape, pod)) for pod in by_training.get(key[1], [])]
                for key, _ in group
            }
            for key, tracked in group:
                try:
                    observed = tuple(observe.pod_observation(pod, f.result()) for pod, f in futures[key])
                except Exception:  # one training's odd pods must not stop the others' scrape
                    log.exception("gputraining %s/%s: reading its pods failed", *key)
                    continue
                with tracked.lock:
                    tracked.pods = observed
        for key, tracked in items:
            # A finished job changes only on an event (a spec edit, a deletion), which
            # reconciles it anyway; everything else may need time (Stalled) or a retry.
            if tracked.phase not in ("Succeeded", "Failed"):
                self.reconcile(key)
        # Only what this replica serves: a standby's table is stale, and its counts would add
        # to the active replica's in a sum over pods.
        self.metrics.set_phases(tracked.phase for _, tracked in items)

    def _final_pods(self, training: GpuTraining) -> tuple[PodObservation, ...]:
        """The job's pods as they ended: their termination messages hold the trainers' records."""
        pods = [
            pod
            for pod in self.kube.list_training_pods(training.namespace or "default")
            if observe.training_of(pod) == training.name
        ]
        return tuple(observe.pod_observation(p, None) for p in pods)

    def _scrape(self, pod: Mapping[str, Any]) -> TrainerMetrics | None:
        ip = observe.pod_ip(pod)
        if ip is None:
            return None
        meta = pod.get("metadata") or {}
        timeout = self.settings.scrape_timeout_seconds
        try:
            if self._via_proxy:
                text = self.kube.pod_metrics_via_proxy(
                    str(meta.get("namespace")), str(meta.get("name")), METRICS_PORT, timeout
                )
            else:
                with urllib.request.urlopen(f"http://{ip}:{METRICS_PORT}/metrics", timeout=timeout) as reply:
                    # One byte past the bound is enough to refuse it: no pod makes us read more.
                    text = reply.read(MAX_METRICS_BYTES + 1).decode("utf-8", errors="replace")
            metrics = parse_metrics(text)
        except Exception as exc:
            # Not serving yet (starting, loading data), gone, or serving anything at all: a pod's
            # answer is untrusted input, and any failure means no figures this tick.
            log.debug("scraping %s: %s", meta.get("name"), exc)
            self.metrics.scrapes.labels(outcome="error").inc()
            return None
        self.metrics.scrapes.labels(outcome="ok").inc()
        return metrics

    # -- introspection (probes, tests) ----------------------------------------------------

    def tracked(self) -> int:
        with self._table_lock:
            return len(self._table)

    def close(self) -> None:
        self._scrapers.shutdown(wait=False, cancel_futures=True)
        self._events.shutdown(wait=True)


def _conflict(kind: str, name: str) -> str:
    return (
        f"a {kind} named {name} already exists and is not owned by this GpuTraining; it is left "
        "untouched: delete it or rename the GpuTraining"
    )
