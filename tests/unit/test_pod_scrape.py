"""The operator's pod scrape against real HTTP endpoints on loopback: a pod whose metrics come a
byte at a time costs its own figures for the tick, never the other trainings' (issue 28: the
tick waited for each scrape, and a per-read timeout never fires on a byte every 0.1 s)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from gpuop.controller.pods import PodReader
from gpuop.controller.settings import OperatorSettings
from gpuop.controller.telemetry import OperatorMetrics
from gputrain.contract import METRICS_PORT
from gputrain.metrics import MetricsServer
from support.samples import RUNNING, SESSION_OCTET, DribblingTrainer
from support.tcp import TcpServer

NAMESPACE = "team-a"
# Addresses of this session's own (the stand-in trainers of other suites use 127.N.0.x).
FINE_IP, SLOW_IP = f"127.{SESSION_OCTET}.1.2", f"127.{SESSION_OCTET}.1.3"


def _pod(name: str, training: str, ip: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": {"gpuop.io/gputraining": training}},
        "status": {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]},
    }


class _Cluster:
    in_cluster = False

    def list_training_pods(self, namespace: str) -> list[dict[str, Any]]:
        return [_pod("fine-master-0", "fine", FINE_IP), _pod("slow-master-0", "slow", SLOW_IP)]


def test_a_pod_that_answers_a_byte_at_a_time_costs_only_its_own_figures() -> None:
    fine = MetricsServer(METRICS_PORT, addr=FINE_IP)
    fine.update(RUNNING)
    slow = DribblingTrainer(SLOW_IP)
    reader = PodReader(
        _Cluster(),  # type: ignore[arg-type]
        OperatorSettings(scrape_timeout_seconds=1.0, scrape_via="pod-ip"),
        OperatorMetrics(),
    )
    observed: dict[str, Any] = {}
    tick = threading.Thread(
        target=lambda: observed.update(reader.observe({NAMESPACE: ["fine", "slow"]})[NAMESPACE] or {})
    )
    try:
        started = time.monotonic()
        tick.start()
        tick.join(timeout=30)  # the slow pod alone would take 100,000 x 0.1 s
        took = time.monotonic() - started
        assert not tick.is_alive(), "the scrape waited for the pod that answers a byte at a time"
        assert took < 5.0, took  # one scrape timeout (1 s) and the cut, with room for a loaded machine
        [fine_pod] = observed["fine"]
        assert fine_pod.metrics is not None
        assert fine_pod.metrics.step == RUNNING.step
        [slow_pod] = observed["slow"]
        assert slow_pod.metrics is None  # no figures this tick, and the pod is still observed
        assert slow_pod.name == "slow-master-0"
        # Its connection was cut at the deadline: no scrape thread is left reading it.
        assert slow.cut.wait(5), "the slow pod's connection was never closed"
    finally:
        reader.close()
        slow.close()
        fine.close()


class _Namespaces:
    """Two namespaces, each with one training whose pod answers a byte at a time."""

    in_cluster = False

    def list_training_pods(self, namespace: str) -> list[dict[str, Any]]:
        ip = {"team-a": SLOW_IP, "team-b": OTHER_SLOW_IP}[namespace]
        pod = _pod("slow-master-0", "slow", ip)
        pod["metadata"]["namespace"] = namespace
        return [pod]


OTHER_SLOW_IP = f"127.{SESSION_OCTET}.1.4"


def test_a_tick_waits_one_scrape_timeout_however_many_namespaces() -> None:
    slow = [DribblingTrainer(SLOW_IP), DribblingTrainer(OTHER_SLOW_IP)]
    reader = PodReader(
        _Namespaces(),  # type: ignore[arg-type]
        OperatorSettings(scrape_timeout_seconds=2.0, scrape_via="pod-ip"),
        OperatorMetrics(),
    )
    try:
        started = time.monotonic()
        observed = reader.observe({"team-a": ["slow"], "team-b": ["slow"]})
        took = time.monotonic() - started
        # One deadline for both, not one a namespace (4 s); the rest is room for a loaded machine.
        assert 2.0 <= took < 4.0, took
        assert [p.metrics for ns in ("team-a", "team-b") for p in (observed[ns] or {})["slow"] or ()] == [
            None,
            None,
        ]
    finally:
        reader.close()
        for server in slow:
            server.close()


def test_an_answer_closed_before_its_length_gives_no_figures() -> None:
    """``gputrain_step 1234`` cut to ``gputrain_step 12`` would read as a step back."""
    whole = b"gputrain_total_steps 5000\ngputrain_step 1234\n"

    def answer_half(connection: socket.socket) -> None:
        connection.recv(4096)
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(whole) + whole[:-4])

    server = TcpServer((FINE_IP, METRICS_PORT), answer_half, "half-answer")
    reader = PodReader(
        _Cluster(),  # type: ignore[arg-type]
        OperatorSettings(scrape_timeout_seconds=1.0, scrape_via="pod-ip"),
        OperatorMetrics(),
    )
    try:
        [fine_pod] = (reader.observe({NAMESPACE: ["fine"]})[NAMESPACE] or {})["fine"] or ()
        assert fine_pod.metrics is None
    finally:
        reader.close()
        server.close()
