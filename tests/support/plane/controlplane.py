"""A real Kubernetes control plane on loopback: etcd, kube-apiserver, kube-controller-manager.

Built from their Go modules (``tests/controlplane/go.mod``: ``k8s.io/kubernetes`` and
``go.etcd.io/etcd/server/v3`` at pinned versions, go.sum committed) with the ordinary ``go``
client, once per machine: the binaries are cached outside the work tree, keyed by a hash of
go.mod and go.sum, so a version bump rebuilds and a second run starts in seconds.

The same code serves ``make controlplane`` (``python -m support.plane.controlplane up``: a detached
supervisor that owns the three processes until ``down``) and the session fixture of the
control-plane suite (:class:`ControlPlane` in the pytest process). Either way every child
gets ``PR_SET_PDEATHSIG``: when whatever started it dies, even by SIGKILL, the kernel kills
it too, so a crash or Ctrl-C leaves no orphan etcd or apiserver behind.

What makes it a real cluster's control plane rather than a test server: TLS with a CA of its
own, client certificates (the admin in ``system:masters``, the controller-manager as
``system:kube-controller-manager``), a service-account signing key (the TokenRequest API
works, tokens are verified), ``--authorization-mode=Node,RBAC`` and the default admission
chain plus NodeRestriction, as kubeadm configures them; the controller-manager runs every
default controller (garbage collector, namespace, service-account and token controllers...).
No kubelet and no scheduler: nothing here runs pods.

The oldest Kubernetes the docs claim gets a plane of its own (:func:`running` with
``oldest=True``): its kube-apiserver, built from ``tests/controlplane-oldest/go.mod``, on an
etcd of its own (the same build), driven by the same kubectl. No controller-manager runs beside it, as the one built
here is newer than that apiserver, and a controller-manager newer than its apiserver is outside
Kubernetes' version skew policy; the suites that run there need only the API server's own
judgement (validation, defaulting, admission).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import textwrap
import time
import traceback
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Final

from support.paths import ROOT
from support.plane import gobuild
from support.tls import CertificateAuthority, openssl

MODULE: Final = ROOT / "tests" / "controlplane"
# kube-apiserver at the oldest Kubernetes minor the docs claim (docs/architecture.md, Compatibility).
OLDEST_MODULE: Final = ROOT / "tests" / "controlplane-oldest"
STATE: Final = ROOT / ".controlplane"
# Binary name -> Go package (etcd's comes out as "server" and is renamed: see support.plane.gobuild).
PACKAGES: Final = {
    "kube-apiserver": "k8s.io/kubernetes/cmd/kube-apiserver",
    "kube-controller-manager": "k8s.io/kubernetes/cmd/kube-controller-manager",
    "kubectl": "k8s.io/kubernetes/cmd/kubectl",
    "etcd": "go.etcd.io/etcd/server/v3",
}
SERVICE_CIDR: Final = "10.96.0.0/16"
SERVICE_ACCOUNT_ISSUER: Final = "https://kubernetes.default.svc.cluster.local"

Say = Callable[[str], None]


def _say(message: str) -> None:
    print(f"controlplane: {message}", file=sys.stderr, flush=True)


# -- building -----------------------------------------------------------------------------


def versions() -> dict[str, str]:
    """The pinned versions, read from the tools module: {"kubernetes": "v1.35.4", "etcd": ...}."""
    return {"kubernetes": gobuild.required_version(MODULE, "k8s.io/kubernetes"),
            "etcd": gobuild.required_version(MODULE, "go.etcd.io/etcd/server/v3")}  # fmt: skip


def _version_ldflags(version: str) -> str:
    """What Kubernetes' own build stamps in (hack/lib/version.sh): without it the binaries call
    themselves v0.0.0-master, and helm refuses any chart with a kubeVersion constraint."""
    major, minor = version.lstrip("v").split(".")[:2]
    stamps = {"gitVersion": version, "gitMajor": major, "gitMinor": minor, "gitTreeState": "clean",
              "buildDate": "1970-01-01T00:00:00Z"}  # fmt: skip
    flags = ["-s", "-w"]
    for package in ("k8s.io/client-go/pkg/version", "k8s.io/component-base/version"):
        flags += [f"-X {package}.{key}={value}" for key, value in stamps.items()]
    return " ".join(flags)


def recipe() -> gobuild.Recipe:
    v = versions()
    return gobuild.Recipe(
        name="controlplane",
        module=MODULE,
        packages=PACKAGES,
        label=f"k8s-{v['kubernetes']}-etcd-{v['etcd']}",
        cold_cost="measured 5.6 min on 2 cores with empty Go caches, 600 MB of modules downloaded",
        ldflags=_version_ldflags(v["kubernetes"]),
        renames={"server": "etcd"},
    )


def ensure_binaries(say: Say = _say) -> Path:
    """The cached binaries, built first when missing. Safe to call from several processes."""
    return gobuild.ensure(recipe(), say)


def oldest_version() -> str:
    """The oldest Kubernetes the docs claim, as its tools module pins it: "v1.29.15"."""
    return gobuild.required_version(OLDEST_MODULE, "k8s.io/kubernetes")


def oldest_recipe() -> gobuild.Recipe:
    version = oldest_version()
    return gobuild.Recipe(
        name="controlplane-oldest",
        module=OLDEST_MODULE,
        packages={"kube-apiserver": PACKAGES["kube-apiserver"]},
        label=f"k8s-{version}",
        cold_cost="measured 5.4 min on 2 cores after the control plane's own build, ~190 MB of modules",
        ldflags=_version_ldflags(version),
    )


def ensure_oldest_binaries(say: Say = _say) -> Path:
    """The oldest claimed kube-apiserver, built first when missing."""
    return gobuild.ensure(oldest_recipe(), say)


# -- certificates -------------------------------------------------------------------------
# The CA (support.tls.CertificateAuthority) signs the apiserver's serving cert, the client certs,
# and serving certs for webhooks the tests run (their caBundle is ``plane.ca.cert``).


def kubeconfig(server: str, ca: Path, *, user: str, cert: Path | None = None, key: Path | None = None,
               token: str | None = None) -> str:  # fmt: skip
    """A kubeconfig document for one user of this cluster (a client cert or a bearer token)."""
    credentials: dict[str, str] = {}
    if cert is not None and key is not None:
        credentials = {"client-certificate": str(cert), "client-key": str(key)}
    if token is not None:
        credentials = {"token": token}
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {"name": "gpuop-test", "cluster": {"server": server, "certificate-authority": str(ca)}}
            ],
            "users": [{"name": user, "user": credentials}],
            "contexts": [{"name": user, "context": {"cluster": "gpuop-test", "user": user}}],
            "current-context": user,
        },
        indent=1,
    )


# -- processes ----------------------------------------------------------------------------


def _die_with_parent() -> None:
    """Run in the child before exec: SIGKILL it when the process that started it dies."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def host_address() -> str:
    """This machine's address on its default route, or 127.0.0.1 with none.

    The apiserver advertises it as the ``kubernetes`` Service's endpoint: a pod on a real node
    (support.node) reaches the API there, through kube-proxy; the machine's loopback is not
    reachable from a pod's network namespace. Connecting a UDP socket sends nothing.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: any routable address picks the route
        except OSError:
            return "127.0.0.1"
        address: str = probe.getsockname()[0]
        return address


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class StartError(RuntimeError):
    """A component did not come up; ``port_clash`` when it lost a race for its port."""

    def __init__(self, message: str, port_clash: bool = False) -> None:
        super().__init__(message)
        self.port_clash = port_clash


@dataclass
class Component:
    name: str
    process: subprocess.Popen[bytes]
    log: Path

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class ControlPlane:
    """etcd + kube-apiserver + kube-controller-manager under ``workdir``, on loopback ports.

    With ``apiserver`` (a directory holding another kube-apiserver: the oldest claimed) that one
    runs instead, and no controller-manager: see the module's docstring.
    """

    def __init__(
        self, workdir: Path, binaries: Path, say: Say = _say, *, apiserver: Path | None = None
    ) -> None:
        self.workdir = workdir
        self.binaries = binaries
        self.apiserver = apiserver
        self.say = say
        self.components: list[Component] = []
        self.pki = workdir / "pki"
        self.ca = CertificateAuthority(self.pki)
        self.apiserver_port = 0
        self.advertise_address = host_address()
        self.kubeconfig = workdir / "kubeconfig"
        self.audit_log = workdir / "audit.log"

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.apiserver_port}"

    def binary(self, name: str) -> Path:
        if name == "kube-apiserver" and self.apiserver is not None:
            return self.apiserver / name
        return self.binaries / name

    # -- start and stop -------------------------------------------------------------------

    def start(self, timeout: float = 120.0) -> None:
        started = time.monotonic()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._make_pki()
        for attempt in range(3):
            try:
                self._start_once(timeout)
                break
            except StartError as exc:
                self.stop()
                if not exc.port_clash or attempt == 2:
                    raise
                self.say(f"{exc}; trying other ports")
        self.say(f"ready at {self.server} in {time.monotonic() - started:.1f}s; kubeconfig {self.kubeconfig}")

    def _start_once(self, timeout: float) -> None:
        etcd_client, etcd_peer = free_port(), free_port()
        self.apiserver_port, controller_manager_port = free_port(), free_port()
        data = self.workdir / "etcd"
        shutil.rmtree(data, ignore_errors=True)
        self._spawn("etcd", [
            f"--data-dir={data}", "--name=gpuop-test",
            f"--listen-client-urls=http://127.0.0.1:{etcd_client}",
            f"--advertise-client-urls=http://127.0.0.1:{etcd_client}",
            f"--listen-peer-urls=http://127.0.0.1:{etcd_peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer}",
            f"--initial-cluster=gpuop-test=http://127.0.0.1:{etcd_peer}",
            # Test data is thrown away: no fsync per write (a 2-core CI machine's disk is slow).
            "--unsafe-no-fsync", "--quota-backend-bytes=2147483648", "--log-level=warn",
        ])  # fmt: skip
        self._wait(f"http://127.0.0.1:{etcd_client}/health", "etcd", timeout, tls=False)
        pki = self.pki
        self._spawn("kube-apiserver", [
            f"--etcd-servers=http://127.0.0.1:{etcd_client}",
            # On every address, as kubeadm's apiserver: pods reach it at the machine's own
            # address (kube-proxy rewrites 10.96.0.1 to it), the tests at 127.0.0.1. Every
            # request is authenticated (client certificates, tokens) and authorized by RBAC.
            "--bind-address=0.0.0.0", f"--advertise-address={self.advertise_address}",
            f"--secure-port={self.apiserver_port}",
            f"--tls-cert-file={pki / 'apiserver.crt'}", f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={self.ca.cert}",
            f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
            f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
            f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            # As kubeadm configures a cluster: Node and RBAC authorizers, the default admission
            # chain (ServiceAccount, webhooks, ResourceQuota, PodSecurity...) plus NodeRestriction.
            "--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction",
            "--allow-privileged=true", "--profiling=false", "--v=1",
            # Webhooks and aggregated APIs are reached at their Service's endpoints, not its
            # cluster IP: no kube-proxy runs here to route a cluster IP (the training-operator's
            # webhook, served from the test host, is the one that needs it).
            "--enable-aggregator-routing=true",
            # Every request at Metadata level, as a managed cluster's audit log has it: the
            # tests read who asked for what and what the authorizer answered.
            f"--audit-policy-file={self._audit_policy()}", f"--audit-log-path={self.audit_log}",
            "--audit-log-format=json", "--audit-log-mode=batch", "--audit-log-batch-max-wait=1s",
        ])  # fmt: skip
        self._wait(f"{self.server}/readyz", "kube-apiserver", timeout)
        self.kubeconfig.write_text(kubeconfig(self.server, self.ca.cert, user="admin",
                                              cert=pki / "admin.crt", key=pki / "admin.key"))  # fmt: skip
        if self.apiserver is not None:  # another version's apiserver: no controller-manager
            return
        kcm = self.workdir / "controller-manager.kubeconfig"
        kcm.write_text(kubeconfig(self.server, self.ca.cert, user="system:kube-controller-manager",
                                  cert=pki / "controller-manager.crt", key=pki / "controller-manager.key"))  # fmt: skip
        self._spawn("kube-controller-manager", [
            f"--kubeconfig={kcm}", f"--authentication-kubeconfig={kcm}", f"--authorization-kubeconfig={kcm}",
            "--bind-address=127.0.0.1", f"--secure-port={controller_manager_port}",
            f"--root-ca-file={self.ca.cert}", f"--service-account-private-key-file={pki / 'sa.key'}",
            f"--cluster-signing-cert-file={self.ca.cert}", f"--cluster-signing-key-file={self.ca.key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}", "--use-service-account-credentials=true",
            "--controllers=*,bootstrapsigner,tokencleaner", "--leader-elect=false", "--profiling=false",
            "--v=1",
        ])  # fmt: skip
        self._wait(f"https://127.0.0.1:{controller_manager_port}/healthz", "kube-controller-manager", timeout)
        # The controllers are really working once the namespace's ServiceAccount exists (pods
        # cannot be created before) and the root CA is published.
        self._wait_for_object("/api/v1/namespaces/default/serviceaccounts/default", timeout)
        self._wait_for_object("/api/v1/namespaces/default/configmaps/kube-root-ca.crt", timeout)

    def _audit_policy(self) -> Path:
        policy = self.workdir / "audit-policy.json"
        policy.write_text(json.dumps({
            "apiVersion": "audit.k8s.io/v1", "kind": "Policy",
            "omitStages": ["RequestReceived", "ResponseStarted"], "rules": [{"level": "Metadata"}],
        }))  # fmt: skip
        return policy

    def audit(self, user: str | None = None) -> list[dict[str, Any]]:
        """The audit log's events so far (written within about a second), of one user if given."""
        events = []
        with contextlib.suppress(FileNotFoundError), self.audit_log.open() as log:
            for line in log:
                if line.endswith("\n"):
                    event = json.loads(line)
                    if user is None or event.get("user", {}).get("username") == user:
                        events.append(event)
        return events

    def _make_pki(self) -> None:
        if (self.pki / "admin.crt").is_file() and (self.pki / "apiserver-kubelet-client.crt").is_file():
            return
        shutil.rmtree(self.pki, ignore_errors=True)
        ca = CertificateAuthority.create(self.pki)
        ca.issue("apiserver", "kube-apiserver", sans=[
            "IP:127.0.0.1", "IP:10.96.0.1", f"IP:{self.advertise_address}", "DNS:localhost", "DNS:kubernetes", "DNS:kubernetes.default",
            "DNS:kubernetes.default.svc", "DNS:kubernetes.default.svc.cluster.local",
        ])  # fmt: skip
        ca.issue("admin", "kubernetes-admin", organization="system:masters")
        ca.issue("controller-manager", "system:kube-controller-manager")
        # What the apiserver shows a kubelet for logs, exec and port-forward (kubeadm's name);
        # the kubelets authenticate it by this CA and ask the apiserver whether it may.
        ca.issue("apiserver-kubelet-client", "kube-apiserver-kubelet-client", organization="system:masters")
        openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", "sa.key", cwd=self.pki)
        openssl("ec", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=self.pki)

    def _spawn(self, name: str, args: list[str]) -> None:
        log = self.workdir / f"{name}.log"
        with log.open("ab") as out:
            process = subprocess.Popen(
                [str(self.binary(name)), *args], stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent, cwd=self.workdir,
            )  # fmt: skip
        self.components.append(Component(name, process, log))

    def _ssl_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.ca.cert))
        context.load_cert_chain(str(self.pki / "admin.crt"), str(self.pki / "admin.key"))
        return context

    def _wait(self, url: str, name: str, timeout: float, tls: bool = True) -> None:
        component = self.components[-1]
        context = self._ssl_context() if tls else None
        if tls and name == "kube-controller-manager":  # its serving cert is self-signed
            context = ssl._create_unverified_context()
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            if component.process.poll() is not None:
                tail = component.log_tail()
                clash = "address already in use" in tail
                raise StartError(
                    f"{name} exited with {component.process.returncode}:\n{tail}", port_clash=clash
                )
            try:
                with urllib.request.urlopen(url, timeout=5, context=context) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, OSError) as exc:
                last = str(exc)
            time.sleep(0.2)
        raise StartError(f"{name} not ready after {timeout:g}s ({last}):\n{component.log_tail()}")

    def _wait_for_object(self, path: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.server + path, timeout=5, context=self._ssl_context()):
                    return
            except (urllib.error.URLError, OSError):
                time.sleep(0.2)
        raise StartError(f"{path} never appeared: is kube-controller-manager working?\n"
                         f"{self.components[-1].log_tail()}")  # fmt: skip

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM in reverse order of start, SIGKILL after ``grace`` seconds."""
        for component in reversed(self.components):
            if component.process.poll() is None:
                component.process.terminate()
                try:
                    component.process.wait(grace)
                except subprocess.TimeoutExpired:
                    component.process.kill()
                    component.process.wait()
        self.components.clear()

    def check_alive(self) -> None:
        for component in self.components:
            if component.process.poll() is not None:
                raise RuntimeError(f"{component.name} died ({component.process.returncode}):\n"
                                   f"{component.log_tail()}")  # fmt: skip

    # -- use ------------------------------------------------------------------------------

    def kubectl(self, *args: str, kubeconfig_path: Path | None = None, input: str | None = None,
                check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:  # fmt: skip
        """The kubectl built with the control plane, as the admin unless told otherwise."""
        result = subprocess.run(
            [str(self.binary("kubectl")), f"--kubeconfig={kubeconfig_path or self.kubeconfig}", *args],
            input=input, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({result.returncode}):\n{result.stderr}")
        return result


@contextlib.contextmanager
def running(workdir: Path, say: Say = _say, *, oldest: bool = False) -> Iterator[ControlPlane]:
    """A started control plane for the duration of the block (the pytest fixture's form); with
    ``oldest``, the oldest claimed kube-apiserver on its own etcd, no controller-manager."""
    binaries = ensure_binaries(say)
    plane = ControlPlane(workdir, binaries, say, apiserver=ensure_oldest_binaries(say) if oldest else None)
    try:
        plane.start()
        yield plane
    finally:
        plane.stop()


# -- `make controlplane` / `make controlplane-down` ----------------------------------------


class StopRequested(BaseException):
    """A stop signal while a supervisor starts. A BaseException, as KeyboardInterrupt is: no
    ``except Exception`` in a start's retry loop may swallow it."""


class StopSignals:
    """A detached supervisor's stop signals (SIGTERM, SIGINT, SIGHUP). Within ``starting()``, the
    first one raises StopRequested wherever the start is, even in a blocking call, so what it
    started so far stops in reverse: a start never outlives whoever asked it to stop (a Ctrl-C, a
    `down`, a test torn down) and never reports "ok" after. Outside it, they only set ``stopped``:
    nothing raises into a stop, nor into the loop that watches ``stopped``."""

    def __init__(self) -> None:
        self.stopped = False
        self._starting = False
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, _frame: object) -> None:
        first = not self.stopped
        self.stopped = True
        if self._starting and first:
            raise StopRequested(f"stopped by {signal.Signals(signum).name} while starting")

    @contextlib.contextmanager
    def starting(self) -> Iterator[None]:
        self._starting = True  # before the check below: a signal between the two still raises
        try:
            if self.stopped:  # a signal came before the start: it stops at its first step
                raise StopRequested("stopped while starting")
            yield
        finally:
            self._starting = False


def _supervise(plane: ControlPlane, ready: IO[str]) -> int:
    """The detached supervisor's life: start, report to the waiting parent, stay until told."""
    signals = StopSignals()
    try:
        with signals.starting():
            plane.start()
    except (Exception, StopRequested) as exc:  # reported to the parent, which prints it and exits 1
        plane.stop()
        with contextlib.suppress(OSError):  # a parent gone already
            ready.write(f"error: {exc}\n")
            ready.close()
        return 1
    ready.write("ok\n")
    ready.close()
    while not signals.stopped:
        time.sleep(0.5)
        try:
            plane.check_alive()
        except RuntimeError as exc:
            (plane.workdir / "supervisor.log").write_text(f"{exc}\n")
            break
    plane.stop()
    return 0


def detach(state: Path, body: Callable[[IO[str]], int]) -> tuple[int, str]:
    """Fork a supervisor that runs ``body(ready)`` in a session of its own (so the terminal's
    Ctrl-C and make's exit spare it), its output in ``state/supervisor.log``, its pid in
    ``state/supervisor.pid``; ``body`` writes "ok" or "error: ..." to ``ready`` once started and
    returns when it is time to stop. Returns the supervisor's pid and that verdict (a Ctrl-C
    while it starts takes the supervisor down and removes ``state``)."""
    pid_file = state / "supervisor.pid"
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(read_end)
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDWR)
        log = os.open(state / "supervisor.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(devnull, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        pid_file.write_text(f"{os.getpid()}\n")
        code = 1
        try:
            with os.fdopen(write_end, "w") as ready:
                code = body(ready)
        except BaseException:  # (a parent gone before the verdict: a broken pipe) to the log
            traceback.print_exc()
        finally:  # never back into the parent's code: this is the fork
            pid_file.unlink(missing_ok=True)
            os._exit(code)
    os.close(write_end)
    try:
        with os.fdopen(read_end) as ready:
            verdict = ready.read().strip()
    except KeyboardInterrupt:
        os.kill(child, signal.SIGTERM)
        os.waitpid(child, 0)
        shutil.rmtree(state, ignore_errors=True)
        raise
    if verdict != "ok":
        os.waitpid(child, 0)
    return child, verdict


def supervisor_alive(state: Path) -> int | None:
    """The pid of ``state``'s supervisor, if it runs."""
    try:
        pid = int((state / "supervisor.pid").read_text())
        os.kill(pid, 0)
        # A killed supervisor stays a zombie until something reaps it: dead all the same.
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return None
    except (OSError, ValueError, IndexError):
        return None
    return pid


def stop_supervisor(state: Path, timeout: float) -> int | None:
    """SIGTERM ``state``'s supervisor and wait for it (SIGKILL after ``timeout``: its children
    follow it, PR_SET_PDEATHSIG); the pid it had, None if none ran."""
    pid = supervisor_alive(state)
    if pid is not None:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while supervisor_alive(state) and time.monotonic() < deadline:
            time.sleep(0.2)
        if supervisor_alive(state):
            os.kill(pid, signal.SIGKILL)
    return pid


def up(state: Path) -> int:
    if supervisor_alive(state):
        print(f"already running: export KUBECONFIG={state / 'kubeconfig'}")
        return 0
    shutil.rmtree(state, ignore_errors=True)
    binaries = ensure_binaries()
    (state / "bin").mkdir(parents=True)
    for name in PACKAGES:
        (state / "bin" / name).symlink_to(binaries / name)

    def supervise(ready: IO[str]) -> int:
        plane = ControlPlane(state, state / "bin", say=lambda m: print(f"controlplane: {m}", flush=True))
        return _supervise(plane, ready)

    try:
        child, verdict = detach(state, supervise)
    except KeyboardInterrupt:  # Ctrl-C while starting: the supervisor went down with us
        return 130
    if verdict != "ok":
        print(verdict or "error: the supervisor died while starting (see .controlplane/)", file=sys.stderr)
        return 1
    print(
        textwrap.dedent(f"""\
        control plane up (supervisor pid {child}); kubectl and the binaries are in {state / "bin"}:
          export KUBECONFIG={state / "kubeconfig"} PATH={state / "bin"}:$PATH
          kubectl get --raw /readyz
        stop it with: make controlplane-down""")
    )
    return 0


def down(state: Path, timeout: float = 30.0) -> int:
    pid = stop_supervisor(state, timeout)
    existed = state.exists()
    shutil.rmtree(state, ignore_errors=True)
    print(
        "control plane stopped"
        if pid
        else "no control plane was running" + (" (state removed)" if existed else "")
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="controlplane", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["build", "up", "down"])
    parser.add_argument("--dir", type=Path, default=STATE, help="state directory (default: .controlplane/)")
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            from support.controllers import (
                kueue,
                podgroups,
                trainingoperator,
            )  # the other Go-built binaries the tests run, and the gang schedulers' CRDs

            print(ensure_binaries())
            print(ensure_oldest_binaries())
            print(trainingoperator.ensure_binary())
            print(kueue.ensure_binary())
            print(podgroups.volcano_crd())
            print(podgroups.coscheduler_crd())
            return 0
        if args.command == "up":
            return up(args.dir.resolve())
        return down(args.dir.resolve())
    except (RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
