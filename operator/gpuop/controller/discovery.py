"""Which job APIs the cluster serves, from the API server's discovery, cached for a while.

Asked only while some training has no job yet (its backend is then chosen), so a Kubeflow
installed meanwhile is found within :data:`DISCOVERY_TTL_SECONDS`.
"""

from __future__ import annotations

import threading
import time
from typing import Final

from gpuop.backends import registry
from gpuop.controller.kube import Kube

# How long a discovery answer is trusted.
DISCOVERY_TTL_SECONDS: Final = 30.0


class ServedBackends:
    """The backends the cluster serves, asked at most every DISCOVERY_TTL_SECONDS. Thread-safe."""

    def __init__(self, kube: Kube) -> None:
        self.kube = kube
        self._answer: tuple[float, frozenset[str]] | None = None  # (monotonic time, answer)
        self._lock = threading.Lock()

    def __call__(self) -> frozenset[str]:
        with self._lock:
            cached = self._answer
            if cached is not None and time.monotonic() - cached[0] < DISCOVERY_TTL_SECONDS:
                return cached[1]
        answer = registry.served(self.kube.served_resources)
        with self._lock:
            self._answer = (time.monotonic(), answer)
        return answer
