"""Why a training's pods are not training, from what they say: a trainer restarted in place, out
of memory, unable to start, or down after a failure no restart mends. Pure.

Each finding is a reason and a message with the fix, for :mod:`gpuop.observing.derive` to put
into a condition; :func:`stop_for` is also what the reconciler acts on (it stops the job).
"""

from __future__ import annotations

from gpuop.api.identity import FETCH_CONTAINER
from gpuop.api.status import TERMINAL_PHASES, GpuTrainingStatus, ProgressStatus
from gpuop.observing.records import Observation, PodObservation
from gputrain.contract import STOPPED_BY_SIGNAL


def restart_note(obs: Observation, progress: ProgressStatus | None) -> tuple[str, str] | None:
    """Why a running job is Restarting, if it is (reason, message): a pod's trainer container was
    restarted in place and the training has not advanced since. Kubeflow says nothing then: with
    restartPolicy OnFailure kubelet restarts the container and the job stays Running (seen on the
    real training-operator), while every rank waits for the restarted one to load its checkpoint."""
    advanced = progress.step_advanced_at if progress is not None else None
    for pod in sorted(obs.pods, key=lambda p: p.name):
        if pod.phase != "Running" or pod.restarts == 0:
            continue
        down = pod.trainer_started_at is None  # exited, waiting to be started again
        if down or advanced is None or advanced < str(pod.trainer_started_at):
            restarted = f"pod {pod.name}'s trainer restarted ({pod.restarts} so far)"
            if pod.oom_killed:
                return "OOMKilled", f"{restarted} after it {_out_of_memory(pod)}"
            record = pod.result  # the last attempt's own word, when it left one (gputrain.contract)
            if (
                record is not None
                and record.phase == "Failed"
                and record.reason not in (None, *STOPPED_BY_SIGNAL)
            ):
                return record.reason, f"{restarted} after it failed: {record.message or record.reason}"
            return "TrainerRestarted", f"{restarted}; waiting for training to resume"
    return None


def _out_of_memory(pod: PodObservation) -> str:
    """What an OOM kill means, and the fix, after "pod X's trainer". The kernel kills a
    container the moment its cgroup passes the limit, so the trainer writes no record and its
    log ends mid-step: without this, a user sees a bare exit code 137 (or a job's backoff limit)."""
    where = "the node's memory (no limit set)"
    if pod.memory_limit:
        where = f"its memory limit of {pod.memory_limit}"
    return (
        f"ran out of memory: the kernel killed it at {where} (OOMKilled). Raise spec.resources.memory, "
        "or lower the batch size or the DataLoader workers; /dev/shm (spec.shmSize) counts toward "
        "the same limit"
    )


def cannot_start(obs: Observation) -> tuple[str, str] | None:
    """Why a pod's trainer cannot start (reason, message), the first such pod by name: the
    kubelet retries on its own, and says why only in the pod, where a training's owner does not
    look. Each reason with what to change."""
    pod = next((p for p in sorted(obs.pods, key=lambda p: p.name) if p.cannot_start), None)
    if pod is None or pod.cannot_start is None:
        return None
    reason, said = pod.cannot_start
    fix = "check spec.image and spec.imagePullSecrets"
    if reason == "DatasetFetchFailed":
        return reason, (f"pod {pod.name}'s dataset step cannot copy spec.dataset.uri: {said}; the kubelet "
                        f"retries it (kubectl logs {pod.name} -c {FETCH_CONTAINER})")  # fmt: skip
    if reason in ("CreateContainerConfigError", "CreateContainerError"):
        fix = ("create what it names in the GpuTraining's namespace, or correct the name "
               "(spec.checkpoint.secretName, spec.env)")  # fmt: skip
    return reason, f"pod {pod.name}'s trainer cannot start: {said or reason}; {fix}"


def stop_for(obs: Observation) -> tuple[str, str, str] | None:
    """Why the training must stop for good, if it must (pod, reason, line): a pod's trainer, or
    its dataset step, is down after a failure its own record says no restart mends (wrong
    credentials, a missing bucket, bad settings; Result.permanent). Left to Kubeflow, its pods
    would restart into it, on their GPUs, until the backoff limit (or forever, with none); a
    Kubernetes Job's podFailurePolicy FailJob does the same for an exit code. The first such pod
    by name. The reconciler stops the job (:func:`stopped` then holds) before the status says so."""
    if obs.job_stopped is not None:
        return obs.job_stopped  # stopped already (its annotation), whatever its pods say now
    finished = any(c.type in TERMINAL_PHASES and c.status == "True" for c in obs.job_conditions)
    if obs.job_name is None or finished:
        return None
    # Only this job's pods: one of an older job of the name (deleted and applied again, its pods
    # still going) is older than the job.
    ours = (
        p for p in obs.pods if not (p.created_at and obs.job_created_at and p.created_at < obs.job_created_at)
    )
    pod = next((p for p in sorted(ours, key=lambda p: p.name) if p.needs_fix), None)
    if pod is None or pod.needs_fix is None:
        return None
    return pod.name, *pod.needs_fix


def stopped(status: GpuTrainingStatus | None) -> bool:
    """Whether the operator stopped this training's job for good (:func:`stop_for`): its status
    stays as written then, and the job stays stopped."""
    return status is not None and any(
        c.type == "JobStopped" and c.status == "True" for c in status.conditions
    )


def oom_failure(obs: Observation) -> tuple[str, str] | None:
    """A failed training's OOM kill, if a pod's trainer had one (the first pod by name)."""
    pod = next((p for p in sorted(obs.pods, key=lambda p: p.name) if p.oom_killed), None)
    return ("OOMKilled", f"pod {pod.name}'s trainer {_out_of_memory(pod)}") if pod is not None else None
