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
    version = gobuild.required_version(MODULE, "github.com/kubeflow/training-operator")
    return gobuild.Recipe(
        name="kubeflow",
        module=MODULE,
        packages={"training-operator": "github.com/kubeflow/training-operator/cmd/training-operator.v1"},
        label=f"training-operator-{version}",
        cold_cost="measured 1.2 min on 2 cores with the control plane's modules already cached",
        renames={"training-operator.v1": "training-operator"},
    )


def ensure_binary() -> Path:
    return gobuild.ensure(recipe()) / "training-operator"


def webhook_configuration() -> dict[str, Any]:
    """Upstream's pytorchjob webhook, with the names the release manifests give it."""
    upstream = next(d for d in yaml.safe_load_all(WEBHOOKS.read_text()) if d)
    hook = next(w for w in upstream["webhooks"] if w["name"].startswith("validator.pytorchjob."))
    hook["clientConfig"]["service"].update(name=SERVICE, namespace=NAMESPACE, port=443)
    return {"apiVersion": upstream["apiVersion"], "kind": upstream["kind"],
            "metadata": {"name": WEBHOOK_CONFIGURATION}, "webhooks": [hook]}  # fmt: skip


class TrainingOperator:
    """The training-operator process, with its namespace, Service, endpoint and webhook."""

    def __init__(self, plane: ControlPlane, api: Api, host_ip: str, workdir: Path) -> None:
        self.plane, self.api, self.host_ip, self.workdir = plane, api, host_ip, workdir
        self.process: subprocess.Popen[bytes] | None = None
        self.log = workdir / "training-operator.log"
        self.certs = workdir / "serving-certs"
        self._stopped = threading.Event()

    def start(self, timeout: float = 90.0) -> None:
        binary = ensure_binary()
        webhook_port, health_port = free_port(), free_port()
        self._create("/api/v1/namespaces", {"metadata": {"name": NAMESPACE}})
        port = {"name": "webhook", "port": 443, "targetPort": webhook_port, "protocol": "TCP"}
        self._create(f"/api/v1/namespaces/{NAMESPACE}/services",
                     {"metadata": {"name": SERVICE}, "spec": {"ports": [port]}})  # fmt: skip
        self._create(f"/api/v1/namespaces/{NAMESPACE}/endpoints", {
            "metadata": {"name": SERVICE},
            "subsets": [{"addresses": [{"ip": self.host_ip}],
                         "ports": [{"name": "webhook", "port": webhook_port, "protocol": "TCP"}]}],
        })  # fmt: skip
        # Empty, as manifests/base/deployment.yaml ships it: the rotator fills it, never creates it.
        self._create(f"/api/v1/namespaces/{NAMESPACE}/secrets", {"metadata": {"name": SECRET}})
        self._create(
            "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations", webhook_configuration()
        )
        command = [
            str(binary), f"--kubeconfig={self.plane.kubeconfig}", "--enable-scheme=pytorchjob",
            f"--webhook-server-port={webhook_port}", f"--health-probe-bind-address=127.0.0.1:{health_port}",
            "--metrics-bind-address=0", "--leader-elect=false", "--zap-log-level=info",
        ]  # fmt: skip
        self.certs.mkdir(parents=True, exist_ok=True)
        private_tmp = (f"mkdir -p {CERT_DIR} && mount -t tmpfs -o size=1m certs {CERT_DIR} && "
                       f"mkdir {CERT_DIR}/serving-certs && mount --bind {self.certs} {CERT_DIR}/serving-certs && "
                       'exec "$@"')  # fmt: skip
        threading.Thread(target=self._project_secret, daemon=True, name="webhook-cert-volume").start()
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c", private_tmp, "sh",
                 *command],
                env={**os.environ, "MY_POD_NAMESPACE": NAMESPACE}, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the training-operator exited with {self.process.returncode}:\n{self.tail()}"
                )
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{health_port}/readyz", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the training-operator was not ready after {timeout:g}s:\n{self.tail()}")

    def _project_secret(self) -> None:
        """What kubelet's secret volume does for the Deployment: the rotator writes its Secret and
        then waits for the files to appear in its cert directory."""
        written: dict[str, str] = {}
        while not self._stopped.wait(0.5):
            try:
                data = (
                    self.api.request("GET", f"/api/v1/namespaces/{NAMESPACE}/secrets/{SECRET}").get("data")
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
