"""``gpuop operator``: the watches, the scrape tick, metrics and health, wired to the reconciler.

Watch events only go to :class:`~gpuop.controller.reconciler.Reconciler`. Kopf watches the
GpuTrainings (with the per-object serialisation of their events), and supplies peering between
replicas and the liveness endpoint; the jobs are watched by :mod:`~gpuop.controller.jobwatch`,
at a fraction of Kopf's cost per event.

No finalizer: the PyTorchJob (or TrainJob and its TrainingRuntime) carries an ownerReference
with ``controller: true``, so the API server's garbage collector deletes it (and the pods and
services Kubeflow made under it) when the GpuTraining goes. Nothing the operator makes lives
outside that tree, so there is nothing a finalizer would have to clean, and none would only delay deletion
whenever the operator is down.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import os
import random
import signal
import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

import kopf

from gpuop.api.identity import GROUP, PLURAL, VERSION
from gpuop.backends.registry import APIS
from gpuop.backends.reportwiring import ReportEndpoint
from gpuop.controller import jobwatch, reportproc
from gpuop.controller.apiclient import ApiError
from gpuop.controller.kube import Kube
from gpuop.controller.reconciler import Reconciler
from gpuop.controller.settings import OperatorSettings, SettingsError
from gpuop.controller.telemetry import OperatorMetrics
from gpuop.observing import endpoint, observe

log = logging.getLogger(__name__)


def own_identity() -> str:
    """This replica's peering identity: the pod name in a cluster (POD_ID), else host/pid."""
    return os.environ.get("POD_ID") or f"{socket.gethostname()}/{os.getpid()}/{random.randrange(16**6):06x}"


Leadership = Callable[[], Callable[[str], bool]]


def leadership(kube: Kube, settings: OperatorSettings, identity: str) -> Leadership:
    """Read once per tick: in which namespaces this replica is the active one.

    Kopf keeps one peering per watched namespace (or one cluster-wide) and pauses its watches
    in each where a live peer outranks this replica; the scrape tick and the job events (whose
    watch is not Kopf's) must pause in the same places, or a standby would keep writing status
    there. Each peering object is read once per reading (each tick, and at most every 2 s for
    job events); one that cannot be read counts as not leading (the next reading asks again).
    """
    name = settings.peering_name
    if name is None:
        return lambda: lambda _namespace: True

    def active(namespace: str | None) -> bool:
        try:
            status = kube.get_peering(name, namespace)
        except ApiError as exc:
            log.warning("reading peering %s in %s: %s; not acting there until it is read", name,
                        namespace or "the cluster", exc)  # fmt: skip
            return False
        return observe.peering_active(status, identity, settings.priority)

    def read() -> Callable[[str], bool]:
        if not settings.namespaces:
            everywhere = active(None)
            return lambda _namespace: everywhere
        verdicts = {namespace: active(namespace) for namespace in settings.namespaces}
        return lambda namespace: verdicts.get(namespace, False)

    return read


PEERING_RECHECK_SECONDS: Final = 60.0


def _missing_peerings(kube: Kube, settings: OperatorSettings) -> list[str]:
    """The peering objects Kopf will wait for that do not exist ("ClusterKopfPeering/NAME",
    "KopfPeering/NAME in NS"). An object that cannot be read (403) counts as there: Kopf
    will say so itself, and guessing would be worse."""
    name = settings.peering_name
    assert name is not None
    missing = []
    for namespace in settings.namespaces or (None,):
        try:
            found = kube.find_peering(name, namespace)
        except ApiError as exc:
            log.warning("reading the peering object %s: %s", name, exc)
            continue
        if found is None:
            missing.append(
                f"KopfPeering/{name} in {namespace}" if namespace else f"ClusterKopfPeering/{name}"
            )
    return missing


def check_peering(kube: Kube, settings: OperatorSettings) -> OperatorSettings:
    """Before Kopf starts: the settings to run with, and a WARNING when peering cannot work.

    Kopf with a named peering pauses every watch until the peering object exists, and says so
    only at DEBUG: an operator that silently does nothing. So a missing object (or its CRD)
    is said at WARNING with the fix; when nobody asked for peering by name, the operator
    runs standalone instead, as Kopf itself does when its default peering is absent.
    """
    if settings.peering_name is None:
        return settings
    missing = _missing_peerings(kube, settings)
    if not missing:
        return settings
    if not settings.peering_required:
        log.warning(
            "no %s (Kopf's peering CRDs and object come with the Helm chart): running standalone, "
            "so run one replica only; install the chart for peering between replicas, or pass "
            "--standalone to say this is intended", ", ".join(missing),
        )  # fmt: skip
        return dataclasses.replace(settings, peering_name=None)
    log.warning(_WAITING, ", ".join(missing), settings.peering_name)
    return settings


_WAITING: Final = (
    "waiting for %s: peering %r is required (--peering / GPUOP_PEERING), and Kopf pauses every "
    "GpuTraining until that object exists. Install the chart's peering CRDs and object (helm "
    "install, or kubectl apply -f charts/gpu-training-operator/crds/ and create the object), "
    "or run a single replica with --standalone"
)


async def _warn_while_peering_missing(kube: Kube, settings: OperatorSettings) -> None:
    """Repeat the WARNING every minute while a required peering object is still missing."""
    while settings.peering_required and settings.peering_name is not None:
        await asyncio.sleep(PEERING_RECHECK_SECONDS)
        missing = await asyncio.to_thread(_missing_peerings, kube, settings)
        if not missing:
            log.info("peering object %s found: Kopf resumes", settings.peering_name)
            return
        log.warning(_WAITING, ", ".join(missing), settings.peering_name)


class ApiRetries:
    """The pauses between retries of a failed API call, for Kopf's own calls (watches, peering).

    Patient while running: 32.5 s in all rides out an API server restart or a 403 while RBAC
    is being rolled out. Short once the operator is stopping: ``helm uninstall`` deletes the
    Deployment and the RBAC at the same moment, and Kopf's last call (leaving its peering)
    would otherwise retry its 403 past the pod's 30 s grace period and be SIGKILLed.
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
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # Kopf's own watches log in the same way as gpuop.controller.kube: in-cluster, else kubeconfig.
        return kopf.login_via_client(**kwargs)

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


async def _close_when_stopping(stop: asyncio.Event, jobs: jobwatch.JobWatch, reconciler: Reconciler) -> None:
    """The jobs' watch and the reconcile workers end as the operator begins to stop, not after
    Kopf has left its peering: a replica that takes over then must not meet this one's
    reconciles."""
    await stop.wait()
    await asyncio.to_thread(jobs.close)
    await asyncio.to_thread(reconciler.stop)


async def _tick_forever(reconciler: Reconciler, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        try:
            await asyncio.to_thread(reconciler.tick)
        except Exception:  # one bad tick must not end the scraping for good
            log.exception("scrape tick failed")


async def serve(settings: OperatorSettings, kube: Kube, stop: asyncio.Event | None = None) -> None:
    """Run until cancelled (or ``stop`` is set): Kopf and the scrape tick side by side."""
    settings = await asyncio.to_thread(check_peering, kube, settings)
    metrics = OperatorMetrics()
    kube.requests.listeners.append(metrics.api_request)
    identity = own_identity()
    report_endpoint, receiver = _report_endpoint(settings, metrics)
    reconciler = Reconciler(
        kube, settings, metrics, leadership=leadership(kube, settings, identity),
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
    if settings.metrics_port:
        metrics.serve(settings.metrics_port)
    liveness = f"http://0.0.0.0:{settings.health_port}/healthz" if settings.health_port else None
    ticker = asyncio.create_task(_tick_forever(reconciler, settings.scrape_interval_seconds))
    peering_warnings = asyncio.create_task(_warn_while_peering_missing(kube, settings))
    signals = asyncio.create_task(_take_over_signals(ready, stop, retries))
    jobs_stop = asyncio.create_task(_close_when_stopping(stop, jobs, reconciler))
    try:
        reconciler.start()
        jobs.start()
        await kopf.operator(
            registry=registry,
            identity=identity,  # type: ignore[arg-type]  # kopf's NewType over str, not exported
            standalone=settings.peering_name is None,
            peering_name=settings.peering_name,
            priority=settings.priority,
            clusterwide=not settings.namespaces,
            namespaces=settings.namespaces,
            liveness_endpoint=liveness,
            stop_flag=stop,
            ready_flag=ready,
        )
    finally:
        for task in (ticker, peering_warnings, signals, jobs_stop):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await asyncio.to_thread(jobs.close)
        reconciler.close()
        if receiver is not None:
            receiver.close()


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
        asyncio.run(serve(settings, kube))
    return 0
