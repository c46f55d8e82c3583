"""From the trainer's start to its first optimizer step, as a pod's container starts it, with
each way of compiling side by side.

Each start is a fresh ``torchrun -m gputrain`` with the environment the operator renders for a
one-worker GpuTraining (the command ``gpuop run`` uses; on a GPU machine, one GPU), whose
metrics endpoint is read every 20 ms, as the operator and Prometheus read it, for:

* the endpoint up: torchrun and the trainer's process started, torch and CUDA initialised,
  the data and model built (the trainer serves its endpoint once it is ready to train);
* the first step: the first optimizer step done, cuDNN's autotuning of every layer included
  (``logEverySteps: 1``, so the endpoint shows step 1 the moment it is done), and a compile
  where the start compiles from step 1;
* the compile mode the start reported (``status.progress.compile``): at step 1, or, where auto
  on a GPU is still timing its eager steps then, once it has decided.

Then torchrun and its rank are killed: only the start is measured. The rows:

* ``default``: spec.training.compile unset (auto);
* ``eager``: compile: false;
* ``compiled, cold cache``: compile: true with an empty compile cache, as a training's first pod;
* ``compiled, warm cache``: compile: true with the compile cache (``<checkpoint dir>/compile-cache``)
  the cold start of the same round wrote, as every later pod of that training.

Every start has empty Inductor and Triton cache directories of its own, as a new pod has, so
the warm row gains only what our compile cache holds. Starts alternate by round (default,
eager, cold, warm, then again), so machine noise hits every row; the first round may pay what
the later ones find cached (the page cache, CUDA's kernel cache), so the report gives each
start and the medians, and the ratios of the medians: warm / cold first step (what the cache
saves) and default / eager first step (what auto costs a start). ``--rows`` measures some rows
only (warm needs cold). What comes before the container starts (pulling the image, the
kubelet's and runtime's work) is ``bench/pod_start.py``'s subject.

    python bench/first_step.py [--model resnet50] [--batch-size 256] [--precision bf16]
        [--gpus 0|1] [--rows default,eager,cold,warm] [--repeats 3] [--json]

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
from typing import Any, NamedTuple

from gpuop.api.spec import parse
from gpuop.local.processes import kill_tree
from gpuop.local.runner import LocalRun, plan, scrape, visible_gpus
from gputrain.compiling import CACHE_DIR

POLL_SECONDS = 0.02


class Row(NamedTuple):
    label: str
    compile: bool | None  # spec.training.compile; None: unset (auto)


# In the order each round starts them: the warm start needs what the cold one wrote.
ROWS = {
    "default": Row("default", None),
    "eager": Row("eager", False),
    "cold": Row("compiled, cold cache", True),
    "warm": Row("compiled, warm cache", True),
}


def training_run(args: argparse.Namespace, compile_setting: bool | None, workdir: Path) -> LocalRun:
    """The local run of a one-worker synthetic GpuTraining with these settings."""
    body = {
        "apiVersion": "gpuop.io/v1alpha1",
        "kind": "GpuTraining",
        "metadata": {"name": "first-step"},
        "spec": {
            "gpusPerWorker": args.gpus,
            "model": {"name": args.model},
            "dataset": {"name": "synthetic"},
            "training": {
                "epochs": 1,
                "batchSize": args.batch_size,
                "precision": args.precision,
                "logEverySteps": 1,
                **({} if compile_setting is None else {"compile": compile_setting}),
            },
            "checkpoint": {"everySteps": 10**9},
        },
    }
    return plan(parse(body), 1, workdir)


def one_start(run: LocalRun, timeout: float) -> dict[str, Any]:
    """Seconds from starting the trainer to its endpoint up and to step 1 on it, and the compile
    mode it reported (None where it had not decided when it ended or the timeout came)."""
    run.workdir.mkdir(parents=True, exist_ok=True)
    log_path = run.workdir / "trainer.log"
    environment = run.environment() | {
        "TORCHINDUCTOR_CACHE_DIR": str(run.workdir / "inductor"),
        "TRITON_CACHE_DIR": str(run.workdir / "triton"),  # its launcher is built again, as in a new pod
    }
    with log_path.open("wb") as log:
        started = time.perf_counter()
        process = subprocess.Popen(
            run.command(), env=environment, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    marks: dict[str, Any] = {}
    try:
        # Past step 1 only while the mode is unknown: auto on a GPU says it after its timed eager steps.
        while "first_step" not in marks or marks["compile"] is None:
            ended = process.poll() is not None
            metrics = scrape(run.metrics_port, timeout=POLL_SECONDS * 10)
            now = time.perf_counter() - started
            if metrics is not None:
                marks.setdefault("endpoint_up", now)
                if metrics.step is not None and metrics.step >= 1:
                    marks.setdefault("first_step", now)
                    marks["compile"] = metrics.compile
            if "first_step" in marks and (ended or now > timeout):
                break
            if ended:
                tail = log_path.read_text(errors="replace")[-3000:]
                raise SystemExit(f"first_step: exit {process.returncode} before step 1:\n{tail}")
            if now > timeout:
                raise SystemExit(f"first_step: no step 1 in {timeout:.0f} s; log: {log_path}")
            time.sleep(POLL_SECONDS)
    finally:
        kill_tree(process)  # the start is all we want
    return marks


def measure(args: argparse.Namespace) -> dict[str, Any]:
    starts: dict[str, list[dict[str, Any]]] = {row: [] for row in args.rows}
    with tempfile.TemporaryDirectory() as tmp:
        for round_number in range(1, args.repeats + 1):
            runs: dict[str, LocalRun] = {}
            for row in args.rows:
                run = training_run(args, ROWS[row].compile, Path(tmp) / f"round-{round_number}" / row)
                # The warm start gets the cache alone, as a training's volume keeps it between pods.
                if row == "warm":
                    written = runs["cold"].checkpoint_dir / CACHE_DIR
                    if written.is_dir():  # else the warm start misses too, and its mode says so
                        shutil.copytree(written, run.checkpoint_dir / CACHE_DIR)
                runs[row] = run
                starts[row].append(one_start(run, args.timeout))
    rows = {row: row_report(row, row_starts) for row, row_starts in starts.items()}
    gpus = args.gpus
    return {
        "machine": f"{platform.machine()}, {'1 GPU' if gpus else 'CPU'}, python {platform.python_version()}",
        "model": args.model,
        "batch_size": args.batch_size,
        "precision": args.precision,
        "gpus": gpus,
        "rounds": args.repeats,
        "rows": rows,
        # Of the medians: what the cache saves a compiled start, and what auto costs one.
        "first_step_ratios": {"warm_to_cold": ratio(rows, "warm", "cold"),
                              "default_to_eager": ratio(rows, "default", "eager")},
    }  # fmt: skip


def row_report(row: str, starts: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "label": ROWS[row].label,
        "compile": ROWS[row].compile,
        "compile_modes": [s["compile"] for s in starts],
        "endpoint_up_seconds": [round(s["endpoint_up"], 2) for s in starts],
        "first_step_seconds": [round(s["first_step"], 2) for s in starts],
        "median_endpoint_up_seconds": round(statistics.median(s["endpoint_up"] for s in starts), 2),
        "median_first_step_seconds": round(statistics.median(s["first_step"] for s in starts), 2),
    }


def ratio(rows: dict[str, dict[str, Any]], over: str, under: str) -> float | None:
    """Row ``over``'s median first step over row ``under``'s; None unless both were measured."""
    if over not in rows or under not in rows:
        return None
    quotient: float = rows[over]["median_first_step_seconds"] / rows[under]["median_first_step_seconds"]
    return round(quotient, 3)


def _rows(text: str) -> list[str]:
    named = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in named if name not in ROWS]
    if unknown or not named:
        raise argparse.ArgumentTypeError(f"{', '.join(unknown) or 'none'}: name some of {', '.join(ROWS)}")
    if "warm" in named and "cold" not in named:
        raise argparse.ArgumentTypeError("warm starts with the cache its round's cold start writes: add cold")
    return [row for row in ROWS if row in named]


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["cnn", "resnet18", "resnet50"], default=None,
                        help="default: resnet50 on a GPU, cnn on a CPU")  # fmt: skip
    parser.add_argument("--batch-size", type=int, default=None, help="default: 256 on a GPU, 32 on a CPU")
    parser.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default=None,
                        help="default: bf16 on a GPU, fp32 on a CPU")  # fmt: skip
    parser.add_argument("--gpus", type=int, choices=[0, 1], default=None,
                        help="default: 1 where the driver lists a GPU, else 0")  # fmt: skip
    parser.add_argument("--rows", type=_rows, default=list(ROWS),
                        help="the rows to measure, comma-separated: default (compile unset: auto), eager "
                             "(false), cold and warm (true; warm needs cold); default: all")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3, help="rounds: each starts every row once")
    parser.add_argument("--timeout", type=float, default=300, help="seconds one start may take")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    args.gpus = (1 if visible_gpus() else 0) if args.gpus is None else args.gpus
    gpu = args.gpus == 1
    args.model = args.model or ("resnet50" if gpu else "cnn")
    args.batch_size = args.batch_size or (256 if gpu else 32)
    args.precision = args.precision or ("bf16" if gpu else "fp32")
    return args


def _seconds(row: dict[str, Any], mark: str) -> str:
    """The median, then each start's."""
    return f"{row[f'median_{mark}_seconds']:.2f} [{', '.join(f'{s:.2f}' for s in row[f'{mark}_seconds'])}]"


def main() -> None:
    args = arguments()
    report = measure(args)
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"machine: {report['machine']}; {sys.executable}")
    print(f"{args.model} {args.precision} batch {args.batch_size}, {args.repeats} round(s) of fresh starts, "
          "one start of each row a round")  # fmt: skip
    print(f"  {'row':<22}{'endpoint up s: median, each':<30}{'first step s: median, each':<30}"
          "compile mode of each")  # fmt: skip
    for row in report["rows"].values():
        up, first = _seconds(row, "endpoint_up"), _seconds(row, "first_step")
        modes = ", ".join(mode or "undecided" for mode in row["compile_modes"])
        print(f"  {row['label']:<22}{up:<30}{first:<30}{modes}")
    ratios = report["first_step_ratios"]
    said = [f"{name.replace('_to_', ' / ')} {value}" for name, value in ratios.items() if value is not None]
    if said:
        print(f"  first step, ratio of the medians: {'; '.join(said)}")


if __name__ == "__main__":
    main()
