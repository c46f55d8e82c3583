"""Writing a training's status, and the Events its transitions make. Blocking calls.

The status is derived (:func:`gpuop.observing.derive.derive_status`) and patched only when it
differs from the one last written, so an unchanged training costs no write. Events are posted
off the reconcile's thread: they are best effort, and a burst of new GpuTrainings should get
its jobs before its "created" Events. The writer keeps no training's state: it returns the
GpuTraining as its patch left it, for the reconcile to keep.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from gpuop.api.status import GpuTrainingStatus, status_patch
from gpuop.controller.apiclient import ApiError
from gpuop.controller.kube import Kube
from gpuop.controller.table import key_of
from gpuop.controller.telemetry import OperatorMetrics
from gpuop.observing.derive import derive_status, events
from gpuop.observing.records import Event, Observation, Thresholds

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Written:
    """A status patched: the GpuTraining as the patch's reply gave it (None: deleted meanwhile)."""

    body: dict[str, Any] | None


class StatusWriter:
    """Derives, patches when changed, and posts the Events of what changed."""

    def __init__(self, kube: Kube, metrics: OperatorMetrics, clock: Callable[[], datetime]) -> None:
        self.kube = kube
        self.metrics = metrics
        self.clock = clock
        # 8 threads: with 2, a burst's Events trailed its statuses (written 16 at a time) and
        # the last came 2.6 s after the last status; with 8, 0.8 s (bench/operator_scale.py,
        # N=1,000 on a real API server). Each thread holds one pooled connection at most.
        self._events = ThreadPoolExecutor(8, thread_name_prefix="events")

    def write(
        self,
        body: dict[str, Any],
        previous: GpuTrainingStatus | None,
        observation: Observation,
        thresholds: Thresholds,
    ) -> Written | None:
        """Derive the status of the GpuTraining ``body`` (its status as decoded: ``previous``)
        and patch it when it differs; None when it does not."""
        new = derive_status(previous, observation, thresholds)
        patch = status_patch(previous, new)
        if patch is None:
            return None
        namespace, name = key_of(body)
        updated = self.kube.patch_training_status(namespace, name, patch)
        self.metrics.status_patches.inc()
        if updated is not None:  # not deleted meanwhile
            for event in events(previous, new):
                self.emit(updated, event, observation.now)
        return Written(updated)

    def emit(self, training: dict[str, Any], event: Event, now: datetime) -> None:
        """Post an event off the reconcile's thread. Once the operator is stopping (SIGTERM: the
        pool is shut down while a last reconcile finishes) it is dropped: the status it reports
        is written, and the next replica reads it."""
        try:
            self._events.submit(self._post, training, event, now)
        except RuntimeError:  # "cannot schedule new futures after shutdown"
            log.debug("stopping: event %s %s not posted", event.type, event.reason)

    def _post(self, training: dict[str, Any], event: Event, now: datetime) -> None:
        try:
            self.kube.post_event(training, event.type, event.reason, event.message, now)
        except ApiError as exc:  # an event is worth less than the reconcile it reports
            meta = training.get("metadata") or {}
            log.warning("gputraining %s/%s: event %s not posted: %s", meta.get("namespace"), meta.get("name"),
                        event.reason, exc)  # fmt: skip

    def close(self) -> None:
        self._events.shutdown(wait=True)
