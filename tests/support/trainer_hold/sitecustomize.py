"""A go-ahead gate for the real trainer, so that tests signal it at a step they chose, not in a race.

Put this folder on a trainer's PYTHONPATH with ``GPUTRAIN_TEST_HOLD_AT_STEP=N`` and
``GPUTRAIN_TEST_HOLD_DIR=DIR`` (:func:`support.training.hold_env` does both): at its first
logging interval at or past step N, each rank publishes its figures as usual, writes
``DIR/held-<rank>`` and then waits until ``DIR/go`` exists or a stop signal (SIGTERM,
SIGINT) has come. So a test can wait for the files, do what takes time (start a second run,
kill a rank), and then signal or release a trainer that cannot have trained on meanwhile:
before, a 40-epoch run trained to 100% on a loaded machine while the test waited 30 s.

Python imports ``sitecustomize`` at start-up; the patch is installed when ``gputrain.train``
is first imported, so processes that never train (torchrun's agent, ``gpuop run``) pay nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

_TARGET = "gputrain.train"


def _install(module: ModuleType) -> None:
    hold_at = int(os.environ["GPUTRAIN_TEST_HOLD_AT_STEP"])
    directory = Path(os.environ["GPUTRAIN_TEST_HOLD_DIR"])
    trainer_class = module.Trainer
    report = trainer_class._report
    held = False

    def holding_report(self: Any, *args: Any, **kwargs: Any) -> None:
        nonlocal held
        report(self, *args, **kwargs)
        if held or self.position.step < hold_at:
            return
        held = True
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"held-{self.cluster.rank}").write_text(str(self.position.step))
        while not (directory / "go").exists() and not self.stop_requested:
            time.sleep(0.02)

    trainer_class._report = holding_report


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds gputrain.train as the other finders do, then patches it once it has run."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        execute = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            _install(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if os.environ.get("GPUTRAIN_TEST_HOLD_AT_STEP") and os.environ.get("GPUTRAIN_TEST_HOLD_DIR"):
    sys.meta_path.insert(0, _PatchOnImport())
