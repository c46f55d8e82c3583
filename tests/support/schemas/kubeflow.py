"""Checks a rendered PyTorchJob or TrainJob the way a cluster would, without one.

1. The openAPIV3Schema of the real Kubeflow training-operator v1.9.4 PyTorchJob CRD
   (``tests/reference/kubeflow.org_pytorchjobs.yaml``), strict about unknown fields: the API
   server would silently prune a misspelled field, so a test must not.
2. The rules of the training-operator's validating webhook, which the CRD does not carry
   (pkg/webhooks/pytorch/pytorchjob_webhook.go at v1.9).
3. Each pod template against the Kubernetes core schemas of several versions
   (kubernetes-validate, strict), as the PodTemplate kind that embeds it.
"""

from __future__ import annotations

import copy
import functools
import re
from typing import Any

import kubernetes_validate

from support.paths import REFERENCE
from support.schemas.crd import load_schema, validate

KUBERNETES_VERSIONS = ("1.29.0", "1.30.0", "1.31.0", "1.32.0", "1.33.0")
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_MANAGED_BY = ("kubeflow.org/training-operator", "kueue.x-k8s.io/multikueue")


@functools.cache
def pytorchjob_schema() -> dict[str, Any]:
    return load_schema(REFERENCE / "kubeflow.org_pytorchjobs.yaml", "v1")


def webhook_errors(job: dict[str, Any]) -> list[str]:
    """What the training-operator's admission webhook would refuse."""
    errors = []
    name = job.get("metadata", {}).get("name", "")
    if len(name) > 63 or not _DNS1035.match(name):
        errors.append(f"metadata.name: must be a DNS-1035 label (got {name!r})")
    spec = job["spec"]
    managed_by = spec.get("runPolicy", {}).get("managedBy")
    if managed_by is not None and managed_by not in _MANAGED_BY:
        errors.append(f"spec.runPolicy.managedBy: unsupported {managed_by!r}")
    replicas = spec.get("pytorchReplicaSpecs", {})
    elastic = spec.get("elasticPolicy")
    if elastic is not None:
        if "Worker" not in replicas:
            errors.append("spec.pytorchReplicaSpecs[Worker]: must be configured if elastic policy is used")
        if "nProcPerNode" in elastic and "nprocPerNode" in spec:
            errors.append("spec.elasticPolicy.nProcPerNode: must not be used with spec.nprocPerNode")
    if not replicas:
        errors.append("spec.pytorchReplicaSpecs: must be set")
    for role, replica in replicas.items():
        where = f"spec.pytorchReplicaSpecs[{role}]"
        if role not in ("Master", "Worker"):
            errors.append(f"{where}: unknown replica type")
        containers = replica.get("template", {}).get("spec", {}).get("containers", [])
        if not containers:
            errors.append(f"{where}.template.spec.containers: must be set")
        if not any(c.get("name") == "pytorch" for c in containers):
            errors.append(f"{where}.template.spec.containers: there is no container named pytorch")
        errors.extend(
            f"{where}: container {c.get('name')} has no image" for c in containers if not c.get("image")
        )
        count = replica.get("replicas")
        if role == "Master" and count != 1:
            errors.append(f"{where}.replicas: must be 1")
        if role == "Worker" and count is not None and count < 1:
            errors.append(f"{where}.replicas: must be at least 1")
    return errors


def pod_template_errors(job: dict[str, Any], version: str) -> list[str]:
    """Each replica's pod template against the core v1 schema of one Kubernetes version."""
    errors = []
    for role, replica in job["spec"]["pytorchReplicaSpecs"].items():
        pod_template = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": f"{job['metadata']['name']}-{role.lower()}"},
            "template": replica["template"],
        }
        try:
            kubernetes_validate.validate(pod_template, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{role} (Kubernetes {version}): {exc.message} at {list(exc.path)}")
    return errors


def all_errors(job: dict[str, Any]) -> list[str]:
    """Every problem a v1.9 cluster would have with ``job``: CRD schema, webhook, core schemas."""
    errors = validate(pytorchjob_schema(), job, defaults=False)
    errors += webhook_errors(job)
    for version in KUBERNETES_VERSIONS:
        errors += pod_template_errors(job, version)
    return errors


# -- Kubeflow Trainer v2.3.0 ---------------------------------------------------------------

_PET_ENV = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")


@functools.cache
def trainjob_schema() -> dict[str, Any]:
    return load_schema(REFERENCE / "trainer.kubeflow.org_trainjobs.yaml", "v1alpha1")


@functools.cache
def runtime_schema() -> dict[str, Any]:
    return load_schema(REFERENCE / "trainer.kubeflow.org_trainingruntimes.yaml", "v1alpha1")


def trainer_webhook_errors(job: dict[str, Any], runtime: dict[str, Any]) -> list[str]:
    """What Trainer v2.3.0's webhooks would refuse (pkg/webhooks/: the TrainJob's runtime must
    exist, torchrun's variables are reserved; a runtime's trainer job has one replica and a
    container named node)."""
    errors = []
    ref = job["spec"]["runtimeRef"]
    if (ref.get("kind"), ref.get("name")) != (runtime["kind"], runtime["metadata"]["name"]):
        errors.append(
            f"spec.runtimeRef: {ref}: specified trainingRuntime must be created before the TrainJob"
        )
    reserved = sorted({e["name"] for e in job["spec"].get("trainer", {}).get("env", [])} & set(_PET_ENV))
    if reserved:
        errors.append(f"spec.trainer.env: must not have reserved envs, invalid envs configured: {reserved}")
    for rjob in runtime["spec"]["template"]["spec"]["replicatedJobs"]:
        if (rjob["template"].get("metadata") or {}).get("labels", {}).get(
            "trainer.kubeflow.org/trainjob-ancestor-step"
        ) == "trainer":
            if rjob.get("replicas", 1) != 1:
                errors.append(f"replicatedJobs[{rjob['name']}].replicas: must be 1")
            names = [c["name"] for c in rjob["template"]["spec"]["template"]["spec"]["containers"]]
            if "node" not in names:
                errors.append(f"replicatedJobs[{rjob['name']}]: no container named node (got {names})")
    return errors


def merged_pod_template(job: dict[str, Any], runtime: dict[str, Any]) -> dict[str, Any]:
    """The node pod template Trainer v2 makes from the runtime and the TrainJob's trainer: an
    approximation for schema checks only (the real merge runs in the end-to-end suite)."""
    rjob = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]
    template = copy.deepcopy(rjob["template"]["spec"]["template"])
    node = next(c for c in template["spec"]["containers"] if c["name"] == "node")
    trainer = job["spec"]["trainer"]
    for key in ("image", "command", "args", "env"):
        if key in trainer:
            node[key] = copy.deepcopy(trainer[key])
    if "resourcesPerNode" in trainer:
        node["resources"] = copy.deepcopy(trainer["resourcesPerNode"])
    return template


def trainjob_errors(job: dict[str, Any], runtime: dict[str, Any]) -> list[str]:
    """Every problem a Trainer v2.3.0 cluster would have with ``job`` on ``runtime``: both CRDs'
    schemas, the webhooks' rules, the merged pod template on the core schemas."""
    errors = validate(trainjob_schema(), job, defaults=False)
    errors += validate(runtime_schema(), runtime, defaults=False)
    errors += trainer_webhook_errors(job, runtime)
    pod_template = {
        "apiVersion": "v1",
        "kind": "PodTemplate",
        "metadata": {"name": f"{job['metadata']['name']}-node"},
        "template": merged_pod_template(job, runtime),
    }
    for version in KUBERNETES_VERSIONS:
        try:
            kubernetes_validate.validate(pod_template, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"node (Kubernetes {version}): {exc.message} at {list(exc.path)}")
    return errors
