"""What a controller's pod gives it that a process on the test host lacks, for a controller
that reads it: its ServiceAccount's files at the in-cluster path, and the ``kubernetes``
Service by its cluster DNS name.

Trainer v2's progress server (its ``TrainJobStatus`` gate) needs both. It reads the token
issuer from ``/var/run/secrets/kubernetes.io/serviceaccount/token`` and fetches the issuer's
OpenID discovery document from that URL, ``https://kubernetes.default.svc.cluster.local``
here: the API server's own ``/.well-known/openid-configuration``. In a pod, kubelet mounts the
files and CoreDNS plus kube-proxy route the name. Here the controller runs in a private mount
namespace (:class:`support.controllers.webhooked.WebhookedController`), where the files are
mounted at that path, and a CONNECT proxy on loopback stands in for DNS and kube-proxy: it
routes the Service's name to the API server, with no other destination. The controller's
own API connection (the kubeconfig, on loopback) bypasses the proxy, as Go's
``ProxyFromEnvironment`` never proxies loopback. Everything the controller asks of the API
server is the real server's answer.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
from pathlib import Path
from typing import Final

from support.plane.cluster import Api, HttpError
from support.plane.controlplane import SERVICE_ACCOUNT_ISSUER, ControlPlane
from support.tcp import TcpServer

MOUNT: Final = "/var/run/secrets/kubernetes.io/serviceaccount"
SERVICE_HOST: Final = SERVICE_ACCOUNT_ISSUER.removeprefix("https://")


class ServiceAccountFiles:
    """A ServiceAccount's token (TokenRequest, an hour), the cluster's CA and the namespace,
    as kubelet writes them, in ``directory``; :meth:`mount` is the shell line that puts them
    at :data:`MOUNT` inside the controller's mount namespace."""

    def __init__(self, plane: ControlPlane, api: Api, namespace: str, name: str, directory: Path) -> None:
        try:
            api.request(
                "POST", f"/api/v1/namespaces/{namespace}/serviceaccounts", {"metadata": {"name": name}}
            )
        except HttpError as exc:
            if exc.status != 409:  # it exists
                raise
        minted = api.request("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token",
                             {"spec": {"expirationSeconds": 3600}})  # fmt: skip
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "token").write_text(minted["status"]["token"])
        (directory / "ca.crt").write_bytes(plane.ca.cert.read_bytes())
        (directory / "namespace").write_text(namespace)
        self.directory = directory

    def mount(self) -> str:
        # /run (where /var/run points) gets a tmpfs of its own in the namespace, so the mount
        # point is made there and the host's /run is untouched; the controller sees nothing
        # else of /run (it reads nothing there, as in its container).
        return (
            f"mount -t tmpfs -o size=1m run /run && mkdir -p {MOUNT} && mount --bind {self.directory} {MOUNT}"
        )


class ServiceProxy:
    """An HTTP CONNECT proxy on loopback for ``kubernetes.default.svc.cluster.local:443`` (to the
    API server) alone; any other destination gets 403. Serves until :meth:`close`."""

    def __init__(self, plane: ControlPlane) -> None:
        self.apiserver_port = plane.apiserver_port
        # The API server's own address is dialled directly (the discovery document's jwks_uri
        # names it), as a pod dials an address it was given.
        self.direct = ("127.0.0.1", "localhost", plane.advertise_address)
        self.routed = 0  # tunnels opened: the controller did reach the Service through here
        self._closing = threading.Event()
        self._server = TcpServer(("127.0.0.1", 0), self._tunnel, "service-proxy")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.port}"

    def environment(self) -> dict[str, str]:
        """The process's proxy variables (Go's ``ProxyFromEnvironment`` reads them)."""
        return {"HTTPS_PROXY": self.url, "NO_PROXY": ",".join(self.direct)}

    def close(self) -> None:
        self._closing.set()  # the open tunnels end within a second
        self._server.close()

    def _tunnel(self, client: socket.socket) -> None:
        client.settimeout(10)
        head = b""
        with contextlib.suppress(OSError):
            while b"\r\n\r\n" not in head and len(head) < 8192:
                chunk = client.recv(1024)
                if not chunk:
                    return
                head += chunk
        method, _, rest = head.partition(b" ")
        target = rest.partition(b" ")[0].decode(errors="replace")
        if method != b"CONNECT" or target != f"{SERVICE_HOST}:443":
            with contextlib.suppress(OSError):
                client.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
            return
        try:
            upstream = socket.create_connection(("127.0.0.1", self.apiserver_port), timeout=10)
        except OSError:
            with contextlib.suppress(OSError):
                client.sendall(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n")
            return
        self.routed += 1
        with upstream:
            client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
            _splice(client, upstream, self._closing)


def _splice(a: socket.socket, b: socket.socket, closing: threading.Event) -> None:
    """Bytes both ways until either side closes (or the proxy does)."""
    a.settimeout(None)
    b.settimeout(None)
    peers = {a: b, b: a}
    while not closing.is_set():
        readable, _, _ = select.select(list(peers), [], [], 1.0)
        for sock in readable:
            try:
                data = sock.recv(65536)
            except OSError:
                return
            if not data:
                return
            try:
                peers[sock].sendall(data)
            except OSError:
                return
