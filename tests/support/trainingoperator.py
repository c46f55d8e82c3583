"""The real Kubeflow training-operator (v1, the PyTorchJob controller and its validating webhook),
built from its Go module and run against a control plane as its Deployment would run it.

Built from ``tests/kubeflow/go.mod`` (``github.com/kubeflow/training-operator v1.9.4``, go.sum
committed) through :mod:`support.gobuild`. That is a module of its own rather than the control
plane's: v1.9.4 needs k8s.io/* v0.36 and controller-runtime v0.24, while the control plane's
module pins every k8s.io staging module to v0.35.4 with ``replace``; one module cannot hold both.

Its webhook is real as well: the training-operator's own cert rotator makes a CA and a serving
certificate for ``training-operator.kubeflow.svc``, stores them in its Secret and writes the CA
into the ValidatingWebhookConfiguration, which is the upstream one
(tests/reference/training-operator-webhook.yaml, the pytorchjob entry, named as the release
manifests name it). The API server reaches the webhook through the Service's endpoint, the test
host's address on the node agent's bridge (``--enable-aggregator-routing``: no kube-proxy here).
The rotator reads its files from a fixed /tmp path, where the Deployment mounts the Secret; here
the process gets a private tmpfs there (a mount namespace of its own, so two suites on one
machine cannot overwrite each other's keys) and a thread plays the secret volume.
"""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import yaml

from support import gobuild
from support.controlplane import ControlPlane, free_port
from support.crdschema import ROOT
from support.realcluster import Api, HttpError

MODULE: Final = ROOT / "tests" / "kubeflow"
WEBHOOKS: Final = ROOT / "tests" / "reference" / "training-operator-webhook.yaml"
NAMESPACE: Final = "kubeflow"
SERVICE: Final = "training-operator"
SECRET: Final = "training-operator-webhook-cert"
WEBHOOK_CONFIGURATION: Final = "validator.training-operator.kubeflow.org"
CERT_DIR: Final = "/tmp/k8s-webhook-server"


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


@dataclass(frozen=True)
class Ports:
    webhook: int
    health: int


@dataclass(frozen=True)
class ControllerSpec:
    """A Kubeflow-style controller manager with webhooks whose certificates it rotates itself."""

    name: str  # for logs and errors
    binary: Callable[[], Path]
    namespace: str
    service: str  # the webhook Service its certificate names (<service>.<namespace>.svc)
    secret: str  # the Secret its rotator fills (shipped empty, as the release manifests do)
    webhooks: Callable[[], list[dict[str, Any]]]  # the webhook configurations, named as released
    command: Callable[[Path, Ports, Path], list[str]]  # (binary, ports, workdir) -> argv


class WebhookedController:
    """One controller process, with its namespace, Service, endpoint, Secret and webhooks."""

    def __init__(
        self, spec: ControllerSpec, plane: ControlPlane, api: Api, host_ip: str, workdir: Path
    ) -> None:
        self.spec, self.plane, self.api, self.host_ip = spec, plane, api, host_ip
        self.workdir = workdir / spec.name
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.process: subprocess.Popen[bytes] | None = None
        self.log = self.workdir / f"{spec.name}.log"
        self.certs = self.workdir / "serving-certs"
        self._stopped = threading.Event()

    def start(self, timeout: float = 90.0) -> None:
        spec = self.spec
        binary = spec.binary()
        ports = Ports(webhook=free_port(), health=free_port())
        self._create("/api/v1/namespaces", {"metadata": {"name": spec.namespace}})
        port = {"name": "webhook", "port": 443, "targetPort": ports.webhook, "protocol": "TCP"}
        self._create(f"/api/v1/namespaces/{spec.namespace}/services",
                     {"metadata": {"name": spec.service}, "spec": {"ports": [port]}})  # fmt: skip
        self._create(f"/api/v1/namespaces/{spec.namespace}/endpoints", {
            "metadata": {"name": spec.service},
            "subsets": [{"addresses": [{"ip": self.host_ip}],
                         "ports": [{"name": "webhook", "port": ports.webhook, "protocol": "TCP"}]}],
        })  # fmt: skip
        self._create(f"/api/v1/namespaces/{spec.namespace}/secrets", {"metadata": {"name": spec.secret}})
        for configuration in spec.webhooks():
            plural = configuration["kind"].lower() + "s"
            self._create(f"/apis/admissionregistration.k8s.io/v1/{plural}", configuration)
        self.certs.mkdir(parents=True, exist_ok=True)
        private_tmp = (f"mkdir -p {CERT_DIR} && mount -t tmpfs -o size=1m certs {CERT_DIR} && "
                       f"mkdir {CERT_DIR}/serving-certs && mount --bind {self.certs} {CERT_DIR}/serving-certs && "
                       'exec "$@"')  # fmt: skip
        threading.Thread(target=self._project_secret, daemon=True, name=f"{spec.name}-cert-volume").start()
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c", private_tmp, "sh",
                 *spec.command(binary, ports, self.workdir)],
                env={**os.environ, "MY_POD_NAMESPACE": spec.namespace, "KUBECONFIG": str(self.plane.kubeconfig)},
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{spec.name} exited with {self.process.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{ports.health}/readyz", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{spec.name} was not ready after {timeout:g}s:\n{self.tail()}")

    def _project_secret(self) -> None:
        """What kubelet's secret volume does for the Deployment: the rotator writes its Secret and
        then waits for the files to appear in its cert directory."""
        written: dict[str, str] = {}
        while not self._stopped.wait(0.5):
            try:
                data = (
                    self.api.request(
                        "GET", f"/api/v1/namespaces/{self.spec.namespace}/secrets/{self.spec.secret}"
                    ).get("data")
                    or {}
                )
            except (HttpError, OSError):
                continue
            for key, value in data.items():
                if written.get(key) != value:
                    (self.certs / f".{key}").write_bytes(base64.b64decode(value))
                    (self.certs / f".{key}").rename(self.certs / key)
                    written[key] = value

    def _create(self, path: str, body: dict[str, Any]) -> None:
        try:
            self.api.request("POST", path, body)
        except HttpError as exc:
            if exc.status != 409:
                raise

    def tail(self, lines: int = 40) -> str:
        return (
            "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:]) if self.log.exists() else ""
        )

    def stop(self) -> None:
        self._stopped.set()
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


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
    ],
)  # fmt: skip


def training_operator(plane: ControlPlane, api: Api, host_ip: str, workdir: Path) -> WebhookedController:
    return WebhookedController(TRAINING_OPERATOR, plane, api, host_ip, workdir)
