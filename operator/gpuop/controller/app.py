"""``gpuop operator``: the watches, the scrape tick, metrics and health, wired to the reconciler.

Watch events only go to :class:`~gpuop.controller.reconciler.Reconciler`. Kopf watches the
GpuTrainings (with the per-object serialisation of their events) and serves the liveness
endpoint; the jobs are watched by :mod:`~gpuop.controller.jobwatch`, at a fraction of Kopf's
cost per event. Which replica acts is a Lease's to say (:mod:`~gpuop.controller.lease`).

No finalizer: the PyTorchJob (or TrainJob and its TrainingRuntime) carries an ownerReference
with ``controller: true``, so the API server's garbage collector deletes it (and the pods and
services Kubeflow made under it) when the GpuTraining goes. Nothing the operator makes lives
outside that tree, so there is nothing a finalizer would have to clean, and none would only delay deletion
whenever the operator is down.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import random
import signal
import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import kopf

from gpuop.api.identity import GROUP, PLURAL, VERSION
from gpuop.backends.registry import APIS
from gpuop.backends.reportwiring import ReportEndpoint
from gpuop.controller import jobwatch, reportproc
from gpuop.controller.kube import Kube
from gpuop.controller.lease import LeaderLease
from gpuop.controller.reconciler import Reconciler
from gpuop.controller.settings import OperatorSettings, SettingsError
from gpuop.controller.telemetry import OperatorMetrics
from gpuop.observing import endpoint

log = logging.getLogger(__name__)


def own_identity() -> str:
    """This replica's name as the Lease's holder: the pod name in a cluster (POD_ID), else
    host/pid and a random suffix."""
    return os.environ.get("POD_ID") or f"{socket.gethostname()}/{os.getpid()}/{random.randrange(16**6):06x}"


def leader_lease(kube: Kube, settings: OperatorSettings, identity: str) -> LeaderLease | None:
    """The Lease this replica leads by (:mod:`~gpuop.controller.lease`), or None: standalone,
    said with a WARNING unless asked for (--standalone)."""
    if settings.lease_namespace is None:
        if not settings.standalone:
            log.warning(
                "no Lease namespace (--lease-namespace / GPUOP_LEASE_NAMESPACE, or POD_NAMESPACE in a pod): "
                "running standalone, so run one replica only; pass --standalone to say this is intended"
            )  # fmt: skip
        return None
    # In a pod (POD_ID is its name, the chart's downward API) the leader labels it for reports.
    return LeaderLease(kube, settings.lease_namespace, settings.lease_name, identity,
                       pod=os.environ.get("POD_ID") or None)  # fmt: skip


class ApiRetries:
    """The pauses between retries of a failed API call, for Kopf's own calls (its watches).

    Patient while running: 32.5 s in all rides out an API server restart or a 403 while RBAC
    is being rolled out. Short once the operator is stopping: ``helm uninstall`` deletes the
    Deployment and the RBAC at the same moment, and a watch's last retries would otherwise
    outlast the pod's 30 s grace period and be SIGKILLed.
    """

    RUNNING: Final = (0.5, 1.0, 2.0, 3.0, 5.0, 8.0, 13.0)
    STOPPING: Final = (0.5, 1.0)

    def __init__(self) -> None:
        self.stopping = False

    def _now(self) -> tuple[float, ...]:
        return self.STOPPING if self.stopping else self.RUNNING

    def __iter__(self) -> Iterator[float]:  # Kopf reads it anew for every request
        return iter(self._now())

    def __len__(self) -> int:  # Kopf's "attempt #2/8" in its log lines
        return len(self._now())


async def _take_over_signals(ready: asyncio.Event, stop: asyncio.Event, retries: ApiRetries) -> None:
    """Once Kopf has started, SIGTERM and SIGINT are ours: each cuts the API retries short, then
    raises the stop flag Kopf watches, which stops it as its own handler would.

    Kopf installs its handlers while it starts, and a loop keeps one handler per signal, so ours
    go in after Kopf's ready flag (its startup handlers done, which come after its signal
    handlers). Only the main thread may own signals (tests run operators in threads).
    """
    await ready.wait()
    if threading.current_thread() is not threading.main_thread():
        return
    loop = asyncio.get_running_loop()

    def stopping(signum: int) -> None:
        log.info("%s received: stopping (failed API calls are retried for 1.5 s at most now)",
                 signal.Signals(signum).name)  # fmt: skip
        retries.stopping = True
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping, signum)


class NoDiffBase(kopf.DiffBaseStorage):
    """Kopf's diff base, kept nowhere: the operator has no on.create/on.update handlers, whose
    diffs are all it is for. Kopf still builds one per watch event (a deep copy of the object,
    and a second one to strip its own progress marks) unless the storage gives none: 15% of
    py-spy's busy samples of the operator in a burst of 1,000 new trainings
    (bench/operator_scale.py against a real API server)."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> Any:
        return None

    def fetch(self, *, body: kopf.Body) -> None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: Any) -> None:
        return None


def build_registry(
    reconciler: Reconciler, settings: OperatorSettings, retries: ApiRetries
) -> kopf.OperatorRegistry:
    """The Kopf handlers, on a registry of their own (tests run several operators)."""
    registry = kopf.OperatorRegistry()

    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
    def training_event(event: kopf.RawEvent, **_: Any) -> None:
        reconciler.training_event(event.get("type"), dict(event["object"]))

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        # Kopf's own watches are let in as the operator's calls are: the same credentials, and
        # the token as it is now (Kopf asks again when the API server answers 401).
        given = reconciler.kube.credentials
        # A proxy only where the kubeconfig names one: the Kopf versions we support before its
        # proxy_url field take the rest.
        proxy: dict[str, Any] = {"proxy_url": given.proxy} if given.proxy else {}
        return kopf.ConnectionInfo(
            server=given.server, ca_path=given.ca_file, insecure=given.insecure, token=given.bearer(),
            scheme="Bearer" if given.token is not None else None, certificate_path=given.cert_file,
            private_key_path=given.key_file, default_namespace=given.namespace, **proxy,
        )  # fmt: skip

    @kopf.on.startup(registry=registry)
    async def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.posting.enabled = False  # our own events only, one per transition
        settings.persistence.diffbase_storage = NoDiffBase()
        settings.execution.max_workers = reconciler.settings.max_workers
        settings.watching.server_timeout = 300
        settings.watching.client_timeout = 330
        settings.networking.error_backoffs = retries
        # Watching given namespaces must need no cluster-scoped permission at all (the chart's
        # Role mode): Kopf's scanning would list namespaces and watch CRDs cluster-wide. Kopf
        # watches only our own CRD, installed before the operator; the jobs' watch (jobwatch)
        # finds a job API installed later by itself.
        settings.scanning.disabled = bool(reconciler.settings.namespaces)

    @kopf.on.probe(id="tracked", registry=registry)
    def tracked(**_: Any) -> int:
        return reconciler.tracked()

    return registry


async def _close_when_stopping(
    stop: asyncio.Event, jobs: jobwatch.JobWatch, reconciler: Reconciler, lease: LeaderLease | None
) -> None:
    """As the operator begins to stop: the jobs' watch and the reconcile workers end, and only
    then is the Lease given up, so a replica that takes over at once never meets this one's
    reconciles."""
    await stop.wait()
    await asyncio.to_thread(jobs.close)
    await asyncio.to_thread(reconciler.stop)
    if lease is not None:
        await asyncio.to_thread(lease.release)


async def _tick_forever(reconciler: Reconciler, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        try:
            await asyncio.to_thread(reconciler.tick)
        except Exception:  # one bad tick must not end the scraping for good
            log.exception("scrape tick failed")


def _leasing(
    lease: LeaderLease, reconciler: Reconciler, stop: asyncio.Event, lost: threading.Event
) -> threading.Thread:
    """The Lease's thread, not yet started: leading, it queues every training (take_over);
    losing the Lease, it sets ``lost`` and stops the operator, whose pod restarts as a standby."""
    loop = asyncio.get_running_loop()

    def on_lost() -> None:
        lost.set()
        loop.call_soon_threadsafe(stop.set)

    lease.on_lead, lease.on_lost = reconciler.take_over, on_lost
    return threading.Thread(target=lease.run, name="lease", daemon=True)


async def serve(settings: OperatorSettings, kube: Kube, stop: asyncio.Event | None = None) -> int:
    """Run until cancelled (or ``stop`` is set): Kopf, the Lease and the scrape tick side by
    side. The exit status: 1 when the Lease was lost (the pod restarts and stands by), else 0."""
    metrics = OperatorMetrics()
    kube.requests.listeners.append(metrics.api_request)
    lease = leader_lease(kube, settings, own_identity())
    report_endpoint, receiver = _report_endpoint(settings, metrics)
    reconciler = Reconciler(
        kube, settings, metrics, leading=lease.leading if lease is not None else lambda: True,
        report_endpoint=report_endpoint, reports=receiver.book if receiver is not None else None,
    )  # fmt: skip
    retries = ApiRetries()
    registry = build_registry(reconciler, settings, retries)
    # Both job APIs, whichever the cluster serves: one not served is looked for again
    # (jobwatch.NOT_SERVED_RETRY_SECONDS).
    jobs = jobwatch.JobWatch(
        kube, [(api.api_version, api.plural) for api in APIS.values()], settings.namespaces,
        reconciler.job_event, settings.max_workers,
    )  # fmt: skip
    stop = stop if stop is not None else asyncio.Event()
    ready = asyncio.Event()
    lost = threading.Event()
    leasing = _leasing(lease, reconciler, stop, lost) if lease is not None else None
    if settings.metrics_port:
        metrics.serve(settings.metrics_port)
    liveness = f"http://0.0.0.0:{settings.health_port}/healthz" if settings.health_port else None
    ticker = asyncio.create_task(_tick_forever(reconciler, settings.scrape_interval_seconds))
    signals = asyncio.create_task(_take_over_signals(ready, stop, retries))
    jobs_stop = asyncio.create_task(_close_when_stopping(stop, jobs, reconciler, lease))
    try:
        reconciler.start()
        jobs.start()
        if leasing is not None:
            leasing.start()
        # Kopf only watches the GpuTrainings, in every replica (a standby keeps its table
        # current); which replica acts is the Lease's to say, not Kopf's peering.
        await kopf.operator(
            registry=registry,
            standalone=True,
            clusterwide=not settings.namespaces,
            namespaces=settings.namespaces,
            liveness_endpoint=liveness,
            stop_flag=stop,
            ready_flag=ready,
        )
    finally:
        for task in (ticker, signals):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        stop.set()
        await jobs_stop  # the jobs' watch and the workers stopped, the Lease given up
        reconciler.close()
        if receiver is not None:
            receiver.close()
    return 1 if lost.is_set() else 0


def _report_endpoint(
    settings: OperatorSettings, metrics: OperatorMetrics
) -> tuple[ReportEndpoint | None, reportproc.ReportProcess | None]:
    """The progress-report endpoint, started in a process of its own, and what trainers are
    told of it; none without --report-url. A certificate that cannot be read stops the start
    with one line."""
    if settings.report_url is None:
        return None, None
    tls_dir = Path(settings.report_tls_dir) if settings.report_url.startswith("https:") else None
    no_tls = (
        f"--report-tls-dir / GPUOP_REPORT_TLS_DIR: cannot serve HTTPS from {settings.report_tls_dir} "
        "({}); it needs tls.crt, tls.key and ca.crt"
    )
    try:
        ca = endpoint.ca_bundle(tls_dir) if tls_dir is not None else ""
    except (OSError, ssl.SSLError) as exc:
        raise SettingsError(no_tls.format(exc)) from None

    def counted(outcome: str, seconds: float) -> None:
        metrics.reports.labels(outcome=outcome).inc()
        metrics.report_latency.observe(seconds)

    config = reportproc.ReportConfig(
        port=settings.report_port, tls_dir=tls_dir, limits=endpoint.Limits(),
        log_json=settings.log_format == "json", verbose=settings.verbose,
    )  # fmt: skip
    process = reportproc.ReportProcess(config, endpoint.ReportBook(), counted, metrics.api_request)
    try:
        process.start()
    except reportproc.ReportStartError as exc:
        if exc.what == "tls":
            raise SettingsError(no_tls.format(exc)) from None
        if exc.what == "port":
            raise SettingsError(
                f"--report-port / GPUOP_REPORT_PORT: cannot listen on {settings.report_port} ({exc}); "
                "choose a free port"
            ) from None
        raise SettingsError(f"the progress-report endpoint: {exc}") from None
    log.info("progress reports: listening on :%d, trainers told %s", process.port, settings.report_url)
    return ReportEndpoint(base_url=settings.report_url, ca_pem=ca), process


# Collector generation-1 passes between full collections (Python's default: 10). A full collection
# walks every object the operator keeps, 1,000 trainings' bodies and jobs included: in a burst
# of 1,000 (bench/operator_scale.py) there were 13 of them, 1.2 of the operator's 8.9 CPU-s. With
# 100, and the heap that start-up left frozen, there was one. The cost: cyclic garbage that
# outlived two younger collections waits longer (peak RSS 193-202 MB against 177-183 MB).
FULL_COLLECTION_EVERY: Final = 100


def settle_the_heap() -> None:
    """Leave what start-up made (modules, Kopf, the client: about 80,000 objects) out of every
    collection from now on, and make full collections rarer (:data:`FULL_COLLECTION_EVERY`).
    Objects are still freed as their last reference goes; this only spaces out the search for
    cycles."""
    gc.collect()
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    # Python 3.14's incremental collector has no third threshold and ignores it; the image is 3.11.
    gc.set_threshold(young, middle, FULL_COLLECTION_EVERY)


def run_operator(settings: OperatorSettings) -> int:
    """The ``gpuop operator`` command."""
    kopf.configure(
        verbose=settings.verbose,
        log_format=kopf.LogFormat.JSON if settings.log_format == "json" else kopf.LogFormat.FULL,
    )
    if not settings.verbose:
        # Kopf logs every handler call at INFO: a line per watch event is noise at scale.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    # Connections for the reconcile workers, the job events' pool (jobwatch: leadership and
    # a DELETED's check) and the scrape tick's pod reads, each up to max_workers at once, as
    # many again to spare, the 8 Event posters (statuswriter), the tick, and the jobs' watches,
    # one per job API and namespace: a pool smaller than that opens and drops a TLS connection
    # per request beyond it in a burst.
    streams = len(APIS) * max(1, len(settings.namespaces))  # each holds its connection
    kube = Kube.login(pool_size=settings.max_workers * 4 + 10 + streams)
    log.info(
        "gpu-training-operator: watching %s, trainer image %s, scraping every %gs via %s",
        ", ".join(settings.namespaces) or "all namespaces",
        settings.trainer_image,
        settings.scrape_interval_seconds,
        "the API server's pod proxy" if settings.scrapes_via_proxy(kube.in_cluster) else "pod IPs",
    )
    settle_the_heap()
    with contextlib.suppress(KeyboardInterrupt):
        return asyncio.run(serve(settings, kube))
    return 0
