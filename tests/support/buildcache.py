"""Things the tests build once per content and keep outside the work tree (images, bases),
and the rule every one of them follows. The Go binaries keep the same rule in
:mod:`support.plane.gobuild`, keyed by their modules.

``<directory>/<name>-<hash of its inputs><suffix>`` (a file or a directory): built once under an
flock, so two processes asking at once build it once; built in a staging directory beside it and
renamed into place, so it appears whole or not at all (a build killed half-way leaves only a
``.building-*`` directory, removed by the next build); the previous version of the same name is
deleted once the new one is in place (a base is 77 MB, an operator image 103 MB).
"""

from __future__ import annotations

import fcntl
import hashlib
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

from support.node import hoststate
from support.plane import gobuild


def directory(kind: str) -> Path:
    """``<cache>/<kind>``: "images", "node-images"."""
    return gobuild.cache_root() / kind


def key(parts: Iterable[bytes]) -> str:
    """12 hex digits of a SHA-256 over ``parts``, each length-prefixed (no two lists collide)."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(len(part).to_bytes(8, "big") + part)
    return digest.hexdigest()[:12]


def ensure(root: Path, name: str, inputs: str, build: Callable[[Path], None], suffix: str = "") -> Path:
    """``<root>/<name>-<inputs><suffix>``, made by ``build(path)`` first when missing.

    ``build`` writes ``path`` (a file or a directory; it does not exist yet) inside a staging
    directory of its own, which it may use for scratch files too.
    """
    target = root / f"{name}-{inputs}{suffix}"
    if target.exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with (root / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same thing
        if target.exists():
            return target
        for abandoned in root.glob(".building-*"):  # a build killed half-way (we hold the lock)
            _remove(abandoned)
        staging = Path(tempfile.mkdtemp(prefix=".building-", dir=root))
        try:
            build(staging / target.name)
            (staging / target.name).rename(target)
        finally:
            _remove(staging)
        # Earlier builds of this name alone: "prometheus-<key>", not "prometheus-config-reloader-<key>".
        earlier = re.compile(rf"{re.escape(name)}-[0-9a-f]{{{len(inputs)}}}{re.escape(suffix)}")
        for old in root.glob(f"{name}-*{suffix}"):
            if old == target or not earlier.fullmatch(old.name):
                continue
            if old.is_dir():
                shutil.rmtree(old)
            else:
                old.unlink()
    return target


def _remove(staging: Path) -> None:
    """Remove a staging directory, unmounting first: debootstrap mounts /proc and /sys in the
    root it makes (and /dev, in a container), and rmtree would descend into the machine's."""
    hoststate.unmount_all_under(staging)
    shutil.rmtree(staging, ignore_errors=True)
