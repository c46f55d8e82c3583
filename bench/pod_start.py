"""How long a pod takes to start on a real node (kubelet, containerd, runc, the CNI bridge,
kube-scheduler), the node every test's pods run on.

One control plane of its own (tests/support/plane): N pods one after the other on one real
node, each pod ``sh -c "sleep 1"`` in the shell stand-in image. For each pod, from the create
request's reply: until the API says it is bound to a node, until it is Running (the kubelet has
started its container), and until Succeeded. Polled every 20 ms, so each figure is late by 10 ms
on average. Needs root, as the node suite does. Figures: docs/benchmarks.md.

    .venv/bin/python bench/pod_start.py 20
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from support.node import binaries  # noqa: E402
from support.node.images import SHELL_IMAGE  # noqa: E402
from support.node.node import running_node, running_scheduler, session_ident  # noqa: E402
from support.plane import controlplane  # noqa: E402
from support.plane.cluster import Api  # noqa: E402

NAMESPACE = "default"
POLL_SECONDS = 0.02


def _pod(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "containers": [{
                "name": "main", "image": SHELL_IMAGE, "imagePullPolicy": "Never",
                "command": ["sh", "-c", "sleep 1"],
                "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}},
            }],
        },
    }  # fmt: skip


def _until(api: Api, name: str, reached: Callable[[dict[str, Any]], bool], timeout: float = 120) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pod = api.request("GET", f"/api/v1/namespaces/{NAMESPACE}/pods/{name}")
        if reached(pod):
            return time.monotonic()
        time.sleep(POLL_SECONDS)
    raise RuntimeError(f"pod {name} did not get there in {timeout:g}s: {pod.get('status')}")


def measure(api: Api, prefix: str, count: int) -> dict[str, list[float]]:
    """Seconds from each create's reply to bound, Running and Succeeded."""
    figures: dict[str, list[float]] = {"bound": [], "running": [], "succeeded": []}
    for index in range(count):
        name = f"{prefix}-{index}"
        api.request("POST", f"/api/v1/namespaces/{NAMESPACE}/pods", _pod(name))
        created = time.monotonic()
        bound = _until(api, name, lambda pod: bool(pod["spec"].get("nodeName")))
        running = _until(api, name, lambda pod: pod["status"].get("phase") in ("Running", "Succeeded"))
        succeeded = _until(api, name, lambda pod: pod["status"].get("phase") in ("Succeeded", "Failed"))
        phase = api.request("GET", f"/api/v1/namespaces/{NAMESPACE}/pods/{name}")["status"]["phase"]
        if phase != "Succeeded":
            raise RuntimeError(f"pod {name} ended {phase}")
        figures["bound"].append(bound - created)
        figures["running"].append(running - created)
        figures["succeeded"].append(succeeded - created)
        api.request("DELETE", f"/api/v1/namespaces/{NAMESPACE}/pods/{name}?gracePeriodSeconds=0")
    return figures


@contextlib.contextmanager
def real_node(plane: controlplane.ControlPlane, api: Api, workdir: Path) -> Iterator[None]:
    node_binaries = binaries.ensure_all()
    with running_scheduler(plane, node_binaries, workdir / "scheduler"), running_node(
        plane, api, node_binaries, workdir / "node", name=socket.gethostname(), ident=session_ident("p")
    ):  # fmt: skip
        yield


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("count", type=int, nargs="?", default=20, help="pods (default 20)")
    args = parser.parse_args()
    results: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="gpuop-podstart-", dir="/tmp") as tmp:
        work = Path(tmp)
        with controlplane.running(work / "plane") as plane:
            api = Api(plane)
            with real_node(plane, api, work):
                measure(api, "warm-node", 2)
                results["real node"] = measure(api, "node", args.count)
    print(f"pod start, {args.count} pods one after the other "
          "(seconds from the create's reply; median / p90 / max)")  # fmt: skip
    print(f"{'':12} {'bound':>22} {'Running':>22} {'Succeeded (sleep 1)':>22}")
    for where, figures in results.items():
        cells = []
        for key in ("bound", "running", "succeeded"):
            values = sorted(figures[key])
            p90 = values[min(len(values) - 1, int(0.9 * len(values)))]
            cells.append(f"{statistics.median(values):.2f} / {p90:.2f} / {values[-1]:.2f}")
        print(f"{where:12} " + " ".join(f"{cell:>22}" for cell in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
