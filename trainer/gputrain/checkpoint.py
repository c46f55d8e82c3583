"""Checkpoints: complete or invisible, the newest K kept, the newest readable one loaded.

A checkpoint of step N is two objects in a location (:mod:`gputrain.storage`: a directory or a
bucket): its state, ``step-<8 digits>.pt``, then its manifest, ``step-<8 digits>.json``, written
last, with the state's size and SHA-256. A checkpoint is complete when its manifest is there and
its state matches it; readers see complete ones only. So a save cut short at any point (SIGKILL,
a store answering 503 until the grace period runs out) leaves a state with no manifest, which
nobody loads, and the last complete checkpoint in place. Pruning takes the manifest away first.

A state file with no manifest in a directory is complete too: versions before manifests wrote
only that, and a directory's rename never shows half a file. In a bucket it is what a cut save
leaves, and is deleted once a newer checkpoint is complete.

One that is complete but does not load (a bit flip, a copy truncated behind our back) is set
aside as ``*.unreadable`` with a warning, and the one before it is loaded.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import io
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gputrain.storage import Directory, Location, open_location

log = logging.getLogger(__name__)

_STATE = re.compile(r"^step-(\d{8,})\.pt$")
_MANIFEST = re.compile(r"^step-(\d{8,})\.json$")
UNREADABLE = ".unreadable"


@dataclass(frozen=True)
class Saved:
    """One complete checkpoint."""

    step: int
    name: str  # the state object's name
    manifest: str | None  # None: a directory's state file from before manifests
    uri: str  # where the state is, as status and logs show it
    time: str | None = None  # when it was saved (RFC 3339), from its manifest


def _state_name(step: int) -> str:
    return f"step-{step:08d}.pt"


def _manifest_name(step: int) -> str:
    return f"step-{step:08d}.json"


class CheckpointManager:
    """Saves, prunes and finds checkpoints in one location. What one holds is the trainer's to
    say (its components, :mod:`gputrain.state`): here a checkpoint is a dict of them."""

    def __init__(self, where: Location | str | Path, keep: int) -> None:
        self.location = open_location(str(where)) if isinstance(where, str | Path) else where
        self.keep = keep
        # A state with no manifest is complete only where writes are renames (see the docstring).
        self._bare_states_complete = isinstance(self.location, Directory)

    def checkpoints(self) -> list[Saved]:
        """Complete checkpoints, oldest first (one listing of the location)."""
        return self._complete(self.location.names())

    def save(self, state: dict[str, Any], step: int) -> Saved:
        """Write the checkpoint of ``step`` (state, then manifest), then prune past ``keep``.
        Only older ones go: the one just written always stays, whatever else is there."""
        buffer = io.BytesIO()
        torch.save(state, buffer)
        data = buffer.getbuffer().tobytes()
        name = _state_name(step)
        self.location.write(name, data)
        time = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
        manifest = {"step": step, "time": time, "state": name, "size": len(data),
                    "sha256": hashlib.sha256(data).hexdigest()}  # fmt: skip
        self.location.write(_manifest_name(step), json.dumps(manifest).encode())
        saved = Saved(step, name, _manifest_name(step), self._uri(name), time)
        self._prune(step)
        return saved

    def load_latest(self) -> tuple[dict[str, Any], Saved] | None:
        """The newest complete checkpoint that loads, or None when there is none."""
        for saved in reversed(self.checkpoints()):
            try:
                data = self.location.read(saved.name)
                if saved.manifest is not None:
                    manifest = json.loads(self.location.read(saved.manifest))
                    _check(data, manifest)
                    saved = dataclasses.replace(saved, time=manifest.get("time"))
                # weights_only: a file on a shared volume or bucket must not be able to run code here.
                state: dict[str, Any] = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            except FileNotFoundError:  # pruned by another writer since the listing
                continue
            except Exception as exc:  # a corrupt checkpoint: any unpickling, zip or manifest error
                log.warning("checkpoint %s is unreadable (%s); set aside as %s, trying the previous one",
                            saved.uri, _one_line(exc), saved.name + UNREADABLE)  # fmt: skip
                self._set_aside(saved)
                continue
            return state, saved
        return None

    def _complete(self, names: dict[str, int]) -> list[Saved]:
        found: list[Saved] = []
        for name in names:
            if (match := _STATE.match(name)) is None:
                continue
            step = int(match.group(1))
            manifest = _manifest_name(step)
            if manifest in names:
                found.append(Saved(step, name, manifest, self._uri(name)))
            elif self._bare_states_complete:
                found.append(Saved(step, name, None, self._uri(name)))
        return sorted(found, key=lambda s: s.step)

    def _prune(self, newest: int) -> None:
        names = self.location.names()
        complete = [s for s in self._complete(names) if s.step < newest]
        for old in complete[: max(0, len(complete) - (self.keep - 1))]:
            if old.manifest is not None:
                self.location.delete(old.manifest)  # invisible first, then gone
            self.location.delete(old.name)
        if self._bare_states_complete:
            return
        # States a cut save left in a bucket: none can become complete now that a newer one is.
        for name in names:
            match = _STATE.match(name)
            if match and int(match.group(1)) < newest and _manifest_name(int(match.group(1))) not in names:
                self.location.delete(name)

    def _set_aside(self, saved: Saved) -> None:
        # Left in place, the newest unreadable one would push every new checkpoint out under
        # keep: 1. Another rank may have moved it already.
        for name in (saved.manifest, saved.name):
            if name is None:
                continue
            try:
                self.location.rename(name, name + UNREADABLE)
            except (OSError, RuntimeError):
                log.debug("could not set %s aside", name, exc_info=True)

    def _uri(self, name: str) -> str:
        return f"{self.location.uri.rstrip('/')}/{name}"


def _check(data: bytes, manifest: dict[str, Any]) -> None:
    if len(data) != manifest.get("size"):
        raise ValueError(f"{len(data)} bytes where its manifest says {manifest.get('size')}")
    if hashlib.sha256(data).hexdigest() != manifest.get("sha256"):
        raise ValueError("its SHA-256 differs from its manifest's")


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:300] or type(exc).__name__
