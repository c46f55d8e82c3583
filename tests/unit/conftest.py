"""Fixtures the unit tests share."""

from __future__ import annotations

import pytest

from gpuop.backends import registry
from support.toyjob import ToyJobApi


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> ToyJobApi:
    """The toy job API, registered beside the real ones for one test."""
    api = ToyJobApi()
    monkeypatch.setitem(registry.APIS, api.backend, api)
    return api
