"""Suite-wide: tests marked ``gpu`` run only where a CUDA GPU is visible."""

from __future__ import annotations

import pytest


def _no_gpu_reason() -> str | None:
    import torch  # only when GPU tests were collected: the operator's tests never need it

    if torch.cuda.is_available():
        return None
    return f"no CUDA GPU visible to torch {torch.__version__}; run `pytest -m gpu` on a GPU machine"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_tests = [item for item in items if item.get_closest_marker("gpu")]
    reason = _no_gpu_reason() if gpu_tests else None
    if reason is not None:
        for item in gpu_tests:
            item.add_marker(pytest.mark.skip(reason=reason))
