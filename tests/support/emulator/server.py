"""A Kubernetes API server for tests: kmock's ``KubernetesEmulator`` with the semantics we rely on.

kmock 0.8 serves discovery, errors and an object store over real HTTP, which is what Kopf,
the kubernetes client and kubectl need to talk to it. Its store is deliberately naive; the
operator's correctness depends on exactly what it leaves out, so this subclass adds it:

* ``metadata``: uid, resourceVersion (one counter, as etcd's revision), generation (bumped
  when anything but metadata and status changes), creationTimestamp, generateName;
* watches from a resourceVersion (kmock replays every object as ADDED on every watch, so
  Kopf would see each object "created" again after a reconnect), ``timeoutSeconds``;
* label selectors on lists and watches; list replies with ``kind`` and a resourceVersion
  (``kubectl get`` needs the first, Kopf the second);
* merge, JSON and (as merge) strategic patches; PUT with resourceVersion preconditions;
  the status subresource: a status write touches only status, a main write never does;
  a write that changes nothing changes no resourceVersion and sends no event;
* finalizers, and the garbage collector: deleting an owner deletes its dependents;
* admission: GpuTrainings are defaulted and validated against our CRD (schema + CEL,
  transition rules included), PyTorchJobs against the real Kubeflow CRD and webhook rules;
* the pod proxy (``pods/NAME:PORT/proxy/PATH``), forwarded to the pod's IP;
* fault injection: a fraction of requests answered 500, 503, 429 or 409 before they act;
* ``kubectl get`` tables from the CRD's printer columns.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import copy
import json
import random
import string
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import aiohttp.web
import attrs
import jsonpatch
import kmock
import yaml

from support.paths import ROOT
from support.schemas import crd as crdschema
from support.schemas import kubeflow

Validator = Callable[[dict[str, Any], dict[str, Any] | None], list[str]]
# How long a test waits for the emulator's loop to run one of its calls: a guard against a hung
# loop, not a timing check. The loop also serves the operator under test, and on a loaded
# 2-core machine a call once waited over 10 s behind a burst of its requests.
LOOP_CALL_TIMEOUT = 120

# (group/version/plural, kind, namespaced, subresources, short names)
RESOURCES: tuple[tuple[str, str, bool, tuple[str, ...], tuple[str, ...]], ...] = (
    ("v1/namespaces", "Namespace", False, ("status",), ("ns",)),
    ("v1/pods", "Pod", True, ("status", "proxy"), ("po",)),
    ("v1/nodes", "Node", False, ("status",), ("no",)),
    ("v1/events", "Event", True, (), ("ev",)),
    (
        "apiextensions.k8s.io/v1/customresourcedefinitions",
        "CustomResourceDefinition",
        False,
        ("status",),
        ("crd",),
    ),
    ("gpuop.io/v1alpha1/gputrainings", "GpuTraining", True, ("status",), ("gtr",)),
    ("kubeflow.org/v1/pytorchjobs", "PyTorchJob", True, ("status",), ()),
    ("coordination.k8s.io/v1/leases", "Lease", True, (), ()),
)
VERBS = {"create", "delete", "get", "list", "patch", "update", "watch"}


@dataclass
class Faults:
    """Answer a fraction of requests with an error before they act (watches excepted)."""

    rate: float = 0.0
    statuses: tuple[int, ...] = (500, 503, 429, 409)
    seed: int = 0
    injected: int = 0
    _random: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        self._random.seed(self.seed)

    def pick(self, verb: str) -> int | None:
        """A status to answer with, or None. 409 only for writes: no API server sends it to a
        read, and Kopf rightly treats a 409 on its watch list as fatal."""
        choices = [c for c in self.statuses if c != 409 or verb in ("create", "update", "patch")]
        if not choices or self.rate <= 0 or self._random.random() >= self.rate:
            return None
        self.injected += 1
        return self._random.choice(choices)


class ApiError(Exception):
    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status, self.reason, self.message = status, reason, message


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _merge(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = _merge(result.get(key), value)
    return result


def _selector(text: str | None) -> Callable[[dict[str, Any]], bool]:
    """A label selector: ``a``, ``!a``, ``a=b``, ``a==b``, ``a!=b``, comma-joined."""
    terms = [t.strip() for t in (text or "").split(",") if t.strip()]

    def match(obj: dict[str, Any]) -> bool:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        for term in terms:
            if "!=" in term:
                k, v = term.split("!=", 1)
                if labels.get(k.strip()) == v.strip():
                    return False
            elif "=" in term:
                k, v = term.replace("==", "=").split("=", 1)
                if labels.get(k.strip()) != v.strip():
                    return False
            elif term.startswith("!"):
                if term[1:] in labels:
                    return False
            elif term not in labels:
                return False
        return True

    return match


def _jsonpath(obj: Any, path: str) -> Any:
    for part in path.strip(".").split("."):
        if not isinstance(obj, dict):
            return None
        obj = obj.get(part)
    return obj


@attrs.define(kw_only=True)
class ApiServer(kmock.KubernetesEmulator):
    """See the module docstring. ``store`` maps (resource, namespace, name) to the object."""

    faults: Faults = attrs.field(factory=Faults)
    validators: dict[str, Validator] = attrs.field(factory=dict)
    defaulters: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = attrs.field(factory=dict)
    store: dict[tuple[str, str | None, str], dict[str, Any]] = attrs.field(factory=dict, init=False)
    history: dict[str, list[tuple[int, dict[str, Any]]]] = attrs.field(factory=dict, init=False)
    revision: int = attrs.field(default=1, init=False)
    changed: asyncio.Condition | None = attrs.field(default=None, init=False)
    kinds: dict[str, tuple[str, bool, tuple[str, ...]]] = attrs.field(factory=dict, init=False)
    printer_columns: dict[str, list[dict[str, Any]]] = attrs.field(factory=dict, init=False)
    counts: dict[tuple[str, str, str], int] = attrs.field(factory=dict, init=False)
    # What RBAC sees of each request: (agent, verb, apiGroup, resource[/subresource], namespace,
    # name).
    audit: set[tuple[str, str, str, str, str | None, str | None]] = attrs.field(factory=set, init=False)
    notifying: set[asyncio.Task[None]] = attrs.field(factory=set, init=False)
    created_at: dict[tuple[str, str], float] = attrs.field(factory=dict, init=False)  # monotonic

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for key, kind, namespaced, subresources, shortnames in RESOURCES:
            self.resources[key] = kmock.ResourceInfo(
                kind=kind,
                namespaced=namespaced,
                singular=kind.lower(),
                verbs=VERBS,
                subresources=set(subresources),
                shortnames=set(shortnames),
            )
            self.kinds[key] = (kind, namespaced, subresources)
        self.install_crd(ROOT / "crds" / "gputraining.yaml")
        # kubectl validates with the server's OpenAPI: an empty document makes it fall back to
        # server-side field validation, which is what a real 1.32 API server is asked for.
        self["get /openapi/v3"] << {"paths": {}}
        self["get /openapi/v2"] << {"swagger": "2.0", "info": {"title": "emulator"}, "paths": {}}

    async def _serve_server_version(self, request: kmock.Request) -> dict[str, Any]:
        return {"major": "1", "minor": "32", "gitVersion": "v1.32.0", "platform": "linux/amd64"}

    async def _serve_version(self, request: kmock.Request) -> dict[str, Any]:
        payload: dict[str, Any] = await super()._serve_version(request)
        for entry in payload["resources"]:
            if "/" in entry["name"]:  # a subresource has no short names or categories of its own
                entry["shortNames"], entry["categories"] = [], []
                entry["verbs"] = ["get", "patch", "update"] if entry["name"].endswith("/status") else ["get"]
            entry["namespaced"] = self.kinds.get(
                f"{payload['groupVersion'].strip('/')}/{entry['name'].split('/')[0]}", ("", True, ())
            )[1]
        return payload

    # -- set-up ---------------------------------------------------------------------------

    def install_crd(self, path: Path) -> None:
        """Serve a CRD: stored like `kubectl apply` would, with its printer columns for tables."""
        crd = yaml.safe_load(path.read_text())
        group, plural = crd["spec"]["group"], crd["spec"]["names"]["plural"]
        for version in crd["spec"]["versions"]:
            self.printer_columns[f"{group}/{version['name']}/{plural}"] = version.get(
                "additionalPrinterColumns", []
            )
        self._put_object("apiextensions.k8s.io/v1/customresourcedefinitions", None, crd)

    def validate_gputrainings(self) -> None:
        """Admit GpuTrainings as an API server with our CRD does: defaults, schema, CEL."""
        schema = crdschema.load_schema(ROOT / "crds" / "gputraining.yaml")
        self.defaulters["gpuop.io/v1alpha1/gputrainings"] = lambda body: crdschema.apply_defaults(
            schema, body
        )

        def check(new: dict[str, Any], old: dict[str, Any] | None) -> list[str]:
            return crdschema.validate(schema, new, old=old)

        self.validators["gpuop.io/v1alpha1/gputrainings"] = check

    def validate_pytorchjobs(self) -> None:
        """Admit PyTorchJobs as a cluster with training-operator v1.9 does (CRD + webhook)."""

        def check(new: dict[str, Any], old: dict[str, Any] | None) -> list[str]:
            body = {k: v for k, v in new.items() if k != "status"}
            return kubeflow.all_errors(body) if old is None else []

        self.validators["kubeflow.org/v1/pytorchjobs"] = check

    # -- the store ------------------------------------------------------------------------

    def _bump(self) -> int:
        self.revision += 1
        return self.revision

    def _emit(self, key: str, kind: str, obj: dict[str, Any]) -> None:
        self.history.setdefault(key, []).append((self.revision, {"type": kind, "object": copy.deepcopy(obj)}))
        if self.changed is not None:
            task = asyncio.get_running_loop().create_task(self._notify())
            self.notifying.add(task)
            task.add_done_callback(self.notifying.discard)

    async def _notify(self) -> None:
        assert self.changed is not None
        async with self.changed:
            self.changed.notify_all()

    def _put_object(self, key: str, namespace: str | None, obj: dict[str, Any]) -> dict[str, Any]:
        """Create (admission already done): metadata filled in, ADDED emitted."""
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name"):
            prefix = meta.get("generateName")
            if not prefix:
                raise ApiError(422, "Invalid", "metadata.name or metadata.generateName is required")
            meta["name"] = prefix + "".join(random.choices(string.ascii_lowercase + string.digits, k=5))
        kind, namespaced, _ = self.kinds[key]
        namespace = (namespace or meta.get("namespace") or "default") if namespaced else None
        if namespace is not None:
            meta["namespace"] = namespace
        if (key, namespace, meta["name"]) in self.store:
            raise ApiError(409, "AlreadyExists", f'{kind.lower()}s "{meta["name"]}" already exists')
        group_version = key.rsplit("/", 1)[0]
        obj["apiVersion"], obj["kind"] = group_version, kind
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now(), generation=1)
        meta["resourceVersion"] = str(self._bump())
        self.store[key, namespace, meta["name"]] = obj
        self.created_at[key, meta["name"]] = time.monotonic()
        self._emit(key, "ADDED", obj)
        owners = {ref.get("uid") for ref in meta.get("ownerReferences") or ()}
        if owners and not any(o["metadata"].get("uid") in owners for o in self.store.values()):
            self._delete(key, namespace, meta["name"])  # the GC removes dependents of absent owners
        return obj

    def _replace(
        self, key: str, old: dict[str, Any], new: dict[str, Any], status_only: bool
    ) -> dict[str, Any]:
        """Write a new version of an object, as the API server's update path does."""
        _, _, subresources = self.kinds[key]
        if "status" in subresources:
            if status_only:  # the status subresource writes status, and only status
                new = {**copy.deepcopy(old), "status": new.get("status")}
                if new["status"] is None:
                    del new["status"]
            else:
                new = {k: v for k, v in new.items() if k != "status"}
                if "status" in old:
                    new["status"] = copy.deepcopy(old["status"])
        meta = new.setdefault("metadata", {})
        for fixed in ("uid", "creationTimestamp", "namespace", "name", "generation", "deletionTimestamp"):
            if fixed in old["metadata"]:
                meta[fixed] = old["metadata"][fixed]
            else:
                meta.pop(fixed, None)
        meta["resourceVersion"] = old["metadata"]["resourceVersion"]
        new["apiVersion"], new["kind"] = old["apiVersion"], old["kind"]
        if new == old:
            return old  # nothing changed: no new revision, no event
        validator = self.validators.get(key)
        if validator is not None and not status_only:
            errors = validator(new, old)
            if errors:
                raise ApiError(422, "Invalid", "; ".join(errors))
        if validator is not None and status_only:
            errors = [e for e in validator(new, None) if e.startswith("status")]
            if errors:
                raise ApiError(422, "Invalid", "; ".join(errors))
        body_changed = {k: v for k, v in new.items() if k not in ("metadata", "status")} != {
            k: v for k, v in old.items() if k not in ("metadata", "status")
        }
        if body_changed:
            meta["generation"] = int(old["metadata"].get("generation", 1)) + 1
        meta["resourceVersion"] = str(self._bump())
        ns, name = meta.get("namespace"), meta["name"]
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            self._remove(key, ns, name, new)
            return new
        self.store[key, ns, name] = new
        self._emit(key, "MODIFIED", new)
        return new

    def _remove(self, key: str, namespace: str | None, name: str, last: dict[str, Any]) -> None:
        del self.store[key, namespace, name]
        last = copy.deepcopy(last)
        last["metadata"]["resourceVersion"] = str(self._bump())
        self._emit(key, "DELETED", last)
        self._collect_garbage(last["metadata"]["uid"])

    def _delete(self, key: str, namespace: str | None, name: str, orphan: bool = False) -> dict[str, Any]:
        obj = self.store.get((key, namespace, name))
        if obj is None:
            raise ApiError(404, "NotFound", f'"{name}" not found')
        if obj["metadata"].get("finalizers"):
            if not obj["metadata"].get("deletionTimestamp"):
                obj = copy.deepcopy(obj)
                obj["metadata"]["deletionTimestamp"] = _now()
                obj["metadata"]["resourceVersion"] = str(self._bump())
                self.store[key, namespace, name] = obj
                self._emit(key, "MODIFIED", obj)
            return obj
        del self.store[key, namespace, name]
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(self._bump())
        self._emit(key, "DELETED", obj)
        if not orphan:
            self._collect_garbage(obj["metadata"]["uid"])
        return obj

    def _collect_garbage(self, owner_uid: str) -> None:
        """The garbage collector's background cascade: dependents of a deleted owner go too."""
        for (key, namespace, name), obj in list(self.store.items()):
            refs = obj["metadata"].get("ownerReferences") or ()
            if any(ref.get("uid") == owner_uid for ref in refs) and (key, namespace, name) in self.store:
                self._delete(key, namespace, name)

    # -- synchronous helpers for tests (call through `on_loop` from other threads) ----------

    def objects(self, key: str, namespace: str | None = None) -> list[dict[str, Any]]:
        return [
            copy.deepcopy(obj)
            for (k, ns, _), obj in list(self.store.items())
            if k == key and (namespace is None or ns == namespace)
        ]

    def get(self, key: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        obj = self.store.get((key, namespace, name))
        return copy.deepcopy(obj) if obj is not None else None

    def create(self, key: str, obj: dict[str, Any]) -> dict[str, Any]:
        return self._put_object(key, (obj.get("metadata") or {}).get("namespace"), obj)

    def patch(
        self, key: str, namespace: str | None, name: str, patch: dict[str, Any], status: bool = False
    ) -> dict[str, Any]:
        old = self.store[key, namespace, name]
        return self._replace(key, old, _merge(old, patch), status_only=status)

    def delete(self, key: str, namespace: str | None, name: str) -> None:
        self._delete(key, namespace, name)

    # -- HTTP -----------------------------------------------------------------------------

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        resource = request.resource
        if self.changed is None:
            self.changed = asyncio.Condition()
        if resource is None or resource.plural is None:
            return await kmock.KubernetesScaffold._handle(self, request)  # discovery, /version, 404s
        key = (
            f"{resource.group}/{resource.version}/{resource.plural}"
            if resource.group
            else (f"{resource.version}/{resource.plural}")
        )
        if key not in self.kinds:
            return self._error(404, "NotFound", f"the server could not find the requested resource {key}")
        agent = (
            "gpuop"
            if "gpuop" in request.headers.get("User-Agent", "")
            else ("kopf" if "kopf" in request.headers.get("User-Agent", "") else "other")
        )
        verb = self._verb(request)
        self.counts[agent, verb, key] = self.counts.get((agent, verb, key), 0) + 1
        subresource = (request.subresource or "").split("/")[0]
        self.audit.add((
            agent,
            verb,
            resource.group or "",
            f"{resource.plural}/{subresource}" if subresource else resource.plural,
            request.namespace if self.kinds[key][1] else None,
            (request.name or "").partition(":")[0] or None,
        ))  # fmt: skip
        fault = self.faults.pick(verb) if verb != "watch" else None
        if fault is not None:
            headers = {"Retry-After": "0"} if fault == 429 else None
            return self._error(fault, "InjectedFault", f"injected {fault} for {verb} {key}", headers)
        try:
            if verb == "watch":
                return await self._watch(request, key)
            if request.subresource and request.subresource.startswith("proxy"):
                return await self._proxy(request, key)
            return self._serve(request, key, verb)
        except ApiError as exc:
            return self._error(exc.status, exc.reason, exc.message)

    @staticmethod
    def _verb(request: kmock.Request) -> str:
        method = str(request.method.value if hasattr(request.method, "value") else request.method).upper()
        if method == "GET":
            if request.params.get("watch") in ("true", "1"):
                return "watch"
            return "get" if request.name else "list"
        return {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}.get(method, method)

    def _serve(self, request: kmock.Request, key: str, verb: str) -> aiohttp.web.StreamResponse:
        kind, namespaced, _ = self.kinds[key]
        namespace = request.namespace if namespaced else None
        status_only = request.subresource == "status"
        if verb == "list":
            match = _selector(request.params.get("labelSelector"))
            items = [
                copy.deepcopy(obj)
                for (k, ns, _), obj in sorted(self.store.items(), key=lambda kv: str(kv[0]))
                if k == key and (namespace is None or ns == namespace) and match(obj)
            ]
            if "as=Table" in request.headers.get("Accept", ""):
                return aiohttp.web.json_response(self._table(key, items))
            group_version = key.rsplit("/", 1)[0]
            return aiohttp.web.json_response(
                {
                    "apiVersion": group_version,
                    "kind": f"{kind}List",
                    "metadata": {"resourceVersion": str(self.revision)},
                    "items": items,
                }
            )
        if verb == "create":
            body = request.data if isinstance(request.data, dict) else None
            if body is None:
                raise ApiError(400, "BadRequest", "the body must be a JSON object")
            body = copy.deepcopy(body)
            body.pop("status", None) if "status" in self.kinds[key][2] else None
            if namespace is not None:
                body.setdefault("metadata", {})["namespace"] = namespace
            defaulter = self.defaulters.get(key)
            if defaulter is not None:
                body = defaulter(body)
            validator = self.validators.get(key)
            if validator is not None:
                errors = validator(body, None)
                if errors:
                    raise ApiError(422, "Invalid", f"{kind} is invalid: " + "; ".join(errors))
            created = self._put_object(key, namespace, body)
            return aiohttp.web.json_response(created, status=201)
        name = request.name or ""
        obj = self.store.get((key, namespace, name))
        if obj is None:
            raise ApiError(404, "NotFound", f'{kind.lower()}s "{name}" not found')
        if verb == "get":
            if "as=Table" in request.headers.get("Accept", ""):
                return aiohttp.web.json_response(self._table(key, [obj]))
            return aiohttp.web.json_response(obj)
        if verb == "delete":
            options = request.data if isinstance(request.data, dict) else request.params
            wanted_uid = (options.get("preconditions") or {}).get("uid")
            if wanted_uid is not None and wanted_uid != obj["metadata"].get("uid"):
                raise ApiError(409, "Conflict", f"Precondition failed: UID in precondition: {wanted_uid}, "
                               f"UID in object meta: {obj['metadata'].get('uid')}")  # fmt: skip
            orphan = options.get("propagationPolicy") == "Orphan"
            return aiohttp.web.json_response(self._delete(key, namespace, name, orphan=orphan))
        if verb == "update":
            new = request.data if isinstance(request.data, dict) else {}
            sent = str((new.get("metadata") or {}).get("resourceVersion", ""))
            if sent and sent != obj["metadata"]["resourceVersion"]:
                raise ApiError(409, "Conflict", "the object has been modified; please apply your changes "
                               "to the latest version and try again")  # fmt: skip
            return aiohttp.web.json_response(self._replace(key, obj, copy.deepcopy(new), status_only))
        if verb == "patch":
            content_type = request.headers.get("Content-Type", "")
            if "json-patch" in content_type:
                try:
                    new = jsonpatch.apply_patch(obj, request.data)
                except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
                    raise ApiError(422, "Invalid", str(exc)) from None
            elif "merge-patch" in content_type:  # merge, and strategic as merge (no CRD has strategies)
                new = _merge(obj, request.data)
            else:
                raise ApiError(415, "UnsupportedMediaType", f"unsupported patch type {content_type!r}")
            return aiohttp.web.json_response(self._replace(key, obj, new, status_only))
        raise ApiError(405, "MethodNotAllowed", f"{verb} is not supported")

    async def _watch(self, request: kmock.Request, key: str) -> aiohttp.web.StreamResponse:
        raw = request._raw_request
        assert raw is not None
        assert self.changed is not None
        _, namespaced, _ = self.kinds[key]
        namespace = request.namespace if namespaced else None
        match = _selector(request.params.get("labelSelector"))
        since = request.params.get("resourceVersion")
        timeout = float(request.params.get("timeoutSeconds") or 3600)
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(raw)

        def visible(obj: dict[str, Any]) -> bool:
            return (namespace is None or obj["metadata"].get("namespace") == namespace) and match(obj)

        async def send(event: dict[str, Any]) -> None:
            await response.write(json.dumps(event).encode() + b"\n")

        log = self.history.setdefault(key, [])
        if since in (None, "", "0"):  # "Get State and Start at Most Recent"
            position = len(log)
            for obj in self.objects(key, namespace):
                if visible(obj):
                    await send({"type": "ADDED", "object": obj})
        else:
            position = bisect.bisect_right(log, int(since), key=lambda entry: entry[0])
        deadline = asyncio.get_running_loop().time() + timeout
        with contextlib.suppress(ConnectionResetError, asyncio.CancelledError, asyncio.TimeoutError):
            while True:
                while position < len(log):
                    _, event = log[position]
                    position += 1
                    if visible(event["object"]):
                        await send(event)
                remaining = deadline - asyncio.get_running_loop().time()
                if remaining <= 0:
                    break
                async with self.changed:
                    if position >= len(log):
                        await asyncio.wait_for(self.changed.wait(), remaining)
        return response

    async def _proxy(self, request: kmock.Request, key: str) -> aiohttp.web.StreamResponse:
        if key != "v1/pods":
            raise ApiError(404, "NotFound", "proxy is served for pods only")
        pod_name, _, port = (request.name or "").partition(":")
        pod = self.store.get((key, request.namespace, pod_name))
        ip = ((pod or {}).get("status") or {}).get("podIP")
        if pod is None or not ip:
            raise ApiError(503, "ServiceUnavailable", f"pod {pod_name} has no IP")
        rest = (request.subresource or "proxy").removeprefix("proxy")
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.get(
                    f"http://{ip}:{port or 80}{rest or '/'}", timeout=aiohttp.ClientTimeout(total=5)
                ) as reply,
            ):
                text = await reply.text()
                return aiohttp.web.Response(text=text, status=reply.status, content_type="text/plain")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ApiError(503, "ServiceUnavailable", f"error trying to reach service: {exc}") from None

    def _table(self, key: str, items: list[dict[str, Any]]) -> dict[str, Any]:
        columns = [{"name": "Name", "type": "string", "format": "name", "description": "", "priority": 0}]
        extra = self.printer_columns.get(key, [])
        columns += [
            {"name": c["name"], "type": c.get("type", "string"), "format": c.get("format", ""),
             "description": c.get("description", ""), "priority": c.get("priority", 0)}
            for c in extra
        ]  # fmt: skip
        rows = []
        for obj in items:
            cells = [obj["metadata"]["name"]]
            cells += [_jsonpath(obj, c["jsonPath"]) for c in extra]
            rows.append({"cells": cells, "object": {"kind": "PartialObjectMetadata",
                                                     "apiVersion": "meta.k8s.io/v1",
                                                     "metadata": obj["metadata"]}})  # fmt: skip
        return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": {}, "columnDefinitions": columns,
                "rows": rows}  # fmt: skip

    @staticmethod
    def _error(
        status: int, reason: str, message: str, headers: dict[str, str] | None = None
    ) -> aiohttp.web.Response:
        body = {"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
                "code": status, "reason": reason, "message": message}  # fmt: skip
        return aiohttp.web.json_response(body, status=status, headers=headers)


class RunningApiServer:
    """An :class:`ApiServer` on its own event loop in a thread, for synchronous tests.

    The operator under test runs in a subprocess (so that it can be killed), kubectl in
    another; the test itself plays the training-operator and the kubelet through
    :meth:`call`, which runs a function on the server's loop, where the store lives.
    """

    def __init__(self, server: ApiServer | None = None) -> None:
        self.server = (
            server if server is not None else ApiServer()
        )  # a kmock handler with no requests is falsy
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="apiserver")
        self._http: kmock.Server | None = None
        self.url = ""

    def __enter__(self) -> RunningApiServer:
        self._thread.start()
        self._http = kmock.Server(self.server)

        async def start() -> str:
            await self.server.__aenter__()
            assert self._http is not None
            await self._http.__aenter__()
            return str(self._http.url).rstrip("/")

        self.url = asyncio.run_coroutine_threadsafe(start(), self.loop).result(LOOP_CALL_TIMEOUT)
        return self

    def __exit__(self, *exc: object) -> None:
        async def stop() -> None:
            assert self._http is not None
            await self._http.__aexit__(None, None, None)
            await self.server.__aexit__(None, None, None)

        async def cancel_the_rest() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        # Separately: a stop that times out (a watch stream still open) must not leave the
        # rest uncancelled, or their coroutines are collected after the loop is closed.
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(cancel_the_rest(), self.loop).result(10)
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self.loop.shutdown_asyncgens(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self.loop.close()

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        async def run() -> Any:
            return fn(*args, **kwargs)

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(LOOP_CALL_TIMEOUT)

    def kubeconfig(self, path: Path) -> Path:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "tester", "user": {"token": "test-token"}}],
            "contexts": [
                {
                    "name": "emulator",
                    "context": {"cluster": "emulator", "user": "tester", "namespace": "default"},
                }
            ],
            "current-context": "emulator",
        }
        path.write_text(yaml.safe_dump(config))
        return path

    def iter_objects(self, key: str, namespace: str | None = None) -> Iterator[dict[str, Any]]:
        yield from self.call(self.server.objects, key, namespace)
