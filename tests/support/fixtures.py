"""The session's shared fixtures, defined once (tests/conftest.py loads this as a plugin).

One real control plane serves the whole session: the control-plane suite first, the
end-to-end chain after it (each cleans up what it installs); tests/controlplane/test_api.py
alone also starts the oldest claimed kube-apiserver, for itself. One real S3-compatible store
(SeaweedFS, :mod:`support.objectstore`) serves every test that keeps things in a bucket; each
takes a prefix of its own. One real OCI registry (:mod:`support.registry`) holds what one
``make release`` pushed, for every suite that installs or pulls it. Fixtures that only one suite
needs stay in that suite's conftest.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from support import objectstore, registry
from support.paths import ROOT
from support.plane import controlplane
from support.plane.cluster import Api, install_crds
from support.tools import cosign

# The buckets the session's store has; each test writes under a prefix of its own.
BUCKETS = ("checkpoints",)


@pytest.fixture(scope="session")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[controlplane.ControlPlane]:
    """etcd + kube-apiserver + kube-controller-manager, built from their Go modules."""
    with controlplane.running(tmp_path_factory.mktemp("controlplane")) as running:
        yield running


@pytest.fixture(scope="session")
def crd_warnings(plane: controlplane.ControlPlane) -> str:
    """Our CRD, Kubeflow's PyTorchJob and Trainer v2 CRDs, created and
    Established once; the value is whatever kubectl printed on stderr while applying them."""
    return installed_crds(plane)


_CRD_WARNINGS: weakref.WeakKeyDictionary[controlplane.ControlPlane, str] = weakref.WeakKeyDictionary()


def installed_crds(plane: controlplane.ControlPlane) -> str:
    """:func:`install_crds` once per control plane, and what kubectl warned then.

    A module that overrides ``plane`` to run on more than one version (tests/controlplane/
    test_api.py) cannot reach the session's ``crd_warnings``: that fixture would resolve
    ``plane`` to the module's override, of a narrower scope. It asks here instead, so the
    session's plane still gets its CRDs applied once, whichever asks first.
    """
    if plane not in _CRD_WARNINGS:
        _CRD_WARNINGS[plane] = install_crds(plane)
    return _CRD_WARNINGS[plane]


@pytest.fixture(scope="session")
def api(plane: controlplane.ControlPlane, crd_warnings: str) -> Api:
    """The test's client of the control plane, its CRDs installed."""
    return Api(plane)


@pytest.fixture(scope="session")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[objectstore.S3Server]:
    """The session's real S3-compatible store, its buckets (:data:`BUCKETS`) made, on this
    machine's address: the chain's trainer pods checkpoint to it as the trainer tests do."""
    host = controlplane.host_address()
    with objectstore.running_server(tmp_path_factory.mktemp("s3"), BUCKETS, host) as server:
        yield server


@pytest.fixture(scope="session")
def local_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[registry.Registry]:
    """The session's OCI registry, over TLS on loopback with a CA of its own. Its storage goes
    with it: the trainer image is gigabytes, which pytest's kept temporary directories of
    earlier sessions would otherwise hold on to."""
    directory = tmp_path_factory.mktemp("registry")
    try:
        with registry.running_registry(directory) as running:
            yield running
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@dataclass(frozen=True)
class Released:
    """What one ``make release`` pushed to the session's registry and left in ``dist``."""

    registry: registry.Registry
    dist: Path
    described: dict[str, object]  # its release.json
    seconds: float

    @property
    def version(self) -> str:
        return str(self.described["version"])

    @property
    def chart(self) -> str:
        """``oci://HOST:PORT/charts/gpu-training-operator``: what a user's ``helm install`` names."""
        chart = self.described["chart"]
        assert isinstance(chart, dict)
        return str(chart["reference"])

    def helm_chart(self) -> list[str]:
        """helm's words for this release's chart, as a user installs it (and the CA a user's
        machine would trust the registry with)."""
        return [self.chart, "--version", self.version, "--ca-file", str(self.registry.ca)]

    def reference(self, name: str) -> str:
        """``HOST:PORT/<name>:<version>``: an image by tag (``operator``, ``trainer``), as the
        released chart's defaults name it."""
        return f"{self.registry.address}/{name}:{self.version}"

    def image(self, name: str) -> str:
        """``HOST:PORT/<name>:<version>@sha256:...``: the image as pushed."""
        images = self.described["images"]
        assert isinstance(images, dict)
        return str(images[name])


def cosign_key_pair(directory: Path, name: str, password: str) -> Path:
    """``cosign generate-key-pair`` in ``directory``: ``<name>.key`` (its path), ``<name>.pub``."""
    subprocess.run([str(cosign.ensure()), "generate-key-pair", "--output-key-prefix", name], cwd=directory,
                   env={**os.environ, "COSIGN_PASSWORD": password}, check=True, capture_output=True, timeout=60)  # fmt: skip
    return directory / f"{name}.key"


@pytest.fixture(scope="session")
def released(local_registry: registry.Registry, tmp_path_factory: pytest.TempPathFactory) -> Released:
    """``make release`` against the session's registry, as a maintainer runs it: the recipe the
    release workflow runs, the Makefile's line included, signing with a key of its own."""
    dist, keys = tmp_path_factory.mktemp("dist"), tmp_path_factory.mktemp("cosign")
    password = "release-password"
    key = cosign_key_pair(keys, "release", password=password)
    started = time.monotonic()
    result = subprocess.run(
        ["make", "-s", "release", f"REGISTRY={local_registry.address}", f"REGISTRY_CA={local_registry.ca}",
         f"DIST={dist}", f"COSIGN_KEY={key}", *([f"HELM={os.environ['HELM']}"] if os.environ.get("HELM") else [])],
        cwd=ROOT, capture_output=True, text=True, timeout=1800,
        env={**os.environ, "COSIGN_PASSWORD": password},
    )  # fmt: skip
    if result.returncode != 0:
        pytest.fail(f"make release failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    described = json.loads((dist / "release.json").read_text())
    return Released(local_registry, dist, described, time.monotonic() - started)
