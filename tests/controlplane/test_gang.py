"""Gang scheduling through the real training-operator v1.9.4, judged by the gang schedulers' own
PodGroup CRDs on the real API server.

The operator renders no PodGroup: ``scheduling.gang`` sets the PyTorchJob's
``runPolicy.schedulingPolicy`` and the training-operator, started with
``--gang-scheduler-name``, makes the PodGroup from it and names the gang scheduler in the pods.
Here that chain runs for real: our operator (watching this module's namespaces) -> the
PyTorchJob -> the training-operator -> a PodGroup that the API server accepts against Volcano's
CRD (generated from volcano.sh/apis by controller-gen) or the coscheduler's (from the
scheduler-plugins module), at the versions the training-operator is linked with
(:mod:`support.controllers.podgroups`). No scheduler runs: the test plays Volcano's, which
admits a PodGroup by setting its phase and then writes its conditions once a scheduling cycle
(:func:`_admit_as_volcano`), and the pods stay unscheduled.

A training-operator with a gang scheduler gangs every job it sees, so each test's instance
watches only a namespace of its own (``--namespace``); its webhook is the cluster-wide one every
instance serves, and it is retired after (no other instance runs on the session's plane while
this suite does).
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

import pytest
import yaml

from gpuop.api.spec import parse
from gpuop.backends.pytorchjob import render_pytorchjob
from support import specs
from support.controllers import podgroups, trainingoperator
from support.plane.cluster import Api, HttpError, OperatorProcess, install_crds
from support.plane.controlplane import ControlPlane
from support.waiting import wait_for

VOLCANO_NAMESPACE: Final = "gang-volcano"
COSCHEDULER_NAMESPACE: Final = "gang-coscheduler"
VOLCANO: Final = "/apis/scheduling.volcano.sh/v1beta1"
COSCHEDULER: Final = "/apis/scheduling.x-k8s.io/v1alpha1"
# The coscheduler's scheduler name in scheduler-plugins' manifests; the training-operator takes
# any name but volcano as a scheduler-plugins scheduler.
COSCHEDULER_NAME: Final = "scheduler-plugins-scheduler"


@pytest.fixture(scope="module")
def podgroup_crds(plane: ControlPlane, api: Api) -> Iterator[list[str]]:
    """Both PodGroup CRDs, and a namespace per gang scheduler; all removed after the module."""
    paths = [podgroups.volcano_crd(), podgroups.coscheduler_crd()]
    install_crds(plane, paths)
    for namespace in (VOLCANO_NAMESPACE, COSCHEDULER_NAMESPACE):
        plane.kubectl("create", "namespace", namespace)
    names = [yaml.safe_load(path.read_text())["metadata"]["name"] for path in paths]
    yield names
    # Waited for: the next modules' operators watch every namespace, and their audit checks
    # count what they did.
    plane.kubectl("delete", "namespace", VOLCANO_NAMESPACE, COSCHEDULER_NAMESPACE, "--timeout=90s")
    plane.kubectl("delete", "crd", *names, "--ignore-not-found", "--timeout=60s")


@pytest.fixture(scope="module")
def operator(podgroup_crds: list[str], plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[OperatorProcess]:  # fmt: skip
    process = OperatorProcess(plane.kubeconfig, tmp_path_factory.mktemp("gang-operator"))
    process.start("--standalone", "--namespace", f"{VOLCANO_NAMESPACE},{COSCHEDULER_NAMESPACE}")
    yield process
    process.stop()
    assert "Traceback" not in process.log(), process.log()[-4000:]


@contextlib.contextmanager
def gang_training_operator(
    plane: ControlPlane, api: Api, workdir: Path, scheduler: str, namespace: str
) -> Iterator[None]:
    """The real training-operator with ``--gang-scheduler-name=scheduler``, for ``namespace`` alone."""
    assert api.get_at(_webhook_configuration()) is None, (
        "another training-operator serves this plane; a gang-scheduling one beside it would fight "
        "it over the same jobs and webhook"
    )
    process = trainingoperator.training_operator(
        plane, api, plane.advertise_address, workdir, gang_scheduler=scheduler, watch_namespace=namespace
    )
    process.start()
    try:
        yield
    except BaseException:
        print(process.tail(80))
        raise
    finally:
        process.retire()


def test_volcano_podgroup_is_accepted_by_volcanos_crd_and_holds_the_pods_until_volcano_admits_it(
    plane: ControlPlane, api: Api, operator: OperatorProcess, tmp_path: Path
) -> None:
    namespace = VOLCANO_NAMESPACE
    with gang_training_operator(plane, api, tmp_path, "volcano", namespace):
        api.create("gputrainings", specs.training(
            "vc-gang", namespace, workers=3, scheduling={"gang": True}), namespace)  # fmt: skip
        group = wait_for("the Volcano PodGroup", lambda: _podgroup(api, VOLCANO, namespace, "vc-gang"), 60)
        assert group["spec"]["minMember"] == 3
        assert group["spec"]["queue"] == "default"  # no queueName: the training-operator's default
        assert group["spec"]["minResources"]["nvidia.com/gpu"] == "3"  # one GPU a pod, three pods
        assert [
            (o["kind"], o["name"], o.get("controller")) for o in group["metadata"]["ownerReferences"]
        ] == [("PyTorchJob", "vc-gang", True)]
        # The CRD is structural and enforced: what the training-operator wrote was judged by it.
        with pytest.raises(HttpError) as refused:
            _merge(api, VOLCANO, namespace, "vc-gang", {"spec": {"minMember": "three"}})
        assert refused.value.status == 422, refused.value
        # Until Volcano's scheduler admits the group, the training-operator makes no pod.
        assert api.list("pods", namespace) == []
        made = _admit_as_volcano(api, namespace, "vc-gang", 3)
        for pod in made:
            assert pod["spec"]["schedulerName"] == "volcano"
            assert pod["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "vc-gang"

        # A training on the queue Kueue admitted (the job as our operator renders it, resumed as
        # Kueue resumes it) with a scheduler name of its own: the queue reaches the PodGroup,
        # and the name is kept over the gang scheduler's, with the training-operator's warning.
        job = render_pytorchjob(parse(specs.training("vc-queued", namespace, scheduling={
            "gang": True, "queueName": "team-a", "schedulerName": "volcano-gpu"})))  # fmt: skip
        assert job["spec"]["runPolicy"]["suspend"] is True  # Kueue's to resume
        job["spec"]["runPolicy"]["suspend"] = False
        api.create("pytorchjobs", job, namespace)
        queued = wait_for("the queued PodGroup", lambda: _podgroup(api, VOLCANO, namespace, "vc-queued"), 30)
        assert (queued["spec"]["queue"], queued["spec"]["minMember"]) == ("team-a", 2)
        made = _admit_as_volcano(api, namespace, "vc-queued", 2)
        assert {pod["spec"]["schedulerName"] for pod in made} == {"volcano-gpu"}
        wait_for("the training-operator's warning", lambda: any(
            e["reason"] == "SetPodTemplateSchedulerName" and e["involvedObject"]["name"] == "vc-queued"
            for e in api.list("events", namespace)), 10)  # fmt: skip


def test_coscheduler_podgroup_is_accepted_by_the_coschedulers_crd_and_the_pods_name_its_scheduler(
    plane: ControlPlane, api: Api, operator: OperatorProcess, tmp_path: Path
) -> None:
    namespace = COSCHEDULER_NAMESPACE
    with gang_training_operator(plane, api, tmp_path, COSCHEDULER_NAME, namespace):
        api.create("gputrainings", specs.training(
            "co-gang", namespace, workers=2, scheduling={"gang": True}), namespace)  # fmt: skip
        group = wait_for(
            "the coscheduler's PodGroup", lambda: _podgroup(api, COSCHEDULER, namespace, "co-gang"), 60
        )
        assert group["spec"]["minMember"] == 2
        assert group["spec"]["minResources"]["nvidia.com/gpu"] == "2"
        with pytest.raises(HttpError) as refused:
            _merge(api, COSCHEDULER, namespace, "co-gang", {"spec": {"minMember": "two"}})
        assert refused.value.status == 422, refused.value
        # The coscheduler holds pods at its Permit stage, not before they exist: they are made at once.
        made = wait_for("the two pods", lambda: _pods(api, namespace, "co-gang", 2), 30)
        for pod in made:
            assert pod["spec"]["schedulerName"] == COSCHEDULER_NAME
            assert pod["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == "co-gang"


def _webhook_configuration() -> str:
    return (
        "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/"
        + trainingoperator.WEBHOOK_CONFIGURATION
    )


def _podgroup(api: Api, group: str, namespace: str, name: str) -> dict[str, Any] | None:
    return api.get_at(f"{group}/namespaces/{namespace}/podgroups/{name}")


def _merge(api: Api, group: str, namespace: str, name: str, patch: dict[str, Any]) -> None:
    # Volcano's PodGroup has no status subresource: its scheduler writes status on the object.
    api.request(
        "PATCH", f"{group}/namespaces/{namespace}/podgroups/{name}", patch, "application/merge-patch+json"
    )


def _admit_as_volcano(api: Api, namespace: str, name: str, count: int) -> list[dict[str, Any]]:
    """Volcano's scheduler admitting a PodGroup, as it does: the phase Inqueue, then once a
    scheduling cycle (1 s), while the gang's pods are not all ready, its gang plugin's
    Unschedulable condition with that cycle's transitionID and time; until the training-operator
    has made the ``count`` pods, which are returned.

    Once is not enough, and a real Volcano never writes it once: the training-operator drops a
    PodGroup's create event (it has no replica-type label), so when its PodGroup informer, which
    starts after its workers, first lists the group already admitted, nothing wakes its job. A
    single write can lose that race: in one CI run (2026-11-26) the training-operator's log had
    no reconcile after the admission, and no pod came in 30 s."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        cycle = {
            "type": "Unschedulable", "status": "True", "transitionID": str(uuid.uuid4()),
            "lastTransitionTime": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "reason": "NotEnoughResources",
            "message": f"{count}/0 tasks in gang unschedulable: pod group is not ready, {count} minAvailable",
        }  # fmt: skip
        _merge(api, VOLCANO, namespace, name, {"status": {"phase": "Inqueue", "conditions": [cycle]}})
        with contextlib.suppress(AssertionError):
            return wait_for(f"the {count} pods of {name}", lambda: _pods(api, namespace, name, count), 1.0)
    raise AssertionError(f"timed out after 30s waiting for the {count} pods of {name}, admitted by Volcano")


def _pods(api: Api, namespace: str, job: str, count: int) -> list[dict[str, Any]] | None:
    pods = api.list("pods", namespace, f"training.kubeflow.org/job-name={job}")
    return pods if len(pods) == count else None
