"""Our CRD against a real kube-apiserver, the newest and the oldest we claim: accepted, served,
defaulted, validated, immutable.

The unit suite checks the same tables with stand-ins (jsonschema, cel-python); here the API
server itself judges them: structural-schema rules, the CEL cost budget, the quantity library,
transition rules, defaulting and pruning, and kubectl's strict field validation.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import pytest
import yaml

from gpuop._kits.schema import SpecError, encode
from gpuop.api.spec import parse
from gpuop.backends.registry import APIS, gaps, render_job
from support.fixtures import installed_crds
from support.plane import controlplane
from support.plane.cluster import KUBEFLOW_CRD, OUR_CRD, TRAINER_CRDS, Api, install_crds
from support.plane.controlplane import ControlPlane
from support.specs import EXAMPLES, load_example, minimal
from unit.test_crd_agreement import IMMUTABLE_UPDATES, MUTABLE_UPDATES, NAMES_REFUSED
from unit.test_spec import BAD_SPECS, ONLY_GPUOP_VALIDATE

# Refused only because kubectl asks for strict field validation (its default): a client that
# does not (--validate=false, most API libraries, older kubectl) gets the field pruned
# silently, and the GpuTraining trains with defaults. `gpuop validate` refuses them always.
REFUSED_ONLY_WHEN_STRICT: frozenset[str] = frozenset({"misspelled field", "unknown field"})


def _minor(version: str) -> str:
    return ".".join(version.lstrip("v").split(".")[:2])


# Every test here runs on the newest Kubernetes (the session's control plane) and on the oldest
# the docs claim (docs/architecture.md, Compatibility), whose API server judges the same CRD by
# its own rules: which CEL libraries and fields exist, the cost estimates, transition rules,
# defaulting, and its messages. The version leads each test's id: `[1.29-kind-cpu.yaml]`.
NEWEST: Final = _minor(controlplane.versions()["kubernetes"])
OLDEST: Final = _minor(controlplane.oldest_version())
# Kubeflow Trainer v2.3.0 states Kubernetes 1.31 as its minimum, and the oldest API server
# refuses its runtime CRDs (test_the_oldest_kubernetes_refuses_kubeflow_trainers_runtimes): there
# nothing could judge a TrainJob's runtime, so the TrainJob backend is checked on the newest only.
CRDS: Final = {NEWEST: (OUR_CRD, KUBEFLOW_CRD, *TRAINER_CRDS), OLDEST: (OUR_CRD, KUBEFLOW_CRD)}
ONLY_ON: Final = {
    "test_each_example_renders_trainjobs_the_server_accepts": (NEWEST,),
    "test_the_oldest_kubernetes_refuses_kubeflow_trainers_runtimes": (OLDEST,),
}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # Module-scoped, so that pytest runs each version's tests together: the oldest plane starts once.
    if "version" in metafunc.fixturenames:
        versions = ONLY_ON.get(metafunc.definition.name, (NEWEST, OLDEST))
        metafunc.parametrize("version", versions, scope="module")


@pytest.fixture(scope="module")
def plane(
    version: str, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ControlPlane]:
    """Overrides the session's: that one for the newest, for the oldest a plane of its own
    (kube-apiserver and etcd), started when its tests begin and stopped after them."""
    if version == NEWEST:
        # An overriding fixture asking for its own name gets the fixture it overrides.
        yield request.getfixturevalue("plane")
        return
    with controlplane.running(tmp_path_factory.mktemp("controlplane-oldest"), oldest=True) as oldest:
        yield oldest


@pytest.fixture(scope="module")
def crd_warnings(version: str, plane: ControlPlane) -> str:
    if version == NEWEST:
        return installed_crds(plane)  # the session's plane: installed once, for every module
    return install_crds(plane, CRDS[version])


@pytest.fixture(scope="module")
def api(plane: ControlPlane, crd_warnings: str) -> Api:
    return Api(plane)


@pytest.fixture(scope="module", autouse=True)
def namespaces(plane: ControlPlane, crd_warnings: str) -> Iterator[None]:
    """The examples' namespaces and "ml"; every GpuTraining made here is deleted at the end."""
    namespaces = {"ml"} | {(load_example(p)["metadata"].get("namespace") or "default") for p in EXAMPLES}
    for namespace in sorted(namespaces - {"default"}):
        plane.kubectl("create", "namespace", namespace)
    yield
    plane.kubectl("delete", "gputrainings", "--all", "--all-namespaces")


def _create(plane: ControlPlane, body: dict[str, Any], *, check: bool = False) -> tuple[int, str]:
    """``kubectl create`` (strict field validation, as kubectl does by default): (rc, stderr)."""
    result = plane.kubectl("create", "-f", "-", input=json.dumps(body), check=check)
    return result.returncode, result.stderr


def test_the_crds_are_accepted_without_warnings_and_established(
    version: str, crd_warnings: str, plane: ControlPlane
) -> None:
    assert "warning" not in crd_warnings.lower(), crd_warnings
    names = plane.kubectl("get", "crd", "-o", "jsonpath={.items[*].metadata.name}").stdout.split()
    trainer = {"trainjobs.trainer.kubeflow.org", "trainingruntimes.trainer.kubeflow.org",
               "clustertrainingruntimes.trainer.kubeflow.org"}  # fmt: skip
    assert set(names) >= {
        "gputrainings.gpuop.io", "pytorchjobs.kubeflow.org",
        *(trainer if TRAINER_CRDS[0] in CRDS[version] else ()),
    }  # fmt: skip
    conditions = json.loads(plane.kubectl("get", "crd", "gputrainings.gpuop.io", "-o", "json").stdout)[
        "status"
    ]
    established = {c["type"]: c["status"] for c in conditions["conditions"]}
    assert established["Established"] == "True"
    assert established["NamesAccepted"] == "True"
    assert established.get("NonStructuralSchema", "False") == "False"


def test_the_oldest_kubernetes_refuses_kubeflow_trainers_runtimes(plane: ControlPlane) -> None:
    """Why the TrainJob backend is claimed from Kubernetes 1.31 (Kubeflow Trainer's own minimum)
    rather than from the oldest: this API server refuses Trainer v2.3.0's runtime CRDs, whose
    CEL rules read a PVC template's metadata.namespace, which its CEL compiler does not find. When it
    accepts them, check the TrainJob backend here too (BACKENDS) and widen the claim."""
    for path in TRAINER_CRDS:
        result = plane.kubectl("apply", "--server-side", "--dry-run=server", "-f", str(path), check=False)
        if "runtimes" in path.name:
            assert result.returncode != 0, f"{path.name} is accepted now"
            assert "undefined field 'namespace'" in result.stderr, result.stderr
        else:
            assert result.returncode == 0, result.stderr


def _words(text: str) -> str:
    return " ".join(text.split())


def test_kubectl_explain_prints_our_descriptions(plane: ControlPlane) -> None:
    crd = yaml.safe_load(OUR_CRD.read_text())
    training = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    training = training["training"]
    explained = _words(plane.kubectl("explain", "gputraining.spec.training").stdout)
    assert _words(training["description"])[:60] in explained
    for field, schema in training["properties"].items():
        assert re.search(rf"\b{field}\b", explained), field
        assert _words(schema["description"])[:50] in explained, field


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_each_example_is_stored_with_the_defaults_parse_computes(
    example: Path, plane: ControlPlane, api: Api
) -> None:
    body = load_example(example)
    rc, stderr = _create(plane, body)
    assert rc == 0, stderr
    assert "warning" not in stderr.lower(), stderr
    namespace = body["metadata"].get("namespace") or "default"
    stored = api.get("gputrainings", body["metadata"]["name"], namespace)
    assert stored is not None
    expected = encode(parse(body).spec)
    if isinstance(stored["spec"].get("shmSize"), int):  # the server keeps the integer the user wrote
        stored["spec"]["shmSize"] = str(stored["spec"]["shmSize"])
    assert stored["spec"] == expected
    api.delete("gputrainings", body["metadata"]["name"], namespace)


def _server_accepts_what_each_example_renders(example: Path, backend: str, plane: ControlPlane) -> None:
    """Created server-side (dry run) with kubectl's strict field validation against the real
    Kubeflow CRDs (or Kubernetes' own Job and Service). What a backend cannot carry is refused
    before rendering."""
    body = load_example(example)
    body["metadata"] |= {"namespace": "ml", "uid": "9b2f4c1e-0d7a-4a8e-9a51-3f0c6a2b7d10"}
    training = parse(body)
    if gaps(training.spec).get(backend):
        with pytest.raises(SpecError):
            render_job(training, backend, default_image="example.com/trainer:1")
        return
    for obj in render_job(training, backend, default_image="example.com/trainer:1"):
        result = plane.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(obj), check=False)
        assert result.returncode == 0, result.stderr
        assert "warning" not in result.stderr.lower(), result.stderr


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_each_example_renders_pytorchjobs_the_server_accepts(example: Path, plane: ControlPlane) -> None:
    """Against Kubeflow training-operator v1.9.4's PyTorchJob CRD."""
    _server_accepts_what_each_example_renders(example, "pytorchjob", plane)


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_each_example_renders_trainjobs_the_server_accepts(example: Path, plane: ControlPlane) -> None:
    """Against Kubeflow Trainer v2.3.0's TrainingRuntime and TrainJob CRDs (the newest only: ONLY_ON)."""
    _server_accepts_what_each_example_renders(example, "trainjob", plane)


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_each_example_renders_jobs_the_server_accepts(example: Path, plane: ControlPlane) -> None:
    """The headless Service and the Indexed batch/v1 Job, on both ends of what we claim (the
    Job's podReplacementPolicy is beta, on by default, from 1.29)."""
    _server_accepts_what_each_example_renders(example, "job", plane)


# The Pod Security Standards level each example's pods meet, as docs/operating.md states it:
# the lowest profile whose namespace admits them.
POD_SECURITY_LEVELS = ("restricted", "baseline", "privileged")
EXAMPLE_POD_SECURITY = {p.name: "restricted" for p in EXAMPLES} | {"aks-nd-h100.yaml": "privileged"}


def _pod_specs(node: Any) -> list[dict[str, Any]]:
    """Every pod spec in a rendered object (PyTorchJob replicas, a TrainingRuntime's jobs)."""
    if isinstance(node, dict):
        here = [node] if "containers" in node else []
        return here + [spec for value in node.values() for spec in _pod_specs(value)]
    return [spec for value in node for spec in _pod_specs(value)] if isinstance(node, list) else []


@pytest.fixture(scope="module")
def pod_security_namespaces(version: str, plane: ControlPlane) -> dict[str, str]:
    """A namespace per Pod Security level, enforced by the API server's PodSecurity admission,
    and the PriorityClasses the examples name (the Priority admission plugin wants them)."""
    classes = {load_example(p)["spec"].get("scheduling", {}).get("priorityClassName") for p in EXAMPLES} - {
        None
    }
    for name in sorted(classes):
        plane.kubectl("create", "priorityclass", name, "--value=1000")
    names = {}
    for level in POD_SECURITY_LEVELS:
        names[level] = f"pss-{level}"
        plane.kubectl("create", "namespace", names[level])
        plane.kubectl("label", "namespace", names[level], f"pod-security.kubernetes.io/enforce={level}")
        if version == OLDEST:
            # The ServiceAccount admission plugin looks up the pod's account, "default" when it
            # names none; no controller-manager runs beside the oldest apiserver to make it.
            plane.kubectl("create", "serviceaccount", "default", "-n", names[level])
    return names


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_each_examples_pods_meet_the_pod_security_level_the_docs_state(
    example: Path, plane: ControlPlane, pod_security_namespaces: dict[str, str]
) -> None:
    """The real PodSecurity admission judges the pods each example's jobs make (both backends):
    the lowest level that admits them is the one docs/operating.md gives."""
    body = load_example(example)
    body["metadata"] |= {"namespace": "ml", "uid": "9b2f4c1e-0d7a-4a8e-9a51-3f0c6a2b7d10"}
    training = parse(body)
    backends = [backend for backend in APIS if backend not in gaps(training.spec)]
    specs = [s for b in backends for o in render_job(training, b, default_image="t:1") for s in _pod_specs(o)]
    assert specs
    lowest = set()
    for index, spec in enumerate(specs):
        for level in POD_SECURITY_LEVELS:
            if spec.get("serviceAccountName"):  # the ServiceAccount admission plugin wants it to exist
                plane.kubectl("create", "serviceaccount", spec["serviceAccountName"], "-n",
                              pod_security_namespaces[level], check=False)  # fmt: skip
            pod = {"apiVersion": "v1", "kind": "Pod", "spec": spec,
                   "metadata": {"name": f"p{index}", "namespace": pod_security_namespaces[level]}}  # fmt: skip
            result = plane.kubectl(
                "create", "--dry-run=server", "-f", "-", input=json.dumps(pod), check=False
            )
            if result.returncode == 0:
                lowest.add(level)
                break
            assert "violates PodSecurity" in result.stderr, result.stderr
    assert lowest == {EXAMPLE_POD_SECURITY[example.name]}
    documented = (Path(__file__).parents[2] / "docs" / "operating.md").read_text()
    assert f"| `{example.name}` | {EXAMPLE_POD_SECURITY[example.name]} |" in documented


def _named(case: str, body: dict[str, Any]) -> dict[str, Any]:
    body["metadata"]["name"] = re.sub(r"[^a-z0-9]+", "-", case.lower()).strip("-")[:40]
    return body


@pytest.mark.parametrize(("case", "fields", "messages"), BAD_SPECS, ids=[c[0] for c in BAD_SPECS])
def test_the_server_refuses_bad_specs_naming_the_field_gpuop_validate_names(
    case: str, fields: dict[str, Any], messages: list[str], plane: ControlPlane, api: Api
) -> None:
    rc, stderr = _create(plane, _named(case, minimal(**fields)))
    if case in ONLY_GPUOP_VALIDATE:
        assert rc == 0, f"the server now refuses {case!r}: take it off ONLY_GPUOP_VALIDATE\n{stderr}"
        return
    assert rc != 0, f"the server accepted {case!r}, which gpuop validate refuses with {messages}"
    for message in messages:
        path = message.split(": ", 1)[0]
        assert path in stderr, f"{path} not named in: {stderr}"

    lax = plane.kubectl("create", "--validate=false", "-f", "-", input=json.dumps(
        _named(case, minimal(**fields))), check=False)  # fmt: skip
    assert (lax.returncode == 0) == (case in REFUSED_ONLY_WHEN_STRICT), lax.stderr
    if lax.returncode == 0:
        stored = api.get("gputrainings", _named(case, minimal())["metadata"]["name"], "ml")
        assert stored is not None
        assert not set(fields) & set(stored["spec"]), "an unknown field was stored, not pruned"


@pytest.mark.parametrize("name", NAMES_REFUSED)
def test_the_server_refuses_bad_names(name: str, plane: ControlPlane) -> None:
    body = minimal()
    body["metadata"]["name"] = name
    rc, stderr = _create(plane, body)
    assert rc != 0
    assert "metadata.name" in stderr or "name" in stderr, stderr


def _apply(plane: ControlPlane, body: dict[str, Any]) -> tuple[int, str]:
    result = plane.kubectl("apply", "-f", "-", input=json.dumps(body), check=False)
    return result.returncode, result.stderr


@pytest.mark.parametrize(("field", "old", "new"), IMMUTABLE_UPDATES, ids=[c[0] for c in IMMUTABLE_UPDATES])
def test_the_server_refuses_changing_an_immutable_field(
    field: str, old: dict[str, Any], new: dict[str, Any], plane: ControlPlane, api: Api
) -> None:
    before = _named(f"immutable-{field}", minimal(**old))
    after = _named(f"immutable-{field}", minimal(**{**old, **new}))
    assert _apply(plane, before)[0] == 0
    rc, stderr = _apply(plane, after)
    assert rc != 0, f"spec.{field} changed on a stored GpuTraining"
    assert (
        f'spec.{field}: Invalid value: "object": spec.{field} cannot change once the GpuTraining exists '
        "(only spec.runPolicy, spec.stallTimeoutSeconds, spec.nodeLossTimeoutSeconds can); delete it and create it again to change this"
    ) in _words(stderr) or f"spec.{field} cannot change once the GpuTraining exists" in _words(stderr), stderr
    api.delete("gputrainings", before["metadata"]["name"], "ml")


@pytest.mark.parametrize(("case", "old", "new"), MUTABLE_UPDATES, ids=[c[0] for c in MUTABLE_UPDATES])
def test_the_server_accepts_changing_a_mutable_field(
    case: str, old: dict[str, Any], new: dict[str, Any], plane: ControlPlane, api: Api
) -> None:
    before = _named(f"mutable-{case}", minimal(**old))
    after = _named(f"mutable-{case}", minimal(**{**old, **new}))
    assert _apply(plane, before)[0] == 0
    rc, stderr = _apply(plane, after)
    assert rc == 0, stderr
    stored = api.get("gputrainings", after["metadata"]["name"], "ml")
    assert stored is not None
    for key, value in new.items():
        if isinstance(value, dict):
            assert value.items() <= stored["spec"][key].items()
        else:
            assert stored["spec"][key] == value
    api.delete("gputrainings", before["metadata"]["name"], "ml")


def _operator_kube(plane: ControlPlane) -> Any:
    """The operator's own API client (``gpuop.controller.kube.Kube``), logged in as kubectl is."""
    from gpuop.controller.credentials import from_kubeconfig
    from gpuop.controller.kube import Kube

    return Kube(from_kubeconfig(str(plane.kubeconfig)))


def _recorder() -> tuple[list[tuple[str | None, str]], Any]:
    """What a job watch delivers, (event type, name) in the order handled, and the handler."""
    import threading

    seen: list[tuple[str | None, str]] = []
    lock = threading.Lock()

    def handle(event_type: str | None, obj: dict[str, Any]) -> None:
        with lock:
            seen.append((event_type, obj["metadata"]["name"]))

    return seen, handle


def test_the_operators_create_knows_the_job_as_the_server_stored_it(
    plane: ControlPlane, crd_warnings: str
) -> None:
    """``Kube.create_object`` asks for a reply of metadata only (PartialObjectMetadata) and fills in
    the rest from what it sent: what the operator keeps of the job must be what a GET returns."""
    from gpuop.observing import observe

    kube = _operator_kube(plane)
    body = minimal(dataset={"name": "digits"})
    body["metadata"] |= {"name": "created-as-stored", "namespace": "ml"}
    job = render_job(parse(body), "pytorchjob", default_image="example.com/trainer:1")[-1]
    job["metadata"].pop("ownerReferences", None)  # no GpuTraining exists to own it
    try:
        made = kube.create_object(job, "pytorchjobs")
        stored = kube.get_object("kubeflow.org/v1", "pytorchjobs", "ml", "created-as-stored")
        assert stored is not None
        assert made["metadata"]["uid"] == stored["metadata"]["uid"]
        assert observe.slim_job(made) == observe.slim_job(stored)
    finally:
        plane.kubectl("delete", "pytorchjob", "created-as-stored", "-n", "ml", "--ignore-not-found")


def test_the_operators_job_watch_follows_the_server_and_resumes_where_it_may(
    plane: ControlPlane, crd_warnings: str
) -> None:
    """``jobwatch`` against the API server itself: the labelled jobs only, every change in order,
    and a version the server forgot answered with 410 Gone (what makes the watch list again)."""
    from gpuop.api.identity import TRAINING_LABEL
    from gpuop.controller import jobwatch
    from support.waiting import wait_for

    kube = _operator_kube(plane)
    seen, handle = _recorder()

    body = minimal(dataset={"name": "digits"})
    body["metadata"] |= {"name": "watched", "namespace": "ml"}
    job = render_job(parse(body), "pytorchjob", default_image="example.com/trainer:1")[-1]
    job["metadata"].pop("ownerReferences", None)  # no GpuTraining exists to own it
    stranger = json.loads(json.dumps(job))
    stranger["metadata"] |= {"name": "not-ours", "labels": {"app": "someone-elses"}}
    watch = jobwatch.JobWatch(kube, [("kubeflow.org/v1", "pytorchjobs")], ["ml"], handle, 2)
    watch.start()
    try:
        wait_for("the watch open", lambda: any(s.response is not None for s in watch._streams), timeout=30)
        kube.create_object(stranger, "pytorchjobs")
        kube.create_object(job, "pytorchjobs")
        kube.patch_object("kubeflow.org/v1", "pytorchjobs", "ml", "watched",
                          {"metadata": {"annotations": {"touched": "yes"}}})  # fmt: skip
        plane.kubectl("delete", "pytorchjob", "watched", "-n", "ml", "--wait=true")
        wait_for("the deletion", lambda: ("DELETED", "watched") in seen, timeout=30)
        assert seen == [("ADDED", "watched"), ("MODIFIED", "watched"), ("DELETED", "watched")]
    finally:
        watch.close()
        plane.kubectl("delete", "pytorchjob", "watched", "not-ours", "-n", "ml", "--ignore-not-found")

    # Both servers we claim send it as an event on a stream that opened (200), not as the reply.
    events = list(kube.watch_objects("kubeflow.org/v1", "pytorchjobs", "ml", TRAINING_LABEL, "1",
                                     timeout_seconds=5))  # fmt: skip
    assert [(e["type"], e["object"].get("code"), e["object"].get("reason")) for e in events] == [
        ("ERROR", 410, "Expired")
    ], events


def test_the_job_watch_finds_a_job_api_installed_after_it_started(
    plane: ControlPlane, crd_warnings: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job API the server does not serve yet (Kubeflow installed after the operator) is looked
    for again, and watched once its CRD is served: no restart, cluster-wide or per namespace.
    A CRD of the test's own stands in for Kubeflow's, which the session has installed already."""
    from gpuop.api.identity import TRAINING_LABEL
    from gpuop.controller import jobwatch
    from support.waiting import wait_for

    monkeypatch.setattr(jobwatch, "NOT_SERVED_RETRY_SECONDS", 1.0)
    kube = _operator_kube(plane)
    seen, handle = _recorder()

    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "latejobs.later.gpuop.test"},
        "spec": {
            "group": "later.gpuop.test",
            "scope": "Namespaced",
            "names": {"plural": "latejobs", "singular": "latejob", "kind": "LateJob"},
            "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                "type": "object", "x-kubernetes-preserve-unknown-fields": True}}}],
        },
    }  # fmt: skip
    late = {
        "apiVersion": "later.gpuop.test/v1",
        "kind": "LateJob",
        "metadata": {"name": "late", "namespace": "ml", "labels": {TRAINING_LABEL: "late"}},
    }
    watch = jobwatch.JobWatch(kube, [("later.gpuop.test/v1", "latejobs")], ["ml"], handle, 2)
    everywhere = jobwatch.JobWatch(kube, [("later.gpuop.test/v1", "latejobs")], [], handle, 2)
    watch.start()
    everywhere.start()
    try:
        time.sleep(2.5)  # each has been told 404 at least twice
        assert all(
            s.response is None and s.thread.is_alive() for s in (*watch._streams, *everywhere._streams)
        )
        plane.kubectl("create", "-f", "-", input=json.dumps(crd))
        plane.kubectl("wait", "--for=condition=Established", "crd/latejobs.later.gpuop.test", "--timeout=30s")

        def created() -> bool:  # the CRD is served a moment after it is Established
            code, _ = _create(plane, late)
            return code == 0

        wait_for("the LateJob made", created, timeout=30)
        wait_for("both watches to see it", lambda: seen.count(("ADDED", "late")) + seen.count((None, "late")) == 2,
                 timeout=30)  # fmt: skip
    finally:
        watch.close()
        everywhere.close()
        plane.kubectl("delete", "crd", "latejobs.later.gpuop.test", "--ignore-not-found")
