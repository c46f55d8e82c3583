"""The operator's state table: what it last saw of each GpuTraining and its children.

One :class:`Tracked` entry per GpuTraining, each with a lock of its own so that reconciles of
different trainings run side by side while one training's are never interleaved. Each entry
keeps its parsed spec per generation (:class:`SpecView`), since a job's life runs dozens of
reconciles (watch events, ticks) over the same few generations.
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
from gpuop.api.spec import GpuTraining, parse
from gpuop.api.status import GpuTrainingStatus, status_from_json
from gpuop.backends import registry
from gpuop.backends.pod import ReportEndpoint
from gpuop.backends.registry import JobApi
from gpuop.observing import observe
from gpuop.observing.records import PodObservation, ReceivedReport


def key_of(obj: Mapping[str, Any], name: str | None = None) -> TrainingKey:
    """An object's (namespace, name), or its namespace with ``name`` (a child's parent)."""
    meta = obj.get("metadata") or {}
    return str(meta.get("namespace") or "default"), str(name or meta.get("name"))


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
    # The training code's reports as of the last tick (or its end). Not the live book: every
    # status write comes back as a watch event, and a reconcile of it that read the reports
    # arrived meanwhile would write again within milliseconds (seen at N=100 in
    # bench/report_scale.py); read once a tick, reports cost one write per tick at most.
    reports: tuple[ReceivedReport, ...] = ()
    lock: threading.Lock = field(default_factory=threading.Lock)
    view: SpecView | None = None
    failure: str | None = None  # the last unexpected error, said once
    child_gone: bool = False  # asked for and not found, after the training finished
    woken_at: datetime | None = None  # when the job was last touched to wake its controller
    # The versions() a reconcile last finished with: a watch event that brings no newer object
    # (the echo of our own status write or job create) has nothing to reconcile.
    reconciled: tuple[str, str] | None = None
    # Its first status left for later by the last reconcile (gpuop.controller.jobsfirst), and
    # when it was first seen (how long that may be).
    status_later: bool = False
    first_seen: float = field(default_factory=time.monotonic)
    # The status last decoded and the very document it came from. Every event and write brings
    # a new document; the tick's reconcile of an unchanged training does not, and decoding it
    # was half of that reconcile's CPU (0.36 of 0.64 s for 1,000 trainings, cProfile).
    decoded_status: tuple[object, GpuTrainingStatus | None] = (object(), None)

    def versions(self) -> tuple[str, str]:
        """The resourceVersions of the GpuTraining and its job as last seen ("" for no job)."""
        child = (self.child or {}).get("metadata") or {}
        return str((self.body.get("metadata") or {}).get("resourceVersion", "")), str(
            child.get("resourceVersion", "")
        )

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
            view = SpecView(version, parse(self.body), None)
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
