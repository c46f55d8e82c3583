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
trainer's samples/s and ``ceiling / baseline`` bounds the speedup any trainer can show. It also
times the model alone (the same step on one batch held in memory: no data path, no figures, no
logging), the most an eager loop with no bookkeeping gets, and names its costliest kernels
besides the convolutions.

gputrain trains with the spec's defaults (what a GpuTraining that sets nothing gets), unless the
flags below say otherwise.

    python bench/trainer_throughput.py [--steps 200] [--batch-size 64] [--repeats 3] [--device cuda]
        [--[no-]channels-last] [--[no-]compile] [--precision fp32|bf16|fp16] [--max-grad-norm N]
"""

from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing
import os
import platform
import statistics
import struct
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.nn import functional

from benchlib import rendered_settings, single_process_trainer, synchronize, time_steps
from gputrain.contract import TrainerSettings
from gputrain.data import build_data, load_mnist_arrays
from gputrain.models import ConvNet
from gputrain.train import effective_precision


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
    data = build_data(_settings(root, batch, {}, device), rank=0, world=1, device=device)
    started, done = time.perf_counter(), 0
    while done < steps:
        for _batch in data.train_batches(epoch=done):
            done += 1
            if done == steps:
                break
    synchronize(device)
    return steps * batch / (time.perf_counter() - started)


def _model_alone(batch: int, layout: torch.memory_format, steps: int, precision: str) -> dict[str, Any]:
    """Milliseconds per training step of the model alone, on one batch it already holds (no data
    path, no figures, nothing logged); of that, the convolution kernels' (forward and backward,
    from the profiler), and the other kernels that cost the most. The step is the one gputrain
    makes with the spec's defaults at the precision it runs here (bf16 autocast on a CPU with
    bf16 arithmetic, fp32 elsewhere): forward, loss, backward, gradients clipped to norm 1,
    fused AdamW. At fp32 against a bf16 trainer the bound would be the wrong one: on an
    AVX512-BF16 CPU the trainer ran at 134% of an fp32 model alone."""
    torch.manual_seed(0)
    model = ConvNet(1, 10).to(memory_format=layout)  # type: ignore[call-overload]
    x = torch.randn(batch, 1, 28, 28).contiguous(memory_format=layout)
    y = torch.randint(0, 10, (batch,))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = functional.cross_entropy(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(5):
        step()
    # The step's time and its convolutions' come from the same steps, so the convolutions are
    # always within the step: timed in two loops, a busy machine can make the second loop's
    # convolutions slower than the first loop's whole step. What the profiler itself costs is
    # within the noise here (medians of 5 interleaved pairs, profiled/plain: 0.91 to 1.07).
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        started = time.perf_counter()
        for _ in range(steps):
            step()
        step_ms = (time.perf_counter() - started) * 1000 / steps
    # Self time, so a kernel counts once and nothing around it does.
    self_ms = {e.key: e.self_cpu_time_total / 1000 / steps for e in profiler.key_averages()}
    conv_ms = sum(ms for key, ms in self_ms.items() if "convolution" in key)
    others = sorted(((ms, key) for key, ms in self_ms.items() if "convolution" not in key), reverse=True)
    return {
        "step_ms": step_ms,
        "conv_ms": conv_ms,
        "other_kernels_ms": {k: round(ms, 2) for ms, k in others[:6]},
    }


def convolution_ceiling(batch: int, precision: str = "fp32", steps: int = 20) -> dict[str, Any]:
    """Two bounds on any loop training this model here, each in the faster memory layout (NCHW or
    channels_last): the convolutions alone (a loop whose data, BatchNorm, ReLU, pooling and
    optimizer cost nothing), and the model alone (a loop whose data and bookkeeping cost nothing,
    with the model's own kernels as PyTorch runs them eagerly)."""
    measured = [
        _model_alone(batch, layout, steps, precision)
        for layout in (torch.contiguous_format, torch.channels_last)
    ]
    fastest = min(measured, key=lambda m: m["step_ms"])
    conv_ms = min(m["conv_ms"] for m in measured)
    return {
        "precision": precision,
        "conv_ms_per_step": conv_ms,
        "samples_per_second": batch / (conv_ms / 1000),
        "model_ms_per_step": fastest["step_ms"],
        "model_samples_per_second": batch / (fastest["step_ms"] / 1000),
        "model_other_kernels_ms": fastest["other_kernels_ms"],
    }


def _settings(root: Path, batch: int, options: dict[str, Any], device: torch.device) -> TrainerSettings:
    """The settings the operator would render for this benchmark's GpuTraining: the spec's
    defaults (what a user who sets nothing gets), with ``options`` (spec field names) on top."""
    return rendered_settings(
        root,
        gpus=1 if device.type == "cuda" else 0,
        model="cnn",
        dataset={"name": "mnist", "path": str(root), "loaderWorkers": 0},
        training={"batchSize": batch, "logEverySteps": 50, **options},
    )


def gputrain_loop(root: Path, steps: int, batch: int, options: dict[str, Any], device: torch.device) -> float:
    """Samples per second of gputrain's epoch loop, single process, same model and data."""
    trainer = single_process_trainer(_settings(root, batch, options, device), device)
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
    # gputrain runs with the spec's defaults unless these say otherwise: what a GpuTraining that
    # sets nothing trains with (make run and the examples set only batch size and precision).
    parser.add_argument(
        "--channels-last",
        action=argparse.BooleanOptionalAction,
        help="gputrain's channelsLast",
    )
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, help="gputrain's compile")
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], help="gputrain's precision")
    parser.add_argument("--max-grad-norm", type=float, help="gputrain's maxGradNorm (0: no clipping)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: the first GPU")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU is visible here")

    runs: dict[str, list[float]] = {"baseline": [], "gputrain": []}
    pipeline: dict[str, list[float]] = {"baseline": [], "gputrain": []}
    ceilings: list[dict[str, Any]] = []
    # The common loop in one process, gputrain's (its loop, its input path, the bounds) in another,
    # one at a time, so neither inherits the other's heap or the kernels it warmed up.
    spawn = multiprocessing.get_context("spawn")
    with (
        tempfile.TemporaryDirectory() as tmp,
        ProcessPoolExecutor(1, mp_context=spawn) as common,
        ProcessPoolExecutor(1, mp_context=spawn) as ours,
    ):
        root = Path(tmp)
        write_mnist(root, args.steps * args.batch_size)
        given = {
            "channelsLast": args.channels_last,
            "compile": args.compile,
            "precision": args.precision,
            "maxGradNorm": args.max_grad_norm,
        }
        options = {field: value for field, value in given.items() if value is not None}
        batch, steps, workers = args.batch_size, args.steps, args.baseline_workers
        # The bounds are measured at the precision gputrain runs here, as the Trainer decides it.
        precision = effective_precision(_settings(root, batch, options, device), device)
        ours.submit(gputrain_loop, root, 20, batch, options, device).result()  # warm-up: kernels, compile
        common.submit(baseline, root, 20, batch, workers, device).result()
        for _ in range(args.repeats):
            runs["baseline"].append(common.submit(baseline, root, steps, batch, workers, device).result())
            runs["gputrain"].append(ours.submit(gputrain_loop, root, steps, batch, options, device).result())
            pipeline["baseline"].append(
                common.submit(baseline_pipeline, root, steps, batch, workers).result()
            )
            pipeline["gputrain"].append(ours.submit(gputrain_pipeline, root, steps, batch, device).result())
            if device.type == "cpu":
                ceilings.append(ours.submit(convolution_ceiling, batch, precision).result())
        # The fastest the convolutions ran in any repeat: the bound the trainer is held to is
        # the hardest one this machine showed, not a median that a noisy repeat lowered.
        ceiling = min(ceilings, key=lambda c: c["conv_ms_per_step"]) if ceilings else None

    medians = {name: statistics.median(values) for name, values in runs.items()}
    settings = _settings(Path("/unused"), args.batch_size, options, device)
    ran_with = {
        "channels_last": settings.channels_last,
        "compile": settings.compile,
        "precision": effective_precision(settings, device),  # as the Trainer runs it here
        "max_grad_norm": settings.max_grad_norm,
    }
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
        "gputrain_settings": ran_with,
        "input_pipeline_samples_per_second": {name: round(v) for name, v in feed.items()},
        "input_pipeline_speedup": round(feed["gputrain"] / feed["baseline"], 1),
    }
    if ceiling is not None:
        report["convolution_ceiling"] = {
            "precision": ceiling["precision"],
            "conv_ms_per_step": round(ceiling["conv_ms_per_step"], 1),
            "conv_ms_per_step_runs": [round(c["conv_ms_per_step"], 1) for c in ceilings],
            "samples_per_second": round(ceiling["samples_per_second"]),
            "max_speedup_over_baseline": round(ceiling["samples_per_second"] / medians["baseline"], 2),
            "gputrain_share": round(medians["gputrain"] / ceiling["samples_per_second"], 3),
        }
        fastest_model = min(ceilings, key=lambda c: c["model_ms_per_step"])
        report["model_alone"] = {
            "ms_per_step": round(fastest_model["model_ms_per_step"], 1),
            "ms_per_step_runs": [round(c["model_ms_per_step"], 1) for c in ceilings],
            "samples_per_second": round(fastest_model["model_samples_per_second"]),
            "share_of_convolution_ceiling": round(
                fastest_model["model_samples_per_second"] / ceiling["samples_per_second"], 3
            ),
            "gputrain_share": round(medians["gputrain"] / fastest_model["model_samples_per_second"], 3),
            "costliest_other_kernels_ms_per_step": fastest_model["model_other_kernels_ms"],
        }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"machine: {report['machine']}")
    print(
        f"CNN, MNIST-shaped data, batch {args.batch_size}, {args.steps} steps, {args.repeats} runs each, "
        f"on {args.device}; gputrain with {', '.join(f'{k}={v}' for k, v in ran_with.items())}"
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
            f"  convolutions alone, in {bound['precision']}: {bound['conv_ms_per_step']} ms/step at best "
            f"(runs: {', '.join(map(str, bound['conv_ms_per_step_runs']))}), so at most "
            f"{bound['samples_per_second']} samples/s for any loop "
            f"({bound['max_speedup_over_baseline']}x the baseline); gputrain reaches "
            f"{bound['gputrain_share']:.1%} of it"
        )
        alone = report["model_alone"]
        print(
            f"  the model alone (one batch held, no data or logging): {alone['ms_per_step']} ms/step at best "
            f"(runs: {', '.join(map(str, alone['ms_per_step_runs']))}), {alone['samples_per_second']} "
            f"samples/s, {alone['share_of_convolution_ceiling']:.1%} of the convolution ceiling; gputrain "
            f"reaches {alone['gputrain_share']:.1%} of it"
        )
        kernels = alone["costliest_other_kernels_ms_per_step"]
        listed = ", ".join(f"{kernel} {ms}" for kernel, ms in kernels.items())
        print(f"  the model's costliest other kernels, ms/step: {listed}")


if __name__ == "__main__":
    main()
