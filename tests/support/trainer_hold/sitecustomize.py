"""A go-ahead gate for the real trainer, so that tests signal it at a step they chose, not in a race.

Put this folder on a trainer's PYTHONPATH with ``GPUTRAIN_TEST_HOLD_AT_STEP=N`` and
``GPUTRAIN_TEST_HOLD_DIR=DIR`` (:func:`support.training.hold_env` does both): at its first
logging interval at or past step N, each rank publishes its figures as usual, writes
``DIR/held-<rank>`` and then waits until ``DIR/go`` exists or a stop signal (SIGTERM,
SIGINT) has come. So a test can wait for the files, do what takes time (start a second run,
kill a rank), and then signal or release a trainer that cannot have trained on meanwhile:
before, a 40-epoch run trained to 100% on a loaded machine while the test waited 30 s.

With ``GPUOP_TEST_FETCH_SECONDS=S``, the dataset step copies one object at a time, each in at
least S seconds.

With ``GPUOP_TEST_STEP_SECONDS=S`` instead, a Hugging Face ``Trainer`` takes at least S
seconds a step, and so do the built-in trainer (each logging interval waits out S seconds for
each of its steps) and a loop that calls ``gpureport.report`` once a step: a run of N
steps lasts N x S seconds by construction, so a test sees it report while running however fast
the machine is (both clients report at most every 5 s).

Python imports ``sitecustomize`` at start-up; each patch is installed when its module is first
imported, so processes that never train (torchrun's agent, ``gpuop run``) pay nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any


def _install_hold(module: ModuleType) -> None:
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
        # Written aside and renamed into place: a test that polls for held-* must never read
        # the file between its creation and its write (empty, seen once in CI).
        written = directory / f".held-{self.cluster.rank}.tmp"
        written.write_text(str(self.position.step))
        written.replace(directory / f"held-{self.cluster.rank}")
        while not (directory / "go").exists() and not self.stop_requested:
            time.sleep(0.02)

    trainer_class._report = holding_report


def _install_pace(module: ModuleType) -> None:
    seconds = float(os.environ["GPUOP_TEST_STEP_SECONDS"])
    trainer_class = module.Trainer
    init = trainer_class.__init__

    def paced_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        from transformers.trainer_callback import TrainerCallback

        class Pace(TrainerCallback):  # type: ignore[misc]
            def on_step_begin(self, *_: Any, **__: Any) -> None:
                self.began = time.monotonic()

            def on_step_end(self, *_: Any, **__: Any) -> None:
                time.sleep(max(0.0, seconds - (time.monotonic() - self.began)))

        self.add_callback(Pace())

    trainer_class.__init__ = paced_init


def _install_trainer_pace(module: ModuleType) -> None:
    seconds = float(os.environ["GPUOP_TEST_STEP_SECONDS"])
    trainer_class = module.Trainer
    report = trainer_class._report
    last = [time.monotonic(), 0]  # when the last interval ended, at which step

    def paced_report(self: Any, *args: Any, **kwargs: Any) -> None:
        steps = self.position.step - last[1]
        time.sleep(max(0.0, seconds * steps - (time.monotonic() - last[0])))
        last[:] = [time.monotonic(), self.position.step]
        report(self, *args, **kwargs)

    trainer_class._report = paced_report


def _install_report_pace(module: ModuleType) -> None:
    seconds = float(os.environ["GPUOP_TEST_STEP_SECONDS"])
    report = module.report
    last = [time.monotonic()]

    def paced_report(*args: Any, **kwargs: Any) -> Any:
        time.sleep(max(0.0, seconds - (time.monotonic() - last[0])))
        last[0] = time.monotonic()
        return report(*args, **kwargs)

    module.report = paced_report


def _install_fetch_pace(module: ModuleType) -> None:
    """The dataset step (gputrain.fetch) copies one object at a time, each taking at least
    GPUOP_TEST_FETCH_SECONDS: long enough by construction for the operator to see it copying."""
    seconds = float(os.environ["GPUOP_TEST_FETCH_SECONDS"])
    download = module.Bucket.download
    one_at_a_time = threading.Lock()

    def paced_download(self: Any, *args: Any, **kwargs: Any) -> Any:
        with one_at_a_time:
            time.sleep(seconds)
            return download(self, *args, **kwargs)

    module.Bucket.download = paced_download


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds a target module as the other finders do, then patches it once it has run."""

    def __init__(self, target: str, install: Any) -> None:
        self.target, self.install = target, install

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != self.target:
            return None
        sys.meta_path.remove(self)
        # The other finders, in order: an editable install's (gpureport here) is one of them.
        spec = next(
            (found for finder in sys.meta_path if hasattr(finder, "find_spec")
             and (found := finder.find_spec(name, path, target)) is not None),
            None,
        )  # fmt: skip
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        execute = loader.exec_module

        install = self.install

        def exec_module(module: ModuleType) -> None:
            execute(module)
            install(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if os.environ.get("GPUTRAIN_TEST_HOLD_AT_STEP") and os.environ.get("GPUTRAIN_TEST_HOLD_DIR"):
    sys.meta_path.insert(0, _PatchOnImport("gputrain.train", _install_hold))
if os.environ.get("GPUOP_TEST_STEP_SECONDS"):
    sys.meta_path.insert(0, _PatchOnImport("transformers.trainer", _install_pace))
    sys.meta_path.insert(0, _PatchOnImport("gpureport", _install_report_pace))
    sys.meta_path.insert(0, _PatchOnImport("gputrain.train", _install_trainer_pace))
if os.environ.get("GPUOP_TEST_FETCH_SECONDS"):
    # gputrain.storage, not gputrain.fetch: `python -m gputrain.fetch` runs that as __main__.
    sys.meta_path.insert(0, _PatchOnImport("gputrain.storage", _install_fetch_pace))
