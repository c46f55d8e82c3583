"""Reading the training pods: one list per namespace per tick, each running trainer's metrics
scraped concurrently, their GPUs as dcgm-exporter sees them (any image; :mod:`gpusource`), the
nodes of the pods that may have been lost with them (:mod:`gpuop.observing.nodeloss`), and the
termination messages of a finished job's pods. Blocking calls.

A pod's answer is untrusted input (any user's image serves it): it is read bounded in size
and in time, parsed by :mod:`gpuop.observing.scrape`, and any failure means no figures for
that pod this tick. The time bound is the whole tick's, not a socket read's: a pod that sends
a byte a second never waits out a per-read timeout, and would hold every training's status.
Through the API server's pod proxy (the operator outside the cluster) there is no socket of
ours to cut: such a pod keeps one scrape thread until the API server ends the stream, while
the tick goes on without it and the pod is not asked again meanwhile.
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Final

from gpuop._kits.deadlines import Deadlines
from gpuop.api.spec import GpuTraining
from gpuop.controller.apiclient import ApiError
from gpuop.controller.gpusource import DcgmSource
from gpuop.controller.kube import Kube
from gpuop.controller.settings import OperatorSettings
from gpuop.controller.telemetry import OperatorMetrics
from gpuop.observing import dcgm, nodeloss, observe
from gpuop.observing.records import NodeLoss, PodObservation
from gpuop.observing.scrape import MAX_METRICS_BYTES, GpuFigures, TrainerMetrics, parse_metrics
from gputrain.contract import METRICS_PORT

log = logging.getLogger(__name__)

_EXPORTERS_EVERY_SECONDS: Final = 30.0
# What a tick waits past the scrape timeout for a scrape to end: the cut-off is a socket's
# shutdown, done at once, then the reading thread's exception.
_CUT_GRACE_SECONDS: Final = 0.2
# Seconds a Node's reading is used again, across ticks: a node is lost for minutes, not seconds,
# and a gang starting on many nodes (its pods not ready yet) would read each every tick.
_NODE_FRESH_SECONDS: Final = 10.0


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
        self._lock = threading.Lock()
        self._reading: set[str] = set()  # pods a scrape is reading now (namespace/name)
        self._late: set[str] = set()  # pods whose last scrape gave no figures
        # Node name -> (its loss or None, when read (monotonic)); the tick's thread alone uses it.
        self._nodes: dict[str, tuple[NodeLoss | None, float]] = {}

    def observe(
        self, active: Mapping[str, Sequence[str]]
    ) -> dict[str, dict[str, tuple[PodObservation, ...] | None] | None]:
        """Per namespace, per training name of ``active``, its pods with their figures (None for
        a training: reading them failed, keep what was seen; None for a namespace: its pods
        could not be listed, said in the log).

        One pod list per namespace; then every pod's metrics at once, all within one scrape
        timeout however many namespaces: a pod whose answer is not whole by then gives no
        figures this tick. A pod still being read from an earlier tick is not asked again (it
        holds one thread at most), and the pods that were late last time are asked last, so a
        tenant's slow pods delay each other, not everyone's.
        """
        listed: dict[str, dict[str, list[dict[str, Any]]]] = {}
        for namespace, names in active.items():
            try:
                pods = self.kube.list_training_pods(namespace)
            except ApiError as exc:
                log.warning("listing training pods in %s: %s", namespace, exc)
                continue
            wanted = set(names)
            listed[namespace] = {}
            for pod in pods:
                owner = observe.training_of(pod)
                if owner in wanted:
                    listed[namespace].setdefault(owner, []).append(pod)
        deadline = time.monotonic() + self.settings.scrape_timeout_seconds
        queue = sorted(
            (pod for trainings in listed.values() for pods in trainings.values() for pod in pods),
            key=lambda pod: _key(pod) in self._late,  # the punctual first (a stable sort)
        )
        scrapes = {_key(pod): self._submit(pod, deadline) for pod in queue}
        with self._lock:
            self._late &= set(scrapes)  # a pod gone, or no longer active, is forgotten
        gpus = self._exporter_gpus(
            {ns: [p for pods in trainings.values() for p in pods] for ns, trainings in listed.items()}
        )
        losses = self._node_losses(queue)
        observed: dict[str, dict[str, tuple[PodObservation, ...] | None] | None] = {}
        for namespace, names in active.items():
            if namespace not in listed:
                observed[namespace] = None
                continue
            by_name: dict[str, tuple[PodObservation, ...] | None] = {}
            observed[namespace] = by_name
            for name in names:
                try:
                    by_name[name] = tuple(
                        observe.pod_observation(
                            pod,
                            self._result_by(deadline, scrapes[_key(pod)]),
                            gpus.get(namespace, {}).get(str(pod["metadata"].get("name"))),
                            losses.get(nodeloss.suspect_node(pod) or ""),
                        )
                        for pod in listed[namespace].get(name, [])
                    )
                except Exception:  # one training's odd pods must not stop the others' scrape
                    log.exception("gputraining %s/%s: reading its pods failed", namespace, name)
                    by_name[name] = None
        return observed

    def _submit(self, pod: Mapping[str, Any], deadline: float) -> Future[TrainerMetrics | None] | None:
        """The pod's scrape, started; None while one from an earlier tick still reads it."""
        key = _key(pod)
        with self._lock:
            if key in self._reading:
                return None
            self._reading.add(key)
        return self._pool.submit(self._scrape, pod, deadline)

    def _result_by(
        self, deadline: float, scraped: Future[TrainerMetrics | None] | None
    ) -> TrainerMetrics | None:
        """A scrape's figures, or None when it is not done by the deadline (with a moment's grace
        for the cut-off itself): the through-the-API-server path has no socket of ours to cut,
        and a scrape queued behind slow pods must not stall the tick either."""
        if scraped is None:
            return None
        try:
            return scraped.result(timeout=max(0.0, deadline - time.monotonic()) + _CUT_GRACE_SECONDS)
        except FutureTimeout:
            return None  # counted as an error by the scrape itself when it ends

    def _exporter_gpus(
        self, pods: Mapping[str, list[dict[str, Any]]]
    ) -> dict[str, dict[str, tuple[GpuFigures, ...]]]:
        """The running pods' GPUs as dcgm-exporter sees them, per namespace and pod ({} when not
        configured or not read)."""
        running = {
            namespace: names
            for namespace, listed in pods.items()
            if (names := [str(p["metadata"].get("name")) for p in listed if observe.pod_ip(p) is not None])
        }
        if self._gpus is None or not running:
            return {}
        if self.settings.gpu_metrics == "dcgm-exporter":
            self._refresh_exporters()
        return self._gpus.read(running)

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

    def _node_losses(self, pods: Sequence[Mapping[str, Any]]) -> dict[str, NodeLoss]:
        """The lost nodes among those of ``pods`` that may be lost (:func:`nodeloss.suspect_node`),
        by name: one GET per such node, read again after :data:`_NODE_FRESH_SECONDS`. A node that
        cannot be read is not judged this tick."""
        now = time.monotonic()
        wanted = {node for pod in pods if (node := nodeloss.suspect_node(pod)) is not None}
        self._nodes = {name: read for name, read in self._nodes.items() if name in wanted}
        for name in sorted(wanted):
            known = self._nodes.get(name)
            if known is not None and now - known[1] < _NODE_FRESH_SECONDS:
                continue
            try:
                self._nodes[name] = (nodeloss.node_loss(name, self.kube.get_node(name)), now)
            except ApiError as exc:
                self._nodes.pop(name, None)
                log.warning("reading node %s of a training pod that is not ready: %s", name, exc)
        return {name: loss for name, (loss, _) in self._nodes.items() if loss is not None}

    def final(self, training: GpuTraining) -> tuple[PodObservation, ...]:
        """The job's pods as they ended: their termination messages hold the trainers' records."""
        pods = [
            pod
            for pod in self.kube.list_training_pods(training.namespace or "default")
            if observe.training_of(pod) == training.name
        ]
        return tuple(observe.pod_observation(p, None) for p in pods)

    def _scrape(self, pod: Mapping[str, Any], deadline: float) -> TrainerMetrics | None:
        key = _key(pod)
        metrics = None
        try:
            metrics = self._read(pod, deadline)
        finally:
            with self._lock:
                self._reading.discard(key)
                if metrics is None:
                    self._late.add(key)
                else:
                    self._late.discard(key)
        return metrics

    def _read(self, pod: Mapping[str, Any], deadline: float) -> TrainerMetrics | None:
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
            if time.monotonic() >= deadline + _CUT_GRACE_SECONDS:
                raise TimeoutError("answered after the tick had gone on")
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
                with connection.getresponse() as reply:
                    # One byte past the bound is enough to refuse it: no pod makes us read more.
                    body = reply.read(MAX_METRICS_BYTES + 1)
                    short = reply.length  # bytes its Content-Length promised and never sent
            finally:
                self._deadlines.cancel(cut)
            if time.monotonic() >= deadline:
                raise TimeoutError("the answer was not whole within the scrape timeout")
            if reply.status != 200:
                raise OSError(f"HTTP {reply.status}")
            if short:  # closed early: "gputrain_step 1234" cut to "12" would read as a step back
                raise http.client.IncompleteRead(body, short)
            if len(body) > MAX_METRICS_BYTES:  # in bytes: decoding could count fewer characters
                raise ValueError(f"metrics over {MAX_METRICS_BYTES} bytes")
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


def _key(pod: Mapping[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    return f"{meta.get('namespace')}/{meta.get('name')}"
