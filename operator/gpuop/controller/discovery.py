"""Which job APIs the cluster serves, and whether it serves Kueue, from the API server's
discovery, cached for a while; and so the job API a training runs on.

Asked only while some training has no job yet (its backend is then chosen; a queued one needs
Kueue), so a Kubeflow or Kueue installed meanwhile is found within :data:`DISCOVERY_TTL_SECONDS`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Final, Generic, TypeVar

from gpuop.api.identity import KUEUE_API_VERSIONS
from gpuop.api.spec import GpuTraining
from gpuop.api.status import TERMINAL_PHASES, GpuTrainingStatus
from gpuop.backends import registry
from gpuop.backends.contract import JobApi
from gpuop.backends.registry import Choice
from gpuop.controller.kube import Kube

# How long a discovery answer is trusted.
DISCOVERY_TTL_SECONDS: Final = 30.0

T = TypeVar("T")


class _Cached(Generic[T]):
    """One discovery answer, asked at most every DISCOVERY_TTL_SECONDS. Thread-safe."""

    def __init__(self, ask: Callable[[], T]) -> None:
        self._ask = ask
        self._answer: tuple[float, T] | None = None  # (monotonic time, answer)
        self._lock = threading.Lock()

    def __call__(self) -> T:
        with self._lock:
            cached = self._answer
            if cached is not None and time.monotonic() - cached[0] < DISCOVERY_TTL_SECONDS:
                return cached[1]
        answer = self._ask()
        with self._lock:
            self._answer = (time.monotonic(), answer)
        return answer


class ServedBackends:
    """The backends the cluster serves (call it), and whether it serves Kueue's Workloads
    (:meth:`kueue`), each asked at most every DISCOVERY_TTL_SECONDS. Thread-safe."""

    def __init__(self, kube: Kube) -> None:
        self.kube = kube
        self._backends = _Cached(lambda: registry.served(kube.served_resources))
        self.kueue = _Cached(
            lambda: any("workloads" in kube.served_resources(version) for version in KUEUE_API_VERSIONS)
        )

    def __call__(self) -> frozenset[str]:
        return self._backends()

    def backend_for(
        self, training: GpuTraining, previous: GpuTrainingStatus | None, child: dict[str, Any] | None
    ) -> tuple[JobApi | None, Choice | None]:
        """The job API ``training`` runs on (its status ``previous``, its job ``child`` as last
        seen), and the choice when it is made now.

        Chosen once: a training whose status (or job) names its backend keeps it, whatever the
        cluster serves since; a training on it never moves mid-run. None (and why) when no
        backend here can run it, or when it names a Kueue queue and the cluster serves no Kueue.
        """
        api = registry.recorded(previous)
        if api is None and child is not None:
            api = registry.of_kind(child.get("kind"))
        choice = None
        spec = training.spec
        if api is None:
            choice = registry.choose(spec.backend, self(), registry.gaps(spec))
            api = registry.APIS[choice.backend] if choice.backend is not None else None
        queue = spec.scheduling.queue_name
        finished = previous is not None and previous.phase in TERMINAL_PHASES
        # Asked only before its job is made (last, so discovery is asked only then): a job once
        # made stays Kueue's, whatever befalls Kueue.
        if api is not None and queue is not None and child is None and not finished and not self.kueue():
            return None, registry.without_kueue(api, queue)
        return api, choice
