"""A TEST DOUBLE of kubelet + container runtime (and of the scheduler's binding), for the local
end-to-end suite. Not a product feature, never shipped: it lets the real control plane and the
real Kubeflow training-operator run pods on a machine without Docker or kind.

What it does, as a kubelet would:

- registers Nodes with the capacity it is given (cpu, memory, pods and ``nvidia.com/gpu``, so
  GPU specs schedule) and keeps their Lease and Ready condition fresh;
- binds each unscheduled pod to a node its requests fit (cpu, memory, GPUs; init containers
  counted as the scheduler counts them) and its nodeSelector matches; a pod that fits nowhere
  gets ``PodScheduled=False, Unschedulable`` as kube-scheduler would write it;
- runs every pod in a network namespace of its own (a veth on one bridge, its own IP as
  ``status.podIP``), so each pod can listen on the metrics and rendezvous ports; the host
  reaches pods through the bridge, so the API server's pod proxy and the operator's scrapes work;
- resolves names as cluster DNS would for what these pods need: each pod's /etc/hosts maps its
  own hostname and every selector Service of its namespace (short name and
  ``name.ns.svc.cluster.local``) to the IPs of the pods it selects, and a pod with hostname and
  subdomain (JobSet's) as ``hostname.subdomain``, rewritten in place as pods come and go;
- builds each container's command, args and env by Kubernetes' rules: ``$(VAR)`` expansion from
  the env defined earlier, ``$$`` escapes, fieldRef, resourceFieldRef, configMapKeyRef,
  secretKeyRef and envFrom;
- gives each container a root of its own (a tmpfs whose top-level directories are bind mounts
  of the host's, so the project's venv is there) with the pod's volumes at their mountPaths:
  emptyDir as a directory of the pod, ``medium: Memory`` as a tmpfs of its sizeLimit, a PVC as
  a directory per claim shared by every pod that mounts it (as ReadWriteMany), and the
  termination message file at terminationMessagePath;
- runs init containers in order, then the containers; runs them as runAsUser/runAsGroup with
  fsGroup, no new privileges and no capabilities when the security context says so;
- reports phase, conditions and container statuses (running; terminated with exit code,
  reason and the termination message, or the log's tail for FallbackToLogsOnError;
  restartCount and lastState), restarts containers in place per restartPolicy with a doubling
  back-off, and on deletion sends SIGTERM, waits the grace period, then SIGKILLs the container's
  whole process group and removes the pod.

What it does not do, and why that is acceptable here: the image is ignored (every command
runs on this host, with the project's venv first on PATH; a command the host lacks, like the
training-operator init container's ``nslookup``, comes from a small shim directory that answers
from the pod's /etc/hosts); there are no cgroups (memory limits are not enforced, no OOM kills),
no probes (a running container is ready), no service environment variables (our pods set
``enableServiceLinks: false``), no image pulls, no PID namespace, and ``kubectl logs`` does not
work (each attempt's log is a file under the agent's directory: :meth:`NodeAgent.log`).
Needs root (network and mount namespaces).
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import ipaddress
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from gpuop._kits.quantity import parse_quantity
from support.paths import ROOT
from support.plane.cluster import Api, HttpError

AGENT_NAME: Final = "gpuop-node-agent"
STAMP: Final = "%Y-%m-%dT%H:%M:%SZ"
TERMINATION_MESSAGE_LIMIT: Final = 4096  # bytes, as kubelet reads it
LOG_FALLBACK_LINES: Final = 80
DEVICES: Final = ("null", "zero", "full", "random", "urandom", "tty")

Say = Callable[[str], None]


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime(STAMP)


def _run(*command: str) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {result.stderr.strip()}")


# -- quantities and env ----------------------------------------------------------------------


def quantity(value: str | int) -> float:
    """A Kubernetes quantity as a number (cpu in cores, memory in bytes), by the operator's parser."""
    return float(parse_quantity(value))


def expand(text: str, values: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: a defined name is replaced, an undefined one is left as
    written, ``$$`` is one literal ``$``, and any other ``$`` stays."""
    out, i = [], 0
    while i < len(text):
        if text.startswith("$$", i):
            out.append("$")
            i += 2
        elif text.startswith("$(", i) and (end := text.find(")", i + 2)) != -1:
            name = text[i + 2 : end]
            out.append(values[name] if name in values else text[i : end + 1])
            i = end + 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def _field(pod: Mapping[str, Any], path: str) -> str:
    meta, spec, status = pod["metadata"], pod["spec"], pod.get("status", {})
    if match := re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path):
        return str(meta.get(match.group(1), {}).get(match.group(2), ""))
    fields = {
        "metadata.name": meta["name"], "metadata.namespace": meta["namespace"], "metadata.uid": meta["uid"],
        "spec.nodeName": spec.get("nodeName", ""), "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": status.get("podIP", ""), "status.hostIP": status.get("hostIP", ""),
    }  # fmt: skip
    if path not in fields:
        raise ValueError(f"fieldRef {path!r} is not supported by the node agent")
    return str(fields[path])


# -- the pod network ---------------------------------------------------------------------------


class PodNetwork:
    """One bridge with the host's address on it, and a network namespace + veth per pod."""

    def __init__(self) -> None:
        self.tag = f"{os.getpid() % 10000:04d}{random.randrange(100):02d}"
        self.bridge = f"gpuopbr{self.tag}"
        taken = subprocess.run(["ip", "-o", "route"], capture_output=True, text=True).stdout
        for _ in range(100):
            subnet = ipaddress.ip_network(f"10.{random.randrange(200, 250)}.{random.randrange(256)}.0/24")
            if str(subnet) not in taken:
                break
        self.subnet = subnet
        hosts = list(subnet.hosts())
        self.host_ip = str(hosts[0])
        self._free = [str(ip) for ip in hosts[1:]]
        self._lock = threading.Lock()
        self.namespaces: set[str] = set()

    def create(self) -> None:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.host_ip}/{self.subnet.prefixlen}", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")

    def attach(self, key: str) -> tuple[str, str]:
        """A namespace for one pod: (netns name, its IP)."""
        with self._lock:
            ip = self._free.pop(0)
        netns, host_end = f"gpuop-{self.tag}-{key}", f"gv{self.tag}{key}"[:15]
        _run("ip", "netns", "add", netns)
        self.namespaces.add(netns)
        _run("ip", "link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", netns)
        _run("ip", "link", "set", host_end, "master", self.bridge, "up")
        _run("ip", "-n", netns, "addr", "add", f"{ip}/{self.subnet.prefixlen}", "dev", "eth0")
        _run("ip", "-n", netns, "link", "set", "eth0", "up")
        _run("ip", "-n", netns, "link", "set", "lo", "up")
        _run("ip", "-n", netns, "route", "add", "default", "via", self.host_ip)
        return netns, ip

    def detach(self, netns: str, ip: str) -> None:
        with contextlib.suppress(RuntimeError):
            _run("ip", "netns", "del", netns)  # takes the veth pair with it
        self.namespaces.discard(netns)
        with self._lock:
            self._free.append(ip)

    def close(self) -> None:
        for netns in list(self.namespaces):
            with contextlib.suppress(RuntimeError):
                _run("ip", "netns", "del", netns)
        with contextlib.suppress(RuntimeError):
            _run("ip", "link", "del", self.bridge)


# -- one container's root and process ------------------------------------------------------------


def _shim_directory(root: Path) -> Path:
    """Commands the images have and this host may not, answered from the pod's /etc/hosts."""
    shims = root / "shims"
    shims.mkdir(parents=True, exist_ok=True)
    nslookup = shims / "nslookup"
    nslookup.write_text(
        textwrap.dedent("""\
        #!/bin/sh
        # node agent shim: resolves like nslookup, from /etc/hosts (the pod's cluster DNS here)
        name="$1"
        found=$(getent hosts "$name") || { echo "** server can't find $name: NXDOMAIN"; exit 1; }
        echo "Name: $name"; echo "$found" | awk '{print "Address: " $1}'
        """)
    )
    nslookup.chmod(0o755)
    return shims


SHIMS_IN_CONTAINER: Final = "/.node-agent/bin"
SKIPPED_TOP: Final = frozenset({"dev", "proc", "sys", "tmp", "lost+found"})  # a container gets its own


def _exposed_tree(needed: list[Path]) -> list[tuple[str, str]]:
    """What of the host a container root shows: ("bind", "/usr") for each top-level directory
    anyone may enter, ("link", "/bin\0usr/bin") for top-level links, then ("expose", path) for
    each ``needed`` path (the interpreter, the venv, the work tree) not already visible: under
    a 0700 /root, or under /tmp, which is the pod's own."""
    entries = []
    for entry in sorted(Path("/").iterdir()):
        if entry.name in SKIPPED_TOP or entry.name.startswith("."):
            continue
        if entry.is_symlink():
            entries.append(("link", f"{entry}\0{os.readlink(entry)}"))
        elif entry.is_dir() and entry.stat().st_mode & 0o001:
            entries.append(("bind", str(entry)))
    shown = {Path(value) for kind, value in entries if kind == "bind"}
    for path in sorted(set(needed), key=lambda p: len(p.parts)):  # a parent first: it covers its children
        if not any(path.is_relative_to(visible) for visible in shown):
            entries.append(("expose", str(path)))
            shown.add(path)
    return entries


@dataclass
class ContainerRun:
    """One attempt of one container: its process and where its output goes."""

    name: str
    process: subprocess.Popen[bytes]
    log: Path
    termination_log: Path
    started_at: str
    message_policy: str

    def exit_code(self) -> int | None:
        code = self.process.poll()
        if code is None:
            return None
        return 128 - code if code < 0 else code  # killed by a signal: 128 + its number

    def kill_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, sig)

    def termination_message(self, code: int) -> str:
        with contextlib.suppress(OSError):
            text = self.termination_log.read_bytes()[:TERMINATION_MESSAGE_LIMIT].decode(errors="replace")
            if text:
                return text
        if code != 0 and self.message_policy == "FallbackToLogsOnError":
            with contextlib.suppress(OSError):
                lines = self.log.read_text(errors="replace").splitlines()[-LOG_FALLBACK_LINES:]
                return "\n".join(lines)[-2048:]
        return ""


class ContainerLauncher:
    """Starts a container of a pod: network namespace, UTS namespace (hostname = pod name), a
    private mount namespace with the container's root, then the command as the pod's user."""

    def __init__(self, venv_bin: Path, shims: Path) -> None:
        self.venv_bin = venv_bin
        self.shims = shims
        # The interpreter, the venv, and the work tree: the venv's editable install imports
        # gputrain and gpuop from it (a clean clone under /tmp found the work tree missing).
        needed = [Path(p).resolve() for p in (sys.base_prefix, sys.prefix, venv_bin, ROOT)]
        self.tree = _exposed_tree(needed)

    def path(self) -> str:
        return f"{SHIMS_IN_CONTAINER}:{self.venv_bin}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

    def script(self, root: Path, pod_dir: Path, hostname: str, mounts: list[tuple[str, str, str, bool]],
               termination: tuple[Path, str], user: list[str], workdir: str) -> str:  # fmt: skip
        """The shell that builds the root in the new mount namespace and execs the command.
        ``mounts``: (kind, source, mountPath, readOnly) with kind "bind" or "tmpfs"."""
        q = shlex.quote
        r = q(str(root))
        lines = ["set -eu", f"mount -t tmpfs -o mode=0755,size=64m ctr-root {r}"]
        for kind, value in self.tree:
            if kind == "link":
                name, target = value.split("\0")
                lines.append(f"ln -s {q(target)} {r}{q(name)}")
            elif kind == "bind":
                lines += [f"mkdir -p {r}{q(value)}", f"mount --rbind {q(value)} {r}{q(value)}"]
        lines += [f"mkdir {r}/dev {r}/proc {r}/sys {r}/tmp",
                  f"mount --bind {q(str(pod_dir / 'tmp'))} {r}/tmp"]  # fmt: skip
        for kind, value in self.tree:  # after /tmp: a work tree under /tmp shows inside the pod's
            if kind == "expose":
                lines += [f"mkdir -p {r}{q(value)}", f"mount --rbind {q(value)} {r}{q(value)}"]
        lines += [f"mkdir -p {r}{SHIMS_IN_CONTAINER}", f"mount --bind {q(str(self.shims))} {r}{SHIMS_IN_CONTAINER}",
                  f"mount -t tmpfs -o mode=0755,size=1m ctr-dev {r}/dev"]  # fmt: skip
        for device in DEVICES:
            lines += [f"touch {r}/dev/{device}", f"mount --bind /dev/{device} {r}/dev/{device}"]
        lines += [
            f"ln -s /proc/self/fd {r}/dev/fd", f"ln -s /proc/self/fd/0 {r}/dev/stdin",
            f"ln -s /proc/self/fd/1 {r}/dev/stdout", f"ln -s /proc/self/fd/2 {r}/dev/stderr",
            f"mkdir {r}/dev/shm", f"mount -t tmpfs -o mode=1777,size=64m ctr-shm {r}/dev/shm",
            f"mount --rbind /proc {r}/proc", f"mount --rbind /sys {r}/sys",
            f"mount --bind {q(str(pod_dir / 'hosts'))} {r}/etc/hosts",
            f"mount --bind {q(str(pod_dir / 'hostname'))} {r}/etc/hostname",
            f"mount --bind {q(str(pod_dir / 'resolv.conf'))} {r}/etc/resolv.conf",
        ]  # fmt: skip
        for kind, source, target, read_only in mounts:
            # Resolved inside the root, as a runtime does: /var/run is a link to /run, which
            # outside the root would put the mount on the host's /run, out of the pod's sight.
            lines.append(f"t={r}$(chroot {r} /usr/bin/realpath -m {q(target)})")
            t = '"$t"'
            lines.append(f"mkdir -p {t}")
            if kind == "tmpfs":
                lines.append(f"mount -t tmpfs -o mode=1777,size={int(float(source))} ctr-mem {t}")
            else:
                lines.append(f"mount --bind {q(source)} {t}")
            if read_only:
                lines.append(f"mount -o remount,bind,ro {t}")
        log_file, log_path = termination
        lines += [f"mkdir -p {r}{q(str(Path(log_path).parent))}", f"touch {r}{q(log_path)}",
                  f"mount --bind {q(str(log_file))} {r}{q(log_path)}",
                  f"hostname {q(hostname)}"]  # fmt: skip
        lines.append(f'exec chroot {r} {" ".join(q(u) for u in user)} /usr/bin/env -C {q(workdir)} -- "$@"')
        return "\n".join(lines)

    def start(self, netns: str, script: str, argv: list[str], env: Mapping[str, str], log: Path
              ) -> subprocess.Popen[bytes]:  # fmt: skip
        with log.open("ab") as out:
            return subprocess.Popen(
                ["ip", "netns", "exec", netns, "unshare", "--uts", "--", "/bin/sh", "-c", script, "sh", *argv],
                env=dict(env), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,  # the container's processes are one group: killed together
            )  # fmt: skip


def _user(pod_spec: Mapping[str, Any], container: Mapping[str, Any]) -> list[str]:
    """setpriv's arguments for the pod's and container's security context (nothing: root)."""
    pod_context, context = pod_spec.get("securityContext", {}), container.get("securityContext", {})
    uid = context.get("runAsUser", pod_context.get("runAsUser"))
    gid = context.get("runAsGroup", pod_context.get("runAsGroup", uid))
    if uid is None:
        return []
    groups = [g for g in [gid, pod_context.get("fsGroup"), *pod_context.get("supplementalGroups", [])]
              if g is not None]  # fmt: skip
    args = ["/usr/bin/setpriv", f"--reuid={uid}", f"--regid={gid}",
            f"--groups={','.join(str(g) for g in dict.fromkeys(groups))}"]  # fmt: skip
    if context.get("allowPrivilegeEscalation") is False:
        args.append("--no-new-privs")
    if "ALL" in context.get("capabilities", {}).get("drop", []):
        args += ["--inh-caps=-all", "--bounding-set=-all"]
    return [*args, "--"]


# -- one pod -----------------------------------------------------------------------------------


@dataclass
class ContainerState:
    restart_count: int = 0
    run: ContainerRun | None = None
    last_terminated: dict[str, Any] | None = None
    terminated: dict[str, Any] | None = None
    waiting: dict[str, Any] | None = None
    next_start: float = 0.0


def _request(spec: Mapping[str, Any], resource: str) -> float:
    def of(c: Mapping[str, Any]) -> float:
        resources = c.get("resources", {})
        value = resources.get("requests", {}).get(resource, resources.get("limits", {}).get(resource, 0))
        return quantity(value)

    main = sum(of(c) for c in spec.get("containers", []))
    return max([main, *(of(c) for c in spec.get("initContainers", []))])


@dataclass
class Node:
    name: str
    cpu: str = "4"
    memory: str = "8Gi"
    gpus: int = 0
    labels: dict[str, str] = field(default_factory=dict)

    def allocatable(self) -> dict[str, str]:
        found = {"cpu": self.cpu, "memory": self.memory, "pods": "110"}
        if self.gpus:
            found["nvidia.com/gpu"] = str(self.gpus)
        return found


class PodRuntime(threading.Thread):
    """Runs one pod until it ends or is deleted; reports its status."""

    def __init__(self, agent: NodeAgent, pod: dict[str, Any]) -> None:
        super().__init__(daemon=True, name=f"pod-{pod['metadata']['name']}")
        self.agent = agent
        self.pod = pod
        self.uid = pod["metadata"]["uid"]
        self.key = self.uid.replace("-", "")[:6]
        self.namespace, self.name = pod["metadata"]["namespace"], pod["metadata"]["name"]
        self.dir = agent.workdir / "pods" / f"{self.namespace}_{self.name}_{self.key}"
        self.netns = ""
        self.ip = ""
        self.started_at = _now()
        self.init_done = False
        self.init: dict[str, ContainerState] = {
            c["name"]: ContainerState() for c in self.spec.get("initContainers", [])
        }
        self.containers: dict[str, ContainerState] = {
            c["name"]: ContainerState() for c in self.spec["containers"]
        }
        self.deleted = threading.Event()
        self.gone = threading.Event()  # the object is no longer in the API
        self.reported: dict[str, Any] = {}
        self.volumes: dict[str, tuple[str, str]] = {}
        self.failure = ""

    @property
    def spec(self) -> dict[str, Any]:
        spec: dict[str, Any] = self.pod["spec"]
        return spec

    # The agent's loop hands over each new version of the pod.
    def update(self, pod: dict[str, Any]) -> None:
        self.pod = pod
        if pod["metadata"].get("deletionTimestamp"):
            self.deleted.set()

    def run(self) -> None:
        try:
            self._run()
        except Exception as exc:  # a defect of the double (or a pod it cannot run) shows on the pod
            if self._deleted_meanwhile(exc):
                # Deleted while being set up (a Kueue preemption can delete a pod within
                # milliseconds): a TokenRequest bound to it, or its status write, then 404s.
                # Kubelet just stops such a pod; so does the agent, and it is no defect.
                self.agent.say(f"pod {self.namespace}/{self.name}: deleted while starting")
                self._remove()
                return
            self.agent.say(f"pod {self.namespace}/{self.name}: {exc!r}")
            self.agent.errors.append(f"{self.namespace}/{self.name}: {exc!r}")
            self._stop_all(grace=0)
            self.failure = f"node agent: {exc}"
            with contextlib.suppress(Exception):
                self._report()
            while not (self.deleted.wait(0.5) or self.gone.is_set()):
                pass
            self._remove()
        finally:
            self._stop_all(grace=0)
            if self.netns:
                self.agent.network.detach(self.netns, self.ip)
            self.agent.forget(self.uid)

    def _deleted_meanwhile(self, exc: Exception) -> bool:
        """Whether ``exc`` came of the pod's deletion (it is gone or going), not of the agent."""
        if not isinstance(exc, HttpError) or exc.status != 404:
            return False
        if self.deleted.is_set() or self.gone.is_set():
            return True
        try:
            pod = self.agent.api.request("GET", f"/api/v1/namespaces/{self.namespace}/pods/{self.name}")
        except HttpError as again:
            return again.status == 404
        return pod["metadata"]["uid"] != self.uid or bool(pod["metadata"].get("deletionTimestamp"))

    def _run(self) -> None:
        self._prepare()
        self._report()
        while not self.deleted.is_set() and not self.gone.is_set():
            if not self.init_done:
                self._step_init()
            else:
                self._step_containers()
            self._report()
            self.deleted.wait(0.5 if self._phase() in ("Succeeded", "Failed") else 0.2)
        grace = self.pod["metadata"].get("deletionGracePeriodSeconds",
                                         self.spec.get("terminationGracePeriodSeconds", 30))  # fmt: skip
        self._stop_all(grace=float(grace))
        with contextlib.suppress(HttpError):
            self._report()
        self._remove()

    def _remove(self) -> None:
        """What kubelet does once a deleted pod's containers are gone: delete it for good."""
        if self.gone.is_set():
            return
        with contextlib.suppress(HttpError):
            self.agent.api.request(
                "DELETE", f"/api/v1/namespaces/{self.namespace}/pods/{self.name}",
                {"gracePeriodSeconds": 0, "preconditions": {"uid": self.uid}},
            )  # fmt: skip

    def _prepare(self) -> None:
        for sub in ("tmp", "volumes", "logs", "termination", "roots"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        (self.dir / "tmp").chmod(0o1777)
        self.netns, self.ip = self.agent.network.attach(self.key)
        self.pod.setdefault("status", {})["podIP"] = self.ip
        self.pod["status"]["hostIP"] = self.agent.network.host_ip
        (self.dir / "hostname").write_text(self.hostname + "\n")
        # Cluster DNS is the hosts file here; what it does not hold must fail at once, as CoreDNS
        # answers NXDOMAIN at once. The host's nameserver is not reachable from a pod's network,
        # and each lookup (c10d reverse-resolves every peer) would wait out its 10 s timeout;
        # nothing listens on port 53 of the bridge address, so the answer is an immediate refusal.
        (self.dir / "resolv.conf").write_text(
            f"nameserver {self.agent.network.host_ip}\n"
            f"search {self.namespace}.svc.cluster.local svc.cluster.local cluster.local\n"
            "options ndots:5 timeout:1 attempts:1\n"
        )
        self.agent.write_hosts(self)
        fs_group = self.spec.get("securityContext", {}).get("fsGroup")
        for volume in self.spec.get("volumes", []):
            self.volumes[volume["name"]] = self._volume(volume, fs_group)

    @property
    def hostname(self) -> str:
        return str(self.spec.get("hostname", self.name))

    def _volume(self, volume: Mapping[str, Any], fs_group: int | None) -> tuple[str, str]:
        if "emptyDir" in volume:
            empty = volume["emptyDir"] or {}
            if empty.get("medium") == "Memory":
                # tmpfs inside each container's mount namespace; sized as the sizeLimit says
                # (kubelet sizes it to the limit as well). Unlike kubelet's it does not outlive
                # a container restart, which nothing here relies on.
                return "tmpfs", str(quantity(empty.get("sizeLimit", "64Mi")))
            path = self.dir / "volumes" / volume["name"]
        elif "projected" in volume:
            path = self.dir / "volumes" / volume["name"]
            path.mkdir(parents=True, exist_ok=True)
            for source in volume["projected"].get("sources", []):
                for name, content in self._projection(source).items():
                    (path / name).write_text(content)
                    (path / name).chmod(0o644)
            return "bind", str(path)
        elif "secret" in volume or "configMap" in volume:
            # As kubelet mounts them: each key a file (a Secret's values decoded), read once.
            path = self.dir / "volumes" / volume["name"]
            path.mkdir(parents=True, exist_ok=True)
            kind, source = (
                ("secrets", volume["secret"]) if "secret" in volume else ("configmaps", volume["configMap"])
            )
            name = source.get("secretName") or source.get("name")
            found = self.agent.api.request("GET", f"/api/v1/namespaces/{self.namespace}/{kind}/{name}")
            for key, value in (found.get("data") or {}).items():
                data = base64.b64decode(value) if kind == "secrets" else str(value).encode()
                (path / key).write_bytes(data)
                (path / key).chmod(0o644)
            return "bind", str(path)
        elif "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]["claimName"]
            path = self.agent.workdir / "claims" / self.namespace / claim  # shared, as ReadWriteMany
        else:
            kinds = sorted(set(volume) - {"name"})
            raise ValueError(f"volume {volume['name']!r}: {kinds} is not supported by the node agent")
        path.mkdir(parents=True, exist_ok=True)
        path.chmod(0o2777)
        if fs_group is not None:
            os.chown(path, -1, int(fs_group))
        return "bind", str(path)

    def _projection(self, source: Mapping[str, Any]) -> dict[str, str]:
        """The files of one projected source (the service-account token volume's three kinds)."""
        if "serviceAccountToken" in source:
            token = source["serviceAccountToken"]
            account = self.spec.get("serviceAccountName", "default")
            request: dict[str, Any] = {
                "expirationSeconds": token.get("expirationSeconds", 3600),
                "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": self.name, "uid": self.uid},
            }
            if token.get("audience"):  # kubelet's rule: the source's audience, else the API server's
                request["audiences"] = [token["audience"]]
            reply = self.agent.api.request(
                "POST",
                f"/api/v1/namespaces/{self.namespace}/serviceaccounts/{account}/token",
                {"spec": request},
            )
            return {token["path"]: reply["status"]["token"]}
        if "configMap" in source:
            ref = source["configMap"]
            data = self.agent.api.request(
                "GET", f"/api/v1/namespaces/{self.namespace}/configmaps/{ref['name']}"
            )
            return {i["path"]: data.get("data", {})[i["key"]] for i in ref.get("items", [])}
        if "downwardAPI" in source:
            return {
                i["path"]: _field(self.pod, i["fieldRef"]["fieldPath"])
                for i in source["downwardAPI"]["items"]
            }
        raise ValueError(f"projected source {sorted(source)} is not supported by the node agent")

    # -- containers --

    def _env(self, container: Mapping[str, Any]) -> dict[str, str]:
        api = self.agent.api
        values: dict[str, str] = {}

        def lookup(kind: str, ref: Mapping[str, Any]) -> dict[str, str] | None:
            try:
                obj = api.request("GET", f"/api/v1/namespaces/{self.namespace}/{kind}/{ref['name']}")
            except HttpError as exc:
                if exc.status == 404 and ref.get("optional"):
                    return None
                raise
            data = dict(obj.get("data", {}))
            if kind == "secrets":
                data = {k: base64.b64decode(v).decode() for k, v in data.items()}
            return data

        for source in container.get("envFrom", []):
            for kind, key in (("configmaps", "configMapRef"), ("secrets", "secretRef")):
                if key in source and (data := lookup(kind, source[key])) is not None:
                    values.update({source.get("prefix", "") + k: v for k, v in data.items()})
        for var in container.get("env", []):
            if "valueFrom" not in var:
                values[var["name"]] = expand(var.get("value", ""), values)
                continue
            source = var["valueFrom"]
            if "fieldRef" in source:
                values[var["name"]] = _field(self.pod, source["fieldRef"]["fieldPath"])
            elif "resourceFieldRef" in source:
                ref = source["resourceFieldRef"]
                kind, resource = ref["resource"].split(".", 1)
                raw = container.get("resources", {}).get(kind, {}).get(resource, "0")
                divisor = quantity(ref.get("divisor", "1"))
                values[var["name"]] = str(max(1, int(-(-quantity(raw) // divisor))))
            else:
                for kind, key in (("configmaps", "configMapKeyRef"), ("secrets", "secretKeyRef")):
                    if key in source:
                        data = lookup(kind, source[key]) or {}
                        if source[key]["key"] in data:
                            values[var["name"]] = data[source[key]["key"]]
        return values

    def _start(self, container: Mapping[str, Any], state: ContainerState) -> None:
        name = container["name"]
        if not container.get("command"):
            state.waiting = {
                "reason": "CreateContainerError",
                "message": (
                    "node agent: the container has no command, and the test double does not know the image's entrypoint"
                ),
            }
            return
        user_env = self._env(container)
        env = {"PATH": self.agent.launcher.path(), "HOSTNAME": self.hostname, "HOME": "/tmp", **user_env}
        argv = [expand(a, env) for a in [*container["command"], *container.get("args", [])]]
        mounts = []
        for mount in container.get("volumeMounts", []):
            kind, source = self.volumes[mount["name"]]
            if kind == "bind" and mount.get("subPath"):
                source = str(Path(source) / mount["subPath"])
                Path(source).mkdir(parents=True, exist_ok=True)
            mounts.append((kind, source, mount["mountPath"], bool(mount.get("readOnly"))))
        attempt = state.restart_count
        log = self.dir / "logs" / f"{name}.{attempt}.log"
        termination = self.dir / "termination" / f"{name}.{attempt}"
        termination.write_bytes(b"")
        termination.chmod(0o666)
        root = self.dir / "roots" / f"{name}.{attempt}"
        root.mkdir()
        script = self.agent.launcher.script(
            root, self.dir, self.hostname, mounts,
            (termination, container.get("terminationMessagePath", "/dev/termination-log")),
            _user(self.spec, container), container.get("workingDir", "/"),
        )  # fmt: skip
        process = self.agent.launcher.start(self.netns, script, argv, env, log)
        state.run = ContainerRun(name, process, log, termination, _now(),
                                 container.get("terminationMessagePolicy", "File"))  # fmt: skip
        state.waiting = state.terminated = None

    def _finish(self, state: ContainerState, code: int) -> None:
        run = state.run
        assert run is not None
        run.kill_group(signal.SIGKILL)  # the runtime ends whatever the container left behind
        state.terminated = {
            "exitCode": code, "reason": "Completed" if code == 0 else "Error",
            "startedAt": run.started_at, "finishedAt": _now(), "containerID": f"gpuop-agent://{run.process.pid}",
        }  # fmt: skip
        if message := run.termination_message(code):
            state.terminated["message"] = message
        state.run = None

    def _backoff(self, state: ContainerState) -> None:
        delay = min(self.agent.backoff * 2 ** max(state.restart_count - 1, 0), self.agent.backoff_cap)
        state.next_start = time.monotonic() + delay
        state.waiting = {
            "reason": "CrashLoopBackOff",
            "message": f"back-off {delay:g}s restarting failed container",
        }

    def _may_start(self, state: ContainerState) -> bool:
        """Whether a container that is not running starts now (counting a restart when it ran
        before): never after CreateContainerError or an exit its restartPolicy keeps (init
        containers included: under Never a failed one is not run again), else once its back-off
        is over."""
        if state.terminated is not None and not self._restarts(state.terminated["exitCode"]):
            return False
        if state.waiting and state.waiting["reason"] == "CreateContainerError":
            return False
        if time.monotonic() < state.next_start:
            return False
        if state.terminated is not None:
            state.last_terminated, state.restart_count = state.terminated, state.restart_count + 1
        return True

    def _restarts(self, code: int) -> bool:
        policy = self.spec.get("restartPolicy", "Always")
        return policy == "Always" or (policy == "OnFailure" and code != 0)

    def _step_init(self) -> None:
        for container in self.spec.get("initContainers", []):
            state = self.init[container["name"]]
            if state.terminated and state.terminated["exitCode"] == 0:
                continue
            if state.run is None:
                if self._may_start(state):
                    self._start(container, state)
                return
            code = state.run.exit_code()
            if code is None:
                return
            self._finish(state, code)
            if code != 0:
                if self.spec.get("restartPolicy", "Always") == "Never":
                    return
                self._backoff(state)
            return
        self.init_done = True

    def _step_containers(self) -> None:
        for container in self.spec["containers"]:
            state = self.containers[container["name"]]
            if state.run is not None:
                code = state.run.exit_code()
                if code is None:
                    continue
                self._finish(state, code)
                if self._restarts(code):
                    self._backoff(state)
                continue
            if self._may_start(state):
                self._start(container, state)

    def _stop_all(self, grace: float) -> None:
        runs = [s.run for s in [*self.init.values(), *self.containers.values()] if s.run is not None]
        for run in runs:
            with contextlib.suppress(ProcessLookupError):
                run.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(run.process.poll() is None for run in runs):
            time.sleep(0.1)
        for state in [*self.init.values(), *self.containers.values()]:
            if state.run is not None:
                state.run.kill_group(signal.SIGKILL)
                state.run.process.wait()
                self._finish(state, state.run.exit_code() or 0)

    # -- status --

    def _phase(self) -> str:
        if self.failure:
            return "Failed"
        if not self.init_done:
            failed = any(s.terminated and s.terminated["exitCode"] != 0 for s in self.init.values())
            return "Failed" if failed and self.spec.get("restartPolicy", "Always") == "Never" else "Pending"
        states = list(self.containers.values())
        if any(s.run is not None for s in states):
            return "Running"
        if all(s.terminated is not None for s in states):
            codes = [s.terminated["exitCode"] for s in states if s.terminated is not None]
            if all(c == 0 for c in codes) and self.spec.get("restartPolicy", "Always") != "Always":
                return "Succeeded"
            if self.spec.get("restartPolicy", "Always") == "Never":
                return "Failed"
        return "Running" if any(s.restart_count for s in states) else "Pending"

    def _statuses(
        self, specs: list[dict[str, Any]], states: Mapping[str, ContainerState]
    ) -> list[dict[str, Any]]:
        out = []
        for container in specs:
            state = states[container["name"]]
            if state.run is not None:
                current: dict[str, Any] = {"running": {"startedAt": state.run.started_at}}
            elif state.waiting is not None:
                current = {"waiting": state.waiting}
            elif state.terminated is not None:
                current = {"terminated": state.terminated}
            else:
                current = {"waiting": {"reason": "PodInitializing"}}
            status: dict[str, Any] = {
                "name": container["name"], "image": container.get("image", ""), "imageID": "",
                "ready": state.run is not None, "started": state.run is not None,
                "restartCount": state.restart_count, "state": current,
                "lastState": {"terminated": state.last_terminated} if state.last_terminated else {},
            }  # fmt: skip
            if state.run is not None:
                status["containerID"] = f"gpuop-agent://{state.run.process.pid}"
            out.append(status)
        return out

    def _report(self) -> None:
        phase = self._phase()
        ready = phase == "Running" and all(s.run is not None for s in self.containers.values())
        conditions = [
            {"type": "PodReadyToStartContainers", "status": "True"},
            {"type": "Initialized", "status": str(self.init_done)},
            {"type": "ContainersReady", "status": str(ready)},
            {"type": "Ready", "status": str(ready)},
            {"type": "PodScheduled", "status": "True"},
        ]
        status = {
            "phase": phase, "podIP": self.ip, "podIPs": [{"ip": self.ip}], "hostIP": self.agent.network.host_ip,
            "hostIPs": [{"ip": self.agent.network.host_ip}], "startTime": self.started_at,
            "initContainerStatuses": self._statuses(self.spec.get("initContainers", []), self.init),
            "containerStatuses": self._statuses(self.spec["containers"], self.containers),
        }  # fmt: skip
        if self.failure:
            status.update(reason="NodeAgentError", message=self.failure)
        comparable = {**status, "conditions": conditions}
        if comparable == self.reported:
            return
        previous = {c["type"]: c for c in self.pod.get("status", {}).get("conditions", [])}
        for condition in conditions:
            old = previous.get(condition["type"])
            condition["lastTransitionTime"] = (
                old["lastTransitionTime"] if old and old.get("status") == condition["status"] and
                old.get("lastTransitionTime") else _now()
            )  # fmt: skip
        try:
            self.pod = self.agent.api.request(
                "PATCH", f"/api/v1/namespaces/{self.namespace}/pods/{self.name}/status",
                {"metadata": {"uid": self.uid}, "status": {**status, "conditions": conditions}},
                "application/merge-patch+json",
            )  # fmt: skip
            self.reported = comparable
        except HttpError as exc:
            if exc.status in (404, 409):
                self.gone.set()
            # other errors: the next step reports again


# -- the agent ---------------------------------------------------------------------------------


class NodeAgent:
    """Nodes, scheduling and pods for a control plane; :meth:`start` then :meth:`stop`."""

    def __init__(self, api: Api, workdir: Path, nodes: list[Node], say: Say | None = None,
                 backoff: float = 1.0, backoff_cap: float = 20.0) -> None:  # fmt: skip
        self.api = api
        self.workdir = workdir
        self.nodes = nodes
        self.say = say or (lambda message: print(f"node-agent: {message}", file=sys.stderr, flush=True))
        # Restart back-off: kubelet starts at 10 s and doubles to 5 min; a test waits less.
        self.backoff, self.backoff_cap = backoff, backoff_cap
        self.network = PodNetwork()
        self.launcher = ContainerLauncher(Path(sys.executable).parent, _shim_directory(workdir))
        self.pods: dict[str, PodRuntime] = {}
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="node-agent")
        self._last_heartbeat = 0.0
        self._last_error = ""
        self._services: list[dict[str, Any]] = []
        self._all_pods: list[dict[str, Any]] = []

    @property
    def host_ip(self) -> str:
        return self.network.host_ip

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.network.create()
        for node in self.nodes:
            self._register(node)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        with self._lock:
            runtimes = list(self.pods.values())
        for runtime in runtimes:
            runtime.gone.set()
            runtime.deleted.set()
        for runtime in runtimes:
            runtime.join(15)
        self.network.close()

    def forget(self, uid: str) -> None:
        with self._lock:
            self.pods.pop(uid, None)

    # -- nodes --

    def _register(self, node: Node) -> None:
        labels = {"kubernetes.io/hostname": node.name, "kubernetes.io/os": "linux",
                  "kubernetes.io/arch": "amd64", **node.labels}  # fmt: skip
        with contextlib.suppress(HttpError):
            self.api.request("POST", "/api/v1/nodes", {"metadata": {"name": node.name, "labels": labels}})
        self._node_status(node)

    def _node_status(self, node: Node) -> None:
        now = _now()
        self.api.request("PATCH", f"/api/v1/nodes/{node.name}/status", {"status": {
            "capacity": node.allocatable(), "allocatable": node.allocatable(),
            "addresses": [{"type": "InternalIP", "address": self.network.host_ip},
                          {"type": "Hostname", "address": node.name}],
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                            "message": f"{AGENT_NAME} is posting ready status",
                            "lastHeartbeatTime": now, "lastTransitionTime": now}],
            "nodeInfo": {"kubeletVersion": f"{AGENT_NAME}", "operatingSystem": "linux", "architecture": "amd64",
                         "containerRuntimeVersion": f"{AGENT_NAME}://processes"},
        }}, "application/merge-patch+json")  # fmt: skip
        lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                 "metadata": {"name": node.name, "namespace": "kube-node-lease"},
                 "spec": {"holderIdentity": node.name, "leaseDurationSeconds": 40,
                          "renewTime": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")}}  # fmt: skip
        path = "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases"
        try:
            self.api.request("PATCH", f"{path}/{node.name}", lease, "application/merge-patch+json")
        except HttpError as exc:
            if exc.status != 404:
                raise
            self.api.request("POST", path, lease)

    # -- the loop --

    def _loop(self) -> None:
        while not self._stop.is_set():
            for what, step in (("heartbeat", self._heartbeat), ("sync", self._sync)):
                try:
                    step()
                except Exception as exc:  # the API may blip; the next round tries again
                    if repr(exc) != self._last_error:
                        self.say(f"{what}: {exc!r}")
                    self._last_error = repr(exc)
            self._stop.wait(0.3)

    def _heartbeat(self) -> None:
        if time.monotonic() - self._last_heartbeat > 10:
            for node in self.nodes:
                self._node_status(node)
            self._last_heartbeat = time.monotonic()

    def _sync(self) -> None:
        pods = self.api.request("GET", "/api/v1/pods")["items"]
        self._services = self.api.request("GET", "/api/v1/services")["items"]
        self._all_pods = pods
        names = {node.name for node in self.nodes}
        seen = set()
        for pod in pods:
            spec = pod["spec"]
            if not spec.get("nodeName"):
                if spec.get("schedulerName", "default-scheduler") == "default-scheduler":
                    self._schedule(pod, pods)
                continue
            if spec["nodeName"] not in names:
                continue
            uid = pod["metadata"]["uid"]
            seen.add(uid)
            with self._lock:
                runtime = self.pods.get(uid)
                if runtime is None and pod.get("status", {}).get("phase") not in ("Succeeded", "Failed"):
                    runtime = self.pods[uid] = PodRuntime(self, pod)
                    runtime.start()
                    continue
            if runtime is not None:
                runtime.update(pod)
        with self._lock:
            runtimes = list(self.pods.values())
        for runtime in runtimes:
            if runtime.uid not in seen:
                runtime.gone.set()
                runtime.deleted.set()
            elif runtime.ip:  # its directory and address exist
                self.write_hosts(runtime)

    def _schedule(self, pod: dict[str, Any], pods: list[dict[str, Any]]) -> None:
        spec, meta = pod["spec"], pod["metadata"]
        if meta.get("deletionTimestamp") or pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
            return
        wanted = {r: _request(spec, r) for r in ("cpu", "memory", "nvidia.com/gpu")}
        reasons = []
        for node in self.nodes:
            if any(node.labels.get(k, {"kubernetes.io/os": "linux"}.get(k)) != v
                   for k, v in spec.get("nodeSelector", {}).items() if k != "kubernetes.io/hostname"):  # fmt: skip
                reasons.append("didn't match Pod's node affinity/selector")
                continue
            on_node = [p for p in pods if p["spec"].get("nodeName") == node.name
                       and p.get("status", {}).get("phase") not in ("Succeeded", "Failed")]  # fmt: skip
            free = {r: quantity(node.allocatable().get(r, "0")) - sum(_request(p["spec"], r) for p in on_node)
                    for r in wanted}  # fmt: skip
            short = [r for r in wanted if wanted[r] > free[r] + 1e-9]
            if short:
                reasons.append(f"Insufficient {short[0]}")
                continue
            with contextlib.suppress(HttpError):  # bound meanwhile, or deleted
                self.api.request("POST", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/binding", {
                    "apiVersion": "v1", "kind": "Binding", "metadata": {"name": meta["name"], "uid": meta["uid"]},
                    "target": {"apiVersion": "v1", "kind": "Node", "name": node.name},
                })  # fmt: skip
                pod["spec"]["nodeName"] = node.name  # later pods in this round see it taken
            return
        counted = {reason: reasons.count(reason) for reason in reasons}
        message = (
            f"0/{len(self.nodes)} nodes are available: "
            + ", ".join(f"{n} {r}" for r, n in counted.items())
            + "."
        )
        conditions = [c for c in pod.get("status", {}).get("conditions", []) if c["type"] == "PodScheduled"]
        if conditions and conditions[0].get("message") == message:
            return
        with contextlib.suppress(HttpError):
            self.api.request("PATCH", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status", {
                "status": {"conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                           "message": message, "lastTransitionTime": _now()}]},
            }, "application/strategic-merge-patch+json")  # fmt: skip

    # -- names --

    def write_hosts(self, runtime: PodRuntime) -> None:
        """The pod's /etc/hosts: itself, then every selector Service of its namespace."""
        lines = [
            "127.0.0.1\tlocalhost",
            "::1\tlocalhost ip6-localhost ip6-loopback",
            f"{runtime.ip}\t{runtime.hostname}",
        ]
        ns = runtime.namespace
        pods = [p for p in self._all_pods if p["metadata"]["namespace"] == ns and p.get("status", {}).get("podIP")
                and not p["metadata"].get("deletionTimestamp")]  # fmt: skip
        for service in self._services:
            if service["metadata"]["namespace"] != ns or not service["spec"].get("selector"):
                continue
            selector = service["spec"]["selector"]
            for pod in pods:
                labels = pod["metadata"].get("labels", {})
                if all(labels.get(k) == v for k, v in selector.items()):
                    name = service["metadata"]["name"]
                    lines.append(f"{pod['status']['podIP']}\t{name} {name}.{ns} {name}.{ns}.svc "
                                 f"{name}.{ns}.svc.cluster.local")  # fmt: skip
                    # A pod with hostname and subdomain (JobSet's, under its headless Service) is
                    # also <hostname>.<subdomain>[.<ns>[.svc[.cluster.local]]].
                    host = pod["spec"].get("hostname")
                    if host and pod["spec"].get("subdomain") == name:
                        own = f"{host}.{name}"
                        lines.append(f"{pod['status']['podIP']}\t{own} {own}.{ns} {own}.{ns}.svc "
                                     f"{own}.{ns}.svc.cluster.local")  # fmt: skip
        text = "\n".join(lines) + "\n"
        path = runtime.dir / "hosts"
        if path.exists() and path.read_text() == text:
            return
        # In place, not renamed: each container has this inode bind-mounted at /etc/hosts.
        with path.open("a+") as hosts:
            hosts.seek(0)
            hosts.truncate()
            hosts.write(text)

    # -- for tests --

    def runtime(self, namespace: str, name: str) -> PodRuntime | None:
        with self._lock:
            return next((r for r in self.pods.values() if (r.namespace, r.name) == (namespace, name)), None)

    def processes(self, namespace: str, name: str, container: str) -> list[int]:
        """The running container's processes: its main process first, then its descendants."""
        runtime = self.runtime(namespace, name)
        state = runtime.containers.get(container) if runtime else None
        if state is None or state.run is None:
            return []
        found, frontier = [state.run.process.pid], [state.run.process.pid]
        parents = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        while frontier:
            children = [pid for pid, parent in parents.items() if parent in frontier]
            found += children
            frontier = children
        return found

    def logs(self, namespace: str, name: str) -> str:
        """Every attempt's output of every container of the pods of that name, oldest first."""
        out = []
        for directory in sorted((self.workdir / "pods").glob(f"{namespace}_{name}_*")):
            for log in sorted((directory / "logs").glob("*.log"), key=lambda p: p.stat().st_mtime):
                out.append(f"--- {directory.name}/{log.name}\n{log.read_text(errors='replace')}")
        return "\n".join(out)


@contextlib.contextmanager
def running(api: Api, workdir: Path, nodes: list[Node], **kwargs: Any) -> Iterator[NodeAgent]:
    agent = NodeAgent(api, workdir, nodes, **kwargs)
    agent.start()
    try:
        yield agent
    finally:
        agent.stop()
