"""The progress-report endpoint against the real kube-apiserver: real ServiceAccount tokens from
the TokenRequest API, bound to real Pod objects (nothing runs them: the pods only need to
exist), reviewed by the real TokenReview API with each training's audience.

The ReportServer (gpuop.observing.endpoint) runs in the test process over HTTPS with a
ClusterGate (gpuop.controller.receiver) on a ``Kube`` logged in with the plane's admin
kubeconfig. What only the real API server decides is what these tests are for: that a token
minted for one audience is refused for another, that a pod-bound token's review names its pod
and uid, that a token outlives nothing of its pod, and that a token bound to no pod carries no pod.
"""

from __future__ import annotations

import http.client
import json
import logging
import math
import secrets
import socket
import ssl
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from gpuop.api.identity import TRAINING_LABEL, report_audience, report_path
from gpuop.controller.apiclient import Backoff
from gpuop.controller.credentials import from_kubeconfig
from gpuop.controller.kube import Kube
from gpuop.controller.receiver import ClusterGate
from gpuop.observing.endpoint import Limits, ReportBook, ReportServer
from gpuop.observing.reports import MAX_REPORT_BYTES
from support.plane.cluster import Api
from support.plane.controlplane import ControlPlane
from support.tls import serving_directory
from support.waiting import wait_for

ACCOUNT = "trainer"
A, B = "llama-a", "llama-b"  # two GpuTrainings (only their names matter: the pods carry them)
POD_NAME = "authentication.kubernetes.io/pod-name"
POD_UID = "authentication.kubernetes.io/pod-uid"
LOGGER = "gpuop.observing.endpoint"
REPORT = json.dumps({
    "trainerStatus": {
        "progressPercentage": 41, "estimatedRemainingSeconds": 873, "lastUpdatedTime": "2026-11-21T12:00:00Z",
        "metrics": [{"name": "loss", "value": "0.69"}, {"name": "current_step", "value": "615"},
                    {"name": "total_steps", "value": "1500"}, {"name": "current_epoch", "value": "1.23"}],
    }
}).encode()  # fmt: skip


@dataclass
class Cluster:
    """The module's namespace, its ServiceAccount and pods, and the admin's clients."""

    api: Api
    kube: Kube
    namespace: str
    uids: dict[str, str] = field(default_factory=dict)  # pod -> uid

    def pod(self, name: str, training: str) -> str:
        created = self.api.create("pods", {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": self.namespace, "labels": {TRAINING_LABEL: training}},
            "spec": {"serviceAccountName": ACCOUNT, "containers": [{"name": "trainer", "image": "trainer:never-run"}]},
        }, self.namespace)  # fmt: skip
        self.uids[name] = created["metadata"]["uid"]
        return name

    def token(self, *, audience: str, pod: str | None) -> str:
        """A TokenRequest for the ServiceAccount, bound to ``pod`` when given (as the kubelet
        asks for a projected volume's token)."""
        spec: dict[str, Any] = {"audiences": [audience], "expirationSeconds": 600}
        if pod is not None:
            spec["boundObjectRef"] = {"apiVersion": "v1", "kind": "Pod", "name": pod, "uid": self.uids[pod]}
        request = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec}
        path = f"/api/v1/namespaces/{self.namespace}/serviceaccounts/{ACCOUNT}/token"
        token: str = self.api.request("POST", path, request)["status"]["token"]
        return token

    def url(self, training: str) -> str:
        return report_path(self.namespace, training)


@pytest.fixture(scope="module")
def cluster(plane: ControlPlane, api: Api) -> Iterator[Cluster]:
    kube = Kube(from_kubeconfig(str(plane.kubeconfig)), backoff=Backoff(attempts=2, base_seconds=0.01))
    namespace = f"reports-{secrets.token_hex(3)}"
    api.create("namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}, None)
    api.create("serviceaccounts", {"apiVersion": "v1", "kind": "ServiceAccount",
                                   "metadata": {"name": ACCOUNT, "namespace": namespace}}, namespace)  # fmt: skip
    made = Cluster(api, kube, namespace)
    made.pod(f"{A}-0", A)
    made.pod(f"{B}-0", B)
    yield made
    api.delete("namespaces", namespace, None)


@dataclass
class Served:
    server: ReportServer
    book: ReportBook
    context: ssl.SSLContext

    def post(self, path: str, token: str | None, body: bytes = REPORT) -> int:
        connection = http.client.HTTPSConnection(
            "127.0.0.1", self.server.port, timeout=10, context=self.context
        )
        headers = {"Content-Type": "application/json"}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        try:
            connection.request("POST", path, body=body, headers=headers)
            reply = connection.getresponse()
            reply.read()
            return reply.status
        finally:
            connection.close()


def _serve(cluster: Cluster, limits: Limits, tls_dir: Path) -> Served:
    book = ReportBook()
    server = ReportServer(ClusterGate(cluster.kube, limits), book, port=0, host="127.0.0.1", tls_dir=tls_dir)
    server.start()
    return Served(server, book, ssl.create_default_context(cafile=str(tls_dir / "ca.crt")))


@pytest.fixture(scope="module")
def tls_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return serving_directory(tmp_path_factory.mktemp("report-tls"))


@pytest.fixture(scope="module")
def served(cluster: Cluster, tls_dir: Path) -> Iterator[Served]:
    """The endpoint as the operator runs it: the default Limits."""
    served = _serve(cluster, Limits(), tls_dir)
    yield served
    served.server.close()


@pytest.fixture(scope="module")
def unremembering(cluster: Cluster, tls_dir: Path) -> Iterator[Served]:
    """The endpoint reviewing every request (no TTL), with no rate to meet and a 1 s deadline."""
    served = _serve(cluster, Limits(review_ttl_seconds=0, burst=1000, reports_per_second=1000, request_seconds=1.0),
                    tls_dir)  # fmt: skip
    yield served
    served.server.close()


def test_the_review_of_a_pod_bound_token_names_its_pod_and_uid(cluster: Cluster) -> None:
    pod = f"{A}-0"
    token = cluster.token(audience=report_audience(cluster.namespace, A), pod=pod)
    review = cluster.kube.review_token(token, report_audience(cluster.namespace, A), 5)
    assert review["authenticated"] is True
    assert review["audiences"] == [report_audience(cluster.namespace, A)]
    assert review["user"]["username"] == f"system:serviceaccount:{cluster.namespace}:{ACCOUNT}"
    assert review["user"]["extra"][POD_NAME] == [pod]
    assert review["user"]["extra"][POD_UID] == [cluster.uids[pod]]
    # The same token asked about for B's audience: the API server itself refuses it.
    other = cluster.kube.review_token(token, report_audience(cluster.namespace, B), 5)
    assert not other.get("authenticated")
    assert other.get("error")
    # A token bound to no pod carries no pod.
    unbound = cluster.token(audience=report_audience(cluster.namespace, A), pod=None)
    extra = (
        cluster.kube.review_token(unbound, report_audience(cluster.namespace, A), 5)["user"].get("extra")
        or {}
    )
    assert POD_NAME not in extra


def test_a_pods_own_token_is_accepted(cluster: Cluster, served: Served) -> None:
    token = cluster.token(audience=report_audience(cluster.namespace, A), pod=f"{A}-0")
    assert served.post(cluster.url(A), token) == 200
    [received] = served.book.of((cluster.namespace, A))
    assert received.pod == f"{A}-0"
    assert (received.report.step, received.report.total_steps, received.report.epoch) == (615, 1500, 2)
    assert served.book.of((cluster.namespace, B)) == ()


def test_refusals_the_real_api_server_decides(cluster: Cluster, served: Served) -> None:
    ns = cluster.namespace
    b_token = cluster.token(audience=report_audience(ns, B), pod=f"{B}-0")
    assert served.post(cluster.url(A), None) == 401  # no token
    assert served.post(cluster.url(A), secrets.token_urlsafe(40)) == 401  # no token the API server made
    assert served.post(cluster.url(A), b_token) == 401  # B's token at A's URL: wrong audience
    assert served.post(cluster.url(B), b_token) == 200  # ... and good at B's
    # Minted with A's audience, but bound to B's pod: the API server vouches; the pod is not A's.
    assert served.post(cluster.url(A), cluster.token(audience=report_audience(ns, A), pod=f"{B}-0")) == 403
    # The ServiceAccount's token with A's audience, bound to no pod.
    assert served.post(cluster.url(A), cluster.token(audience=report_audience(ns, A), pod=None)) == 403
    assert {r.pod for r in served.book.of((ns, A))} <= {f"{A}-0"}  # never B's pod
    assert [r.pod for r in served.book.of((ns, B))] == [f"{B}-0"]


def test_a_token_whose_pod_is_deleted_is_refused(cluster: Cluster, unremembering: Served) -> None:
    pod = cluster.pod(f"{A}-doomed", A)
    token = cluster.token(audience=report_audience(cluster.namespace, A), pod=pod)
    assert unremembering.post(cluster.url(A), token) == 200
    cluster.api.delete("pods", pod, cluster.namespace)  # no node: deleted at once
    # The API server's token authenticator reads pods from its informer cache: a moment later.
    wait_for(
        "the deleted pod's token refused",
        lambda: unremembering.post(cluster.url(A), token) == 401,
        timeout=20,
    )


def test_bodies_out_of_bounds(cluster: Cluster, served: Served) -> None:
    token = cluster.token(audience=report_audience(cluster.namespace, A), pod=f"{A}-0")
    over = b" " * (MAX_REPORT_BYTES + 1 - len(REPORT)) + REPORT
    assert served.post(cluster.url(A), token, over) == 413
    metrics = [{"name": f"m{i}", "value": "1"} for i in range(300)]
    assert (
        served.post(cluster.url(A), token, json.dumps({"trainerStatus": {"metrics": metrics}}).encode())
        == 400
    )
    assert served.post(cluster.url(A), token, b'{"trainerStatus": {"progressPercentage": NaN}}') == 400


def test_a_flood_from_one_pod_is_rate_limited_and_logged_once(
    cluster: Cluster, served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    token = cluster.token(audience=report_audience(cluster.namespace, A), pod=f"{A}-0")
    burst, started = Limits().burst, time.monotonic()
    statuses = [served.post(cluster.url(A), token) for _ in range(50)]
    refilled = math.ceil((time.monotonic() - started) * Limits().reports_per_second)
    assert statuses[:burst] == [200] * burst
    assert statuses.count(200) <= burst + refilled
    assert statuses.count(429) == 50 - statuses.count(200)
    refused = [r.getMessage() for r in caplog.records if r.name == LOGGER and "429" in r.getMessage()]
    assert len(refused) == 1, refused


def test_a_slow_client_is_cut_off(cluster: Cluster, unremembering: Served) -> None:
    token = cluster.token(audience=report_audience(cluster.namespace, A), pod=f"{A}-0")
    head = (f"POST {cluster.url(A)} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
            f"Content-Length: {len(REPORT)}\r\n\r\n").encode() + REPORT  # fmt: skip
    plain = socket.create_connection(("127.0.0.1", unremembering.server.port), timeout=5)
    with unremembering.context.wrap_socket(plain, server_hostname="127.0.0.1") as connection:
        connection.settimeout(0.5)  # a byte every 0.5 s, under the 1 s deadline
        started, closed_after = time.monotonic(), None
        for byte in head[:20]:
            try:
                connection.sendall(bytes([byte]))
                answer = connection.recv(1)
            except TimeoutError:
                continue
            except (ssl.SSLEOFError, ConnectionResetError, BrokenPipeError):
                answer = b""
            assert answer == b""
            closed_after = time.monotonic() - started
            break
    assert closed_after is not None, "never cut off"
    assert closed_after < 1.0 + 1.0
