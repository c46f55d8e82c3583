"""From the trainer's start to its first optimizer step, as a pod's container starts it.

Each repeat starts a fresh ``torchrun -m gputrain`` with the environment the operator renders
for a one-worker GpuTraining (the command ``gpuop run`` uses; on a GPU machine, one GPU),
then reads its metrics endpoint every 20 ms, as the operator and Prometheus read it, for:

* the endpoint up: torchrun and the trainer's process started, torch and CUDA initialised,
  the data and model built (the trainer serves its endpoint once it is ready to train);
* the first step: the first optimizer step done, cuDNN's autotuning of every layer included
  (``logEverySteps: 1``, so the endpoint shows step 1 the moment it is done).

Then torchrun and its rank are killed: only the start is measured. ``--compile`` sets
spec.training.compile (auto: unset, the default; on: true; off: false), and the mode the
trainer chose is read from its endpoint. Each start has an Inductor cache of its own, as a new
pod has; with ``--cache-dir``, each start's checkpoint directory gets the compile cache kept
there, and what the start wrote goes back to it: the first start into an empty one compiles
cold, the later ones load the entry. The first repeat may pay what
the later ones find cached (the page cache, CUDA's kernel cache), so the report gives each.
What comes before the container starts (pulling the image, the kubelet's and runtime's work)
is ``bench/pod_start.py``'s subject.

    python bench/first_step.py [--model resnet50] [--batch-size 256] [--precision bf16]
        [--gpus 0|1] [--compile auto|on|off] [--cache-dir DIR] [--repeats 3] [--json]

Where no GPU is visible it runs on the CPU, with the CNN unless ``--model`` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gpuop.api.spec import parse
from gpuop.local.processes import kill_tree
from gpuop.local.runner import LocalRun, plan, scrape, visible_gpus
from gputrain.compiling import CACHE_DIR

POLL_SECONDS = 0.02
COMPILE_SETTINGS = {"auto": None, "on": True, "off": False}  # --compile: spec.training.compile


def training_run(args: argparse.Namespace, gpus: int, workdir: Path) -> LocalRun:
    """The local run of a one-worker synthetic GpuTraining with these settings."""
    body = {
        "apiVersion": "gpuop.io/v1alpha1",
        "kind": "GpuTraining",
        "metadata": {"name": "first-step"},
        "spec": {
            "gpusPerWorker": gpus,
            "model": {"name": args.model},
            "dataset": {"name": "synthetic"},
            "training": {
                "epochs": 1,
                "batchSize": args.batch_size,
                "precision": args.precision,
                "logEverySteps": 1,
                **({} if args.compile == "auto" else {"compile": COMPILE_SETTINGS[args.compile]}),
            },
            "checkpoint": {"everySteps": 10**9},
        },
    }
    return plan(parse(body), 1, workdir)


def one_start(run: LocalRun, timeout: float, cache_dir: Path | None = None) -> dict[str, Any]:
    """Seconds from starting the trainer to its endpoint up and to step 1 on it, and the compile
    mode it reported."""
    run.workdir.mkdir(parents=True, exist_ok=True)
    if cache_dir is not None and (cache_dir / CACHE_DIR).is_dir():
        shutil.copytree(cache_dir / CACHE_DIR, run.checkpoint_dir / CACHE_DIR)
    log_path = run.workdir / "trainer.log"
    environment = run.environment() | {"TORCHINDUCTOR_CACHE_DIR": str(run.workdir / "inductor")}
    with log_path.open("wb") as log:
        started = time.perf_counter()
        process = subprocess.Popen(
            run.command(), env=environment, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    marks: dict[str, Any] = {}
    try:
        deadline = started + timeout
        while "first_step" not in marks:
            if process.poll() is not None:
                tail = log_path.read_text(errors="replace")[-3000:]
                raise SystemExit(f"first_step: exit {process.returncode} before step 1:\n{tail}")
            if time.perf_counter() > deadline:
                raise SystemExit(f"first_step: no step 1 in {timeout:.0f} s; log: {log_path}")
            metrics = scrape(run.metrics_port, timeout=POLL_SECONDS * 10)
            now = time.perf_counter() - started
            if metrics is not None:
                marks.setdefault("endpoint_up", now)
                if metrics.step is not None and metrics.step >= 1:
                    marks["first_step"] = now
                    marks["compile"] = metrics.compile  # None: auto, still timing its eager steps
            time.sleep(POLL_SECONDS)
    finally:
        kill_tree(process)  # the start is all we want
    if cache_dir is not None and (run.checkpoint_dir / CACHE_DIR).is_dir():  # what it wrote, for the next
        shutil.copytree(run.checkpoint_dir / CACHE_DIR, cache_dir / CACHE_DIR, dirs_exist_ok=True)
    return marks


def measure(args: argparse.Namespace) -> dict[str, Any]:
    gpus = args.gpus
    starts = []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            run = training_run(args, gpus, Path(tmp) / str(repeat))
            starts.append(one_start(run, args.timeout, args.cache_dir))
    return {
        "machine": f"{platform.machine()}, {'1 GPU' if gpus else 'CPU'}, python {platform.python_version()}",
        "model": args.model,
        "batch_size": args.batch_size,
        "precision": args.precision,
        "gpus": gpus,
        "compile": args.compile,
        "compile_modes": [s["compile"] for s in starts],
        "endpoint_up_seconds": [round(s["endpoint_up"], 2) for s in starts],
        "first_step_seconds": [round(s["first_step"], 2) for s in starts],
        "median_endpoint_up_seconds": round(statistics.median(s["endpoint_up"] for s in starts), 2),
        "median_first_step_seconds": round(statistics.median(s["first_step"] for s in starts), 2),
    }


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["cnn", "resnet18", "resnet50"], default=None,
                        help="default: resnet50 on a GPU, cnn on a CPU")  # fmt: skip
    parser.add_argument("--batch-size", type=int, default=None, help="default: 256 on a GPU, 32 on a CPU")
    parser.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default=None,
                        help="default: bf16 on a GPU, fp32 on a CPU")  # fmt: skip
    parser.add_argument("--gpus", type=int, choices=[0, 1], default=None,
                        help="default: 1 where the driver lists a GPU, else 0")  # fmt: skip
    parser.add_argument("--compile", choices=list(COMPILE_SETTINGS), default="auto",
                        help="spec.training.compile: auto (unset), on (true), off (false)")  # fmt: skip
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="keep the compile cache here, across starts and runs")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300, help="seconds one start may take")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    args.gpus = (1 if visible_gpus() else 0) if args.gpus is None else args.gpus
    gpu = args.gpus == 1
    args.model = args.model or ("resnet50" if gpu else "cnn")
    args.batch_size = args.batch_size or (256 if gpu else 32)
    args.precision = args.precision or ("bf16" if gpu else "fp32")
    return args


def main() -> None:
    args = arguments()
    report = measure(args)
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"machine: {report['machine']}; {sys.executable}")
    print(f"{args.model} {args.precision} batch {args.batch_size}, compile {args.compile}, "
          f"{args.repeats} fresh starts")  # fmt: skip
    print(f"  compile mode of each start: {report['compile_modes']}")
    for mark in ("endpoint_up", "first_step"):
        print(f"  {mark:<12} s: {report[f'{mark}_seconds']}   median {report[f'median_{mark}_seconds']}")


if __name__ == "__main__":
    main()
