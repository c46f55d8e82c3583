"""Pods on a real node: created through the API, placed by kube-scheduler, run by the kubelet
through containerd and runc as containers in cgroups, with the kubelet's volumes and tokens.

Each test checks what only a real node does (the node agent the chain ran on before imitated
some of it and failed every one of these): a cgroup under ``kubepods`` and the exit code, the kernel's OOM
kill, the size the kubelet gives a memory-backed emptyDir, a projected token the apiserver
accepts for its audience, and a stop that leaves nothing on the machine.
"""

from __future__ import annotations

import ipaddress
import json
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuop._kits.quantity import parse_quantity
from gpuop.api.spec import parse
from gpuop.backends.registry import render_job
from support import specs
from support.node import hoststate, images
from support.node.binaries import NodeBinaries
from support.node.node import Node, Scheduler, running_node, session_ident
from support.plane.cluster import Api, HttpError
from support.plane.controlplane import ControlPlane
from support.waiting import wait_for

NAMESPACE = "gpuop-real-node"
MI = 1024 * 1024


@pytest.fixture(scope="module")
def namespace(node: Node, node_api: Api) -> Iterator[str]:
    node_api.request("POST", "/api/v1/namespaces", {"metadata": {"name": NAMESPACE}})
    wait_for(
        "the namespace's default ServiceAccount",
        lambda: node_api.get("serviceaccounts", "default", NAMESPACE),
    )
    yield NAMESPACE
    node_api.request("DELETE", f"/api/v1/namespaces/{NAMESPACE}")


def pod(node: Node, name: str, script: str, memory: str | None = None, **spec: Any) -> dict[str, Any]:
    """A one-container pod of the stand-in shell image running ``script`` once, for ``node``:
    the scheduler places it, and the node selector keeps it off any other node the module
    has."""
    container: dict[str, Any] = {
        "name": "main",
        "image": images.SHELL_IMAGE,
        "command": ["/bin/sh", "-c", script],
    }
    if memory is not None:
        container["resources"] = {"limits": {"memory": memory, "cpu": "100m"}}
    container |= spec.pop("container", {})
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "containers": [container],
            "nodeSelector": {"kubernetes.io/hostname": node.name},
            **spec,
        },
    }


def get_pod(api: Api, name: str) -> dict[str, Any]:
    found = api.get("pods", name, NAMESPACE)
    assert found is not None, f"pod {name} is gone"
    return found


def wait_phase(api: Api, name: str, phases: set[str], timeout: float = 60) -> dict[str, Any]:
    """The pod once its phase is one of ``phases``; on timeout, fail with its status and events."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        current = get_pod(api, name)
        if current["status"].get("phase") in phases:
            return current
        time.sleep(0.1)
    events = api.list("events", NAMESPACE)
    said = [
        f"{e['reason']}: {e.get('message', '')}" for e in events if e["involvedObject"].get("name") == name
    ]
    raise AssertionError(f"pod {name} not in {sorted(phases)} after {timeout:g}s: "
                         f"{json.dumps(current['status'])}\nevents: {said}")  # fmt: skip


def terminated(pod_object: dict[str, Any]) -> dict[str, Any]:
    state: dict[str, Any] = pod_object["status"]["containerStatuses"][0]["state"]
    assert "terminated" in state, state
    return state["terminated"]  # type: ignore[no-any-return]


def logs(plane: ControlPlane, name: str) -> str:
    """``kubectl logs``: the apiserver asks the kubelet, which reads containerd's log file."""
    return plane.kubectl("logs", f"--namespace={NAMESPACE}", name).stdout


def test_a_pod_runs_as_containers_in_kubepods_and_reports_its_exit_codes(
    node: Node, node_api: Api, plane: ControlPlane, namespace: str, scheduler: Scheduler
) -> None:
    script = "echo hello from a container; cat /proc/self/cgroup; sleep 3; echo done"
    created_at = time.monotonic()
    created = node_api.create("pods", pod(node, "runs", script, memory="64Mi"), namespace)
    node_api.create("pods", pod(node, "exits-3", "echo failing on purpose; exit 3"), namespace)
    running = wait_phase(node_api, "runs", {"Running", "Succeeded"})
    latency = time.monotonic() - created_at
    print(f"pod start latency (create -> Running): {latency:.2f}s")
    assert running["spec"]["nodeName"] == node.name  # bound by kube-scheduler, the only binder here
    assert ipaddress.ip_address(running["status"]["podIP"]) in ipaddress.ip_network(
        node.subnet
    )  # the bridge's

    group = node.pod_cgroup(created["metadata"]["uid"])
    assert int((group / "memory.limit_in_bytes").read_text()) == 64 * MI  # the limit, enforced by the kernel
    container_id = running["status"]["containerStatuses"][0]["containerID"].removeprefix("containerd://")
    procs = (group / container_id / "cgroup.procs").read_text().split()
    commands = [Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode() for pid in procs]
    assert any(command.startswith("/bin/sh -c echo hello") or "sleep" in command for command in commands), (
        commands
    )

    done = wait_phase(node_api, "runs", {"Succeeded", "Failed"})
    assert done["status"]["phase"] == "Succeeded"
    assert (terminated(done)["exitCode"], terminated(done)["reason"]) == (0, "Completed")
    output = logs(plane, "runs")
    assert output.startswith("hello from a container\n"), output
    assert output.endswith("done\n"), output
    assert re.search(
        rf"^\d+:memory:/{node.cgroup_root}/kubepods/.*pod{created['metadata']['uid']}/", output, re.M
    )

    failed = wait_phase(node_api, "exits-3", {"Succeeded", "Failed"})
    assert failed["status"]["phase"] == "Failed"
    assert (terminated(failed)["exitCode"], terminated(failed)["reason"]) == (3, "Error")
    assert logs(plane, "exits-3") == "failing on purpose\n"


def test_a_container_over_its_memory_limit_ends_oomkilled(node: Node, node_api: Api, namespace: str) -> None:
    # `tail /dev/zero` keeps one endless line in memory: it grows until the kernel kills it.
    node_api.create("pods", pod(node, "oom", "exec tail /dev/zero", memory="32Mi"), namespace)
    done = wait_phase(node_api, "oom", {"Succeeded", "Failed"}, timeout=90)
    assert done["status"]["phase"] == "Failed"
    state = terminated(done)
    assert (state["reason"], state["exitCode"]) == ("OOMKilled", 137), state


@pytest.mark.parametrize(
    ("size_limit", "expected_mib"),
    [("256Mi", 64), ("16Mi", 16)],
    ids=["sizeLimit-above-the-memory-limit", "sizeLimit-below-it"],
)
def test_a_memory_emptydir_at_dev_shm_gets_the_smaller_of_its_size_limit_and_the_memory_limit(
    node: Node, node_api: Api, plane: ControlPlane, namespace: str, size_limit: str, expected_mib: int
) -> None:
    name = f"shm-{size_limit.lower()}"
    body = pod(node, name, "cat /proc/mounts", memory="64Mi", container={"volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}]},
               volumes=[{"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": size_limit}}])  # fmt: skip
    node_api.create("pods", body, namespace)
    assert wait_phase(node_api, name, {"Succeeded", "Failed"})["status"]["phase"] == "Succeeded"
    shm = [line for line in logs(plane, name).splitlines() if line.split()[1:2] == ["/dev/shm"]]
    assert [line.split()[2] for line in shm] == ["tmpfs"], shm
    size = re.search(r"\bsize=(\d+)k\b", shm[0])
    assert size is not None, shm[0]
    # The kubelet sizes a memory-backed emptyDir at min(sizeLimit, the pod's memory limit): a
    # sizeLimit above the limit does not buy more /dev/shm than the limit.
    assert int(size.group(1)) * 1024 == expected_mib * MI, shm[0]


def rendered_worker(
    node: Node, name: str, script: str, quick_delete: bool = True, **spec: Any
) -> dict[str, Any]:
    """The master pod of the PyTorchJob the operator renders for a GpuTraining with ``spec``, as
    the training-operator would create it (its MASTER_ADDR and MASTER_PORT added), with the
    shell image running ``script`` in place of the trainer: everything else (volumes, resources,
    security contexts, args, the grace period unless ``quick_delete``) is the operator's."""
    training = parse(specs.minimal(**{"workers": 1, "gpusPerWorker": 0, **spec}))
    job = render_job(training, "pytorchjob", default_image=images.SHELL_IMAGE)[-1]
    template = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]
    container = template["spec"]["containers"][0]
    container["command"] = ["/bin/sh", "-c", script, "sh"]  # the rendered args follow as "$@"
    container["env"] += [
        {"name": "MASTER_ADDR", "value": f"{name}-master-0"},
        {"name": "MASTER_PORT", "value": "23456"},
    ]
    body: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": template["metadata"]["labels"]},
        "spec": {
            **template["spec"],
            "restartPolicy": "Never",
            "nodeSelector": {"kubernetes.io/hostname": node.name},
        },
    }
    if quick_delete:
        body["spec"]["terminationGracePeriodSeconds"] = 1
    return body


@pytest.mark.parametrize(
    ("memory", "expected"),
    [("1Gi", "512Mi"), ("600Mi", "300Mi"), (None, "512Mi")],
    ids=["1Gi-limit", "600Mi-limit", "no-memory-limit"],
)
def test_the_operators_worker_gets_the_dev_shm_it_meant_and_its_args_expanded(
    node: Node, node_api: Api, plane: ControlPlane, namespace: str, memory: str | None, expected: str
) -> None:
    """The operator sizes /dev/shm (support: gpuop.backends.nccl.shm_size_bytes) at most half the
    memory limit, so the kubelet's cap at min(sizeLimit, limit) never cuts it: the size in the
    pod is the size the operator rendered. And ``$(MASTER_ADDR)`` in its args is the kubelet's
    to expand from the env the training-operator adds."""
    name = f"worker-{(memory or 'none').lower()}"
    resources = {"cpu": "100m", **({"memory": memory} if memory else {})}
    body = rendered_worker(node, name, 'cat /proc/mounts; echo "args: $*"', resources=resources)
    volume = next(v for v in body["spec"]["volumes"] if v["name"] == "dshm")
    assert volume["emptyDir"]["sizeLimit"] == expected  # what the operator meant
    node_api.create("pods", body, namespace)
    assert wait_phase(node_api, name, {"Succeeded", "Failed"})["status"]["phase"] == "Succeeded"
    output = logs(plane, name)
    shm = [line for line in output.splitlines() if line.split()[1:2] == ["/dev/shm"]]
    size = re.search(r"\bsize=(\d+)k\b", shm[0]) if shm else None
    assert size is not None, output
    assert int(size.group(1)) * 1024 == parse_quantity(expected), shm[0]
    args = next(line for line in output.splitlines() if line.startswith("args: "))
    assert f"--master-addr={name}-master-0 --master-port=23456" in args, args


def test_the_operators_gpu_worker_gets_the_devices_its_kubelet_allocates_and_one_too_many_waits(
    node: Node, node_api: Api, plane: ControlPlane, namespace: str
) -> None:
    """GPU-shaped pods on a node whose device plugin (the stand-in) offers two devices: the
    operator's worker asking for both is placed and given both by the kubelet's device manager
    (the plugin's NVIDIA_VISIBLE_DEVICES); while it holds them, a second asking for one more
    waits, Unschedulable for want of nvidia.com/gpu."""
    allocatable = node.node_object()["status"]["allocatable"]
    assert allocatable["nvidia.com/gpu"] == "2", allocatable
    body = rendered_worker(
        node, "gpu-worker", 'echo "visible: $NVIDIA_VISIBLE_DEVICES"; sleep 30', gpusPerWorker=2
    )
    assert body["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 2
    node_api.create("pods", body, namespace)
    wait_phase(node_api, "gpu-worker", {"Running"})
    said = wait_for("the worker's line", lambda: "visible: " in (out := logs(plane, "gpu-worker")) and out)
    visible = next(line for line in said.splitlines() if line.startswith("visible: "))
    assert set(visible.split(" ", 1)[1].split(",")) == {f"GPU-standin-{node.name}-{i}" for i in range(2)}, (
        said
    )
    more = rendered_worker(node, "gpu-worker-2", "true", gpusPerWorker=1)
    node_api.create("pods", more, namespace)

    def unschedulable() -> str | None:
        conditions = get_pod(node_api, "gpu-worker-2")["status"].get("conditions") or []
        found = [c for c in conditions if c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable"]
        return found[0].get("message") if found else None

    message = wait_for("the second worker Unschedulable", unschedulable, timeout=30)
    assert "Insufficient nvidia.com/gpu" in message, message
    for name in ("gpu-worker", "gpu-worker-2"):
        node_api.delete("pods", name, namespace)


def test_sigterm_gives_the_operators_worker_its_grace_period_to_save(
    node: Node, node_api: Api, plane: ControlPlane, namespace: str
) -> None:
    """Deleting a worker (preemption, a drain, a suspend) sends its process SIGTERM and waits up to
    the grace period the operator rendered before SIGKILL: a trainer that takes seconds to write
    its checkpoint gets them. The log is followed while the pod goes, as it is gone after."""
    save = 3
    script = (f"trap 'echo TERM received; sleep {save}; echo checkpoint saved; exit 0' TERM; "
              "echo training; while :; do sleep 0.2; done")  # fmt: skip
    body = rendered_worker(node, "graceful", script, quick_delete=False)
    grace = body["spec"]["terminationGracePeriodSeconds"]
    assert grace >= 30, grace  # the operator's, longer than Kubernetes' default
    node_api.create("pods", body, namespace)
    wait_phase(node_api, "graceful", {"Running"})
    wait_for("the worker's first line", lambda: "training" in logs(plane, "graceful"))
    follow = subprocess.Popen(
        [str(plane.binary("kubectl")), f"--kubeconfig={plane.kubeconfig}", "logs", "-f", "-n", NAMESPACE, "graceful"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deleted = time.monotonic()
        node_api.request("DELETE", f"/api/v1/namespaces/{NAMESPACE}/pods/graceful")
        output, _ = follow.communicate(timeout=60)
    finally:
        follow.kill()
    wait_for("the pod gone", lambda: node_api.get("pods", "graceful", NAMESPACE) is None, timeout=60)
    took = time.monotonic() - deleted
    assert "TERM received" in output, output
    assert output.rstrip().endswith("checkpoint saved"), output
    assert save <= took < grace, f"deletion took {took:.1f}s"


def test_a_trainer_with_no_sigterm_handler_stops_at_sigterm_in_the_operators_pod_not_at_the_kill(
    node: Node, node_api: Api, namespace: str
) -> None:
    """torchrun sets its SIGTERM handler only once it starts its workers; waiting in its
    rendezvous (a peer gone, or not up yet) it has none. The kernel drops a signal that has no
    handler when it is sent to a PID namespace's init, so as its container's PID 1 it would sit
    out the SIGTERM of a suspend, an eviction or a preemption, and the pod would hold its GPUs
    until the grace period's SIGKILL. In the operator's pod the pause process is PID 1
    (shareProcessNamespace) and the SIGTERM stops it at once; the same pod without it, beside it,
    waits the grace period out on this kubelet."""
    grace = 12
    took = {}
    for name, shared in (("no-handler", True), ("no-handler-pid1", False)):
        body = rendered_worker(node, name, "exec sleep 600", quick_delete=False)
        assert body["spec"]["shareProcessNamespace"] is True  # as the operator renders it
        body["spec"]["shareProcessNamespace"] = shared
        body["spec"]["terminationGracePeriodSeconds"] = grace
        node_api.create("pods", body, namespace)
        wait_phase(node_api, name, {"Running"})
        deleted = time.monotonic()
        node_api.request("DELETE", f"/api/v1/namespaces/{NAMESPACE}/pods/{name}")
        wait_for(
            f"{name} gone", lambda n=name: node_api.get("pods", n, NAMESPACE) is None, timeout=grace + 30
        )
        took[name] = time.monotonic() - deleted
    print(f"SIGTERM to a process with no handler, pod deleted in: {took} (grace period {grace} s)")
    assert took["no-handler"] < grace / 2, took
    assert took["no-handler-pid1"] >= grace, took


def test_a_projected_token_with_an_audience_passes_a_token_review_for_that_audience_only(
    node: Node, node_api: Api, plane: ControlPlane, namespace: str
) -> None:
    audience = "gpuop-progress"
    token_volume = {"name": "token", "projected": {"sources": [{"serviceAccountToken": {
        "audience": audience, "expirationSeconds": 3600, "path": "token"}}]}}  # fmt: skip
    body = pod(node, "token", "cat /var/run/secrets/gpuop/token", volumes=[token_volume],
               container={"volumeMounts": [{"name": "token", "mountPath": "/var/run/secrets/gpuop"}]})  # fmt: skip
    node_api.create("pods", body, namespace)
    assert wait_phase(node_api, "token", {"Succeeded", "Failed"})["status"]["phase"] == "Succeeded"
    token = logs(plane, "token").strip()

    def review(audiences: list[str]) -> dict[str, Any]:
        reply: dict[str, Any] = node_api.request("POST", "/apis/authentication.k8s.io/v1/tokenreviews", {
            "apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
            "spec": {"token": token, "audiences": audiences}})  # fmt: skip
        status: dict[str, Any] = reply["status"]
        return status

    accepted = review([audience])
    assert accepted.get("authenticated") is True, accepted
    assert accepted["user"]["username"] == f"system:serviceaccount:{namespace}:default"
    assert accepted["user"]["extra"]["authentication.kubernetes.io/pod-name"] == ["token"]  # bound to the pod
    assert accepted["audiences"] == [audience]
    refused = review(["https://kubernetes.default.svc.cluster.local"])  # the apiserver's own audience
    assert not refused.get("authenticated"), refused


def test_a_node_stopped_with_a_pod_running_leaves_nothing_on_the_machine(
    plane: ControlPlane, node_api: Api, node_binaries: NodeBinaries, scheduler: Scheduler, namespace: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:  # fmt: skip
    ident = session_ident("b")
    name = f"gpuopnode-{ident}"
    taint = {
        "key": "gpuop.io/leaves-nothing",
        "value": "test",
        "effect": "NoSchedule",
    }  # no other pod lands here
    workdir = tmp_path_factory.mktemp("node-b")
    with running_node(plane, node_api, node_binaries, workdir, name, ident, taints=[taint]) as second:
        body = pod(second, "on-second-node", "sleep 600", memory="32Mi",
                   tolerations=[{"key": taint["key"], "operator": "Exists", "effect": "NoSchedule"}])  # fmt: skip
        node_api.create("pods", body, namespace)
        assert wait_phase(node_api, "on-second-node", {"Running"})["spec"]["nodeName"] == name
        while_running = second.footprint()
        print(f"node {name} started: {second.timings}; while running: {while_running.summary()}")
        # What the stop must take away is there: containerd's shims, the pod's mounts (its network
        # namespace, rootfs, /dev/shm), its cgroups, the bridge and the pod's veth on it.
        assert while_running.processes, while_running
        assert while_running.mounts, while_running
        assert while_running.cgroups, while_running
        assert len(while_running.links) == 2, while_running.links
    after = second.footprint()
    assert after.empty(), after
    assert not hoststate.links_of(second.bridge)
    assert not [link for link in hoststate.links() if link["name"] in while_running.links]
    # The graceful part (drain, kubelet, containerd) must have stopped every process by itself,
    # and released every mount but the one a kubelet never releases: the bind mount of its root
    # directory onto itself (it makes it rshared at start). The sweep removes that, the groups
    # under the cgroup root, the bridge, and the kubelet's /var/log/containers links (its
    # container GC removes them only a minute after a pod is gone).
    print(f"what the graceful stop left, then swept: {second.swept and second.swept.summary()}")
    assert second.swept is not None
    assert second.swept.processes == {}, second.swept
    assert second.swept.mounts in ([], [str(second.kubelet.root_dir)]), second.swept
    assert hoststate.dead_sockets_in_shared_directories() == []  # shims' and the kubelet's, closed
    with pytest.raises(HttpError) as gone:
        node_api.request("GET", f"/api/v1/nodes/{name}")
    assert gone.value.status == 404


def test_a_node_whose_session_was_killed_is_swept_by_the_next_node_to_start_and_a_live_one_is_not(
    plane: ControlPlane, node: Node, node_api: Api, node_binaries: NodeBinaries, scheduler: Scheduler,
    namespace: str, tmp_path_factory: pytest.TempPathFactory,
) -> None:  # fmt: skip
    """A session killed outright (the CI job's time limit, SIGKILL) stops no node: its daemons die
    with it, and its mounts, cgroups, bridge, shims and unpacked images stay, gigabytes with the
    trainer image. The next node to start sweeps them, and leaves alone a node whose session
    still runs (this module's)."""
    ident = session_ident("k")
    name = f"gpuopnode-{ident}"
    taint = {"key": "gpuop.io/killed-session", "value": "test", "effect": "NoSchedule"}
    killed = Node(plane, node_api, node_binaries, tmp_path_factory.mktemp("node-k"), name, ident, [taint])
    claims = hoststate.CLAIMS / f"{ident}.json", hoststate.CLAIMS / f"{node.ident}.json"
    try:
        killed.start()
        body = pod(killed, "on-killed-node", "sleep 600", memory="32Mi",
                   tolerations=[{"key": taint["key"], "operator": "Exists", "effect": "NoSchedule"}])  # fmt: skip
        node_api.create("pods", body, namespace)
        wait_phase(node_api, "on-killed-node", {"Running"})
        assert all(claim.exists() for claim in claims)
        # The session dies: its daemons with it (PR_SET_PDEATHSIG), the pod's shim not (it is
        # init's child); the claim's owner is a process that has exited.
        for daemon in (killed.kubelet.process, killed.containerd.process):
            assert daemon is not None
            daemon.process.kill()
            daemon.process.wait()
        exited = subprocess.Popen(["true"])
        exited.wait()
        claims[0].write_text(json.dumps(json.loads(claims[0].read_text()) | {"pid": exited.pid}))
        left = killed.footprint()
        assert all((left.processes, left.mounts, left.cgroups, left.links)), left.summary()
        assert killed.containerd.store.is_dir()

        swept = hoststate.sweep_orphans()

        assert [claim.ident for claim in swept] == [ident]
        after = killed.footprint()
        assert after.empty(), after.summary()
        assert not killed.containerd.store.exists()  # the images: what filled the disk
        assert (killed.workdir / "kubelet" / "kubelet.log").is_file()  # the logs stay
        assert not claims[0].exists()
        assert claims[1].exists()  # the live session's node: untouched
        assert node.ready()
    finally:
        killed.kubelet.process = killed.containerd.process = None  # nothing left to drain
        killed.stop()
        node_api.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/on-killed-node",
                         {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0})  # fmt: skip
