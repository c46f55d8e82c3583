"""The chart's RBAC rules are exactly what the operator asks the API server for.

The real operator runs a scenario that takes every path that talks to the API (create,
adopt-or-conflict, runPolicy patch, status, events, pod listing, proxy scraping, a lost node's
gang deleted, a child's deletion, Kopf's watches, the Lease and the leader's pod label, a
graceful exit). The emulator records each request as
RBAC sees it; every request must be allowed by the rules `helm template` renders for that
mode, and every rule must have been used: nothing missing, nothing more.
"""

from __future__ import annotations

import json
from typing import Any

from gpuop.backends.registry import APIS
from support.emulator.cluster import JOBS, PODS, Cluster, stranger_job
from support.samples import RUNNING
from support.specs import training
from support.tools.helm import RELEASE, RELEASE_NAMESPACE, rules, template
from support.waiting import wait_for

# The Lease the chart names (the release's full name, in its namespace), and the operator's own
# pod there, which it labels while it leads.
LEASE = ("--lease", f"{RELEASE}-gpu-training-operator")
OWN_POD = "gpuop-operator-0"
# The emulator has no TokenReview and no dcgm-exporter, and the operator here runs without the
# report endpoint and GPU metrics: the chart is rendered with both off, and its rules for them
# (tokenreviews, pods get, configmaps, dcgm-exporter's Endpoints) are proven used by the real
# control plane's audit log (tests/controlplane/test_operator.py, a real report included).
WITHOUT_REPORTS_AND_GPU_METRICS = {"reports.enabled": False, "gpuMetrics.source": "none"}
Request = tuple[str, str, str, str | None, str | None]  # verb, group, resource, namespace, name


def _scenario(env: Cluster, operator_args: tuple[str, ...]) -> set[Request]:
    env.api.call(env.server.create, PODS, {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": OWN_POD, "namespace": RELEASE_NAMESPACE},
        "spec": {"containers": [{"name": "operator", "image": "operator"}]},
    })  # fmt: skip
    env.operator_env = {"POD_ID": OWN_POD}
    env.start_operator(*operator_args, *LEASE, lease_namespace=RELEASE_NAMESPACE)
    wait_for("the leader's label on its pod", lambda: (
        (env.get(PODS, OWN_POD, namespace=RELEASE_NAMESPACE) or {}).get("metadata", {}).get("labels") or {}
    ).get("gpuop.io/leader") == "true")  # fmt: skip
    env.apply(training("a"))
    wait_for("phase Created", lambda: env.status("a").get("phase") == "Created")

    # Running, scraped: pods listed, metrics read (by pod IP or through the pod proxy).
    env.job_condition("a", "Created", "Running", startTime="2026-01-01T00:00:00Z")
    pods = env.start_pods("a", 2, RUNNING, gpu_percent=80.0)
    wait_for("progress", lambda: env.status("a").get("progress", {}).get("step") == 30)

    # A runPolicy change is patched onto the running job.
    env.kubectl(
        "patch",
        "gputraining",
        "a",
        "--type",
        "merge",
        "-p",
        json.dumps({"spec": {"runPolicy": {"suspend": True}}}),
    )
    wait_for(
        "the job suspended",
        lambda: (env.get(JOBS, "a") or {}).get("spec", {}).get("runPolicy", {}).get("suspend"),
    )

    # A stranger's job under the wanted name: the 409 is followed by a read.
    env.api.call(env.server.create, JOBS, stranger_job("b"))
    env.apply(training("b"))
    wait_for("NameConflict", lambda: env.condition("b", "NameConflict"))

    # A node lost: the Node of its pod that is not ready read, and the gang's pods deleted for
    # its job to make again (the loss is older than the default timeout).
    env.apply(training("c"))
    wait_for("c Created", lambda: env.status("c").get("phase") == "Created")
    env.job_condition("c", "Created", "Running", startTime="2026-01-01T00:00:00Z")
    gang = env.start_pods("c", 2, RUNNING, gpu_percent=80.0)
    env.lose_node(gang[1], "gpu-1")
    wait_for("the gang deleted", lambda: all(env.get(PODS, p) is None for p in gang))

    # Finished: termination messages read. Then someone deletes the job: its DELETED makes
    # the operator ask whether the GpuTraining is still there.
    env.job_condition("a", "Created", "Succeeded", completionTime="2026-01-01T01:00:00Z")
    for pod in pods:
        env.finish_pod(pod, {"phase": "Succeeded", "step": 100, "totalSteps": 100})
    wait_for("Succeeded", lambda: env.status("a").get("phase") == "Succeeded")
    env.kubectl("delete", "pytorchjob", "a")
    wait_for(
        "the operator's read after the child's deletion",
        lambda: ("gpuop", "get", "gpuop.io", "gputrainings", "default", "a") in env.server.audit,
    )
    process = env.operator
    assert process is not None
    env.stop_operator()  # the Lease given up, and the leader's label taken off its pod
    assert process.returncode == 0, env.operator_log()
    return {entry[1:] for entry in env.server.audit if entry[0] in ("gpuop", "kopf")}


def _allows(rule: dict[str, Any], request: Request) -> bool:
    verb, group, resource, _, name = request
    return (
        group in rule["apiGroups"]
        and resource in rule["resources"]
        and verb in rule["verbs"]
        and (not rule.get("resourceNames") or name in rule["resourceNames"])
    )


# What the chart grants for the backends the scenario does not run (registry: each one's access).
OTHER_BACKENDS_RULES = frozenset(
    (rule.api_group, rule.resources, rule.verbs)
    for name, api in APIS.items()
    if name != "pytorchjob"
    for rule in api.access
)


def _rule_of(rule: dict[str, Any]) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    (group,) = rule["apiGroups"]
    return group, tuple(rule["resources"]), tuple(rule["verbs"])


def _check(requests: set[Request], granted: list[tuple[str | None, dict[str, Any]]]) -> None:
    def allowed(request: Request) -> bool:
        namespace = request[3]
        return any(
            (scope is None or scope == namespace) and _allows(rule, request) for scope, rule in granted
        )

    refused = sorted(r for r in requests if not allowed(r))
    assert refused == [], f"the operator asked for what the chart does not grant: {refused}"
    # The scenario runs a PyTorchJob, and the emulator serves no Kueue API, so the other
    # backends' rules and Kueue's go unused here; the real control plane's audit-log tests
    # (tests/controlplane/test_operator.py) prove them used.
    unused = sorted(
        (rule["apiGroups"][0], resource, verb)
        for scope, rule in granted
        if rule["apiGroups"] != ["kueue.x-k8s.io"] and _rule_of(rule) not in OTHER_BACKENDS_RULES
        for resource in rule["resources"]
        for verb in rule["verbs"]
        if not any(
            r[0] == verb
            and r[1] in rule["apiGroups"]
            and r[2] == resource
            and (scope is None or r[3] == scope)
            for r in requests
        )
    )
    assert unused == [], f"the chart grants what the operator never asks for: {unused}"


def test_cluster_wide_rbac_is_exactly_what_the_operator_uses(env: Cluster) -> None:
    requests = _scenario(env, ("--scrape-via", "proxy"))
    granted = rules(template({"operator.scrapeVia": "proxy", **WITHOUT_REPORTS_AND_GPU_METRICS}))
    # A ClusterRole, and the Lease's Role in the operator's own namespace.
    assert {scope for scope, _ in granted} == {None, RELEASE_NAMESPACE}
    _check(requests, granted)


def test_namespaced_rbac_is_exactly_what_the_operator_uses(env: Cluster) -> None:
    requests = _scenario(env, ("--namespace", "default", "--scrape-via", "pod-ip"))
    granted = rules(
        template(
            {
                "watchNamespaces": ["default"],
                "operator.scrapeVia": "pod-ip",
                **WITHOUT_REPORTS_AND_GPU_METRICS,
            }
        )
    )
    # Roles only, but for what has no namespaced form: a Node, read. The Lease's Role is in
    # the operator's own namespace.
    assert {(scope, *_rule_of(rule)) for scope, rule in granted if scope not in ("default", RELEASE_NAMESPACE)} == {
        (None, "", ("nodes",), ("get",))}  # fmt: skip
    _check(requests, granted)
