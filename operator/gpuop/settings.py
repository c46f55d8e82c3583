"""How the operator runs: read once at start from flags, else ``GPUOP_*`` env, else defaults.

Flags win over env so that ``kubectl exec ... gpuop operator --log-format text`` overrides
what the Helm chart put in the Deployment's env. A bad value is one line naming the flag,
its env variable and the fix, before anything connects to a cluster.
"""

from __future__ import annotations

import argparse
import os
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal

from gpuop.identity import DEFAULT_TRAINER_IMAGE

ENV_PREFIX: Final = "GPUOP_"
ScrapeVia = Literal["auto", "pod-ip", "proxy"]
_NAMESPACE_RE: Final = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


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
    peering_name: str | None = "gpu-training-operator"  # None: standalone, no peering
    # Named by --peering or GPUOP_PEERING (the chart does): wait for the object rather than
    # fall back to standalone when it is missing (see gpuop.controller.check_peering).
    peering_required: bool = False
    priority: int = 0
    metrics_port: int = 8080  # 0 disables the operator's own /metrics
    health_port: int = 8081  # 0 disables /healthz
    log_format: Literal["text", "json"] = "text"
    verbose: bool = False
    max_workers: int = 16  # threads for the blocking API calls of concurrent reconciles
    underutilized_percent: float = 30.0
    underutilized_seconds: int = 600

    def scrapes_via_proxy(self, in_cluster: bool) -> bool:
        """Whether trainer metrics are read through the API server's pod proxy.

        Outside the cluster pod IPs are unreachable; inside, the pod IP spares the API server.
        """
        return self.scrape_via == "proxy" or (self.scrape_via == "auto" and not in_cluster)

    def __post_init__(self) -> None:
        for namespace in self.namespaces:
            if not _NAMESPACE_RE.match(namespace) or len(namespace) > 63:
                raise SettingsError(
                    f"--namespace / {ENV_PREFIX}NAMESPACES: {namespace!r} is not a namespace name "
                    "(lowercase letters, digits and '-'); separate several with commas"
                )
        if not self.trainer_image.strip():
            raise SettingsError(f"--trainer-image / {ENV_PREFIX}TRAINER_IMAGE: must not be empty")
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
        if not 1 <= self.max_workers <= 256:
            raise SettingsError(
                f"--max-workers / {ENV_PREFIX}MAX_WORKERS: must be 1..256 (got {self.max_workers})"
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


def _env_default(env: Mapping[str, str], name: str, fallback: str) -> str:
    return env.get(ENV_PREFIX + name, fallback)


def add_arguments(parser: argparse.ArgumentParser, env: Mapping[str, str] | None = None) -> None:
    """The ``gpuop operator`` flags, each defaulting to its GPUOP_* env variable."""
    env = os.environ if env is None else env
    d = OperatorSettings()

    def default(name: str, value: object) -> str:
        return _env_default(env, name, "" if value is None else str(value))

    parser.add_argument(
        "--namespace",
        action="append",
        default=None,
        metavar="NS",
        help="watch this namespace (repeatable, or comma-separated); default: all namespaces "
        f"[{ENV_PREFIX}NAMESPACES]",
    )
    parser.add_argument(
        "--trainer-image",
        default=default("TRAINER_IMAGE", d.trainer_image),
        help="trainer image for GpuTrainings without spec.image [%(default)s]",
    )
    parser.add_argument(
        "--scrape-interval",
        default=default("SCRAPE_INTERVAL", d.scrape_interval_seconds),
        metavar="SECONDS",
        help="how often running jobs' metrics are read into their status [%(default)s]",
    )
    parser.add_argument(
        "--scrape-timeout",
        default=default("SCRAPE_TIMEOUT", d.scrape_timeout_seconds),
        metavar="SECONDS",
        help="timeout of one metrics request [%(default)s]",
    )
    parser.add_argument(
        "--scrape-via",
        default=default("SCRAPE_VIA", d.scrape_via),
        help="pod-ip (in-cluster), proxy (through the API server's pod proxy, from outside the "
        "cluster) or auto: pod-ip when running in a pod [%(default)s]",
    )
    parser.add_argument(
        "--peering",
        default=env.get(f"{ENV_PREFIX}PEERING"),
        metavar="NAME",
        help="Kopf peering object shared by the replicas; one is active at a time. Named here (or "
        f"in {ENV_PREFIX}PEERING), the operator waits for it to exist; by default it uses "
        f"{d.peering_name!r} when that exists and runs standalone, with a warning, when not",
    )
    parser.add_argument(
        "--standalone",
        action="store_true",
        default=_env_default(env, "STANDALONE", "").lower() in ("1", "true", "yes"),
        help=f"run without peering (a single replica; tests) [{ENV_PREFIX}STANDALONE]",
    )
    parser.add_argument(
        "--priority",
        default=_env_default(env, "PRIORITY", "random"),
        help="peering priority, an integer or 'random'; the highest live replica runs, the others "
        "wait. Replicas with equal priorities all pause (Kopf's rule), so replicas of one "
        "Deployment need 'random' [%(default)s]",
    )
    parser.add_argument(
        "--metrics-port",
        default=default("METRICS_PORT", d.metrics_port),
        help="port of the operator's own Prometheus /metrics; 0 disables [%(default)s]",
    )
    parser.add_argument(
        "--health-port",
        default=default("HEALTH_PORT", d.health_port),
        help="port of /healthz (liveness and readiness); 0 disables [%(default)s]",
    )
    parser.add_argument(
        "--log-format",
        default=default("LOG_FORMAT", d.log_format),
        help="text or json (one object per line, for log pipelines) [%(default)s]",
    )
    parser.add_argument(
        "--max-workers",
        default=default("MAX_WORKERS", d.max_workers),
        help="threads for concurrent API calls [%(default)s]",
    )
    parser.add_argument(
        "--underutilized-percent",
        default=default("UNDERUTILIZED_PERCENT", d.underutilized_percent),
        help="mean GPU utilization under which a running job counts as underutilized [%(default)s]",
    )
    parser.add_argument(
        "--underutilized-seconds",
        default=default("UNDERUTILIZED_SECONDS", d.underutilized_seconds),
        help="how long it must stay under before the Underutilized condition [%(default)s]",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def _number(flag: str, env_name: str, text: str, kind: type[int] | type[float]) -> float:
    try:
        return kind(text)
    except ValueError:
        noun = "an integer" if kind is int else "a number"
        raise SettingsError(f"--{flag} / {ENV_PREFIX}{env_name}: must be {noun} (got {text!r})") from None


def _priority(text: str) -> int:
    """An explicit priority, or a random one so that replicas sharing one pod template differ."""
    if text.strip().lower() == "random":
        return random.SystemRandom().randrange(1, 2**31)
    return int(_number("priority", "PRIORITY", text, int))


def from_arguments(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> OperatorSettings:
    """Settings from parsed flags (whose defaults already came from env)."""
    env = os.environ if env is None else env
    raw_namespaces = args.namespace or [env.get(f"{ENV_PREFIX}NAMESPACES", "")]
    namespaces = tuple(
        dict.fromkeys(ns.strip() for chunk in raw_namespaces for ns in chunk.split(",") if ns.strip())
    )
    if args.scrape_via not in ("auto", "pod-ip", "proxy"):
        raise SettingsError(
            f"--scrape-via / {ENV_PREFIX}SCRAPE_VIA: must be auto, pod-ip or proxy (got {args.scrape_via!r})"
        )
    if args.log_format not in ("text", "json"):
        raise SettingsError(
            f"--log-format / {ENV_PREFIX}LOG_FORMAT: must be text or json (got {args.log_format!r})"
        )
    d = OperatorSettings()
    return OperatorSettings(
        namespaces=namespaces,
        trainer_image=args.trainer_image,
        scrape_interval_seconds=_number("scrape-interval", "SCRAPE_INTERVAL", args.scrape_interval, float),
        scrape_timeout_seconds=_number("scrape-timeout", "SCRAPE_TIMEOUT", args.scrape_timeout, float),
        scrape_via=args.scrape_via,
        peering_name=None if args.standalone or args.peering == "" else (args.peering or d.peering_name),
        peering_required=bool(args.peering) and not args.standalone,
        priority=_priority(args.priority),
        metrics_port=int(_number("metrics-port", "METRICS_PORT", args.metrics_port, int)),
        health_port=int(_number("health-port", "HEALTH_PORT", args.health_port, int)),
        log_format=args.log_format,
        verbose=args.verbose,
        max_workers=int(_number("max-workers", "MAX_WORKERS", args.max_workers, int)),
        underutilized_percent=_number(
            "underutilized-percent", "UNDERUTILIZED_PERCENT", args.underutilized_percent, float
        ),
        underutilized_seconds=int(
            _number("underutilized-seconds", "UNDERUTILIZED_SECONDS", args.underutilized_seconds, int)
        ),
    )
