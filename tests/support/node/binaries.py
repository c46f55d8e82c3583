"""The binaries a real node runs, built from pinned Go modules and cached outside the work tree.

Four builds, each cached by :mod:`support.plane.gobuild`'s keys (``~/.cache/gpuop/<name>/<label>-<hash>``):

- ``node-runtime`` from ``tests/node/go.mod``: containerd v2 (``containerd``,
  ``containerd-shim-runc-v2``, ``ctr``) and the CNI plugins (bridge, host-local, loopback,
  portmap), all pure Go (``CGO_ENABLED=0``).
- ``node-runc`` from the same module: runc v1.5, the one piece that needs cgo (its ``nsenter``
  is C, run before the Go runtime starts) and with the ``seccomp`` tag: containerd gives every
  pod sandbox the RuntimeDefault profile, and restricted Pod Security asks it of every container.
  That tag links libseccomp, whose headers come from Debian's libseccomp-dev, installed by
  ``tests/node/install-build-deps.sh`` (with iptables, for kube-proxy). Built here
  rather than taken from Debian's runc package (1.1.5, from 2023, and needing a Debian package
  all the same): the version is pinned in go.sum with containerd's.
- ``node-dns`` from ``tests/dns/go.mod``: CoreDNS, the cluster's DNS (its k8s.io client graph
  is its own).
- ``node-k8s`` from ``tests/controlplane/go.mod``, kube-apiserver's own tools module: kubelet,
  kube-proxy and kube-scheduler, so the k8s.io/kubernetes version and the whole dependency graph are the
  apiserver's and the Go build cache shares its compiled packages. containerd v2 cannot join
  that graph: it requires k8s.io/cri-api v0.37, and MVS would lift the kubelet onto it.
- ``node-gpuplugin`` from the same module: ``tests/controlplane/gpuplugin``, our stand-in for
  NVIDIA's device plugin (no GPU here), on the kubelet's own device-plugin API package.
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from pathlib import Path
from typing import Final

from support.paths import ROOT
from support.plane import controlplane, gobuild

MODULE: Final = ROOT / "tests" / "node"
CONTAINERD: Final = "github.com/containerd/containerd/v2"
CNI_PLUGINS: Final = "github.com/containernetworking/plugins"
RUNC: Final = "github.com/opencontainers/runc"
DNS_MODULE: Final = ROOT / "tests" / "dns"
COREDNS: Final = "github.com/coredns/coredns"

RUNTIME_PACKAGES: Final = {
    "containerd": f"{CONTAINERD}/cmd/containerd",
    "containerd-shim-runc-v2": f"{CONTAINERD}/cmd/containerd-shim-runc-v2",
    "ctr": f"{CONTAINERD}/cmd/ctr",
    "bridge": f"{CNI_PLUGINS}/plugins/main/bridge",
    "host-local": f"{CNI_PLUGINS}/plugins/ipam/host-local",
    "loopback": f"{CNI_PLUGINS}/plugins/main/loopback",
    "portmap": f"{CNI_PLUGINS}/plugins/meta/portmap",
}
CNI_PLUGIN_NAMES: Final = ("bridge", "host-local", "loopback", "portmap")
K8S_PACKAGES: Final = {
    "kubelet": "k8s.io/kubernetes/cmd/kubelet",
    "kube-scheduler": "k8s.io/kubernetes/cmd/kube-scheduler",
    "kube-proxy": "k8s.io/kubernetes/cmd/kube-proxy",
}
RUNC_TAGS: Final = "seccomp"
INSTALL_BUILD_DEPS: Final = MODULE / "install-build-deps.sh"


def versions() -> dict[str, str]:
    kubernetes = controlplane.versions()["kubernetes"]  # one module: kubelet is the apiserver's version
    return {
        "containerd": gobuild.required_version(MODULE, CONTAINERD),
        "cni-plugins": gobuild.required_version(MODULE, CNI_PLUGINS),
        "runc": gobuild.required_version(MODULE, RUNC),
        "coredns": gobuild.required_version(DNS_MODULE, COREDNS),
        "kubernetes": kubernetes,
    }


def runtime_recipe() -> gobuild.Recipe:
    v = versions()
    # Without the stamp containerd reports "2.x+unknown" through the CRI, which the kubelet logs.
    stamp = f"-X {CONTAINERD}/version.Version={v['containerd']} -X {CONTAINERD}/version.Revision=gpuop"
    return gobuild.Recipe(
        name="node-runtime",
        module=MODULE,
        packages=RUNTIME_PACKAGES,
        label=f"containerd-{v['containerd']}-cni-{v['cni-plugins']}",
        cold_cost="measured 6.9 min on 2 cores at load 11 with GOMAXPROCS=1, after a 26 s module download",
        ldflags=f"-s -w {stamp}",
    )


def install_build_deps(say: gobuild.Say = gobuild.say_on_stderr) -> None:
    """Debian's libseccomp-dev (runc's build), iptables (kube-proxy) and debootstrap (the image
    base), installed once by ``install-build-deps.sh``; nothing to do when they are there."""
    if shutil.which("iptables") and shutil.which("debootstrap") and Path("/usr/include/seccomp.h").is_file():
        return
    say(f"{INSTALL_BUILD_DEPS.name}: Debian's libseccomp-dev, iptables, debootstrap (apt-get, once)")
    subprocess.run([str(INSTALL_BUILD_DEPS)], check=True)


def runc_recipe() -> gobuild.Recipe:
    version = versions()["runc"]
    return gobuild.Recipe(
        name="node-runc",
        module=MODULE,
        packages={"runc": RUNC},
        label=f"runc-{version}-{RUNC_TAGS}",
        cold_cost="measured 53 s on 2 cores at load 11 with GOMAXPROCS=1",
        ldflags=f"-s -w -X main.version={version.lstrip('v')} -X main.gitCommit=gpuop",
        cgo=True,  # nsenter is C
        tags=RUNC_TAGS,  # links libseccomp: its headers come from install_build_deps
    )


def dns_recipe() -> gobuild.Recipe:
    return gobuild.Recipe(
        name="node-dns",
        module=DNS_MODULE,
        packages={"coredns": COREDNS},
        label=f"coredns-{versions()['coredns']}",
        cold_cost="measured 4.5 min on 2 cores at load 4 (another test run beside it), modules downloaded",
    )


def k8s_recipe() -> gobuild.Recipe:
    plane = controlplane.recipe()  # the same version stamps as kube-apiserver
    return dataclasses.replace(
        plane,
        name="node-k8s",
        packages=K8S_PACKAGES,
        label=f"k8s-{versions()['kubernetes']}",
        cold_cost="measured 4.0 min on 2 cores at load 11 with GOMAXPROCS=1, kube-apiserver's packages cached",
        renames={},
    )


GPU_PLUGIN: Final = controlplane.MODULE / "gpuplugin"


def gpuplugin_recipe() -> gobuild.Recipe:
    return gobuild.Recipe(
        name="node-gpuplugin",
        module=controlplane.MODULE,
        packages={"gpuplugin": "gpuop.io/tests/controlplane/gpuplugin"},
        label=f"k8s-{versions()['kubernetes']}",
        cold_cost="measured 24 s on 2 cores, the packages it shares with the kubelet already compiled",
        sources=tuple(sorted(GPU_PLUGIN.glob("*.go"))),
    )


@dataclasses.dataclass(frozen=True)
class NodeBinaries:
    """Where each binary of a node is; :meth:`path` by name."""

    runtime: Path
    runc: Path
    k8s: Path
    dns: Path  # CoreDNS, which runs in a pod (support.node.dns)
    controlplane: Path  # kubectl and friends, for the tests
    gpuplugin: Path  # the device-plugin stand-in (support.node.node.Node's ``gpus``)

    def path(self, name: str) -> Path:
        for directory in (self.runtime, self.runc, self.k8s, self.dns, self.controlplane, self.gpuplugin):
            if (directory / name).is_file():
                return directory / name
        raise FileNotFoundError(name)

    @property
    def cni_dir(self) -> Path:
        return self.runtime  # the CNI plugins are named as the CNI config's "type" fields ask


def ensure_all(say: gobuild.Say = gobuild.say_on_stderr) -> NodeBinaries:
    """Every binary a node needs, built first where missing (cold: see each recipe's cold_cost)."""
    install_build_deps(say)
    return NodeBinaries(
        runtime=gobuild.ensure(runtime_recipe(), say),
        runc=gobuild.ensure(runc_recipe(), say),
        k8s=gobuild.ensure(k8s_recipe(), say),
        dns=gobuild.ensure(dns_recipe(), say),
        controlplane=controlplane.ensure_binaries(say),
        gpuplugin=gobuild.ensure(gpuplugin_recipe(), say),
    )


if __name__ == "__main__":  # `python -m support.node.binaries` (from tests/): build everything, print where
    print(ensure_all())
