"""The real Kubeflow Trainer v2.3.0 controller manager and JobSet v0.12.0, built from their Go
modules (``tests/kubeflow/go.mod``, beside the training-operator) and run against a control plane
as their release manifests run them, webhooks included.

Each rotates its own webhook certificate, as shipped (Trainer's ``certManagement``, JobSet's
``internalCertManagement``), into the Secret and the webhook configurations its release names
(Trainer: ``kubeflow-trainer-controller-manager`` in ``kubeflow-system``, configurations
``validator.trainer.kubeflow.org`` and ``defaulter.trainer.kubeflow.org``; JobSet:
``jobset-webhook-service`` in ``jobset-system``). The configurations are upstream's
(tests/reference/trainer-webhooks.yaml, jobset-webhooks.yaml) with the patches their
kustomizations apply, done here in code: names, service, and the object selectors that keep
JobSet's pod webhooks to JobSet's pods. Each process gets its ports from a config file, the
format its Deployment mounts.

A TrainJob's chain on this machine: Trainer makes a JobSet, JobSet makes a Job per replicated job
and a headless Service, kube-controller-manager's Job controller makes the pods, and the real
nodes' kubelets run them (support.node).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from pathlib import Path
from typing import Any, Final

import yaml

from support.controllers.trainingoperator import ensure_binary
from support.controllers.webhooked import ControllerSpec, Ports, WebhookedController
from support.paths import REFERENCE
from support.plane.cluster import Api
from support.plane.controlplane import ControlPlane, free_port

JOBSET_CRD: Final = REFERENCE / "jobset.x-k8s.io_jobsets.yaml"
TRAINER_NAMESPACE: Final = "kubeflow-system"
TRAINER_SERVICE: Final = "kubeflow-trainer-controller-manager"
JOBSET_NAMESPACE: Final = "jobset-system"
JOBSET_SERVICE: Final = "jobset-webhook-service"
TRAINER_CONFIG: Final = "trainer-config.yaml"


def _configurations(path: Path, names: dict[str, str], service: str, namespace: str) -> list[dict[str, Any]]:
    """Upstream's webhook configurations, renamed by kind and pointed at ``service``."""
    out = []
    for document in yaml.safe_load_all(path.read_text()):
        if not document:
            continue
        configuration = copy.deepcopy(document)
        configuration["metadata"] = {"name": names[configuration["kind"]]}
        for hook in configuration["webhooks"]:
            hook["clientConfig"]["service"].update(name=service, namespace=namespace, port=443)
        out.append(configuration)
    return out


def trainer_webhooks() -> list[dict[str, Any]]:
    configurations = _configurations(
        REFERENCE / "trainer-webhooks.yaml",
        {
            "MutatingWebhookConfiguration": "defaulter.trainer.kubeflow.org",
            "ValidatingWebhookConfiguration": "validator.trainer.kubeflow.org",
        },
        TRAINER_SERVICE,
        TRAINER_NAMESPACE,
    )
    # manifests/base/webhook/patch_validating.yaml: the runtime validators skip opted-out objects.
    validating = next(c for c in configurations if c["kind"] == "ValidatingWebhookConfiguration")
    for hook in validating["webhooks"][:2]:
        hook["objectSelector"] = {"matchExpressions": [
            {"key": "trainer.kubeflow.org/webhook-validation", "operator": "NotIn", "values": ["disabled"]}
        ]}  # fmt: skip
    return configurations


def jobset_webhooks() -> list[dict[str, Any]]:
    configurations = _configurations(
        REFERENCE / "jobset-webhooks.yaml",
        {
            "MutatingWebhookConfiguration": "jobset-mutating-webhook-configuration",
            "ValidatingWebhookConfiguration": "jobset-validating-webhook-configuration",
        },
        JOBSET_SERVICE,
        JOBSET_NAMESPACE,
    )
    # config/components/webhook/patches: the pod webhooks only see JobSet's pods.
    for configuration in configurations:
        for hook in configuration["webhooks"]:
            if hook["rules"][0]["resources"] == ["pods"]:
                hook["objectSelector"] = {
                    "matchExpressions": [{"key": "jobset.sigs.k8s.io/jobset-name", "operator": "Exists"}]
                }
    return configurations


def _trainer_command(
    binary: Path, ports: Ports, workdir: Path, *, progress_server: bool = False
) -> list[str]:
    config: dict[str, Any] = {
        "apiVersion": "config.trainer.kubeflow.org/v1alpha1",
        "kind": "Configuration",
        "health": {"healthProbeBindAddress": f"127.0.0.1:{ports.health}", "readinessEndpointName": "readyz",
                   "livenessEndpointName": "healthz"},
        "metrics": {"bindAddress": "0"},
        "webhook": {"port": ports.webhook, "host": ""},
        "leaderElection": {"leaderElect": False},
        "certManagement": {"enable": True, "webhookServiceName": TRAINER_SERVICE,
                           "webhookSecretName": "kubeflow-trainer-webhook-cert"},
    }  # fmt: skip
    if progress_server:
        # The alpha gate as an operator turns it on (manifests' config, featureGates), and its
        # server on a port of this host's (10443 in the release).
        config["featureGates"] = {"TrainJobStatus": True}
        config["statusServer"] = {"port": free_port()}
    path = workdir / TRAINER_CONFIG
    path.write_text(yaml.safe_dump(config))
    return [str(binary), f"--config={path}", "--zap-log-level=info"]


def progress_server_port(controller: WebhookedController) -> int:
    """The port Trainer's progress server (``TrainJobStatus``) listens on, from its config."""
    port: int = yaml.safe_load((controller.workdir / TRAINER_CONFIG).read_text())["statusServer"]["port"]
    return port


def _jobset_command(binary: Path, ports: Ports, workdir: Path) -> list[str]:
    config = {
        "apiVersion": "config.jobset.x-k8s.io/v1alpha1",
        "kind": "Configuration",
        "health": {"healthProbeBindAddress": f"127.0.0.1:{ports.health}"},
        "metrics": {"bindAddress": "0"},
        "webhook": {"port": ports.webhook},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": True},
    }
    path = workdir / "jobset-config.yaml"
    path.write_text(yaml.safe_dump(config))
    return [str(binary), f"--config={path}", "--zap-log-level=info"]


TRAINER: Final = ControllerSpec(
    name="trainer",
    binary=lambda: ensure_binary("trainer-controller-manager"),
    namespace=TRAINER_NAMESPACE,
    service=TRAINER_SERVICE,
    secret="kubeflow-trainer-webhook-cert",
    webhooks=trainer_webhooks,
    command=_trainer_command,
)
# Trainer with its ``TrainJobStatus`` gate on: it then injects Kubeflow's progress variables
# into every trainer container and serves them itself. Its server finds the token issuer from
# its own ServiceAccount's token and fetches the issuer's discovery document by the kubernetes
# Service's name, as in its pod (support.controllers.incluster).
TRAINER_WITH_PROGRESS_SERVER: Final = dataclasses.replace(
    TRAINER,
    command=functools.partial(_trainer_command, progress_server=True),
    service_account="kubeflow-trainer-controller-manager",
)
JOBSET: Final = ControllerSpec(
    name="jobset",
    binary=lambda: ensure_binary("jobset"),
    namespace=JOBSET_NAMESPACE,
    service=JOBSET_SERVICE,
    secret="jobset-webhook-server-cert",
    webhooks=jobset_webhooks,
    command=_jobset_command,
)


def trainer_and_jobset(
    plane: ControlPlane, api: Api, host_ip: str, workdir: Path
) -> list[WebhookedController]:
    """JobSet first (Trainer's JobSets go through its webhooks), then Trainer; not started."""
    return [WebhookedController(spec, plane, api, host_ip, workdir) for spec in (JOBSET, TRAINER)]
