"""spec.training.compile (absent: auto) on its way to the trainer, and the trainer's compile mode
on its way back into status.progress.compile, by each of the three roads a figure takes."""

from __future__ import annotations

import json
from datetime import datetime

import pytest

from gpuop._kits.schema import SpecError
from gpuop.api.spec import parse
from gpuop.backends.pod import trainer_settings
from gpuop.observing.figures import progress_from_metrics, progress_from_report, progress_from_result
from gpuop.observing.records import ReceivedReport
from gpuop.observing.reports import parse_report
from gpuop.observing.scrape import parse_metrics
from gputrain.contract import ContractError, Result, TrainerSettings, env_name
from support.specs import minimal

NOW = "2026-01-01T00:00:00Z"


@pytest.mark.parametrize(("training", "setting", "env"), [
    ({}, None, "auto"),
    ({"compile": True}, True, "true"),
    ({"compile": False}, False, "false"),
])  # fmt: skip
def test_compile_is_auto_when_absent_and_true_or_false_as_before(
    training: dict[str, object], setting: bool | None, env: str
) -> None:
    parsed = parse(minimal(training=training))
    assert parsed.spec.training.compile is setting
    settings = trainer_settings(parsed.name, parsed.spec)
    rendered = settings.to_env()
    assert rendered[env_name("compile")] == env
    assert TrainerSettings.from_env(rendered).compile is setting


def test_compile_stays_a_boolean_in_the_spec() -> None:
    with pytest.raises(SpecError, match="compile"):
        parse(minimal(training={"compile": "auto"}))


def test_the_trainer_refuses_a_compile_setting_it_does_not_know() -> None:
    parsed = parse(minimal())
    rendered = trainer_settings(parsed.name, parsed.spec).to_env()
    with pytest.raises(ContractError, match=r"GPUTRAIN_COMPILE: must be auto, true or false \(got 'yes'\)"):
        TrainerSettings.from_env({**rendered, env_name("compile"): "yes"})


def _report(metrics: list[dict[str, str]]) -> ReceivedReport:
    body = json.dumps({"trainerStatus": {"progressPercentage": 10, "metrics": metrics}}).encode()
    return ReceivedReport(pod="demo-master-0", report=parse_report(body), received_at=datetime(2026, 1, 1))


def test_the_mode_reaches_status_from_a_report() -> None:
    sent = [{"name": "current_step", "value": "3"}, {"name": "compile", "value": "CompiledCacheHit"}]
    progress = progress_from_report(_report(sent), NOW)
    assert progress.compile == "CompiledCacheHit"
    assert progress.metrics == ()  # read into its field, not shown again among the others
    # A value that is not a mode (any container can report) is dropped, not written into status.
    bogus = progress_from_report(_report([{"name": "compile", "value": "fast"}]), NOW)
    assert bogus.compile is None


def test_the_mode_reaches_status_from_the_endpoint() -> None:
    text = (
        "# TYPE gputrain_step gauge\ngputrain_step 3.0\n"
        "# TYPE gputrain_total_steps gauge\ngputrain_total_steps 9.0\n"
        "# TYPE gputrain_compile info\n"
        'gputrain_compile_info{mode="EagerTooShort"} 1.0\n'
    )
    assert progress_from_metrics(parse_metrics(text), NOW).compile == "EagerTooShort"
    assert progress_from_metrics(parse_metrics(text.replace("EagerTooShort", "x")), NOW).compile is None


def test_the_mode_reaches_status_from_the_final_record() -> None:
    record = Result.from_json(
        Result(phase="Succeeded", step=9, total_steps=9, compile="EagerOnCpu").to_json()
    )
    assert record is not None
    assert progress_from_result(record, NOW).compile == "EagerOnCpu"
    unknown = Result.from_json(json.dumps({"phase": "Succeeded", "compile": 1}))
    assert unknown is not None
    assert unknown.compile is None
