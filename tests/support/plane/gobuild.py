"""Go binaries the tests run, built from pinned Go modules with the ordinary ``go`` client.

Each :class:`Recipe` names a tools module under tests/ (go.mod + go.sum committed) and the
packages to build from it. The binaries land outside the work tree, in
``<cache>/<recipe>/<key>-<hash of go.mod, go.sum and the link flags>/``, so a version bump
rebuilds, a second run finds them in milliseconds, and an flock lets several processes ask at
once. A build's directory appears whole (it is renamed into place) or not at all.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Final

Say = Callable[[str], None]
# Every go command here: this machine's Go only, and go.mod/go.sum as committed.
GO_ENV: Final = {"GOFLAGS": "-mod=readonly", "GOTOOLCHAIN": "local"}


def say_on_stderr(message: str) -> None:
    print(f"gobuild: {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Recipe:
    """What to build from one tools module, and how."""

    name: str  # the cache subdirectory: "controlplane", "kubeflow"
    module: Path  # the directory holding go.mod and go.sum
    packages: Mapping[str, str]  # binary name -> Go package
    label: str  # the readable part of the cache key: "k8s-v1.35.4-etcd-v3.6.5"
    cold_cost: str  # what a build with empty Go caches cost when measured, for the progress line
    ldflags: str = "-s -w"
    # `go build -o DIR/` names a /vN package after its parent directory (etcd's …/server/v3
    # comes out as "server"): built name -> binary name.
    renames: Mapping[str, str] = field(default_factory=dict)
    # Pure Go unless a package needs C (runc's nsenter runs before the Go runtime starts); a cgo
    # build also needs gcc and the C headers of what the tags link.
    cgo: bool = False
    tags: str = ""  # go build -tags, comma-separated
    # Go files of our own built from the module (a stand-in's source): their text is in the key.
    sources: tuple[Path, ...] = ()

    def directory(self) -> Path:
        # What changes the binaries changes the key: flags, packages, cgo and tags, go.mod, go.sum,
        # and our own sources.
        how = [self.ldflags, self.tags, str(self.cgo), *sorted(f"{k}={v}" for k, v in self.packages.items())]
        digest = hashlib.sha256("\n".join(how).encode())
        for path in (self.module / "go.mod", self.module / "go.sum", *self.sources):
            digest.update(path.read_bytes())
        return cache_root() / self.name / f"{self.label}-{digest.hexdigest()[:12]}"


def required_version(module: Path, dependency: str) -> str:
    """The version of ``dependency`` that ``module``'s go.mod pins, in a require block or on a
    line of its own (``go mod tidy`` writes a lone direct requirement so)."""
    text = (module / "go.mod").read_text()
    match = re.search(rf"^\s*(?:require\s+)?{re.escape(dependency)}\s+(v\S+)", text, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"{module / 'go.mod'} does not require {dependency}")
    return match.group(1)


@cache
def module_source(module: Path, dependency: str) -> Path:
    """``dependency``'s directory in the Go module cache, at the version ``module`` selects;
    downloaded (and checked against go.sum) when missing. For files a module ships (CRDs)."""
    env = {**os.environ, **GO_ENV}
    listed = subprocess.run(["go", "list", "-m", "-json", dependency], cwd=module, env=env,
                            capture_output=True, text=True, check=True).stdout  # fmt: skip
    directory = json.loads(listed).get("Dir")
    if directory:
        return Path(directory)
    downloaded = subprocess.run(["go", "mod", "download", "-json", dependency], cwd=module, env=env,
                                capture_output=True, text=True, check=True).stdout  # fmt: skip
    return Path(json.loads(downloaded)["Dir"])


def print_built(*find: Callable[[], object]) -> int:
    """What ``python -m support.<tool>`` does (the Makefile's ``*-binaries`` targets): build or
    find each thing, print where it is; a failed build is one line and exit status 1."""
    try:
        for each in find:
            print(each())
    except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def cache_root() -> Path:
    """``$GPUOP_CACHE``, else ``$XDG_CACHE_HOME/gpuop``, else ``~/.cache/gpuop``."""
    if os.environ.get("GPUOP_CACHE"):
        return Path(os.environ["GPUOP_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpuop"


def ensure(recipe: Recipe, say: Say = say_on_stderr) -> Path:
    """The recipe's cached binaries, built first when missing. Safe from several processes."""
    target = recipe.directory()
    if all((target / name).is_file() for name in recipe.packages):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with (target.parent / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same thing
        if not all((target / name).is_file() for name in recipe.packages):
            _build(recipe, target, say)
    return target


def _build(recipe: Recipe, target: Path, say: Say) -> None:
    go = shutil.which("go")
    if go is None:
        raise RuntimeError(f"{', '.join(recipe.packages)} are built from Go modules and `go` is not on PATH")
    if recipe.cgo and shutil.which("gcc") is None:
        raise RuntimeError(f"{', '.join(recipe.packages)} are built with cgo and `gcc` is not on PATH")
    say(f"building {', '.join(recipe.packages)} from {recipe.module} into {target} "
        f"(once per machine; {recipe.cold_cost})")  # fmt: skip
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    env = {**os.environ, **GO_ENV, "CGO_ENABLED": "1" if recipe.cgo else "0"}
    tags = [f"-tags={recipe.tags}"] if recipe.tags else []
    command = [go, "build", "-v", "-trimpath", *tags, f"-ldflags={recipe.ldflags}", "-o", f"{staging}/",
               *recipe.packages.values()]  # fmt: skip
    started = time.monotonic()
    process = subprocess.Popen(
        command, cwd=recipe.module, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert process.stdout is not None
    last_report, tail = started, list[str]()
    for compiled, line in enumerate(process.stdout, 1):
        tail = [*tail[-40:], line.rstrip()]
        if time.monotonic() - last_report >= 30:
            last_report = time.monotonic()
            say(f"  {compiled} packages compiled, {last_report - started:.0f}s (now {line.strip()})")
    if process.wait() != 0:
        shutil.rmtree(staging, ignore_errors=True)
        raise RuntimeError("go build failed:\n" + "\n".join(tail))
    for built, name in recipe.renames.items():
        (staging / built).rename(staging / name)
    staging.rename(target)
    for old in target.parent.iterdir():  # other versions' binaries: hundreds of MB each
        if old.is_dir() and old != target and not old.name.startswith(".building-"):
            shutil.rmtree(old, ignore_errors=True)
    say(f"built in {time.monotonic() - started:.0f}s")
