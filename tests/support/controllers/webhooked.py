"""A Kubeflow-style controller manager run against the control plane with its webhooks: its
namespace, Service and endpoint (the test host's address, which the API server dials), the
Secret its own cert rotator fills, its webhook configurations as released, and its process.

The training-operator, Trainer v2, JobSet and Kueue all run this way
(:mod:`support.controllers.trainingoperator`, :mod:`~support.controllers.trainerv2`,
:mod:`~support.controllers.kueue`).
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

from support.controllers import incluster
from support.plane.cluster import Api, HttpError
from support.plane.controlplane import ControlPlane, free_port

CERT_DIR: Final = "/tmp/k8s-webhook-server"


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
    # The ServiceAccount whose in-cluster files it reads, with the kubernetes Service by name
    # (support.controllers.incluster); None for one that needs neither.
    service_account: str | None = None


# Starts on new ports when one picked was taken before the controller bound it.
PORT_TRIES: Final = 3


class PortTakenError(RuntimeError):
    """The controller exited because a port picked for it was taken meanwhile."""


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
        self.proxy: incluster.ServiceProxy | None = None

    def start(self, timeout: float = 90.0) -> None:
        """Start it; again after :meth:`stop` too (on new ports, its endpoint moved to them).

        Its ports are free when picked and taken only as it binds them: a port of the ephemeral
        range may go to another process's connection in between ("bind: address already in
        use"). It then starts again on new ports, as the control plane's components do
        (:class:`~support.plane.controlplane.StartError`)."""
        for attempt in range(1, PORT_TRIES + 1):
            try:
                self._start_once(timeout)
                return
            except PortTakenError:
                self.stop()
                if attempt == PORT_TRIES:
                    raise

    def _start_once(self, timeout: float) -> None:
        spec = self.spec
        binary = spec.binary()
        ports = Ports(webhook=free_port(), health=free_port())
        self._stopped.clear()
        self._create("/api/v1/namespaces", {"metadata": {"name": spec.namespace}})
        port = {"name": "webhook", "port": 443, "targetPort": ports.webhook, "protocol": "TCP"}
        self._create(f"/api/v1/namespaces/{spec.namespace}/services",
                     {"metadata": {"name": spec.service}, "spec": {"ports": [port]}})  # fmt: skip
        endpoints = {
            "metadata": {"name": spec.service},
            "subsets": [{"addresses": [{"ip": self.host_ip}],
                         "ports": [{"name": "webhook", "port": ports.webhook, "protocol": "TCP"}]}],
        }  # fmt: skip
        self._create(f"/api/v1/namespaces/{spec.namespace}/endpoints", endpoints)
        # An endpoint left by an earlier start names its old port: point it at this one.
        self.api.request("PUT", f"/api/v1/namespaces/{spec.namespace}/endpoints/{spec.service}", endpoints)
        self._create(f"/api/v1/namespaces/{spec.namespace}/secrets", {"metadata": {"name": spec.secret}})
        for configuration in spec.webhooks():
            self._create(_webhooks_path(configuration), configuration)
        self.certs.mkdir(parents=True, exist_ok=True)
        private_tmp = (f"mkdir -p {CERT_DIR} && mount -t tmpfs -o size=1m certs {CERT_DIR} && "
                       f"mkdir {CERT_DIR}/serving-certs && mount --bind {self.certs} {CERT_DIR}/serving-certs && "
                       'exec "$@"')  # fmt: skip
        env = {**os.environ, "MY_POD_NAMESPACE": spec.namespace, "KUBECONFIG": str(self.plane.kubeconfig)}
        if spec.service_account is not None:
            files = incluster.ServiceAccountFiles(
                self.plane, self.api, spec.namespace, spec.service_account, self.workdir / "serviceaccount"
            )
            private_tmp = f"{files.mount()} && {private_tmp}"
            self.proxy = incluster.ServiceProxy(self.plane)
            env.update(self.proxy.environment())
        threading.Thread(target=self._project_secret, daemon=True, name=f"{spec.name}-cert-volume").start()
        said_before = self.log.stat().st_size if self.log.exists() else 0
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c", private_tmp, "sh",
                 *spec.command(binary, ports, self.workdir)],
                env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                said = self.log.read_bytes()[said_before:].decode(errors="replace")
                failed = PortTakenError if "address already in use" in said else RuntimeError
                raise failed(f"{spec.name} exited with {self.process.returncode}:\n{self.tail()}")
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
        if self.proxy is not None:
            self.proxy.close()
            self.proxy = None

    def retire(self) -> None:
        """Stop it and take its webhook configurations away: for a module that runs it for a while
        in a session that goes on without it. Upstream's webhooks fail closed, so left behind
        they would refuse every job of their kind while nobody serves them. Its namespace,
        Service, endpoint and Secret stay for a later :meth:`start`."""
        self.stop()
        for configuration in self.spec.webhooks():
            try:
                self.api.request(
                    "DELETE", f"{_webhooks_path(configuration)}/{configuration['metadata']['name']}"
                )
            except HttpError as exc:
                if exc.status != 404:
                    raise


def _webhooks_path(configuration: dict[str, Any]) -> str:
    """Where a Validating- or MutatingWebhookConfiguration is created (its collection)."""
    return f"/apis/admissionregistration.k8s.io/v1/{configuration['kind'].lower()}s"
