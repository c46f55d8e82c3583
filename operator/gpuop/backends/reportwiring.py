"""How a trainer pod reaches the operator's report endpoint: its URL, the token it presents
(projected, bound to the pod and to this training's audience) and the CA it trusts, under
Kubeflow's three variables. Pure.

Hugging Face's KubeflowCallback, the Kubeflow SDK and gpureport all find the endpoint by those
variables, so any training code reports with no code of ours in its image. The endpoint itself
is :mod:`gpuop.observing.endpoint`; the URL's path is :func:`gpuop.api.identity.report_path`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from gpuop.api.identity import (
    REPORT_CA_ENV,
    REPORT_MOUNT,
    REPORT_TOKEN_ENV,
    REPORT_URL_ENV,
    report_audience,
    report_ca_config_map,
    report_path,
)
from gpuop.api.spec import GpuTraining


@dataclass(frozen=True)
class ReportEndpoint:
    """The operator's progress-report endpoint as trainers reach it: a setting of the operator's
    (its Service, its certificate), not of any spec."""

    base_url: str  # https://<service>.<namespace>.svc:<port>, no trailing slash
    ca_pem: str  # the CA that signed the endpoint's certificate


@dataclass(frozen=True)
class TrainingReports:
    """Where one training's code sends its reports, and with what credentials."""

    url: str
    audience: str
    ca_config_map: str


# A token lives an hour, as Kubeflow's do; kubelet renews a projected token at 80% of its life,
# so a long training always has a valid one and a leaked one is worth an hour at most.
REPORT_TOKEN_SECONDS: Final = 3600
_REPORT_VOLUME: Final = "gpuop-reports"


def training_reports(training: GpuTraining, endpoint: ReportEndpoint | None) -> TrainingReports | None:
    if endpoint is None:
        return None
    namespace = training.namespace or "default"
    path = report_path(namespace, training.name)
    return TrainingReports(
        url=f"{endpoint.base_url}{path}",
        audience=report_audience(namespace, training.name),
        ca_config_map=report_ca_config_map(training.name),
    )


def report_env(reports: TrainingReports) -> dict[str, str]:
    """Kubeflow's three variables: Hugging Face's KubeflowCallback, the Kubeflow SDK and
    gpureport find the endpoint by them, with no code of ours in the image."""
    return {
        REPORT_URL_ENV: reports.url,
        REPORT_CA_ENV: f"{REPORT_MOUNT}/ca.crt",
        REPORT_TOKEN_ENV: f"{REPORT_MOUNT}/token",
    }


def report_volume(reports: TrainingReports) -> tuple[dict[str, Any], dict[str, Any]]:
    """The projected volume of the report token (bound to the pod, this training's audience)
    and the endpoint's CA, and its mount."""
    volume = {
        "name": _REPORT_VOLUME,
        "projected": {
            "sources": [
                {"serviceAccountToken": {"audience": reports.audience,
                                         "expirationSeconds": REPORT_TOKEN_SECONDS, "path": "token"}},
                {"configMap": {"name": reports.ca_config_map,
                               "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
            ]
        },
    }  # fmt: skip
    return volume, {"name": _REPORT_VOLUME, "mountPath": REPORT_MOUNT, "readOnly": True}
