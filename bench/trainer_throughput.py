"""Training throughput: gputrain's loop vs. a loop written the common way, side by side.

Both train the same CNN (gputrain.models.ConvNet) with AdamW on the same MNIST-shaped data
(random 28x28 images written as real IDX files and read by gputrain's MNIST reader), with
the same batch size and number of steps, in one process on this machine.

* baseline: the tutorial pattern: a Dataset of PIL images with per-sample ToTensor and
  Normalize transforms, a DataLoader (workers as given), ``loss.item()`` and an accuracy
  ``.item()`` every step.
* gputrain: the trainer's own epoch loop (data as one normalised tensor, batched indexing,
  figures read from the device only at logging intervals).

Runs alternate (baseline, gputrain, baseline, ...) so machine noise hits both; the report
gives each run, the medians and their ratio.

On CPU it also measures the ceiling any loop can reach with this model: the time PyTorch's
convolution kernels alone take per step (forward and backward, from the profiler, in the
faster of the two memory layouts). A loop whose data, normalisation, pooling, BatchNorm,
ReLU and optimizer all cost nothing still pays that, so ``batch / conv time`` bounds every
trainer's samples/s and ``ceiling / baseline`` bounds the speedup any trainer can show.

    python bench/trainer_throughput.py [--steps 200] [--batch-size 64] [--repeats 3] [--device cuda]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import statistics
import struct
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.nn import functional

from benchlib import rendered_settings, single_process_trainer, synchronize, time_steps
from gputrain.contract import TrainerSettings
from gputrain.data import build_data, load_mnist_arrays
from gputrain.models import ConvNet


def write_mnist(root: Path, samples: int) -> None:
    """MNIST-shaped random data in the real IDX format, so gputrain reads it as MNIST."""
    rng = np.random.default_rng(0)

    def idx(name: str, array: np.ndarray) -> None:
        header = struct.pack(">I", 0x0800 | array.ndim) + b"".join(struct.pack(">I", d) for d in array.shape)
        (root / name).write_bytes(gzip.compress(header + array.astype(np.uint8).tobytes(), compresslevel=1))

    idx("train-images-idx3-ubyte.gz", rng.integers(0, 256, (samples, 28, 28)))
    idx("train-labels-idx1-ubyte.gz", rng.integers(0, 10, samples))
    idx("t10k-images-idx3-ubyte.gz", rng.integers(0, 256, (256, 28, 28)))
    idx("t10k-labels-idx1-ubyte.gz", rng.integers(0, 10, 256))


class PilDataset(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """The tutorial dataset: PIL images, converted and normalised one sample at a time."""

    def __init__(self, images: np.ndarray, labels: np.ndarray) -> None:
        self.images = [Image.fromarray(image, mode="L") for image in images]
        self.labels = labels.tolist()

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = self.images[index]
        tensor = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0)[None]  # ToTensor
        return (tensor - 0.1307) / 0.3081, self.labels[index]  # Normalize


def pil_loader(root: Path, batch: int, workers: int) -> torch.utils.data.DataLoader[tuple[torch.Tensor, int]]:
    """The same images, as PIL images in the tutorial's Dataset and DataLoader."""
    x_train, y_train, _, _ = load_mnist_arrays(root)
    images = (x_train[:, 0] * 255).round().astype(np.uint8)
    return torch.utils.data.DataLoader(
        PilDataset(images, y_train), batch_size=batch, shuffle=True, num_workers=workers, drop_last=True
    )


def baseline(root: Path, steps: int, batch: int, workers: int, device: torch.device) -> float:
    """Samples per second of the common loop."""
    loader = pil_loader(root, batch, workers)
    torch.manual_seed(0)
    model = ConvNet(1, 10).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    done = 0
    started = time.perf_counter()
    while done < steps:
        for x_host, y_host in loader:
            x, y = x_host.to(device), y_host.to(device)
            optimizer.zero_grad()
            logits = model(x)
            loss = functional.cross_entropy(logits, y)
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            running_loss = loss.item()  # the per-step host sync of the common loop
            correct = (logits.argmax(1) == y).sum().item()
            del running_loss, correct
            done += 1
            if done == steps:
                break
    return steps * batch / (time.perf_counter() - started)


def baseline_pipeline(root: Path, steps: int, batch: int, workers: int) -> float:
    """Samples per second the common input pipeline delivers, with no model at all."""
    loader = pil_loader(root, batch, workers)
    started, done = time.perf_counter(), 0
    while done < steps:
        for _batch in loader:
            done += 1
            if done == steps:
                break
    return steps * batch / (time.perf_counter() - started)


def gputrain_pipeline(root: Path, steps: int, batch: int, device: torch.device) -> float:
    """Samples per second gputrain's in-memory batching delivers, with no model at all."""
    data = build_data(_settings(root, batch, False, False, device), rank=0, world=1, device=device)
    started, done = time.perf_counter(), 0
    while done < steps:
        for _batch in data.train_batches(epoch=done):
            done += 1
            if done == steps:
                break
    synchronize(device)
    return steps * batch / (time.perf_counter() - started)


def _convolution_ms(batch: int, layout: torch.memory_format, steps: int) -> float:
    """Milliseconds per training step spent in convolution kernels (forward + backward)."""
    torch.manual_seed(0)
    model = ConvNet(1, 10).to(memory_format=layout)  # type: ignore[call-overload]
    x = torch.randn(batch, 1, 28, 28).contiguous(memory_format=layout)
    y = torch.randint(0, 10, (batch,))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        optimizer.zero_grad()
        functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
        optimizer.step()

    for _ in range(5):
        step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        for _ in range(steps):
            step()
    # Self time, so a convolution's own kernels count once, and nothing around them does.
    conv_us = sum(e.self_cpu_time_total for e in profiler.key_averages() if "convolution" in e.key)
    return float(conv_us) / 1000 / steps


def convolution_ceiling(batch: int, steps: int = 20) -> dict[str, float]:
    """The fewest milliseconds per step PyTorch's convolutions take here (NCHW or channels_last),
    and the samples/s that bounds any loop training this model to."""
    best = min(
        _convolution_ms(batch, layout, steps) for layout in (torch.contiguous_format, torch.channels_last)
    )
    return {"conv_ms_per_step": best, "samples_per_second": batch / (best / 1000)}


def _settings(
    root: Path, batch: int, channels_last: bool, compile_model: bool, device: torch.device
) -> TrainerSettings:
    """The settings the operator would render for this benchmark's GpuTraining."""
    return rendered_settings(
        root,
        gpus=1 if device.type == "cuda" else 0,
        model="cnn",
        dataset={"name": "mnist", "path": str(root), "loaderWorkers": 0},
        training={
            "batchSize": batch,
            "precision": "fp32",
            "maxGradNorm": 0,
            "channelsLast": channels_last,
            "compile": compile_model,
            "logEverySteps": 50,
        },
    )


def gputrain_loop(
    root: Path, steps: int, batch: int, channels_last: bool, compile_model: bool, device: torch.device
) -> float:
    """Samples per second of gputrain's epoch loop, single process, same model and data."""
    trainer = single_process_trainer(_settings(root, batch, channels_last, compile_model, device), device)
    try:
        return steps * batch / time_steps(trainer, steps)
    finally:
        trainer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline-workers", type=int, default=0, help="DataLoader workers of the baseline")
    parser.add_argument("--channels-last", action="store_true", help="gputrain with channelsLast: true")
    parser.add_argument("--compile", action="store_true", help="gputrain with compile: true")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: the first GPU")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU is visible here")

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_mnist(root, args.steps * args.batch_size)
        options = (args.channels_last, args.compile, device)
        gputrain_loop(root, 20, args.batch_size, *options)  # warm-up: allocator, kernels, compile
        baseline(root, 20, args.batch_size, args.baseline_workers, device)
        runs: dict[str, list[float]] = {"baseline": [], "gputrain": []}
        pipeline: dict[str, list[float]] = {"baseline": [], "gputrain": []}
        for _ in range(args.repeats):
            runs["baseline"].append(
                baseline(root, args.steps, args.batch_size, args.baseline_workers, device)
            )
            runs["gputrain"].append(gputrain_loop(root, args.steps, args.batch_size, *options))
            pipeline["baseline"].append(
                baseline_pipeline(root, args.steps, args.batch_size, args.baseline_workers)
            )
            pipeline["gputrain"].append(gputrain_pipeline(root, args.steps, args.batch_size, device))
    ceiling = convolution_ceiling(args.batch_size) if device.type == "cpu" else None

    medians = {name: statistics.median(values) for name, values in runs.items()}
    feed = {name: statistics.median(values) for name, values in pipeline.items()}
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
    machine += f"{torch.get_num_threads()} threads"
    if device.type == "cuda":
        machine += f", {torch.cuda.get_device_name(device)}"
    report = {
        "machine": machine,
        "device": args.device,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "baseline_workers": args.baseline_workers,
        "samples_per_second": {name: [round(v) for v in values] for name, values in runs.items()},
        "median": {name: round(v) for name, v in medians.items()},
        "speedup": round(medians["gputrain"] / medians["baseline"], 2),
        "gputrain_options": {"channels_last": args.channels_last, "compile": args.compile},
        "input_pipeline_samples_per_second": {name: round(v) for name, v in feed.items()},
        "input_pipeline_speedup": round(feed["gputrain"] / feed["baseline"], 1),
    }
    if ceiling is not None:
        report["convolution_ceiling"] = {
            "conv_ms_per_step": round(ceiling["conv_ms_per_step"], 1),
            "samples_per_second": round(ceiling["samples_per_second"]),
            "max_speedup_over_baseline": round(ceiling["samples_per_second"] / medians["baseline"], 2),
        }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"machine: {report['machine']}")
    print(
        f"CNN, MNIST-shaped data, batch {args.batch_size}, {args.steps} steps, {args.repeats} runs each, "
        f"on {args.device}; gputrain channels_last={args.channels_last} compile={args.compile}"
    )
    for name, values in runs.items():
        each = ", ".join(f"{v:.0f}" for v in values)
        print(f"  {name:9s} median {medians[name]:8.0f} samples/s   runs: {each}")
    print(f"  speedup (median gputrain / median baseline): {report['speedup']}x")
    print(
        f"  input pipeline alone: baseline {feed['baseline']:.0f}, gputrain {feed['gputrain']:.0f} samples/s "
        f"({report['input_pipeline_speedup']}x)"
    )
    if ceiling is not None:
        bound = report["convolution_ceiling"]
        print(
            f"  convolutions alone: {bound['conv_ms_per_step']} ms/step, so at most "
            f"{bound['samples_per_second']} samples/s for any loop "
            f"({bound['max_speedup_over_baseline']}x the baseline)"
        )


if __name__ == "__main__":
    main()
