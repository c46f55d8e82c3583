"""The real Kubeflow training-operator (v1, the PyTorchJob controller and its validating webhook),
built from its Go module and run against a control plane as its Deployment would run it.

Built from ``tests/kubeflow/go.mod`` (``github.com/kubeflow/training-operator v1.9.4``, go.sum
committed) through :mod:`support.plane.gobuild`. That is a module of its own rather than the control
plane's: v1.9.4 needs k8s.io/* v0.36 and controller-runtime v0.24, while the control plane's
module pins every k8s.io staging module to v0.35.4 with ``replace``; one module cannot hold both.

Its webhook is real as well: the training-operator's own cert rotator makes a CA and a serving
certificate for ``training-operator.kubeflow.svc``, stores them in its Secret and writes the CA
into the ValidatingWebhookConfiguration, which is the upstream one
(tests/reference/training-operator-webhook.yaml, the pytorchjob entry, named as the release
manifests name it). The API server reaches the webhook through the Service's endpoint, the test
host's address (``--enable-aggregator-routing``: the API server dials the endpoint itself, with no
kube-proxy on its host).
The rotator reads its files from a fixed /tmp path, where the Deployment mounts the Secret; here
the process gets a private tmpfs there (a mount namespace of its own, so two suites on one
machine cannot overwrite each other's keys) and a thread plays the secret volume.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Final

import yaml

from support.controllers.webhooked import ControllerSpec, WebhookedController
from support.node import images
from support.paths import ROOT
from support.plane import gobuild
from support.plane.cluster import Api
from support.plane.controlplane import ControlPlane

MODULE: Final = ROOT / "tests" / "kubeflow"
WEBHOOKS: Final = ROOT / "tests" / "reference" / "training-operator-webhook.yaml"
NAMESPACE: Final = "kubeflow"
SERVICE: Final = "training-operator"
SECRET: Final = "training-operator-webhook-cert"
WEBHOOK_CONFIGURATION: Final = "validator.training-operator.kubeflow.org"


def recipe() -> gobuild.Recipe:
    """The Kubeflow controllers, from one tools module: the training-operator v1, Trainer v2 and
    JobSet (MVS settles them on one k8s.io and controller-runtime version)."""
    versions = {
        "training-operator": gobuild.required_version(MODULE, "github.com/kubeflow/training-operator"),
        "trainer": gobuild.required_version(MODULE, "github.com/kubeflow/trainer/v2"),
        "jobset": gobuild.required_version(MODULE, "sigs.k8s.io/jobset"),
    }
    return gobuild.Recipe(
        name="kubeflow",
        module=MODULE,
        packages={
            "training-operator": "github.com/kubeflow/training-operator/cmd/training-operator.v1",
            "trainer-controller-manager": "github.com/kubeflow/trainer/v2/cmd/trainer-controller-manager",
            "jobset": "sigs.k8s.io/jobset",
        },
        label="-".join(f"{name}-{version}" for name, version in versions.items()),
        cold_cost="measured 2.0 min on 2 cores for all three with their modules cached; 1.2 min for the "
        "training-operator alone with the control plane's modules already cached",
        renames={"training-operator.v1": "training-operator"},
    )


def ensure_binary(name: str = "training-operator") -> Path:
    return gobuild.ensure(recipe()) / name


def webhook_configuration() -> dict[str, Any]:
    """Upstream's pytorchjob webhook, with the names the release manifests give it."""
    upstream = next(d for d in yaml.safe_load_all(WEBHOOKS.read_text()) if d)
    hook = next(w for w in upstream["webhooks"] if w["name"].startswith("validator.pytorchjob."))
    hook["clientConfig"]["service"].update(name=SERVICE, namespace=NAMESPACE, port=443)
    return {"apiVersion": upstream["apiVersion"], "kind": upstream["kind"],
            "metadata": {"name": WEBHOOK_CONFIGURATION}, "webhooks": [hook]}  # fmt: skip


TRAINING_OPERATOR: Final = ControllerSpec(
    name="training-operator",
    binary=ensure_binary,
    namespace=NAMESPACE,
    service=SERVICE,
    secret=SECRET,
    webhooks=lambda: [webhook_configuration()],
    command=lambda binary, ports, _: [
        str(binary), "--enable-scheme=pytorchjob", f"--webhook-server-port={ports.webhook}",
        f"--health-probe-bind-address=127.0.0.1:{ports.health}", "--metrics-bind-address=0",
        "--leader-elect=false", "--zap-log-level=info",
        # Its init container (waits for the master's name) runs in place of alpine, which no
        # registry here serves.
        f"--pytorch-init-container-image={images.SHELL_IMAGE}",
    ],
)  # fmt: skip


def training_operator(
    plane: ControlPlane,
    api: Api,
    host_ip: str,
    workdir: Path,
    *,
    gang_scheduler: str | None = None,
    watch_namespace: str | None = None,
) -> WebhookedController:
    """``gang_scheduler``: its ``--gang-scheduler-name`` (volcano, or the coscheduler's scheduler
    name), which gangs every PyTorchJob it sees; ``watch_namespace``: its ``--namespace``, the only
    namespace whose jobs it acts on (its webhook, cluster-wide, is the same either way)."""
    extra = [f"--gang-scheduler-name={gang_scheduler}"] if gang_scheduler else []
    extra += [f"--namespace={watch_namespace}"] if watch_namespace else []
    spec = TRAINING_OPERATOR
    if extra:
        spec = dataclasses.replace(spec, command=lambda binary, ports, workdir: [
            *TRAINING_OPERATOR.command(binary, ports, workdir), *extra])  # fmt: skip
    return WebhookedController(spec, plane, api, host_ip, workdir)
