"""A training code's progress report (Kubeflow Trainer's ``trainerStatus`` protocol), read into
typed figures. Pure: no I/O.

Any training code can send one: Hugging Face Transformers' ``KubeflowCallback`` (on by itself
whenever ``KUBEFLOW_TRAINER_SERVER_URL`` is set), the Kubeflow SDK's
``update_trainjob_status()``, our own ``gpureport`` (the built-in trainer uses it too) or a
hand-written POST. The body is untrusted input from any container: everything here is bounded
(the body's size, the metric count, names and values as Kubeflow's API bounds them) and a body
that breaks a bound is refused whole, with the HTTP status and one line saying why, never
half-read. Figures are read from the metrics by the names the clients that exist send
(``current_step``, ``total_steps``, ``current_epoch``, ``loss``, ...), so every client is read
alike and none needs code of ours.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

import gpureport

from gpuop.api.status import TIME_FORMAT, Activity
from gputrain.contract import COMPILE_METRIC, CompileMode, compile_mode

# A report with 256 metrics of 64-character values is about 30 KiB of JSON; 64 KiB leaves room
# for long names and whitespace and still bounds what one request costs the operator to read.
MAX_REPORT_BYTES: Final = 64 * 1024
# Kubeflow's API bounds (TrainJob status.trainerStatus): at most 256 metrics, values as strings
# of at most 64 characters. A name has no bound there; 128 covers "eval/accuracy_top5"-style keys.
MAX_METRICS: Final = 256
MAX_VALUE_CHARS: Final = 64
MAX_NAME_CHARS: Final = 128
# What status keeps of the metrics no field holds (learning_rate, grad_norm, eval_loss, ...):
# enough to show, bounded so that a chatty client cannot grow the object.
MAX_SHOWN_METRICS: Final = 16

# Metric names the known clients send, per figure, first found wins. HF's KubeflowCallback
# sends every numeric key of its last log plus current_step/total_steps/current_epoch; its
# final report (on_train_end) carries only the last log (train_loss, train_runtime, ...).
_STEP: Final = ("current_step", "step", "global_step")
_TOTAL_STEPS: Final = ("total_steps", "max_steps")
_EPOCH: Final = ("current_epoch", "epoch")
_TOTAL_EPOCHS: Final = ("total_epochs", "num_train_epochs", "max_epochs")
_LOSS: Final = ("loss", "train_loss", "train/loss")
_ACCURACY: Final = ("accuracy", "eval_accuracy", "eval/accuracy", "val_accuracy", "val_acc")
_SAMPLES_PER_SECOND: Final = ("samples_per_second", "train_samples_per_second")
# What the code says it is doing besides optimizer steps (gpureport's ``pause()``, our Lightning
# callback): the stall clock does not run through these. Another value, or none, is training.
ACTIVITY_METRIC: Final = "activity"
PAUSES: Final = frozenset(typing.get_args(Activity))
# The last complete checkpoint, as gpureport's checkpointed() says it (the names are its): the
# step, when (RFC 3339) and where, the URI in pieces of 64 characters (a value's bound).
_CHECKPOINT_STEP: Final = gpureport.CHECKPOINT_STEP
_CHECKPOINT_TIME: Final = gpureport.CHECKPOINT_TIME
_CHECKPOINT_URI_PIECES: Final = tuple(gpureport.uri_piece_names())
_READ: Final = frozenset(
    _STEP + _TOTAL_STEPS + _EPOCH + _TOTAL_EPOCHS + _LOSS + _ACCURACY + _SAMPLES_PER_SECOND
    + (ACTIVITY_METRIC, COMPILE_METRIC, _CHECKPOINT_STEP, _CHECKPOINT_TIME) + _CHECKPOINT_URI_PIECES
)  # fmt: skip


class ReportError(ValueError):
    """A body refused whole: ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class CheckpointReport:
    """A checkpoint the training code says is complete."""

    step: int
    time: str | None  # in the status's TIME_FORMAT (UTC, to the second); None when not sent or unreadable
    uri: str | None


@dataclass(frozen=True)
class TrainerReport:
    """One report's figures; a figure the report does not carry is None, never 0."""

    percent: float | None = None  # 0..100, as the client computed it
    estimated_remaining_seconds: float | None = None
    step: int | None = None
    total_steps: int | None = None
    epoch: int | None = None  # from 1: HF's fractional current_epoch 0.4 is epoch 1
    total_epochs: int | None = None
    loss: float | None = None
    accuracy: float | None = None  # 0..1
    samples_per_second: float | None = None
    activity: Activity | None = None  # while the code says so; None: training
    checkpoint: CheckpointReport | None = None  # the last complete one, when the code says it
    compile: CompileMode | None = None  # the built-in trainer's compile mode, once decided
    # The other metrics, in the client's order, at most MAX_SHOWN_METRICS: (name, value as sent).
    other: tuple[tuple[str, str], ...] = ()
    sent_at: str | None = None  # the client's lastUpdatedTime, as sent (for people only)

    @property
    def finished(self) -> bool:
        """The client's final report: HF and ours send 100 only at the end of training."""
        return self.percent is not None and self.percent >= 100

    def over(self, earlier: TrainerReport) -> TrainerReport:
        """This report with what it leaves out taken from the pod's earlier one: clients send
        what they have (HF's final report carries no step, the SDK's may carry only percent),
        and status shows the latest known value of each figure."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name, value in values.items():
            # A pause lasts while each report says it: a report that does not is training again.
            if value is None and name != "activity":
                values[name] = getattr(earlier, name)
        values["other"] = tuple({**dict(earlier.other), **dict(self.other)}.items())[-MAX_SHOWN_METRICS:]
        return TrainerReport(**values)


def parse_report(body: bytes) -> TrainerReport:
    """The figures of one POSTed body; ReportError (413 or 400) when it breaks a bound or is
    not a ``trainerStatus`` report."""
    if len(body) > MAX_REPORT_BYTES:
        raise ReportError(413, f"body over {MAX_REPORT_BYTES} bytes")
    try:
        # parse_constant refuses NaN and Infinity; a number too large for a float (1e400) comes
        # back as inf and is refused below with the other values out of range.
        document = json.loads(body, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as exc:
        raise ReportError(400, f"not JSON: {str(exc)[:120]}") from None
    status = document.get("trainerStatus") if isinstance(document, Mapping) else None
    if not isinstance(status, Mapping):
        raise ReportError(400, 'no "trainerStatus" object')
    metrics = _metrics(status.get("metrics"))
    numbers = {name: number for name, value in metrics if (number := _number(value)) is not None}

    def first(names: Sequence[str]) -> float | None:
        return next((numbers[n] for n in names if n in numbers), None)

    percent = _bounded(status.get("progressPercentage"), "progressPercentage", 0, 100)
    eta = _bounded(status.get("estimatedRemainingSeconds"), "estimatedRemainingSeconds", 0, 10**9)
    epoch = first(_EPOCH)
    sent_at = status.get("lastUpdatedTime")
    return TrainerReport(
        percent=percent,
        estimated_remaining_seconds=eta,
        step=_count(first(_STEP)),
        total_steps=_count(first(_TOTAL_STEPS)),
        # HF's current_epoch counts epochs done (1.5: halfway through the second); from 1 here,
        # bounded as the counts are (the status holds int64: 1e300 epochs would fail its patch).
        epoch=None if epoch is None or epoch < 0 or epoch > 2**53 else max(1, math.ceil(epoch)),
        total_epochs=_count(first(_TOTAL_EPOCHS)),
        loss=first(_LOSS),
        accuracy=_ratio(first(_ACCURACY)),
        samples_per_second=_nonnegative(first(_SAMPLES_PER_SECOND)),
        activity=_activity(metrics),
        checkpoint=_checkpoint(dict(metrics), numbers),
        compile=compile_mode(dict(metrics).get(COMPILE_METRIC)),
        other=tuple((n, v) for n, v in metrics if n not in _READ)[:MAX_SHOWN_METRICS],
        sent_at=sent_at[:64] if isinstance(sent_at, str) else None,
    )


def _activity(metrics: list[tuple[str, str]]) -> Activity | None:
    said = next((value for name, value in metrics if name == ACTIVITY_METRIC), None)
    return typing.cast(Activity, said) if said in PAUSES else None


def _checkpoint(metrics: Mapping[str, str], numbers: Mapping[str, float]) -> CheckpointReport | None:
    """The checkpoint a report names; None without a step. A time that is not RFC 3339 is
    dropped (the status's schema would refuse the whole write), the URI's pieces joined."""
    step = numbers.get(_CHECKPOINT_STEP)
    if step is None or not step.is_integer() or _count(step) is None:
        return None
    pieces = []
    for name in _CHECKPOINT_URI_PIECES:
        if name not in metrics:
            break
        pieces.append(metrics[name])
    return CheckpointReport(step=int(step), time=_utc_time(metrics.get(_CHECKPOINT_TIME)),
                            uri="".join(pieces) or None)  # fmt: skip


def _utc_time(text: str | None) -> str | None:
    """An RFC 3339 time as the status writes one; None for anything else (a time with no
    zone is taken as UTC)."""
    if not text or not _RFC3339.fullmatch(text):
        return None
    try:
        moment = datetime.fromisoformat(text.replace("z", "Z"))
    except ValueError:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC).strftime(TIME_FORMAT) if 1970 <= moment.year <= 9998 else None


_RFC3339: Final = re.compile(r"\d{4}-\d\d-\d\d[Tt ]\d\d:\d\d:\d\d(\.\d{1,9})?([Zz]|[+-]\d\d:\d\d)?")


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _metrics(raw: Any) -> list[tuple[str, str]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ReportError(400, "metrics: a list of {name, value} is expected")
    if len(raw) > MAX_METRICS:
        raise ReportError(400, f"metrics: {len(raw)} given, at most {MAX_METRICS}")
    out = []
    for item in raw:
        if not isinstance(item, Mapping):
            raise ReportError(400, "metrics: each item is a {name, value} object")
        name, value = item.get("name"), item.get("value")
        if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS:
            raise ReportError(400, f"metrics: a name is a string of 1..{MAX_NAME_CHARS} characters")
        # Kubeflow's API has values as strings; numbers sent bare are read as their text.
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            raise ReportError(400, f"metrics: {name[:40]}: the value is a string")
        text = value if isinstance(value, str) else repr(value)
        if len(text) > MAX_VALUE_CHARS:
            raise ReportError(400, f"metrics: {name[:40]}: values have at most {MAX_VALUE_CHARS} chars")
        out.append((name, text))
    return out


def _number(text: str) -> float | None:
    """A metric's value as a finite number; None for text ("nan", "inf", "abc") or 1e400."""
    try:
        number = float(text)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def _bounded(value: Any, field: str, low: float, high: float) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ReportError(400, f"{field}: a number is expected")
    if not low <= value <= high:
        raise ReportError(400, f"{field}: {value!r} is outside {low:g}..{high:g}")
    return float(value)


def _count(value: float | None) -> int | None:
    return None if value is None or value < 0 or value > 2**53 else int(value)


def _ratio(value: float | None) -> float | None:
    """An accuracy as 0..1; a client that sends percent (87.5) is read as 0.875."""
    if value is None or value < 0:
        return None
    if value > 1:
        return value / 100 if value <= 100 else None
    return value


def _nonnegative(value: float | None) -> float | None:
    return value if value is not None and value >= 0 else None
