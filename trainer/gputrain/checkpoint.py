"""Checkpoints: written atomically, the newest K kept, the newest readable one loaded.

A checkpoint is ``step-<8 digits>.pt`` in the checkpoint directory. Writing goes to a
temporary file in the same directory, is fsynced, renamed over the final name and the
directory fsynced: a crash leaves either the old set or the new one, never half a file.
A newest checkpoint that still fails to load (a truncated copy, a full disk) is skipped
with a warning for the one before it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch

log = logging.getLogger(__name__)

_NAME = re.compile(r"^step-(\d{8,})\.pt$")


def _step(path: Path) -> int:
    match = _NAME.match(path.name)
    return int(match.group(1)) if match else -1


class CheckpointManager:
    """Saves, prunes and finds checkpoints in one directory. What one holds is the trainer's
    to say (its components, :mod:`gputrain.state`): here a checkpoint is a dict of them."""

    def __init__(self, directory: str | Path, keep: int) -> None:
        self.directory = Path(directory)
        self.keep = keep

    def checkpoints(self) -> list[Path]:
        """Existing checkpoints, oldest first."""
        if not self.directory.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.directory.iterdir() if (m := _NAME.match(p.name))]
        return [p for _, p in sorted(found)]

    def save(self, state: dict[str, Any], step: int) -> Path:
        """Write the checkpoint of ``step``, then prune the older ones past ``keep``. Only older
        ones: the one just written always stays, whatever else the directory holds."""
        final = self.directory / f"step-{step:08d}.pt"
        write_atomically(final, lambda handle: torch.save(state, handle))
        older = [p for p in self.checkpoints() if p != final and _step(p) < step]
        for old in older[: max(0, len(older) - (self.keep - 1))]:
            old.unlink(missing_ok=True)
        return final

    def load_latest(self) -> tuple[dict[str, Any], Path] | None:
        """The newest checkpoint that loads, or None when there is none.

        One that does not load is renamed ``*.unreadable`` (kept to look at, out of the set):
        left in place, as the newest it would push every new checkpoint out under ``keep: 1``.
        """
        for path in reversed(self.checkpoints()):
            try:
                # weights_only: a file on a shared volume must not be able to run code here.
                state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as exc:  # a corrupt file: any unpickling or zip error
                aside = path.with_name(path.name + ".unreadable")
                log.warning("checkpoint %s is unreadable (%s); moved to %s, trying the previous one",
                            path, exc, aside.name)  # fmt: skip
                with contextlib.suppress(OSError):  # another rank may have moved it already
                    path.rename(aside)
                continue
            return state, path
        return None


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
