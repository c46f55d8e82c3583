"""The Helm chart, rendered by the real helm binary and checked as a cluster would check it."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import tomllib
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

import jsonschema
import kubernetes_validate
import pytest
import yaml

from gpuop.api.identity import DEFAULT_TRAINER_IMAGE, TRAINING_LABEL
from gpuop.controller.lease import LEADER_LABEL
from gputrain.contract import METRICS_PORT_NAME
from support.paths import ROOT
from support.tools.helm import (
    CHART,
    RELEASE,
    RELEASE_NAMESPACE,
    TEAM_VALUES,
    helm,
    render_error,
    rules,
    template,
    value_args,
)
from support.tools.operator_args import parse_operator_args

CLOUD_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
KUBERNETES_VERSIONS = ["1.29.0", "1.30.0", "1.31.0", "1.32.0", "1.33.0"]
EVERYTHING_ON: dict[str, Any] = {
    "replicaCount": 3,
    "watchNamespaces": ["team-a", "team-b"],
    "operator.scrapeVia": "proxy",
    "metrics.serviceMonitor.enabled": True,
    "metrics.trainerPodMonitor.enabled": True,
    "grafana.dashboards.enabled": True,
    "networkPolicy.enabled": True,
    "networkPolicy.metricsFrom": [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}],
    "image.digest": "sha256:" + "ab" * 32,
}
CASES: list[tuple[str, dict[str, Any], tuple[Path, ...]]] = [
    ("defaults", {}, ()),
    ("everything on", EVERYTHING_ON, ()),
    ("a team's values", TEAM_VALUES, ()),
    ("standalone, no CRD, no RBAC", {"leaderElection.enabled": False, "crds.install": False, "rbac.create": False,
                                     "serviceAccount.create": False, "serviceAccount.name": "mine"}, ()),
    *[(path.name, {}, (path,)) for path in CLOUD_VALUES],
]  # fmt: skip
CASE_IDS = [case[0] for case in CASES]

# The fields of monitoring.coreos.com/v1 that the chart sets, with their API types (no
# prometheus-operator CRD ships with this repository to validate against in full).
_DURATION = {
    "type": "string",
    "pattern": "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
}
_ENDPOINT = {
    "type": "object",
    "additionalProperties": False,
    "required": ["port"],
    "properties": {
        "port": {"type": "string"},
        "path": {"type": "string"},
        "interval": _DURATION,
        "scrapeTimeout": _DURATION,
        "honorLabels": {"type": "boolean"},
        "relabelings": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "sourceLabels": {
                        "type": "array",
                        "items": {"type": "string", "pattern": "^[a-zA-Z_][a-zA-Z0-9_]*$"},
                    },
                    "targetLabel": {"type": "string"},
                },
            },
        },
    },
}
_NAMESPACE_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {"any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}},
}
_MONITOR_SPECS = {
    "ServiceMonitor": {"selector": {"type": "object"}, "namespaceSelector": _NAMESPACE_SELECTOR,
                       "endpoints": {"type": "array", "items": _ENDPOINT, "minItems": 1}},
    "PodMonitor": {"selector": {"type": "object"}, "namespaceSelector": _NAMESPACE_SELECTOR,
                   "podMetricsEndpoints": {"type": "array", "items": _ENDPOINT, "minItems": 1}},
}  # fmt: skip


def _validate(obj: dict[str, Any], version: str) -> None:
    kind = obj["kind"]
    if kind in _MONITOR_SPECS:
        schema = {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector"],
            "properties": _MONITOR_SPECS[kind],
        }
        jsonschema.validate(obj["spec"], schema)
    else:
        kubernetes_validate.validate(obj, version, strict=True)


def _of_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def _deployment(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = _of_kind(objects, "Deployment")
    return deployment


@pytest.mark.parametrize(
    "values_file", [None, *CLOUD_VALUES], ids=["defaults", *[p.name for p in CLOUD_VALUES]]
)
def test_lint_strict(values_file: Path | None) -> None:
    helm("lint", "--strict", str(CHART), *(["--values", str(values_file)] if values_file else []))


@pytest.mark.parametrize(("name", "values", "files"), CASES, ids=CASE_IDS)
def test_every_rendered_object_is_valid_for_every_supported_kubernetes(
    name: str, values: dict[str, Any], files: tuple[Path, ...]
) -> None:
    for version in KUBERNETES_VERSIONS:
        objects = template(values, files, kube_version=version)
        assert objects
        for obj in objects:
            try:
                _validate(obj, version)
            except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as exc:
                pytest.fail(f"{name}, Kubernetes {version}: {obj['kind']} {obj['metadata']['name']}: {exc}")


def test_the_chart_refuses_kubernetes_older_than_the_crd_needs() -> None:
    result = helm("template", "x", str(CHART), "--kube-version", "1.27.0", check=False)
    assert result.returncode != 0
    assert "kubeVersion" in result.stderr


def test_the_chart_crd_is_crds_gputraining_byte_for_byte() -> None:
    source = ROOT / "crds" / "gputraining.yaml"
    assert (CHART / "files" / "gputraining.yaml").read_bytes() == source.read_bytes(), "run `make crds`"
    (rendered,) = [
        o for o in _of_kind(template(), "CustomResourceDefinition") if o["spec"]["group"] == "gpuop.io"
    ]
    meta = rendered.pop("metadata")
    original = yaml.safe_load(source.read_text())
    original_meta = original.pop("metadata")
    assert rendered == original  # nothing lost on the way through fromYaml/toYaml
    assert meta["name"] == original_meta["name"]
    assert meta["annotations"]["helm.sh/resource-policy"] == "keep"  # kept on uninstall
    (dropped,) = [
        o
        for o in _of_kind(template({"crds.keep": False}), "CustomResourceDefinition")
        if o["spec"]["group"] == "gpuop.io"
    ]
    assert "helm.sh/resource-policy" not in dropped["metadata"].get("annotations", {})


def test_crds_can_be_left_to_the_user() -> None:
    objects = template({"crds.install": False})
    kinds = {o["kind"] for o in objects}
    crds = [o["metadata"]["name"] for o in _of_kind(objects, "CustomResourceDefinition")]
    assert "Deployment" in kinds
    assert crds == []  # the chart has no other CRD


# -- values: documented and strictly checked ------------------------------------------------


def test_every_value_is_documented() -> None:
    """Each value has a ``# --`` comment (helm-docs' marker), or sits in a section that has one."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented = []
    stack: list[tuple[int, str, bool]] = []  # indent, key, documented
    for number, line in enumerate(lines):
        match = re.match(r"^( *)([A-Za-z][\w-]*):(.*)$", line)
        if not match:
            continue
        indent, key, rest = len(match[1]), match[2], match[3].strip()
        while stack and stack[-1][0] >= indent:
            stack.pop()
        above = number - 1
        while (
            above >= 0
            and lines[above].strip().startswith("#")
            and not lines[above].strip().startswith("# --")
        ):
            above -= 1
        documented = above >= 0 and lines[above].strip().startswith("# --")
        documented = documented or any(d for _, _, d in stack)
        stack.append((indent, key, documented))
        section = (
            rest == "" and number + 1 < len(lines) and re.match(rf"^ {{{indent + 2}}}\S", lines[number + 1])
        )
        if not section and not documented:
            undocumented.append(".".join(k for _, k, _ in stack))
    assert undocumented == [], f"values without a '# --' comment: {undocumented}"


_OPTIONAL = {"ephemeral-storage", "cpu"}  # resource names the schema allows but values.yaml leaves out


def test_the_schema_knows_every_value_and_no_other() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = yaml.safe_load((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.validate(values, schema)

    def keys(tree: dict[str, Any], node: dict[str, Any], prefix: str = "") -> None:
        node = schema["definitions"][node["$ref"].split("/")[-1]] if "$ref" in node else node
        props = node.get("properties")
        if props is None or not isinstance(tree, dict):
            return
        assert node.get("additionalProperties") is False, f"{prefix or 'the root'} accepts unknown keys"
        assert set(tree) <= set(props), f"{prefix}: not in the schema: {set(tree) - set(props)}"
        assert set(props) - {"global"} <= set(tree) | _OPTIONAL, (
            f"{prefix}: not in values.yaml: {set(props) - set(tree)}"
        )
        for key, value in tree.items():
            keys(value, props[key], f"{prefix}{key}.")

    keys(values, schema)


REFUSED_VALUES: list[tuple[dict[str, Any], str]] = [
    ({"replicaCont": 2}, "replicaCont"),  # a typo fails the install
    ({"operator.scrapeIntervall": 5}, "scrapeIntervall"),
    ({"metrics.serviceMonitor.enable": True}, "enable"),
    ({"operator.scrapeVia": "carrier-pigeon"}, "scrapeVia"),
    ({"operator.logFormat": "xml"}, "logFormat"),
    ({"replicaCount": 0}, "replicaCount"),
    ({"watchNamespaces": ["Team_A"]}, "watchNamespaces"),
    ({"image.digest": "latest"}, "digest"),
    ({"metrics.port": 70000}, "port"),
    (
        {"replicaCount": 2, "leaderElection.enabled": False},
        "replicaCount > 1 needs leaderElection.enabled=true",
    ),
    ({"leaderElection": {"enabled": True, "name": "x"}}, "name"),  # the Lease is named after the release
    ({"operator.scrapeTimeout": 10}, "operator.scrapeTimeout must be shorter than operator.scrapeInterval"),
    ({"health.port": 8080}, "metrics.port and health.port must differ"),
    ({"networkPolicy.enabled": True}, "networkPolicy.namespaces: a NetworkPolicy lives in one namespace"),
    ({"serviceAccount.create": False}, "serviceAccount.name: set it to an existing ServiceAccount"),
    ({"imagePullSecrets": ["registry"]}, "imagePullSecrets.0"),  # the pod spec's shape: {name: ...}
    (
        {"extraEnv": [{"name": "GPUOP_SCRAPE_VIA", "value": "proxy"}]},
        "extraEnv: GPUOP_SCRAPE_VIA is set by the chart",
    ),
    ({"extraEnv": [{"value": "x"}]}, "extraEnv.0"),
    ({"volumeMounts": [{"name": "ca", "mountPath": "etc/ca"}]}, "mountPath"),
    ({"strategy": {"type": "BlueGreen"}}, "strategy.type"),
    ({"priorityClass.value": 2_000_000_000}, "priorityClass.value"),  # over the user-class ceiling
]


@pytest.mark.parametrize(("values", "message"), REFUSED_VALUES, ids=[m for _, m in REFUSED_VALUES])
def test_bad_values_are_refused_with_a_message_naming_the_value(values: dict[str, Any], message: str) -> None:
    assert message in render_error(values)


# -- the operator's Deployment ------------------------------------------------------------


@pytest.mark.parametrize(("name", "values", "files"), CASES, ids=CASE_IDS)
def test_the_deployment_is_restricted_and_its_settings_are_valid(
    name: str, values: dict[str, Any], files: tuple[Path, ...]
) -> None:
    objects = template(values, files)
    deployment = _deployment(objects)
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    # OpenShift assigns the UID; everywhere else the image's fixed non-root one.
    openshift = any(path.name == "openshift-values.yaml" for path in files)
    assert ("runAsUser" in pod["securityContext"]) != openshift
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    # The env the chart sets is what `gpuop operator` reads: parse it the operator's way.
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    parsed = parse_operator_args(container["args"][1:], env)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (parsed.metrics_port, parsed.health_port) == (ports["metrics"], ports["health"])
    # The Lease in the release's namespace; standalone when leader election is off.
    electing = values.get("leaderElection.enabled") is not False
    assert parsed.lease_namespace == (RELEASE_NAMESPACE if electing else None)
    assert parsed.standalone == (not electing)
    if electing:
        assert parsed.lease_name == deployment["metadata"]["name"]
    file_values = [yaml.safe_load(path.read_text()) for path in files]
    namespaces = values.get(
        "watchNamespaces", next((f["watchNamespaces"] for f in file_values if "watchNamespaces" in f), [])
    )
    assert list(parsed.namespaces) == namespaces
    replicas = deployment["spec"]["replicas"]
    assert bool(_of_kind(objects, "PodDisruptionBudget")) == (replicas > 1)


def test_a_teams_values_reach_the_operator_pod() -> None:
    objects = template(TEAM_VALUES)
    deployment = _deployment(objects)
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["imagePullSecrets"] == [{"name": "registry"}]
    assert container["args"] == ["operator", "--verbose"]
    assert container["env"][-3:] == TEAM_VALUES["extraEnv"]
    assert {"name": "proxy-ca", "configMap": {"name": "proxy-ca"}} in pod["volumes"]
    assert {"name": "proxy-ca", "mountPath": "/etc/proxy-ca", "readOnly": True} in container["volumeMounts"]
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]  # the chart's own stay
    assert container["livenessProbe"]["periodSeconds"] == 60
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}  # merged
    assert container["readinessProbe"]["tcpSocket"] == {"port": "health"}
    assert "httpGet" not in container["readinessProbe"]  # a probe has one handler
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}  # no rollingUpdate left over
    (account,) = _of_kind(objects, "ServiceAccount")
    assert account["metadata"]["labels"]["policy.example.com/tier"] == "platform"
    assert account["automountServiceAccountToken"] is False
    assert pod["automountServiceAccountToken"] is True  # the operator needs its token


def test_the_operator_has_a_class_of_its_own_above_the_trainings_unless_given_one() -> None:
    """A training of any PriorityClass on a full node would otherwise evict the operator
    (priority 0), and the reports in flight with it (seen: a preempted trainer's last
    checkpoint, sent as it stopped, never reached status)."""
    objects = template({})
    (made,) = _of_kind(objects, "PriorityClass")
    pod = _deployment(objects)["spec"]["template"]["spec"]
    assert pod["priorityClassName"] == made["metadata"]["name"] == "gpuop-gpu-training-operator"
    assert made["value"] == 1_000_000_000  # the ceiling of a cluster's own classes
    assert made["preemptionPolicy"] == "Never"
    assert made["globalDefault"] is False

    named = template({"priorityClassName": "system-cluster-critical"})
    assert not _of_kind(named, "PriorityClass")
    assert _deployment(named)["spec"]["template"]["spec"]["priorityClassName"] == "system-cluster-critical"

    # `helm upgrade --reuse-values` from a release made before these values: none are there.
    reused = template({"priorityClass": None})
    assert [c["value"] for c in _of_kind(reused, "PriorityClass")] == [1_000_000_000]

    none = template({"priorityClass.create": False})
    assert not _of_kind(none, "PriorityClass")
    assert "priorityClassName" not in _deployment(none)["spec"]["template"]["spec"]


def test_image_tag_defaults_to_the_app_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert chart["appVersion"] == project["version"]
    (container,) = _deployment(template())["spec"]["template"]["spec"]["containers"]
    assert container["image"].endswith(":" + chart["appVersion"])
    # The trainer image the operator defaults to is the one gpuop itself names: one version.
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["GPUOP_TRAINER_IMAGE"] == DEFAULT_TRAINER_IMAGE
    assert DEFAULT_TRAINER_IMAGE.endswith(":" + project["version"])


# -- RBAC, the Lease, monitoring, network ---------------------------------------------------


NODES_GET: Final = {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}


def test_namespaced_mode_grants_nothing_cluster_scoped_but_nodes_token_reviews_and_the_exporters_endpoints() -> (
    None
):
    """A Node has no namespaced form: reading the node of a training pod that may be lost needs
    a ClusterRole whatever the operator watches. Nor has TokenReview: checking a progress
    report's token needs one too (Kubernetes' own system:auth-delegator is the same grant); so
    does reading dcgm-exporter's Endpoints in the GPU Operator's namespace, which may not exist
    at install time (granted by name only). With reports and GPU metrics off, the Node alone."""
    off = {"watchNamespaces": ["a"], "reports": {"enabled": False}, "gpuMetrics": {"source": "none"}}
    (only_nodes,) = _of_kind(template(off), "ClusterRole")
    assert only_nodes["rules"] == [NODES_GET]
    objects = template({"watchNamespaces": ["team-a", "team-b"]})
    (cluster_role,) = _of_kind(objects, "ClusterRole")
    assert cluster_role["rules"] == [
        NODES_GET,
        {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"]},
        {
            "apiGroups": [""],
            "resources": ["endpoints"],
            "resourceNames": ["nvidia-dcgm-exporter"],
            "verbs": ["get"],
        },
    ]
    (cluster_binding,) = _of_kind(objects, "ClusterRoleBinding")
    assert cluster_binding["roleRef"]["name"] == cluster_role["metadata"]["name"]
    # A Role per watched namespace, and the Lease's in the release's own.
    assert sorted(r["metadata"]["namespace"] for r in _of_kind(objects, "Role")) == sorted(
        ["team-a", "team-b", RELEASE_NAMESPACE]
    )
    for binding in _of_kind(objects, "RoleBinding"):
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "gpuop-gpu-training-operator", "namespace": RELEASE_NAMESPACE}
        ]


LEADER: Final = "gpuop-gpu-training-operator-leader"  # the Role and RoleBinding
LEADER_RULES: Final = [
    {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
    {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
     "resourceNames": ["gpuop-gpu-training-operator"], "verbs": ["get", "update"]},
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "patch"]},
]  # fmt: skip


def _named(objects: list[dict[str, Any]], kind: str, name: str) -> list[dict[str, Any]]:
    return [o for o in _of_kind(objects, kind) if o["metadata"]["name"] == name]


def _reports_service(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (service,) = [s for s in _of_kind(objects, "Service") if s["metadata"]["name"].endswith("-reports")]
    return service


def _leader_rules(objects: list[dict[str, Any]]) -> list[tuple[str | None, dict[str, Any]]]:
    """Every rule, anywhere, on a Lease or patching a pod (the leader's label)."""
    return [
        (namespace, rule)
        for namespace, rule in rules(objects)
        if "leases" in rule["resources"] or ("pods" in rule["resources"] and "patch" in rule["verbs"])
    ]


@pytest.mark.parametrize(
    "values",
    [{}, {"watchNamespaces": ["team-a"]}, {"watchNamespaces": ["team-a", RELEASE_NAMESPACE]}],
    ids=["cluster-wide", "Role mode", "Role mode watching its own namespace"],
)
def test_the_lease_is_in_the_releases_namespace_and_the_report_service_selects_its_holder(
    values: dict[str, Any],
) -> None:
    """One Role in the release's namespace, whatever is watched (beside the watch Role when that
    namespace is watched too): its one Lease (made, then read and renewed by name) and the pods
    there (the leader labels its own, and takes the label off a dead leader's), which the report
    Service selects, so reports reach the replica that writes status. No other rule touches a
    Lease or patches a pod."""
    objects = template(values)
    (role,) = _named(objects, "Role", LEADER)
    assert role["metadata"]["namespace"] == RELEASE_NAMESPACE
    assert role["rules"] == LEADER_RULES
    assert _leader_rules(objects) == [(RELEASE_NAMESPACE, rule) for rule in LEADER_RULES]
    (binding,) = _named(objects, "RoleBinding", LEADER)
    assert binding["metadata"]["namespace"] == RELEASE_NAMESPACE
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": LEADER}
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "gpuop-gpu-training-operator", "namespace": RELEASE_NAMESPACE}
    ]
    # The Lease the operator is told is the one the Role names, after the release.
    deployment = _deployment(objects)
    env = _env(objects)
    assert (env["GPUOP_LEASE"], env["GPUOP_LEASE_NAMESPACE"]) == (
        deployment["metadata"]["name"],
        RELEASE_NAMESPACE,
    )
    assert LEADER_RULES[1]["resourceNames"] == [env["GPUOP_LEASE"]]
    assert "GPUOP_STANDALONE" not in env
    # The operator's pods, the leader's alone. The label is the operator's to set at run time:
    # in the pod template every replica would start as leader, and in the Deployment's selector
    # taking it off would orphan the pod from its ReplicaSet.
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert _reports_service(objects)["spec"]["selector"] == {**selector, LEADER_LABEL: "true"}
    assert LEADER_LABEL not in selector
    assert LEADER_LABEL not in deployment["spec"]["template"]["metadata"]["labels"]


@pytest.mark.parametrize("values", [{}, {"watchNamespaces": ["team-a"]}], ids=["cluster-wide", "Role mode"])
def test_standalone_has_no_lease_and_the_report_service_selects_its_one_replica(
    values: dict[str, Any],
) -> None:
    """leaderElection.enabled=false: no Role or binding for a Lease, no rule on one, the operator
    told to act alone, and the report Service selects the operator's pods as the Deployment does
    (no replica would ever carry the leader's label)."""
    objects = template({**values, "leaderElection.enabled": False})
    assert _named(objects, "Role", LEADER) == _named(objects, "RoleBinding", LEADER) == []
    assert _leader_rules(objects) == []
    env = _env(objects)
    assert env["GPUOP_STANDALONE"] == "true"
    assert not {"GPUOP_LEASE", "GPUOP_LEASE_NAMESPACE"} & set(env)
    selector = _deployment(objects)["spec"]["selector"]["matchLabels"]
    assert _reports_service(objects)["spec"]["selector"] == selector


def test_without_rbac_the_lease_is_still_used_and_its_role_left_to_the_site() -> None:
    """rbac.create=false: the site grants the operator's rules itself, the leader's included;
    leader election is a separate value, so the operator still elects one."""
    objects = template({"rbac.create": False})
    assert _of_kind(objects, "Role") == _of_kind(objects, "RoleBinding") == []
    assert (_env(objects)["GPUOP_LEASE"], _env(objects)["GPUOP_LEASE_NAMESPACE"]) == (
        "gpuop-gpu-training-operator",
        RELEASE_NAMESPACE,
    )
    assert LEADER_LABEL in _reports_service(objects)["spec"]["selector"]


def test_no_rule_reaches_secrets_or_deletes_anything_but_pods() -> None:
    """The one delete: a training's pods whose node is lost, for its job to make them again."""
    for values in ({}, EVERYTHING_ON):
        for obj in template(values):
            for rule in obj.get("rules", []) if obj["kind"] in ("Role", "ClusterRole") else []:
                assert not {"secrets", "*"} & set(rule["resources"]), rule
                assert not {"deletecollection", "*", "escalate", "bind", "impersonate"} & set(
                    rule["verbs"]
                ), rule
                assert "delete" not in rule["verbs"] or rule["resources"] == ["pods"], rule


def test_trainer_monitoring_and_network_policy_select_the_trainer_pods_and_port() -> None:
    objects = template(EVERYTHING_ON)
    (pod_monitor,) = _of_kind(objects, "PodMonitor")
    assert pod_monitor["spec"]["selector"]["matchExpressions"] == [
        {"key": TRAINING_LABEL, "operator": "Exists"}
    ]
    assert pod_monitor["spec"]["podMetricsEndpoints"][0]["port"] == METRICS_PORT_NAME
    # Prometheus' name for the pod label, as its Kubernetes discovery writes it.
    source = "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", TRAINING_LABEL)
    assert pod_monitor["spec"]["podMetricsEndpoints"][0]["relabelings"] == [
        {"sourceLabels": [source], "targetLabel": "gputraining"}
    ]
    assert pod_monitor["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}
    policies = _of_kind(objects, "NetworkPolicy")
    assert sorted(p["metadata"]["namespace"] for p in policies) == ["team-a", "team-b"]
    for policy in policies:
        assert policy["spec"]["podSelector"]["matchExpressions"] == [
            {"key": TRAINING_LABEL, "operator": "Exists"}
        ]
        peers, scrapers = policy["spec"]["ingress"]
        assert "ports" not in peers  # rendezvous and NCCL/gloo pick ports at run time
        assert scrapers["ports"] == [{"port": METRICS_PORT_NAME, "protocol": "TCP"}]
        operator_peer = scrapers["from"][0]
        assert operator_peer["namespaceSelector"]["matchLabels"] == {
            "kubernetes.io/metadata.name": RELEASE_NAMESPACE
        }
        assert (
            operator_peer["podSelector"]["matchLabels"]
            == _deployment(objects)["spec"]["selector"]["matchLabels"]
        )
    (service_monitor,) = _of_kind(objects, "ServiceMonitor")
    services = {s["metadata"]["name"].rsplit("-", 1)[-1]: s for s in _of_kind(objects, "Service")}
    assert sorted(services) == ["metrics", "reports"]
    assert (
        service_monitor["spec"]["selector"]["matchLabels"].items()
        <= services["metrics"]["metadata"]["labels"].items()
    )
    # The monitor's labels match the reports Service too; it has no port of the monitor's name.
    (endpoint,) = service_monitor["spec"]["endpoints"]
    assert endpoint["port"] not in {p["name"] for p in services["reports"]["spec"]["ports"]}


# -- the cloud values files, and what a new user is told -----------------------------------------

# Kinds the chart renders without a namespace (cluster-scoped), and those it renders in one.
_CLUSTER_SCOPED = {"ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "PriorityClass"}
_NAMESPACED = {"Deployment", "Service", "ServiceAccount", "Secret", "ConfigMap", "PodDisruptionBudget",
               "Role", "RoleBinding", "NetworkPolicy", "ServiceMonitor", "PodMonitor",
               "PrometheusRule"}  # fmt: skip


@pytest.mark.parametrize("values_file", CLOUD_VALUES, ids=[p.name for p in CLOUD_VALUES])
def test_a_cloud_values_file_installs_on_a_new_cluster_with_only_the_documented_prerequisites(
    values_file: Path,
) -> None:
    """`helm install --create-namespace -f ci/<cloud>-values.yaml` makes the release namespace
    and nothing else: an object in any other namespace (a NetworkPolicy or Role in a team's)
    fails the install where that namespace does not exist yet. A node selector or required
    node affinity names labels a cluster's nodes may lack, leaving the operator Pending, and a
    toleration names a site's taint: both are site choices. prometheus-operator's kinds need
    CRDs the chart does not list as prerequisites. Serving one namespace is a site's choice
    too; a cloud file serves them all. Those choices stay in the files as comments."""
    objects = template(files=(values_file,))
    traps: list[str] = []
    for obj in objects:
        kind, meta = obj["kind"], obj["metadata"]
        where = f"{kind} {meta['name']}"
        assert kind in _CLUSTER_SCOPED | _NAMESPACED, (
            f"{where}: add its kind to _CLUSTER_SCOPED or _NAMESPACED"
        )
        if kind in _CLUSTER_SCOPED and "namespace" in meta:
            traps.append(f"{where}: cluster-scoped, given namespace {meta['namespace']}")
        # helm puts a namespaced object that names none in the release's
        if kind in _NAMESPACED and meta.get("namespace", RELEASE_NAMESPACE) != RELEASE_NAMESPACE:
            traps.append(f"{where}: in namespace {meta['namespace']}, which the install does not make")
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            traps.append(f"{where}: needs prometheus-operator's CRDs")
    pod = _deployment(objects)["spec"]["template"]["spec"]
    for field in ("nodeSelector", "tolerations"):
        if field in pod:
            traps.append(f"the operator pod's {field}: {pod[field]}")
    if "nodeAffinity" in pod.get("affinity", {}):
        traps.append(f"the operator pod's nodeAffinity: {pod['affinity']['nodeAffinity']}")
    # The class the operator runs at is the one the chart makes, not one the cluster must have.
    made = [c["metadata"]["name"] for c in _of_kind(objects, "PriorityClass")]
    if made != [pod.get("priorityClassName")]:
        traps.append(f"priorityClassName {pod.get('priorityClassName')}, which the chart does not make")
    # Every namespace: GPUOP_NAMESPACES empty, the rules in a ClusterRole bound cluster-wide.
    if _env(objects)["GPUOP_NAMESPACES"]:
        traps.append(f"serves only {_env(objects)['GPUOP_NAMESPACES']}")
    bound = {b["roleRef"]["name"] for b in _of_kind(objects, "ClusterRoleBinding")}
    serving = {
        role["metadata"]["name"]
        for role in _of_kind(objects, "ClusterRole")
        if any("gputrainings" in rule["resources"] for rule in role["rules"])
    }
    # (The one Role is the Lease's, in the release's own namespace.)
    namespaced = [
        r
        for r in _of_kind(objects, "Role")
        if r["metadata"]["name"] != f"{RELEASE}-gpu-training-operator-leader"
    ]
    if not serving & bound or namespaced:
        traps.append("GpuTrainings granted in Roles, not a ClusterRole")
    assert traps == [], f"{values_file.name}: {traps}"


# What each cloud file leaves to the site, as commented examples (top-level values).
SITE_CHOICES = {
    "aks-values.yaml": {"watchNamespaces", "nodeSelector", "tolerations", "metrics"},
    "eks-values.yaml": {"watchNamespaces", "nodeSelector", "priorityClassName", "metrics", "networkPolicy"},
    "gke-values.yaml": {"watchNamespaces", "nodeSelector", "networkPolicy"},
    "openshift-values.yaml": set(),
}


def _site_choices(path: Path) -> dict[str, Any]:
    """A values file's commented examples, uncommented: each starts at a `# key:` line naming a
    top-level value and goes on over the indented `#` lines under it."""
    top = set(yaml.safe_load((CHART / "values.yaml").read_text()))
    lines: list[str] = []
    inside = False
    for line in path.read_text().splitlines():
        start = re.match(r"# ([a-zA-Z]\w*):", line)
        if start and start[1] in top:
            inside = True
            lines.append(line[2:])
        elif inside and line.startswith("#  "):
            lines.append(line[2:])
        else:
            inside = False
    choices: dict[str, Any] = yaml.safe_load("\n".join(lines)) or {}
    return choices


@pytest.mark.parametrize("values_file", CLOUD_VALUES, ids=[p.name for p in CLOUD_VALUES])
def test_the_site_choices_a_cloud_file_leaves_commented_are_values_the_chart_takes(
    values_file: Path, tmp_path: Path
) -> None:
    """Uncommented together over the file, they pass the schema, render objects the API would
    take, and reach the operator's pod: a user who uncomments one gets what its comment says."""
    choices = _site_choices(values_file)
    assert set(choices) == SITE_CHOICES[values_file.name]
    uncommented = tmp_path / "site.yaml"
    uncommented.write_text(yaml.safe_dump(choices))
    version = KUBERNETES_VERSIONS[-1]
    objects = template(files=(values_file, uncommented), kube_version=version)
    for obj in objects:
        _validate(obj, version)
    pod = _deployment(objects)["spec"]["template"]["spec"]
    for key in ("nodeSelector", "tolerations", "priorityClassName"):
        if key in choices:
            assert pod[key] == choices[key], key
    if "watchNamespaces" in choices:
        assert _env(objects)["GPUOP_NAMESPACES"] == ",".join(choices["watchNamespaces"])


@pytest.fixture(scope="module")
def notes_chart(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the chart that renders NOTES.txt as a ConfigMap's data, through `tpl` with the
    release's context as helm renders it: `helm template` leaves NOTES out, and helm 3.17's
    `install --dry-run=client` still asks a cluster for its version."""
    chart = tmp_path_factory.mktemp("notes") / CHART.name
    shutil.copytree(CHART, chart)
    shutil.copy(CHART / "templates" / "NOTES.txt", chart / "notes-source.txt")
    (chart / "templates" / "zz-notes.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\ndata:\n"
        '  notes: {{ tpl (.Files.Get "notes-source.txt") . | toJson }}\n'
    )
    return chart


def _notes(chart: Path, values: dict[str, Any] | None = None) -> str:
    result = helm("template", RELEASE, str(chart), "--namespace", RELEASE_NAMESPACE,
                  "--show-only", "templates/zz-notes.yaml", *value_args(values))  # fmt: skip
    notes: str = yaml.safe_load(result.stdout)["data"]["notes"]
    return notes


def test_a_new_user_is_pointed_at_the_first_example_and_every_example_named_exists(notes_chart: Path) -> None:
    """The first example needs one GPU and no volume; examples/mnist.yaml needs two GPUs, three
    ReadWriteMany claims and MNIST already on one, so it is named only as the fuller example."""
    notes = _notes(notes_chart)
    readme = (CHART / "README.md").read_text()
    for where, text in (("NOTES.txt", notes), ("README.md", readme)):
        named = re.findall(r"examples/[\w./-]+\.yaml", text)
        assert named[0] == "examples/first-training.yaml", where
        assert f"kubectl apply -f {named[0]}" in text, where
        assert "kubectl apply -f examples/mnist.yaml" not in text, where
        for path in named:
            assert (ROOT / path).is_file(), f"{where} names {path}, which is not in the repository"
    assert "serving GpuTrainings in every namespace." in notes
    # Served only some namespaces, the first example goes to one of them.
    scoped = _notes(notes_chart, {"watchNamespaces": ["team-a", "team-b"]})
    assert "serving GpuTrainings in team-a, team-b." in scoped
    assert "kubectl apply -f examples/first-training.yaml -n team-a" in scoped


# -- Grafana dashboards ------------------------------------------------------------------------

# Labels Prometheus adds to every scraped series (prometheus-operator: namespace, pod, container,
# endpoint, job, instance, service), and the one the trainer PodMonitor adds.
_TARGET_LABELS = {"namespace", "pod", "container", "endpoint", "job", "instance", "service", "gputraining"}


def _exported_series() -> dict[str, set[str]]:
    """Every series the trainer and the operator serve, with its labels, read from the real
    endpoints' exposition after each figure has been set once."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from gpuop.controller.table import Tracked
    from gpuop.controller.telemetry import OperatorMetrics
    from gputrain.contract import Progress
    from gputrain.metrics import GpuReading, MetricsServer

    trainer = MetricsServer(None)
    trainer.update(
        Progress(epoch=1, total_epochs=2, step=3, total_steps=10, loss=0.5, accuracy=0.9,
                 samples_per_second=100.0, estimated_remaining_seconds=60.0),
        gpus=[GpuReading(0, "NVIDIA H100 80GB HBM3", 50.0, 1, 2)],
    )  # fmt: skip
    trainer.count(1, 32.0)
    operator = OperatorMetrics()
    operator.api_request("list", "pods", 200, 0.01)
    operator.reconciles.labels(outcome="created").inc()
    operator.errors.inc()
    operator.duration.observe(0.1)
    operator.status_patches.inc()
    operator.scrapes.labels(outcome="ok").inc()
    running = Tracked(body={"metadata": {"name": "llm", "namespace": "team-a", "uid": "u"}, "status": {
        "phase": "Running", "gpuHours": 1.0, "gpuHoursCountedAt": "2026-11-24T10:00:00Z",
        "gpu": {"count": 8, "model": "NVIDIA H100 80GB HBM3",
                "perWorker": [{"pod": "llm-master-0", "utilizationPercent": 50.0, "memoryUsedBytes": 1}]},
        "progress": {"percent": 30.0, "loss": 0.5, "accuracy": 0.9, "samplesPerSecond": 100.0,
                     "estimatedRemainingSeconds": 60},
        "conditions": [{"type": t, "status": "True", "lastTransitionTime": "2026-11-24T10:00:00Z"}
                       for t in ("Running", "Stalled")]}})  # fmt: skip
    operator.observe_trainings([(("team-a", "llm"), running)], datetime(2026, 11, 24, 10, tzinfo=UTC))
    operator.observe_trainings([(("team-a", "llm"), running)], datetime(2026, 11, 24, 11, tzinfo=UTC))
    series: dict[str, set[str]] = {}
    for registry in (trainer.registry, operator.registry):
        for family in text_string_to_metric_families(generate_latest(registry).decode()):
            for sample in family.samples:
                series.setdefault(sample.name, set()).update(sample.labels)
    return series


def _dashboards() -> list[tuple[str, dict[str, Any]]]:
    objects = template({"grafana.dashboards.enabled": True})
    maps = _of_kind(objects, "ConfigMap")
    return [(key, json.loads(text)) for cm in maps for key, text in cm["data"].items()]


def test_grafana_dashboards_are_off_by_default_and_carry_the_sidecars_label() -> None:
    assert not _of_kind(template(), "ConfigMap")
    maps = _of_kind(template({"grafana.dashboards.enabled": True}), "ConfigMap")
    assert len(maps) == 2
    for cm in maps:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"  # kube-prometheus-stack's sidecar default
    moved = _of_kind(template({"grafana.dashboards.enabled": True, "grafana.dashboards.namespace": "monitoring"}),
                     "ConfigMap")  # fmt: skip
    assert {cm["metadata"]["namespace"] for cm in moved} == {"monitoring"}


def test_each_dashboard_is_a_dashboard_model_over_series_we_export() -> None:
    """The JSON is a Grafana dashboard model (what its import reads: uid, title, schemaVersion,
    panels placed on the grid, each with Prometheus targets on the datasource variable), and
    every series a query names is one the trainer or the operator really serves, grouped only
    by labels that series has."""
    series = _exported_series()
    found = _dashboards()
    assert sorted(key for key, _ in found) == ["gpu-training-operator-operator.json",
                                               "gpu-training-operator-trainings.json"]  # fmt: skip
    for key, model in found:
        assert re.fullmatch(r"[a-zA-Z0-9_-]{1,40}", model["uid"]), key
        assert model["title"]
        assert isinstance(model["schemaVersion"], int)
        assert model["schemaVersion"] >= 36
        variables = {v["name"] for v in model["templating"]["list"]}
        assert "datasource" in variables
        ids = [p["id"] for p in model["panels"]]
        assert len(ids) == len(set(ids)), key
        for panel in model["panels"]:
            where = f"{key} panel {panel['title']!r}"
            grid = panel["gridPos"]
            assert grid["x"] + grid["w"] <= 24, where  # Grafana's grid is 24 wide
            assert panel["type"] in {"timeseries", "stat"}, where
            assert panel["targets"], where
            for target in panel["targets"]:
                assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where
                expr = target["expr"]
                assert expr.count("(") == expr.count(")"), where
                names = set(re.findall(r"\b((?:gputrain|gpuop|process)_[a-z_]+)\b", expr))
                assert names, where
                for name in names:
                    assert name in series, f"{where}: {name} is not a series we export"
                    grouped = {
                        label.strip()
                        for group in re.findall(r"by \(([^)]*)\)", expr)
                        for label in group.split(",")
                    } - {"le"}
                    assert grouped <= series[name] | _TARGET_LABELS, (
                        f"{where}: {name} has no {grouped - series[name] - _TARGET_LABELS}"
                    )
                for variable in re.findall(r"\$([a-z]+)", expr):
                    assert variable in variables | {"__rate_interval"}, where


# -- the progress-report endpoint ----------------------------------------------------------------


def _env(objects: list[dict[str, Any]]) -> dict[str, str]:
    (container,) = _deployment(objects)["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e.get("value") for e in container["env"]}


def test_the_report_endpoint_has_a_service_a_certificate_for_its_name_and_the_operator_is_told_its_url() -> (
    None
):
    objects = template({})
    env = _env(objects)
    (service,) = [s for s in _of_kind(objects, "Service") if s["metadata"]["name"].endswith("-reports")]
    name = service["metadata"]["name"]
    assert env["GPUOP_REPORT_URL"] == f"https://{name}.{RELEASE_NAMESPACE}.svc:443"
    assert service["spec"]["ports"] == [
        {"name": "reports", "port": 443, "targetPort": "reports", "protocol": "TCP"}
    ]
    (container,) = _deployment(objects)["spec"]["template"]["spec"]["containers"]
    assert {"name": "reports", "containerPort": 8443, "protocol": "TCP"} in container["ports"]
    assert env["GPUOP_REPORT_PORT"] == "8443"
    mount = next(m for m in container["volumeMounts"] if m["name"] == "report-tls")
    assert mount["mountPath"] == env["GPUOP_REPORT_TLS_DIR"]
    (secret,) = _of_kind(objects, "Secret")
    assert secret["type"] == "kubernetes.io/tls"
    assert sorted(secret["data"]) == [
        "ca.crt",
        "tls.crt",
        "tls.key",
    ]
    volumes = _deployment(objects)["spec"]["template"]["spec"]["volumes"]
    assert {"name": "report-tls", "secret": {"secretName": secret["metadata"]["name"]}} in volumes
    # The certificate names the Service as trainers reach it (openssl reads it back).
    pem = base64.b64decode(secret["data"]["tls.crt"])
    text = subprocess.run(
        ["openssl", "x509", "-noout", "-ext", "subjectAltName"], input=pem, capture_output=True, check=True
    ).stdout.decode()
    assert f"DNS:{name}.{RELEASE_NAMESPACE}.svc" in text
    # ECDSA P-256, the CA's and the endpoint's: a handshake a report, signed cheaply.
    for field in ("tls.crt", "ca.crt"):
        key = subprocess.run(["openssl", "x509", "-noout", "-text"], input=base64.b64decode(secret["data"][field]),
                             capture_output=True, check=True).stdout.decode()  # fmt: skip
        assert ("id-ecPublicKey" in key, "prime256v1" in key) == (True, True), key
    key = subprocess.run(["openssl", "pkey", "-noout", "-text"], input=base64.b64decode(secret["data"]["tls.key"]),
                         capture_output=True, check=True).stdout.decode()  # fmt: skip
    assert "prime256v1" in key, key


def test_a_given_certificate_secret_is_mounted_and_none_is_made_and_reports_off_leaves_no_trace() -> None:
    objects = template({"reports": {"tls": {"secretName": "from-cert-manager"}}})
    assert not _of_kind(objects, "Secret")
    volumes = _deployment(objects)["spec"]["template"]["spec"]["volumes"]
    assert {"name": "report-tls", "secret": {"secretName": "from-cert-manager"}} in volumes
    off = template({"reports": {"enabled": False}})
    assert not any(k.startswith("GPUOP_REPORT") for k in _env(off))
    assert not [s for s in _of_kind(off, "Service") if s["metadata"]["name"].endswith("-reports")]
    assert not _of_kind(off, "Secret")


def test_gpu_figures_source_reaches_the_operator_and_prometheus_needs_its_url() -> None:
    env = _env(template({}))
    assert env["GPUOP_GPU_METRICS"] == "dcgm-exporter"
    assert env["GPUOP_DCGM_EXPORTER_SERVICE"] == "gpu-operator/nvidia-dcgm-exporter"
    url = "http://prometheus-operated.monitoring:9090"
    env = _env(template({"gpuMetrics": {"source": "prometheus", "prometheus": {"url": url}}}))
    assert (env["GPUOP_GPU_METRICS"], env["GPUOP_GPU_METRICS_PROMETHEUS_URL"]) == ("prometheus", url)
    assert "gpuMetrics" in render_error({"gpuMetrics": {"source": "prometheus"}})
    assert "gpuMetrics" in render_error({"gpuMetrics": {"dcgmExporter": {"service": "no-namespace"}}})
