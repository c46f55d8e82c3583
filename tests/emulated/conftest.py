"""Clusters for the operator tests: an API emulator with admission, and one without."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from support.emulator.cluster import Cluster, admit_all, cluster


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Cluster]:
    with cluster(tmp_path, admit_all) as running:
        yield running


@pytest.fixture
def lax(tmp_path: Path) -> Iterator[Cluster]:
    """No GpuTraining admission: objects that got past an older CRD, or none at all."""
    with cluster(tmp_path, lambda s: s.validate_pytorchjobs()) as running:
        yield running
