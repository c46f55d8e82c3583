"""The GpuTraining status: its shape, documented for ``kubectl explain``.

The operator fills it (phase, conditions, progress scraped from the trainers, GPU
utilization); the CRD's status schema is generated from these classes like the spec's.
Field names follow what Kubeflow users know from Trainer v2's ``trainerStatus``
(``progressPercentage``, ``estimatedRemainingSeconds``) where the idea is the same.
"""

from __future__ import annotations

from typing import Final, Literal, get_args

from gpuop.schema import api_field, api_object

Phase = Literal["Pending", "Created", "Running", "Restarting", "Suspended", "Succeeded", "Failed"]
PHASES: Final[tuple[str, ...]] = get_args(Phase)


@api_object
class Condition:
    """A condition in the Kubernetes convention."""

    type: str = api_field(
        "Condition type: Created, Running, Succeeded, Failed, Suspended, Restarting, InvalidSpec, "
        "Stalled or Underutilized.",
        max_length=64,
    )
    status: Literal["True", "False", "Unknown"] = api_field("Whether the condition holds.")
    reason: str | None = api_field("A CamelCase word for the last transition.", max_length=128)
    message: str | None = api_field("What happened, for people.", max_length=32768)
    last_transition_time: str | None = api_field("When status last changed.", date_time=True, max_length=64)
    observed_generation: int | None = api_field(
        "The metadata.generation this condition was set for.", minimum=0
    )


@api_object
class WorkerCounts:
    """Worker pods."""

    ready: int = api_field("Worker pods running and ready.", default=0, minimum=0)
    total: int = api_field("Worker pods the job asks for.", default=0, minimum=0)


@api_object
class Progress:
    """Training progress, scraped from the trainers' metrics while running and read from
    their termination messages when they finish."""

    percent: float | None = api_field("Progress in percent of all optimizer steps.", minimum=0, maximum=100)
    epoch: int | None = api_field("Current epoch, from 1.", minimum=0)
    total_epochs: int | None = api_field("Epochs in the run.", minimum=0)
    step: int | None = api_field("Optimizer steps done.", minimum=0)
    total_steps: int | None = api_field("Optimizer steps in the run.", minimum=0)
    loss: float | None = api_field("Training loss, mean over the last logging interval.")
    accuracy: float | None = api_field("Accuracy on the evaluation split, 0..1.", minimum=0, maximum=1)
    samples_per_second: float | None = api_field("Training throughput of the whole job.", minimum=0)
    estimated_remaining_seconds: int | None = api_field("Estimated seconds to completion.", minimum=0)
    eta: str | None = api_field("estimatedRemainingSeconds for people, e.g. 1h12m.", max_length=32)
    updated_at: str | None = api_field("When these figures were read.", date_time=True, max_length=64)


@api_object
class WorkerGpu:
    """GPU figures of one worker pod."""

    pod: str = api_field("Worker pod name.", max_length=253)
    utilization_percent: float | None = api_field(
        "Mean utilization of the pod's GPUs, percent.", minimum=0, maximum=100
    )
    memory_used_bytes: int | None = api_field("GPU memory in use, summed over its GPUs.", minimum=0)
    memory_total_bytes: int | None = api_field("GPU memory in all, summed over its GPUs.", minimum=0)


@api_object
class GpuUsage:
    """GPU usage of the job, read from NVML inside the trainers."""

    count: int | None = api_field("GPUs the job holds (workers x gpusPerWorker).", minimum=0)
    utilization_percent: float | None = api_field(
        "Mean GPU utilization over all workers, percent.", minimum=0, maximum=100
    )
    memory_used_bytes: int | None = api_field("GPU memory in use over all workers.", minimum=0)
    memory_total_bytes: int | None = api_field("GPU memory in all over all workers.", minimum=0)
    per_worker: tuple[WorkerGpu, ...] = api_field(
        "Per worker pod.", default=(), max_items=1024, list_map_key="pod"
    )


@api_object
class GpuTrainingStatus:
    """What the operator observed."""

    phase: Phase | None = api_field(
        "Pending, Created (PyTorchJob made), Running, Restarting, Suspended, Succeeded or Failed."
    )
    conditions: tuple[Condition, ...] = api_field(
        "Conditions, one per type.", default=(), max_items=32, list_map_key="type"
    )
    observed_generation: int | None = api_field("The metadata.generation the status describes.", minimum=0)
    pytorch_job: str | None = api_field("Name of the PyTorchJob that runs the training.", max_length=253)
    workers: WorkerCounts | None = api_field("Worker pods ready and asked for.")
    progress: Progress | None = api_field("Training progress.")
    gpu: GpuUsage | None = api_field("GPU utilization and memory.")
    start_time: str | None = api_field("When the job started running.", date_time=True, max_length=64)
    completion_time: str | None = api_field("When the job finished.", date_time=True, max_length=64)
    gpu_hours: float | None = api_field("GPU-hours consumed: GPUs held x hours running.", minimum=0)
    message: str | None = api_field("The latest notable event, for people.", max_length=32768)
