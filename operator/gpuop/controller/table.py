"""The operator's state table: what it last saw of each GpuTraining and its children.

One :class:`Tracked` entry per GpuTraining. Two kinds of writer meet in it, on separate fields:

- what was seen (the GpuTraining, its job, its pods, the reports) is written only through the
  entry's ``see_*`` methods: by the watches (Kopf's events of the trainings, the job watch), the
  scrape tick (the pods it listed, the reports it read) and the reconcile (the last reports and
  pods of a job that just finished), under the entry's lock, which is held for those few lines
  only, never across an API call;
- the reconcile (:mod:`gpuop.controller.sync`, the only module that assigns these fields) owns
  everything else, and is never run for one training by two workers at once
  (:mod:`gpuop.controller.workqueue`). What its own writes return (the job it made, the status
  it patched) it keeps with :meth:`Tracked.keep_training` and :meth:`Tracked.keep_job`, which
  never put back an older object than a watch brought meanwhile.

Each entry keeps its parsed spec per generation (:class:`SpecView`), since a job's life runs
dozens of reconciles (watch events, ticks) over the same few generations.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from gpuop._kits.schema import SpecError
from gpuop.api.fixed import fixed_spec_changes
from gpuop.api.identity import TrainingKey
from gpuop.api.spec import GpuTraining
from gpuop.api.status import GpuTrainingStatus, status_from_json
from gpuop.backends import registry
from gpuop.backends.contract import JobApi
from gpuop.backends.reportwiring import ReportEndpoint
from gpuop.observing import observe
from gpuop.observing.records import PodObservation, ReceivedReport


def key_of(obj: Mapping[str, Any], name: str | None = None) -> TrainingKey:
    """An object's (namespace, name), or its namespace with ``name`` (a child's parent)."""
    meta = obj.get("metadata") or {}
    return str(meta.get("namespace") or "default"), str(name or meta.get("name"))


def _uid(obj: Mapping[str, Any]) -> str | None:
    uid = (obj.get("metadata") or {}).get("uid")
    return str(uid) if uid else None


def _version(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("resourceVersion", ""))


def newer(candidate: Mapping[str, Any], current: Mapping[str, Any]) -> bool:
    """False when ``candidate`` is an older version than ``current``.

    resourceVersions are opaque by contract but integers in every API server; an event
    queued before our own status patch must not overwrite the patch's reply. Anything
    that is not two integers counts as newer.
    """
    a = str((candidate.get("metadata") or {}).get("resourceVersion", ""))
    b = str((current.get("metadata") or {}).get("resourceVersion", ""))
    return not (a.isdigit() and b.isdigit() and int(a) < int(b))


@dataclass
class SpecView:
    """What one generation of a GpuTraining's spec yields: parsed (or why not), rendered per
    backend when first asked, and the fixed fields changed since each child was made. Its
    first three fields never change; the two memos fill as they are asked for."""

    version: tuple[str, int] | None  # uid, metadata.generation (None: not cacheable)
    training: GpuTraining | None
    invalid: str | None  # the parse error, when it did not parse
    # The objects to create per backend (the job last), rendered when first asked for.
    rendered: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    # Fixed fields changed, by the child's created-from record: filled in as records are met.
    not_applied: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def objects(
        self, api: JobApi, default_image: str, reports: ReportEndpoint | None = None
    ) -> list[dict[str, Any]]:
        assert self.training is not None  # rendered only when it parsed
        if api.backend not in self.rendered:
            self.rendered[api.backend] = registry.render_objects(
                api, self.training, default_image=default_image, reports=reports
            )
            # A job carrying the record this very spec renders was made from the same fixed
            # fields: nothing of it is unapplied, and no need to decode the record to say so
            # (2.4% of the operator's CPU in a burst of new trainings, one decode each).
            record = observe.created_from(self.rendered[api.backend][-1])
            if record is not None:
                self.not_applied.setdefault(record, ())
        return self.rendered[api.backend]

    def not_applied_to(self, child: Mapping[str, Any] | None) -> tuple[str, ...]:
        """Fixed fields changed since the child was made (remembered per record)."""
        record = observe.created_from(child)
        if self.training is None or record is None:
            return ()
        if record not in self.not_applied:
            self.not_applied[record] = fixed_spec_changes(record, self.training.spec)
        return self.not_applied[record]


@dataclass
class Tracked:
    """What the operator last saw of one GpuTraining and its children."""

    body: dict[str, Any]
    child: dict[str, Any] | None = None
    pods: tuple[PodObservation, ...] = ()
    # Guards what was seen against a watch (or the tick) and the reconcile writing it at once.
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Counts the job watch's changes of child; what the running reconcile began with (begin()).
    # A job the reconcile keeps replaces a child the watch changed meanwhile only when newer: a
    # DELETED seen mid-reconcile is not undone by the job that reconcile had in hand.
    child_seen: int = 0
    child_seen_at_begin: int = 0
    # The versions of the GpuTraining and job the running reconcile has seen: as it began, then
    # as its own writes returned them. What it ends with becomes `reconciled`; a watch event
    # that came meanwhile is not in it, so the key that event queued is worked, not dropped.
    seen_versions: tuple[str, str] = ("", "")
    # The training code's reports as of the last tick (or its end). Not the live book: every
    # status write comes back as a watch event, and a reconcile of it that read the reports
    # arrived meanwhile would write again within milliseconds (seen at N=100 in
    # bench/report_scale.py); read once a tick, reports cost one write per tick at most.
    reports: tuple[ReceivedReport, ...] = ()
    view: SpecView | None = None
    failure: str | None = None  # the last unexpected error, said once
    child_gone: bool = False  # asked for and not found, after the training finished
    # The job as its DELETED event showed it. A job its controller deletes as soon as it ends
    # (runPolicy.ttlSecondsAfterFinished) can go before any reconcile saw it end; its last state
    # still says how it ended, which is written then, rather than the job made and run again.
    deleted_job: dict[str, Any] | None = None
    woken_at: datetime | None = None  # when the job was last touched to wake its controller
    # The uids of the pods the reconcile deleted for a lost node (gpuop.observing.nodeloss): a
    # listing may show them a while yet (one taken before the delete, a finalizer), and the gang
    # is not deleted again for them. Forgotten once no listing shows them.
    deleted_pods: frozenset[str] = frozenset()
    # The versions() a reconcile last finished with: a watch event that brings no newer object
    # (the echo of our own status write or job create) has nothing to reconcile.
    reconciled: tuple[str, str] | None = None
    # When it was first seen (monotonic): how long its first status may be left for later
    # (gpuop.controller.jobsfirst).
    first_seen: float = field(default_factory=time.monotonic)
    # The status last decoded and the very document it came from. Every event and write brings
    # a new document; the tick's reconcile of an unchanged training does not, and decoding it
    # was half of that reconcile's CPU (0.36 of 0.64 s for 1,000 trainings, cProfile).
    decoded_status: tuple[object, GpuTrainingStatus | None] = (object(), None)

    # -- the watches' side ------------------------------------------------------------------

    def see_training(self, body: dict[str, Any]) -> None:
        """A watch event's GpuTraining: kept unless older than the one known; a new object
        under the same name (another uid) starts over."""
        with self.lock:
            if _uid(self.body) != _uid(body):
                self.body, self.child, self.pods, self.deleted_job = body, None, (), None
                self.child_seen += 1
                self.first_seen = time.monotonic()
            elif newer(body, self.body):
                self.body = body

    def see_job(self, event_type: str | None, job: dict[str, Any]) -> None:
        """A watch event of this training's job: kept unless older than the one known."""
        with self.lock:
            known = self.child
            if event_type == "DELETED":
                self.child, self.pods, self.deleted_job = None, (), observe.slim_job(job)
            elif known is None or newer(job, known):
                self.child = observe.slim_job(job)
            if self.child is not known:
                self.child_seen += 1

    def see_pods(self, pods: tuple[PodObservation, ...]) -> bool:
        """The job's pods as listed (by the tick, or read once more as it finished); whether
        they differ from those known."""
        with self.lock:
            changed = pods != self.pods
            self.pods = pods
            return changed

    def see_reports(self, reports: tuple[ReceivedReport, ...]) -> None:
        """The training code's reports as read (by the tick, or once more as the job finished)."""
        with self.lock:
            self.reports = reports

    # -- the reconcile's side ------------------------------------------------------------

    def begin(self) -> None:
        """A reconcile starts from what the watches have told so far."""
        with self.lock:
            self.child_seen_at_begin = self.child_seen
            self.seen_versions = self.versions()

    def keep_training(self, body: dict[str, Any]) -> None:
        """The GpuTraining as one of our writes returned it, unless a watch brought a newer one."""
        with self.lock:
            self.seen_versions = (_version(body), self.seen_versions[1])
            if _uid(body) == _uid(self.body) and newer(body, self.body):
                self.body = body

    def keep_job(self, job: dict[str, Any] | None) -> None:
        """The job as the reconcile's own call left it (made, patched, looked up), unless the
        job watch told something since this reconcile began that is not older."""
        with self.lock:
            self.seen_versions = (self.seen_versions[0], _version(job) if job is not None else "")
            if self.child_seen == self.child_seen_at_begin or (
                job is not None
                and self.child is not None
                and _uid(job) == _uid(self.child)
                and newer(job, self.child)
            ):
                self.child = job

    def versions(self) -> tuple[str, str]:
        """The resourceVersions of the GpuTraining and its job as last seen ("" for no job)."""
        return _version(self.body), _version(self.child) if self.child is not None else ""

    @property
    def generation(self) -> object:
        """The GpuTraining's metadata.generation as last seen."""
        return (self.body.get("metadata") or {}).get("generation")

    @property
    def phase(self) -> str | None:
        phase = (self.body.get("status") or {}).get("phase")
        return phase if isinstance(phase, str) else None

    def status(self) -> GpuTrainingStatus | None:
        """The GpuTraining's status, decoded, or what the same document gave already (nothing
        changes a document in place: each event or reply is a new one)."""
        document = self.body.get("status")
        if self.decoded_status[0] is not document:
            self.decoded_status = (document, status_from_json(document))
        return self.decoded_status[1]

    def spec_view(self) -> SpecView:
        """The GpuTraining parsed, or what its current generation gave already."""
        meta = self.body.get("metadata") or {}
        uid, generation = meta.get("uid"), meta.get("generation")
        version = (str(uid), generation) if uid and isinstance(generation, int) else None
        if version is not None and self.view is not None and self.view.version == version:
            return self.view
        try:
            view = SpecView(version, registry.parse_training(self.body), None)
        except SpecError as exc:
            view = SpecView(version, None, "; ".join(str(p) for p in exc.problems))
        if version is not None:
            self.view = view
        return view


class Table:
    """Every tracked GpuTraining by key. Thread-safe; each entry has its own lock as well."""

    def __init__(self) -> None:
        self._entries: dict[TrainingKey, Tracked] = {}
        self._lock = threading.Lock()

    def get(self, key: TrainingKey) -> Tracked | None:
        with self._lock:
            return self._entries.get(key)

    def get_or_add(self, key: TrainingKey, body: dict[str, Any]) -> Tracked:
        with self._lock:
            tracked = self._entries.get(key)
            if tracked is None:
                tracked = self._entries[key] = Tracked(body=body)
            return tracked

    def forget(self, key: TrainingKey) -> None:
        with self._lock:
            self._entries.pop(key, None)

    def items(self) -> list[tuple[TrainingKey, Tracked]]:
        with self._lock:
            return list(self._entries.items())

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
