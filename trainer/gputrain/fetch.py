"""The dataset step (``spec.dataset.uri``): a bucket prefix copied into the dataset's directory
before training, by an init container of the trainer's pod, so that the trainer (the built-in
one, or any code) reads local files as it does from a volume.

    python -m gputrain.fetch s3://bucket/datasets/cifar10 /data

- **Resumable.** What is copied is recorded, per object with its size and ETag, in
  ``<dir>/.gpuop-fetch.json`` as it goes; a restarted step (the pod's container restarted, or a
  cache volume kept from an earlier run) copies only what is missing or changed. An object no
  longer under the prefix is removed from the directory, if this step copied it.
- **Verified.** Every object's size; and its MD5 where the store's ETag is one (S3's, for an
  object uploaded in one part). A mismatch is retried once, then fails the step.
- **Bounded.** ``--concurrency`` objects at a time (8), each streamed to its file in 8 MiB
  chunks: memory stays at a few chunks per stream, whatever the dataset's size.
- **Said.** A progress line every ``--every`` seconds (objects, bytes, percent, rate), and one
  at the end; a failure is one line naming the URI and the fix, in the log and the container's
  termination message (:data:`~gputrain.contract.EXIT_FETCH`), where the operator reads it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import logging
import re
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from gputrain.contract import EXIT_FETCH, EXIT_OK, FAILURE_REASONS, Result
from gputrain.storage import Bucket, StorageError, StoredObject, is_bucket_uri, write_atomically

log = logging.getLogger("gputrain.fetch")

STATE_FILE: Final = ".gpuop-fetch.json"
_MD5: Final = re.compile(r'^"?([0-9a-f]{32})"?$')


@dataclass(frozen=True)
class Fetched:
    """What one step did."""

    objects: int  # under the prefix
    copied: int  # copied now (the rest were there already)
    bytes_total: int
    bytes_copied: int
    seconds: float


class _Progress:
    """Counts what the copying threads finish, and says so every ``every`` seconds."""

    def __init__(self, objects: int, total: int, every: float) -> None:
        self.objects, self.total, self.every = objects, total, every
        self.done_objects, self.done_bytes = 0, 0
        self.copied_bytes = 0
        self.started = self._said_at = time.monotonic()
        self._lock = threading.Lock()

    def add(self, size: int, copied: bool) -> None:
        with self._lock:
            self.done_objects += 1
            self.done_bytes += size
            self.copied_bytes += size if copied else 0
            now = time.monotonic()
            if now - self._said_at >= self.every:
                self._said_at = now
                self.say()

    def say(self) -> None:
        seconds = max(time.monotonic() - self.started, 1e-9)
        percent = 100.0 * self.done_bytes / self.total if self.total else 100.0
        rate = _size(self.copied_bytes / seconds)
        log.info("fetched %d/%d objects, %s of %s (%.0f%%), %s/s", self.done_objects, self.objects,
                 _size(self.done_bytes), _size(self.total), percent, rate)  # fmt: skip


def fetch(uri: str, directory: Path, concurrency: int = 8, every: float = 5.0) -> Fetched:
    """Copy every object under ``uri`` into ``directory``, keeping the paths below the prefix."""
    started = time.monotonic()
    bucket = Bucket(uri)
    listed = bucket.tree()
    directory.mkdir(parents=True, exist_ok=True)
    state_path = directory / STATE_FILE
    state = _read_state(state_path)
    for gone in sorted(set(state) - set(listed)):  # copied by an earlier step, since removed upstream
        _inside(directory, gone).unlink(missing_ok=True)
        del state[gone]
    wanted = {n: obj for n, obj in listed.items() if not _present(directory, n, obj, state.get(n))}
    progress = _Progress(len(listed), sum(o.size for o in listed.values()), every)
    for name, obj in listed.items():
        if name not in wanted:
            progress.add(obj.size, copied=False)
    log.info("fetching %s into %s: %d objects, %s (%d there already)", bucket.uri, directory, len(listed),
             _size(progress.total), len(listed) - len(wanted))  # fmt: skip
    lock = threading.Lock()

    def copy(name: str, obj: StoredObject) -> None:
        _copy_verified(bucket, name, obj, _inside(directory, name))
        with lock:
            state[name] = {"size": obj.size, "etag": obj.etag}
            _write_state(state_path, state)  # each object recorded as it lands: a restart skips it
        progress.add(obj.size, copied=True)

    with concurrent.futures.ThreadPoolExecutor(max_workers=concurrency) as pool:
        futures = [pool.submit(copy, name, obj) for name, obj in sorted(wanted.items())]
        try:
            for future in concurrent.futures.as_completed(futures):
                future.result()
        except BaseException:
            for future in futures:
                future.cancel()
            raise
    _write_state(state_path, state)
    progress.say()
    seconds = time.monotonic() - started
    return Fetched(len(listed), len(wanted), progress.total, progress.copied_bytes, seconds)


def _copy_verified(bucket: Bucket, name: str, obj: StoredObject, path: Path) -> None:
    expected = _MD5.match(obj.etag or "") if bucket.uri.startswith("s3://") else None
    for attempt in (1, 2):
        md5 = bucket.download(name, path)
        size = path.stat().st_size
        problem = None
        if size != obj.size:
            problem = f"{size} bytes came, the listing said {obj.size}"
        elif expected is not None and md5 != expected.group(1):
            problem = f"its MD5 is {md5}, its ETag says {expected.group(1)}"
        if problem is None:
            return
        path.unlink(missing_ok=True)
        if attempt == 2:
            raise StorageError(f"{bucket.uri}/{name}: {problem} (twice); was it being rewritten? Fetch again")
        log.warning("%s/%s: %s; copying it again", bucket.uri, name, problem)


def _present(directory: Path, name: str, obj: StoredObject, recorded: dict[str, object] | None) -> bool:
    """Whether an earlier step copied this very object (same size and ETag) and its file is whole."""
    if recorded is None or recorded.get("size") != obj.size or recorded.get("etag") != obj.etag:
        return False
    path = _inside(directory, name)
    return path.is_file() and path.stat().st_size == obj.size


def _inside(directory: Path, name: str) -> Path:
    """``name``'s file in ``directory``; a key that would climb out of it is refused."""
    path = (directory / name).resolve()
    if not path.is_relative_to(directory.resolve()) or name.endswith("/"):
        raise StorageError(f"{name!r}: not a file name below the prefix; rename the object in the bucket")
    return path


def _read_state(path: Path) -> dict[str, dict[str, object]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, dict)} if isinstance(data, dict) else {}


def _write_state(path: Path, state: dict[str, dict[str, object]]) -> None:
    text = json.dumps(state, sort_keys=True).encode()
    write_atomically(path, lambda handle: handle.write(text))


def _size(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024:
            return f"{count:.1f} {unit}" if unit != "B" else f"{count:.0f} B"
        count /= 1024
    return f"{count:.1f} TiB"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gputrain.fetch", description=__doc__.split("\n\n")[0])
    parser.add_argument("uri", help="s3://, gs:// or az:// prefix to copy")
    parser.add_argument("directory", type=Path, help="where to copy it (the dataset's path)")
    parser.add_argument("--concurrency", type=int, default=8, help="objects copied at a time")
    parser.add_argument("--every", type=float, default=5.0, help="seconds between progress lines")
    parser.add_argument("--termination-log", default="/dev/termination-log")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s fetch %(levelname)s %(message)s",
                        stream=sys.stdout)  # fmt: skip
    try:
        if not is_bucket_uri(args.uri):
            raise StorageError(f"{args.uri}: not an s3://, gs:// or az:// URI")
        done = fetch(args.uri, args.directory, max(1, args.concurrency), args.every)
    except StorageError as exc:
        log.error("%s", exc)
        record = Result(phase="Failed", reason=FAILURE_REASONS[EXIT_FETCH], message=str(exc)[:3000])
        with contextlib.suppress(OSError):  # outside a pod there may be none; the log line says it all
            Path(args.termination_log).write_text(record.to_json())
        return EXIT_FETCH
    log.info("fetched %d objects (%d copied, %s) in %.1f s", done.objects, done.copied,
             _size(done.bytes_copied), done.seconds)  # fmt: skip
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
