"""Where a trainer's start goes, phase by phase, up to its first and second optimizer steps.

``bench/first_step.py`` measures the totals; this splits them. Each repeat starts a fresh python
(this script with ``--child``), which does what ``gputrain``'s Trainer does before its first
step, with gputrain's own functions and the settings the operator renders for a one-worker
synthetic GpuTraining, and reads the clock after each phase (``PHASES``). The model phase
includes importing torchvision (for the ResNets), the optimizer phase the first optimizer's
import of torch._dynamo, where nothing imported it before (the CNN: nothing did).

Times are seconds since the parent's clock just before it started the child (``time.time()``
on both sides: the one clock two processes share), so ``python`` includes the interpreter's own
start. The GPU's queue is drained before each reading. No torchrun, process group or metrics
endpoint: those are ``first_step.py``'s totals less these.

    python bench/start_phases.py [--model resnet50] [--batch-size 256] [--device auto|cpu|cuda]
        [--repeats 3] [--json]

Where no GPU is visible it runs on the CPU, with the CNN and a batch of 32, in fp32.
"""

from __future__ import annotations

import time

BORN = time.time()  # before anything else this script imports: the child's first mark

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

PHASES = {  # in order; each mark is taken when its phase is done
    "python": "python started",
    "torch": "import torch",
    "gputrain": "gputrain imported",
    "cuda": "CUDA context up",  # torch.cuda.init() and a tiny tensor; nothing on a CPU
    "model": "model built, on device",  # and channels_last, as the spec's default asks
    "optimizer": "AdamW made",  # fused, as the trainer makes it
    "data": "synthetic data ready",  # the batches made on the device
    "step1": "first step done",  # forward, backward, clipping, step; cuDNN's autotuning
    "step2": "second step done",
}
DEVICE_VARIABLE = "START_PHASES_DEVICE"


def child() -> None:
    """The phases in this fresh process; prints each mark's ``time.time()`` as JSON."""
    marks = {"python": BORN}
    import torch

    marks["torch"] = time.time()
    from torch.nn import functional

    from gputrain.contract import TrainerSettings
    from gputrain.data import build_data
    from gputrain.models import build_model
    from gputrain.train import (
        _autocast,
        effective_precision,
    )  # the whole loop's module, as the trainer loads it

    marks["gputrain"] = time.time()
    device = torch.device(os.environ[DEVICE_VARIABLE])
    cuda = device.type == "cuda"

    def sync() -> None:  # a clock read after queued GPU work counts that work
        if cuda:
            torch.cuda.synchronize(device)

    if cuda:
        torch.cuda.init()
        torch.empty(1, device=device)
        sync()
    marks["cuda"] = time.time()

    # What Trainer.__init__ does, in its order, less the process group, checkpoints and endpoint.
    settings = TrainerSettings.from_env(os.environ)
    settings = settings.replace(precision=effective_precision(settings, device))
    torch.manual_seed(settings.seed)
    torch.backends.cudnn.benchmark = cuda
    data = build_data(settings, 0, 1, device)  # synthetic: only the shapes, until the first batch
    model = build_model(settings.model, data.in_channels, data.num_classes, data.image_size).to(device)
    if settings.channels_last:
        model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    sync()
    marks["model"] = time.time()
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.learning_rate, fused=True)
    marks["optimizer"] = time.time()
    batches = data.train_batches(0)
    first = next(batches)
    sync()
    marks["data"] = time.time()

    for mark, (x, y) in (("step1", first), ("step2", next(batches))):
        # Trainer._micro_step and _optimizer_step, one micro-step per step (no fp16 scaler).
        with _autocast(settings, device):
            loss = functional.cross_entropy(model(x).float(), y)
        loss.backward()
        if settings.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), settings.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        marks[mark] = time.time()
    print(json.dumps(marks))


def one_start(args: argparse.Namespace, environment: dict[str, str]) -> dict[str, float]:
    """Seconds from just before starting a fresh child to each of its marks."""
    started = time.time()
    done = subprocess.run(
        [sys.executable, __file__, "--child"],
        env=environment,
        capture_output=True,
        text=True,
        timeout=args.timeout,
    )
    if done.returncode != 0:
        raise SystemExit(f"start_phases: child exit {done.returncode}:\n{done.stderr[-3000:]}")
    marks = json.loads(done.stdout.strip().splitlines()[-1])
    return {phase: round(marks[phase] - started, 3) for phase in PHASES}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from benchlib import rendered_settings  # imports torch and gpuop: the parent's, not timed

    gpu = args.device == "cuda"
    with tempfile.TemporaryDirectory() as tmp:
        settings = rendered_settings(
            Path(tmp),
            gpus=int(gpu),
            model=args.model,
            dataset={"name": "synthetic"},
            training={"batchSize": args.batch_size, "precision": "bf16" if gpu else "fp32"},
        )
        environment = {**os.environ, **settings.to_env(), DEVICE_VARIABLE: args.device}
        starts = [one_start(args, environment) for _ in range(args.repeats)]
    return {
        "machine": f"{platform.machine()}, {args.device}, python {platform.python_version()}",
        "model": args.model,
        "batch_size": args.batch_size,
        "precision": settings.precision,
        "seconds_since_start": {phase: [s[phase] for s in starts] for phase in PHASES},
        "median_seconds_since_start": {
            phase: statistics.median(s[phase] for s in starts) for phase in PHASES
        },
        # Each phase's own length, the median over repeats (not a difference of medians).
        "median_phase_seconds": {
            phase: round(statistics.median(s[phase] - s.get(before, 0.0) for s in starts), 3)
            for before, phase in zip(["start", *PHASES], PHASES, strict=False)
        },
    }


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["cnn", "resnet18", "resnet50"], default=None,
                        help="default: resnet50 on a GPU, cnn on a CPU")  # fmt: skip
    parser.add_argument("--batch-size", type=int, default=None, help="default: 256 on a GPU, 32 on a CPU")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300, help="seconds one start may take")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    gpu = args.device == "cuda"
    args.model = args.model or ("resnet50" if gpu else "cnn")
    args.batch_size = args.batch_size or (256 if gpu else 32)
    return args


def main() -> None:
    if sys.argv[1:] == ["--child"]:
        child()
        return
    args = arguments()
    report = measure(args)
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"machine: {report['machine']}; {sys.executable}")
    print(f"{args.model} {report['precision']} batch {args.batch_size}, {args.repeats} fresh processes")
    print(f"  {'phase':<24}{'median s':>13}{'since start':>13}   each repeat, since start")
    for phase, label in PHASES.items():
        own, since = report["median_phase_seconds"][phase], report["median_seconds_since_start"][phase]
        print(f"  {label:<24}{own:>13.2f}{since:>13.2f}   {report['seconds_since_start'][phase]}")


if __name__ == "__main__":
    main()
