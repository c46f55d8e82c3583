"""Where the API server is and who the operator is to it, found the way kubectl finds them: in a
pod its ServiceAccount, else the current context of ``$KUBECONFIG`` (or ``~/.kube/config``).

Our own reader, not the kubernetes client's: importing that package costs the operator about
20 MB of resident memory (Kopf imports it too, whenever it is installed), and of it only the
two loaders were used. What a kubeconfig may say that is read here: the cluster's server, CA
(file or inline), ``insecure-skip-tls-verify``, ``tls-server-name`` and ``proxy-url``; the user's
client certificate and key (files or inline), ``token``, ``tokenFile``, and an ``exec``
credential plugin (what EKS's, GKE's and AKS's kubeconfigs use), whose token is kept until it
expires. Basic auth (gone from Kubernetes since 1.19) and the old ``auth-provider`` entries
are refused with the reason.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import functools
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Final

import yaml

SERVICE_ACCOUNT: Final = Path("/var/run/secrets/kubernetes.io/serviceaccount")
# client-go rereads a projected token's file every minute: the kubelet rotates it well before
# it expires (at 80% of its life), so a minute-old copy is always still good.
TOKEN_FILE_REREAD_SECONDS: Final = 60.0
# An exec plugin's token is run for again this long before it says it expires, so that no
# request carries one that expires on the way.
EXEC_TOKEN_MARGIN_SECONDS: Final = 30.0
EXEC_TIMEOUT_SECONDS: Final = 60.0


class CredentialsError(Exception):
    """No usable credentials; the message says where they were looked for and what was wrong."""


class TokenFile:
    """A bearer token read from a file, and read again every minute (a projected token rotates)."""

    def __init__(self, path: Path, clock: Callable[[], float] = time.monotonic) -> None:
        self.path, self._clock = path, clock
        self._lock = threading.Lock()
        self._read_at: float | None = None
        self._token = ""

    def __call__(self) -> str:
        with self._lock:
            now = self._clock()
            if self._read_at is None or now - self._read_at >= TOKEN_FILE_REREAD_SECONDS:
                try:
                    self._token = self.path.read_text().strip()
                except OSError as exc:
                    if self._read_at is None:
                        raise CredentialsError(f"cannot read the token file {self.path}: {exc}") from None
                    # A rotation caught half-way: the last token read is still good for a while.
                self._read_at = now
            return self._token


class ExecToken:
    """The token of a kubeconfig's ``exec`` plugin (ExecCredential), run again once it expires
    (or at every request when it gives no expiry, as kubectl does)."""

    def __init__(self, spec: Mapping[str, Any], base: Path, clock: Callable[[], float] = time.time) -> None:
        self.spec, self.base, self._clock = spec, base, clock
        self._lock = threading.Lock()
        self._token: str | None = None
        self._until = 0.0

    def __call__(self) -> str:
        with self._lock:
            if self._token is None or self._clock() >= self._until:
                self._token, self._until = self._run()
            return self._token

    def _run(self) -> tuple[str, float]:
        command = str(self.spec.get("command") or "")
        if not command:
            raise CredentialsError("the kubeconfig's exec plugin names no command")
        if "/" in command and not os.path.isabs(command):
            command = str(self.base / command)  # relative to the kubeconfig, as kubectl reads it
        api_version = str(self.spec.get("apiVersion") or "client.authentication.k8s.io/v1")
        info = {"apiVersion": api_version, "kind": "ExecCredential", "spec": {"interactive": False}}
        env = os.environ | {str(e["name"]): str(e["value"]) for e in self.spec.get("env") or ()}
        env["KUBERNETES_EXEC_INFO"] = json.dumps(info)
        try:
            done = subprocess.run(
                [command, *(str(a) for a in self.spec.get("args") or ())], env=env, capture_output=True,
                text=True, timeout=EXEC_TIMEOUT_SECONDS, stdin=subprocess.DEVNULL, check=False,
            )  # fmt: skip
        except (OSError, subprocess.TimeoutExpired) as exc:
            hint = self.spec.get("installHint")
            raise CredentialsError(
                f"the kubeconfig's exec plugin {command}: {exc}" + (f" ({hint})" if hint else "")
            ) from None
        if done.returncode != 0:
            said = done.stderr.strip()[-300:]
            raise CredentialsError(f"the kubeconfig's exec plugin {command} exited {done.returncode}: {said}")
        try:
            status = json.loads(done.stdout)["status"]
            token = str(status["token"])
        except (ValueError, KeyError, TypeError):
            raise CredentialsError(
                f"the kubeconfig's exec plugin {command} gave no token (a client certificate is not read)"
            ) from None
        expires = status.get("expirationTimestamp")
        until = self._clock()
        if isinstance(expires, str):
            with contextlib.suppress(ValueError):
                until = (
                    datetime.fromisoformat(expires.replace("Z", "+00:00")).timestamp()
                    - EXEC_TOKEN_MARGIN_SECONDS
                )
        return token, until


@dataclass(frozen=True)
class Credentials:
    """The API server and how to be let in: TLS material as files (inline data is written to
    files of this process's own), and a bearer token asked for at each request."""

    server: str
    in_cluster: bool
    ca_file: str | None = None
    insecure: bool = False
    tls_server_name: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    proxy: str | None = None
    token: Callable[[], str] | None = None
    namespace: str | None = None

    def bearer(self) -> str | None:
        return self.token() if self.token is not None else None


def login() -> Credentials:
    """In a pod, its ServiceAccount; else the kubeconfig's current context."""
    found = in_cluster()
    if found is not None:
        return found
    return from_kubeconfig()


def in_cluster(root: Path = SERVICE_ACCOUNT, environ: Mapping[str, str] = os.environ) -> Credentials | None:
    """The pod's ServiceAccount, when this runs in a pod that has one mounted; else None."""
    host, port = environ.get("KUBERNETES_SERVICE_HOST"), environ.get("KUBERNETES_SERVICE_PORT")
    if not host or not port or not (root / "token").is_file():
        return None
    if ":" in host:  # an IPv6 address
        host = f"[{host}]"
    token = TokenFile(root / "token")
    token()  # unreadable: said now, not at the first request
    namespace = root / "namespace"
    return Credentials(
        server=f"https://{host}:{port}", in_cluster=True, ca_file=str(root / "ca.crt"), token=token,
        namespace=namespace.read_text().strip() if namespace.is_file() else None,
    )  # fmt: skip


def from_kubeconfig(paths: str | None = None, context: str | None = None) -> Credentials:
    """The context ``context`` (default: the current one) of the kubeconfig files ``paths``
    (default: ``$KUBECONFIG``, else ``~/.kube/config``), merged as kubectl merges them: the first
    file to name a cluster, user or context wins."""
    listed = (
        paths if paths is not None else os.environ.get("KUBECONFIG") or str(Path.home() / ".kube" / "config")
    )
    files = [Path(p).expanduser() for p in listed.split(os.pathsep) if p]
    merged: dict[str, dict[str, tuple[Mapping[str, Any], Path]]] = {
        "clusters": {},
        "users": {},
        "contexts": {},
    }
    current = context
    read = []
    for path in files:
        try:
            config = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            if len(files) == 1:
                raise CredentialsError(f"cannot read the kubeconfig {path}: {exc}") from None
            continue
        read.append(path)
        for section, entries in merged.items():
            for entry in config.get(section) or ():
                if isinstance(entry, Mapping) and entry.get("name") not in entries:
                    entries[str(entry.get("name"))] = (entry, path.parent)
        current = current or config.get("current-context")
    if not read:
        raise CredentialsError(f"no kubeconfig could be read from {listed}")
    if not current or current not in merged["contexts"]:
        raise CredentialsError(f"the kubeconfig {listed} has no context {current!r}")
    named = merged["contexts"][current][0].get("context") or {}
    cluster_name, user_name = str(named.get("cluster")), str(named.get("user"))
    if cluster_name not in merged["clusters"]:
        raise CredentialsError(
            f"the kubeconfig's context {current} names no known cluster ({cluster_name!r})"
        )
    cluster, cluster_base = merged["clusters"][cluster_name]
    user, user_base = merged["users"].get(user_name, ({}, Path.cwd()))
    return _credentials(cluster.get("cluster") or {}, cluster_base, user.get("user") or {}, user_base,
                        named.get("namespace"))  # fmt: skip


def _credentials(
    cluster: Mapping[str, Any], cluster_base: Path, user: Mapping[str, Any], user_base: Path, namespace: Any
) -> Credentials:
    server = str(cluster.get("server") or "")
    if not server:
        raise CredentialsError("the kubeconfig's cluster has no server")
    if user.get("auth-provider") or user.get("username"):
        raise CredentialsError(
            "the kubeconfig's user logs in with an auth-provider or a password, which Kubernetes no longer "
            "supports: use a token, a client certificate or an exec plugin"
        )
    token: Callable[[], str] | None = None
    if user.get("exec"):
        token = ExecToken(user["exec"], user_base)
    elif user.get("tokenFile"):
        token = TokenFile(_path(user["tokenFile"], user_base))
    elif user.get("token"):
        value = str(user["token"])
        token = lambda: value  # noqa: E731
    return Credentials(
        server=server.rstrip("/"),
        in_cluster=False,
        ca_file=_file(cluster, "certificate-authority", cluster_base),
        insecure=bool(cluster.get("insecure-skip-tls-verify")),
        tls_server_name=cluster.get("tls-server-name") or None,
        cert_file=_file(user, "client-certificate", user_base),
        key_file=_file(user, "client-key", user_base),
        proxy=cluster.get("proxy-url") or None,
        token=token,
        namespace=str(namespace) if namespace else None,
    )


def _path(value: Any, base: Path) -> Path:
    path = Path(str(value)).expanduser()
    return path if path.is_absolute() else base / path


def _file(entry: Mapping[str, Any], key: str, base: Path) -> str | None:
    """``key`` as a path (relative to the kubeconfig's folder), or ``key-data`` written to a
    file only this process reads."""
    if entry.get(key):
        return str(_path(entry[key], base))
    data = entry.get(f"{key}-data")
    if not data:
        return None
    try:
        decoded = base64.b64decode(str(data), validate=True)
    except ValueError:
        raise CredentialsError(f"the kubeconfig's {key}-data is not base64") from None
    handle, name = tempfile.mkstemp(prefix="gpuop-", suffix=f"-{key}", dir=_private_dir())
    with os.fdopen(handle, "wb") as out:
        out.write(decoded)
    return name


@functools.cache
def _private_dir() -> str:
    """One folder a process for the files of inline credentials, removed at its exit."""
    made = tempfile.mkdtemp(prefix="gpuop-credentials-")  # mode 0700
    atexit.register(shutil.rmtree, made, True)
    return made
