"""The transport under every call the operator makes to the Kubernetes API: log in, send,
retry.

Objects travel as plain JSON dicts: the operator reads a handful of fields, and a client's
generated model classes would cost a deserialisation of every pod for nothing. Credentials
come from :mod:`gpuop.controller.credentials` (in-cluster or a kubeconfig); one urllib3 pool
carries every request. Every call goes
through :meth:`ApiSession._request`, which retries what a real API server sends under load or
during a control-plane upgrade (429, 500, 502, 503, 504, timeouts, refused connections) with
capped exponential backoff and jitter, honouring ``Retry-After``. Everything else is the
caller's to decide: 404 and 409 mean something (gone; exists or conflicts), 4xx is a bug or a
policy. The verbs themselves are :class:`gpuop.controller.kube.Kube`'s.
"""

from __future__ import annotations

import json
import logging
import random
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Self

import urllib3

from gpuop.controller import credentials
from gpuop.controller.credentials import Credentials

log = logging.getLogger(__name__)

USER_AGENT: Final = "gpuop-operator/0.1"
RETRIED_STATUSES: Final = frozenset({429, 500, 502, 503, 504})


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


class ApiSession:
    """Credentials, a connection pool and the one way out (:meth:`_request`). Thread-safe."""

    def __init__(
        self,
        login: Credentials,
        *,
        backoff: Backoff | None = None,
        timeout_seconds: float = 30.0,
        pool_size: int = 32,
    ) -> None:
        self.credentials = login
        self._pool = _pool(login, pool_size)
        self.backoff = backoff or Backoff()
        self.timeout_seconds = timeout_seconds
        self.in_cluster = login.in_cluster
        self.requests = RequestCounter()

    @classmethod
    def login(cls, *, pool_size: int = 32) -> Self:
        """Credentials the way kubectl finds them: in a pod its ServiceAccount, else KUBECONFIG."""
        try:
            found = credentials.login()
        except credentials.CredentialsError as exc:
            raise LoginError(
                f"no cluster credentials: not in a pod, and no usable kubeconfig ({exc}); set "
                "KUBECONFIG or run in-cluster with a ServiceAccount"
            ) from None
        return cls(found, pool_size=pool_size)

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
        url = f"{self.credentials.server}{path}"
        verb, resource = request_target(method, path)
        attempts = attempts or self.backoff.attempts
        for attempt in range(attempts):
            started = time.monotonic()
            try:
                response = self._pool.request(
                    method, url, body=payload, headers=headers | _auth_header(self.credentials),
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

    def _open_stream(self, path: str, resource: str, read_timeout: float) -> urllib3.BaseHTTPResponse:
        """A GET whose reply is read as it comes (a watch), not retried; the response, its
        status 200, for the caller to read and close. ApiError as :meth:`_request` raises it."""
        url = f"{self.credentials.server}{path}"
        headers = {"Accept": "application/json", "User-Agent": USER_AGENT} | _auth_header(self.credentials)
        started = time.monotonic()
        try:
            response = self._pool.request(
                "GET", url, headers=headers, preload_content=False, retries=False,
                timeout=urllib3.Timeout(connect=self.timeout_seconds, read=read_timeout),
            )  # fmt: skip
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            self.requests.record("watch", resource, 0, time.monotonic() - started)
            raise ApiError(0, "Unreachable", str(exc)) from None
        self.requests.record("watch", resource, response.status, time.monotonic() - started)
        if response.status != 200:
            try:
                raise _error(response.status, response.read())
            finally:
                response.close()
                response.release_conn()
        return response


def _pool(login: Credentials, size: int) -> urllib3.PoolManager:
    """One connection pool: the API server's CA, a client certificate, the TLS server name, a
    proxy; ``size`` connections kept (the workers and the watches at once)."""
    args: dict[str, Any] = {
        "cert_reqs": ssl.CERT_NONE if login.insecure else ssl.CERT_REQUIRED,
        "ca_certs": login.ca_file,
        "cert_file": login.cert_file,
        "key_file": login.key_file,
        "maxsize": size,
    }
    if login.insecure:
        args["assert_hostname"] = False
    if login.tls_server_name:
        args["server_hostname"] = login.tls_server_name
    if login.proxy:
        return urllib3.ProxyManager(proxy_url=login.proxy, **args)
    return urllib3.PoolManager(**args)


def _auth_header(login: Credentials) -> dict[str, str]:
    """The bearer token, asked for on every request: a projected token's file is reread as the
    kubelet rotates it, an exec plugin's run again as it expires."""
    token = login.bearer()
    return {"Authorization": f"Bearer {token}"} if token else {}


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


def _error(status: int, data: bytes) -> ApiError:
    try:
        body = json.loads(data)
    except ValueError:
        body = None
    if isinstance(body, dict):
        return ApiError(status, str(body.get("reason") or ""), str(body.get("message") or ""))
    return ApiError(status, "", data[:200].decode("utf-8", errors="replace"))
