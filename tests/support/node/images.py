"""The two container images a node here needs, assembled in Python as OCI image archives.

No image registry is reachable from this machine, so nothing can be pulled. Both images are
STAND-INS for what a cluster would pull, built here from what the machine has, each as an OCI
image layout in a tar (``oci-layout``, ``index.json``, ``blobs/sha256/...``: what ``ctr images
import`` reads), made reproducibly (sorted entries, mtime 0, root-owned) and cached in
``~/.cache/gpuop/node-images/<name>-<hash of the inputs>.tar``:

- :data:`PAUSE_IMAGE`, the pod sandbox image (the CRI's ``sandbox`` image, in place of
  registry.k8s.io/pause): one static binary built with gcc from ``pause.c`` beside this file.
- :data:`SHELL_IMAGE`, the image of the tests' pods (in place of busybox): the host's dash as
  ``/bin/sh`` and a few coreutils (cat, head, tail, sleep, ls, df, stat, mkdir, true, seq), with
  the shared libraries ``ldd`` names. Enough for the tests' scripts, OOM included (``tail
  /dev/zero`` keeps one endless line in memory), and for the training-operator's init container
  (its ``--pytorch-init-container-image``, in place of alpine), whose ``nslookup`` is a script
  over glibc's ``getent hosts`` (glibc 2.34+ resolves through DNS with no NSS modules or
  nsswitch.conf).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import tarfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from support import buildcache

HERE: Final = Path(__file__).resolve().parent
PAUSE_IMAGE: Final = "registry.gpuop.test/pause:3.10-standin"
SHELL_IMAGE: Final = "registry.gpuop.test/shell:1-standin"
SHELL_TOOLS: Final = ("cat", "head", "tail", "sleep", "ls", "df", "stat", "mkdir", "true", "seq", "getent")
# What the training-operator's init container asks of busybox's nslookup: succeed once the name
# resolves.
NSLOOKUP: Final = b'#!/bin/sh\n# stand-in for nslookup: resolves the name or fails\nexec getent hosts "$1"\n'

PATH_ENV: Final = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class ImageArchive:
    name: str  # the image reference the archive's index names, e.g. registry.gpuop.test/pause:3.10-standin
    path: Path


@dataclass(frozen=True)
class _File:
    path: str  # inside the image, no leading slash
    data: bytes
    mode: int = 0o755


# -- building the archive -----------------------------------------------------------------


def _layer(files: Iterable[_File], directories: Iterable[str], symlinks: dict[str, str]) -> bytes:
    """An uncompressed, reproducible layer tar: every entry root-owned at mtime 0."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        entries: list[tuple[str, tarfile.TarInfo, bytes | None]] = []
        for directory in directories:
            info = tarfile.TarInfo(directory)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if directory == "tmp" else 0o755
            entries.append((directory, info, None))
        for link, target in symlinks.items():
            info = tarfile.TarInfo(link)
            info.type, info.linkname, info.mode = tarfile.SYMTYPE, target, 0o777
            entries.append((link, info, None))
        for file in files:
            info = tarfile.TarInfo(file.path)
            info.size, info.mode = len(file.data), file.mode
            entries.append((file.path, info, file.data))
        for _, info, data in sorted(entries, key=lambda entry: entry[0]):
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buffer.getvalue()


def full_reference(name: str) -> str:
    """An image name as the kubelet asks containerd for it, Docker's short forms spelled out
    (``team/app:1`` is ``docker.io/team/app:1``, ``app:1`` is ``docker.io/library/app:1``): an
    image imported or tagged under the short form is never found by a pod that names it so."""
    first, _, rest = name.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        return name
    return f"docker.io/{name}" if rest else f"docker.io/library/{name}"


def blob_path(digest: str) -> str:
    """Where an OCI layout keeps the blob of ``digest`` ("sha256:..."): blobs/sha256/<hex>."""
    algorithm, _, hexadecimal = digest.partition(":")
    return f"blobs/{algorithm}/{hexadecimal}"


def _blob(tar: tarfile.TarFile, data: bytes) -> str:
    digest = f"sha256:{hashlib.sha256(data).hexdigest()}"
    info = tarfile.TarInfo(blob_path(digest))
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))
    return digest


def image_index(
    name: str, manifest_digest: str, manifest_size: int, *more: tuple[str, str, int]
) -> dict[str, object]:
    """An OCI layout's index.json naming its one linux/amd64 image ``name``. containerd's
    importer names the image from io.containerd.image.name; other tools read the OCI ref
    annotation, so both carry the full reference. ``more`` lists further images of the
    layout, each (name, manifest digest, manifest size): ``ctr images import`` imports every
    manifest the index lists, each under its own name."""
    return {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": digest, "size": size,
            "platform": {"architecture": "amd64", "os": "linux"},
            "annotations": {"io.containerd.image.name": named, "org.opencontainers.image.ref.name": named},
        } for named, digest, size in ((name, manifest_digest, manifest_size), *more)],
    }  # fmt: skip


def write_oci_archive(destination: Path, name: str, layer: bytes, entrypoint: list[str],
                      cmd: list[str] | None = None) -> None:  # fmt: skip
    """An OCI image layout tar holding one linux/amd64 image of one gzip layer."""
    compressed = gzip.compress(layer, mtime=0)
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Entrypoint": entrypoint, "Cmd": cmd, "Env": [PATH_ENV], "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{hashlib.sha256(layer).hexdigest()}"]},
        "history": [{"created_by": "support.node.images (a stand-in assembled in Python)"}],
    }
    with tarfile.open(destination, "w") as tar:
        layer_digest = _blob(tar, compressed)
        config_bytes = json.dumps(config, sort_keys=True).encode()
        config_digest = _blob(tar, config_bytes)
        manifest = json.dumps({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                       "digest": config_digest, "size": len(config_bytes)},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                        "digest": layer_digest, "size": len(compressed)}],
        }, sort_keys=True).encode()  # fmt: skip
        manifest_digest = _blob(tar, manifest)
        index = image_index(name, manifest_digest, len(manifest))
        for member, data in (("oci-layout", b'{"imageLayoutVersion":"1.0.0"}'),
                             ("index.json", json.dumps(index, sort_keys=True).encode())):  # fmt: skip
            info = tarfile.TarInfo(member)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


# -- the two images -----------------------------------------------------------------------


def _cached(name: str, inputs: bytes, build: Callable[[Path], None]) -> Path:
    """``build(path)`` once per content hash (:mod:`support.buildcache`'s rule)."""
    return buildcache.ensure(
        buildcache.directory("node-images"), name, buildcache.key([inputs]), build, ".tar"
    )


def pause_image() -> ImageArchive:
    source = HERE / "pause.c"
    gcc = subprocess.run(["gcc", "--version"], capture_output=True, text=True, check=True).stdout

    def build(destination: Path) -> None:
        binary = destination.with_name("pause")
        subprocess.run(["gcc", "-static", "-O2", "-s", "-o", str(binary), str(source)], check=True,
                       capture_output=True)  # fmt: skip
        layer = _layer([_File("pause", binary.read_bytes())], [], {})
        write_oci_archive(destination, PAUSE_IMAGE, layer, entrypoint=["/pause"])

    return ImageArchive(PAUSE_IMAGE, _cached("pause", source.read_bytes() + gcc.encode(), build))


def _shared_libraries(binary: str) -> list[str]:
    """The absolute paths ``ldd`` resolves for ``binary`` (the loader included)."""
    output = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True).stdout
    return re.findall(r"(/\S+) \(0x", output)


def _shell_files() -> list[_File]:
    binaries = {"sh": shutil.which("dash") or "/bin/sh"}
    for tool in SHELL_TOOLS:
        found = shutil.which(tool)
        if found is None:
            raise RuntimeError(f"the shell stand-in image takes `{tool}` from this machine: not found")
        binaries[tool] = found
    files = [_File(f"bin/{name}", Path(path).read_bytes()) for name, path in binaries.items()]
    files.append(_File("bin/nslookup", NSLOOKUP))
    libraries = sorted({library for path in binaries.values() for library in _shared_libraries(path)})
    # At the path ldd names (the loader at /lib64/..., the rest under /lib/x86_64-linux-gnu,
    # which Debian's loader searches without an ld.so.cache); symlinks resolved to their file.
    files += [_File(library.lstrip("/"), Path(library).resolve().read_bytes()) for library in libraries]
    files.append(
        _File("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534::/:/bin/sh\n", 0o644)
    )
    files.append(_File("etc/group", b"root:x:0:\nnogroup:x:65534:\n", 0o644))
    return files


def shell_image() -> ImageArchive:
    files = _shell_files()
    directories = ["bin", "dev", "etc", "lib", "lib/x86_64-linux-gnu", "lib64", "proc", "root", "sys", "tmp",
                   "usr", "usr/bin", "var", "var/run"]  # fmt: skip
    inputs = b"".join(file.path.encode() + hashlib.sha256(file.data).digest() for file in files)

    def build(destination: Path) -> None:
        layer = _layer(files, directories, {"usr/bin/sh": "../../bin/sh"})
        write_oci_archive(destination, SHELL_IMAGE, layer, entrypoint=[], cmd=["/bin/sh"])

    return ImageArchive(SHELL_IMAGE, _cached("shell", inputs, build))


def all_images() -> list[ImageArchive]:
    return [pause_image(), shell_image()]


if __name__ == "__main__":
    for image in all_images():
        print(image.name, image.path, os.path.getsize(image.path))


def single_binary_image(name: str, binary: Path, path_in_image: str) -> ImageArchive:
    """An image of one static binary at ``/<path_in_image>``, its entrypoint (a stand-in for a
    registry's image of the same program: CoreDNS's, Prometheus's)."""
    data = binary.read_bytes()

    def build(destination: Path) -> None:
        layer = _layer([_File(path_in_image, data)], ["tmp"], {})
        write_oci_archive(destination, name, layer, entrypoint=[f"/{path_in_image}"])

    inputs = name.encode() + hashlib.sha256(data).digest()
    return ImageArchive(name, _cached(Path(path_in_image).name, inputs, build))
