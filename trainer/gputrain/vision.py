"""Importing torchvision where its compiled extension cannot load.

The torchvision 0.28.0 wheel on PyPI is a CUDA build. Beside a CPU-only torch 2.13.0 its
extension fails to load, and the import dies while registering a fake kernel for an
operator the extension should have defined: ``operator torchvision::nms does not exist``.
Defining the schemas of the two operators it registers that way lets the import finish;
datasets, transforms.v2 and models then work, and only ``torchvision.ops.nms`` and image
decoding stay unavailable, which the trainer does not use.

This is the only module that imports torchvision; the workaround runs only when the plain
import fails with that error.
"""

from __future__ import annotations

import sys
import typing
from types import ModuleType

import torch

_MISSING_OP = "torchvision::nms does not exist"
_library: torch.library.Library | None = None  # kept alive: dropping it undefines the ops


def import_torchvision() -> ModuleType:
    """``torchvision``, working around a missing compiled extension."""
    global _library
    try:
        import torchvision
    except RuntimeError as exc:
        if _MISSING_OP not in str(exc):
            raise
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        _library = torch.library.Library("torchvision", "DEF")  # type: ignore[no-untyped-call]
        _library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")  # type: ignore[no-untyped-call]
        _library.define("qnms(Tensor qdets, Tensor scores, float iou_threshold) -> Tensor")  # type: ignore[no-untyped-call]
        import torchvision
    return typing.cast(ModuleType, torchvision)
