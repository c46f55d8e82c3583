"""The real control-plane suite: one etcd + kube-apiserver + kube-controller-manager for the
session, built from the Go modules beside this file (support.controlplane).

Every test here is marked ``controlplane``. None skips: without ``go`` the binaries cannot be
built and the suite fails, saying so.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from support import controlplane
from support.realcluster import Api, install_crds


@pytest.fixture(scope="session")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[controlplane.ControlPlane]:
    with controlplane.running(tmp_path_factory.mktemp("controlplane")) as running:
        yield running


@pytest.fixture(scope="session")
def crd_warnings(plane: controlplane.ControlPlane) -> str:
    """Our CRD, Kubeflow's PyTorchJob and Trainer v2 CRDs and Kopf's peering CRDs, created and Established
    once; the value is whatever kubectl printed on stderr while applying them."""
    return install_crds(plane)


@pytest.fixture(scope="session")
def api(plane: controlplane.ControlPlane, crd_warnings: str) -> Api:
    return Api(plane)
