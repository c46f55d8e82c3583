"""Real distributed training on CPU: torchrun, 2 processes, gloo, scikit-learn's digits."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from gputrain.contract import EXIT_BAD_CONFIG, EXIT_DATA_MISSING, HISTORY_FILE, read_history
from support.paths import ROOT
from support.training import (
    GPUOP,
    digits_run,
    elastic_launcher_args,
    finish,
    hold_dir,
    hold_env,
    log_of,
    rank_states,
    release,
    start,
    start_gpuop_run,
    train,
    wait_for_step,
    wait_held,
    worker_pids,
)


def relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    num = sum(float(((a[k].double() - b[k].double()) ** 2).sum()) for k in a if a[k].is_floating_point())
    den = sum(float((a[k].double() ** 2).sum()) for k in a if a[k].is_floating_point())
    return (num / den) ** 0.5


def test_local_run_of_the_demo_learns_digits(tmp_path: Path) -> None:
    """`gpuop run` (what `make run` does): loss falls, test accuracy >= 0.90, status Succeeded."""
    done = subprocess.run(
        [
            GPUOP,
            "run",
            "-f",
            str(ROOT / "examples" / "local-digits.yaml"),
            "-o",
            "json",
            "--workdir",
            str(tmp_path),
            "--plot",
            str(tmp_path / "curves.png"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    status = json.loads(done.stdout)
    assert status["phase"] == "Succeeded"
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Succeeded"]["status"] == "True"
    # torchrun ran it here: no PyTorchJob was made, and the status does not say one was.
    assert conditions["Created"]["message"] == "torchrun local-digits created"
    assert "pytorchJob" not in status
    assert "PyTorchJob" not in done.stdout
    progress = status["progress"]
    assert progress["accuracy"] >= 0.90
    assert (progress["percent"], progress["step"]) == (100.0, progress["totalSteps"])
    assert status["gpu"]["count"] == 0
    assert status["gpuHours"] == 0.0
    losses = [
        float(x)
        for x in re.findall(r" loss (\d+\.\d+) ", (tmp_path / "local-digits" / "trainer.log").read_text())
    ]
    assert len(losses) > 10
    assert losses[-1] < losses[0] / 10, losses
    assert (tmp_path / "local-digits" / "output" / "model.pt").is_file()

    # The run's curves: its history (every logging interval and evaluation), TensorBoard's
    # events, the summary in the terminal, and the picture.
    output = tmp_path / "local-digits" / "output"
    points = read_history((output / HISTORY_FILE).read_text())
    trained = [p for p in points if p.loss is not None]
    assert len(trained) > 10
    assert trained[-1].loss < trained[0].loss / 10
    assert all(p.learning_rate and p.samples_per_second for p in trained)
    evaluated = [p.accuracy for p in points if p.accuracy is not None]
    assert len(evaluated) == 15  # one per epoch
    assert evaluated[-1] == pytest.approx(progress["accuracy"])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(output / "tensorboard"))
    board.Reload()
    assert {"train/loss", "train/learning_rate", "train/samples_per_second", "eval/accuracy"} <= set(
        board.Tags()["scalars"]
    )
    assert [e.step for e in board.Scalars("train/loss")] == [p.step for p in trained]
    assert "local-digits succeeded in " in done.stderr
    assert re.search(r"\n  loss +[0-9.]+ [▁▂▃▄▅▆▇█]{20,} [0-9.e-]+\n", done.stderr), done.stderr
    assert "[########################] 100.0%" in done.stderr  # the bar ends at 100%, not at the last scrape
    picture = (tmp_path / "curves.png").read_bytes()
    assert picture.startswith(b"\x89PNG\r\n\x1a\n")
    assert len(picture) > 20_000  # three panels of curves, not an empty canvas


def test_ranks_end_with_identical_models(tmp_path: Path) -> None:
    run = digits_run(tmp_path, epochs=2)
    assert train(run, dump_ranks=True) == 0, log_of(run)
    first, second = rank_states(run)
    assert first.keys() == second.keys()
    for key in first:  # parameters and BatchNorm statistics alike
        assert torch.equal(first[key], second[key]), key


def test_bf16_on_cpu_trains_and_says_when_this_cpu_runs_it_in_fp32(tmp_path: Path) -> None:
    """bf16 autocast where the CPU has bf16 arithmetic; elsewhere fp32, said in each rank's log."""
    from gputrain.train import cpu_computes_bf16_natively

    run = digits_run(tmp_path, precision="bf16", epochs=3)
    assert train(run) == 0, log_of(run)
    result = json.loads(run.termination_log.read_text())
    assert result["phase"] == "Succeeded"
    assert result["accuracy"] >= 0.9
    said = log_of(run).count("this CPU has no bf16 arithmetic (AVX512-BF16 or AMX)")
    assert said == (0 if cpu_computes_bf16_natively() else 2), log_of(run)  # once per rank


def test_compile_under_ddp_with_accumulation_trains_and_ranks_agree(tmp_path: Path) -> None:
    """``compile: true`` on 2 ranks: the compiled DDP module with no_sync micro-steps, and a
    smaller last batch (a recompile) at the end of the epoch."""
    run = digits_run(tmp_path, epochs=1, compile=True, gradientAccumulationSteps=2)
    assert finish(run, start(run, dump_ranks=True), timeout=480) == 0, log_of(run)
    result = json.loads(run.termination_log.read_text())
    assert (result["phase"], result["step"]) == ("Succeeded", 12)  # 23 micro-batches per rank
    assert result["accuracy"] >= 0.5, result  # 10 classes: it learns within one epoch
    first, second = rank_states(run)
    for key in first:
        assert torch.equal(first[key], second[key]), key


def test_gradient_accumulation_4x8_equals_batch_32(tmp_path: Path) -> None:
    """One optimizer step on 2 ranks: four no_sync micro-steps of 8 == one step of 32.

    BatchNorm is swapped out (its statistics depend on the micro-batch size), and a single
    step is compared: Adam's first updates are sign-like, so over many steps it amplifies
    float summation-order noise into percent-level differences.
    """
    runs = {
        name: digits_run(
            tmp_path / name, epochs=1, batchSize=batch, gradientAccumulationSteps=accum, maxGradNorm=0
        )
        for name, batch, accum in (("big", 32, 1), ("accumulated", 8, 4), ("small", 8, 1))
    }
    for run in runs.values():
        assert train(run, dump_ranks=True, no_batchnorm=True, steps=1) == 0, log_of(run)
    big, accumulated, small = (rank_states(runs[n])[0] for n in ("big", "accumulated", "small"))
    assert relative_difference(big, accumulated) < 1e-4
    assert relative_difference(big, small) > 1e-2  # the comparison can tell a different batch apart


def test_sigterm_checkpoints_and_resume_matches_an_uninterrupted_run(tmp_path: Path) -> None:
    straight = digits_run(tmp_path / "straight", epochs=3)
    assert train(straight, dump_ranks=True) == 0, log_of(straight)

    interrupted = digits_run(tmp_path / "interrupted", epochs=3)
    process = start(interrupted, dump_ranks=True, hold_at=25)
    metrics = wait_for_step(interrupted, process, 25)
    # The metrics endpoint serves live progress while training.
    assert metrics.total_steps == 69
    assert metrics.percent == pytest.approx(100 * metrics.step / 69)  # type: ignore[operator]
    assert metrics.loss is not None
    assert metrics.epoch == 2
    process.send_signal(signal.SIGTERM)  # to torchrun, which passes it on, as the kubelet does
    assert finish(interrupted, process) != 0
    record = json.loads(interrupted.termination_log.read_text())
    assert record["reason"] == "Preempted", record
    stopped_at = int(re.search(r"at step (\d+)", record["message"]).group(1))  # type: ignore[union-attr]
    assert stopped_at >= 25
    assert (interrupted.checkpoint_dir / f"step-{stopped_at:08d}.json").is_file()  # complete

    assert train(interrupted, dump_ranks=True) == 0, log_of(interrupted)
    assert f"resumed from {interrupted.checkpoint_dir}/step-{stopped_at:08d}-" in log_of(interrupted)
    for expected, resumed in zip(rank_states(straight), rank_states(interrupted), strict=True):
        for key in expected:
            torch.testing.assert_close(resumed[key], expected[key], rtol=1e-5, atol=1e-6, msg=key)


def test_a_killed_worker_is_restarted_and_finishes_from_the_checkpoint(tmp_path: Path) -> None:
    """Elastic torchrun (c10d, --nnodes=1:2) restarts the group after a SIGKILL.

    Without TORCH_DISABLE_SHARE_RDZV_TCP_STORE, so it is the trainer's own per-attempt store
    prefix that keeps the new group from dialling the dead one (pytorch/pytorch#135712):
    measured without that prefix, this run fails with "Gloo connectFullMesh failed ...
    Connection refused".
    """
    run = digits_run(tmp_path, epochs=3)
    process = start(run, launcher_args=elastic_launcher_args(max_restarts=1), hold_at=15)
    wait_for_step(run, process, 15)  # a checkpoint at step 10 exists
    workers = worker_pids(process.pid)
    assert len(workers) == 2
    os.kill(workers[1], signal.SIGKILL)
    release(hold_dir(run))  # the survivor, and the restarted group, train on
    assert finish(run, process) == 0, log_of(run)
    log = log_of(run)
    resumed = re.search(r"resumed from \S+step-(\d+)-[0-9a-f]{8}\.pt", log)
    assert resumed is not None, log
    assert int(resumed.group(1)) >= 10
    result = json.loads(run.termination_log.read_text())
    assert (result["phase"], result["step"], result["totalSteps"]) == ("Succeeded", 69, 69)


def _gpuop_run(tmp_path: Path, spec: dict[str, Any]) -> tuple[int, dict[str, Any], str]:
    body = {"apiVersion": "gpuop.io/v1alpha1", "kind": "GpuTraining", "metadata": {"name": "t"}, "spec": spec}
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(body))
    done = subprocess.run(
        [GPUOP, "run", "-f", str(path), "-o", "json", "--workdir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return done.returncode, json.loads(done.stdout), done.stderr


def test_missing_dataset_fails_with_the_path_and_expected_files(tmp_path: Path) -> None:
    empty = tmp_path / "nothing-here"
    empty.mkdir()
    code, status, _ = _gpuop_run(
        tmp_path, {"workers": 2, "gpusPerWorker": 0, "dataset": {"name": "mnist", "path": str(empty)}}
    )
    assert code == 1
    assert status["phase"] == "Failed"
    condition = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert (condition["status"], condition["reason"]) == ("True", "DatasetMissing")
    assert condition["message"] == (
        f"dataset mnist: train-images-idx3-ubyte not found under {empty} (expected train-images-idx3-ubyte, "
        "train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte (or .gz)); the trainer never "
        "downloads data: put the files on the dataset volume"
    )


def _trainer(env: dict[str, str], *args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("GPUTRAIN_", "RANK", "WORLD_SIZE"))}
    return subprocess.run(
        [sys.executable, "-m", "gputrain", f"--termination-log={tmp_path / 'term'}", *args],
        env=clean | env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_trainer_refuses_bad_settings_with_one_line_each(tmp_path: Path) -> None:
    env = digits_run(tmp_path).environment()
    env = {k: v for k, v in env.items() if k.startswith("GPUTRAIN_")}
    env["GPUTRAIN_EPOCHS"] = "0"
    env["GPUTRAIN_PRECISION"] = "fp8"
    done = _trainer(env, "--batch-size=many", tmp_path=tmp_path)
    assert done.returncode == EXIT_BAD_CONFIG
    errors = [line.split(" ERROR ", 1)[1] for line in done.stdout.splitlines() if " ERROR " in line]
    assert errors == [
        "bad setting: GPUTRAIN_BATCH_SIZE: must be an integer (got 'many')",
        "bad setting: GPUTRAIN_PRECISION: must be one of fp32, bf16, fp16 (got 'fp8')",
    ]
    assert "Traceback" not in done.stdout + done.stderr
    assert json.loads((tmp_path / "term").read_text())["reason"] == "InvalidSettings"
    done = _trainer(env | {"GPUTRAIN_PRECISION": "fp32"}, tmp_path=tmp_path)
    assert done.returncode == EXIT_BAD_CONFIG
    assert "bad setting: GPUTRAIN_EPOCHS: must be >= 1 (got 0)" in done.stdout


def test_trainer_alone_exits_3_on_missing_data(tmp_path: Path) -> None:
    env = {k: v for k, v in digits_run(tmp_path).environment().items() if k.startswith("GPUTRAIN_")}
    done = _trainer(
        env | {"GPUTRAIN_DATASET": "cifar10", "GPUTRAIN_DATA_DIR": str(tmp_path)}, tmp_path=tmp_path
    )
    assert done.returncode == EXIT_DATA_MISSING
    assert f"dataset cifar10: data_batch_1 not found under {tmp_path}" in done.stdout


def test_running_a_finished_job_again_reports_the_runs_figures(tmp_path: Path) -> None:
    """A restart after the last checkpoint trains nothing, but its result is still the run's."""
    run = digits_run(tmp_path, epochs=2)
    assert train(run) == 0, log_of(run)
    first = json.loads(run.termination_log.read_text())
    assert train(run) == 0, log_of(run)
    again = json.loads(run.termination_log.read_text())
    for key in ("loss", "accuracy", "testLoss", "step", "samplesPerSecond"):
        assert again[key] == first[key], key
    assert again["accuracy"] >= 0.9
    assert again["samplesPerSecond"] > 0


def _logged_learning_rates(log: str) -> list[float]:
    return [float(m.group(1)) for m in re.finditer(r" lr (\S+) ", log)]


def test_resumed_on_one_worker_after_two_progress_and_the_lr_carry_on(tmp_path: Path) -> None:
    """Stopped at step 25+ of 69 on 2 workers, resumed on 1 (what `gpuop run --workers 1` or an
    elastic shrink does): an epoch is now twice the steps, and yet the percentage goes on from
    where it was, the LR from where it was on the same curve, and the run ends at 100% with
    step == totalSteps (before: "step 565 of 675, 100%", and the schedule started over)."""
    two = digits_run(tmp_path, workers=2, epochs=3)
    process = start(two, hold_at=25)
    before = wait_for_step(two, process, 25)
    process.send_signal(signal.SIGTERM)
    assert finish(two, process) != 0
    record = json.loads(two.termination_log.read_text())
    stopped_at = int(re.search(r"at step (\d+)", record["message"]).group(1))  # type: ignore[union-attr]
    (state,) = two.checkpoint_dir.glob(f"step-{stopped_at:08d}-*.pt")
    checkpoint = torch.load(state, map_location="cpu", weights_only=False)
    lr_before = float(checkpoint["optimizer"]["param_groups"][0]["lr"])  # the last step's, at the stop

    one = digits_run(tmp_path, workers=1, epochs=3)  # the same directories: the same checkpoints
    process = start(one, hold_at=stopped_at + 1)
    after = wait_for_step(one, process, stopped_at + 1)
    assert after.percent is not None
    assert before.percent is not None
    assert after.percent >= before.percent, (before.percent, after.percent)
    release(hold_dir(one))
    assert finish(one, process) == 0, log_of(one)
    assert "the world size changed" in log_of(one), log_of(one)
    resumed_log = log_of(one).split(" resumed from ", 1)[1]  # one log file, both attempts
    result = json.loads(one.termination_log.read_text())
    assert result["phase"] == "Succeeded"
    assert result["step"] == result["totalSteps"]
    assert result["totalSteps"] > 69  # 1 worker: more, smaller global batches
    assert result["worldSize"] == 1
    assert result["accuracy"] > 0.9
    # The first LR logged after the resume (one step on) is the curve's there: a little below
    # the one at the stop, not the warmup of a schedule restarted for a run of twice the steps.
    lr_after = _logged_learning_rates(resumed_log)[0]
    assert lr_after <= lr_before
    assert lr_before - lr_after < 0.1 * 0.003, (lr_before, lr_after)


def _start_gpuop_run(
    tmp_path: Path, epochs: int, hold_at: int | None = None
) -> tuple[subprocess.Popen[str], Path]:
    """`gpuop run` of a digits spec, in a process group of its own: the foreground group a
    terminal's Ctrl-C goes to. ``hold_at``: its trainers wait at that step for a signal or
    :func:`release` (the gate's files in ``tmp_path/hold``)."""
    body = {"apiVersion": "gpuop.io/v1alpha1", "kind": "GpuTraining", "metadata": {"name": "t"},
            "spec": {"workers": 2, "gpusPerWorker": 0, "dataset": {"name": "digits", "loaderWorkers": 0},
                     "training": {"epochs": epochs, "batchSize": 32, "precision": "fp32", "logEverySteps": 5},
                     "checkpoint": {"everySteps": 1000, "keep": 1}}}  # fmt: skip
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(body))
    hold = hold_env(tmp_path / "hold", hold_at) if hold_at is not None else {}
    process = start_gpuop_run(path, tmp_path / "work", env=hold)
    return process, tmp_path / "work" / "t"


def _wait_held(tmp_path: Path, process: subprocess.Popen[str]) -> int:
    """Both ranks of a `gpuop run` started with ``hold_at`` wait there; the step they hold at."""
    return wait_held(tmp_path / "hold", 2, lambda: process.poll() is None)


def _run_processes(directory: Path) -> list[int]:
    """Processes whose command line names the run directory (torchrun and trainers pass it)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if str(directory).encode() in (proc / "environ").read_bytes():
                    found.append(int(proc.name))
            except OSError:
                continue
    return found


def test_ctrl_c_checkpoints_exits_130_and_a_second_run_resumes(tmp_path: Path) -> None:
    """Ctrl-C as a terminal sends it (SIGINT to the foreground process group): the trainers
    finish their step, checkpoint and stop; `gpuop run` exits 130 with the status Suspended /
    Interrupted, not Failed; the next `gpuop run` resumes there (its own log beside the first)."""
    process, directory = _start_gpuop_run(tmp_path, epochs=3, hold_at=20)
    _wait_held(tmp_path, process)
    # A second run in the same directory while this one trains: refused, naming the holder.
    second, _ = _start_gpuop_run(tmp_path, epochs=3)
    assert second.wait(30) == 2
    assert f"is in use by another gpuop run (pid {process.pid})" in second.communicate()[1]
    os.killpg(process.pid, signal.SIGINT)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 130, err
    status = json.loads(out)
    assert status["phase"] == "Suspended", status
    condition = next(c for c in status["conditions"] if c["type"] == "Suspended")
    assert condition["reason"] == "Interrupted"
    stopped_at = int(re.search(r"stopped by SIGINT \(Ctrl-C\) at step (\d+)", condition["message"]).group(1))  # type: ignore[union-attr]
    assert (directory / "checkpoints" / f"step-{stopped_at:08d}.json").is_file()
    assert _run_processes(directory) == []  # nothing trains on unobserved

    again, _ = _start_gpuop_run(tmp_path, epochs=3)
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err
    assert json.loads(out)["phase"] == "Succeeded"
    assert re.search(
        rf"step-{stopped_at:08d}-[0-9a-f]{{8}}\.pt at epoch", (directory / "trainer.log").read_text()
    )
    assert len(list(directory.glob("trainer-*.log"))) == 1  # the interrupted attempt's log, kept


def test_sigterm_to_gpuop_run_alone_stops_the_whole_run(tmp_path: Path) -> None:
    """Before: torchrun and both trainers went on, orphaned and unobserved."""
    process, directory = _start_gpuop_run(tmp_path, epochs=3, hold_at=10)
    _wait_held(tmp_path, process)
    process.send_signal(signal.SIGTERM)  # to gpuop run's process only
    out, _ = process.communicate(timeout=120)
    assert process.returncode == 143
    condition = next(c for c in json.loads(out)["conditions"] if c["type"] == "Suspended")
    assert condition["reason"] == "Preempted"
    assert _run_processes(directory) == []


def _trainer_pids(directory: Path) -> list[int]:
    """The trainer processes of a `gpuop run` (not torchrun, not gpuop run itself)."""
    pids = []
    for pid in _run_processes(directory):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"gputrain" in argv and not any(b"torchrun" in a or b"distributed.run" in a for a in argv):
            pids.append(pid)
    return pids


def test_a_killed_worker_is_named_with_its_signal_and_how_to_resume(tmp_path: Path) -> None:
    """SIGKILL of one rank (as the OOM killer does): before, exit 1 "the trainer exited with code
    1" and nothing else; now which rank, which signal, and where a rerun resumes."""
    process, directory = _start_gpuop_run(tmp_path, epochs=3, hold_at=25)
    _wait_held(tmp_path, process)  # past epoch 1's checkpoint
    ranks = _trainer_pids(directory)
    assert len(ranks) == 2, ranks
    os.kill(ranks[-1], signal.SIGKILL)
    release(tmp_path / "hold")
    out, _ = process.communicate(timeout=120)
    assert process.returncode == 1
    condition = next(c for c in json.loads(out)["conditions"] if c["type"] == "Failed")
    assert condition["reason"] == "TrainerFailed"
    assert re.fullmatch(
        r"rank \d was killed by SIGKILL \(the kernel's OOM killer sends it when memory runs out\); torchrun then "
        r"stopped the others; `gpuop run` again resumes from its checkpoint at step \d+",
        condition["message"],
    ), condition["message"]


def test_a_finished_run_is_said_to_be_finished_and_fresh_starts_over(tmp_path: Path) -> None:
    """Before: a rerun printed the old Succeeded after 12 s ("resumed at epoch 16 of 15")."""
    process, directory = _start_gpuop_run(tmp_path, epochs=1)
    assert process.wait(120) == 0, process.communicate()
    again, _ = _start_gpuop_run(tmp_path, epochs=1)
    _, err = again.communicate(timeout=60)
    assert again.returncode == 2
    assert f"error: t already finished in {directory} (Succeeded at step 23 of 23" in err
    assert "add --fresh to train it again from the start" in err
    fresh = subprocess.run(
        [GPUOP, "run", "-f", str(tmp_path / "t.yaml"), "-o", "json", "--workdir", str(tmp_path / "work"), "--fresh"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert fresh.returncode == 0, fresh.stderr
    (kept,) = directory.glob("previous-*")
    assert (kept / "output" / "result.json").is_file()  # moved aside, not deleted
    assert "resumed from" not in (directory / "trainer.log").read_text()
