"""The chain refuses an image pull the disk cannot hold, at once and in one line, instead of
the kubelet failing half-way with ENOSPC (as a CI run's import did with stale clones on the disk); and tells a
killed session's nodes, whose images are what filled it, from a live one's."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from support.node import hoststate, pool, process


def _nodes(tmp_path: Path, count: int) -> tuple[Any, ...]:
    made = []
    for letter in "ab"[:count]:
        (tmp_path / letter).mkdir()
        made.append(SimpleNamespace(workdir=tmp_path / letter))
    return tuple(made)


def test_a_pull_larger_than_the_free_disk_is_refused_naming_the_room_needed(tmp_path: Path) -> None:
    disk = os.statvfs(tmp_path).f_blocks * os.statvfs(tmp_path).f_frsize
    with pytest.raises(
        RuntimeError, match=r"pulling the trainer on 2 nodes needs about \d+ GB free .* free some"
    ):
        pool.enough_disk(cast(Any, _nodes(tmp_path, 2)), disk, "pulling the trainer")


def test_a_pull_that_fits_goes_ahead(tmp_path: Path) -> None:
    pool.enough_disk(cast(Any, _nodes(tmp_path, 2)), 1024, "pulling a small image")


def test_a_claims_owner_is_alive_only_while_that_very_process_runs() -> None:
    me = process.start_time(os.getpid())
    assert me is not None
    exited = subprocess.Popen(["true"])
    exited.wait()
    claim = hoststate.Claim(
        "xa", "/nowhere", "gpuopnode-xa", "gpuopnode-xa", "/nowhere/root", os.getpid(), me
    )
    assert claim.owner_alive()
    assert not hoststate.Claim(**{**claim.__dict__, "started": me + 1}).owner_alive()  # the pid, given again
    assert not hoststate.Claim(**{**claim.__dict__, "pid": exited.pid}).owner_alive()
