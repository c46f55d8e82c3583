"""What the tests' stand-ins report and what kubectl shows: a trainer's figures mid-run, an
H100's NVML reading, stand-in trainers serving them, the CRD's printer columns."""

from __future__ import annotations

import os
from typing import Final

from gputrain.contract import METRICS_PORT, Progress
from gputrain.metrics import GpuReading, MetricsServer

# What `kubectl get gputrainings` prints as its header (the CRD's printer columns).
PRINTER_COLUMNS = ["NAME", "PHASE", "WORKERS", "GPUS", "PROGRESS", "LOSS", "GPU-UTIL", "ETA", "AGE"]


# A trainer's figures mid-run, as the tests' trainer pods report them.
RUNNING = Progress(
    epoch=1, total_epochs=2, step=30, total_steps=100, loss=0.9, accuracy=None,
    samples_per_second=512.0, estimated_remaining_seconds=140.0,
)  # fmt: skip


def h100(utilization_percent: float | None) -> list[GpuReading]:
    """What NVML reads from one busy H100 (none without a utilization figure)."""
    if utilization_percent is None:
        return []
    return [GpuReading(0, "NVIDIA H100 80GB HBM3", utilization_percent, 10 * 2**30, 80 * 2**30)]


# The second octet of the stand-in pods' loopback addresses, one per test session: two sessions
# on one machine (two checkouts' `make test`) would otherwise both bind 127.0.0.x:9090, and the
# second's trainers serve nothing (seen: Underutilized never came, its GPU figures unread).
SESSION_OCTET: Final = os.getpid() % 254 + 1


class StandInTrainers:
    """The trainers of pods a test plays: each a real metrics endpoint (the trainer's own
    server) on a loopback address of its own, as a pod IP, where the operator scrapes it."""

    def __init__(self, first_ip: int) -> None:
        self._servers: dict[str, MetricsServer] = {}
        self._next_ip = first_ip

    def start(self, pod: str, progress: Progress, gpu_percent: float | None) -> str:
        """Serve ``pod``'s figures; returns the pod IP to write in its status."""
        ip = f"127.{SESSION_OCTET}.0.{self._next_ip}"
        self._next_ip += 1
        server = MetricsServer(METRICS_PORT, addr=ip)
        server.update(progress, gpus=h100(gpu_percent))
        self._servers[pod] = server
        return ip

    def report(self, pod: str, progress: Progress, gpu_percent: float | None = None) -> None:
        self._servers[pod].update(progress, gpus=h100(gpu_percent) or None)

    def stop(self, pod: str) -> None:
        """The trainer exits: its endpoint goes."""
        server = self._servers.pop(pod, None)
        if server is not None:
            server.close()

    def close(self) -> None:
        for pod in list(self._servers):
            self.stop(pod)
