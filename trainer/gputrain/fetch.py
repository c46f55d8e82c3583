"""The dataset step (``spec.dataset.uri``): a bucket prefix copied into the dataset's directory
before training, by an init container of the trainer's pod, so that the trainer (the built-in
one, or any code) reads local files as it does from a volume.

    python3 -m gputrain.fetch s3://bucket/datasets/cifar10 /data

- **Resumable.** Each object copied is recorded, with its size and ETag, by a line appended to
  ``<dir>/.gpuop-fetch.jsonl`` (one line per object: a million files cost a million short
  appends, not a million rewrites of one growing file); the journal is compacted when the
  step ends. A restarted step (the pod's container restarted, or a cache volume kept from an
  earlier run) copies only what is missing or changed, and removes what it copied that is no
  longer under the prefix.
- **Verified.** Every object's size; and its MD5 where the store's ETag looks like one (S3's,
  for an object uploaded in one part). An object whose MD5 is not its ETag is copied again: the
  same bytes twice mean the ETag is no MD5 (S3 with SSE-KMS or SSE-C), different bytes fail
  the step.
- **Bounded.** ``--concurrency`` objects at a time (8), each streamed to its file in 8 MiB
  chunks: memory stays at a few chunks per stream, whatever the dataset's size.
- **Said.** A progress line every ``--every`` seconds (objects, bytes, percent, rate), counted
  as bytes arrive, and one at the end; a failure is one line naming the URI and the fix, in the
  log and the container's termination message (:data:`~gputrain.contract.EXIT_FETCH`), where
  the operator reads it.

Folder markers (the zero-byte ``train/`` objects consoles and Hadoop make) are skipped.
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
from typing import Final, TextIO

from gputrain.contract import EXIT_FETCH, EXIT_OK, FAILURE_REASONS, Result
from gputrain.storage import Bucket, StorageError, StoredObject, is_bucket_uri, write_atomically

log = logging.getLogger("gputrain.fetch")

JOURNAL: Final = ".gpuop-fetch.jsonl"
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
    """Counts bytes as the copying threads write them, and says so every ``every`` seconds."""

    def __init__(self, objects: int, total: int, every: float) -> None:
        self.objects, self.total, self.every = objects, total, every
        self.done_objects, self.done_bytes, self.copied_bytes = 0, 0, 0
        self.started = self._said_at = time.monotonic()
        self._lock = threading.Lock()

    def arrived(self, count: int) -> None:
        with self._lock:
            self.done_bytes += count
            self.copied_bytes += count
            self._maybe_say()

    def finished(self, size: int, copied: bool) -> None:
        with self._lock:
            self.done_objects += 1
            if not copied:
                self.done_bytes += size
            self._maybe_say()

    def _maybe_say(self) -> None:
        now = time.monotonic()
        if now - self._said_at >= self.every:
            self._said_at = now
            self.say()

    def say(self) -> None:
        seconds = max(time.monotonic() - self.started, 1e-9)
        percent = min(100.0, 100.0 * self.done_bytes / self.total) if self.total else 100.0
        rate = _size(self.copied_bytes / seconds)
        log.info("fetched %d/%d objects, %s of %s (%.0f%%), %s/s", self.done_objects, self.objects,
                 _size(self.done_bytes), _size(self.total), percent, rate)  # fmt: skip


def fetch(uri: str, directory: Path, concurrency: int = 8, every: float = 5.0) -> Fetched:
    """Copy every object under ``uri`` into ``directory``, keeping the paths below the prefix."""
    started = time.monotonic()
    bucket = Bucket(uri)
    listed = _files(bucket.tree())
    directory.mkdir(parents=True, exist_ok=True)
    journal_path = directory / JOURNAL
    state = _read_journal(journal_path)
    for gone in sorted(set(state) - set(listed)):  # copied by an earlier step, since removed upstream
        with contextlib.suppress(StorageError):  # a name that was never a file here: nothing to remove
            _inside(directory, gone).unlink(missing_ok=True)
        del state[gone]
    _write_journal(journal_path, state)  # compacted: one line per object present
    wanted = {n: obj for n, obj in listed.items() if not _present(directory, n, obj, state.get(n))}
    progress = _Progress(len(listed), sum(o.size for o in listed.values()), every)
    for name, obj in listed.items():
        if name not in wanted:
            progress.finished(obj.size, copied=False)
    log.info("fetching %s into %s: %d objects, %s (%d there already)", bucket.uri, directory, len(listed),
             _size(progress.total), len(listed) - len(wanted))  # fmt: skip
    lock = threading.Lock()
    with journal_path.open("a", encoding="utf-8") as journal:

        def copy(name: str, obj: StoredObject) -> None:
            _copy_verified(bucket, name, obj, _inside(directory, name), progress)
            _record(journal, lock, name, obj)
            progress.finished(obj.size, copied=True)

        with concurrent.futures.ThreadPoolExecutor(max_workers=concurrency) as pool:
            futures = [pool.submit(copy, name, obj) for name, obj in sorted(wanted.items())]
            try:
                for future in concurrent.futures.as_completed(futures):
                    future.result()
            except BaseException:
                for future in futures:
                    future.cancel()
                raise
    _write_journal(journal_path, {**state, **{n: _entry(o) for n, o in wanted.items()}})
    progress.say()
    seconds = time.monotonic() - started
    return Fetched(len(listed), len(wanted), progress.total, progress.copied_bytes, seconds)


def _files(tree: dict[str, StoredObject]) -> dict[str, StoredObject]:
    """The objects that are files: not the folder markers (a zero-byte object whose name is a
    folder of other names, or the prefix itself: the store lists ``train/`` as ``train``), nor
    an object that would overwrite the journal."""
    folders = {name.rsplit("/", 1)[0] for name in tree if "/" in name}
    folders |= {parent for folder in folders for parent in _parents(folder)}
    return {n: o for n, o in tree.items()
            if n and n != JOURNAL and not (o.size == 0 and (n in folders or n.endswith("/")))}  # fmt: skip


def _parents(folder: str) -> list[str]:
    parts = folder.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]


def _copy_verified(bucket: Bucket, name: str, obj: StoredObject, path: Path, progress: _Progress) -> None:
    expected = _MD5.match(obj.etag or "") if bucket.uri.startswith("s3://") else None
    md5s: list[str] = []
    while True:
        try:
            md5s.append(bucket.download(name, path, progress.arrived))
        except FileNotFoundError:
            raise StorageError(f"{bucket.uri}/{name}: listed, then gone; was the prefix being rewritten? "
                               "Fetch again") from None  # fmt: skip
        size = path.stat().st_size
        if size != obj.size:
            problem = f"{size} bytes came, the listing said {obj.size}"
        elif expected is None or md5s[-1] == expected.group(1):
            return
        elif len(md5s) == 2 and md5s[0] == md5s[1]:
            return  # the same bytes twice: the ETag is no MD5 (SSE-KMS, SSE-C), the copy is right
        else:
            problem = f"its MD5 is {md5s[-1]}, its ETag says {expected.group(1)}"
        if len(md5s) == 2:
            path.unlink(missing_ok=True)
            raise StorageError(f"{bucket.uri}/{name}: {problem} (twice); was it being rewritten? Fetch again")
        log.warning("%s/%s: %s; copying it again", bucket.uri, name, problem)


def _entry(obj: StoredObject) -> dict[str, object]:
    return {"size": obj.size, "etag": obj.etag}


def _record(journal: TextIO, lock: threading.Lock, name: str, obj: StoredObject) -> None:
    """One line, flushed: a step killed after it keeps this object; one killed before copies it again."""
    line = json.dumps({"name": name, **_entry(obj)}) + "\n"
    with lock:
        journal.write(line)
        journal.flush()


def _present(directory: Path, name: str, obj: StoredObject, recorded: dict[str, object] | None) -> bool:
    """Whether an earlier step copied this very object (same size and ETag) and its file is whole."""
    if recorded is None or recorded.get("size") != obj.size or recorded.get("etag") != obj.etag:
        return False
    path = _inside(directory, name)
    return path.is_file() and path.stat().st_size == obj.size


def _inside(directory: Path, name: str) -> Path:
    """``name``'s file in ``directory``; a key that would climb out of it is refused."""
    path = (directory / name).resolve()
    if not path.is_relative_to(directory.resolve()) or path == directory.resolve():
        raise StorageError(f"{name!r}: not a file name below the prefix; rename the object in the bucket")
    return path


def _read_journal(path: Path) -> dict[str, dict[str, object]]:
    """The journal's entries, the last line of each name winning; a torn last line is skipped."""
    state: dict[str, dict[str, object]] = {}
    with contextlib.suppress(OSError), path.open(encoding="utf-8", errors="replace") as lines:
        for line in lines:
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict) and isinstance(entry.get("name"), str):
                state[entry.pop("name")] = entry
    return state


def _write_journal(path: Path, state: dict[str, dict[str, object]]) -> None:
    text = "".join(json.dumps({"name": name, **entry}) + "\n" for name, entry in sorted(state.items()))
    write_atomically(path, lambda handle: handle.write(text.encode()))


def _size(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024:
            return f"{count:.1f} {unit}" if unit != "B" else f"{count:.0f} B"
        count /= 1024
    return f"{count:.1f} TiB"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m gputrain.fetch", description=__doc__.split("\n\n")[0])
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
            raise StorageError(f"{args.uri}: not an s3://, gs:// or az:// URI", refused=True)
        done = fetch(args.uri, args.directory, max(1, args.concurrency), args.every)
    except (StorageError, OSError) as exc:  # OSError: the cache's disk (full, read-only)
        message = str(exc)
        if not isinstance(exc, StorageError):
            message = f"{exc.filename or args.directory}: {exc.strerror or exc}; check the dataset volume"
        log.error("%s", message)
        refused = isinstance(exc, StorageError) and exc.refused
        record = Result(phase="Failed", reason=FAILURE_REASONS[EXIT_FETCH], message=message[:3000],
                        permanent=refused)  # fmt: skip
        with contextlib.suppress(OSError):  # outside a pod there may be none; the log line says it all
            Path(args.termination_log).write_text(record.to_json())
        return EXIT_FETCH
    log.info("fetched %d objects (%d copied, %s) in %.1f s", done.objects, done.copied,
             _size(done.bytes_copied), done.seconds)  # fmt: skip
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
