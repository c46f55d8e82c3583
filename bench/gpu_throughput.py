"""One GPU: images/s of gputrain's own loop, as the spec's default, eager and compiled, against
the loop as it is commonly written, side by side, and GPU utilization as the GpuTraining's status
shows it against nvidia-smi's.

The model (ResNet-50 by default) trains on gputrain's ``synthetic`` dataset, ImageNet-shaped
and already resident on the GPU, with the settings the operator would render for the
matching GpuTraining (bf16 autocast, channels_last, fused AdamW, the loop's no-host-sync
hot path and its logging interval). So this measures the training step as the trainer runs
it, not a storage system or a decoder: the input pipeline is ``bench/trainer_throughput.py``'s
subject.

The common loop trains the same model on the same batches with the same autocast and memory
layout, written as PyTorch's AMP recipe and most training scripts write it: AdamW with its
defaults, ``zero_grad`` each step, and the loss read back to the host every step for the
running figure a progress bar prints.

gputrain trains in three rows, one trainer each: ``default`` (spec.training.compile unset:
auto; the report gives the mode it chose), ``eager`` (false) and ``compiled`` (true), each with a
checkpoint directory, so a compile cache, of its own. Runs alternate (common, default, eager,
compiled, then again), so machine noise hits every row; each is timed on its own and the
report gives every run, the medians and each row's median over the common loop's. ``--compile``
keeps one row (a bare ``--compile`` is ``on``, as the figures in docs/benchmarks.md were taken).

Utilization, during the timed steps only (warm-up, cuDNN autotuning and compilation fall
outside), two ways:

* as the status shows it from the trainer's endpoint: scraped every second (as ``gpuop run``
  fetches it) and read by the operator's own code (``gpuop.observing.scrape.parse_metrics``
  and ``figures.gpu_usage``, which make ``status.gpu.utilizationPercent``; in a cluster with a
  DCGM exporter the operator takes that exporter's figure instead). The endpoint changes at
  the trainer's logging intervals, so a run's first scrape may still show the run before;
  that is what a status shows too;
* as ``nvidia-smi --query-gpu=utilization.gpu --loop-ms=100`` prints it, for both loops.

Peak memory is each row's: the most allocated during its runs, less what the common loop and
the other rows keep allocated meanwhile (their models, gradients, optimizer state and batches).

    python bench/gpu_throughput.py [--model resnet50] [--batch-size 256] [--precision bf16]
        [--steps 200] [--warmup 30] [--repeats 3] [--no-channels-last] [--compile [auto|on|off]]
        [--no-common-loop] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional

from benchlib import rendered_settings, single_process_trainer, synchronize, time_steps
from gpuop.local.runner import scrape
from gpuop.observing.figures import gpu_usage
from gputrain.contract import TrainerSettings
from gputrain.data import SyntheticData
from gputrain.models import build_model
from gputrain.train import Trainer

# nvidia-smi's fastest loop; NVML's own utilization figure is a share of a sample period of
# 1/6 s to 1 s (driver-dependent), so sampling faster would only repeat it.
SMI_MILLISECONDS = 100
# What a Prometheus scrape or the operator would do at most; the endpoint changes only at the
# trainer's logging intervals anyway.
SCRAPE_SECONDS = 1.0
# gputrain's rows, in the order each round runs them after the common loop: spec.training.compile
# as --compile names it (auto: unset).
ROWS = {"default": "auto", "eager": "off", "compiled": "on"}


def settings_for(args: argparse.Namespace, root: Path, compile_setting: str) -> TrainerSettings:
    """The trainer settings the operator renders for a one-GPU synthetic GpuTraining."""
    return rendered_settings(
        root,
        gpus=1,
        model=args.model,
        dataset={"name": "synthetic"},
        training={
            "batchSize": args.batch_size,
            "precision": args.precision,
            "channelsLast": args.channels_last,
            **({} if compile_setting == "auto" else {"compile": compile_setting == "on"}),
        },
    )


class CommonLoop:
    """The same model, batches, precision and memory layout as ``trainer``, in the loop most
    training scripts run, with cuDNN's autotuning on as the Trainer and NVIDIA's and timm's
    scripts have it."""

    def __init__(self, trainer: Trainer) -> None:
        settings, data = trainer.settings, trainer.data
        assert isinstance(data, SyntheticData)
        self.device = trainer.device
        if self.device.type == "cuda":
            torch.backends.cudnn.benchmark = True
        torch.manual_seed(settings.seed)
        self.model = build_model(settings.model, data.in_channels, data.num_classes, data.image_size)
        self.model.to(self.device)
        if settings.channels_last:
            self.model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=settings.learning_rate)
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(settings.precision)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=settings.precision == "fp16")
        # The trainer's pool of synthetic batches (an epoch cycles through a few; the same values,
        # made anew), so only the loop differs.
        self.batches = list({id(batch): batch for batch in data.train_batches(0)}.values())
        self.model.train()

    def run(self, steps: int) -> float:
        """Seconds for ``steps`` steps, the device's queue drained before and after."""
        synchronize(self.device)
        started = time.perf_counter()
        running = 0.0
        for step in range(steps):
            x, y = self.batches[step % len(self.batches)]
            self.optimizer.zero_grad()
            with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None):
                loss = functional.cross_entropy(self.model(x), y)
            self.scaler.scale(loss).backward()  # type: ignore[no-untyped-call]
            self.scaler.step(self.optimizer)
            self.scaler.update()
            running += loss.item()  # the per-step host sync of the common loop
        synchronize(self.device)
        return time.perf_counter() - started


class Sampler:
    """Calls ``read`` every ``period`` seconds on a thread while it runs; keeps what is not None."""

    def __init__(self, read: Callable[[], float | None], period: float) -> None:
        self.read, self.period = read, period
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            if (value := self.read()) is not None:
                self.samples.append(value)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def status_utilization(port: int) -> float | None:
    """``status.gpu.utilizationPercent`` as the operator would make it from one scrape of the
    trainer's endpoint (None when the endpoint has no GPU figures: no NVML here)."""
    metrics = scrape(port)
    if metrics is None:
        return None
    return gpu_usage({"bench-worker-0": metrics.gpus}, count=1).utilization_percent


class NvidiaSmi:
    """``nvidia-smi``'s utilization of the first visible GPU, every SMI_MILLISECONDS, while it
    runs; no samples where there is no nvidia-smi. The GPU is named by CUDA_VISIBLE_DEVICES'
    first index, which is nvidia-smi's own where CUDA orders GPUs by PCI bus (one GPU, or
    CUDA_DEVICE_ORDER=PCI_BUS_ID)."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self.returncode: int | None = None  # once it has ended
        self._process: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None

    def __enter__(self) -> NvidiaSmi:
        smi = shutil.which("nvidia-smi")
        if smi is None:
            return self
        first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
        self._process = subprocess.Popen(
            [smi, f"--id={first}", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
             f"--loop-ms={SMI_MILLISECONDS}"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        assert self._process is not None
        assert self._process.stdout is not None
        for line in self._process.stdout:
            try:
                self.samples.append(float(line.strip()))
            except ValueError:  # "[N/A]" on a GPU that does not report it
                continue

    def __exit__(self, *exc: object) -> None:
        if self._process is None:
            return
        ended_early = self._process.poll() is not None
        self._process.terminate()
        self.returncode = self._process.wait()
        if self._reader is not None:
            self._reader.join()
        assert self._process.stderr is not None
        if ended_early:  # a figure missing must say why, not read as "no GPU here"
            said = self._process.stderr.read().strip()
            print(f"gpu_throughput: nvidia-smi ended ({self.returncode}): {said}", file=sys.stderr)


def gputrain_run(trainer: Trainer, steps: int) -> dict[str, Any]:
    """Images/s over ``steps`` optimizer steps of the trainer's epoch loop, with the status's and
    nvidia-smi's utilization meanwhile."""
    assert trainer.metrics is not None  # rank 0 of a world of one serves the endpoint
    port = trainer.metrics.port
    assert port is not None
    with Sampler(lambda: status_utilization(port), SCRAPE_SECONDS) as status, NvidiaSmi() as smi:
        seconds = time_steps(trainer, steps)
    rate = steps * trainer.settings.batch_size / seconds
    return {"rate": rate, "status": status.samples, "smi": smi.samples}


def common_run(loop: CommonLoop, steps: int, batch_size: int) -> dict[str, Any]:
    with NvidiaSmi() as smi:
        seconds = loop.run(steps)
    return {"rate": steps * batch_size / seconds, "smi": smi.samples}


def _medians(runs: list[dict[str, Any]], key: str) -> list[float]:
    return [statistics.median(run[key]) for run in runs if run[key]]


def _lowest(runs: list[dict[str, Any]], key: str) -> float | None:
    return min((min(run[key]) for run in runs if run[key]), default=None)


def measure(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """The report: each row's trainer warmed up, then ``args.repeats`` rounds of one timed run of
    ``args.steps`` steps of each loop.

    The GPU is what this is for; on a CPU the same flow runs (without utilization figures),
    which is how the test suite keeps this script working on machines without one.
    """
    cuda = device.type == "cuda"

    def allocated() -> int:
        return torch.cuda.memory_allocated(device) if cuda else 0

    rows = [row for row, setting in ROWS.items() if args.compile in (None, setting)]
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as trainers_open:
        trainers: dict[str, Trainer] = {}
        resident: dict[str, int] = {}  # what each row's trainer keeps allocated through the others' runs
        for row in rows:
            before = allocated()
            trainer = single_process_trainer(settings_for(args, Path(tmp) / row, ROWS[row]), device)
            trainers_open.callback(trainer.close)
            data = trainer.data
            assert isinstance(data, SyntheticData)
            data.samples = max(args.steps, args.warmup) * args.batch_size  # one epoch covers a run
            # The steps this trainer will take, as compile: auto weighs them against a compile.
            trainer.total_steps = args.warmup + args.repeats * args.steps
            time_steps(trainer, args.warmup)
            trainers[row] = trainer
            resident[row] = allocated() - before
        common = CommonLoop(trainers[rows[0]]) if args.common_loop else None
        if common is not None:
            common.run(args.warmup)
        runs: dict[str, list[dict[str, Any]]] = {row: [] for row in rows}
        peaks: dict[str, list[int]] = {row: [] for row in rows}
        common_runs: list[dict[str, Any]] = []
        for _ in range(args.repeats):
            if common is not None:
                common_runs.append(common_run(common, args.steps, args.batch_size))
            for row, trainer in trainers.items():
                others = allocated() - resident[row]
                if cuda:
                    torch.cuda.reset_peak_memory_stats(device)
                runs[row].append(gputrain_run(trainer, args.steps))
                if cuda:
                    peaks[row].append(torch.cuda.max_memory_allocated(device) - others)
        steps_done = {row: trainer.position.step for row, trainer in trainers.items()}
        modes = {row: trainer.compiler.mode for row, trainer in trainers.items()}

    machine = f"{torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda}" if cuda else "CPU"
    common_median = statistics.median(run["rate"] for run in common_runs) if common_runs else None
    report_rows = {}
    for row in rows:
        median = statistics.median(run["rate"] for run in runs[row])
        report_rows[row] = {
            "compile": ROWS[row],
            "compile_mode": modes[row],
            "optimizer_steps_done": steps_done[row],
            "images_per_second": [round(run["rate"], 1) for run in runs[row]],
            "median_images_per_second": round(median, 1),
            "ratio_to_common_loop": None if common_median is None else round(median / common_median, 3),
            # Medians per run, and the lowest sample of all runs.
            "status_gpu_utilization_percent": _medians(runs[row], "status"),
            "status_gpu_utilization_lowest": _lowest(runs[row], "status"),
            "nvidia_smi_utilization_percent": _medians(runs[row], "smi"),
            "nvidia_smi_utilization_lowest": _lowest(runs[row], "smi"),
            "peak_memory_gib": round(max(peaks[row]) / 2**30, 1) if cuda else None,
        }
    return {
        "machine": f"{machine}, {platform.machine()}, torch {torch.__version__}",
        "model": args.model,
        "precision": args.precision,
        "batch_size": args.batch_size,
        "channels_last": args.channels_last,
        "steps_per_run": args.steps,
        "repeats": args.repeats,
        "common_loop": None if common_median is None else {
            "images_per_second": [round(run["rate"], 1) for run in common_runs],
            "median_images_per_second": round(common_median, 1),
            "nvidia_smi_utilization_percent": _medians(common_runs, "smi"),
        },
        "rows": report_rows,
    }  # fmt: skip


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["cnn", "resnet18", "resnet50"], default="resnet50")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default="bf16")
    parser.add_argument("--steps", type=int, default=200, help="timed optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=30, help="untimed steps first (autotuning, compiling)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-channels-last", dest="channels_last", action="store_false")
    # A bare --compile is on: the figures in docs/benchmarks.md were taken with it.
    parser.add_argument("--compile", choices=list(ROWS.values()), nargs="?", const="on", default=None,
                        help="gputrain with this spec.training.compile alone: auto (unset), on (true), off "
                             "(false); default: all three")  # fmt: skip
    parser.add_argument("--no-common-loop", dest="common_loop", action="store_false",
                        help="time gputrain's loop alone")  # fmt: skip
    parser.add_argument("--json", action="store_true")
    return parser.parse_args(argv)


def show(report: dict[str, Any]) -> None:
    """The report as text."""
    r, common, rows = report, report["common_loop"], report["rows"]
    print(f"machine: {r['machine']}")
    print(f"{r['model']} {r['precision']} batch {r['batch_size']} channels_last={r['channels_last']}, "
          f"{r['repeats']} x {r['steps_per_run']} steps, runs alternating: "
          f"{', '.join((['common loop'] if common else []) + list(rows))}")  # fmt: skip
    print(f"  {'':<12}{'images/s: median, runs':<40}{'/ common loop':<15}compile (mode)")
    if common:
        rates = common["images_per_second"]
        print(f"  {'common loop':<12}{common['median_images_per_second']:<10}{rates!s:<30}")
    for name, row in rows.items():
        rates, ratio = row["images_per_second"], row["ratio_to_common_loop"]
        ratio_text = "" if ratio is None else str(ratio)
        print(f"  {name:<12}{row['median_images_per_second']:<10}{rates!s:<30}{ratio_text:<15}"
              f"{row['compile']} ({row['compile_mode']})")  # fmt: skip
    print("  GPU utilization % during gputrain's runs (median of each run, lowest sample), as the status")
    print("  shows it (the endpoint as the operator reads it) and as nvidia-smi does:")
    for name, row in rows.items():
        status = f"{row['status_gpu_utilization_percent']}, {row['status_gpu_utilization_lowest']}"
        smi = f"{row['nvidia_smi_utilization_percent']}, {row['nvidia_smi_utilization_lowest']}"
        print(f"    {name:<12}status {status}; nvidia-smi {smi}")
    if common:
        print(f"    {'common loop':<12}nvidia-smi {common['nvidia_smi_utilization_percent']}")
    peaks = ", ".join(f"{name} {row['peak_memory_gib']}" for name, row in rows.items())
    print(f"  peak memory of each row's runs, GiB: {peaks}")


def main() -> None:
    args = arguments()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_throughput: no CUDA GPU is visible here; this benchmark measures one")
    report = measure(args, torch.device("cuda", 0))
    if args.json:
        print(json.dumps(report, indent=2))
        return
    show(report)


if __name__ == "__main__":
    main()
