"""The trainer's GPU paths on a real NVIDIA GPU: autocast in each precision, GradScaler, fused
AdamW, NVML figures on the metrics endpoint, torch.compile, and NCCL between two GPUs.

Marked ``gpu``: skipped where torch sees no CUDA GPU (this project's CI); on a GPU machine,
``pytest -m gpu tests/trainer``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from gputrain.checkpoint import CheckpointManager
from gputrain.contract import env_name
from support.training import (
    digits_run,
    finish,
    hold_dir,
    log_of,
    rank_states,
    release,
    start,
    train,
    wait_for_step,
)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_one_gpu_trains_digits(tmp_path: Path, precision: str) -> None:
    """Learns, serves NVML figures for its GPU while training, and checkpoints the scaler and a
    fused optimizer."""
    # Held at step 20, so the endpoint is read mid-run however fast the GPU is.
    run = digits_run(tmp_path, workers=1, gpus=1, precision=precision, epochs=20)
    assert run.processes == 1
    process = start(run, hold_at=20)
    metrics = wait_for_step(run, process, 20)
    assert [g.index for g in metrics.gpus] == ["0"], metrics.gpus
    (gpu,) = metrics.gpus
    assert gpu.memory_total_bytes is not None
    assert gpu.memory_total_bytes > 0
    assert gpu.memory_used_bytes is not None
    assert 0 < gpu.memory_used_bytes <= gpu.memory_total_bytes
    assert gpu.utilization_percent is not None
    assert 0 <= gpu.utilization_percent <= 100
    release(hold_dir(run))
    assert finish(run, process) == 0, log_of(run)

    result = json.loads(run.termination_log.read_text())
    assert result["phase"] == "Succeeded", result
    assert result["accuracy"] >= 0.90, result
    assert math.isfinite(result["loss"])
    found = CheckpointManager(run.checkpoint_dir, keep=3).load_latest()
    assert found is not None
    state, _path = found
    assert state["optimizer"]["param_groups"][0]["fused"] is True
    if precision == "fp16":
        # Loss scaling ran: a finite positive scale that has been updated step by step.
        assert 0 < state["scaler"]["scale"] < math.inf
        assert state["scaler"]["_growth_tracker"] >= 0
    else:
        assert state["scaler"] == {}  # disabled: bf16 and fp32 need no scaling
    assert state["rng"]["cuda"], "the CUDA RNG state is checkpointed"


def test_compile_and_channels_last_on_one_gpu(tmp_path: Path) -> None:
    run = digits_run(tmp_path, workers=1, gpus=1, precision="bf16", compile=True, channelsLast=True)
    assert finish(run, start(run), timeout=600) == 0, log_of(run)  # compiling takes a while
    result = json.loads(run.termination_log.read_text())
    assert result["accuracy"] >= 0.90, result


def test_two_gpus_over_nccl_end_with_identical_models(tmp_path: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, {torch.cuda.device_count()} visible (NCCL refuses two ranks on one GPU)")
    run = digits_run(tmp_path, workers=1, gpus=2, precision="bf16", epochs=2)
    assert run.processes == 2
    assert run.environment()[env_name("backend")] == "nccl"
    assert train(run, dump_ranks=True) == 0, log_of(run)
    first, second = rank_states(run)
    assert first.keys() == second.keys()
    for key in first:
        assert torch.equal(first[key].cpu(), second[key].cpu()), key
