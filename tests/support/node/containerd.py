"""One containerd v2 of one node: its config, its process, its images, and its clean stop.

Everything it keeps is under the node's work directory (root, state, temp, sockets, runc's
state, the network namespaces of its pods, the CNI config and IPAM state), so two nodes on one
machine never share a file, and deleting the directory after :meth:`Containerd.stop` leaves
nothing of it behind. Plugins that would reach outside it (NRI's socket in /var/run/nri,
/opt/containerd) are off. One path cannot be moved: each shim's socket is in /run/containerd/s
(hard-coded in containerd); a shim removes its own when it exits, and the node that created the
directory removes it (:data:`support.node.hoststate.SHARED_DIRECTORIES`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from support.node import images
from support.node.binaries import CNI_PLUGIN_NAMES, NodeBinaries
from support.node.process import Supervised, spawn, wait_until

# Plugins a node here does not use, each of which would otherwise touch a path outside the work
# directory or probe for hardware (the CRI plugin, overlayfs and the runc shim are what remains).
DISABLED_PLUGINS = [
    "io.containerd.nri.v1.nri",
    "io.containerd.internal.v1.opt",
    "io.containerd.snapshotter.v1.btrfs",
    "io.containerd.snapshotter.v1.zfs",
    "io.containerd.snapshotter.v1.devmapper",
    "io.containerd.snapshotter.v1.blockfile",
    "io.containerd.snapshotter.v1.erofs",
    "io.containerd.differ.v1.erofs",
    "io.containerd.tracing.processor.v1.otlp",
    "io.containerd.internal.v1.tracing",
]


def _toml(value: object) -> str:
    """A TOML value: JSON's strings, numbers, booleans and arrays are TOML's."""
    return json.dumps(value)


class Containerd:
    """The containerd of one node, everything under ``workdir`` (its socket is :attr:`socket`)."""

    def __init__(self, workdir: Path, binaries: NodeBinaries, bridge: str, subnet: str) -> None:
        self.workdir = workdir
        self.binaries = binaries
        self.bridge = bridge
        self.subnet = subnet
        self.socket = workdir / "containerd.sock"
        self.cni_conf_dir = workdir / "cni" / "net.d"
        self.cni_data_dir = workdir / "cni" / "ipam"
        self.process: Supervised | None = None

    @property
    def store(self) -> Path:
        """Its images and snapshots: gigabytes with the trainer image."""
        return self.workdir / "root"

    @property
    def registry_hosts(self) -> Path:
        """``<host:port>/hosts.toml`` of each registry this node trusts (:meth:`trust`)."""
        return self.workdir / "certs.d"

    def trust(self, address: str, ca: Path) -> None:
        """Pull from the registry at ``address`` (``host:port``) over TLS verified with ``ca``,
        as a cloud node trusts a private registry's CA; the CA is copied under the node."""
        directory = self.registry_hosts / address
        directory.mkdir(parents=True, exist_ok=True)
        shutil.copy(ca, directory / "ca.crt")
        server = f"https://{address}"
        (directory / "hosts.toml").write_text("\n".join([
            f"server = {_toml(server)}",
            f"[host.{_toml(server)}]",
            "  capabilities = ['pull', 'resolve']",
            f"  ca = {_toml(str(directory / 'ca.crt'))}",
        ]) + "\n")  # fmt: skip

    @property
    def endpoint(self) -> str:
        return f"unix://{self.socket}"

    def config(self) -> str:
        runtime = "plugins.'io.containerd.cri.v1.runtime'"
        return "\n".join([
            "version = 4",
            f"root = {_toml(str(self.store))}",
            f"state = {_toml(str(self.workdir / 'state'))}",
            f"temp = {_toml(str(self.workdir / 'tmp'))}",
            f"disabled_plugins = {_toml(DISABLED_PLUGINS)}",
            "[plugins.'io.containerd.server.v1.grpc']",
            f"  address = {_toml(str(self.socket))}",
            "[plugins.'io.containerd.server.v1.ttrpc']",
            f"  address = {_toml(str(self.socket) + '.ttrpc')}",
            f"[{runtime}]",
            # This kernel refuses a negative oom_score_adj even to root, and the pod sandbox asks
            # for -998: without this runc fails with "can't get final child's PID from pipe: EOF".
            "  restrict_oom_score_adj = true",
            # Pods' network namespaces under the state directory, not the machine's /var/run/netns.
            "  netns_mounts_under_state_dir = true",
            "  enable_selinux = false",
            f"[{runtime}.containerd]",
            "  default_runtime_name = 'runc'",
            f"[{runtime}.containerd.runtimes.runc]",
            "  runtime_type = 'io.containerd.runc.v2'",
            f"[{runtime}.containerd.runtimes.runc.options]",
            f"  BinaryName = {_toml(str(self.binaries.path('runc')))}",
            # runc's state of each container here, not in the machine's /run/containerd/runc.
            f"  Root = {_toml(str(self.workdir / 'runc'))}",
            "  SystemdCgroup = false",  # the kubelet's cgroupDriver is cgroupfs: no systemd here
            f"[{runtime}.cni]",
            f"  bin_dirs = {_toml([str(self.binaries.cni_dir)])}",
            f"  conf_dir = {_toml(str(self.cni_conf_dir))}",
            "  max_conf_num = 1",
            "[plugins.'io.containerd.cri.v1.images']",
            "  snapshotter = 'overlayfs'",
            # A pulled layer leaves the content store once unpacked, so that a node holds the
            # trainer image's 5.4 GB once, not twice (no pod here pushes an image it pulled).
            # containerd then pulls in the CRI plugin itself, not through its transfer service.
            "  discard_unpacked_layers = true",
            # Where the registries it may pull from are described (hosts.toml per host:port,
            # read at each pull, so a registry can be trusted after the node started).
            "[plugins.'io.containerd.cri.v1.images'.registry]",
            f"  config_path = {_toml(str(self.registry_hosts))}",
            "[plugins.'io.containerd.cri.v1.images'.pinned_images]",
            f"  sandbox = {_toml(images.PAUSE_IMAGE)}",
            "[plugins.'io.containerd.grpc.v1.cri']",
            "  disable_tcp_service = true",
            "  stream_server_address = '127.0.0.1'",
            "  stream_server_port = '0'",
        ]) + "\n"  # fmt: skip

    def cni_config(self) -> dict[str, object]:
        """The pod network: a bridge of this node's own with host-local addresses from ``subnet``."""
        return {
            "cniVersion": "1.0.0",
            "name": self.bridge,
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": self.bridge,
                    # The bridge holds the gateway address, so the host reaches its pods directly,
                    # and pods route everything else through it: a Service's cluster IP, which
                    # kube-proxy rewrites on the host (support.node.proxy). Cost: the plugin
                    # turns on net.ipv4.ip_forward for the whole machine.
                    "isGateway": True,
                    "isDefaultGateway": True,
                    # No masquerade: pods here reach nothing beyond this machine (the API and
                    # the tests' servers are on it), and their own addresses in its logs say who.
                    "ipMasq": False,
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": self.subnet}]],
                        "dataDir": str(self.cni_data_dir),
                    },
                },
                # portmap (hostPort) is built but not chained: no test uses a hostPort.
                # loopback is not listed: containerd brings up each pod's lo with it by itself.
            ],
        }

    def start(self, timeout: float = 60.0) -> None:
        for directory in ("root", "state", "tmp"):
            (self.workdir / directory).mkdir(parents=True, exist_ok=True)
        self.cni_conf_dir.mkdir(parents=True, exist_ok=True)
        self.cni_data_dir.mkdir(parents=True, exist_ok=True)
        (self.cni_conf_dir / "10-gpuopnode.conflist").write_text(json.dumps(self.cni_config(), indent=1))
        config = self.workdir / "containerd.toml"
        config.write_text(self.config())
        missing = [name for name in CNI_PLUGIN_NAMES if not (self.binaries.cni_dir / name).is_file()]
        if missing:
            raise RuntimeError(f"CNI plugins missing from {self.binaries.cni_dir}: {missing}")
        # containerd finds containerd-shim-runc-v2 on PATH.
        path = f"{self.binaries.runtime}:{os.environ.get('PATH', '/usr/bin:/bin')}"
        self.process = spawn(
            "containerd",
            [str(self.binaries.path("containerd")), f"--config={config}", "--log-level=info"],
            self.workdir / "containerd.log",
            env={**os.environ, "PATH": path},
        )
        process = self.process
        wait_until(lambda: self.socket.exists() and self.ctr("version", check=False).returncode == 0,
                   timeout, "containerd answering on its socket", process)  # fmt: skip

    def ctr(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """``ctr`` against this containerd, in the CRI's namespace (k8s.io)."""
        result = subprocess.run(
            [str(self.binaries.path("ctr")), f"--address={self.socket}", "--namespace=k8s.io", *args],
            capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        if check and result.returncode != 0:
            raise RuntimeError(f"ctr {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
        return result

    def import_images(self, archives: list[images.ImageArchive], timeout: float = 60) -> float:
        """Import (and unpack for overlayfs) each archive, each within ``timeout`` seconds (the
        node's own images and the monitoring suite's); the seconds it took. The layers leave the content
        store once unpacked (no pod here pulls or pushes them): the disk holds an image once,
        not twice (ctr does that only with --local, the import run in ctr, not through
        containerd's transfer service)."""
        started = time.monotonic()
        for archive in archives:
            self.ctr("images", "import", "--platform=linux/amd64", "--local", "--discard-unpacked-layers", str(archive.path),
                     timeout=timeout)  # fmt: skip
            listed = self.ctr("images", "ls", "-q").stdout.split()
            if archive.name not in listed:
                raise RuntimeError(f"{archive.path} imported but {archive.name} not listed: {listed}")
        return time.monotonic() - started

    def pull(self, reference: str, layers: list[str], timeout: float = 600) -> float:
        """Pull ``reference`` from its registry (one :meth:`trust` named) into the CRI's namespace
        and unpack it for overlayfs, then drop its ``layers`` (their digests) from the content
        store, as the CRI's ``discard_unpacked_layers`` does: the node holds the image once. A
        pod then finds it as one loaded before the kubelet started (``kind load``'s way), so
        the kubelet never pulls it; the seconds it took."""
        started = time.monotonic()
        self.ctr("images", "pull", "--local", f"--hosts-dir={self.registry_hosts}", "--platform=linux/amd64",
                 reference, timeout=timeout)  # fmt: skip
        self.ctr("content", "rm", *layers, check=False)
        return time.monotonic() - started

    def running_tasks(self) -> list[str]:
        """The ids of the tasks (pod sandboxes and containers) still running or paused."""
        lines = self.ctr("tasks", "ls", check=False).stdout.splitlines()[1:]
        return [line.split()[0] for line in lines if line.split() and line.split()[-1] != "STOPPED"]

    def remove_everything(self) -> None:
        """Kill and delete whatever tasks and containers remain (the kubelet is gone by now)."""
        for task in self.ctr("tasks", "ls", "-q", check=False).stdout.split():
            self.ctr("tasks", "kill", "--signal=SIGKILL", task, check=False)
            self.ctr("tasks", "delete", "--force", task, check=False)
        containers = self.ctr("containers", "ls", "-q", check=False).stdout.split()
        if containers:
            self.ctr("containers", "delete", *containers, check=False)

    def discard_store(self) -> None:
        """Delete the images and snapshots (once stopped and unmounted): gigabytes with the
        trainer image, which pytest's kept temporary directories would otherwise hold on to."""
        shutil.rmtree(self.store, ignore_errors=True)

    def stop(self, grace: float = 10.0) -> None:
        if self.process is not None:
            self.process.stop(grace)
            self.process = None
