"""A client of the OCI distribution API, enough to push an image from an OCI archive and to read
back what a registry holds: the standard library only, so ``make release`` needs no crane, oras or
Docker.

Pushing follows the spec's order: each blob the manifest names (config and layers) is asked for
with HEAD and uploaded only when missing (a POST opens an upload, one PUT with the digest closes
it), then the manifest goes up under its tag. A registry checks every blob's digest as it takes
it, so a torn upload is refused, never stored; the manifest, put last, is what makes the image
exist, so an interrupted push leaves no tag.

Authentication is the registries' token dance: a 401 names a realm, service and scope; a GET of
the realm with the user's Basic credentials (``REGISTRY_USERNAME`` and ``REGISTRY_PASSWORD``, as
GitHub's token for ghcr.io) returns a bearer token for that scope. The local registry asks none.
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import os
import re
import ssl
import tarfile
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Final

from support.node.images import blob_path

INDEX_TYPES: Final = frozenset({
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
})  # fmt: skip
MANIFEST_TYPES: Final = frozenset({
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
})  # fmt: skip
ACCEPT: Final = ", ".join(sorted(INDEX_TYPES | MANIFEST_TYPES))
# The annotation an OCI layout names its images by (buildctl's and our archives both set it).
REF_NAME: Final = "org.opencontainers.image.ref.name"
CHUNK: Final = 1 << 20


class RegistryError(RuntimeError):
    """A registry refused or could not be reached; the message is one line for the user."""


@dataclass(frozen=True)
class Reference:
    """``host[:port]/repository:tag``, the way a pod spec names an image."""

    host: str
    repository: str
    tag: str

    @classmethod
    def parse(cls, text: str) -> Reference:
        host, _, rest = text.partition("/")
        name, _, tag = rest.rpartition(":")
        if not host or not name or not tag or "/" in tag:
            raise ValueError(f"{text!r} is not host/repository:tag")
        return cls(host, name, tag)

    def __str__(self) -> str:
        return f"{self.host}/{self.repository}:{self.tag}"


@dataclass
class Client:
    """One registry's API at ``host`` over HTTPS, verified with ``ca`` (else the system's CAs)."""

    host: str
    ca: Path | None = None
    username: str | None = field(default_factory=lambda: os.environ.get("REGISTRY_USERNAME"))
    password: str | None = field(default_factory=lambda: os.environ.get("REGISTRY_PASSWORD"), repr=False)
    _tokens: dict[str, str] = field(default_factory=dict, repr=False)

    def _context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca) if self.ca else None)

    def request(self, method: str, url: str, *, scope: str, body: IO[bytes] | bytes | None = None,
                headers: dict[str, str] | None = None, length: int | None = None) -> tuple[int, dict[str, str], bytes]:  # fmt: skip
        """Send one request (retried once with a token after a 401): status, headers, body."""
        for attempt in (1, 2):
            sent = dict(headers or {})
            if scope in self._tokens:
                sent["Authorization"] = f"Bearer {self._tokens[scope]}"
            if length is not None:
                sent["Content-Length"] = str(length)
            status, answer, data = self._send(method, url, body, sent)
            if status == 401 and attempt == 1:
                self._tokens[scope] = self._token(answer.get("www-authenticate", ""), scope)
                if hasattr(body, "seek"):
                    body.seek(0)  # type: ignore[union-attr]
                continue
            return status, answer, data
        raise AssertionError("unreachable")

    def _send(self, method: str, url: str, body: IO[bytes] | bytes | None,
              headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:  # fmt: skip
        parsed = urllib.parse.urlsplit(url if "://" in url else f"https://{self.host}{url}")
        connection = http.client.HTTPSConnection(
            parsed.netloc, context=self._context(), timeout=120, blocksize=CHUNK
        )
        path = parsed.path + (f"?{parsed.query}" if parsed.query else "")
        try:
            connection.request(method, path, body=body, headers=headers)
            response = connection.getresponse()
            return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
        except ssl.SSLCertVerificationError as error:
            raise RegistryError(f"the registry {self.host} is not trusted: {error.verify_message}; give its CA "
                                "certificate (REGISTRY_CA=path)") from None  # fmt: skip
        except ssl.SSLError as error:
            raise RegistryError(f"the registry {self.host} does not speak TLS as expected ({error.reason}): "
                                "make release pushes over HTTPS only") from None  # fmt: skip
        except OSError as error:
            raise RegistryError(f"the registry {self.host} cannot be reached: {error}") from None
        finally:
            connection.close()

    def _token(self, challenge: str, scope: str) -> str:
        if not challenge.lower().startswith("bearer "):
            raise RegistryError(f"the registry {self.host} asks for credentials this client cannot give "
                                f"({challenge or 'no challenge'})")  # fmt: skip
        params = dict(re.findall(r'(\w+)="([^"]*)"', challenge))
        query = urllib.parse.urlencode(
            {"service": params.get("service", ""), "scope": params.get("scope", scope)}
        )
        headers = {}
        if self.username and self.password:
            basic = base64.b64encode(f"{self.username}:{self.password}".encode()).decode()
            headers["Authorization"] = f"Basic {basic}"
        status, _, data = self._send("GET", f"{params.get('realm', '')}?{query}", None, headers)
        if status != 200:
            raise RegistryError(f"the registry {self.host} refused the credentials (token endpoint said {status}); "
                                "set REGISTRY_USERNAME and REGISTRY_PASSWORD")  # fmt: skip
        try:
            answer = json.loads(data)
        except ValueError:
            raise RegistryError(f"the registry {self.host}'s token endpoint answered no JSON") from None
        return str(answer.get("token") or answer.get("access_token"))

    # -- what a release needs ---------------------------------------------------------------

    def ping(self) -> None:
        """Fail with one line unless the registry answers its API's base (any auth is fine)."""
        status, _, _ = self._send("GET", "/v2/", None, {})
        if status not in (200, 401):
            raise RegistryError(f"{self.host} answered {status} to GET /v2/: not an OCI registry")

    def has_blob(self, repository: str, digest: str) -> bool:
        status, _, _ = self.request("HEAD", f"/v2/{repository}/blobs/{digest}", scope=_scope(repository))
        return status == 200

    def put_blob(self, repository: str, digest: str, data: IO[bytes], size: int) -> None:
        scope = _scope(repository, push=True)
        status, headers, body = self.request(
            "POST", f"/v2/{repository}/blobs/uploads/", scope=scope, length=0
        )
        _expect(status, 202, f"opening an upload to {self.host}/{repository}", body)
        location = headers.get("location")
        if not location:
            raise RegistryError(f"{self.host} opened an upload without saying where (no Location header)")
        separator = "&" if "?" in location else "?"
        status, _, body = self.request("PUT", f"{location}{separator}digest={digest}", scope=scope, body=data,
                                       length=size, headers={"Content-Type": "application/octet-stream"})  # fmt: skip
        _expect(status, 201, f"uploading {digest[:19]} to {self.host}/{repository}", body)

    def put_manifest(self, repository: str, tag: str, media_type: str, manifest: bytes) -> str:
        scope = _scope(repository, push=True)
        status, headers, body = self.request("PUT", f"/v2/{repository}/manifests/{tag}", scope=scope,
                                             body=manifest, headers={"Content-Type": media_type})  # fmt: skip
        _expect(status, 201, f"putting the manifest {self.host}/{repository}:{tag}", body)
        return headers.get("docker-content-digest") or _digest(manifest)

    def manifest(self, repository: str, reference: str) -> tuple[str, dict[str, Any]]:
        """(digest, manifest) of a tag or digest; RegistryError when absent."""
        status, headers, body = self.request("GET", f"/v2/{repository}/manifests/{reference}",
                                             scope=_scope(repository), headers={"Accept": ACCEPT})  # fmt: skip
        _expect(status, 200, f"reading {self.host}/{repository}:{reference}", body)
        return headers.get("docker-content-digest") or _digest(body), json.loads(body)

    def blob(self, repository: str, digest: str) -> bytes:
        status, _, body = self.request("GET", f"/v2/{repository}/blobs/{digest}", scope=_scope(repository))
        _expect(status, 200, f"reading {digest[:19]} from {self.host}/{repository}", body)
        if _digest(body) != digest:
            raise RegistryError(f"{self.host}/{repository} served {digest[:19]} with other content")
        return body


def _scope(repository: str, push: bool = False) -> str:
    return f"repository:{repository}:{'pull,push' if push else 'pull'}"


def _digest(data: bytes) -> str:
    return f"sha256:{hashlib.sha256(data).hexdigest()}"


def _expect(status: int, wanted: int, what: str, body: bytes) -> None:
    if status != wanted:
        said = body.decode(errors="replace").strip().replace("\n", " ")[:300]
        raise RegistryError(f"{what}: the registry answered {status}: {said}")


# -- reading an OCI archive ----------------------------------------------------------------


def archive_blob(tar: tarfile.TarFile, digest: str) -> tuple[IO[bytes], int]:
    """A blob of an OCI archive, and its size."""
    info = tar.getmember(blob_path(digest))
    data = tar.extractfile(info)
    if data is None:
        raise RuntimeError(f"{tar.name} holds no blob {digest}")
    return data, info.size


def image_descriptor(tar: tarfile.TarFile, image: str | None = None) -> dict[str, Any]:
    """The index entry of ``image`` (by its ref.name annotation; the only one when None)."""
    found = tar.extractfile("index.json")
    if found is None:
        raise RuntimeError(f"{tar.name} holds no index.json")
    entries = json.load(found)["manifests"]
    if image is None:
        if len(entries) != 1:
            raise RuntimeError(f"{tar.name} holds {len(entries)} images; name the one to push")
        return dict(entries[0])
    for entry in entries:
        names = {entry.get("annotations", {}).get(key) for key in (REF_NAME, "io.containerd.image.name")}
        if image in names:
            return dict(entry)
    raise RuntimeError(f"{tar.name} holds no image named {image}")


def platform_manifests(tar: tarfile.TarFile, top: dict[str, Any]) -> list[dict[str, Any]]:
    """The descriptors of the image manifests ``top`` stands for: itself, or an index's entries."""
    if top["mediaType"] in INDEX_TYPES:
        return list(json.load(archive_blob(tar, top["digest"])[0])["manifests"])
    return [top]


# -- pushing from an OCI archive ------------------------------------------------------------


def push_archive(client: Client, archive: Path, target: Reference, image: str | None = None) -> str:
    """Push one image of an OCI archive (with every platform an index of it holds) as ``target``;
    its manifest's digest, which a pod can name as ``repository@digest``."""
    with tarfile.open(archive) as tar:
        top = image_descriptor(tar, image)
        for descriptor in platform_manifests(tar, top):
            manifest = json.load(archive_blob(tar, descriptor["digest"])[0])
            for blob in [manifest["config"], *manifest["layers"]]:
                if not client.has_blob(target.repository, blob["digest"]):
                    data, size = archive_blob(tar, blob["digest"])
                    client.put_blob(target.repository, blob["digest"], data, size)
            if descriptor is not top:  # an index's platforms go up by digest, then the index by tag
                raw, _ = archive_blob(tar, descriptor["digest"])
                client.put_manifest(
                    target.repository, descriptor["digest"], descriptor["mediaType"], raw.read()
                )
        raw, _ = archive_blob(tar, top["digest"])
        return client.put_manifest(target.repository, target.tag, top["mediaType"], raw.read())
