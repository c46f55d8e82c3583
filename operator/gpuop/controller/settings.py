"""How the operator runs: read once at start from flags, else ``GPUOP_*`` env, else defaults.

Flags win over env so that ``kubectl exec ... gpuop operator --log-format text`` overrides
what the Helm chart put in the Deployment's env. A bad value is one line naming the flag,
its env variable and the fix, before anything connects to a cluster.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeVar, cast, get_args

import click

from gpuop.api.identity import DEFAULT_TRAINER_IMAGE

# What every gpuop option's variable starts with (the CLI's other commands' too).
ENV_PREFIX: Final = "GPUOP_"
ScrapeVia = Literal["auto", "pod-ip", "proxy"]
GpuMetrics = Literal["none", "dcgm-exporter", "prometheus"]
_NAMESPACE_RE: Final = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_NAME_RE: Final = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


class SettingsError(Exception):
    """A setting with a value the operator cannot run with; the message says which and why."""


@dataclass(frozen=True, kw_only=True)
class OperatorSettings:
    """Everything ``gpuop operator`` can be told. Checked at construction."""

    namespaces: tuple[str, ...] = ()  # empty: every namespace
    trainer_image: str = DEFAULT_TRAINER_IMAGE
    scrape_interval_seconds: float = 10.0
    scrape_timeout_seconds: float = 3.0
    scrape_via: ScrapeVia = "auto"
    # The Lease the replicas share (gpuop.controller.lease), in their own namespace; with no
    # namespace (outside a pod, none given) or --standalone, this replica acts alone.
    lease_name: str = "gpu-training-operator"
    lease_namespace: str | None = None
    standalone: bool = False  # said on purpose: no warning that there is no Lease
    metrics_port: int = 8080  # 0 disables the operator's own /metrics
    health_port: int = 8081  # 0 disables /healthz
    log_format: Literal["text", "json"] = "text"
    verbose: bool = False
    max_workers: int = 16  # reconcile workers, and the size of each other pool of API calls
    underutilized_percent: float = 30.0
    underutilized_seconds: int = 600
    # The progress-report endpoint (Kubeflow's trainerStatus protocol). Off without a URL: the
    # trainers must be told where to reach it (the chart's Service), and it needs a certificate.
    report_url: str | None = None  # what trainers are given, https://<service>.<ns>.svc:<port>
    report_port: int = 8443
    report_tls_dir: str = "/etc/gpuop/report-tls"  # tls.crt, tls.key, ca.crt
    # GPU figures of any image: NVIDIA's dcgm-exporter on the GPU nodes, read directly (its
    # Service's endpoints) or through a Prometheus-compatible query API that scrapes it.
    gpu_metrics: GpuMetrics = "none"
    dcgm_exporter_service: str = "gpu-operator/nvidia-dcgm-exporter"  # the GPU Operator's
    gpu_metrics_prometheus_url: str | None = None

    def scrapes_via_proxy(self, in_cluster: bool) -> bool:
        """Whether trainer metrics are read through the API server's pod proxy.

        Outside the cluster pod IPs are unreachable; inside, the pod IP spares the API server.
        """
        return self.scrape_via == "proxy" or (self.scrape_via == "auto" and not in_cluster)

    def __post_init__(self) -> None:
        # Each setting checked as the operator starts: one out of range stops it with one line
        # naming the flag, its variable and the fix.
        self._check_scope()
        self._check_network()
        self._check_gpu_figures()

    def _check_scope(self) -> None:
        """What it watches and runs: namespaces, the trainer image, its workers."""
        for namespace in self.namespaces:
            if not _NAMESPACE_RE.match(namespace) or len(namespace) > 63:
                raise SettingsError(
                    f"--namespace / {ENV_PREFIX}NAMESPACES: {namespace!r} is not a namespace name "
                    "(lowercase letters, digits and '-'); separate several with commas"
                )
        if not self.trainer_image.strip():
            raise SettingsError(f"--trainer-image / {ENV_PREFIX}TRAINER_IMAGE: must not be empty")
        if not 1 <= self.max_workers <= 256:
            raise SettingsError(
                f"--max-workers / {ENV_PREFIX}MAX_WORKERS: must be 1..256 (got {self.max_workers})"
            )

    def _check_network(self) -> None:
        """Its scrapes and ports, and the report endpoint it serves."""
        if not 1.0 <= self.scrape_interval_seconds <= 3600:
            raise SettingsError(
                f"--scrape-interval / {ENV_PREFIX}SCRAPE_INTERVAL: must be 1..3600 seconds "
                f"(got {self.scrape_interval_seconds:g})"
            )
        if not 0.1 <= self.scrape_timeout_seconds < self.scrape_interval_seconds:
            raise SettingsError(
                f"--scrape-timeout / {ENV_PREFIX}SCRAPE_TIMEOUT: must be at least 0.1 s and shorter "
                f"than the scrape interval (got {self.scrape_timeout_seconds:g})"
            )
        for flag, port in (("metrics-port", self.metrics_port), ("health-port", self.health_port)):
            if not 0 <= port <= 65535:
                env = f"{ENV_PREFIX}{flag.upper().replace('-', '_')}"
                raise SettingsError(f"--{flag} / {env}: must be 0..65535, 0 to disable (got {port})")
        if self.metrics_port and self.metrics_port == self.health_port:
            raise SettingsError("--metrics-port and --health-port must differ")
        if self.report_url is not None:
            if not re.match(r"^https?://[^/\s]+$", self.report_url):
                raise SettingsError(
                    f"--report-url / {ENV_PREFIX}REPORT_URL: scheme, host and port only, e.g. "
                    f"https://gpuop-reports.gpuop-system.svc:8443 (got {self.report_url!r})"
                )
            taken = (self.metrics_port, self.health_port)
            if not 1 <= self.report_port <= 65535 or self.report_port in taken:
                raise SettingsError(
                    f"--report-port / {ENV_PREFIX}REPORT_PORT: must be 1..65535 and differ from the "
                    f"metrics and health ports (got {self.report_port})"
                )

    def _check_gpu_figures(self) -> None:
        """Where GPU figures come from, and when they make a training Underutilized."""
        if self.gpu_metrics == "prometheus" and not (self.gpu_metrics_prometheus_url or "").startswith(
            ("http://", "https://")
        ):
            raise SettingsError(
                f"--gpu-metrics-prometheus-url / {ENV_PREFIX}GPU_METRICS_PROMETHEUS_URL: --gpu-metrics "
                "prometheus needs the query API's base URL, e.g. http://prometheus-operated.monitoring:9090"
            )
        if self.gpu_metrics == "dcgm-exporter" and not re.match(
            r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?/[a-z0-9]([-a-z0-9]*[a-z0-9])?$", self.dcgm_exporter_service
        ):
            raise SettingsError(
                f"--dcgm-exporter-service / {ENV_PREFIX}DCGM_EXPORTER_SERVICE: NAMESPACE/NAME of the "
                "exporter's Service, e.g. gpu-operator/nvidia-dcgm-exporter "
                f"(got {self.dcgm_exporter_service!r})"
            )
        if not 0 <= self.underutilized_percent <= 100:
            raise SettingsError(
                f"--underutilized-percent / {ENV_PREFIX}UNDERUTILIZED_PERCENT: must be 0..100 "
                f"(got {self.underutilized_percent:g})"
            )
        if self.underutilized_seconds < 1:
            raise SettingsError(
                f"--underutilized-seconds / {ENV_PREFIX}UNDERUTILIZED_SECONDS: must be >= 1 "
                f"(got {self.underutilized_seconds})"
            )


F = TypeVar("F", bound=Callable[..., Any])


def _option(flag: str, env: str, help: str, **kwargs: Any) -> Callable[[F], F]:
    """A ``gpuop operator`` option read from its ``GPUOP_*`` variable too (named in --help).
    Values stay text until :func:`from_options`, whose messages name the flag and the variable."""
    return click.option(flag, envvar=ENV_PREFIX + env, show_envvar=True, help=help, **kwargs)


def operator_options(command: F) -> F:
    """The ``gpuop operator`` options, each defaulting to its GPUOP_* variable, then to
    :class:`OperatorSettings`' default."""
    d = OperatorSettings()
    options = [
        _option(
            "--namespace",
            "NAMESPACES",
            "Watch this namespace (repeatable, or comma-separated); default: all namespaces.",
            multiple=True,
            metavar="NS",
        ),
        _option(
            "--trainer-image",
            "TRAINER_IMAGE",
            "Trainer image for GpuTrainings without spec.image.",
            default=d.trainer_image,
            show_default=True,
        ),
        _option(
            "--scrape-interval",
            "SCRAPE_INTERVAL",
            "How often running jobs' metrics are read into their status, in seconds.",
            default=str(d.scrape_interval_seconds),
            show_default=True,
            metavar="SECONDS",
        ),
        _option(
            "--scrape-timeout",
            "SCRAPE_TIMEOUT",
            "Seconds a tick waits for the trainers' metrics, all pods at once (one not answered "
            "whole by then gives no figures that tick).",
            default=str(d.scrape_timeout_seconds),
            show_default=True,
            metavar="SECONDS",
        ),
        _option(
            "--scrape-via",
            "SCRAPE_VIA",
            "pod-ip (in-cluster), proxy (through the API server's pod proxy, "
            "from outside the cluster) or auto: pod-ip when running in a pod.",
            default=d.scrape_via,
            show_default=True,
        ),
        _option(
            "--lease",
            "LEASE",
            "Name of the coordination.k8s.io Lease the replicas share: the one holding it works, "
            "the others stand by.",
            default=d.lease_name,
            show_default=True,
            metavar="NAME",
        ),
        _option(
            "--lease-namespace",
            "LEASE_NAMESPACE",
            "Namespace of that Lease; default: the pod's own (POD_NAMESPACE). Outside a pod, without "
            "it, the operator runs standalone.",
            metavar="NS",
        ),
        _option("--standalone", "STANDALONE", "Run without a Lease: a single replica (tests).", is_flag=True),
        _option(
            "--metrics-port",
            "METRICS_PORT",
            "Port of the operator's own Prometheus /metrics; 0 disables.",
            default=str(d.metrics_port),
            show_default=True,
        ),
        _option(
            "--health-port",
            "HEALTH_PORT",
            "Port of /healthz (liveness and readiness); 0 disables.",
            default=str(d.health_port),
            show_default=True,
        ),
        _option(
            "--log-format",
            "LOG_FORMAT",
            "text, or json (one object per line, for log pipelines).",
            default=d.log_format,
            show_default=True,
        ),
        _option(
            "--max-workers",
            "MAX_WORKERS",
            "Reconcile workers: trainings reconciled at once (and the threads of each other pool "
            "of API calls).",
            default=str(d.max_workers),
            show_default=True,
        ),
        _option(
            "--underutilized-percent",
            "UNDERUTILIZED_PERCENT",
            "Mean GPU utilization under which a running job counts as underutilized.",
            default=str(d.underutilized_percent),
            show_default=True,
        ),
        _option(
            "--underutilized-seconds",
            "UNDERUTILIZED_SECONDS",
            "How long it must stay under before the Underutilized condition.",
            default=str(d.underutilized_seconds),
            show_default=True,
        ),
        _option(
            "--report-url",
            "REPORT_URL",
            "Where training pods reach the progress-report endpoint (scheme://host:port; the chart sets its "
            "Service's); unset: no endpoint, and trainers get no report variables.",
            metavar="URL",
        ),
        _option(
            "--report-port",
            "REPORT_PORT",
            "Port the progress-report endpoint listens on.",
            default=str(d.report_port),
            show_default=True,
        ),
        _option(
            "--report-tls-dir",
            "REPORT_TLS_DIR",
            "Directory with the endpoint's tls.crt, tls.key and ca.crt (a kubernetes.io/tls Secret with "
            "its CA); re-read when they change.",
            default=d.report_tls_dir,
            show_default=True,
            metavar="DIR",
        ),
        _option(
            "--gpu-metrics",
            "GPU_METRICS",
            "GPU figures for any image: dcgm-exporter (read the exporters behind --dcgm-exporter-service), "
            "prometheus (query --gpu-metrics-prometheus-url for their series) or none.",
            default=d.gpu_metrics,
            show_default=True,
        ),
        _option(
            "--dcgm-exporter-service",
            "DCGM_EXPORTER_SERVICE",
            "NAMESPACE/NAME of dcgm-exporter's Service (the NVIDIA GPU Operator's by default).",
            default=d.dcgm_exporter_service,
            show_default=True,
        ),
        _option(
            "--gpu-metrics-prometheus-url",
            "GPU_METRICS_PROMETHEUS_URL",
            "Base URL of a Prometheus-compatible query API that scrapes dcgm-exporter.",
            metavar="URL",
        ),
        click.option(
            "-v",
            "--verbose",
            envvar=ENV_PREFIX + "VERBOSE",
            show_envvar=True,
            is_flag=True,
            help="Debug logging.",
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _number(flag: str, env_name: str, text: str, kind: type[int] | type[float]) -> float:
    try:
        return kind(text)
    except ValueError:
        noun = "an integer" if kind is int else "a number"
        raise SettingsError(f"--{flag} / {ENV_PREFIX}{env_name}: must be {noun} (got {text!r})") from None


def _lease(values: Mapping[str, Any], standalone: bool) -> tuple[str, str | None]:
    """The Lease's name and namespace (None: standalone), each a valid name or one line."""
    name = values.get("lease") or OperatorSettings().lease_name
    given = values.get("lease_namespace") or os.environ.get("POD_NAMESPACE") or None
    namespace = None if standalone else given
    if not _NAME_RE.match(name):
        raise SettingsError(f"--lease / {ENV_PREFIX}LEASE: not a valid object name (got {name!r})")
    if namespace is not None and not _NAMESPACE_RE.match(namespace):
        raise SettingsError(
            f"--lease-namespace / {ENV_PREFIX}LEASE_NAMESPACE: not a valid namespace (got {namespace!r})"
        )
    return name, namespace


def from_options(values: Mapping[str, Any]) -> OperatorSettings:
    """Settings from the parsed options (whose defaults already came from the environment)."""
    raw_namespaces: Sequence[str] = values.get("namespace") or ()
    namespaces = tuple(
        dict.fromkeys(ns.strip() for chunk in raw_namespaces for ns in chunk.split(",") if ns.strip())
    )
    scrape_via, log_format = values["scrape_via"], values["log_format"]
    if scrape_via not in ("auto", "pod-ip", "proxy"):
        raise SettingsError(
            f"--scrape-via / {ENV_PREFIX}SCRAPE_VIA: must be auto, pod-ip or proxy (got {scrape_via!r})"
        )
    if log_format not in ("text", "json"):
        raise SettingsError(
            f"--log-format / {ENV_PREFIX}LOG_FORMAT: must be text or json (got {log_format!r})"
        )
    d = OperatorSettings()
    standalone = bool(values.get("standalone"))
    lease_name, lease_namespace = _lease(values, standalone)
    return OperatorSettings(
        namespaces=namespaces,
        trainer_image=values["trainer_image"],
        scrape_interval_seconds=_number(
            "scrape-interval", "SCRAPE_INTERVAL", values["scrape_interval"], float
        ),
        scrape_timeout_seconds=_number("scrape-timeout", "SCRAPE_TIMEOUT", values["scrape_timeout"], float),
        scrape_via=scrape_via,
        lease_name=lease_name,
        lease_namespace=lease_namespace,
        standalone=standalone,
        metrics_port=int(_number("metrics-port", "METRICS_PORT", values["metrics_port"], int)),
        health_port=int(_number("health-port", "HEALTH_PORT", values["health_port"], int)),
        log_format=log_format,
        verbose=bool(values.get("verbose")),
        max_workers=int(_number("max-workers", "MAX_WORKERS", values["max_workers"], int)),
        underutilized_percent=_number(
            "underutilized-percent", "UNDERUTILIZED_PERCENT", values["underutilized_percent"], float
        ),
        underutilized_seconds=int(
            _number("underutilized-seconds", "UNDERUTILIZED_SECONDS", values["underutilized_seconds"], int)
        ),
        report_url=(values.get("report_url") or "").rstrip("/") or None,
        report_port=int(
            _number("report-port", "REPORT_PORT", values.get("report_port") or str(d.report_port), int)
        ),
        report_tls_dir=values.get("report_tls_dir") or d.report_tls_dir,
        gpu_metrics=_gpu_metrics(values.get("gpu_metrics") or d.gpu_metrics),
        dcgm_exporter_service=values.get("dcgm_exporter_service") or d.dcgm_exporter_service,
        gpu_metrics_prometheus_url=values.get("gpu_metrics_prometheus_url") or None,
    )


def _gpu_metrics(text: str) -> GpuMetrics:
    for choice in get_args(GpuMetrics):
        if text == choice:
            return cast(GpuMetrics, choice)
    raise SettingsError(
        f"--gpu-metrics / {ENV_PREFIX}GPU_METRICS: must be none, dcgm-exporter or prometheus (got {text!r})"
    )
