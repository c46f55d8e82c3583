"""``gpuop run``: the same GpuTraining, trained on this machine instead of a cluster.

It reuses every piece the operator uses except the cluster: the spec model, the trainer's
environment from :func:`gpuop.backends.pod.trainer_env`, the progress-report endpoint
(:mod:`gpuop.local.runreports`), the metrics scrape and the status derivation. Only "create a
PyTorchJob" becomes "start torchrun here" -- or, for a spec with its own ``command``, "run
that command with the environment a pod of the job would have" (torchrun's PET_* variables,
the rendezvous address), as the training-operator would start it in the container.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

from gpuop._kits.schema import encode
from gpuop.api.spec import GpuTraining
from gpuop.api.status import TIME_FORMAT, GpuTrainingStatus
from gpuop.backends.pod import trainer_env
from gpuop.local import processes, runreports
from gpuop.observing.derive import derive_status
from gpuop.observing.records import JobCondition, Observation, PodObservation, ReceivedReport, Thresholds
from gpuop.observing.scrape import TrainerMetrics, parse_metrics
from gputrain.contract import (
    HISTORY_FILE,
    RESULT_FILE,
    STOPPED_BY_SIGNAL,
    HistoryPoint,
    Result,
    complete_checkpoint_step,
    env_name,
    read_history,
)

POLL_SECONDS = 0.5
LOCAL_POD = "local-0"


def _now() -> datetime:
    return datetime.now(UTC).replace(microsecond=0)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclasses.dataclass(frozen=True)
class LocalRun:
    """How to run one GpuTraining here."""

    training: GpuTraining
    processes: int
    workdir: Path
    metrics_port: int

    @property
    def checkpoint_dir(self) -> Path:
        return self.workdir / self.training.name / "checkpoints"

    @property
    def output_dir(self) -> Path:
        return self.workdir / self.training.name / "output"

    @property
    def termination_log(self) -> Path:
        return self.workdir / self.training.name / "termination-log"

    @property
    def data_dir(self) -> Path | None:
        """Where spec.dataset.uri is copied here (as the pod's cache is there); None without one."""
        dataset = self.training.spec.dataset
        return self.workdir / self.training.name / "data" if dataset is not None and dataset.uri else None

    @property
    def custom(self) -> bool:
        """Whether the spec runs its own command (its own code) rather than the built-in trainer."""
        return self.training.spec.command is not None

    def environment(self, reports: Mapping[str, str] | None = None) -> dict[str, str]:
        """This machine's environment plus the trainer's, with local directories and port, and
        where to report progress."""
        env = dict(os.environ)
        env.update(reports or {})
        for var in trainer_env(self.training.name, self.training.spec):
            if "valueFrom" not in var:  # no "value": set, to "" (pod.env_var)
                env[var["name"]] = var.get("value", "")
        if self.training.spec.checkpoint.uri is None:
            # A volume's path means this machine's work directory; a bucket means the bucket,
            # here as in a cluster: a run resumes from what the other wrote.
            env[env_name("checkpoint_dir")] = str(self.checkpoint_dir)
        env[env_name("output_dir")] = str(self.output_dir)
        if self.data_dir is not None:
            env[env_name("data_dir")] = str(self.data_dir)
        env[env_name("metrics_port")] = str(self.metrics_port)
        if self.training.spec.uses_gpus and "CUDA_VISIBLE_DEVICES" not in env:
            # What the device plugin does in a pod: the run sees the GPUs it uses and no others,
            # so its NVML figures (and the status's GPU figures) are this run's, not the machine's.
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(self.processes))
        env.setdefault("PYTHONUNBUFFERED", "1")
        if self.custom:
            # After a restart, torchrun's store (which its workers share unless told not to)
            # still holds the last attempt's keys, which a user's code may trip on
            # (pytorch/pytorch#135712). The built-in trainer keys its rendezvous per attempt and
            # shares it: a store of the workers' own would listen on a port torchrun picked and
            # let go, which any other process on the machine can take first (EADDRINUSE).
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
            # `torchrun` and `python` of the environment gpuop runs in, activated or not.
            scripts = str(Path(sys.executable).parent)
            env["PATH"] = os.pathsep.join([scripts, env.get("PATH", "")])
            # What Kubeflow gives a one-node job's pod (both APIs set PET_*, torchrun's own
            # defaults): a plain `torchrun train.py` starts this run's processes.
            port = str(_free_port())
            env.update({"PET_NNODES": "1", "PET_NODE_RANK": "0", "PET_NPROC_PER_NODE": str(self.processes),
                        "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": port, "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": port, "WORLD_SIZE": "1", "RANK": "0"})  # fmt: skip
        return env

    def custom_command(self, env: Mapping[str, str]) -> list[str]:
        """The spec's command and args, with ``$(VAR)`` expanded from ``env`` as Kubernetes does."""
        spec = self.training.spec
        assert spec.command is not None
        return [expand(part, env) for part in (*spec.command, *(spec.args or ()))]

    def command(
        self, launcher_args: tuple[str, ...] = (), entry: tuple[str, ...] = ("-m", "gputrain")
    ) -> list[str]:
        """torchrun on this machine; ``launcher_args`` (e.g. --max-restarts) go to torchrun."""
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={self.processes}",
            *launcher_args,
            *entry,
            f"--termination-log={self.termination_log}",
        ]


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' rule for command and args: ``$(VAR)`` becomes VAR's value when VAR is set
    (else stays as written), ``$$`` is one ``$``."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, text)


def visible_gpus() -> int:
    """NVIDIA GPUs this process may use, from the driver's /proc entries and CUDA_VISIBLE_DEVICES.

    Read without importing torch (the operator package never does).
    """
    driver = Path("/proc/driver/nvidia/gpus")
    count = len(list(driver.iterdir())) if driver.is_dir() else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = min(count, len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"]))
    return count


def gpu_shortfall(run: LocalRun, available: int) -> str | None:
    """One line for a GPU run this machine cannot hold, else None."""
    spec = run.training.spec
    if not spec.uses_gpus or available >= run.processes:
        return None
    return (
        f"spec.gpusPerWorker: {run.processes} GPU(s) needed here ({run.processes // spec.gpus_per_worker} "
        f"worker(s) x {spec.gpus_per_worker}) but {available} visible; set gpusPerWorker: 0 to train on CPU "
        "(gloo), or lower --workers"
    )


def plan(training: GpuTraining, workers: int | None, workdir: Path) -> LocalRun:
    """A local run: one process per worker (times GPUs per worker), in ``workdir``."""
    count = workers if workers is not None else training.spec.workers
    return LocalRun(
        training=training,
        processes=count * training.spec.processes_per_worker,
        workdir=workdir.resolve(),
        metrics_port=_free_port(),
    )


def scrape(port: int, timeout: float = 1.0) -> TrainerMetrics | None:
    """The trainer's current figures, or None while its endpoint is not up yet."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as response:
            return parse_metrics(response.read().decode())
    except (urllib.error.URLError, OSError, ValueError):
        return None


def final_status(
    run: LocalRun,
    code: int,
    last: TrainerMetrics | None,
    started: datetime,
    finished: datetime,
    report: ReceivedReport | None = None,
    *,
    asked_to_stop: bool = False,
) -> GpuTrainingStatus:
    """The status the operator would write for this run, by the operator's own derivation.

    torchrun plays the PyTorchJob: it succeeded when it exited 0 and the trainer left a
    success record (for the spec's own command, its exit 0 is enough, as for a Job). The
    trainer's own failure record, when there is one, gives the reason.
    """
    message = run.termination_log.read_text() if run.termination_log.is_file() else None
    record = Result.from_json(message) if message is not None else None
    if record is not None and record.reason in STOPPED_BY_SIGNAL and not asked_to_stop:
        # A rank torchrun stopped because another died checkpoints and says "Preempted" too;
        # without a signal from this run it is no pause: the run failed, as the other died.
        record = None
    if code == 0 and (
        (record is not None and record.phase == "Succeeded") or (run.custom and record is None)
    ):
        outcome = JobCondition("Succeeded", "True")
    elif record is not None and record.reason in STOPPED_BY_SIGNAL:
        # Stopped on purpose and checkpointed: paused, not failed; a rerun resumes.
        outcome = JobCondition("Suspended", "True", record.reason, f"{record.message}: run `gpuop run` again")
    else:
        log_path = run.workdir / run.training.name / "trainer.log"
        what = (
            stopped_rank(log_path.read_text(errors="replace")) if log_path.is_file() and code != 0 else None
        )
        resume = _resume_note(run)
        message = f"{what}{resume}" if what else f"the trainer exited with code {code}; see its log{resume}"
        outcome = JobCondition("Failed", "True", "TrainerFailed", message)
    observation = Observation(
        now=finished,
        generation=run.training.generation,
        workers_total=run.processes,
        gpus=run.processes if run.training.spec.uses_gpus else 0,
        runner="torchrun",  # no PyTorchJob here: the status must not name one
        job_name=run.training.name,
        job_conditions=(JobCondition("Created", "True"), outcome),
        job_start_time=started.strftime(TIME_FORMAT),
        job_completion_time=finished.strftime(TIME_FORMAT),
        pods=(PodObservation(LOCAL_POD, outcome.type, result=record, metrics=last),),
        reports=(report,) if report is not None else (),
    )
    return derive_status(None, observation, Thresholds(stall_timeout_seconds=0))


class RunDirectoryBusyError(Exception):
    """Another ``gpuop run`` trains in this run directory; the message says which."""


class _Stopped(BaseException):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def hold_run_directory(run: LocalRun) -> Iterator[None]:
    """Hold the run directory: two runs in one would train on each other's checkpoints."""
    directory = run.workdir / run.training.name
    directory.mkdir(parents=True, exist_ok=True)
    with (directory / ".lock").open("a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "unknown"
            raise RunDirectoryBusyError(
                f"{directory} is in use by another gpuop run (pid {holder}); wait for it to finish, stop "
                "it, or give this one another --workdir"
            ) from None
        lock.seek(0)
        lock.truncate()
        lock.write(str(os.getpid()))
        lock.flush()
        yield


def finished_result(run: LocalRun) -> str | None:
    """What an earlier run in this directory finished with, if it did: resuming it would only
    print its old status again."""
    path = run.output_dir / RESULT_FILE
    record = Result.from_json(path.read_text(errors="replace")) if path.is_file() else None
    if record is None or record.phase != "Succeeded":
        return None
    return f"Succeeded at step {record.step} of {record.total_steps}, accuracy {record.accuracy}"


def _resume_note(run: LocalRun) -> str:
    """Where a rerun resumes from, after "; " (or nothing, when it would start over)."""
    uri = run.training.spec.checkpoint.uri
    if uri is not None:
        where = f"{uri.rstrip('/')}/{run.training.name}"
        return f"; `gpuop run` again resumes from its newest checkpoint in {where}"
    found = (complete_checkpoint_step(p.name) for p in run.checkpoint_dir.glob("step-*"))
    steps = [step for step in found if step is not None]
    return f"; `gpuop run` again resumes from its checkpoint at step {max(steps)}" if steps else ""


def move_aside(run: LocalRun) -> Path | None:
    """The run's checkpoints and outputs moved to ``previous-<time>/`` in its directory (kept,
    not deleted: they may be the only copy of a model); None when there were none."""
    present = [d for d in (run.checkpoint_dir, run.output_dir) if d.is_dir() and any(d.iterdir())]
    if not present:
        return None
    target = run.workdir / run.training.name / f"previous-{_now().strftime('%Y%m%dT%H%M%SZ')}"
    target.mkdir(parents=True, exist_ok=True)
    for directory in present:
        directory.rename(target / directory.name)
    return target


def stopped_rank(log_text: str) -> str | None:
    """What torchrun's failure summary says killed the run: which rank, which signal. Its "Root
    Cause" (the first failure), not its "Failures" list, where the ranks torchrun stopped itself
    come first."""
    root = log_text.rsplit("Root Cause", 1)[-1] if "Root Cause" in log_text else log_text
    found = re.search(r"rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", root, re.DOTALL)
    if found is None:
        return None
    rank, code = int(found.group(1)), int(found.group(2))
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        cause = " (the kernel's OOM killer sends it when memory runs out)" if name == "SIGKILL" else ""
        return f"rank {rank} was killed by {name}{cause}; torchrun then stopped the others"
    return f"rank {rank} exited with code {code}; torchrun then stopped the others"


def new_log(run: LocalRun) -> Path:
    """This attempt's trainer log; an earlier attempt's is kept as ``trainer-<when>.log``."""
    path = run.workdir / run.training.name / "trainer.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        stamp = datetime.fromtimestamp(path.stat().st_mtime, UTC).strftime("%Y%m%dT%H%M%SZ")
        path.rename(path.with_name(f"trainer-{stamp}.log"))
    return path


def execute(
    run: LocalRun, show: Callable[[TrainerMetrics], None] | None, log: TextIO | None, *, lock: bool = True
) -> GpuTrainingStatus:
    """Run torchrun to the end, showing progress; returns the final status.

    torchrun runs in a session of its own, and a signal to this process (Ctrl-C, SIGTERM) is
    passed on to it, and through it to the trainers, which checkpoint and stop: nothing trains
    on unobserved after ``gpuop run`` is gone. A second signal kills them all."""
    with contextlib.ExitStack() as held:
        if lock:
            held.enter_context(hold_run_directory(run))
        if run.training.spec.checkpoint.uri is None:
            run.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        run.output_dir.mkdir(parents=True, exist_ok=True)
        run.termination_log.unlink(missing_ok=True)  # a stale record must not pass for this run's
        namespace = run.training.namespace or "default"
        endpoint = held.enter_context(
            runreports.serving(namespace, run.training.name, run.workdir / run.training.name, LOCAL_POD)
        )
        started = _now()
        env = run.environment(endpoint.env)
        fetch_dataset(run, env, log)
        command = run.custom_command(env) if run.custom else run.command()
        try:
            process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True)  # fmt: skip
        except OSError as exc:  # the spec's command is not on this machine
            raise CommandNotFoundError(
                f"spec.command: cannot run {command[0]!r} here: {exc.strerror}"
            ) from None

        points: list[HistoryPoint] = []
        last, asked_to_stop = _follow(run, process, endpoint, show, points)
        _latest_figures(run, endpoint, points)  # the final report, sent as the process ended
        if run.custom and points and not (run.output_dir / HISTORY_FILE).exists():
            # Our trainer writes its own history; for other code, the reports are the history.
            (run.output_dir / HISTORY_FILE).write_text("".join(p.to_json() + "\n" for p in points))
        return final_status(
            run, process.returncode, last, started, _now(), endpoint.latest(), asked_to_stop=asked_to_stop
        )


def _follow(
    run: LocalRun,
    process: subprocess.Popen[bytes],
    endpoint: runreports.LocalEndpoint,
    show: Callable[[TrainerMetrics], None] | None,
    points: list[HistoryPoint],
) -> tuple[TrainerMetrics | None, bool]:
    """Follow torchrun to its end, showing its figures and passing a signal to stop on to it;
    the last figures seen, and whether this run was asked to stop."""

    def stop(signum: int, frame: object) -> None:
        raise _Stopped(signum)

    previous = signal.signal(signal.SIGTERM, stop)
    asked_to_stop = False
    last: TrainerMetrics | None = None
    try:
        try:
            while process.poll() is None:
                time.sleep(POLL_SECONDS)
                metrics = _latest_figures(run, endpoint, points)
                if metrics is not None:
                    last = metrics
                    if show is not None:
                        show(metrics)
        except (KeyboardInterrupt, _Stopped) as exc:
            signum = exc.signum if isinstance(exc, _Stopped) else signal.SIGINT
            asked_to_stop = True
            try:
                # In the try: a second Ctrl-C as the first is passed on stops everything too.
                process.send_signal(signum)  # torchrun passes it to the trainers
                process.wait()
            except (KeyboardInterrupt, _Stopped):  # asked twice: no checkpoint, just stop
                processes.kill_tree(process)  # the ranks too: each runs in a session of its own
    finally:
        signal.signal(signal.SIGTERM, previous)
    return last, asked_to_stop


class CommandNotFoundError(Exception):
    """The spec's command cannot be started on this machine; the message says which."""


class DatasetFetchError(Exception):
    """spec.dataset.uri could not be copied here; the message is the step's one line."""


def fetch_dataset(run: LocalRun, env: Mapping[str, str], log: TextIO | None) -> None:
    """The dataset step a pod's init container runs (gputrain.fetch), here before torchrun, into
    :attr:`LocalRun.data_dir`: a second run copies only what changed."""
    dataset = run.training.spec.dataset
    if dataset is None or dataset.uri is None or run.data_dir is None:
        return
    record = run.workdir / run.training.name / "fetch-termination-log"
    record.unlink(missing_ok=True)
    command = [sys.executable, "-m", "gputrain.fetch", dataset.uri, str(run.data_dir),
               f"--termination-log={record}"]  # fmt: skip
    done = subprocess.run(command, env=dict(env), stdout=log, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        said = Result.from_json(record.read_text()) if record.is_file() else None
        why = said.message if said is not None and said.message else f"it exited with {done.returncode}"
        raise DatasetFetchError(f"spec.dataset.uri: {why}")


def _latest_figures(
    run: LocalRun, endpoint: runreports.LocalEndpoint, points: list[HistoryPoint]
) -> TrainerMetrics | None:
    """The run's figures now: its code's latest report (appended to ``points`` when new), else
    the built-in trainer's metrics endpoint (an older trainer that does not report)."""
    received = endpoint.latest()
    if received is not None:
        point = runreports.history_point(received)
        if point is not None and (not points or points[-1].time != point.time):
            points.append(point)
        return runreports.as_metrics(received.report)
    if run.custom:
        return None
    metrics = scrape(run.metrics_port)
    return metrics if metrics is not None and metrics.total_steps else None  # 0 until published


def status_document(status: GpuTrainingStatus) -> dict[str, Any]:
    """The status as the operator would write it into the object."""
    document: dict[str, Any] = encode(status)
    return document


def history(run: LocalRun) -> list[HistoryPoint]:
    """The run's metric history (every attempt), as the trainer wrote it."""
    path = run.output_dir / HISTORY_FILE
    return read_history(path.read_text(errors="replace")) if path.is_file() else []
