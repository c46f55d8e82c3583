"""The contract between the operator and the trainer, defined once.

The operator (``gpuop``) renders environment variables into every training pod and later
scrapes the trainer's Prometheus endpoint; the trainer (``gputrain``) reads those variables
and serves those metrics. Both sides import the names from here, so a rename is one edit
and a mismatch is impossible.

This module imports nothing outside the standard library: the operator image has no torch,
and the trainer image has no kopf or kubernetes client.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping
from typing import Final, Literal, get_args, get_type_hints

# What the trainer knows how to build. The spec model's enums are these tuples.
ModelName = Literal["cnn", "resnet18", "resnet50"]
DatasetName = Literal["mnist", "cifar10", "imagefolder", "digits", "synthetic"]
Precision = Literal["fp32", "bf16", "fp16"]
CommBackend = Literal["nccl", "gloo"]  # torch.distributed's communication backend
# How the built-in trainer ran its model and why (gputrain.compiling decides): compiled, its
# compile cache found for this training's key or not; or eager, because the spec said
# compile: false, the device is a CPU, torch.compile's GPU backend has no C compiler in the
# image, or the steps left cannot win back a compile.
CompileMode = Literal[
    "CompiledCacheHit", "CompiledCacheMiss", "EagerForced", "EagerOnCpu", "EagerNoCompiler", "EagerTooShort"
]

MODEL_NAMES: Final[tuple[str, ...]] = get_args(ModelName)
DATASET_NAMES: Final[tuple[str, ...]] = get_args(DatasetName)
PRECISIONS: Final[tuple[str, ...]] = get_args(Precision)
COMM_BACKENDS: Final[tuple[str, ...]] = get_args(CommBackend)
COMPILE_MODES: Final[tuple[str, ...]] = get_args(CompileMode)
# What the built-in trainer's reports call the mode (a gpureport metric, a label on its endpoint).
COMPILE_METRIC: Final = "compile"


def compile_mode(value: object) -> CompileMode | None:
    """``value`` as a compile mode; None for anything else (the value comes from a container)."""
    return value if isinstance(value, str) and value in COMPILE_MODES else None  # type: ignore[return-value]


# Ports on the `pytorch` container. The rendezvous port carries Kubeflow's default port name,
# which the training-operator looks up to build MASTER_PORT and the elastic rendezvous endpoint.
METRICS_PORT: Final = 9090
METRICS_PORT_NAME: Final = "metrics"
RENDEZVOUS_PORT: Final = 23456
RENDEZVOUS_PORT_NAME: Final = "pytorchjob-port"

# The kubelet copies this file into the container's termination message, which the operator
# reads from pod status with no network path to the pod at all.
TERMINATION_LOG: Final = "/dev/termination-log"

# Exit codes. Kubeflow's `ExitCode` restart policy treats 1-127 as permanent and 128-255 as
# retryable, so a preempted trainer exits like a SIGTERM'd process and is restarted.
EXIT_OK: Final = 0
EXIT_BAD_CONFIG: Final = 2
EXIT_DATA_MISSING: Final = 3
EXIT_STORAGE: Final = 4  # the checkpoint store refused (credentials, a missing bucket) at the start
EXIT_OUTPUT_STORAGE: Final = 5  # trained, but the outputs could not be uploaded to GPUTRAIN_OUTPUT_URI
EXIT_FETCH: Final = 6  # the dataset step (gputrain.fetch) could not copy spec.dataset.uri
EXIT_PREEMPTED: Final = 143  # SIGTERM: an eviction, a preemption, `kubectl delete`
EXIT_INTERRUPTED: Final = 130  # SIGINT: Ctrl-C in a terminal

ENV_PREFIX: Final = "GPUTRAIN_"

# The final result: rank 0 writes it as JSON to <output dir>/RESULT_FILE, beside the model's
# state_dict in MODEL_FILE, and every pod's local rank 0 to its termination message (a
# :class:`Result`). A trainer that stops on a known failure writes a Failed one with reason and
# message there instead: torchrun's own exit code does not carry the worker's.
RESULT_FILE: Final = "result.json"
MODEL_FILE: Final = "model.pt"
# The run's metric history, beside them: a :class:`HistoryPoint` per line (JSON Lines), appended
# by rank 0 at each logging interval and evaluation, over every attempt.
HISTORY_FILE: Final = "metrics.jsonl"
# TensorBoard's event files of the same history, beside it (when tensorboard is installed).
TENSORBOARD_DIR: Final = "tensorboard"
# A checkpoint's objects in its directory or bucket (gputrain.checkpoint writes them): the state,
# ``step-<8 digits>-<token>.pt`` (no token before manifests), and its manifest, written last.
CHECKPOINT_STATE: Final = re.compile(r"^step-(\d{8,})(-[0-9a-f]{8})?\.pt$")  # group 2: the token
CHECKPOINT_MANIFEST: Final = re.compile(r"^step-(\d{8,})\.json$")


def complete_checkpoint_step(name: str) -> int | None:
    """The step of a complete checkpoint that an object named ``name`` stands for, as a listing
    shows it: a manifest, or a state from before manifests (complete alone); None otherwise."""
    match = CHECKPOINT_MANIFEST.match(name) or CHECKPOINT_STATE.match(name)
    if match is None or (match.re is CHECKPOINT_STATE and match.group(2) is not None):
        return None
    return int(match.group(1))


@dataclasses.dataclass(frozen=True)
class Progress:
    """What a training trainer publishes on its metrics endpoint (the names in :class:`Metric`),
    and what readers get back from it; a figure not published yet is None, never 0."""

    epoch: int | None = None  # from 1
    total_epochs: int | None = None
    step: int | None = None  # optimizer steps done, over every attempt
    total_steps: int | None = None  # steps done + steps to go at the current world size
    percent: float | None = None  # of the run's data: unlike steps, the same at any world size
    loss: float | None = None  # training loss over the last logging interval
    accuracy: float | None = None  # on the evaluation split after the last epoch, 0..1
    samples_per_second: float | None = None  # whole job
    estimated_remaining_seconds: float | None = None
    compile: CompileMode | None = None  # once the trainer knows how it runs its model


@dataclasses.dataclass(frozen=True)
class Result:
    """The trainer's final record, as JSON in its termination message and result file; keys in
    camelCase, as in the GpuTraining status."""

    phase: Literal["Succeeded", "Failed"]
    epoch: int | None = None
    total_epochs: int | None = None
    step: int | None = None
    total_steps: int | None = None
    loss: float | None = None  # training loss over the last logging interval
    accuracy: float | None = None  # on the evaluation split, 0..1
    test_loss: float | None = None
    samples_per_second: float | None = None  # whole job, over the time spent in steps, every attempt
    duration_seconds: float | None = None
    world_size: int | None = None
    reason: str | None = None  # Failed only: InvalidSettings, DatasetMissing or Preempted
    message: str | None = None
    # Failed only: True when a restart would fail the same way, until a person changes something
    # (bad settings, no data, a store that refuses the credentials or has no such bucket). The
    # operator then stops the job rather than let its pods restart into it on their GPUs.
    permanent: bool | None = None
    compile: CompileMode | None = None  # how the model ran (Succeeded only)

    def to_json(self) -> str:
        return json.dumps({_camel(f.name): getattr(self, f.name) for f in dataclasses.fields(self)},
                          sort_keys=True)  # fmt: skip

    @classmethod
    def from_json(cls, text: str) -> Result | None:
        """The record in ``text``; None when it is none (a crashed trainer's last log lines, under
        FallbackToLogsOnError, are not an error here, just not a record). The text is the
        container's to write, a custom image's too: a value of the wrong type is dropped here,
        at the edge, rather than break a reader later."""
        try:
            data = json.loads(text)
        except ValueError:
            return None
        if not isinstance(data, dict) or data.get("phase") not in ("Succeeded", "Failed"):
            return None
        values: dict[str, object] = {}
        for field in dataclasses.fields(cls)[1:]:
            value = data.get(_camel(field.name))
            if field.name in ("reason", "message"):
                values[field.name] = value[:1024] if isinstance(value, str) else None
            elif field.name == "permanent":
                values[field.name] = value if isinstance(value, bool) else None
            elif field.name == "compile":
                values[field.name] = compile_mode(value)
            elif isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
                values[field.name] = int(value) if field.name in _INTEGERS else value
        return cls(phase=data["phase"], **values)  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True)
class HistoryPoint:
    """One line of a run's metric history (:data:`HISTORY_FILE`): the figures at a logging
    interval, or the accuracy after an evaluation. Keys in camelCase, as in :class:`Result`."""

    time: float  # Unix seconds
    step: int
    epoch: int  # from 1
    percent: float | None = None
    loss: float | None = None
    accuracy: float | None = None
    learning_rate: float | None = None
    samples_per_second: float | None = None
    gpu_utilization_percent: float | None = None  # mean over rank 0's pod's GPUs (NVML)

    def to_json(self) -> str:
        values = {_camel(f.name): getattr(self, f.name) for f in dataclasses.fields(self)}
        return json.dumps({k: v for k, v in values.items() if v is not None}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> HistoryPoint | None:
        """The point on a line; None for a line that is not one (a file cut short by a kill)."""
        try:
            data = json.loads(text)
        except ValueError:
            return None
        if not isinstance(data, dict):
            return None
        values: dict[str, float | int] = {}
        for field in dataclasses.fields(cls):
            value = data.get(_camel(field.name))
            if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
                values[field.name] = int(value) if field.name in ("step", "epoch") else value
        if not {"time", "step", "epoch"} <= values.keys():
            return None
        return cls(**values)  # type: ignore[arg-type]


def read_history(text: str) -> list[HistoryPoint]:
    """Every point of a history file's text, in order; lines that are not points are skipped."""
    return [p for p in map(HistoryPoint.from_json, text.splitlines()) if p is not None]


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


_INTEGERS: Final = frozenset({"epoch", "total_epochs", "step", "total_steps", "world_size"})
RESULT_KEYS: Final = tuple(_camel(f.name) for f in dataclasses.fields(Result))

FAILURE_REASONS: Final = {
    EXIT_BAD_CONFIG: "InvalidSettings",
    EXIT_DATA_MISSING: "DatasetMissing",
    EXIT_STORAGE: "CheckpointStorageFailed",
    EXIT_OUTPUT_STORAGE: "OutputStorageFailed",
    EXIT_FETCH: "DatasetFetchFailed",
    EXIT_PREEMPTED: "Preempted",
    EXIT_INTERRUPTED: "Interrupted",
}
# The reasons of a trainer a signal stopped after its checkpoint: paused, not failed.
STOPPED_BY_SIGNAL: Final = (FAILURE_REASONS[EXIT_INTERRUPTED], FAILURE_REASONS[EXIT_PREEMPTED])


class Metric:
    """Prometheus metric names the trainer exposes and the operator scrapes, in Prometheus'
    conventions: base units, 0..1 ``_ratio`` for shares, ``_total`` counters for what only
    grows (so ``rate()`` works), an ``_info`` series for text."""

    EPOCH: Final = "gputrain_epoch"
    TOTAL_EPOCHS: Final = "gputrain_total_epochs"
    # The run's position (gauges: a resume sets them back to the checkpoint's).
    STEP: Final = "gputrain_step"
    TOTAL_STEPS: Final = "gputrain_total_steps"
    PROGRESS_RATIO: Final = "gputrain_progress_ratio"
    LOSS: Final = "gputrain_loss"
    ACCURACY: Final = "gputrain_accuracy"
    SAMPLES_PER_SECOND: Final = "gputrain_samples_per_second"
    ESTIMATED_REMAINING_SECONDS: Final = "gputrain_estimated_remaining_seconds"
    # What this process has done for the job (counters; they start at 0 with the process).
    STEPS: Final = "gputrain_steps"  # exposed as gputrain_steps_total
    SAMPLES: Final = "gputrain_samples"  # exposed as gputrain_samples_total
    # Per visible GPU, labelled with GPU_LABEL (and the info series with GPU_NAME_LABEL).
    GPU_UTILIZATION_RATIO: Final = "gputrain_gpu_utilization_ratio"
    GPU_MEMORY_USED_BYTES: Final = "gputrain_gpu_memory_used_bytes"
    GPU_MEMORY_TOTAL_BYTES: Final = "gputrain_gpu_memory_total_bytes"
    GPU_INFO: Final = "gputrain_gpu"  # exposed as gputrain_gpu_info{gpu, name} 1
    # How the model runs, once decided: gputrain_compile_info{mode="CompiledCacheHit"} 1.
    COMPILE_INFO: Final = "gputrain_compile"
    COMPILE_MODE_LABEL: Final = "mode"
    GPU_LABEL: Final = "gpu"
    GPU_NAME_LABEL: Final = "name"


class ContractError(ValueError):
    """A trainer setting in the environment is missing or malformed."""


@dataclasses.dataclass(frozen=True)
class TrainerSettings:
    """Everything the operator tells the trainer, as typed values.

    Each field travels as the environment variable ``GPUTRAIN_<FIELD IN UPPER CASE>``. There
    are deliberately no defaults here: the spec model is the one home of defaults, and a
    setting the operator forgot to render must fail loudly in the trainer, not silently
    fall back to a value nobody chose.
    """

    job_name: str
    model: ModelName
    dataset: DatasetName
    data_dir: str
    epochs: int
    batch_size: int
    learning_rate: float
    precision: Precision
    grad_accum_steps: int
    seed: int
    max_grad_norm: float
    channels_last: bool
    # None: auto (gputrain.compiling's rule); travels as "auto", true or false.
    compile: bool | None
    loader_workers: int
    log_every_steps: int
    checkpoint_dir: str
    checkpoint_every_steps: int
    checkpoint_keep: int
    output_dir: str
    output_uri: str  # where the outputs are uploaded at the end ("": nowhere but output_dir)
    backend: CommBackend
    metrics_port: int

    def __post_init__(self) -> None:
        problems = [
            f"{env_name(name)}: must be >= {low} (got {getattr(self, name)})"
            for name, low in _MINIMUMS.items()
            if getattr(self, name) < low
        ]
        if self.learning_rate <= 0:
            problems.append(f"{env_name('learning_rate')}: must be > 0 (got {self.learning_rate})")
        if self.precision == "fp16" and self.backend != "nccl":
            problems.append(
                f"{env_name('precision')}: fp16 needs GPUs (backend nccl); use bf16 or fp32 on CPU"
            )
        if problems:
            raise ContractError("\n".join(problems))

    def to_env(self) -> dict[str, str]:
        """The settings as environment variables, in field order."""
        return {env_name(f.name): _encode(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> TrainerSettings:
        """Read and check the settings; every problem is reported, one per line."""
        hints = get_type_hints(cls)
        values: dict[str, object] = {}
        problems: list[str] = []
        for f in dataclasses.fields(cls):
            name = env_name(f.name)
            raw = environ.get(name)
            if raw is None:
                problems.append(f"{name}: required but not set")
                continue
            try:
                values[f.name] = _decode(raw, hints[f.name])
            except ValueError as exc:
                problems.append(f"{name}: {exc} (got {raw!r})")
        if problems:
            raise ContractError("\n".join(problems))
        return cls(**values)  # type: ignore[arg-type]

    def replace(self, **changes: object) -> TrainerSettings:
        """A copy with some settings changed (and checked again)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


_MINIMUMS: Final = {
    "epochs": 1,
    "batch_size": 1,
    "grad_accum_steps": 1,
    "seed": 0,
    "max_grad_norm": 0,
    "loader_workers": 0,
    "log_every_steps": 1,
    "checkpoint_every_steps": 1,
    "checkpoint_keep": 1,
    "metrics_port": 0,
}


def env_name(field_name: str) -> str:
    """The environment variable that carries one TrainerSettings field."""
    return ENV_PREFIX + field_name.upper()


def _encode(value: object) -> str:
    if value is None:  # the one optional setting, compile: absent in the spec means auto
        return "auto"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _decode(raw: str, hint: object) -> object:
    if hint == bool | None:
        if raw not in ("auto", "true", "false"):
            raise ValueError("must be auto, true or false")
        return None if raw == "auto" else raw == "true"
    choices = get_args(hint)
    if choices:  # a Literal
        if raw not in choices:
            raise ValueError("must be one of " + ", ".join(choices))
        return raw
    if hint is bool:
        if raw not in ("true", "false"):
            raise ValueError("must be true or false")
        return raw == "true"
    if hint is int:
        try:
            return int(raw)
        except ValueError:
            raise ValueError("must be an integer") from None
    if hint is float:
        try:
            return float(raw)
        except ValueError:
            raise ValueError("must be a number") from None
    return raw
