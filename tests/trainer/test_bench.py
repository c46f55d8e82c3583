"""The benchmark scripts still run: their flow on a few steps here, not their figures.

They are run by hand on quiet or GPU machines, so a change to the trainer that breaks them
would otherwise surface only when someone needs a number.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest
import torch

from gputrain.checkpoint import CheckpointManager
from gputrain.contract import Progress
from gputrain.metrics import GpuReading, MetricsServer
from support import objectstore
from support.node.process import processes_naming
from support.paths import ROOT

BENCH = ROOT / "bench"


def _load(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """A script as a module; its directory on the path, as ``python bench/<name>.py`` puts it."""
    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_benchmark_times_exactly_the_steps_it_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its flow on the CPU: every run restarts the epoch, so each times ``--steps`` real steps;
    the common loop runs beside it, on the trainer's batches, without moving its position."""
    bench = _load("gpu_throughput", monkeypatch)
    options = ["--model=cnn", "--precision=fp32", "--batch-size=8", "--steps=3", "--warmup=2", "--repeats=2"]
    args = bench.arguments(options)
    report = bench.measure(args, torch.device("cpu"))
    assert report["optimizer_steps_done"] == 2 + 2 * 3
    assert len(report["images_per_second"]) == 2
    assert all(rate > 0 for rate in report["images_per_second"])
    assert len(report["common_loop_images_per_second"]) == 2
    assert all(rate > 0 for rate in report["common_loop_images_per_second"])
    assert report["ratio_to_common_loop"] > 0
    # No NVML and no nvidia-smi here: no utilization, rather than a made-up 0.
    assert report["status_gpu_utilization_percent"] == []
    assert report["nvidia_smi_utilization_percent"] == []
    alone = bench.measure(bench.arguments([*options, "--no-common-loop"]), torch.device("cpu"))
    assert alone["common_loop_images_per_second"] == []
    assert alone["ratio_to_common_loop"] is None


def test_gpu_benchmark_reads_utilization_as_the_status_shows_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The figure is the trainer's endpoint read by the operator's own scrape and status code."""
    bench = _load("gpu_throughput", monkeypatch)
    reading = GpuReading(0, "NVIDIA H100 80GB HBM3", 73.0, 2**30, 80 * 2**30)
    with_gpu, without_gpu = MetricsServer(port=0), MetricsServer(port=0)
    try:
        assert with_gpu.port is not None
        assert without_gpu.port is not None
        with_gpu.update(Progress(step=1), gpus=[reading])
        assert bench.status_utilization(with_gpu.port) == 73.0
        without_gpu.update(Progress(step=1), gpus=[])  # no NVML: the status has no figure, not 0
        assert bench.status_utilization(without_gpu.port) is None
    finally:
        with_gpu.close()
        without_gpu.close()
    assert bench.status_utilization(with_gpu.port) is None  # the endpoint gone


def test_gpu_benchmark_samples_nvidia_smi(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """It asks nvidia-smi for the first visible GPU's utilization in a loop (the flags checked on
    an H100's nvidia-smi, docs/benchmarks.md), keeps the numbers, skips "[N/A]", and ends it."""
    bench = _load("gpu_throughput", monkeypatch)
    argv = tmp_path / "argv"
    fake = tmp_path / "nvidia-smi"
    fake.write_text(f'#!/bin/sh\necho "$@" > {argv}\nprintf "87\\n[N/A]\\n91\\n"\nexec sleep 60\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    with bench.NvidiaSmi() as smi:
        deadline = time.monotonic() + 10
        while len(smi.samples) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert smi.samples == [87.0, 91.0]
    assert smi.returncode == -signal.SIGTERM  # ended with the run, not left sampling
    assert argv.read_text().split() == [
        "--id=3", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "--loop-ms=100"
    ]  # fmt: skip


def test_first_step_benchmark_times_a_fresh_trainer_and_leaves_nothing_running(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torchrun starts its rank in a session of its own: killing torchrun's group alone left the
    rank training on while the next start was timed."""
    bench = _load("first_step", monkeypatch)
    report = bench.measure(bench.arguments(["--gpus=0", "--repeats=1"]))
    assert report["model"] == "cnn"
    (up,) = report["endpoint_up_seconds"]
    (first,) = report["first_step_seconds"]
    assert 0 < up <= first < 120
    assert processes_naming("first-step/termination-log") == {}  # the rank's own command line


def test_first_step_benchmark_names_a_trainer_that_exits_before_step_1(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bench = _load("first_step", monkeypatch)
    failing = [sys.executable, "-c", "import sys; print('no such model'); sys.exit(3)"]
    monkeypatch.setattr(bench.LocalRun, "command", lambda self: failing)
    with pytest.raises(SystemExit, match=r"^first_step: exit 3 before step 1:\nno such model\n$"):
        bench.measure(bench.arguments(["--gpus=0", "--repeats=1"]))


def test_first_step_benchmark_gives_up_at_its_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = _load("first_step", monkeypatch)
    with pytest.raises(SystemExit, match=r"^first_step: no step 1 in 0 s; log: .*trainer\.log$"):
        bench.measure(bench.arguments(["--gpus=0", "--repeats=1", "--timeout=0.2"]))


def test_start_phases_benchmark_times_every_phase_of_a_fresh_process_in_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its flow on the CPU: one fresh child, every phase timed from before its start, in order."""
    bench = _load("start_phases", monkeypatch)
    report = bench.measure(bench.arguments(["--device=cpu", "--repeats=1", "--batch-size=4"]))
    assert report["model"] == "cnn"
    since = [report["seconds_since_start"][phase] for phase in bench.PHASES]
    assert all(len(values) == 1 for values in since)
    marks = [values[0] for values in since]
    assert marks[0] >= 0
    assert marks == sorted(marks)
    assert marks[-1] < 120
    assert list(report["median_phase_seconds"]) == list(bench.PHASES)
    assert all(seconds >= 0 for seconds in report["median_phase_seconds"].values())


def test_gpu_benchmark_refuses_to_run_without_a_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here")
    done = subprocess.run(
        [sys.executable, BENCH / "gpu_throughput.py"], capture_output=True, text=True, check=False
    )
    assert done.returncode == 1
    assert done.stderr.strip() == "gpu_throughput: no CUDA GPU is visible here; this benchmark measures one"


def test_cpu_benchmark_reports_both_loops_and_the_convolution_ceiling() -> None:
    done = subprocess.run(
        [sys.executable, BENCH / "trainer_throughput.py", "--steps", "5", "--repeats", "1", "--json"],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert set(report["median"]) == {"baseline", "gputrain"}
    assert all(v > 0 for v in report["median"].values())
    ceiling = report["convolution_ceiling"]
    # The bounds at the precision gputrain ran (bf16 where this CPU computes it, else fp32).
    assert ceiling["precision"] == report["gputrain_settings"]["precision"]
    assert ceiling["conv_ms_per_step"] > 0
    assert ceiling["samples_per_second"] > 0
    alone = report["model_alone"]
    # The model alone runs the convolutions and more, so it is slower than the convolutions.
    assert alone["ms_per_step"] > ceiling["conv_ms_per_step"]
    assert 0 < alone["share_of_convolution_ceiling"] < 1
    assert alone["costliest_other_kernels_ms_per_step"]  # named, whichever they are on this machine
    # gputrain ran with the spec's defaults, as this machine runs them.
    assert report["gputrain_settings"]["channels_last"] is True
    assert report["gputrain_settings"]["max_grad_norm"] == 1.0


def test_checkpoint_store_benchmark_saves_and_loads_in_a_directory_and_a_bucket(
    s3: objectstore.S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bench = _load("checkpoint_store", monkeypatch)
    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    state = bench.trained_state("cnn")
    assert state["optimizer"]["state"]  # the moments are there: one step was taken
    for where in (tmp_path / "volume", "s3://checkpoints/test-checkpoint-store-benchmark"):
        saving, loading, size = bench.timed(CheckpointManager(where, keep=1), state, 7)
        assert saving > 0
        assert loading > 0
        assert size > sum(t.numel() * t.element_size() for t in state["model"].values())
