"""An SPDX 2.3 SBOM of an image, read from the image itself (an OCI archive), offline.

What an image holds is read from its layers, in order, as a runtime would stack them (a later
layer's file replaces an earlier one's; whiteouts delete): Debian's packages from dpkg's
database (``var/lib/dpkg/status``, installed ones only) and Python's distributions from every
``*.dist-info/METADATA`` in a site-packages directory. Each becomes an SPDX package with its
package URL (``pkg:deb/debian/...``, ``pkg:pypi/...``), contained by the image's own package,
which names the image by digest.

Why not syft, the usual tool: building it from its Go module would add another large cold
build to every fresh CI machine, and these two sources are everything our images install (no
OS packages but Debian's, nothing but pip beside them). What it does not see: files copied in
by hand, static binaries, and licences that a METADATA does not declare.
"""

from __future__ import annotations

import email.parser
import gzip
import json
import re
import tarfile
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any, Final

import zstandard

from support import oci

SPDX_VERSION: Final = "SPDX-2.3"
DPKG_STATUS: Final = "var/lib/dpkg/status"
DIST_INFO: Final = re.compile(r"(^|/)(site|dist)-packages/[^/]+\.dist-info/METADATA$")
CREATOR: Final = "Tool: gpu-training-operator-release"
ZSTD_MAGIC: Final = b"\x28\xb5\x2f\xfd"


def _layers(archive: tarfile.TarFile, image: str | None) -> Iterator[tuple[str, bytes]]:
    """(path, content) of the files the image's layers hold that an SBOM reads, in the order a
    runtime applies them; a whiteout comes as (path, b"") to drop the path and what is below it.
    Of an index, the first platform's (the images here are built for one)."""
    first = oci.platform_manifests(archive, oci.image_descriptor(archive, image))[0]
    manifest = json.load(oci.archive_blob(archive, first["digest"])[0])
    for layer in manifest["layers"]:
        blob = oci.archive_blob(archive, layer["digest"])[0]
        # Streamed: the trainer's largest layer is gigabytes.
        with tarfile.open(fileobj=_decompressed(blob), mode="r|") as tar:
            for member in tar:
                name = member.name.removeprefix("./")
                directory, _, base = name.rpartition("/")
                if base == ".wh..wh..opq":  # an opaque directory: nothing of lower layers below it
                    yield directory, b""
                elif base.startswith(".wh."):
                    yield (f"{directory}/{base[4:]}" if directory else base[4:]), b""
                elif member.isfile() and (name == DPKG_STATUS or DIST_INFO.search(name)):
                    found = tar.extractfile(member)
                    yield name, found.read() if found else b""


def _decompressed(blob: IO[bytes]) -> IO[bytes]:
    """A layer's tar stream, whatever its compression (by its magic number): zstd (our images'),
    gzip (most bases'), or none."""
    magic = blob.read(4)
    blob.seek(0)
    if magic[:2] == b"\x1f\x8b":
        return gzip.GzipFile(fileobj=blob)
    if magic == ZSTD_MAGIC:
        return zstandard.ZstdDecompressor().stream_reader(blob)  # type: ignore[no-any-return]
    return blob


def _debian(status: bytes) -> Iterator[dict[str, str]]:
    for stanza in status.decode(errors="replace").split("\n\n"):
        fields = dict(re.findall(r"^([A-Za-z-]+): (.*)$", stanza, re.MULTILINE))
        if fields.get("Package") and fields.get("Status", "").endswith(" installed"):
            yield fields


def _package(kind: str, name: str, version: str, purl: str, expression: str | None = None,
             text: str | None = None) -> dict[str, Any]:  # fmt: skip
    """One package; ``expression`` an SPDX licence expression (PEP 639's License-Expression),
    ``text`` a free-text licence, which SPDX can only carry as a comment."""
    ident = re.sub(r"[^A-Za-z0-9.-]", "-", f"{kind}-{name}-{version}")
    return {
        "SPDXID": f"SPDXRef-{ident}",
        "name": name,
        "versionInfo": version,
        "downloadLocation": "NOASSERTION",
        "filesAnalyzed": False,
        "licenseDeclared": expression or "NOASSERTION",
        **({"comment": f"licence as declared: {text[:200]}"} if text and not expression else {}),
        "externalRefs": [
            {"referenceCategory": "PACKAGE-MANAGER", "referenceType": "purl", "referenceLocator": purl}
        ],
    }


def packages(archive_path: Path, image: str | None = None) -> list[dict[str, Any]]:
    """The SPDX packages an image of an archive holds (``image`` as :func:`support.oci.push_archive`
    selects it): Debian's, then Python's, each sorted by name."""
    files: dict[str, bytes] = {}
    with tarfile.open(archive_path) as archive:
        for path, content in _layers(archive, image):
            if content:
                files[path] = content
            else:  # a whiteout: the path and anything below it
                files = {p: c for p, c in files.items() if p != path and not p.startswith(path + "/")}
    found = []
    for fields in _debian(files.get(DPKG_STATUS, b"")):
        name, version, arch = fields["Package"], fields.get("Version", ""), fields.get("Architecture", "")
        found.append(_package("deb", name, version, f"pkg:deb/debian/{name}@{version}?arch={arch}"))
    pythons = []
    for path, content in files.items():
        if DIST_INFO.search(path):
            metadata = email.parser.BytesHeaderParser().parsebytes(content)
            name, version = metadata["Name"], metadata["Version"]
            if name and version:
                canonical = re.sub(r"[-_.]+", "-", name).lower()
                purl = f"pkg:pypi/{canonical}@{version}"
                pythons.append(
                    _package("pypi", name, version, purl, metadata["License-Expression"], metadata["License"])
                )
    return sorted(found, key=lambda p: p["name"]) + sorted(pythons, key=lambda p: p["name"].lower())


def document(archive_path: Path, image: str, selector: str | None = None) -> dict[str, Any]:
    """The SBOM of the image pushed as ``image`` (``registry/repository:tag@digest``), read from
    the archive it was pushed from (``selector`` picks it there, as for the push)."""
    contained = packages(archive_path, selector)
    top = {
        "SPDXID": "SPDXRef-image",
        "name": image.split("@")[0],
        "versionInfo": image.rpartition("@")[2] if "@" in image else "NOASSERTION",
        "downloadLocation": "NOASSERTION",
        "filesAnalyzed": False,
        "primaryPackagePurpose": "CONTAINER",
    }
    return {
        "spdxVersion": SPDX_VERSION,
        "dataLicense": "CC0-1.0",
        "SPDXID": "SPDXRef-DOCUMENT",
        "name": image,
        "documentNamespace": f"https://spdx.org/spdxdocs/gpu-training-operator-{uuid.uuid4()}",
        "creationInfo": {"created": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), "creators": [CREATOR]},
        "packages": [top, *contained],
        "relationships": [
            {"spdxElementId": "SPDXRef-DOCUMENT", "relationshipType": "DESCRIBES", "relatedSpdxElement": "SPDXRef-image"},
            *({"spdxElementId": "SPDXRef-image", "relationshipType": "CONTAINS", "relatedSpdxElement": p["SPDXID"]}
              for p in contained),
        ],
    }  # fmt: skip
