"""What the trainer benchmarks share: settings rendered from a GpuTraining, and timing the
trainer's own epoch loop.

The scripts run as ``python bench/<name>.py``, which puts this directory on the path.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from gpuop.api.spec import parse
from gpuop.backends.pod import trainer_settings
from gputrain.contract import TrainerSettings
from gputrain.distributed import Cluster
from gputrain.train import Position, Trainer


def rendered_settings(
    root: Path, *, gpus: int, model: str, dataset: dict[str, Any], training: dict[str, Any]
) -> TrainerSettings:
    """The settings the operator renders for a one-epoch GpuTraining named ``bench`` with these
    spec fields: checkpoints and outputs under ``root``, no checkpoint ever due, and a metrics
    port picked free."""
    parsed = parse(
        {
            "apiVersion": "gpuop.io/v1alpha1",
            "kind": "GpuTraining",
            "metadata": {"name": "bench"},
            "spec": {
                "gpusPerWorker": gpus,
                "model": {"name": model},
                "dataset": dataset,
                "training": {"epochs": 1, **training},
                "checkpoint": {"path": str(root / "ck"), "everySteps": 10**9},
                "output": {"path": str(root / "out")},
            },
        }
    )
    return trainer_settings(parsed.name, parsed.spec).replace(metrics_port=0)


def single_process_trainer(settings: TrainerSettings, device: torch.device) -> Trainer:
    """A world of one on ``device``: no process group, the loop as every rank runs it."""
    cluster = Cluster(rank=0, local_rank=0, world=1, device=device, backend=settings.backend)
    return Trainer(settings, cluster, termination_log=None)


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so a clock read after it counts that work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(trainer: Trainer, steps: int) -> float:
    """Seconds the trainer's epoch loop takes for ``steps`` optimizer steps from an epoch's
    first batch (no accumulation), with the device's queue drained before and after."""
    trainer.batches = steps
    trainer.position = Position(0, 0, trainer.position.step, trainer.batches)
    synchronize(trainer.device)
    started = time.perf_counter()
    trainer._train_epoch(0)
    synchronize(trainer.device)
    return time.perf_counter() - started
