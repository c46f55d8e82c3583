"""What the tests' stand-ins report and what kubectl shows: a trainer's figures mid-run, an
H100's NVML reading, stand-in trainers serving them (and one that answers a byte at a time),
the CRD's printer columns."""

from __future__ import annotations

import os
import socket
import threading
from typing import Final

from gputrain.contract import METRICS_PORT, Progress
from gputrain.metrics import GpuReading, MetricsServer
from support.tcp import TcpServer

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
        self._servers: dict[str, MetricsServer | DribblingTrainer] = {}
        self._next_ip = first_ip

    def _ip(self) -> str:
        ip = f"127.{SESSION_OCTET}.0.{self._next_ip}"
        self._next_ip += 1
        return ip

    def start(self, pod: str, progress: Progress, gpu_percent: float | None) -> str:
        """Serve ``pod``'s figures; returns the pod IP to write in its status."""
        ip = self._ip()
        server = MetricsServer(METRICS_PORT, addr=ip)
        server.update(progress, gpus=h100(gpu_percent))
        self._servers[pod] = server
        return ip

    def start_dribbling(self, pod: str) -> str:
        """``pod``'s endpoint answers a byte at a time (:class:`DribblingTrainer`); its IP."""
        ip = self._ip()
        self._servers[pod] = DribblingTrainer(ip)
        return ip

    def report(self, pod: str, progress: Progress, gpu_percent: float | None = None) -> None:
        server = self._servers[pod]
        assert isinstance(server, MetricsServer), f"{pod} serves no figures"
        server.update(progress, gpus=h100(gpu_percent) or None)

    def stop(self, pod: str) -> None:
        """The trainer exits: its endpoint goes."""
        server = self._servers.pop(pod, None)
        if server is not None:
            server.close()

    def close(self) -> None:
        for pod in list(self._servers):
            self.stop(pod)


class DribblingTrainer:
    """A pod's metrics endpoint that answers one byte at a time, every ``every`` seconds, for as
    long as the client waits (any user's image can): a per-read timeout never fires on it.
    ``cut`` is set when a client closes its connection; serves until :meth:`close`."""

    def __init__(self, ip: str, every: float = 0.1) -> None:
        self.every = every
        self.cut = threading.Event()
        self._closing = threading.Event()
        self._server = TcpServer((ip, METRICS_PORT), self._dribble, "dribbling-trainer")

    def _dribble(self, connection: socket.socket) -> None:
        try:
            connection.recv(4096)  # the request
            connection.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 100000\r\n\r\n"
            )
            while not self._closing.wait(self.every):
                connection.sendall(b"#")
        except OSError:
            self.cut.set()  # the client hung up on it

    def close(self) -> None:
        self._closing.set()  # its connections end within ``every``
        self._server.close()
