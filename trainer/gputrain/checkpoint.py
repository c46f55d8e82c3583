"""Checkpoints: complete or invisible, the newest K kept, the newest readable one loaded.

A checkpoint of step N is two objects in a location (:mod:`gputrain.storage`: a directory or a
bucket): its state, ``step-<8 digits>-<token>.pt``, then its manifest, ``step-<8 digits>.json``,
written last, which names that state and gives its size and SHA-256. A checkpoint is complete
when its manifest is there and the state it names matches it; readers see complete ones only.
So a save cut short at any point (SIGKILL, a store answering 503 until the grace period runs
out) leaves a state no manifest names, which nobody loads, and the last complete checkpoint in
place. The token makes each write's state an object of its own: two writers of the same step
(every pod's first rank at a preemption, on one bucket or ReadWriteMany volume; a periodic and
an end-of-epoch save of one step) never mix one's state with the other's manifest. Pruning
takes a manifest away before its state; states no manifest names go once a newer checkpoint is
complete.

A state named ``step-<8 digits>.pt`` with no token is complete alone: versions before manifests
wrote only that (renamed into place whole), and a copy of one into a bucket resumes too.

One that is complete but does not load (a bit flip, a copy truncated behind our back) is set
aside as ``*.unreadable`` with a warning, and the one before it is loaded. A store that fails
(:class:`~gputrain.storage.StorageError`) is not a corrupt checkpoint: it is raised.
"""

from __future__ import annotations

import datetime
import hashlib
import io
import json
import logging
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gputrain.contract import CHECKPOINT_MANIFEST, CHECKPOINT_STATE, complete_checkpoint_step
from gputrain.storage import Location, StorageError, open_location

log = logging.getLogger(__name__)

UNREADABLE = ".unreadable"


@dataclass(frozen=True)
class Saved:
    """One complete checkpoint."""

    step: int
    name: str  # the state object's name
    manifest: str | None  # None: a state from before manifests, complete alone
    uri: str  # where the state is, as status and logs show it
    time: str | None = None  # when it was saved (RFC 3339), from its manifest
    size: int | None = None  # the state's bytes and SHA-256, from its manifest
    sha256: str | None = None


def _manifest_name(step: int) -> str:
    return f"step-{step:08d}.json"


class CheckpointManager:
    """Saves, prunes and finds checkpoints in one location. What one holds is the trainer's to
    say (its components, :mod:`gputrain.state`): here a checkpoint is a dict of them."""

    def __init__(self, where: Location | str | Path, keep: int) -> None:
        self.location = open_location(str(where)) if isinstance(where, str | Path) else where
        self.keep = keep

    def checkpoints(self) -> list[Saved]:
        """Complete checkpoints, oldest first: one listing, and a read of each manifest."""
        return self._complete(self.location.names())

    def save(self, state: dict[str, Any], step: int) -> Saved:
        """Write the checkpoint of ``step`` (state, then manifest), then prune past ``keep``.
        Only older ones go: the one just written always stays, whatever else is there."""
        buffer = io.BytesIO()
        torch.save(state, buffer)
        data = buffer.getbuffer()
        name = f"step-{step:08d}-{secrets.token_hex(4)}.pt"
        self.location.write(name, data)
        time = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
        sha256 = hashlib.sha256(data).hexdigest()
        manifest = {"step": step, "time": time, "state": name, "size": len(data), "sha256": sha256}
        self.location.write(_manifest_name(step), json.dumps(manifest).encode())
        self._prune(step)
        return Saved(step, name, _manifest_name(step), self._uri(name), time, len(data), sha256)

    def load_latest(self) -> tuple[dict[str, Any], Saved] | None:
        """The newest complete checkpoint that loads, or None when there is none."""
        for saved in reversed(self.checkpoints()):
            try:
                data = self.location.read(saved.name)
                _check(data, saved)
                # weights_only: a file on a shared volume or bucket must not be able to run code here.
                state: dict[str, Any] = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            except FileNotFoundError:  # pruned by another writer since the listing
                continue
            except StorageError:  # the store failed, not the checkpoint: nothing to judge it by
                raise
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
            if CHECKPOINT_STATE.match(name) and (step := complete_checkpoint_step(name)) is not None:
                found.append(Saved(step, name, None, self._uri(name)))  # from before manifests
            elif CHECKPOINT_MANIFEST.match(name) and (saved := self._vouched(name, names)) is not None:
                found.append(saved)
        return sorted(found, key=lambda s: s.step)

    def _vouched(self, manifest: str, names: dict[str, int]) -> Saved | None:
        """The checkpoint ``manifest`` names, if its state is there; None for a manifest that is
        not one of ours, or whose state another writer's prune took since the listing."""
        try:
            fields = json.loads(self.location.read(manifest))
            step, state = int(fields["step"]), str(fields["state"])
            size, sha256, time = int(fields["size"]), str(fields["sha256"]), fields.get("time")
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("%s is not a checkpoint manifest (%s); ignored", self._uri(manifest), _one_line(exc))
            return None
        if state not in names or CHECKPOINT_STATE.match(state) is None:
            return None
        return Saved(step, state, manifest, self._uri(state), time if isinstance(time, str) else None,
                     size, sha256)  # fmt: skip

    def _prune(self, newest: int) -> None:
        names = self.location.names()
        complete = self._complete(names)
        older = [s for s in complete if s.step < newest]
        for old in older[: max(0, len(older) - (self.keep - 1))]:
            if old.manifest is not None:
                self.location.delete(old.manifest)  # invisible first, then gone
            self.location.delete(old.name)
        # States a cut save or a lost race left (no manifest names them), and manifests whose
        # state is gone: none of them can become complete now that a newer checkpoint is. (A
        # state from before manifests is complete, so among the kept.)
        kept = {s.name for s in complete} | {s.manifest for s in complete}
        for name in names.keys() - kept:
            match = CHECKPOINT_STATE.match(name) or CHECKPOINT_MANIFEST.match(name)
            if match and int(match.group(1)) < newest:
                self.location.delete(name)

    def _set_aside(self, saved: Saved) -> None:
        # Left in place, the newest unreadable one would push every new checkpoint out under
        # keep: 1. Another rank may have moved it already.
        for name in (saved.manifest, saved.name):
            if name is None:
                continue
            try:
                self.location.rename(name, name + UNREADABLE)
            except (OSError, StorageError) as exc:
                log.warning("could not set %s aside: %s", self._uri(name), _one_line(exc))

    def _uri(self, name: str) -> str:
        return f"{self.location.uri.rstrip('/')}/{name}"


def _check(data: bytes | memoryview, saved: Saved) -> None:
    if saved.manifest is None:  # from before manifests: nothing to check it against
        return
    if len(data) != saved.size:
        raise ValueError(f"{len(data)} bytes where its manifest says {saved.size}")
    if hashlib.sha256(data).hexdigest() != saved.sha256:
        raise ValueError("its SHA-256 differs from its manifest's")


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:300] or type(exc).__name__
