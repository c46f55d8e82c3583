"""BuildKit (buildkitd and buildctl), built from its Go module, and a buildkitd that lives as long
as one build.

No Docker daemon runs here and none is needed: buildkitd's OCI worker runs each ``RUN`` step of a
Dockerfile with runc (the real node's, built by :mod:`support.node.binaries`) on an overlayfs
snapshotter. :func:`running_buildkitd` gives the daemon a temporary directory of its own for
everything it keeps (root, socket, config, log) and its build containers a cgroup parent of its
own, so that when it returns nothing of it is left on the machine: no process, no mount, no
cgroup, no file. Nothing is kept between builds either: a build here is rare (only when what goes
into the image changes), and a persistent root would grow by every pip download until collected.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from support.node import binaries, hoststate
from support.node.process import Supervised, kill_all, processes_naming, spawn, wait_until
from support.paths import ROOT
from support.plane import gobuild

MODULE: Final = ROOT / "tests" / "images"
BUILDKIT: Final = "github.com/moby/buildkit"
PACKAGES: Final = {"buildkitd": f"{BUILDKIT}/cmd/buildkitd", "buildctl": f"{BUILDKIT}/cmd/buildctl"}


def version() -> str:
    return gobuild.required_version(MODULE, BUILDKIT)


def recipe() -> gobuild.Recipe:
    v = version()
    # Without the stamp both report v0.0.0+unknown (`buildctl debug info`, the daemon's log).
    stamp = f"-X {BUILDKIT}/version.Version={v} -X {BUILDKIT}/version.Revision=gpuop"
    return gobuild.Recipe(
        name="buildkit",
        module=MODULE,
        packages=PACKAGES,
        label=f"buildkit-{v}",
        cold_cost="measured 3.6 min on 2 cores at load 6 after a 9 s module download, containerd's packages "
        "already compiled for the node (same v2.4.2)",
        ldflags=f"-s -w {stamp}",
    )


@dataclass
class Buildkitd:
    """A running buildkitd: its binaries, its directory and its socket."""

    binaries: Path  # buildkitd and buildctl
    workdir: Path
    process: Supervised

    @property
    def address(self) -> str:
        return f"unix://{self.workdir / 'buildkitd.sock'}"

    def buildctl(self) -> list[str]:
        """The start of a ``buildctl`` command line that talks to this daemon."""
        return [str(self.binaries / "buildctl"), f"--addr={self.address}"]

    def log_tail(self, lines: int = 30) -> str:
        return self.process.log_tail(lines)


@contextlib.contextmanager
def running_buildkitd(
    say: gobuild.Say = gobuild.say_on_stderr, timeout: float = 60.0, trusted: Mapping[str, Path] | None = None
) -> Iterator[Buildkitd]:
    """A buildkitd (OCI worker, runc, host network) for the duration of the ``with`` block;
    ``trusted`` maps each registry (``host:port``) it pulls from or pushes to over TLS verified
    with a CA of its own to that CA's file.

    Its directory is a fresh one under the system's temporary directory (a unix socket's path
    may not exceed 107 bytes, which a deep cache directory could). At the end: SIGTERM, then
    whatever is still there is removed by force: processes naming the directory, mounts under it
    (the overlayfs of a step that was cancelled), its cgroups, and the directory.
    """
    if os.geteuid() != 0:
        raise RuntimeError("buildkitd runs build steps with runc, which needs root; run the tests as root")
    tools = gobuild.ensure(recipe(), say)
    runc = gobuild.ensure(binaries.runc_recipe(), say) / "runc"
    workdir = Path(tempfile.mkdtemp(prefix="gpuop-buildkitd-"))
    # The build containers' cgroups: /<this>/buildkit/<id> in every hierarchy, not the shared
    # /buildkit that another buildkitd on the machine would use too.
    cgroup_parent = workdir.name
    config = workdir / "buildkitd.toml"
    # A config file of its own, so the machine's /etc/buildkit/buildkitd.toml (if any) is not read.
    config.write_text(f'[worker.oci]\n  defaultCgroupParent = "{cgroup_parent}"\n' + "".join(
        f'[registry."{address}"]\n  ca = ["{ca}"]\n' for address, ca in (trusted or {}).items()
    ))  # fmt: skip
    command = [
        str(tools / "buildkitd"),
        f"--config={config}",
        f"--root={workdir / 'root'}",
        f"--addr=unix://{workdir / 'buildkitd.sock'}",
        # Else it listens on /run/buildkit/otel-grpc.sock, and leaves the socket there.
        f"--otel-socket-path={workdir / 'otel-grpc.sock'}",
        "--oci-worker=true",
        "--containerd-worker=false",
        f"--oci-worker-binary={runc}",
        # Every step on the host's network: there is no CNI for it here, and `pip install` in
        # the Dockerfile must reach the package index. Named, so that a /etc/buildkit/cni.json
        # cannot switch it (buildkitd's "auto"); no build needs to ask for network.host then.
        "--oci-worker-net=host",
    ]
    process = spawn("buildkitd", command, workdir / "buildkitd.log")
    daemon = Buildkitd(tools, workdir, process)
    try:
        wait_until(
            lambda: subprocess.run([*daemon.buildctl(), "debug", "workers"], capture_output=True,
                                   timeout=10).returncode == 0,
            timeout, "buildkitd answering on its socket", process,
        )  # fmt: skip
        yield daemon
    finally:
        process.stop(grace=20)
        _sweep(workdir, cgroup_parent)


def _sweep(workdir: Path, cgroup_parent: str) -> None:
    """Remove what a stopped buildkitd leaves: always the cgroup parents of its steps (runc
    removes a step's own group, not the /<parent>/buildkit it made above it: 20 directories
    here); after a crash or a kill also processes and mounts under its directory."""
    kill_all(sorted(processes_naming(str(workdir))))
    hoststate.remove_cgroup_tree(cgroup_parent)
    hoststate.unmount_all_under(workdir)
    # Overlay upper directories hold files of any owner and mode; rmtree as root removes them.
    shutil.rmtree(workdir, ignore_errors=True)
    if workdir.exists():
        raise RuntimeError(f"buildkitd's directory {workdir} could not be removed: {os.listdir(workdir)}")
