"""``gpuop run`` of a spec whose ``command`` is the user's own code: a real Hugging Face
``Trainer`` script with no reporting code of ours (examples/hf-trainer/train.py), run as a
GpuTraining's pod would run it, reports its progress by Kubeflow's protocol by itself; the run
shows it live and ends with the status the operator would write.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuop.local import processes
from support.paths import ROOT
from support.training import pace_env, start_gpuop_run

GPUOP = Path(sys.executable).parent / "gpuop"
HF_SCRIPT = ROOT / "examples" / "hf-trainer" / "train.py"


def _spec(
    tmp_path: Path, name: str, command: list[str], workers: int = 1, env: dict[str, str] | None = None
) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "apiVersion": "gpuop.io/v1alpha1", "kind": "GpuTraining", "metadata": {"name": name},
        "spec": {"image": "registry.example.com/team/own:1", "command": command, "workers": workers,
                 "gpusPerWorker": 0, "env": [{"name": k, "value": v} for k, v in (env or {}).items()]},
    }))  # fmt: skip
    return path


def _run(spec: Path, tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    done = subprocess.run(
        [GPUOP, "run", "-f", str(spec), "-o", "json", "--workdir", str(tmp_path / "work")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    status = json.loads(done.stdout) if done.stdout.strip() else {}
    return done, status


def test_a_hugging_face_trainer_script_reports_by_itself_and_ends_succeeded_with_its_loss(
    tmp_path: Path,
) -> None:
    # Transformers' callback sends a mid-run report at most every 5 s (its _MIN_UPDATE_INTERVAL);
    # unpaced, these 12 steps take 0.2 s and only the first and last reports (no step) are sent.
    # 0.7 s a step makes the run ~8 s long, so at least one report with a step comes by construction.
    spec = _spec(tmp_path, "hf", ["torchrun", str(HF_SCRIPT), "--samples", "48", "--epochs", "2",
                                  "--output-dir", str(tmp_path / "hf-out")], env=pace_env(0.7))  # fmt: skip
    done, status = _run(spec, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert status["phase"] == "Succeeded"
    progress = status["progress"]
    # From Transformers' own KubeflowCallback, switched on by the variable gpuop run sets.
    assert progress["source"] == "TrainerStatus"
    assert progress["percent"] == 100
    assert progress["loss"] > 0
    assert progress["totalSteps"] == 12  # 48 samples / batch 8 x 2 epochs, as HF counts them
    assert {m["name"] for m in progress["metrics"]} >= {"learning_rate", "train_runtime"}
    # The live bar showed the run, and its summary names the history written from the reports.
    assert "step " in done.stderr
    history = (tmp_path / "work" / "hf" / "output" / "metrics.jsonl").read_text().splitlines()
    assert history
    assert all(json.loads(line)["step"] >= 1 for line in history)


def test_a_command_this_machine_lacks_is_one_line_naming_spec_command(tmp_path: Path) -> None:
    spec = _spec(tmp_path, "missing", ["no-such-launcher", "train.py"])
    done, _ = _run(spec, tmp_path)
    assert done.returncode == 2
    assert "spec.command: cannot run 'no-such-launcher' here" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_plain_loop_on_gpureport_on_two_processes_reports_from_rank_0(tmp_path: Path) -> None:
    spec = _spec(tmp_path, "loop", ["torchrun", str(ROOT / "examples" / "plain-loop" / "train.py"), "--steps", "40"],
                 workers=2)  # fmt: skip
    done, status = _run(spec, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    progress = status["progress"]
    assert (status["phase"], progress["source"], progress["reportedBy"]) == (
        "Succeeded",
        "TrainerStatus",
        "local-0",
    )
    assert (progress["step"], progress["totalSteps"], progress["percent"]) == (40, 40, 100)
    assert progress["loss"] >= 0
    assert progress["samplesPerSecond"] > 0


@pytest.mark.parametrize("workers", [1, 2])
def test_a_lightning_module_reports_through_its_callback(tmp_path: Path, workers: int) -> None:
    """On two workers, one DDP training: each rank takes half the batches. Before, Lightning's
    defaults (one node, one device) made each rank a training of its own on all the data."""
    spec = _spec(
        tmp_path,
        "lit",
        ["torchrun", str(ROOT / "examples" / "lightning" / "train.py"), "--epochs", "2"],
        workers,
    )
    done, status = _run(spec, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    progress = status["progress"]
    assert (status["phase"], progress["source"]) == ("Succeeded", "TrainerStatus")
    # 512 samples / batch 32 = 16 batches an epoch, shared by the ranks; 2 epochs
    assert (progress["totalSteps"], progress["percent"]) == (32 // workers, 100)
    assert (progress["epoch"], progress["totalEpochs"]) == (2, 2)
    assert progress["loss"] >= 0


IGNORES_STOP_SIGNALS = """\
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(os.path.join(sys.argv[1], "rank-" + os.environ["RANK"] + ".pid"), "w") as f:
    f.write(str(os.getpid()))
while True:
    time.sleep(1)
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the ranks in Linux's /proc")
def test_a_second_ctrl_c_stops_a_rank_that_ignores_the_first(tmp_path: Path) -> None:
    """Ctrl-C twice: the first asks the trainers to checkpoint and stop, the second stops the
    run at once. Before, the second killed torchrun's process group alone, and a rank that had
    not stopped (hung in a collective, or deaf to signals as here) ran on, orphaned: torchrun
    starts each rank in a session of its own."""
    script = tmp_path / "deaf.py"
    script.write_text(IGNORES_STOP_SIGNALS)
    spec = _spec(tmp_path, "deaf", ["torchrun", str(script), str(tmp_path)])
    # As a terminal starts a foreground job: its own process group, Ctrl-C at its default action.
    # Started with SIGINT ignored as inherited (a shell's background job, `make test &`), `gpuop
    # run` ignored the first Ctrl-C, and this test failed in two CI runs started so.
    run = start_gpuop_run(spec, tmp_path / "work")
    pid_file = tmp_path / "rank-0.pid"
    rank = None
    try:
        deadline = time.monotonic() + 120
        while not (pid_file.is_file() and pid_file.read_text()):
            assert run.poll() is None, run.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the rank never started"
            time.sleep(0.1)
        rank = int(pid_file.read_text())

        def torchrun_log() -> str:
            return "".join(
                log.read_text(errors="replace") for log in (tmp_path / "work").rglob("trainer.log")
            )

        # torchrun says it passed the signal on (gpuop run is waiting for it by then); the rank
        # ignored it and runs on.
        os.killpg(run.pid, signal.SIGINT)
        passed_on = time.monotonic() + 60
        while "closing signal" not in torchrun_log():
            assert run.poll() is None, run.communicate()[1][-3000:]
            assert time.monotonic() < passed_on, (
                f"torchrun never passed the first Ctrl-C on; its log: {torchrun_log()[-2000:]!r}"
            )
            time.sleep(0.1)
        assert processes.alive(rank)
        os.killpg(run.pid, signal.SIGINT)
        _, err = run.communicate(timeout=60)
        assert run.returncode != 0, err[-3000:]
        assert not processes.alive(rank), "the rank outlived `gpuop run`"
    finally:
        if run.poll() is None:
            run.kill()
        if rank is not None and processes.alive(rank):
            os.kill(rank, signal.SIGKILL)
