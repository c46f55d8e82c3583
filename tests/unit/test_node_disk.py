"""The chain refuses an image import the disk cannot hold, at once and in one line, instead of
ctr failing half-way with ENOSPC (as a CI run did with stale clones on the disk)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from support.node import pool
from support.node.images import ImageArchive


def _nodes(tmp_path: Path, count: int) -> tuple[Any, ...]:
    made = []
    for letter in "ab"[:count]:
        (tmp_path / letter).mkdir()
        made.append(SimpleNamespace(workdir=tmp_path / letter))
    return tuple(made)


def test_an_import_larger_than_the_free_disk_is_refused_naming_the_room_needed(tmp_path: Path) -> None:
    archive = tmp_path / "trainer.tar"
    with archive.open("wb") as sparse:  # as large as a disk, taking none of it
        sparse.truncate(os.statvfs(tmp_path).f_blocks * os.statvfs(tmp_path).f_frsize)
    with pytest.raises(RuntimeError, match=r"needs about \d+ GB free .* free some"):
        pool._enough_disk(cast(Any, _nodes(tmp_path, 2)), [ImageArchive("trainer:1", archive)])


def test_an_import_that_fits_goes_ahead(tmp_path: Path) -> None:
    archive = tmp_path / "small.tar"
    archive.write_bytes(b"x" * 1024)
    pool._enough_disk(cast(Any, _nodes(tmp_path, 2)), [ImageArchive("small:1", archive)])
