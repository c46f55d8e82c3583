"""Real training runs for tests: torchrun with 2 gloo processes, launched as `gpuop run` does."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from gpuop.api.spec import parse
from gpuop.local.runner import LocalRun, plan, scrape
from gpuop.observing.scrape import TrainerMetrics
from support.paths import ROOT
from support.specs import minimal

RANK_DUMP = ROOT / "tests" / "trainer" / "rank_dump.py"
HOLD_SITE = Path(__file__).resolve().parent / "trainer_hold"
# Where a volume holds the hooks for the pods that mount it (:func:`put_hooks`).
HOOKS_FOLDER = "test-hooks"


def put_hooks(folder: Path) -> str:
    """The hooks of trainer_hold (the gate and the pacing) copied to ``folder/test-hooks``,
    readable by any uid: no image carries them, so a pod gets them from a volume it mounts,
    ``<mount>/test-hooks`` on its PYTHONPATH. The folder's name, relative to ``folder``."""
    site = folder / HOOKS_FOLDER
    site.mkdir(parents=True, exist_ok=True)
    site.chmod(0o755)
    shutil.copy(HOLD_SITE / "sitecustomize.py", site / "sitecustomize.py")
    (site / "sitecustomize.py").chmod(0o644)
    return HOOKS_FOLDER


def hold_env(directory: Path, step: int) -> dict[str, str]:
    """What makes each rank of a trainer wait at its first logging interval at or past ``step``
    until :func:`release` or a stop signal (see trainer_hold/sitecustomize.py)."""
    path = os.pathsep.join(p for p in (str(HOLD_SITE), os.environ.get("PYTHONPATH", "")) if p)
    return {
        "PYTHONPATH": path,
        "GPUTRAIN_TEST_HOLD_AT_STEP": str(step),
        "GPUTRAIN_TEST_HOLD_DIR": str(directory),
    }


def pace_env(step_seconds: float) -> dict[str, str]:
    """What makes a Hugging Face Trainer take at least ``step_seconds`` a step (see
    trainer_hold/sitecustomize.py): a run long enough by construction to be seen reporting."""
    path = os.pathsep.join(p for p in (str(HOLD_SITE), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "GPUOP_TEST_STEP_SECONDS": str(step_seconds)}


def wait_held(directory: Path, ranks: int, alive: Callable[[], bool], timeout: float = 240) -> int:
    """Wait until ``ranks`` ranks are held (or ``alive`` says the run ended); the step they hold at."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        held = sorted(directory.glob("held-*"))
        if len(held) >= ranks:
            return max(int(h.read_text()) for h in held)
        assert alive(), f"the run ended before {ranks} ranks were held in {directory}"
        time.sleep(0.05)
    raise AssertionError(f"{ranks} ranks not held in {directory} within {timeout}s")


def release(directory: Path) -> None:
    """Let held ranks (and any that a restart brings) train on."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "go").touch()


def digits_run(tmp_path: Path, workers: int = 2, gpus: int = 0, **training: Any) -> LocalRun:
    """A digits run in ``tmp_path``, on CPU unless ``gpus`` per worker are given; ``training``
    overrides spec.training fields."""
    settings = {"epochs": 3, "batchSize": 32, "learningRate": 0.003, "precision": "fp32", "logEverySteps": 5}
    settings.update(training)
    body = minimal(
        gpusPerWorker=gpus,
        dataset={"name": "digits", "loaderWorkers": 0},
        training=settings,
        checkpoint={"everySteps": 10, "keep": 3},
    )
    return plan(parse(body), workers, tmp_path)


def start(
    run: LocalRun,
    *,
    launcher_args: tuple[str, ...] = (),
    dump_ranks: bool = False,
    no_batchnorm: bool = False,
    steps: int | None = None,
    extra_env: dict[str, str] | None = None,
    hold_at: int | None = None,
) -> subprocess.Popen[bytes]:
    """Start torchrun; its output goes to <workdir>/torchrun.log. ``hold_at``: the ranks wait at
    that step (the first logging interval at or past it) for :func:`release` or a signal, their
    figures published; the gate's files are in :func:`hold_dir`."""
    entry: tuple[str, ...] = ("-m", "gputrain")
    if dump_ranks:
        entry = (str(RANK_DUMP), f"--dump-dir={run.workdir / 'ranks'}")
        if no_batchnorm:
            entry += ("--no-batchnorm",)
        if steps is not None:
            entry += (f"--steps={steps}",)
    env = run.environment() | (extra_env or {})
    if hold_at is not None:
        shutil.rmtree(hold_dir(run), ignore_errors=True)  # an earlier attempt's gate in this workdir
        env |= hold_env(hold_dir(run), hold_at)
    run.workdir.mkdir(parents=True, exist_ok=True)
    log = (run.workdir / "torchrun.log").open("ab")
    command = run.command(launcher_args, entry)
    if any(a.startswith("--rdzv-endpoint") for a in launcher_args):
        command.remove("--standalone")
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)


def hold_dir(run: LocalRun) -> Path:
    return run.workdir / "hold"


def finish(run: LocalRun, process: subprocess.Popen[bytes], timeout: float = 240) -> int:
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        raise AssertionError(f"training did not finish in {timeout}s:\n{log_of(run)}") from None


def train(run: LocalRun, **kwargs: Any) -> int:
    return finish(run, start(run, **kwargs))


def log_of(run: LocalRun) -> str:
    path = run.workdir / "torchrun.log"
    return path.read_text(errors="replace") if path.exists() else ""


def wait_for_step(
    run: LocalRun, process: subprocess.Popen[bytes], step: int, timeout: float = 240
) -> TrainerMetrics:
    """The live figures of a run started with ``hold_at=step``, once every rank waits there.

    Held, the trainer cannot finish (or pass the step) while the test looks, signals or kills:
    polling a free-running trainer raced it (69 steps of digits can pass between two polls on
    a loaded machine)."""
    held = wait_held(hold_dir(run), run.processes, lambda: process.poll() is None, timeout)
    assert held >= step, (held, step)
    metrics = scrape(run.metrics_port)
    assert metrics is not None, log_of(run)
    assert metrics.step == held, (metrics, held)
    return metrics


def elastic_launcher_args(max_restarts: int) -> tuple[str, ...]:
    """torchrun as the training-operator runs it for elastic jobs: c10d rendezvous, 1 to 2 nodes.

    ``start`` drops ``--standalone`` when these are given.
    """
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return (
        f"--max-restarts={max_restarts}",
        "--nnodes=1:2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-conf=last_call_timeout=1",
    )


def worker_pids(parent: int) -> list[int]:
    """Direct children of a process (torchrun's workers), from /proc."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent:
            children.append(int(stat.parent.name))
    return sorted(children)


def rank_states(run: LocalRun) -> list[dict[str, torch.Tensor]]:
    """Each rank's final parameters and buffers, as dumped by rank_dump.py."""
    paths = sorted((run.workdir / "ranks").glob("rank-*.pt"))
    return [torch.load(p, weights_only=True) for p in paths]


GPUOP = Path(sys.executable).parent / "gpuop"
# As a terminal starts it: SIGINT at its default. A pytest started in the background by a shell
# (`make test &`) inherits SIGINT ignored, and so would `gpuop run`: Ctrl-C would then never
# reach it. (A disposition set to default survives exec; preexec_fn is unsafe with the threads a
# test session has.)
AS_A_TERMINAL_STARTS_IT = [sys.executable, "-c", "import os, signal, sys; "
                           "signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"]  # fmt: skip


def start_gpuop_run(
    spec_file: Path, workdir: Path, *extra: str, env: Mapping[str, str] | None = None
) -> subprocess.Popen[str]:
    """`gpuop run -o json` of the GpuTraining in ``spec_file``, in a process group of its own (the
    foreground group a terminal's Ctrl-C goes to), with ``env`` over this environment."""
    return subprocess.Popen(
        [*AS_A_TERMINAL_STARTS_IT, GPUOP, "run", "-f", str(spec_file), "-o", "json", "--workdir", str(workdir), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env=dict(os.environ) | dict(env or {}),
    )  # fmt: skip
