"""Using the real control plane from tests: a small REST client, kubectl, the operator process.

The REST client is the admin's (client certificate, ``system:masters``): the tests read what
the API server stored and play the parts nobody runs here (the training-operator writing a
PyTorchJob's status, a kubelet reporting pods). Everything a user does goes through the
``kubectl`` built with the control plane.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

import yaml

from support.paths import ROOT
from support.plane.controlplane import ControlPlane, free_port, kubeconfig
from support.tools.helm import CHART, RELEASE, RELEASE_NAMESPACE, helm, value_args
from support.waiting import wait_for

GPUOP: Final = str(Path(sys.executable).with_name("gpuop"))
KUBEFLOW_CRD: Final = ROOT / "tests" / "reference" / "kubeflow.org_pytorchjobs.yaml"
# Kubeflow Trainer v2.3.0's CRDs: the TrainJob and both runtime kinds, as its release installs them.
TRAINER_CRDS: Final = tuple(
    ROOT / "tests" / "reference" / f"trainer.kubeflow.org_{plural}.yaml"
    for plural in ("trainjobs", "trainingruntimes", "clustertrainingruntimes")
)
OUR_CRD: Final = ROOT / "crds" / "gputraining.yaml"

# API paths of the kinds the tests touch, by a short name.
PATHS: Final = {
    "gputrainings": "/apis/gpuop.io/v1alpha1",
    "pytorchjobs": "/apis/kubeflow.org/v1",
    "trainjobs": "/apis/trainer.kubeflow.org/v1alpha1",
    "trainingruntimes": "/apis/trainer.kubeflow.org/v1alpha1",
    "pods": "/api/v1",
    "nodes": "/api/v1",
    "configmaps": "/api/v1",
    "secrets": "/api/v1",
    "events": "/api/v1",
    "serviceaccounts": "/api/v1",
    "namespaces": "/api/v1",
    "services": "/api/v1",
    "deployments": "/apis/apps/v1",
    "jobs": "/apis/batch/v1",
    "clusterroles": "/apis/rbac.authorization.k8s.io/v1",
    "clusterrolebindings": "/apis/rbac.authorization.k8s.io/v1",
    "customresourcedefinitions": "/apis/apiextensions.k8s.io/v1",
}
CLUSTER_SCOPED: Final = frozenset(
    {"namespaces", "nodes", "clusterroles", "clusterrolebindings", "customresourcedefinitions"}
)


class HttpError(Exception):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"{status}: {body[:500]}")
        self.status = status
        self.body = body


class Api:
    """The admin's REST client: JSON in, JSON out, errors as :class:`HttpError`."""

    def __init__(self, plane: ControlPlane) -> None:
        self.server = plane.server
        self.context = ssl.create_default_context(cafile=str(plane.ca.cert))
        self.context.load_cert_chain(str(plane.pki / "admin.crt"), str(plane.pki / "admin.key"))
        # One opener, with no proxies: urlopen(context=...) builds an opener per call, whose
        # ProxyHandler reads the environment by iterating os.environ, and a thread of the node
        # agent doing so while pytest removes PYTEST_CURRENT_TEST between phases got KeyError
        # (seen once in a clean-clone run). Loopback needs no proxy.
        self._opener = urllib.request.build_opener(
            urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=self.context)
        )

    def request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.server + path, data=data, method=method)
        request.add_header("Accept", "application/json")
        if data is not None:
            request.add_header("Content-Type", content_type)
        # 429 with Retry-After is the API server asking to be asked again (a CRD's storage
        # still initializing, seconds after it was made): client-go waits and retries, as here.
        for attempt in range(10):
            try:
                with self._opener.open(request, timeout=30) as reply:
                    text = reply.read()
                break
            except urllib.error.HTTPError as exc:
                retry_after = exc.headers.get("Retry-After")
                if exc.code != 429 or retry_after is None or attempt == 9:
                    raise HttpError(exc.code, exc.read().decode(errors="replace")) from None
                time.sleep(min(float(retry_after), 5.0))
        return json.loads(text) if text else None

    @staticmethod
    def path(resource: str, namespace: str | None = "default", name: str | None = None) -> str:
        base = PATHS[resource]
        scope = "" if resource in CLUSTER_SCOPED or namespace is None else f"/namespaces/{namespace}"
        return f"{base}{scope}/{resource}" + (f"/{name}" if name else "")

    def get(self, resource: str, name: str, namespace: str | None = "default") -> dict[str, Any] | None:
        return self.get_at(self.path(resource, namespace, name))

    def get_at(self, path: str) -> dict[str, Any] | None:
        """The object at an API path (one of a resource :data:`PATHS` does not name); None when
        there is none."""
        try:
            body: dict[str, Any] = self.request("GET", path)
        except HttpError as exc:
            if exc.status == 404:
                return None
            raise
        return body

    def list(self, resource: str, namespace: str | None = "default", selector: str | None = None
             ) -> list[dict[str, Any]]:  # fmt: skip
        query = f"?labelSelector={urllib.parse.quote(selector)}" if selector else ""
        items: list[dict[str, Any]] = self.request("GET", self.path(resource, namespace) + query)["items"]
        return items

    def create(
        self, resource: str, body: Mapping[str, Any], namespace: str | None = "default"
    ) -> dict[str, Any]:
        created: dict[str, Any] = self.request("POST", self.path(resource, namespace), body)
        return created

    def patch_status(self, resource: str, name: str, status: Mapping[str, Any], namespace: str = "default"
                     ) -> dict[str, Any]:  # fmt: skip
        patched: dict[str, Any] = self.request(
            "PATCH", self.path(resource, namespace, name) + "/status", {"status": status},
            "application/merge-patch+json",
        )  # fmt: skip
        return patched

    def delete(self, resource: str, name: str, namespace: str | None = "default") -> None:
        try:
            self.request("DELETE", self.path(resource, namespace, name))
        except HttpError as exc:
            if exc.status != 404:
                raise


def apply_file(plane: ControlPlane, path: Path) -> str:
    """``kubectl apply --server-side`` of a file; returns what kubectl said on stderr (warnings)."""
    result = plane.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(path))
    return result.stderr


def _established(plane: ControlPlane, crd: str, jsonpath: str) -> bool:
    return plane.kubectl("get", "crd", crd, "-o", jsonpath).stdout == "True"


def install_crds(plane: ControlPlane, paths: Iterable[Path] = (OUR_CRD, KUBEFLOW_CRD, *TRAINER_CRDS)) -> str:
    """Create the CRDs and wait until each is Established; returns kubectl's warnings, if any."""
    paths = list(paths)
    warnings = "".join(apply_file(plane, path) for path in paths)
    names = [doc["metadata"]["name"] for path in paths for doc in yaml.safe_load_all(path.read_text()) if doc]
    jsonpath = 'jsonpath={.status.conditions[?(@.type=="Established")].status}'
    for name in names:  # `kubectl wait` fails outright on a CRD whose status is not written yet
        wait_for(f"CRD {name} Established", functools.partial(_established, plane, name, jsonpath))
    return warnings


def service_account_kubeconfig(plane: ControlPlane, namespace: str, name: str, path: Path) -> Path:
    """A kubeconfig for a ServiceAccount, with a token from the TokenRequest API (as a pod's)."""
    token = plane.kubectl("create", "token", name, "-n", namespace, "--duration=2h").stdout.strip()
    path.write_text(kubeconfig(plane.server, plane.ca.cert, user=f"{namespace}:{name}", token=token))
    return path


class OperatorProcess:
    """``gpuop operator`` in a subprocess, logged in with a kubeconfig; killable at any moment."""

    def __init__(
        self, kubeconfig_path: Path, workdir: Path, env: Mapping[str, str] | None = None, *,
        report_port: int | None = None,
    ) -> None:  # fmt: skip
        self.kubeconfig = kubeconfig_path
        self.workdir = workdir
        self.extra_env = dict(env or {})
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.args: tuple[str, ...] = ()
        self.report_port = report_port

    def start(self, *args: str) -> subprocess.Popen[bytes]:
        if args:
            self.args = args
        self.starts += 1
        log = (self.workdir / f"operator-{self.starts}.log").open("wb")
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), "PYTHONUNBUFFERED": "1", **self.extra_env}
        if "GPUOP_REPORT_URL" in env:
            # In a cluster every replica's pod has its own IP and listens on the chart's port;
            # here they share the host: a port given (the one trainers are told), else a free one.
            env["GPUOP_REPORT_PORT"] = str(self.report_port or free_port())
        self.process = subprocess.Popen(
            [GPUOP, "operator", "--metrics-port", "0", "--health-port", "0", *self.args],
            env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        return self.process

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()

    def log(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.workdir.glob("operator-*.log")))


@dataclass(frozen=True)
class Installed:
    """What the chart's Deployment would run: its container's environment and its ServiceAccount."""

    env: dict[str, str]
    service_account: str
    # When this install began, as the audit log stamps requests: the ServiceAccount's name is
    # the same for every install of the release, and an earlier suite's operator used it too.
    since: str = ""

    @property
    def user(self) -> str:
        return f"system:serviceaccount:{RELEASE_NAMESPACE}:{self.service_account}"


def install_chart(plane: ControlPlane, values: Mapping[str, Any], chart: Sequence[str] = ()) -> Installed:
    """``helm upgrade --install`` of the chart (adopting a CRD applied before it), and what its
    Deployment would run; :class:`OperatorProcess` runs that with the ServiceAccount's token.

    ``chart``: helm's words for where the chart comes from (``oci://...``, ``--version``,
    ``--ca-file``: what a release pushed, :class:`support.fixtures.Released`); else this tree's."""
    since = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    plane.kubectl("label", "crd", "gputrainings.gpuop.io", "app.kubernetes.io/managed-by=Helm", "--overwrite")
    plane.kubectl("annotate", "crd", "gputrainings.gpuop.io", f"meta.helm.sh/release-name={RELEASE}",
                  f"meta.helm.sh/release-namespace={RELEASE_NAMESPACE}", "--overwrite")  # fmt: skip
    config = ["--kubeconfig", str(plane.kubeconfig)]
    helm("upgrade", "--install", RELEASE, *(chart or [str(CHART)]), "-n", RELEASE_NAMESPACE, "--create-namespace",
         *value_args(dict(values)), *config)  # fmt: skip
    manifest = helm("get", "manifest", RELEASE, "-n", RELEASE_NAMESPACE, *config).stdout
    deployment = next(d for d in yaml.safe_load_all(manifest) if d and d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["args"] == ["operator"]
    env = {e["name"]: str(e["value"]) for e in container["env"] if "value" in e}
    env["POD_ID"] = "gpu-training-operator-5d4f8-x2x9q"  # its pod's name: stable across restarts
    if "GPUOP_REPORT_TLS_DIR" in env:
        env["GPUOP_REPORT_TLS_DIR"] = str(_mounted_secret(plane, pod, "report-tls"))
    return Installed(env, pod["serviceAccountName"], since)


def _mounted_secret(plane: ControlPlane, pod: Mapping[str, Any], volume: str) -> Path:
    """A Secret volume of the chart's pod as kubelet would mount it: its keys as files."""
    source = next(v for v in pod["volumes"] if v["name"] == volume)["secret"]
    reply = plane.kubectl("get", "secret", source["secretName"], "-n", RELEASE_NAMESPACE, "-o", "json")
    secret = json.loads(reply.stdout)
    directory: Path = plane.workdir / "mounts" / str(source["secretName"])
    directory.mkdir(parents=True, exist_ok=True)
    for key, value in secret["data"].items():
        (directory / key).write_bytes(base64.b64decode(value))
    return directory


def pod_ready(pod: Mapping[str, Any] | None) -> bool:
    """Whether a pod has container statuses and every container in them is Ready."""
    statuses = (pod or {}).get("status", {}).get("containerStatuses") or []
    return bool(statuses) and all(s.get("ready") for s in statuses)


def ready_operator_pod(api: Api) -> dict[str, Any] | None:
    """The chart's operator pod once every container of it is Ready (its readiness probe is the
    operator's /healthz), or None: for the suites and `make cluster` that run it on a node."""
    return next((dict(found) for found in api.list("pods", RELEASE_NAMESPACE) if pod_ready(found)), None)


def uninstall_chart(plane: ControlPlane) -> None:
    """``helm uninstall``, the release's namespace deleted and gone (a later install creates
    one of that name), and the CRD as :func:`install_chart` found it: uninstall keeps it (the
    chart's resource-policy) with Helm's ownership on it, which install_chart had put there."""
    config = ["--kubeconfig", str(plane.kubeconfig)]
    helm("uninstall", RELEASE, "-n", RELEASE_NAMESPACE, "--ignore-not-found", *config)
    plane.kubectl(
        "delete", "namespace", RELEASE_NAMESPACE, "--ignore-not-found", "--wait=true", "--timeout=90s"
    )
    crd = "crd/gputrainings.gpuop.io"
    plane.kubectl("label", crd, "app.kubernetes.io/managed-by-")
    plane.kubectl("annotate", crd, "meta.helm.sh/release-name-", "meta.helm.sh/release-namespace-")
