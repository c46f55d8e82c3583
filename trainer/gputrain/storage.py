"""Where checkpoints and outputs live: a directory (a volume) or a bucket (S3, GCS, Azure Blob).

Both are a flat set of named objects with the one promise the checkpoint manager builds on: an
object written is either wholly there or not there at all. A directory keeps it by writing a
temporary file, fsyncing it and renaming it over the name; a bucket keeps it by itself (a PUT,
or a multipart upload's completion, publishes the whole object at once).

Buckets go through obstore (the Rust ``object_store`` crate that DataFusion, Polars and Delta
Lake use): one wheel with no Python dependencies, the three clouds behind one API, the standard
credential chain of each (the ``AWS_*``, ``GOOGLE_*`` and ``AZURE_*`` variables, IRSA and EKS
Pod Identity, GKE's metadata server, Azure Workload Identity) and retries of 5xx answers and
dropped connections with backoff. fsspec with s3fs, gcsfs and adlfs would be three packages
with their own dependency trees (aiobotocore pins botocore) to do the same.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Final, Protocol

if TYPE_CHECKING:
    from obstore.store import BackoffConfig, ClientConfig, ObjectStore, RetryConfig

SCHEMES: Final = ("s3", "gs", "az")

# Endpoints of S3-compatible stores (MinIO, SeaweedFS, Ceph's RGW, a local server): the first of
# these that is set names it. Read here only to know whether it is plain HTTP, which obstore
# refuses unless told (a real cloud endpoint is always HTTPS).
_ENDPOINT_VARIABLES: Final = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT")


class StorageError(RuntimeError):
    """A store refused or could not be reached: one line that names the location and the fix.

    ``refused``: the store answered, and its answer holds until a person changes something
    (access denied, no such bucket, a URI it cannot take), so trying again later meets the same
    answer. A store that was down or slow past its retries is not refused: it may be back.
    """

    def __init__(self, message: str, *, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


class Location(Protocol):
    """A flat set of named objects. Names have no slashes; each object is whole or absent."""

    @property
    def uri(self) -> str:
        """Where it is, as a user wrote it: shown in logs, messages and status."""
        ...

    def names(self) -> dict[str, int]:
        """Every object here, by name, with its size in bytes."""
        ...

    def read(self, name: str) -> bytes: ...

    def write(self, name: str, data: bytes | memoryview) -> None:
        """Publish ``data`` as ``name`` at once: a reader sees the old object or the new one."""
        ...

    def delete(self, name: str) -> None:
        """Remove ``name``; one already gone is not an error."""
        ...

    def rename(self, name: str, new_name: str) -> None: ...


def is_bucket_uri(where: str) -> bool:
    return where.partition("://")[0] in SCHEMES and "://" in where


def open_location(where: str) -> Location:
    """A bucket for ``s3://``, ``gs://`` and ``az://`` URIs, a directory for anything else."""
    return Bucket(where) if is_bucket_uri(where) else Directory(Path(where))


@dataclass
class Directory:
    """A directory on a local or mounted file system."""

    path: Path

    @property
    def uri(self) -> str:
        return str(self.path)

    def names(self) -> dict[str, int]:
        if not self.path.is_dir():
            return {}
        found: dict[str, int] = {}
        for entry in os.scandir(self.path):
            if entry.is_file() and not entry.name.startswith("."):  # "." : a write in progress
                found[entry.name] = entry.stat().st_size
        return found

    def read(self, name: str) -> bytes:
        return (self.path / name).read_bytes()

    def write(self, name: str, data: bytes | memoryview) -> None:
        write_atomically(self.path / name, lambda handle: handle.write(data))

    def delete(self, name: str) -> None:
        (self.path / name).unlink(missing_ok=True)

    def rename(self, name: str, new_name: str) -> None:
        os.replace(self.path / name, self.path / new_name)


@dataclass(frozen=True)
class StoredObject:
    """An object as a listing shows it."""

    size: int
    etag: str | None  # the store's; S3 gives the MD5 of a single-part upload, in quotes


class Bucket:
    """A prefix in an object store bucket, reached with the credentials the process's
    environment gives (obstore reads the variables itself)."""

    def __init__(self, uri: str) -> None:
        from obstore.store import from_url

        self.uri = uri.rstrip("/")
        endpoint = next((os.environ[v] for v in _ENDPOINT_VARIABLES if os.environ.get(v)), "")
        # obstore's 30 s for a whole request would fail a large state's GET; a stalled read, and
        # a connection not made, fail fast instead (and are retried).
        options: ClientConfig = {"timeout": "30min", "read_timeout": "60s", "connect_timeout": "10s"}
        if endpoint.startswith("http://"):
            options["allow_http"] = True
        # A store that throttles (503 SlowDown) or fails over does so for seconds to minutes;
        # obstore's default (10 retries from 100 ms) gives up within about 3 s. From 0.5 s,
        # doubling to 15 s, a request is retried for up to 2 minutes. The cost: a save to a store
        # that is down holds the loop that long (then it is a warning, and training goes on).
        second = datetime.timedelta(seconds=1)
        backoff: BackoffConfig = {"init_backoff": second / 2, "max_backoff": 15 * second, "base": 2}
        retry: RetryConfig = {"max_retries": 20, "retry_timeout": 120 * second, "backoff": backoff}
        try:
            self._store: ObjectStore = from_url(self.uri, client_options=options, retry_config=retry)
        except Exception as exc:  # obstore says what is wrong with the URI or the configuration
            raise StorageError(f"{self.uri}: {_first_line(exc)}", refused=True) from None

    def names(self) -> dict[str, int]:
        # Deeper keys belong to someone else.
        return {name: obj.size for name, obj in self.tree().items() if "/" not in name}

    def read(self, name: str) -> bytes:
        import obstore

        with self._calls(f"read {name}"):
            return bytes(obstore.get(self._store, name).bytes())

    def tree(self) -> dict[str, StoredObject]:
        """Every object under the prefix, at any depth, by its path below it (a dataset's
        ``train/cat/1.jpg``), with its size and ETag."""
        import obstore

        found: dict[str, StoredObject] = {}
        with self._calls("list"):
            for chunk in obstore.list(self._store):
                for meta in chunk:
                    found[meta["path"]] = StoredObject(meta["size"], meta["e_tag"])
        return found

    def download(self, name: str, path: Path, arrived: Callable[[int], None] | None = None) -> str:
        """Stream object ``name`` into ``path`` (whole or absent, as :func:`write_atomically`
        leaves a file) without holding it in memory, calling ``arrived`` with each chunk's size;
        the MD5 of what came, in hex."""
        import obstore

        digest = hashlib.md5(usedforsecurity=False)

        def copy(handle: BinaryIO) -> None:
            for chunk in obstore.get(self._store, name).stream(min_chunk_size=8 * 2**20):
                digest.update(chunk)
                handle.write(chunk)
                if arrived is not None:
                    arrived(len(chunk))

        with self._calls(f"read {name}"):
            write_atomically(path, copy)
        return digest.hexdigest()

    def write(self, name: str, data: bytes | memoryview) -> None:
        import obstore

        with self._calls(f"write {name}"):
            obstore.put(self._store, name, data)

    def delete(self, name: str) -> None:
        import obstore

        with contextlib.suppress(FileNotFoundError), self._calls(f"delete {name}"):
            obstore.delete(self._store, name)  # S3 says 204 for a missing key; GCS and Azure 404

    def rename(self, name: str, new_name: str) -> None:
        import obstore

        with self._calls(f"rename {name}"):
            obstore.rename(self._store, name, new_name)

    @contextlib.contextmanager
    def _calls(self, what: str) -> Iterator[None]:
        """Turns obstore's errors into a StorageError of one line that says what to check."""
        try:
            yield
        except Exception as exc:
            if isinstance(exc, FileNotFoundError) and "NoSuchBucket" not in str(exc):
                raise  # a missing object is the caller's to judge, as with files
            advice, refused = _advice(exc)
            raise StorageError(f"{self.uri}: {what} failed: {advice}", refused=refused) from None


def _advice(exc: Exception) -> tuple[str, bool]:
    """What the store said, in one line with what to check, and whether it refused (an answer
    that holds until someone changes the credentials, the bucket or the URI)."""
    from obstore import exceptions

    whole = str(exc)
    # The store's own error code (S3's XML <Code>) says it best; obstore's first line is a URL.
    code = re.search(r"<Code>([^<]{1,64})</Code>", whole)
    text = code.group(1) if code else _first_line(exc)
    if isinstance(exc, exceptions.UnauthenticatedError | exceptions.PermissionDeniedError) or any(
        code in whole
        for code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403 Forbidden")
    ):
        return (f"access denied ({text}); check the credentials (the Secret in spec.checkpoint.secretName, "
                "or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY) and that they may read and write "
                "here"), True  # fmt: skip
    if "NoSuchBucket" in whole or "ContainerNotFound" in whole:
        return "the bucket does not exist; create it or correct the URI", True
    return text, False


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0][:500] if lines else type(exc).__name__


def write_atomically(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Write ``path`` so that a crash leaves the old file or the new one, never half of one.

    A temporary file in the same directory is written, fsynced and renamed over ``path``,
    then the directory is fsynced so the rename itself survives a power loss.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
