"""A real OCI registry on this machine: CNCF Distribution (the ``registry`` that Docker Hub, GitLab
and Harbor grew from), built from its Go module (``tests/registry/go.mod``) as the control plane
is, and served over TLS on loopback with a CA of its own.

It is what ``make release`` pushes to and what the nodes' containerd pulls from, so the images,
the chart and the pulls the tests run are the ones a user's cluster would run: nothing is imported
into a node's store behind the kubelet's back. Loopback is enough: containerd pulls on the host's
network, not from inside a pod.

It is named by this machine's host name, which resolves to the loopback here, not by
``localhost`` or ``127.0.0.1``: helm and containerd speak plain HTTP to those (a registry on
loopback is assumed to be a developer's insecure one), and this one checks TLS as a cloud's does.

:func:`running_registry` starts one in a directory of its own and stops it; what it writes there:

- ``registry`` (one line, ``HOST:PORT``): where it answers;
- ``registry-ca.crt``: the CA its serving certificate chains to (a client's ``--ca-file``, a
  node's ``hosts.toml``).

    PYTHONPATH=tests python3 -m support.registry       # build (or find) the server
"""

from __future__ import annotations

import contextlib
import secrets
import socket
import ssl
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import yaml

from support.node.process import Supervised, spawn, wait_until
from support.paths import ROOT
from support.plane import gobuild
from support.tls import CertificateAuthority

MODULE: Final = ROOT / "tests" / "registry"
DISTRIBUTION: Final = "github.com/distribution/distribution/v3"
ADDRESS_FILE: Final = "registry"
CA_FILE: Final = "registry-ca.crt"


def recipe() -> gobuild.Recipe:
    version = gobuild.required_version(MODULE, DISTRIBUTION)
    return gobuild.Recipe(
        name="registry",
        module=MODULE,
        packages={"registry": f"{DISTRIBUTION}/cmd/registry"},
        label=f"distribution-{version}",
        cold_cost="measured 6.1 min (3.5 CPU-min) on 2 cores beside the control plane's build, after a 49 s module download",
    )


def ensure_server(say: gobuild.Say = gobuild.say_on_stderr) -> Path:
    """The cached ``registry`` binary, built first when missing. Safe from several processes."""
    return gobuild.ensure(recipe(), say) / "registry"


@dataclass(frozen=True)
class Registry:
    """A running registry: ``host:port`` and the CA that signs its certificate."""

    address: str
    ca: Path

    def context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca))

    def url(self, path: str) -> str:
        return f"https://{self.address}{path}"


def _free_port(address: str) -> int:
    # The registry takes its address from its configuration, not from a port 0 it could report;
    # a port picked here is free unless another process takes it in the next milliseconds.
    with socket.socket() as probe:
        probe.bind((address, 0))
        port: int = probe.getsockname()[1]
        return port


def loopback_name() -> tuple[str, str]:
    """A name of this machine that resolves to a loopback address and that helm and containerd do
    not treat as insecure (neither ``localhost`` nor an IP): the host name, as /etc/hosts has it;
    and that address (127.0.0.1 here; Debian's /etc/hosts says 127.0.1.1), to listen on."""
    name = socket.gethostname()
    try:
        addresses = sorted({str(info[4][0]) for info in socket.getaddrinfo(name, None, socket.AF_INET)})
    except OSError:
        addresses = []
    if not addresses or not all(address.startswith("127.") for address in addresses):
        raise RuntimeError(f"the registry needs a name for the loopback other than localhost, and this machine's "
                           f"name {name!r} resolves to {addresses or 'nothing'}: add '127.0.0.1 {name}' "
                           "to /etc/hosts")  # fmt: skip
    return name, addresses[0]


def _config(directory: Path, address: str, port: int, cert: Path, key: Path) -> dict[str, object]:
    return {
        "version": 0.1,
        "log": {"level": "warn", "accesslog": {"disabled": True}},
        # delete: a test can remove what it pushed; the storage is the directory, gone at stop.
        "storage": {"filesystem": {"rootdirectory": str(directory / "storage")}, "delete": {"enabled": True}},
        "http": {
            "addr": f"{address}:{port}",
            # Signs upload state between requests; any value works for one process.
            "secret": secrets.token_hex(16),
            "tls": {"certificate": str(cert), "key": str(key)},
        },
    }


def answers(registry: Registry) -> bool:
    """Whether ``GET /v2/`` (the API's base, which every client asks first) answers 200."""
    with urllib.request.urlopen(registry.url("/v2/"), context=registry.context(), timeout=5) as response:
        return bool(response.status == 200)


@contextlib.contextmanager
def running_registry(directory: Path, timeout: float = 30.0) -> Iterator[Registry]:
    """A registry whose state lives in ``directory`` (made here) for the ``with`` block."""
    binary = ensure_server()
    directory.mkdir(parents=True, exist_ok=True)
    name, address = loopback_name()
    ca = CertificateAuthority.create(directory / "pki", common_name="gpuop-registry-ca")
    cert, key = ca.issue("registry", name, sans=[f"DNS:{name}", f"IP:{address}"])
    port = _free_port(address)
    config = directory / "config.yml"
    config.write_text(yaml.safe_dump(_config(directory, address, port, cert, key)))
    (directory / CA_FILE).write_bytes(ca.cert.read_bytes())
    registry = Registry(f"{name}:{port}", directory / CA_FILE)
    process: Supervised = spawn("registry", [str(binary), "serve", str(config)], directory / "registry.log")
    try:
        wait_until(
            lambda: answers(registry), timeout, f"answer from the registry at {registry.address}", process
        )
        (directory / ADDRESS_FILE).write_text(registry.address + "\n")
        yield registry
    finally:
        process.stop()


def read(directory: Path) -> Registry:
    """The registry a running ``make cluster`` (or a test's) wrote into ``directory``."""
    return Registry((directory / ADDRESS_FILE).read_text().strip(), directory / CA_FILE)


if __name__ == "__main__":
    sys.exit(gobuild.print_built(ensure_server))
