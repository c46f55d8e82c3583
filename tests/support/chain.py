"""What the end-to-end chain (tests/e2e_local) stands on, as the tests see it: both real
nodes, the in-cluster operator, and shared claims. Its fixtures make them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import yaml

from support.node.node import Node
from support.paths import ROOT
from support.plane import controlplane
from support.tools.helm import RELEASE_NAMESPACE

# The image the kind examples name: a user of kind builds it and loads it into the nodes.
EXAMPLE_IMAGE: Final = yaml.safe_load((ROOT / "examples" / "kind-cpu.yaml").read_text())["spec"]["image"]
# The namespace the chain's trainings run in.
NAMESPACE: Final = "e2e"
# The label of the volumes :class:`Claims` makes, to find them again.
CLAIMS_LABEL: Final = "gpuop.io/test-claim"


@dataclass(frozen=True)
class Nodes:
    """Both nodes, the images on them."""

    first: Node
    second: Node

    def all(self) -> tuple[Node, Node]:
        return self.first, self.second

    def of(self, pod: dict[str, Any]) -> Node:
        """The node a pod is bound to."""
        bound = pod["spec"].get("nodeName")
        found = next((node for node in self.all() if node.name == bound), None)
        if found is None:
            raise LookupError(f"pod {pod['metadata']['name']} is on no node of the chain's ({bound})")
        return found


@dataclass(frozen=True)
class InClusterOperator:
    """The operator's pod, and the report URL its Deployment tells it to give the trainers."""

    pod: dict[str, Any]
    report_url: str

    def log(self, plane: controlplane.ControlPlane) -> str:
        return plane.kubectl(
            "logs", "-n", RELEASE_NAMESPACE, self.pod["metadata"]["name"], check=False
        ).stdout


@dataclass(frozen=True)
class Claims:
    """ReadWriteMany claims the way a cluster's shared storage gives them, here a hostPath
    PersistentVolume per claim: both nodes are this machine, so a folder is shared by every pod
    of a training, wherever it runs, and by the test, which reads the checkpoints in it."""

    root: Path
    plane: controlplane.ControlPlane

    def make(self, namespace: str, claim: str) -> Path:
        """The claim, bound to a volume of its own; the volume's folder as this host sees it."""
        folder = self.root / namespace / claim
        folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(0o777)  # the trainers run as the image's user, not root
        volume = f"{namespace}-{claim}"
        self.plane.kubectl("apply", "-f", "-", input=json.dumps({
            "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": volume, "labels": {CLAIMS_LABEL: "1"}},
            "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"], "storageClassName": "",
                     "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": str(folder), "type": "Directory"},
                     "claimRef": {"namespace": namespace, "name": claim}},
        }))  # fmt: skip
        self.plane.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps({
            "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": claim},
            "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "", "volumeName": volume,
                     "resources": {"requests": {"storage": "1Gi"}}},
        }))  # fmt: skip
        return folder
