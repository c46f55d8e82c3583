"""The names that identify things: our API, the labels and annotations we write, the Kubeflow
and Kueue APIs we talk to, and the default trainer image: constants, and the few functions that
build a name and read it back. This module imports nothing of gpuop, so every layer may import it.
"""

from __future__ import annotations

import importlib.metadata
import re
import string
from typing import Final

# Our API.
GROUP: Final = "gpuop.io"
VERSION: Final = "v1alpha1"
API_VERSION: Final = f"{GROUP}/{VERSION}"
KIND: Final = "GpuTraining"
PLURAL: Final = "gputrainings"
# One GpuTraining, wherever one is looked up or keyed by: (namespace, name).
TrainingKey = tuple[str, str]

# What we write on the objects we make.
TRAINING_LABEL: Final = "gpuop.io/gputraining"  # on the job and its pods: the GpuTraining's name
# The fixed spec fields the job was made from (JSON), so that a change that got past the CRD's
# transition rules is reported instead of silently not applied.
CREATED_FROM_ANNOTATION: Final = "gpuop.io/created-from"
# On a PyTorchJob, when the operator last woke its controller for a deadline or a TTL that
# came due (gpuop.backends.pytorchjob: the v1 training-operator sleeps through both).
WOKEN_AT_ANNOTATION: Final = "gpuop.io/woken-at"
# On a job the operator stopped for good (a pod failed in a way no restart mends), why: JSON
# {pod, reason, line} (gpuop.observing.observe reads and writes it). Set in the same patch as
# the suspend, so the job itself says it, whatever becomes of the status write after it.
STOPPED_ANNOTATION: Final = "gpuop.io/stopped"
# The version has one home, pyproject.toml; the installed distribution's metadata carries it
# here (and the chart's appVersion is checked against it), so a release is one edit.
PACKAGE_VERSION: Final = importlib.metadata.version("gpu-training-operator")
TRAINER_IMAGE_REPOSITORY: Final = "ghcr.io/gpu-training-operator/trainer"
DEFAULT_TRAINER_IMAGE: Final = f"{TRAINER_IMAGE_REPOSITORY}:{PACKAGE_VERSION}"

# Progress reports (Kubeflow Trainer's trainerStatus protocol, served by the operator). The
# variables are Kubeflow's, so Hugging Face's KubeflowCallback and the Kubeflow SDK report to us
# with no change; the path is shaped like Kubeflow's, under our API.
# report_path() fills it in, report_path_training() reads it back.
REPORT_PATH: Final = f"/apis/{GROUP}/{VERSION}/namespaces/{{namespace}}/{PLURAL}/{{name}}/status"
REPORT_URL_ENV: Final = "KUBEFLOW_TRAINER_SERVER_URL"
REPORT_CA_ENV: Final = "KUBEFLOW_TRAINER_SERVER_CA_CERT"
REPORT_TOKEN_ENV: Final = "KUBEFLOW_TRAINER_SERVER_TOKEN"
REPORT_MOUNT: Final = "/var/run/secrets/gpuop.io/reports"  # the projected token and the CA


def report_path(namespace: str, name: str) -> str:
    """The path a training's pods POST their reports to (under the endpoint's base URL)."""
    return REPORT_PATH.format(namespace=namespace, name=name)


# What each field of REPORT_PATH may hold: a namespace is a DNS label, a GpuTraining's name a
# DNS subdomain. Anything else names no training, so it is refused before any other work.
_REPORT_PATH_FIELDS: Final = {"namespace": "[a-z0-9-]{1,63}", "name": "[a-z0-9.-]{1,253}"}
# REPORT_PATH as a regex: its literal text escaped ("gpuop.io" has a dot), its fields as groups.
_REPORT_PATH_RE: Final = re.compile(
    "".join(
        re.escape(literal) + (f"(?P<{field}>{_REPORT_PATH_FIELDS[field]})" if field else "")
        for literal, field, _, _ in string.Formatter().parse(REPORT_PATH)
    )
)


def report_path_training(path: str) -> TrainingKey | None:
    """The training a report path names (as :func:`report_path` made it), or None for any
    other path. ``path`` is the path alone, without a query string."""
    match = _REPORT_PATH_RE.fullmatch(path)
    return (match["namespace"], match["name"]) if match is not None else None


def report_audience(namespace: str, name: str) -> str:
    """The audience of a training's report tokens: one per training, so a token minted for one
    training's pods is worth nothing at another's URL (the API server checks it)."""
    return f"{GROUP}/reports/{namespace}/{name}"


def report_ca_config_map(name: str) -> str:
    """The ConfigMap in a training's namespace that carries the endpoint's CA for its pods."""
    return f"{name}-report-ca"


# Device resources other fields of the spec own (gpusPerWorker, nccl.efaDevices).
GPU_RESOURCE: Final = "nvidia.com/gpu"
EFA_RESOURCE: Final = "vpc.amazonaws.com/efa"

# The dataset step's init container (spec.dataset.uri): observe reads its state by this name.
FETCH_CONTAINER: Final = "fetch-dataset"
# Each backend names its trainer container its own way (its controller looks for that name);
# every pod template carries the name in Kubernetes' annotation for it, which `kubectl logs`
# and `kubectl exec` also read, so that nothing but the backend knows the name.
DEFAULT_CONTAINER_ANNOTATION: Final = "kubectl.kubernetes.io/default-container"

# Kueue.
KUEUE_QUEUE_LABEL: Final = "kueue.x-k8s.io/queue-name"
KUEUE_JOB_UID_LABEL: Final = "kueue.x-k8s.io/job-uid"  # on the Workloads Kueue makes for a job
KUEUE_API_VERSIONS: Final = ("kueue.x-k8s.io/v1beta2", "kueue.x-k8s.io/v1beta1")  # newest first
