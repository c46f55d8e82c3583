"""A cluster with no Kubeflow at all: ``backend: auto`` runs a training on a plain Job.

A control plane of its own (etcd, kube-apiserver, kube-controller-manager with the real Job
controller), with our CRD and nothing else: the session's plane serves Kubeflow's APIs, where
auto would pick them. The rest of the Job backend runs on the session's plane under the chart's
RBAC (tests/controlplane/test_operator.py) and trains on real nodes (tests/e2e_local).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from support import specs
from support.plane import controlplane
from support.plane.cluster import OUR_CRD, Api, OperatorProcess, install_crds
from support.waiting import wait_for


@pytest.fixture(scope="module")
def bare(tmp_path_factory: pytest.TempPathFactory) -> Iterator[controlplane.ControlPlane]:
    with controlplane.running(tmp_path_factory.mktemp("bare-plane")) as plane:
        install_crds(plane, (OUR_CRD,))
        yield plane


def test_auto_takes_a_job_where_the_cluster_serves_no_kubeflow(
    bare: controlplane.ControlPlane, tmp_path: Path
) -> None:
    api = Api(bare)
    operator = OperatorProcess(bare.kubeconfig, tmp_path)
    operator.start("--standalone")
    try:
        api.create("gputrainings", specs.training("plain", workers=2, gpusPerWorker=0), "default")
        job = wait_for("the Job", lambda: api.get("jobs", "plain"), timeout=60)
        assert job["spec"]["completionMode"] == "Indexed"
        assert api.get("services", "plain") is not None
        status = wait_for("the backend chosen", lambda: (s := (api.get("gputrainings", "plain") or {})
                          .get("status") or {}).get("backend") and s)  # fmt: skip
        assert status["backend"] == "job"
        selected = next(c for c in status["conditions"] if c["type"] == "BackendSelected")
        assert (selected["reason"], selected["message"]) == (
            "Auto",
            "spec.backend is auto; the cluster serves Job and no PyTorchJob or TrainJob",
        )
        selector = "batch.kubernetes.io/job-name=plain"
        wait_for(
            "the Job controller's pods", lambda: len(api.list("pods", selector=selector)) == 2, timeout=60
        )
        bare.kubectl("delete", "gtr", "plain")
        wait_for("the Job and its Service garbage-collected", lambda: api.get("jobs", "plain") is None
                 and api.get("services", "plain") is None, timeout=60)  # fmt: skip
    finally:
        operator.stop()
    assert "Traceback" not in operator.log(), operator.log()[-4000:]
