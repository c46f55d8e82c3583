"""A job API the operator has never heard of, and enough of a cluster to run it: the unit
tests' third backend (tests/unit/test_backend_plugin.py shows it needs nothing else changed)
and their in-memory API server. The ``toy`` fixture (tests/unit/conftest.py) registers it.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any, Final

from gpuop.api.gaps import SpecGap
from gpuop.api.spec import GpuTraining
from gpuop.backends import pod, reportwiring
from gpuop.backends.contract import AccessRule
from gpuop.controller.apiclient import ApiError
from gpuop.observing import observe
from gpuop.observing.records import JobCondition, JobKind

TOY_API: Final = "toy.example.com/v1"


class ToyJobApi:
    """A job API the operator has never heard of: a ToyJob, made after its ToyConfig, whose
    state is one word and whose only mutable field is ``spec.paused``."""

    backend: Final = "toyjob"
    summary: Final = "a toy's ToyJob"
    api_version: Final = TOY_API
    kind: Final = "ToyJob"
    plural: Final = "toyjobs"
    installed_by: Final = "the toy controller"
    facts: Final = JobKind("toyjob", TOY_API, "ToyJob", None, ("runPolicy.suspend", "stallTimeoutSeconds"))
    companion_plurals: Final = {"ToyConfig": "toyconfigs"}
    gaps: Final = (
        SpecGap(
            "toyjob", ".elastic", "has(self.elastic)", lambda s: s.elastic is not None, "toys do not stretch"
        ),
    )
    access: Final = (
        AccessRule("toy.example.com", ("toyjobs",), ("get", "list", "watch", "create", "patch"), "ToyJobs"),
        AccessRule("toy.example.com", ("toyconfigs",), ("get", "create"), "The ToyConfig of each ToyJob"),
    )

    def served(self, resources: Callable[[str], frozenset[str]]) -> bool:
        return {"toyjobs", "toyconfigs"} <= resources(TOY_API)

    def render(
        self, training: GpuTraining, *, default_image: str, reports: reportwiring.ReportEndpoint | None = None
    ) -> list[dict[str, Any]]:
        config = {"apiVersion": TOY_API, "kind": "ToyConfig",
                  "metadata": pod.object_metadata(training, pod.labels(training.name)), "spec": {}}  # fmt: skip
        job = {"apiVersion": TOY_API, "kind": "ToyJob",
               "metadata": pod.job_metadata(training, self.facts.mutable_fields),
               "spec": {"paused": pod.job_suspended(training.spec), "workers": training.spec.workers,
                        "image": training.spec.image or default_image}}  # fmt: skip
        return [config, job]

    def conditions(self, job: Mapping[str, Any] | None) -> tuple[JobCondition, ...]:
        if not job:
            return ()
        state = (job.get("status") or {}).get("state")
        out = [JobCondition("Created", "True", "ToyJobCreated")]
        kind = {"Running": "Running", "Done": "Succeeded", "Broken": "Failed", "Paused": "Suspended"}.get(
            state or ""
        )
        if kind is not None:
            out.append(JobCondition(kind, "True", f"Toy{state}", f"the toy is {state}",
                                    (job.get("status") or {}).get("since")))  # fmt: skip
        return tuple(out)

    def suspended(self, job: Mapping[str, Any] | None) -> bool:
        return bool(((job or {}).get("spec") or {}).get("paused"))

    def times(self, job: Mapping[str, Any] | None) -> tuple[str | None, str | None]:
        status = (job or {}).get("status") or {}
        return status.get("began"), observe.finished_at(self.conditions(job))

    def mutable_patch(
        self, desired: Mapping[str, Any], child: Mapping[str, Any], skip: tuple[str, ...] = ()
    ) -> dict[str, Any] | None:
        paused = desired["spec"]["paused"]
        # A job as the operator keeps it (observe.slim_job) has no spec.paused: unpaused.
        if "suspend" in skip or (child.get("spec") or {}).get("paused", False) == paused:
            return None
        return {"spec": {"paused": paused}}

    def suspend_patch(self) -> dict[str, Any]:
        return {"spec": {"paused": True}}

    def wake_times(self, job: Mapping[str, Any] | None) -> tuple[datetime, ...]:
        """A toy controller sleeps through the time in ``status.wakeAt``."""
        wake_at = ((job or {}).get("status") or {}).get("wakeAt")
        return (datetime.fromisoformat(wake_at),) if wake_at else ()


class Store:
    """The API calls the reconciler makes, on dicts: enough of a cluster serving only the toy."""

    in_cluster = False

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str, str], dict[str, Any]] = {}
        self.trainings: dict[tuple[str, str], dict[str, Any]] = {}
        self.created: list[str] = []
        self.events: list[str] = []
        self.status_writes = 0
        self.annotated: list[str] = []
        self.pods: list[dict[str, Any]] = []  # every training's, as the kubelet shows them
        self.nodes: dict[str, dict[str, Any]] = {}
        self.deleted_pods: list[tuple[str, int | None]] = []  # (name, grace seconds)
        self._versions = itertools.count(1)

    def _stamp(self, obj: dict[str, Any]) -> dict[str, Any]:
        obj["metadata"]["resourceVersion"] = str(next(self._versions))
        return obj

    def served_resources(self, api_version: str) -> frozenset[str]:
        return frozenset({"toyjobs", "toyconfigs"}) if api_version == TOY_API else frozenset()

    def create_object(self, obj: Mapping[str, Any], plural: str) -> dict[str, Any]:
        meta = obj["metadata"]
        key = (obj["apiVersion"], plural, meta.get("namespace") or "default", meta["name"])
        if key in self.objects:  # as the API server answers: the caller adopts or refuses it
            raise ApiError(409, "AlreadyExists", f"{plural} {meta['name']} already exists")
        made = self._stamp(copy.deepcopy(dict(obj)))
        made["metadata"]["uid"] = f"uid-{meta['name']}-{plural}"
        self.objects[key] = made
        self.created.append(obj["kind"])
        return copy.deepcopy(made)

    def get_object(self, api_version: str, plural: str, namespace: str, name: str) -> dict[str, Any] | None:
        found = self.objects.get((api_version, plural, namespace, name))
        return copy.deepcopy(found) if found else None

    def patch_object(
        self, api_version: str, plural: str, namespace: str, name: str, patch: Mapping[str, Any]
    ) -> dict[str, Any]:
        key = (api_version, plural, namespace, name)
        if key not in self.objects:
            raise ApiError(404, "NotFound", f"{plural} {name} not found")
        obj = self.objects[key]
        obj["spec"].update(patch.get("spec") or {})
        annotations = (patch.get("metadata") or {}).get("annotations") or {}
        obj["metadata"].setdefault("annotations", {}).update(annotations)
        self.annotated += [f"{k}={v}" for k, v in annotations.items()]
        return copy.deepcopy(self._stamp(obj))

    def job(self) -> dict[str, Any]:
        return next(o for o in self.objects.values() if o["kind"] == "ToyJob")

    def get_training(self, namespace: str, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.trainings.get((namespace, name)))

    def patch_training_status(self, namespace: str, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        body = self.trainings[(namespace, name)]
        status = body.setdefault("status", {})
        for key, value in patch["status"].items():
            if value is None:
                status.pop(key, None)
            else:
                status[key] = value
        self.status_writes += 1
        return copy.deepcopy(self._stamp(body))

    def post_event(
        self, training: Mapping[str, Any], kind: str, reason: str, message: str, now: datetime
    ) -> None:
        self.events.append(reason)

    def list_training_pods(self, namespace: str) -> list[dict[str, Any]]:
        return copy.deepcopy(self.pods)

    def get_node(self, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.nodes.get(name))

    def delete_pod(self, namespace: str, name: str, uid: str | None, grace_seconds: int | None) -> None:
        self.deleted_pods.append((name, grace_seconds))
        self.pods = [p for p in self.pods if p["metadata"]["name"] != name or grace_seconds != 0]

    def list_workloads(self, namespace: str, job_uid: str) -> list[dict[str, Any]] | None:
        return None
