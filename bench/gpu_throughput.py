"""One GPU through gputrain's own loop: images/s and steady-state utilization from NVML.

The model (ResNet-50 by default) trains on gputrain's ``synthetic`` dataset, ImageNet-shaped
and already resident on the GPU, with the settings the operator would render for the
matching GpuTraining (bf16 autocast, channels_last, fused AdamW, the loop's no-host-sync
hot path and its logging interval). So this measures the training step as the trainer runs
it, not a storage system or a decoder: the input pipeline is ``bench/trainer_throughput.py``'s
subject.

Utilization is NVML's (the figure the trainer publishes and the operator's status shows),
sampled every 100 ms during the timed steps only; warm-up, cuDNN autotuning and compilation
fall outside. Each repeat is timed separately and the report gives every repeat and the
medians.

    python bench/gpu_throughput.py [--model resnet50] [--batch-size 256] [--precision bf16]
        [--steps 200] [--warmup 30] [--repeats 3] [--no-channels-last] [--compile] [--json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

from benchlib import rendered_settings, single_process_trainer, time_steps
from gputrain.contract import TrainerSettings
from gputrain.data import SyntheticData
from gputrain.metrics import GpuMonitor
from gputrain.train import Trainer

SAMPLE_SECONDS = 0.1


def settings_for(args: argparse.Namespace, root: Path) -> TrainerSettings:
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
            "compile": args.compile,
        },
    )


class UtilizationSampler:
    """NVML utilization of the first visible GPU (cuda:0), sampled on a thread while it runs."""

    def __init__(self, monitor: GpuMonitor) -> None:
        self.monitor = monitor
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_SECONDS):
            readings = self.monitor.read()  # in CUDA_VISIBLE_DEVICES order: cuda:0 first
            if readings:
                self.samples.append(readings[0].utilization_percent)

    def __enter__(self) -> UtilizationSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def timed_steps(trainer: Trainer, steps: int) -> tuple[float, list[float]]:
    """Images/s over ``steps`` optimizer steps of the trainer's epoch loop, and NVML's samples."""
    assert trainer.metrics is not None  # rank 0 of a one-process job serves (and reads NVML)
    with UtilizationSampler(trainer.metrics.gpus) as sampler:
        seconds = time_steps(trainer, steps)
    return steps * trainer.settings.batch_size / seconds, sampler.samples


def measure(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """The report: warm-up, then ``args.repeats`` timed runs of ``args.steps`` steps each.

    The GPU is what this is for; on a CPU the same flow runs (without NVML figures), which is
    how the test suite keeps this script working on machines without one.
    """
    with tempfile.TemporaryDirectory() as tmp:
        trainer = single_process_trainer(settings_for(args, Path(tmp)), device)
        try:
            data = trainer.data
            assert isinstance(data, SyntheticData)
            data.samples = max(args.steps, args.warmup) * args.batch_size  # one epoch covers a run
            timed_steps(trainer, args.warmup)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            runs = [timed_steps(trainer, args.steps) for _ in range(args.repeats)]
            steps_done = trainer.position.step
        finally:
            trainer.close()

    rates = [rate for rate, _ in runs]
    sampled = [samples for _, samples in runs if samples]
    if device.type == "cuda":
        machine = f"{torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda}"
        peak_gib: float | None = round(torch.cuda.max_memory_allocated(device) / 2**30, 1)
    else:
        machine, peak_gib = "CPU", None
    return {
        "machine": f"{machine}, {platform.machine()}, torch {torch.__version__}",
        "model": args.model,
        "precision": args.precision,
        "batch_size": args.batch_size,
        "channels_last": args.channels_last,
        "compile": args.compile,
        "steps_per_run": args.steps,
        "optimizer_steps_done": steps_done,
        "images_per_second": [round(r, 1) for r in rates],
        "median_images_per_second": round(statistics.median(rates), 1),
        "gpu_utilization_percent_median_per_run": [statistics.median(s) for s in sampled],
        "gpu_utilization_percent_lowest_sample": min((min(s) for s in sampled), default=None),
        "peak_memory_gib": peak_gib,
    }


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["cnn", "resnet18", "resnet50"], default="resnet50")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default="bf16")
    parser.add_argument("--steps", type=int, default=200, help="timed optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=30, help="untimed steps first (autotuning, compiling)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-channels-last", dest="channels_last", action="store_false")
    parser.add_argument("--compile", action="store_true", help="compile: true in the spec")
    parser.add_argument("--json", action="store_true")
    return parser.parse_args(argv)


def main() -> None:
    args = arguments()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_throughput: no CUDA GPU is visible here; this benchmark measures one")
    report = measure(args, torch.device("cuda", 0))
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"machine: {report['machine']}")
    print(
        f"{args.model} {args.precision} batch {args.batch_size} channels_last={args.channels_last} "
        f"compile={args.compile}, {args.repeats} x {args.steps} steps"
    )
    print(f"  images/s median {report['median_images_per_second']}   runs: {report['images_per_second']}")
    utilization = report["gpu_utilization_percent_median_per_run"]
    lowest = report["gpu_utilization_percent_lowest_sample"]
    print(f"  GPU utilization (NVML) median per run: {utilization}, lowest sample {lowest}")
    print(f"  peak memory {report['peak_memory_gib']} GiB")


if __name__ == "__main__":
    main()
