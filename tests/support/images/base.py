"""The base the operator image is built on: a STAND-IN for ``python:3.11.11-slim-bookworm``,
made here with debootstrap, because no registry is reachable and the official image cannot be
pulled.

Debian bookworm ``minbase`` plus ``python3``, ``python3-venv`` and ``ca-certificates`` from
Debian's mirror; then, inside it, a venv at ``/usr/local`` so that ``python``, ``python3`` and
``python -m pip`` on ``/usr/local/bin`` work as they do in the official image (whose Python is
installed there); then this machine's CA bundle, without which pip inside a build cannot verify
the package index's certificate here. The Python is Debian's (3.11.2), not the official image's
3.11.11: the operator needs ">=3.11".

Kept as an OCI image layout directory (what ``buildctl --oci-layout`` reads) in
``<cache>/images/base-<suite>-<hash>/``, keyed by what goes in: suite, mirror, packages, the
script run inside, the CA bundle, the layout's format. Built once per machine; Debian's archive
moves on, so two machines' bases differ in point releases, and the digest of the one built here
is part of the operator image's key (:mod:`support.images.build`).
"""

from __future__ import annotations

import inspect
import io
import json
import os
import subprocess
import tarfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from support import buildcache
from support.node import binaries
from support.node.images import write_oci_archive
from support.plane import gobuild

SUITE: Final = "bookworm"
MIRROR: Final = "http://deb.debian.org/debian"
PACKAGES: Final = ("python3", "python3-venv", "ca-certificates")
NAME: Final = "registry.gpuop.test/python:3.11-bookworm-standin"
CA_BUNDLE: Final = Path("/etc/ssl/certs/ca-certificates.crt")
COLD_COST: Final = "measured 3.4 min on 2 cores at load 7 to 10: debootstrap 144 s, venv 12 s, layer 50 s"
# Run in the new root (chroot) once debootstrap is done.
FINISH: Final = """set -eu
# python, python3 and pip in /usr/local/bin, first on PATH, as in the official image.
python3 -m venv /usr/local
# What an image does not carry: apt's indexes and downloads, install logs, and this machine's
# name and resolver (a container runtime mounts its own over both).
rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/cache/apt/archives/*.deb /var/log/apt/* /var/log/*.log
# debootstrap copied the machine's, mode and all.
install -m 644 /dev/null /etc/hostname
install -m 644 /dev/null /etc/resolv.conf
"""
# Kept as mount points only: what debootstrap made in them is the build machine's.
MOUNT_POINTS: Final = ("dev", "proc", "sys")
LAYOUT_FORMAT: Final = b"1"  # bump when the packing below changes what the layout holds


@dataclass(frozen=True)
class BaseImage:
    """An OCI image layout directory holding one image, and that image's manifest digest."""

    layout: Path
    digest: str  # sha256:..., what ``oci-layout://<name>@<digest>`` names


def base_image(say: gobuild.Say = gobuild.say_on_stderr) -> BaseImage:
    """The cached base, made first when missing (cold: :data:`COLD_COST`)."""
    ca_bundle = CA_BUNDLE.read_bytes()
    # write_oci_archive is support.node.images': a change there changes the layout too.
    inputs = buildcache.key([SUITE.encode(), MIRROR.encode(), " ".join(PACKAGES).encode(), FINISH.encode(),
                        ca_bundle, LAYOUT_FORMAT, inspect.getsource(write_oci_archive).encode()])  # fmt: skip

    def build(layout: Path) -> None:
        _build(layout, ca_bundle, say)

    layout = buildcache.ensure(buildcache.directory("images"), f"base-{SUITE}", inputs, build)
    index = json.loads((layout / "index.json").read_text())
    return BaseImage(layout, index["manifests"][0]["digest"])


def _build(layout: Path, ca_bundle: bytes, say: gobuild.Say) -> None:
    if os.geteuid() != 0:
        raise RuntimeError("making the base image needs root (debootstrap and chroot); run the tests as root")
    rootfs = layout.with_name("rootfs")
    log = layout.with_name("debootstrap.log")
    binaries.install_build_deps(say)  # debootstrap, once
    say(f"making the base image: debootstrap {SUITE} minbase + {', '.join(PACKAGES)} from {MIRROR} "
        f"(once per machine; {COLD_COST})")  # fmt: skip
    started = time.monotonic()
    include = f"--include={','.join(PACKAGES)}"
    _run(["debootstrap", "--variant=minbase", include, SUITE, str(rootfs), MIRROR], log, "debootstrap")
    bootstrapped = time.monotonic()
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", "LANG": "C.UTF-8"}
    _run(["chroot", str(rootfs), "/bin/sh", "-c", FINISH], log, "the base's finishing script", env)
    (rootfs / CA_BUNDLE.relative_to("/")).write_bytes(ca_bundle)
    finished = time.monotonic()
    layer = _layer(rootfs)
    write_oci_archive(layout.with_name("base.tar"), NAME, layer, entrypoint=[], cmd=["python3"])
    with tarfile.open(layout.with_name("base.tar")) as archive:
        archive.extractall(layout, filter="data")
    packed = time.monotonic()
    say(f"base made: debootstrap {bootstrapped - started:.0f}s, venv {finished - bootstrapped:.0f}s, "
        f"layer {packed - finished:.0f}s; {len(layer) / 1e6:.0f} MB unpacked, "
        f"{layout.with_name('base.tar').stat().st_size / 1e6:.0f} MB in the layout")  # fmt: skip


def _run(command: list[str], log: Path, what: str, env: dict[str, str] | None = None) -> None:
    with log.open("ab") as out:
        result = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    if result.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"{what} failed ({result.returncode}) making the base image:\n{tail}")


def _walk(rootfs: Path, directory: Path) -> Iterator[Path]:
    """Everything below ``directory``, parents first, names sorted (the order is the layer's)."""
    for entry in sorted(os.scandir(directory), key=lambda entry: entry.name):
        path = Path(entry.path)
        yield path
        if entry.is_dir(follow_symlinks=False) and path.relative_to(rootfs).as_posix() not in MOUNT_POINTS:
            yield from _walk(rootfs, path)


def _layer(rootfs: Path) -> bytes:
    """The root filesystem as one uncompressed layer: owners, modes, symlinks, hard links and
    device nodes as debootstrap made them, every mtime 0, so the same files give the same bytes."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in _walk(rootfs, rootfs):
            # gettarinfo remembers inodes: a second name of a file comes out as a hard link.
            info = tar.gettarinfo(str(path), arcname=path.relative_to(rootfs).as_posix())
            if info is None:  # a socket: nothing a layer can hold
                continue
            info.mtime, info.uname, info.gname = 0, "", ""
            if info.isreg():
                with path.open("rb") as data:
                    tar.addfile(info, data)
            else:
                tar.addfile(info)
    return buffer.getvalue()
