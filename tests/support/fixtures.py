"""The session's shared fixtures, defined once (tests/conftest.py loads this as a plugin).

One real control plane serves the whole session: the control-plane suite first, the
end-to-end chain after it (each cleans up what it installs); tests/controlplane/test_api.py
alone also starts the oldest claimed kube-apiserver, for itself. One real S3-compatible store
(SeaweedFS, :mod:`support.objectstore`) serves every test that keeps things in a bucket; each
takes a prefix of its own. Fixtures that only one suite needs stay in that suite's conftest.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator

import pytest

from support import objectstore
from support.plane import controlplane
from support.plane.cluster import Api, install_crds

# The buckets the session's store has; each test writes under a prefix of its own.
BUCKETS = ("checkpoints",)


@pytest.fixture(scope="session")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[controlplane.ControlPlane]:
    """etcd + kube-apiserver + kube-controller-manager, built from their Go modules."""
    with controlplane.running(tmp_path_factory.mktemp("controlplane")) as running:
        yield running


@pytest.fixture(scope="session")
def crd_warnings(plane: controlplane.ControlPlane) -> str:
    """Our CRD, Kubeflow's PyTorchJob and Trainer v2 CRDs and Kopf's peering CRDs, created and
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
