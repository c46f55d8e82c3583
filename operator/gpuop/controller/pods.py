"""Reading the training pods: one list per namespace per tick, each running trainer's metrics
scraped concurrently, their GPUs as dcgm-exporter sees them (any image; :mod:`gpusource`), and
the termination messages of a finished job's pods. Blocking calls.

A pod's answer is untrusted input (any user's image serves it): it is read bounded in size
and in time, parsed by :mod:`gpuop.observing.scrape`, and any failure means no figures for
that pod this tick. The time bound is the whole tick's, not a socket read's: a pod that sends
a byte a second never waits out a per-read timeout, and would hold every training's status.
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import socket
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Final

from gpuop._kits.deadlines import Deadlines
from gpuop.api.spec import GpuTraining
from gpuop.controller.gpusource import DcgmSource
from gpuop.controller.kube import ApiError, Kube
from gpuop.controller.settings import OperatorSettings
from gpuop.controller.telemetry import OperatorMetrics
from gpuop.observing import dcgm, observe
from gpuop.observing.records import PodObservation
from gpuop.observing.scrape import MAX_METRICS_BYTES, GpuFigures, TrainerMetrics, parse_metrics
from gputrain.contract import METRICS_PORT

log = logging.getLogger(__name__)

_EXPORTERS_EVERY_SECONDS: Final = 30.0
# What a tick waits past the scrape timeout for a scrape to end: the cut-off is a socket's
# shutdown, done at once, then the reading thread's exception.
_CUT_GRACE_SECONDS: Final = 0.2


class PodReader:
    """The training pods of a namespace, observed; metrics requests in a pool of their own."""

    def __init__(self, kube: Kube, settings: OperatorSettings, metrics: OperatorMetrics) -> None:
        self.kube = kube
        self.settings = settings
        self.metrics = metrics
        self._pool = ThreadPoolExecutor(settings.max_workers, thread_name_prefix="scrape")
        self._deadlines = Deadlines("scrape-deadlines")
        self._via_proxy = settings.scrapes_via_proxy(kube.in_cluster)
        self._gpus: DcgmSource | None = None
        if settings.gpu_metrics != "none":
            self._gpus = DcgmSource(
                prometheus_url=settings.gpu_metrics_prometheus_url
                if settings.gpu_metrics == "prometheus"
                else None,
                timeout_seconds=settings.scrape_timeout_seconds,
                count=lambda outcome: metrics.scrapes.labels(outcome=f"dcgm_{outcome}").inc(),
            )
        self._exporters_read_at: float | None = None

    def observe_namespace(
        self, namespace: str, names: Sequence[str]
    ) -> dict[str, tuple[PodObservation, ...] | None]:
        """Per training name, its pods with their scraped figures (None: reading them failed,
        keep what was seen). Raises ApiError when the pods cannot be listed.

        Metrics requests run concurrently, all within one scrape timeout: a pod whose answer is
        not whole by then gives no figures this tick, and costs the others nothing.
        """
        by_training: dict[str, list[dict[str, Any]]] = {}
        for pod in self.kube.list_training_pods(namespace):
            owner = observe.training_of(pod)
            if owner is not None:
                by_training.setdefault(owner, []).append(pod)
        deadline = time.monotonic() + self.settings.scrape_timeout_seconds
        futures = {
            name: [(pod, self._pool.submit(self._scrape, pod, deadline)) for pod in by_training.get(name, [])]
            for name in names
        }
        gpus = self._exporter_gpus(namespace, [p for name in names for p in by_training.get(name, [])])
        observed: dict[str, tuple[PodObservation, ...] | None] = {}
        for name in names:
            try:
                observed[name] = tuple(
                    observe.pod_observation(
                        pod, self._by(deadline, f), gpus.get(str(pod["metadata"].get("name")))
                    )
                    for pod, f in futures[name]
                )
            except Exception:  # one training's odd pods must not stop the others' scrape
                log.exception("gputraining %s/%s: reading its pods failed", namespace, name)
                observed[name] = None
        return observed

    def _by(self, deadline: float, scraped: Future[TrainerMetrics | None]) -> TrainerMetrics | None:
        """A scrape's figures, or None when it is not done by the deadline (with a moment's grace
        for the cut-off itself): the through-the-API-server path has no socket of ours to cut, and
        a pool busy with slow pods must not stall the tick either."""
        try:
            return scraped.result(timeout=max(0.0, deadline - time.monotonic()) + _CUT_GRACE_SECONDS)
        except FutureTimeout:
            return None  # counted as an error by the scrape itself when it ends

    def _exporter_gpus(self, namespace: str, pods: list[dict[str, Any]]) -> dict[str, tuple[GpuFigures, ...]]:
        """The running pods' GPUs as dcgm-exporter sees them ({} when not configured or not read)."""
        running = [str(p["metadata"].get("name")) for p in pods if observe.pod_ip(p) is not None]
        if self._gpus is None or not running:
            return {}
        if self.settings.gpu_metrics == "dcgm-exporter":
            self._refresh_exporters()
        return self._gpus.read({namespace: running}).get(namespace, {})

    def _refresh_exporters(self) -> None:
        """The exporters behind their Service, asked again every 30 s: GPU nodes come and go
        rarely, and one GET a tick for a list that seldom changes is load for nothing."""
        now = time.monotonic()
        if self._exporters_read_at is not None and now - self._exporters_read_at < _EXPORTERS_EVERY_SECONDS:
            return
        self._exporters_read_at = now
        assert self._gpus is not None
        namespace, _, name = self.settings.dcgm_exporter_service.partition("/")
        try:
            endpoints = self.kube.get_endpoints(namespace, name)
        except ApiError as exc:
            log.warning("reading dcgm-exporter's endpoints %s: %s", self.settings.dcgm_exporter_service, exc)
            return
        if endpoints is None:
            log.debug(
                "no dcgm-exporter Service %s: no GPU figures for custom images",
                self.settings.dcgm_exporter_service,
            )
        self._gpus.set_exporters(dcgm.exporter_urls(endpoints or {}))

    def final(self, training: GpuTraining) -> tuple[PodObservation, ...]:
        """The job's pods as they ended: their termination messages hold the trainers' records."""
        pods = [
            pod
            for pod in self.kube.list_training_pods(training.namespace or "default")
            if observe.training_of(pod) == training.name
        ]
        return tuple(observe.pod_observation(p, None) for p in pods)

    def _scrape(self, pod: Mapping[str, Any], deadline: float) -> TrainerMetrics | None:
        ip = observe.pod_ip(pod)
        if ip is None:
            return None
        meta = pod.get("metadata") or {}
        try:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no time left in this tick's scrape")
            if self._via_proxy:
                text = self.kube.pod_metrics_via_proxy(
                    str(meta.get("namespace")), str(meta.get("name")), METRICS_PORT, left
                )
            else:
                text = self._get_metrics(ip, deadline)
            metrics = parse_metrics(text)
        except Exception as exc:
            # Not serving yet (starting, loading data), gone, too slow, or serving anything at
            # all: a pod's answer is untrusted input, and any failure means no figures this tick.
            log.debug("scraping %s: %s", meta.get("name"), exc)
            self.metrics.scrapes.labels(outcome="error").inc()
            return None
        self.metrics.scrapes.labels(outcome="ok").inc()
        return metrics

    def _get_metrics(self, ip: str, deadline: float) -> str:
        """GET /metrics from the pod, whole by ``deadline`` or cut off then (its socket shut
        down by the deadline thread, so a read in progress ends at once)."""
        connection = http.client.HTTPConnection(
            ip, METRICS_PORT, timeout=max(0.01, deadline - time.monotonic())
        )
        try:
            connection.connect()
            sock = connection.sock
            cut = self._deadlines.after(deadline - time.monotonic(), lambda: _shut(sock))
            try:
                connection.request("GET", "/metrics")
                reply = connection.getresponse()
                # One byte past the bound is enough to refuse it: no pod makes us read more.
                body = reply.read(MAX_METRICS_BYTES + 1)
            finally:
                self._deadlines.cancel(cut)
            if time.monotonic() >= deadline:
                raise TimeoutError("the answer was not whole within the scrape timeout")
            if reply.status != 200:
                raise OSError(f"HTTP {reply.status}")
            return body.decode("utf-8", errors="replace")
        finally:
            connection.close()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._deadlines.stop()
        if self._gpus is not None:
            self._gpus.close()


def _shut(sock: socket.socket | None) -> None:
    """The deadline thread's cut: a shutdown wakes a read blocked on the socket (close would not)."""
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
