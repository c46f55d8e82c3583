"""What a node leaves on the machine, found and removed: mounts, cgroups, network links, the
kubelet's log symlinks, processes.

A node owns exactly these, each recognisable as its own: every path under its work directory
(mounts, and the network namespaces containerd mounts there), its cgroup root
``/sys/fs/cgroup/<hierarchy>/gpuopnode-<ident>`` in every hierarchy, its bridge
``gpuopnode-<ident>`` and the veths enslaved to it, the processes whose command line names its
work directory (containerd's shims), and the symlinks the kubelet makes in /var/log/containers
(a path it does not let anyone configure) that point into its work directory.
:class:`Footprint` is what :meth:`support.node.node.Node.stop` must bring to nothing, and what
the tests check it did.

A session killed outright (SIGKILL, a CI job's time limit, a closed terminal) stops no node: its
daemons die with it (PR_SET_PDEATHSIG), but mounts, cgroups, the bridge and each node's images
(about 5 GB a node, unpacked) stay. Two such sessions once left 21 GB in /tmp and the next
`make test` could not import its images. So a running node keeps a :class:`Claim` in
:data:`CLAIMS`, and the next node to start on the machine sweeps the nodes of every claim whose
owner is gone (:func:`sweep_orphans`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import ipaddress
import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from support.node.process import kill_all, processes_naming, start_time

CGROUP_MOUNT: Final = Path("/sys/fs/cgroup")
CONTAINER_LOG_LINKS: Final = Path("/var/log/containers")  # the kubelet's, fixed in its code
# Directories that every containerd, CNI plugin chain or kubelet on the machine shares, their
# paths fixed in code: the shims' sockets (containerd), libcni's result cache (go-cni sets no
# other), and the kubelet's device-plugin registration socket (pluginapi.DevicePluginPath).
SHARED_DIRECTORIES: Final = (
    Path("/run/containerd/s"),
    Path("/var/lib/cni/results"),
    Path("/var/lib/kubelet/device-plugins"),
)


def _unescape(path: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal (\\040...)."""
    return path.encode().decode("unicode_escape") if "\\" in path else path


def mounts_under(directory: Path) -> list[str]:
    """Mount points at or below ``directory`` (from this process's mountinfo), deepest last."""
    prefix = str(directory.resolve())
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = _unescape(line.split()[4])
        if point == prefix or point.startswith(prefix + "/"):
            found.append(point)
    return found


def unmount_all_under(directory: Path) -> list[str]:
    """Unmount everything at or below ``directory``, deepest first; what had to be unmounted."""
    left = mounts_under(directory)
    for point in sorted(set(left), key=len, reverse=True):
        if subprocess.run(["umount", point], capture_output=True).returncode != 0:
            subprocess.run(["umount", "--lazy", point], capture_output=True)  # busy: detach now, free later
    return left


def hierarchies() -> list[Path]:
    """The cgroup hierarchies mounted under /sys/fs/cgroup (v1 controllers, name=systemd, and the
    hybrid layout's cgroup2 ``unified``), or /sys/fs/cgroup itself on a pure cgroup2 machine."""
    if (CGROUP_MOUNT / "cgroup.controllers").exists():
        return [CGROUP_MOUNT]
    return sorted(path for path in CGROUP_MOUNT.iterdir() if path.is_dir() and not path.is_symlink())


def create_cgroup_root(name: str) -> None:
    """``/<name>`` in every hierarchy, for the kubelet's ``cgroupRoot`` (it refuses a root that
    does not exist). A new cpuset group starts with no CPUs and no memory nodes, and a child of
    it could run nothing: copy the parent's, as the kernel would with clone_children."""
    for hierarchy in hierarchies():
        group = hierarchy / name
        group.mkdir(exist_ok=True)
        for knob in ("cpuset.cpus", "cpuset.mems"):
            if (group / knob).exists() and not (group / knob).read_text().strip():
                (group / knob).write_text((hierarchy / knob).read_text())


def cgroups_under(name: str) -> list[Path]:
    """Every cgroup directory at or below ``/<name>`` in every hierarchy, deepest last."""
    found = []
    for hierarchy in hierarchies():
        root = hierarchy / name
        if root.is_dir():
            found += [Path(walked[0]) for walked in os.walk(root)]
    return found


def remove_cgroup_tree(name: str, timeout: float = 10.0) -> list[Path]:
    """Kill what still runs in ``/<name>`` and remove its groups, deepest first; what was there.
    A group that just lost its last process can refuse rmdir for a moment (EBUSY): retried."""
    left = cgroups_under(name)
    pids = set()
    for group in left:
        with contextlib.suppress(OSError):
            pids |= {int(pid) for pid in (group / "cgroup.procs").read_text().split()}
    kill_all(sorted(pids))
    deadline = time.monotonic() + timeout
    while True:
        remaining = cgroups_under(name)
        for group in sorted(remaining, key=lambda path: len(path.parts), reverse=True):
            with contextlib.suppress(OSError):
                group.rmdir()
        if not cgroups_under(name) or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def links() -> list[dict[str, str]]:
    """The machine's network links: [{"name", "kind", "master"}] (kind "bridge", "veth"...)."""
    output = subprocess.run(["ip", "-json", "-details", "link", "show"], capture_output=True, text=True,
                            check=True).stdout  # fmt: skip
    return [
        {"name": link["ifname"], "kind": link.get("linkinfo", {}).get("info_kind", ""),
         "master": link.get("master", "")}
        for link in json.loads(output)
    ]  # fmt: skip


def create_bridge(name: str, subnet: str) -> None:
    """The node's bridge, up, with the subnet's first address (the CNI bridge plugin's gateway,
    which it would make on the first pod): its route claims the subnet at once, so a second
    node started before any pod runs on the first does not pick the same one."""
    gateway = f"{ipaddress.ip_network(subnet)[1]}/{ipaddress.ip_network(subnet).prefixlen}"
    for command in (["ip", "link", "add", "name", name, "type", "bridge"],
                    ["ip", "addr", "add", gateway, "dev", name],
                    ["ip", "link", "set", name, "up"]):  # fmt: skip
        subprocess.run(command, check=True, capture_output=True)


def links_of(bridge: str) -> list[str]:
    """The bridge itself (when it exists) and every link enslaved to it."""
    return [link["name"] for link in links() if bridge in (link["name"], link["master"])]


def delete_links(names: list[str]) -> None:
    for name in names:
        subprocess.run(["ip", "link", "delete", name], capture_output=True)


def log_links_into(directory: Path) -> list[Path]:
    """The kubelet's /var/log/containers symlinks that point into ``directory``."""
    prefix = str(directory.resolve()) + "/"
    if not CONTAINER_LOG_LINKS.is_dir():
        return []
    found = []
    for link in CONTAINER_LOG_LINKS.iterdir():
        with contextlib.suppress(OSError):
            if link.is_symlink() and os.readlink(link).startswith(prefix):
                found.append(link)
    return found


def missing_shared_directories() -> list[Path]:
    """The :data:`SHARED_DIRECTORIES`, and those of their parents, that do not exist yet."""
    missing = []
    for directory in SHARED_DIRECTORIES:
        for path in (directory, *directory.parents):
            if path.exists():
                break
            missing.append(path)
    return missing


def listening_socket_paths() -> set[str]:
    """The paths of the machine's bound unix sockets (from /proc/net/unix)."""
    lines = Path("/proc/net/unix").read_text().splitlines()[1:]
    return {fields[7] for line in lines if len(fields := line.split()) > 7}


def dead_sockets_in_shared_directories() -> list[Path]:
    """Socket files in :data:`SHARED_DIRECTORIES` that no process listens on any more."""
    live = listening_socket_paths()
    return [
        entry
        for directory in SHARED_DIRECTORIES
        if directory.is_dir()
        for entry in directory.iterdir()
        if entry.is_socket() and str(entry) not in live
    ]


# What a kubelet's device manager writes beside its socket once a device plugin registers (the
# stand-in GPUs), with no kubelet left to read it.
DEVICE_CHECKPOINT: Final = Path("/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint")


def remove_dead_sockets_and_empty(directories: list[Path]) -> None:
    """Remove the dead sockets of :data:`SHARED_DIRECTORIES` (a kubelet leaves its
    device-plugin socket behind), then each of ``directories`` that is empty, deepest first;
    the device manager's checkpoint goes too once no kubelet's socket is left beside it."""
    for socket_path in dead_sockets_in_shared_directories():
        socket_path.unlink(missing_ok=True)
    plugins = DEVICE_CHECKPOINT.parent
    if (
        plugins in directories
        and plugins.is_dir()
        and not any(entry.is_socket() for entry in plugins.iterdir())
    ):
        DEVICE_CHECKPOINT.unlink(missing_ok=True)
    for directory in sorted(directories, key=lambda path: len(path.parts), reverse=True):
        with contextlib.suppress(OSError):  # not empty: another node's, or something else's
            directory.rmdir()


@dataclass
class Footprint:
    """What of one node is on the machine right now."""

    processes: dict[int, str] = field(default_factory=dict)
    mounts: list[str] = field(default_factory=list)
    cgroups: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)
    log_links: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, workdir: Path, cgroup_root: str, bridge: str) -> Footprint:
        return cls(
            processes=processes_naming(str(workdir)),
            mounts=mounts_under(workdir),
            cgroups=[str(path) for path in cgroups_under(cgroup_root)],
            links=links_of(bridge),
            log_links=[str(path) for path in log_links_into(workdir)],
        )

    def summary(self) -> str:
        """Counts, and the links by name: the full lists run to dozens of cgroup paths."""
        return (f"{len(self.processes)} processes, {len(self.mounts)} mounts, {len(self.cgroups)} cgroups, "
                f"links {self.links}, {len(self.log_links)} log links")  # fmt: skip

    def empty(self) -> bool:
        return not (self.processes or self.mounts or self.cgroups or self.links or self.log_links)


def sweep(workdir: Path, cgroup_root: str, bridge: str) -> None:
    """A stopped node's footprint removed by force: the processes naming its work directory
    (containerd's shims), its mounts, cgroups, bridge with its veths, and log links. The files
    under its work directory stay (the caller decides which go)."""
    kill_all(sorted(processes_naming(str(workdir))))
    unmount_all_under(workdir)
    remove_cgroup_tree(cgroup_root)
    delete_links(links_of(bridge))
    for link in log_links_into(workdir):
        link.unlink(missing_ok=True)


# -- the nodes of sessions that died ---------------------------------------------------------

# One JSON file a running node: machine-wide, not in a checkout or a cache, as bridges and
# cgroups are, so that another checkout's session finds them too.
CLAIMS: Final = Path("/var/lib/gpuop-nodes")


@dataclass(frozen=True)
class Claim:
    """A running node's footprint, its image store (the gigabytes), and the process it belongs
    to: pid and start time, so that a pid the kernel has given to another process since is not
    taken for the owner."""

    ident: str
    workdir: str
    cgroup_root: str
    bridge: str
    store: str
    pid: int
    started: int

    def owner_alive(self) -> bool:
        return start_time(self.pid) == self.started


def claim(ident: str, workdir: Path, cgroup_root: str, bridge: str, store: Path) -> None:
    """Record a node as this process's, before it makes anything on the machine."""
    me = os.getpid()
    record = Claim(ident, str(workdir.resolve()), cgroup_root, bridge, str(store.resolve()), me,
                   start_time(me) or 0)  # fmt: skip
    CLAIMS.mkdir(parents=True, exist_ok=True)
    staging = CLAIMS / f".{ident}.{me}"
    staging.write_text(json.dumps(dataclasses.asdict(record)))
    staging.rename(CLAIMS / f"{ident}.json")  # whole or not at all: a sweep never reads half


def release(ident: str) -> None:
    """The node is gone from the machine: forget its claim."""
    (CLAIMS / f"{ident}.json").unlink(missing_ok=True)


def sweep_orphans() -> list[Claim]:
    """Sweep the node of every claim whose owner is gone, and delete its image store (its logs
    stay, for whoever looks into why its session died); the claims swept. A claim whose sweep
    leaves a mount is kept, to be tried again. Under a lock: two sessions starting at once
    sweep each orphan once."""
    if not CLAIMS.is_dir():
        return []
    swept = []
    with (CLAIMS / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for path in sorted(CLAIMS.glob("*.json")):
            try:
                orphan = Claim(**json.loads(path.read_text()))
            except (OSError, ValueError, TypeError):
                continue  # not ours to judge: a file someone else put there
            if orphan.owner_alive():
                continue
            workdir = Path(orphan.workdir)
            sweep(workdir, orphan.cgroup_root, orphan.bridge)
            if mounts_under(workdir):  # never delete through a mount left behind
                continue
            shutil.rmtree(orphan.store, ignore_errors=True)
            path.unlink(missing_ok=True)
            swept.append(orphan)
        if swept:
            remove_dead_sockets_and_empty([])  # their kubelets' device-plugin sockets
    return swept
