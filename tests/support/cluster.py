"""`make cluster` / `make cluster-down`: a local Kubernetes cluster on this machine, no Docker.

The same pieces the tests run (the control plane, two real nodes with the stand-in GPU device
plugin, kube-scheduler, kube-proxy, CoreDNS, the real Kubeflow training-operator v1, and Kubeflow
Trainer v2 with JobSet, so both of the operator's backends run), kept up by a
detached supervisor (:func:`support.plane.controlplane.detach`) until ``down``; and a real OCI
registry (:mod:`support.registry`) that ``make release`` pushes this tree's operator image and
chart to, so the chart is installed as a user installs it, from ``oci://`` with its defaults,
and the nodes pull the image. Everything lives under ``.cluster/`` (ignored by git): the
kubeconfig, the binaries' links, the registry's address (``registry``, one line ``host:port``)
and CA (``registry-ca.crt``), the release's files (``dist/``), each piece's work directory and
log. ``down`` stops them in reverse order, each node cordoned and
drained, and sweeps what a piece left (support.node.node.Node.stop); then it checks that no
process, mount, bridge, cgroup or kube-proxy chain of the cluster is left on the machine.

The release pushes the trainer image too (images/trainer.Dockerfile, 5.4 GB unpacked), which the
released chart's defaults name, so a GpuTraining with no ``image`` trains, its pods' kubelets
pulling the image at the first one on each node: ``examples/first-training.yaml`` with
``gpusPerWorker: 0``.
What it needs: root (cgroups, mounts, network namespaces, iptables), Go and gcc (the binaries
are built from their modules the first time: README has the cold cost) and about 15 GB of disk
(the trainer image in the cache, the registry and each node).
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import textwrap
import time
from pathlib import Path
from typing import IO, Final

from support import registry, release
from support.controllers import trainerv2, trainingoperator
from support.images import build
from support.node import binaries, hoststate
from support.node.node import PREFIX, Node
from support.node.pool import GPUS_PER_NODE, running_pool
from support.node.process import processes_naming
from support.node.proxy import kube_chains
from support.paths import ROOT
from support.plane import controlplane
from support.plane.cluster import KUBEFLOW_CRD, TRAINER_CRDS, Api, install_crds, ready_operator_pod
from support.tools.helm import CHART, RELEASE, RELEASE_NAMESPACE, helm

STATE: Final = ROOT / ".cluster"
_BINARIES: Final = ("kubectl", "ctr")


def _say(message: str) -> None:
    print(f"cluster: {message}", flush=True)


def _operator_state(api: Api) -> str:
    """Why the operator's pod is not Ready: its phase, its containers' states, its events."""
    said = []
    for pod in api.list("pods", RELEASE_NAMESPACE):
        states = [c.get("state") for c in pod["status"].get("containerStatuses") or []]
        said.append(f"pod {pod['metadata']['name']} {pod['status'].get('phase')} on "
                    f"{pod['spec'].get('nodeName')}: {states}")  # fmt: skip
    said += [f"{e['reason']}: {e.get('message', '')}" for e in api.list("events", RELEASE_NAMESPACE)][-8:]
    return "; ".join(said) or "no pod"


def _supervise(state: Path, node_binaries: binaries.NodeBinaries, ready: IO[str]) -> int:
    """The supervisor's life: start every piece, report, stay until SIGTERM, stop in reverse."""
    signals = controlplane.StopSignals()
    with contextlib.ExitStack() as pieces:
        try:
            with signals.starting():
                plane = controlplane.ControlPlane(state / "plane", node_binaries.controlplane, say=_say)
                pieces.callback(plane.stop)
                plane.start()
                # Kubeflow's CRDs and JobSet's, for the controllers below (the chart brings ours and
                # Kopf's); before the chart, so that the operator finds both backends at its start.
                install_crds(plane, [KUBEFLOW_CRD, *TRAINER_CRDS, trainerv2.JOBSET_CRD])
                api = Api(plane)
                local = pieces.enter_context(registry.running_registry(state / "registry-server"))
                shutil.copy(local.ca, state / registry.CA_FILE)
                (state / registry.ADDRESS_FILE).write_text(local.address + "\n")
                # A working tree's release: no CHANGELOG section asked of a version in progress.
                described = release.release(local.address, release.pyproject_version(), state / "dist",
                                            local.ca, _say, with_notes=False)  # fmt: skip
                version = str(described["version"])

                def trust(node: Node) -> None:
                    node.containerd.trust(local.address, local.ca)

                pool = pieces.enter_context(running_pool(plane, api, node_binaries, state, trust))
                nodes = pool.nodes
                controllers = [
                    trainingoperator.training_operator(plane, api, plane.advertise_address, state),
                    *trainerv2.trainer_and_jobset(plane, api, plane.advertise_address, state),
                ]
                for controller in controllers:
                    pieces.callback(controller.retire)
                    controller.start()
                config = ["--kubeconfig", str(plane.kubeconfig)]
                chart = f"oci://{local.address}/charts/{CHART.name}"
                helm("upgrade", "--install", RELEASE, chart, "--version", version, "--ca-file", str(local.ca),
                     "-n", RELEASE_NAMESPACE, "--create-namespace", *config)  # fmt: skip
                deadline = time.monotonic() + 180
                while ready_operator_pod(api) is None:
                    if time.monotonic() > deadline:
                        raise RuntimeError(
                            f"the operator's pod was not Ready after 180 s: {_operator_state(api)}"
                        )
                    time.sleep(1)
                shutil.copy(plane.kubeconfig, state / "kubeconfig")
                (state / "nodes").write_text(
                    "".join(f"{n.name} {n.ident} {n.containerd.socket}\n" for n in nodes)
                )
        except (Exception, controlplane.StopRequested) as exc:  # to the parent, which prints it, exits 1
            with contextlib.suppress(OSError):  # a parent gone already
                ready.write(f"error: {exc}\n")
                ready.close()
            return 1
        ready.write("ok\n")
        ready.close()
        while not signals.stopped:
            time.sleep(1.0)
            try:
                plane.check_alive()
            except RuntimeError as exc:
                _say(f"stopping: {exc}")
                break
        _say("stopping")
    _say("stopped")
    return 0


def _nodes(state: Path) -> list[tuple[str, str, str]]:
    """(name, ident, containerd socket) of each node the cluster under ``state`` started."""
    listed = state / "nodes"
    return [tuple(line.split()) for line in listed.read_text().splitlines()] if listed.exists() else []  # type: ignore[misc]


def left_on_machine(state: Path) -> list[str]:
    """What of a cluster under ``state`` is still on the machine: processes and mounts under it,
    each node's cgroups and bridge links, kube-proxy's chains (empty after a clean ``down``)."""
    # (`make cluster` and `make cluster-down` themselves name it too.)
    left = [f"process {pid}: {command[:120]}" for pid, command in sorted(processes_naming(str(state)).items())
            if "support.cluster" not in command]  # fmt: skip
    left += [f"mount {m}" for m in hoststate.mounts_under(state)]
    for name, ident, _ in _nodes(state):
        left += [f"node {name}: cgroup {path}" for path in hoststate.cgroups_under(f"{PREFIX}{ident}")]
        left += [f"node {name}: link {link}" for link in hoststate.links_of(f"{PREFIX}{ident}")]
    before = (
        set((state / "chains-before").read_text().split()) if (state / "chains-before").exists() else set()
    )
    left += [f"iptables chain {chain}" for chain in kube_chains() if chain not in before]
    return left


# The deepest unix socket a node makes under the state directory (the device plugin's, in the
# kubelet's plugins_registry), and the kernel's bound on a socket's path (sun_path, 108 bytes).
_DEEPEST_SOCKET: Final = "node-a/kubelet/root/plugins_registry/gpuplugin-reg.sock"
_SOCKET_PATH_MAX: Final = 107


def up(state: Path) -> int:
    if controlplane.supervisor_alive(state):
        print(f"already running: export KUBECONFIG={state / 'kubeconfig'}")
        return 0
    deepest = state / _DEEPEST_SOCKET
    if len(str(deepest).encode()) > _SOCKET_PATH_MAX:
        print(f"error: {state} is too deep for the nodes' unix sockets ({deepest}: over {_SOCKET_PATH_MAX} "
              "bytes); clone the repository to a shorter path, or give --dir a shorter one", file=sys.stderr)  # fmt: skip
        return 1
    shutil.rmtree(state, ignore_errors=True)
    state.mkdir(parents=True)
    started = time.monotonic()
    # Another session's kube-proxy chains, if any, are not ours to find left at `down`.
    (state / "chains-before").write_text("\n".join(kube_chains()))
    # Built (or found) before the supervisor starts, so their progress shows here.
    node_binaries = binaries.ensure_all()
    # What the release pushes, built here so that their progress shows.
    image = build.operator_image()
    trainer = build.trainer_image()
    release.packages(_say)
    (state / "bin").mkdir()
    for name in _BINARIES:
        (state / "bin" / name).symlink_to(node_binaries.path(name))
    try:
        child, verdict = controlplane.detach(state, lambda ready: _supervise(state, node_binaries, ready))
    except KeyboardInterrupt:
        return 130
    if verdict != "ok":
        print(
            verdict or f"error: the supervisor died while starting (see {state}/supervisor.log)",
            file=sys.stderr,
        )
        return 1
    nodes = _nodes(state)
    print(
        textwrap.dedent(f"""\
        cluster up in {time.monotonic() - started:.0f}s (supervisor pid {child}): {len(nodes)} nodes with \
{GPUS_PER_NODE} stand-in nvidia.com/gpu each, CoreDNS, Kubeflow's training-operator v1 and Trainer v2 \
with JobSet, and the chart
        installed from the registry at {registry.read(state).address} as `make release` pushed it \
(operator image built here: {image.name}).
          export KUBECONFIG={state / "kubeconfig"} PATH={state / "bin"}:$PATH
          kubectl get nodes; kubectl get pods -A
        A GpuTraining with no `image` runs the trainer image the release pushed (built here from \
images/trainer.Dockerfile as {trainer.name}); to train in an image of yours,
        push it to that registry (its CA: {state / registry.CA_FILE}), or import it into each node:
        {"; ".join(f"ctr --address {sock} -n k8s.io images import IMAGE.tar" for _, _, sock in nodes)}
        Logs: {state}/*/ ; stop it with: make cluster-down""")
    )
    return 0


def down(state: Path, timeout: float = 300.0) -> int:
    """Stop the supervisor (it drains and stops every piece), then check and remove ``state``."""
    started = time.monotonic()
    pid = controlplane.stop_supervisor(state, timeout)
    left = left_on_machine(state)
    if left:  # the supervisor was killed at the timeout, or a piece's stop failed: see its log
        print(f"left on the machine (logs in {state}):\n  " + "\n  ".join(left), file=sys.stderr)
        return 1
    existed = state.exists()
    shutil.rmtree(state, ignore_errors=True)
    if pid:
        print(f"cluster stopped in {time.monotonic() - started:.0f}s; nothing of it is left on the machine")
    else:
        print("no cluster was running" + (" (state removed)" if existed else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cluster", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["up", "down"])
    parser.add_argument("--dir", type=Path, default=STATE, help="state directory (default: .cluster/)")
    args = parser.parse_args(argv)
    try:
        return up(args.dir.resolve()) if args.command == "up" else down(args.dir.resolve())
    except (RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
