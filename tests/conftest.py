"""Suite-wide: the suites marked by their directory, and tests marked ``gpu`` run only where a
CUDA GPU is visible."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
# Every test under tests/<directory>/ carries that suite's marker (`pytest -m e2e_local`).
DIRECTORY_MARKERS = {"controlplane": pytest.mark.controlplane, "e2e_local": pytest.mark.e2e_local}


def _no_gpu_reason() -> str | None:
    import torch  # only when GPU tests were collected: the operator's tests never need it

    if torch.cuda.is_available():
        return None
    return f"no CUDA GPU visible to torch {torch.__version__}; run `pytest -m gpu` on a GPU machine"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        suite = Path(item.path).resolve().relative_to(HERE).parts[0]
        if suite in DIRECTORY_MARKERS:
            item.add_marker(DIRECTORY_MARKERS[suite])
    gpu_tests = [item for item in items if item.get_closest_marker("gpu")]
    reason = _no_gpu_reason() if gpu_tests else None
    if reason is not None:
        for item in gpu_tests:
            item.add_marker(pytest.mark.skip(reason=reason))
