"""The trainer suite: real trainers (DDP over gloo, torchrun, the CLI) on this machine's CPUs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from support.tools import lanes


@pytest.fixture(scope="package", autouse=True)
def machine_turn() -> Iterator[float]:
    """Under `make test`, never beside the chain (tests/e2e_local): see lanes.machine_turn."""
    with lanes.machine_turn() as waited:
        yield waited
