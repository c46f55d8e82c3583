"""``gpuop operator``: Kopf watches, the scrape tick, metrics and health, wired to the reconciler.

Handlers only forward watch events to :class:`~gpuop.reconcile.Reconciler`; Kopf supplies
the watching, the per-object serialisation of events, peering between replicas and the
liveness endpoint.

No finalizer: the PyTorchJob carries an ownerReference with ``controller: true``, so the
API server's garbage collector deletes it (and the training-operator's pods and services
under it) when the GpuTraining goes. Nothing the operator makes lives outside that tree,
so there is nothing a finalizer would have to clean, and none would only delay deletion
whenever the operator is down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import socket
from collections.abc import Callable
from typing import Any

import kopf

from gpuop import observe
from gpuop.kube import ApiError, Kube
from gpuop.reconcile import Reconciler
from gpuop.render import PYTORCHJOB_API_VERSION, TRAINING_LABEL
from gpuop.settings import OperatorSettings
from gpuop.spec import GROUP, PLURAL, VERSION
from gpuop.telemetry import OperatorMetrics

log = logging.getLogger(__name__)


def own_identity() -> str:
    """This replica's peering identity: the pod name in a cluster (POD_ID), else host/pid."""
    return os.environ.get("POD_ID") or f"{socket.gethostname()}/{os.getpid()}/{random.randrange(16**6):06x}"


Leadership = Callable[[], Callable[[str], bool]]


def leadership(kube: Kube, settings: OperatorSettings, identity: str) -> Leadership:
    """Read once per tick: in which namespaces this replica is the active one.

    Kopf keeps one peering per watched namespace (or one cluster-wide) and pauses its watches
    in each where a live peer outranks this replica; the scrape tick must pause in the same
    places, or a standby would keep writing status there. Each peering object is read once
    per tick; one that cannot be read counts as not leading (the next tick asks again).
    """
    name = settings.peering_name
    if name is None:
        return lambda: lambda _namespace: True

    def active(namespace: str | None) -> bool:
        try:
            status = kube.get_peering(name, namespace)
        except ApiError as exc:
            log.warning("reading peering %s in %s: %s; not scraping there this tick", name,
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


def build_registry(reconciler: Reconciler, settings: OperatorSettings) -> kopf.OperatorRegistry:
    """The Kopf handlers, on a registry of their own (tests run several operators)."""
    registry = kopf.OperatorRegistry()
    group, version = PYTORCHJOB_API_VERSION.split("/")

    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
    def training_event(event: kopf.RawEvent, **_: Any) -> None:
        reconciler.training_event(event.get("type"), dict(event["object"]))

    @kopf.on.event(group, version, "pytorchjobs", labels={TRAINING_LABEL: kopf.PRESENT}, registry=registry)
    def job_event(event: kopf.RawEvent, **_: Any) -> None:
        reconciler.job_event(event.get("type"), dict(event["object"]))

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # Kopf's own watches log in the same way as gpuop.kube: in-cluster, else kubeconfig.
        return kopf.login_via_client(**kwargs)

    @kopf.on.startup(registry=registry)
    async def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.posting.enabled = False  # our own events only, one per transition
        settings.execution.max_workers = reconciler.settings.max_workers
        settings.watching.server_timeout = 300
        settings.watching.client_timeout = 330
        settings.networking.error_backoffs = (0.5, 1, 2, 3, 5, 8, 13)
        # Watching given namespaces must need no cluster-scoped permission at all (the chart's
        # Role mode): Kopf's scanning would list namespaces and watch CRDs cluster-wide. The
        # resources are still found through discovery at start; a CRD installed later (say
        # Kubeflow's) is picked up on the next restart instead of at once.
        settings.scanning.disabled = bool(reconciler.settings.namespaces)

    @kopf.on.probe(id="tracked", registry=registry)
    def tracked(**_: Any) -> int:
        return reconciler.tracked()

    return registry


async def _tick_forever(reconciler: Reconciler, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        try:
            await asyncio.to_thread(reconciler.tick)
        except Exception:  # one bad tick must not end the scraping for good
            log.exception("scrape tick failed")


async def serve(settings: OperatorSettings, kube: Kube, stop: asyncio.Event | None = None) -> None:
    """Run until cancelled (or ``stop`` is set): Kopf and the scrape tick side by side."""
    metrics = OperatorMetrics()
    kube.requests.listeners.append(metrics.api_request)
    identity = own_identity()
    reconciler = Reconciler(kube, settings, metrics, leadership=leadership(kube, settings, identity))
    registry = build_registry(reconciler, settings)
    if settings.metrics_port:
        metrics.serve(settings.metrics_port)
    liveness = f"http://0.0.0.0:{settings.health_port}/healthz" if settings.health_port else None
    ticker = asyncio.create_task(_tick_forever(reconciler, settings.scrape_interval_seconds))
    try:
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
        )
    finally:
        ticker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await ticker
        reconciler.close()


def run(settings: OperatorSettings) -> int:
    """The ``gpuop operator`` command."""
    kopf.configure(
        verbose=settings.verbose,
        log_format=kopf.LogFormat.JSON if settings.log_format == "json" else kopf.LogFormat.FULL,
    )
    if not settings.verbose:
        # Kopf logs every handler call at INFO: a line per watch event is noise at scale.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    kube = Kube.login(pool_size=settings.max_workers * 2)
    log.info(
        "gpu-training-operator: watching %s, trainer image %s, scraping every %gs via %s",
        ", ".join(settings.namespaces) or "all namespaces",
        settings.trainer_image,
        settings.scrape_interval_seconds,
        "the API server's pod proxy" if settings.scrapes_via_proxy(kube.in_cluster) else "pod IPs",
    )
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(settings, kube))
    return 0
