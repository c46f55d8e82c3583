"""Which job APIs the cluster serves, and whether it serves Kueue, from the API server's
discovery, cached for a while.

Asked only while some training has no job yet (its backend is then chosen; a queued one needs
Kueue), so a Kubeflow or Kueue installed meanwhile is found within :data:`DISCOVERY_TTL_SECONDS`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Final, Generic, TypeVar

from gpuop.api.identity import KUEUE_API_VERSIONS
from gpuop.backends import registry
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
