"""What a backend is: the one interface every job API a GpuTraining can run on implements. Pure.

A backend is one module under :mod:`gpuop.backends` with one object that satisfies
:class:`JobApi`, listed once in :mod:`gpuop.backends.registry`. Everything that differs
between backends comes from that object: what the CRD allows (its name in ``spec.backend``'s
enum, the fields it refuses), what the chart grants the operator (:attr:`JobApi.access`), what
the operator creates, watches, patches and reads, and what status says of it. Nothing else in
the operator, the CRD or the chart names a backend.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from gpuop.api.gaps import SpecGap
from gpuop.api.spec import GpuTraining, GpuTrainingSpec
from gpuop.backends.reportwiring import ReportEndpoint
from gpuop.observing.records import JobCondition, JobKind


@dataclass(frozen=True)
class AccessRule:
    """One RBAC rule the operator needs for a backend's objects, and why (the chart's comment)."""

    api_group: str
    resources: tuple[str, ...]
    verbs: tuple[str, ...]
    why: str


class JobApi(Protocol):
    """One job API a training can run on: where it lives, how a training becomes its objects,
    and how its job is read and changed."""

    @property
    def backend(self) -> str: ...  # spec.backend and status.backend say this
    @property
    def summary(self) -> str: ...  # what it is, one line of spec.backend's description
    @property
    def api_version(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def plural(self) -> str: ...
    @property
    def installed_by(self) -> str: ...  # what to install, in the message when it is missing
    @property
    def facts(self) -> JobKind: ...  # what status says of it
    @property
    def companion_plurals(
        self,
    ) -> Mapping[str, str]: ...  # kind -> plural, for what render makes before the job
    @property
    def gaps(self) -> tuple[SpecGap, ...]: ...  # the spec fields its job cannot carry
    @property
    def access(self) -> tuple[AccessRule, ...]: ...  # what the operator does to its objects

    def served(self, resources: Callable[[str], frozenset[str]]) -> bool:
        """Whether the cluster serves it, given discovery (apiVersion -> resource plurals)."""
        ...

    def controller_env(self, spec: GpuTrainingSpec) -> frozenset[str]:
        """The variables its controller adds to the trainer container of such a spec's pods
        (never rendered by us): what a ``$(VAR)`` in the spec may name besides its own env."""
        ...

    def render(
        self, training: GpuTraining, *, default_image: str, reports: ReportEndpoint | None = None
    ) -> list[dict[str, Any]]:
        """The objects to create, in creation order, the job last; with ``reports``, its pods
        report progress to that endpoint. Each pod template names its trainer container in
        ``kubectl.kubernetes.io/default-container`` (:func:`gpuop.backends.pod.pod_template`)."""
        ...

    def conditions(self, job: Mapping[str, Any] | None) -> tuple[JobCondition, ...]:
        """The job's state as conditions in the PyTorchJob's terms (status derives from those)."""
        ...

    def suspended(self, job: Mapping[str, Any] | None) -> bool:
        """Whether the job's spec says suspended (Kueue's hold, or the user's)."""
        ...

    def times(self, job: Mapping[str, Any] | None) -> tuple[str | None, str | None]:
        """When the job started and finished, as far as it says."""
        ...

    def mutable_patch(
        self, desired: Mapping[str, Any], child: Mapping[str, Any], skip: tuple[str, ...] = ()
    ) -> dict[str, Any] | None:
        """The merge patch bringing a made job's mutable fields to ``desired``'s, but ``skip``."""
        ...

    def suspend_patch(self) -> dict[str, Any]:
        """The merge patch that suspends a made job: its controller deletes the job's pods."""
        ...

    def wake_times(self, job: Mapping[str, Any] | None) -> tuple[datetime, ...]:
        """When its controller must act on the job by the clock alone (a deadline, a TTL) and is
        known to sleep through it unless the job changes: the operator touches the job then.
        Empty for a controller that keeps its own clocks."""
        ...
