"""parse_report, the reader of a progress report's body (Kubeflow Trainer's ``trainerStatus``):
the bodies the clients that exist send (Hugging Face's KubeflowCallback at each of its hooks, the
Kubeflow SDK's ``update_trainjob_status``), every bound exactly at it and one past it, what JSON
allows and Python's reader would take anyway (NaN, Infinity, 1e400), values of the wrong type,
nesting deep enough to exhaust the stack, and a property over any bytes: a report or a
ReportError with an HTTP status, never another exception, and every figure within what the
GpuTraining's status can hold.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gpuop.observing.reports import (
    MAX_METRICS,
    MAX_NAME_CHARS,
    MAX_REPORT_BYTES,
    MAX_SHOWN_METRICS,
    MAX_VALUE_CHARS,
    ReportError,
    TrainerReport,
    parse_report,
)

SENT_AT = "2026-11-21T12:00:00Z"
INT64_MAX = 2**63 - 1  # the status's integers are int64 on the API server


def body(status: Any) -> bytes:
    return json.dumps({"trainerStatus": status}).encode()


def metrics(**values: Any) -> list[dict[str, Any]]:
    return [{"name": name, "value": value} for name, value in values.items()]


def refused(raw: bytes, status: int = 400) -> str:
    with pytest.raises(ReportError) as caught:
        parse_report(raw)
    assert caught.value.status == status, str(caught.value)
    return str(caught.value)


# -- what the clients that exist send --------------------------------------------------------
# Hugging Face's KubeflowCallback (transformers 5.x): percent = global_step / max_steps (99 at
# most until the end), an ETA, every numeric key of the last log as a string plus current_step,
# total_steps and current_epoch; its final report carries the train_* summary of the last log.


def test_hf_train_begin_reports_zero_and_the_steps_to_come() -> None:
    report = parse_report(body({
        "progressPercentage": 0,
        "metrics": metrics(current_step="0", total_steps="1500", current_epoch="0"),
        "lastUpdatedTime": SENT_AT,
    }))  # fmt: skip
    assert report == TrainerReport(percent=0.0, step=0, total_steps=1500, epoch=1, sent_at=SENT_AT)
    assert not report.finished


def test_hf_step_end_reads_every_figure_and_keeps_the_rest_in_order() -> None:
    report = parse_report(body({
        "progressPercentage": 41,
        "estimatedRemainingSeconds": 873,
        "metrics": metrics(loss="0.6931", learning_rate="4.2e-05", grad_norm="1.873", epoch="1.23",
                           current_step="615", total_steps="1500", current_epoch="1.23"),
        "lastUpdatedTime": SENT_AT,
    }))  # fmt: skip
    assert report.percent == 41.0
    assert report.estimated_remaining_seconds == 873.0
    assert (report.step, report.total_steps) == (615, 1500)
    assert report.epoch == 2  # 1.23 epochs done: in the second
    assert report.loss == pytest.approx(0.6931)
    assert (report.accuracy, report.samples_per_second) == (None, None)
    # What no figure holds is kept as sent (the string, not a re-formatted float), in order.
    assert report.other == (("learning_rate", "4.2e-05"), ("grad_norm", "1.873"))
    assert not report.finished


def test_hf_train_end_is_finished_with_the_summary_read() -> None:
    report = parse_report(body({
        "progressPercentage": 100,
        "estimatedRemainingSeconds": 0,
        "metrics": metrics(train_runtime="412.7", train_samples_per_second="116.3",
                           train_steps_per_second="3.635", total_flos="1.2e15", train_loss="0.4125",
                           epoch="3.0", current_step="1500", total_steps="1500", current_epoch="3.0"),
        "lastUpdatedTime": SENT_AT,
    }))  # fmt: skip
    assert report.finished
    assert (report.percent, report.estimated_remaining_seconds) == (100.0, 0.0)
    assert report.loss == pytest.approx(0.4125)  # no "loss" in the final log: train_loss
    assert report.samples_per_second == pytest.approx(116.3)
    assert (report.step, report.total_steps, report.epoch) == (1500, 1500, 3)
    assert dict(report.other) == {
        "train_runtime": "412.7", "train_steps_per_second": "3.635", "total_flos": "1.2e15"
    }  # fmt: skip


def test_the_kubeflow_sdk_shape_with_bare_numbers_and_eval_metrics() -> None:
    # update_trainjob_status(progress_percent=62.5, estimated_remaining_seconds=120,
    # metrics={...}): a float percent, and metrics as a user passes them (numbers, not strings).
    report = parse_report(body({
        "progressPercentage": 62.5,
        "estimatedRemainingSeconds": 120,
        "metrics": metrics(step=250, max_steps=400, num_train_epochs=4, eval_accuracy=87.5,
                           loss=0.25, note="warmup over"),
    }))  # fmt: skip
    assert report.percent == 62.5
    assert (report.step, report.total_steps, report.total_epochs) == (250, 400, 4)
    assert report.accuracy == pytest.approx(0.875)  # sent in percent, read as a ratio
    assert report.loss == 0.25
    assert report.other == (("note", "warmup over"),)
    assert report.sent_at is None


def test_a_metrics_only_update_and_an_empty_status_carry_no_figures() -> None:
    assert parse_report(body({})) == TrainerReport()
    assert parse_report(body({"metrics": None, "progressPercentage": None})) == TrainerReport()
    only = parse_report(body({"metrics": metrics(current_step="7")}))
    assert only == TrainerReport(step=7)


@pytest.mark.parametrize(
    ("sent", "figure", "read"),
    [
        ({"current_epoch": "0"}, "epoch", 1),  # before the first epoch ends: epoch 1
        ({"current_epoch": "0.4"}, "epoch", 1),
        ({"current_epoch": "2"}, "epoch", 2),  # two done exactly: still shown as the second
        ({"current_epoch": "-1"}, "epoch", None),
        ({"current_step": "-3"}, "step", None),
        ({"current_step": "12.9"}, "step", 12),
        ({"current_step": str(2**53)}, "step", 2**53),
        ({"current_step": str(2**53 + 2)}, "step", None),
        ({"accuracy": "1"}, "accuracy", 1.0),
        ({"accuracy": "100"}, "accuracy", 1.0),
        ({"accuracy": "150"}, "accuracy", None),
        ({"accuracy": "-0.1"}, "accuracy", None),
        ({"samples_per_second": "-5"}, "samples_per_second", None),
        ({"loss": "nan"}, "loss", None),  # text that is no finite number is no figure
        ({"loss": "inf"}, "loss", None),
        ({"loss": "1e400"}, "loss", None),
        ({"loss": "abc"}, "loss", None),
        ({"loss": "-2.5"}, "loss", -2.5),  # a loss may be negative (an ELBO, a reward)
        ({"current_step": "x", "step": "5"}, "step", 5),  # first readable name wins
        ({"current_step": "9", "step": "5"}, "step", 9),
    ],
)
def test_figures_are_read_within_what_they_mean(sent: dict[str, str], figure: str, read: Any) -> None:
    assert getattr(parse_report(body({"metrics": metrics(**sent)})), figure) == read


def test_an_epoch_beyond_any_count_is_no_figure() -> None:
    # HF's current_epoch is a float; 1e300 epochs would be written to the status as an integer
    # the API server cannot hold (int64) and fail the whole status patch.
    report = parse_report(body({"metrics": metrics(current_epoch="1e300")}))
    assert report.epoch is None
    assert parse_report(body({"metrics": metrics(current_epoch=str(2**53))})).epoch == 2**53


def test_other_metrics_are_capped_for_the_status() -> None:
    many = [{"name": f"m{i}", "value": str(i)} for i in range(MAX_METRICS)]
    report = parse_report(body({"metrics": many}))
    assert report.other == tuple((f"m{i}", str(i)) for i in range(MAX_SHOWN_METRICS))


def test_sent_at_is_kept_as_text_and_bounded() -> None:
    assert parse_report(body({"lastUpdatedTime": "x" * 1000})).sent_at == "x" * 64
    assert parse_report(body({"lastUpdatedTime": 1_700_000_000})).sent_at is None


# -- bounds: exactly at each is taken, one past is refused ------------------------------------


def padded(size: int) -> bytes:
    """A valid report of exactly ``size`` bytes (whitespace pads it)."""
    raw = body({"progressPercentage": 50})
    return raw + b" " * (size - len(raw))


def test_the_body_size_bound() -> None:
    assert len(padded(MAX_REPORT_BYTES)) == MAX_REPORT_BYTES
    assert parse_report(padded(MAX_REPORT_BYTES)).percent == 50
    assert refused(padded(MAX_REPORT_BYTES + 1), 413) == f"body over {MAX_REPORT_BYTES} bytes"
    # The size is judged before anything is parsed: garbage over the bound is a 413 too.
    refused(b"\xff" * (MAX_REPORT_BYTES + 1), 413)


def test_the_metric_count_bound() -> None:
    def of(count: int) -> bytes:
        return body({"metrics": [{"name": f"m{i}", "value": "1"} for i in range(count)]})

    assert len(parse_report(of(MAX_METRICS)).other) == MAX_SHOWN_METRICS
    assert refused(of(MAX_METRICS + 1)) == f"metrics: {MAX_METRICS + 1} given, at most {MAX_METRICS}"


def test_the_name_bounds() -> None:
    assert parse_report(body({"metrics": metrics(**{"n" * MAX_NAME_CHARS: "1"})})).other
    assert "name" in refused(body({"metrics": metrics(**{"n" * (MAX_NAME_CHARS + 1): "1"})}))
    assert "name" in refused(body({"metrics": metrics(**{"": "1"})}))


def test_the_value_bounds() -> None:
    at = "9" * MAX_VALUE_CHARS
    assert parse_report(body({"metrics": metrics(x=at)})).other == (("x", at),)
    assert "at most 64" in refused(body({"metrics": metrics(x=at + "9")}))
    # A bare number is read as its text, and that text is bounded alike.
    assert parse_report(body({"metrics": metrics(x=10**63)})).other == (("x", "1" + "0" * 63),)
    refused(body({"metrics": metrics(x=10**64)}))


@pytest.mark.parametrize(
    ("field", "at", "past"),
    [
        ("progressPercentage", 0, -1),
        ("progressPercentage", 0, -5e-324),  # the smallest float below 0
        ("progressPercentage", 100, 101),
        ("progressPercentage", 100, math.nextafter(100, math.inf)),
        ("estimatedRemainingSeconds", 0, -1),
        ("estimatedRemainingSeconds", 10**9, 10**9 + 1),
    ],
)
def test_the_number_bounds(field: str, at: float, past: float) -> None:
    assert parse_report(body({field: at})) is not None
    assert "is outside" in refused(body({field: past}))


# -- what JSON does not allow, and what is no number ---------------------------------------


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize(
    "where",
    [
        '{"trainerStatus": {"progressPercentage": %s}}',
        '{"trainerStatus": {"estimatedRemainingSeconds": %s}}',
        '{"trainerStatus": {"metrics": [{"name": "loss", "value": %s}]}}',
        '{"trainerStatus": {}, "elsewhere": [%s]}',  # refused wherever it is, read or not
    ],
)
def test_nan_and_infinity_literals_are_refused_anywhere(literal: str, where: str) -> None:
    assert "not JSON" in refused((where % literal).encode())


@pytest.mark.parametrize("field", ["progressPercentage", "estimatedRemainingSeconds"])
def test_a_number_too_large_for_a_float_is_refused(field: str) -> None:
    # Python reads 1e400 as inf without a complaint.
    assert f"{field}: a number is expected" == refused(b'{"trainerStatus": {"%s": 1e400}}' % field.encode())


def test_a_bare_metric_value_too_large_for_a_float_is_no_figure() -> None:
    report = parse_report(b'{"trainerStatus": {"metrics": [{"name": "loss", "value": 1e400}]}}')
    assert report.loss is None


@pytest.mark.parametrize("value", [True, False])
def test_booleans_are_not_numbers(value: bool) -> None:
    assert "a number is expected" in refused(body({"progressPercentage": value}))
    assert "a number is expected" in refused(body({"estimatedRemainingSeconds": value}))
    assert "the value is a string" in refused(body({"metrics": metrics(current_step=value)}))


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b"", "not JSON"),
        (b"   ", "not JSON"),
        (b"{", "not JSON"),
        (b'{"trainerStatus": {}} trailing', "not JSON"),
        (b"\xff\xfe\x00garbage", "not JSON"),  # no UTF-8/16/32 text
        (b'{"trainerStatus": {"progressPercentage": "50"}}', "a number is expected"),
        (b"null", 'no "trainerStatus" object'),
        (b"[]", 'no "trainerStatus" object'),
        (b'"trainerStatus"', 'no "trainerStatus" object'),
        (b"{}", 'no "trainerStatus" object'),
        (b'{"trainerStatus": null}', 'no "trainerStatus" object'),
        (b'{"trainerStatus": []}', 'no "trainerStatus" object'),
        (b'{"trainerStatus": "50%"}', 'no "trainerStatus" object'),
        (b'{"status": {"progressPercentage": 50}}', 'no "trainerStatus" object'),
        (b'{"trainerStatus": {"metrics": {"loss": "1"}}}', "a list of {name, value}"),
        (b'{"trainerStatus": {"metrics": "loss=1"}}', "a list of {name, value}"),
        (b'{"trainerStatus": {"metrics": [["loss", "1"]]}}', "each item is a {name, value} object"),
        (b'{"trainerStatus": {"metrics": [null]}}', "each item is a {name, value} object"),
        (b'{"trainerStatus": {"metrics": [{"value": "1"}]}}', "a name is a string"),
        (b'{"trainerStatus": {"metrics": [{"name": 7, "value": "1"}]}}', "a name is a string"),
        (b'{"trainerStatus": {"metrics": [{"name": "loss"}]}}', "the value is a string"),
        (b'{"trainerStatus": {"metrics": [{"name": "loss", "value": null}]}}', "the value is a string"),
        (b'{"trainerStatus": {"metrics": [{"name": "loss", "value": [1]}]}}', "the value is a string"),
        (b'{"trainerStatus": {"metrics": [{"name": "loss", "value": {"v": 1}}]}}', "the value is a string"),
        (b'{"trainerStatus": {"progressPercentage": [50]}}', "a number is expected"),
        (b'{"trainerStatus": {"progressPercentage": {"value": 50}}}', "a number is expected"),
    ],
)
def test_garbage_is_refused_with_a_reason(raw: bytes, why: str) -> None:
    assert why in refused(raw)


# About 32k levels within the size bound: far beyond the interpreter's recursion limit, so the
# JSON reader raises RecursionError, which is refused like any other unreadable body.
DEPTH = MAX_REPORT_BYTES // 2 - 40
WRAPPED = (MAX_REPORT_BYTES - 80) // 6


@pytest.mark.parametrize(
    "raw",
    [
        b"[" * DEPTH + b"]" * DEPTH,
        b"[" * MAX_REPORT_BYTES,  # never closed
        b'{"trainerStatus": {"x": ' + b"[" * DEPTH + b"]" * DEPTH + b"}}",
        b'{"trainerStatus": {"metrics": [{"name": "a", "value": '
        + b'{"a":' * WRAPPED
        + b"1"
        + b"}" * WRAPPED
        + b"}]}}",
    ],
    ids=["lists", "unclosed", "inside-the-status", "inside-a-metric"],
)
def test_deep_nesting_is_a_400_not_a_crash(raw: bytes) -> None:
    assert len(raw) <= MAX_REPORT_BYTES
    assert "not JSON" in refused(raw)


# -- any bytes: a report or a ReportError -----------------------------------------------------

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=80),
    st.sampled_from(["1e400", "-1e400", "nan", "inf", "1e300", "9" * 64, "0.5", "-0", "1_000", " 7 "]),
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=10), inner, max_size=5)
    ),
    max_leaves=30,
)
NAMES = st.one_of(
    st.sampled_from([
        "current_step", "step", "global_step", "total_steps", "max_steps", "current_epoch", "epoch",
        "total_epochs", "num_train_epochs", "loss", "train_loss", "accuracy", "eval_accuracy",
        "samples_per_second", "learning_rate",
    ]),
    st.text(max_size=130),
    JSON,
)  # fmt: skip
METRIC = st.one_of(st.fixed_dictionaries({"name": NAMES, "value": JSON}), JSON)
STATUS = st.one_of(
    st.fixed_dictionaries(
        {},
        optional={
            "progressPercentage": st.one_of(st.floats(-1, 101), JSON),
            "estimatedRemainingSeconds": st.one_of(st.integers(-1, 10**10), JSON),
            "metrics": st.one_of(st.lists(METRIC, max_size=8), JSON),
            "lastUpdatedTime": JSON,
        },
    ),
    JSON,
)
BODIES = st.one_of(
    st.binary(max_size=512),
    st.builds(lambda s: json.dumps({"trainerStatus": s}).encode(), STATUS),
    # Valid JSON cut or spliced anywhere, and the literals JSON forbids dropped in.
    st.builds(
        lambda s, cut, splice: (lambda raw: raw[:cut] + splice + raw[cut:])(
            json.dumps({"trainerStatus": s}).encode()
        ),
        STATUS,
        st.integers(0, 200),
        st.sampled_from([b"", b"NaN", b"Infinity", b"1e400", b"[", b"}", b"\xff", b'"', b"\\u0000"]),
    ),
)


def _within_the_status(report: TrainerReport) -> None:
    """Every figure is one the GpuTraining's status can hold."""
    for count in (report.step, report.total_steps, report.epoch, report.total_epochs):
        assert count is None or (isinstance(count, int) and 0 <= count <= INT64_MAX)
    for number in (report.percent, report.estimated_remaining_seconds, report.loss, report.accuracy,
                   report.samples_per_second):  # fmt: skip
        assert number is None or math.isfinite(number)
    assert report.percent is None or 0 <= report.percent <= 100
    assert report.estimated_remaining_seconds is None or report.estimated_remaining_seconds >= 0
    assert report.accuracy is None or 0 <= report.accuracy <= 1
    assert report.samples_per_second is None or report.samples_per_second >= 0
    assert len(report.other) <= MAX_SHOWN_METRICS
    for name, value in report.other:
        assert 0 < len(name) <= MAX_NAME_CHARS
        assert len(value) <= MAX_VALUE_CHARS
    assert report.sent_at is None or len(report.sent_at) <= 64
    if report.checkpoint is not None:
        assert 0 <= report.checkpoint.step <= INT64_MAX
        assert report.checkpoint.time is None or re.fullmatch(
            r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", report.checkpoint.time
        )
        assert report.checkpoint.uri is None or 0 < len(report.checkpoint.uri) <= 1024


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(BODIES)
@example(b'{"trainerStatus": {"metrics": [{"name": "current_epoch", "value": "1e300"}]}}')
@example(b'{"trainerStatus": {"metrics": [{"name": "epoch", "value": 1e300}]}}')
@example(b"[" * MAX_REPORT_BYTES)
@example(body({"metrics": metrics(checkpoint_step="1e300", checkpoint_time="9999-12-31T23:59:59-01:00")}))
@example(body({"metrics": metrics(checkpoint_step="7", checkpoint_time="2026-02-30T00:00:00Z")}))
def test_any_bytes_are_a_report_or_a_report_error(raw: bytes) -> None:
    try:
        report: TrainerReport | ReportError = parse_report(raw)
    except ReportError as exc:  # anything else fails the test
        report = exc
    if isinstance(report, ReportError):
        assert report.status in (400, 413)
        assert str(report)
    else:
        assert isinstance(report, TrainerReport)
        _within_the_status(report)


@pytest.mark.parametrize(
    ("said", "read"),
    [("evaluating", "evaluating"), ("saving", "saving"), ("loading", "loading"), ("compiling", "compiling"),
     ("training", None), ("Evaluating", None), ("x" * 64, None)],
)  # fmt: skip
def test_a_pause_is_read_from_the_activity_metric_and_lasts_only_while_reports_say_it(
    said: str, read: str | None
) -> None:
    """The code's pause (gpureport.pause) is one of four words; anything else is training. It
    is not carried over from the pod's earlier report, as the other figures are: a report that
    does not say it ends it."""
    body = {
        "trainerStatus": {
            "metrics": [{"name": "current_step", "value": "5"}, {"name": "activity", "value": said}]
        }
    }
    report = parse_report(json.dumps(body).encode())
    assert report.activity == read
    assert "activity" not in dict(report.other)
    later = parse_report(
        json.dumps({"trainerStatus": {"metrics": [{"name": "loss", "value": "0.5"}]}}).encode()
    )
    merged = later.over(report)
    assert (merged.step, merged.loss, merged.activity) == (5, 0.5, None)
    assert report.over(later).activity == read


# -- the last complete checkpoint (gpureport.checkpointed) --------------------------------------


def test_a_checkpoint_is_read_with_its_time_in_utc_and_its_uri_from_its_pieces() -> None:
    """A URI longer than a value's 64 characters comes in pieces, joined in order; a piece
    after a missing one is not part of it. The time is the status's (UTC, to the second)."""
    uri = "s3://team-checkpoints/runs/" + "x" * 90 + "/step-00000500-0f1e2d3c.pt"
    pieces = {("checkpoint_uri" if n == 0 else f"checkpoint_uri_{n + 1}"): uri[64 * n : 64 * (n + 1)]
              for n in range((len(uri) + 63) // 64)}  # fmt: skip
    report = parse_report(body({"metrics": metrics(
        current_step="510", checkpoint_step="500", checkpoint_time="2026-11-25T18:30:00.25+01:00",
        **pieces, checkpoint_uri_9="not/part/of/it")}))  # fmt: skip
    assert report.checkpoint is not None
    assert (report.checkpoint.step, report.checkpoint.time, report.checkpoint.uri) == (
        500,
        "2026-11-25T17:30:00Z",
        uri,
    )
    assert not {name for name, _ in report.other} & {"checkpoint_step", "checkpoint_time", "checkpoint_uri"}
    # Carried over from the pod's earlier report, as the other figures are.
    later = parse_report(body({"metrics": metrics(current_step="520")}))
    assert later.over(report).checkpoint == report.checkpoint


@pytest.mark.parametrize(
    ("step", "time", "read"),
    [("500", "2026-11-25 17:30:00", (500, "2026-11-25T17:30:00Z")),  # no zone: UTC
     ("500", "yesterday", (500, None)), ("500", "2026-02-30T00:00:00Z", (500, None)),
     ("500", "0001-01-01T00:00:00Z", (500, None)), ("500.5", SENT_AT, None), ("-1", SENT_AT, None),
     ("1e300", SENT_AT, None), ("five", SENT_AT, None)],
)  # fmt: skip
def test_a_checkpoint_without_a_count_is_none_and_a_time_the_status_cannot_hold_is_dropped(
    step: str, time: str, read: tuple[int, str | None] | None
) -> None:
    report = parse_report(body({"metrics": metrics(checkpoint_step=step, checkpoint_time=time)}))
    got = None if report.checkpoint is None else (report.checkpoint.step, report.checkpoint.time)
    assert got == read
