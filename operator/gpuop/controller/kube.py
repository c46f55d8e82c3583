"""The operator's verbs on the Kubernetes API (Kopf's watch of GpuTrainings aside): each a
path and a request through :mod:`~gpuop.controller.apiclient`, which logs in, sends and retries.
"""

from __future__ import annotations

import json
import logging
import urllib.parse
from collections.abc import Callable, Generator, Mapping
from datetime import UTC, datetime
from typing import Any, Final

import urllib3

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
from gpuop.controller.apiclient import RETRIED_STATUSES, ApiError, ApiSession

log = logging.getLogger(__name__)

_TRAININGS: Final = f"/apis/{GROUP}/{VERSION}/namespaces/{{ns}}/{PLURAL}"
_MERGE_PATCH: Final = "application/merge-patch+json"
_LEASES: Final = "/apis/coordination.k8s.io/v1/namespaces/{ns}/leases"
# Seconds one call on the Lease may take: a renewal that waits longer is tried again, several
# times within the renew deadline.
LEASE_CALL_SECONDS: Final = 3.0
# Objects per page of a list: the size of the page the API server's own clients (kubectl) ask for.
LIST_PAGE: Final = 500
# A reply of metadata only (every API server we claim, 1.29 on, serves it); plain JSON elsewhere.
_METADATA_ONLY: Final = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1,application/json"


class Kube(ApiSession):
    """A Kubernetes API session with the operator's verbs. Thread-safe (urllib3 pools)."""

    # -- Kubeflow jobs (PyTorchJob, TrainJob) and the TrainJob's TrainingRuntime ---------

    def _get_or_none(
        self, path: str, *, attempts: int | None = None, timeout: float | None = None
    ) -> dict[str, Any] | None:
        try:
            body: dict[str, Any] = self._request("GET", path, attempts=attempts, timeout=timeout)
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
        response = self._open_stream(path, plural, read_timeout=timeout_seconds + 30)
        try:
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
        return self.list_pods(namespace, TRAINING_LABEL)

    def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        reply = self._request(
            "GET", f"/api/v1/namespaces/{namespace}/pods", query={"labelSelector": selector}
        )
        items: list[dict[str, Any]] = reply.get("items") or []
        return items

    def get_endpoints(self, namespace: str, name: str) -> dict[str, Any] | None:
        """A Service's Endpoints (dcgm-exporter's: where its pods answer)."""
        return self._get_or_none(f"/api/v1/namespaces/{namespace}/endpoints/{name}")

    def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._get_or_none(f"/api/v1/namespaces/{namespace}/pods/{name}")

    def delete_pod(self, namespace: str, name: str, uid: str | None, grace_seconds: int | None) -> None:
        """Delete one pod (``grace_seconds`` None: its own grace period; 0: at once, for a pod
        whose kubelet is gone and will never confirm). Only the pod of that ``uid``: its job's
        controller may have made a new one of that name since. Gone already, or replaced, is
        no error."""
        options: dict[str, Any] = {"kind": "DeleteOptions", "apiVersion": "v1"}
        if grace_seconds is not None:
            options["gracePeriodSeconds"] = grace_seconds
        if uid is not None:
            options["preconditions"] = {"uid": uid}
        try:
            self._request("DELETE", f"/api/v1/namespaces/{namespace}/pods/{name}", body=options)
        except ApiError as exc:
            if exc.status not in (404, 409):  # 409: the uid precondition failed
                raise

    # -- nodes ----------------------------------------------------------------------------

    def get_node(self, name: str) -> dict[str, Any] | None:
        """A Node (None: there is none); read only for the node of a training pod that may be lost.
        Asked once: the tick reads it, and asks again at the next one rather than wait here."""
        return self._get_or_none(f"/api/v1/nodes/{name}", attempts=1)

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

    # -- leadership: the Lease, and the leader's pod label ----------------------------------

    def get_lease(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The replicas' Lease (:mod:`~gpuop.controller.lease`); asked once, briefly: a round
        that fails is the next round's to retry, within the renew deadline."""
        return self._get_or_none(
            f"{_LEASES.format(ns=namespace)}/{name}", attempts=1, timeout=LEASE_CALL_SECONDS
        )

    def create_lease(self, namespace: str, name: str, spec: Mapping[str, Any]) -> dict[str, Any]:
        """The Lease as created; ApiError 409 when another replica created it first."""
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": name, "namespace": namespace}, "spec": spec}  # fmt: skip
        made: dict[str, Any] = self._request(
            "POST", _LEASES.format(ns=namespace), body=body, attempts=1, timeout=LEASE_CALL_SECONDS
        )
        return made

    def replace_lease(self, lease: Mapping[str, Any], timeout: float = LEASE_CALL_SECONDS) -> dict[str, Any]:
        """Write the Lease as read and changed, and return it as written: its resourceVersion
        makes a write that another replica's overtook fail with ApiError 409."""
        meta = lease["metadata"]
        path = f"{_LEASES.format(ns=meta['namespace'])}/{meta['name']}"
        written: dict[str, Any] = self._request("PUT", path, body=lease, attempts=1, timeout=timeout)
        return written

    def label_pod(self, namespace: str, name: str, key: str, value: str | None) -> None:
        """Set one label of a pod (None: remove it); a pod that is gone is no error. Asked once
        (the leader's next round asks again; on the way out there is no time to)."""
        patch = {"metadata": {"labels": {key: value}}}
        try:
            self._request("PATCH", f"/api/v1/namespaces/{namespace}/pods/{name}", body=patch,
                          content_type=_MERGE_PATCH, attempts=1, timeout=LEASE_CALL_SECONDS)  # fmt: skip
        except ApiError as exc:
            if exc.status != 404:
                raise

    # -- events ---------------------------------------------------------------------------

    def post_event(
        self, training: Mapping[str, Any], event_type: str, reason: str, message: str, now: datetime
    ) -> None:
        """A core/v1 Event about the GpuTraining, as ``kubectl describe`` shows them."""
        event = event_body(training, event_type, reason, message, now)
        self._request("POST", f"/api/v1/namespaces/{event['metadata']['namespace']}/events", body=event)


def _objects(api_version: str, plural: str, namespace: str | None) -> str:
    """The collection's path: in a namespace, or (None) across all of them."""
    root = "/api" if "/" not in api_version else "/apis"  # "v1" is the core group's
    if namespace is None:
        return f"{root}/{api_version}/{plural}"
    return f"{root}/{api_version}/namespaces/{namespace}/{plural}"


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
