"""The one module that talks to the Kubernetes API (Kopf's watch of GpuTrainings aside).

Objects travel as plain JSON dicts: the operator reads a handful of fields, and the client's
generated model classes would cost a deserialisation of every pod for nothing. Of the
kubernetes client only the public surface every version from 29 on has is used: its
kubeconfig and in-cluster loaders fill a ``Configuration``, whose TLS, proxy and pool fields
and ``auth_settings()`` (which refreshes a rotating token) set up our own urllib3 pool. Its
``ApiClient`` internals changed across versions (``param_serialize`` is 36+ only: with the
Kubeflow SDK's ``kubernetes<36`` every request failed). Every call goes
through :meth:`Kube._request`, which retries what a real API server sends under load or during
a control-plane upgrade (429, 500, 502, 503, 504, timeouts, refused connections) with capped
exponential backoff and jitter, honouring ``Retry-After``. Everything else is the caller's to
decide: 404 and 409 mean something (gone; exists or conflicts), 4xx is a bug or a policy.
"""

from __future__ import annotations

import json
import logging
import random
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

import urllib3
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config

from gpuop.api.identity import (
    API_VERSION,
    GROUP,
    KIND,
    KUEUE_API_VERSIONS,
    KUEUE_JOB_UID_LABEL,
    PLURAL,
    TRAINING_LABEL,
    VERSION,
)

log = logging.getLogger(__name__)

USER_AGENT: Final = "gpuop-operator/0.1"
RETRIED_STATUSES: Final = frozenset({429, 500, 502, 503, 504})
_TRAININGS: Final = f"/apis/{GROUP}/{VERSION}/namespaces/{{ns}}/{PLURAL}"
_MERGE_PATCH: Final = "application/merge-patch+json"
# Objects per page of a list: the size of the page the API server's own clients (kubectl) ask for.
LIST_PAGE: Final = 500
# A reply of metadata only (every API server we claim, 1.29 on, serves it); plain JSON elsewhere.
_METADATA_ONLY: Final = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1,application/json"


class ApiError(Exception):
    """A non-retried error reply: ``status`` and the API server's ``reason`` and message."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


class LoginError(Exception):
    """No usable cluster credentials; the message says where the operator looked."""


@dataclass(frozen=True)
class Backoff:
    """Retry delays: base * 2**attempt, capped, with full jitter; ``attempts`` tries in all."""

    attempts: int = 8
    base_seconds: float = 0.1
    cap_seconds: float = 5.0

    def delay(self, attempt: int, retry_after: float | None) -> float:
        jittered = random.uniform(0, min(self.cap_seconds, self.base_seconds * 2**attempt))
        if retry_after is not None:
            return min(max(retry_after, jittered), 60.0)
        return jittered


class RequestCounter:
    """Requests by verb, resource and status code: the operator's metrics read it, the benchmark
    and tests too."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: dict[tuple[str, str, int], int] = {}
        self.listeners: list[Callable[[str, str, int, float], None]] = []

    def record(self, verb: str, resource: str, status: int, seconds: float) -> None:
        with self._lock:
            key = (verb, resource, status)
            self.counts[key] = self.counts.get(key, 0) + 1
        for listener in self.listeners:
            listener(verb, resource, status, seconds)


def _retry_after(headers: Mapping[str, str] | None) -> float | None:
    value = (headers or {}).get("Retry-After")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


class Kube:
    """A Kubernetes API session with the operator's verbs. Thread-safe (urllib3 pools)."""

    def __init__(
        self,
        api: k8s_client.ApiClient,
        *,
        backoff: Backoff | None = None,
        timeout_seconds: float = 30.0,
        in_cluster: bool = False,
    ) -> None:
        self.configuration = api.configuration
        self._pool = _pool(self.configuration)
        self.backoff = backoff or Backoff()
        self.timeout_seconds = timeout_seconds
        self.in_cluster = in_cluster
        self.requests = RequestCounter()

    @classmethod
    def login(cls, *, pool_size: int = 32) -> Kube:
        """Credentials the way kubectl finds them: in a pod its ServiceAccount, else KUBECONFIG."""
        configuration = k8s_client.Configuration()
        try:
            k8s_config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
            in_cluster = True
        except k8s_config.ConfigException:
            try:
                k8s_config.load_kube_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
            except (k8s_config.ConfigException, OSError) as exc:
                raise LoginError(
                    f"no cluster credentials: not in a pod, and no usable kubeconfig ({exc}); set "
                    "KUBECONFIG or run in-cluster with a ServiceAccount"
                ) from None
            in_cluster = False
        configuration.connection_pool_maxsize = pool_size
        configuration.retries = False  # retried here, for every verb, with backoff
        return cls(k8s_client.ApiClient(configuration), in_cluster=in_cluster)

    # -- the one way out ------------------------------------------------------------------

    def _request(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
        raw: bool = False,
        timeout: float | None = None,
        retried: frozenset[int] = RETRIED_STATUSES,
        attempts: int | None = None,
        accept: str | None = None,
    ) -> Any:
        if query:
            path = f"{path}?{urllib.parse.urlencode(query)}"
        accept = accept or ("*/*" if raw else "application/json")
        headers = {"Accept": accept, "User-Agent": USER_AGENT}
        if body is not None:
            headers["Content-Type"] = content_type
        payload = json.dumps(body).encode() if body is not None else None
        url = f"{self.configuration.host}{path}"
        verb, resource = request_target(method, path)
        attempts = attempts or self.backoff.attempts
        for attempt in range(attempts):
            started = time.monotonic()
            try:
                response = self._pool.request(
                    method, url, body=payload, headers=headers | _auth_header(self.configuration),
                    timeout=urllib3.Timeout(total=timeout or self.timeout_seconds), retries=False,
                )  # fmt: skip
                data = response.data
                status = response.status
                retry_after = _retry_after(response.headers)
            except (urllib3.exceptions.HTTPError, OSError) as exc:
                self.requests.record(verb, resource, 0, time.monotonic() - started)
                if attempt + 1 == attempts:
                    raise ApiError(0, "Unreachable", str(exc)) from None
                delay = self.backoff.delay(attempt, None)
                log.warning("%s %s: %s; retrying in %.1fs", method, path, exc, delay)
                time.sleep(delay)
                continue
            self.requests.record(verb, resource, status, time.monotonic() - started)
            if 200 <= status < 300:
                if raw:
                    return data.decode("utf-8", errors="replace")
                return json.loads(data) if data else None
            error = _error(status, data)
            if status in retried and attempt + 1 < attempts:
                delay = self.backoff.delay(attempt, retry_after)
                log.info("%s %s: %s; retrying in %.1fs", method, path, error, delay)
                time.sleep(delay)
                continue
            raise error
        raise AssertionError("unreachable: the loop returns or raises")

    # -- Kubeflow jobs (PyTorchJob, TrainJob) and the TrainJob's TrainingRuntime ---------

    def _get_or_none(self, path: str) -> dict[str, Any] | None:
        try:
            body: dict[str, Any] = self._request("GET", path)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise
        return body

    def create_object(self, obj: Mapping[str, Any], plural: str) -> dict[str, Any]:
        """Create a namespaced object (a custom one, or a core one such as a ConfigMap);
        ApiError 409 AlreadyExists when its name is taken.

        Returns the object as sent with the metadata the API server gave it (uid,
        resourceVersion, ...), not the object as stored: what a webhook or the CRD's schema
        defaulted or pruned comes with its watch event. The reply carries only metadata
        (PartialObjectMetadata): decoding whole PyTorchJob replies (13 KB of JSON; 8 KB as
        metadata only, most of it managedFields) took 13% of the operator's CPU in a burst
        of 1,000. The rest is ``obj``'s own values, not copies: a deep copy of each job made
        was another 6% (py-spy, the same burst), for callers that keep a slim part of it."""
        path = _objects(str(obj["apiVersion"]), plural, obj["metadata"]["namespace"])
        reply = self._request("POST", path, body=obj, accept=_METADATA_ONLY)
        metadata = (reply or {}).get("metadata")
        if not isinstance(metadata, dict) or "uid" not in metadata:
            raise ApiError(
                0, "BadReply", f"the create of {obj['kind']} {obj['metadata']['name']} replied no metadata"
            )
        return {**obj, "metadata": metadata}

    def get_object(self, api_version: str, plural: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self._get_or_none(f"{_objects(api_version, plural, namespace)}/{name}")

    def patch_object(
        self, api_version: str, plural: str, namespace: str, name: str, patch: Mapping[str, Any]
    ) -> dict[str, Any]:
        obj: dict[str, Any] = self._request(
            "PATCH",
            f"{_objects(api_version, plural, namespace)}/{name}",
            body=patch,
            content_type=_MERGE_PATCH,
        )
        return obj

    def served_resources(self, api_version: str) -> frozenset[str]:
        """The resources (plurals) the API server serves in a group/version; none when it is not
        there at all. Discovery is open to every authenticated client (system:discovery)."""
        reply = self._get_or_none(f"/apis/{api_version}")
        resources = (reply or {}).get("resources") or ()
        return frozenset(str(r.get("name")) for r in resources if isinstance(r, Mapping))

    # -- lists and watches (jobwatch) -------------------------------------------------------

    def list_objects(
        self, api_version: str, plural: str, namespace: str | None, label_selector: str
    ) -> tuple[list[dict[str, Any]], str]:
        """Every object of a kind with the label (in a namespace, or everywhere), and the
        resourceVersion to watch from. In pages of :data:`LIST_PAGE`: one reply of 1,000 jobs
        would be 15 MB of JSON, read and decoded in one piece, on the server's side too."""
        path = _objects(api_version, plural, namespace)
        query = {"labelSelector": label_selector, "limit": str(LIST_PAGE)}
        items: list[dict[str, Any]] = []
        version = ""
        while True:
            reply = self._request("GET", path, query=query) or {}
            kind = str(reply.get("kind") or "").removesuffix("List")
            for item in reply.get("items") or ():
                item.setdefault("apiVersion", api_version)  # core lists leave them out
                item.setdefault("kind", kind)
                items.append(item)
            meta = reply.get("metadata") or {}
            version = version or str(meta.get("resourceVersion") or "")
            if not meta.get("continue"):
                return items, version
            query["continue"] = str(meta["continue"])

    def watch_objects(
        self,
        api_version: str,
        plural: str,
        namespace: str | None,
        label_selector: str,
        resource_version: str,
        *,
        timeout_seconds: int,
        opened: Callable[[urllib3.BaseHTTPResponse], None] = lambda _response: None,
    ) -> Generator[dict[str, Any], None, None]:
        """The watch events ({type, object}) from ``resource_version`` on, as they come, until the
        API server ends the stream (``timeout_seconds``). Not retried: the watcher resumes from the
        last version it saw. ApiError as :meth:`_request` raises it; 0 "Unreachable" when the
        connection breaks. ``opened`` gets the response, which it may shut down from another
        thread to end the stream (the operator stopping)."""
        query = {
            "watch": "1", "labelSelector": label_selector, "resourceVersion": resource_version,
            "allowWatchBookmarks": "true", "timeoutSeconds": str(timeout_seconds),
        }  # fmt: skip
        path = f"{_objects(api_version, plural, namespace)}?{urllib.parse.urlencode(query)}"
        url = f"{self.configuration.host}{path}"
        headers = {"Accept": "application/json", "User-Agent": USER_AGENT} | _auth_header(self.configuration)
        started = time.monotonic()
        try:
            response = self._pool.request(
                "GET", url, headers=headers, preload_content=False, retries=False,
                timeout=urllib3.Timeout(connect=self.timeout_seconds, read=timeout_seconds + 30),
            )  # fmt: skip
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            self.requests.record("watch", plural, 0, time.monotonic() - started)
            raise ApiError(0, "Unreachable", str(exc)) from None
        self.requests.record("watch", plural, response.status, time.monotonic() - started)
        try:
            if response.status != 200:
                raise _error(response.status, response.read())
            opened(response)
            pending = b""
            for chunk in response.stream(64 * 1024):
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    if line.strip():
                        yield _event(line)
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise ApiError(0, "Unreachable", str(exc)) from None
        finally:
            response.close()  # a stream left mid-way cannot go back to the pool as it is
            response.release_conn()

    # -- Kueue ----------------------------------------------------------------------------

    def list_workloads(self, namespace: str, job_uid: str) -> list[dict[str, Any]] | None:
        """The Kueue Workloads made for a job (by Kueue's job-uid label); None when this cluster
        serves no Kueue API (v1beta2 since Kueue 0.15; v1beta1 before) or this operator may not
        read it (the chart grants it; a hand-made Role may not): the status then says less."""
        query = {"labelSelector": f"{KUEUE_JOB_UID_LABEL}={job_uid}"}
        for version in KUEUE_API_VERSIONS:
            try:
                reply = self._request("GET", _objects(version, "workloads", namespace), query=query)
            except ApiError as exc:
                if exc.status == 404:
                    continue
                if exc.status == 403:
                    return None
                raise
            items: list[dict[str, Any]] = reply.get("items") or []
            for item in items:
                item.setdefault("apiVersion", version)  # the version to patch it by
            return items
        return None

    # -- GpuTrainings ---------------------------------------------------------------------

    def get_training(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._get_or_none(f"{_TRAININGS.format(ns=namespace)}/{name}")

    def patch_training_status(
        self, namespace: str, name: str, patch: Mapping[str, Any]
    ) -> dict[str, Any] | None:
        """Merge-patch the status subresource; None when the GpuTraining is gone.

        A 409 here can only be a transient conflict (a merge patch carries no
        resourceVersion), so it is retried like a 5xx.
        """
        path = f"{_TRAININGS.format(ns=namespace)}/{name}/status"
        try:
            body: dict[str, Any] = self._request(
                "PATCH", path, body=patch, content_type=_MERGE_PATCH, retried=RETRIED_STATUSES | {409}
            )
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise
        return body

    # -- pods -----------------------------------------------------------------------------

    def list_training_pods(self, namespace: str) -> list[dict[str, Any]]:
        """Every pod of every GpuTraining in the namespace: one request however many jobs."""
        reply = self._request(
            "GET", f"/api/v1/namespaces/{namespace}/pods", query={"labelSelector": TRAINING_LABEL}
        )
        items: list[dict[str, Any]] = reply.get("items") or []
        return items

    def get_endpoints(self, namespace: str, name: str) -> dict[str, Any] | None:
        """A Service's Endpoints (dcgm-exporter's: where its pods answer)."""
        return self._get_or_none(f"/api/v1/namespaces/{namespace}/endpoints/{name}")

    def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._get_or_none(f"/api/v1/namespaces/{namespace}/pods/{name}")

    # -- authentication -------------------------------------------------------------------

    def review_token(self, token: str, audience: str, timeout: float) -> dict[str, Any]:
        """The API server's verdict on a bearer token for ``audience`` (a TokenReview's
        status: authenticated, user.username, user.extra, audiences, error). Not retried: the
        caller answers its client, who sends again."""
        review = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "spec": {"token": token, "audiences": [audience]},
        }
        reply = self._request(
            "POST",
            "/apis/authentication.k8s.io/v1/tokenreviews",
            body=review,
            timeout=timeout,
            retried=frozenset(),
        )
        status: dict[str, Any] = (reply or {}).get("status") or {}
        return status

    def pod_metrics_via_proxy(self, namespace: str, pod: str, port: int, timeout: float) -> str:
        """The pod's /metrics through the API server's pod proxy (the operator is outside).
        Asked once: a pod not serving yet is asked again at the next tick, not within this one."""
        path = f"/api/v1/namespaces/{namespace}/pods/{pod}:{port}/proxy/metrics"
        text: str = self._request("GET", path, raw=True, timeout=timeout, attempts=1)
        return text

    # -- peering --------------------------------------------------------------------------

    def find_peering(self, name: str, namespace: str | None) -> dict[str, Any] | None:
        """Kopf's peering object (namespace None: the cluster-wide one); None when it, or its
        CRD, is not there."""
        if namespace is not None:
            path = f"/apis/kopf.dev/v1/namespaces/{namespace}/kopfpeerings/{name}"
        else:
            path = f"/apis/kopf.dev/v1/clusterkopfpeerings/{name}"
        return self._get_or_none(path)

    def get_peering(self, name: str, namespace: str | None) -> dict[str, Any] | None:
        """The peering object's status: who is alive, with which priority."""
        status: dict[str, Any] | None = (self.find_peering(name, namespace) or {}).get("status")
        return status

    # -- events ---------------------------------------------------------------------------

    def post_event(
        self, training: Mapping[str, Any], event_type: str, reason: str, message: str, now: datetime
    ) -> None:
        """A core/v1 Event about the GpuTraining, as ``kubectl describe`` shows them."""
        event = event_body(training, event_type, reason, message, now)
        self._request("POST", f"/api/v1/namespaces/{event['metadata']['namespace']}/events", body=event)


def _pool(configuration: k8s_client.Configuration) -> urllib3.PoolManager:
    """A connection pool set up as the client's own REST layer sets one up, from the
    Configuration's public fields: the API server's CA, a client certificate, hostname
    checks, a proxy, the pool's size."""
    args: dict[str, Any] = {
        "cert_reqs": ssl.CERT_REQUIRED if configuration.verify_ssl else ssl.CERT_NONE,
        "ca_certs": configuration.ssl_ca_cert,
        "cert_file": configuration.cert_file,
        "key_file": configuration.key_file,
    }
    ca_data = getattr(configuration, "ca_cert_data", None)  # kubeconfig's inline CA, client 31+
    if ca_data:
        args["ca_cert_data"] = ca_data
    if configuration.assert_hostname is not None:
        args["assert_hostname"] = configuration.assert_hostname
    if configuration.tls_server_name:
        args["server_hostname"] = configuration.tls_server_name
    if configuration.connection_pool_maxsize is not None:
        args["maxsize"] = configuration.connection_pool_maxsize
    if configuration.proxy:
        return urllib3.ProxyManager(
            proxy_url=configuration.proxy, proxy_headers=configuration.proxy_headers, **args
        )
    return urllib3.PoolManager(**args)


def _auth_header(configuration: k8s_client.Configuration) -> dict[str, str]:
    """The bearer token, asked for on every request: the in-cluster loader's refresh hook
    rereads a projected token as the kubelet rotates it."""
    bearer: Mapping[str, Any] = configuration.auth_settings().get("BearerToken") or {}
    value = bearer.get("value")
    return {"Authorization": str(value)} if value else {}


def _objects(api_version: str, plural: str, namespace: str | None) -> str:
    """The collection's path: in a namespace, or (None) across all of them."""
    root = "/api" if "/" not in api_version else "/apis"  # "v1" is the core group's
    if namespace is None:
        return f"{root}/{api_version}/{plural}"
    return f"{root}/{api_version}/namespaces/{namespace}/{plural}"


_VERBS: Final = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}
# The verbs of :func:`request_target` that change the cluster: what "writes" counts.
WRITE_VERBS: Final = frozenset(_VERBS.values())


def request_target(method: str, path: str) -> tuple[str, str]:
    """The Kubernetes verb and resource of a request, as the API server's own request metrics
    name them: (list, pytorchjobs), (patch, gputrainings/status), (get, discovery) for a
    group/version's resource list (which job APIs the cluster serves)."""
    parts = [p for p in path.split("?")[0].split("/") if p]
    if "namespaces" in parts:
        rest = parts[parts.index("namespaces") + 2 :]
        if not rest:
            rest = ["namespaces", parts[parts.index("namespaces") + 1]]
    else:
        rest = parts[3:] if parts[:1] == ["apis"] else parts[2:]
    if not rest:
        return "get", "discovery"
    resource = rest[0] if len(rest) < 3 else f"{rest[0]}/{rest[2]}"
    if method == "GET":
        return ("get" if len(rest) >= 2 else "list"), resource
    return _VERBS.get(method, method.lower()), resource


def _event(line: bytes) -> dict[str, Any]:
    """One line of a watch stream; one that is not a JSON object breaks the stream (ApiError 0),
    which the watcher opens again from the last version it saw."""
    try:
        event = json.loads(line)
    except ValueError:
        event = None
    if not isinstance(event, dict):
        raise ApiError(0, "BadEvent", f"a watch line that is not a JSON object: {line[:200]!r}")
    return event


def _error(status: int, data: bytes) -> ApiError:
    try:
        body = json.loads(data)
    except ValueError:
        body = None
    if isinstance(body, dict):
        return ApiError(status, str(body.get("reason") or ""), str(body.get("message") or ""))
    return ApiError(status, "", data[:200].decode("utf-8", errors="replace"))


def event_body(
    training: Mapping[str, Any], event_type: str, reason: str, message: str, now: datetime
) -> dict[str, Any]:
    """The core/v1 Event :meth:`Kube.post_event` posts about a GpuTraining (the bench's floors
    post the same)."""
    meta = training["metadata"]
    ns = meta["namespace"]
    stamp = now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": ns},
        "involvedObject": {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": meta["name"],
            "namespace": ns,
            "uid": meta.get("uid"),
            "resourceVersion": meta.get("resourceVersion"),
        },
        "type": event_type,
        "reason": reason,
        "message": message[:1024],
        "source": {"component": "gpu-training-operator"},
        "reportingComponent": "gpuop.io/operator",
        "reportingInstance": "gpu-training-operator",
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }
