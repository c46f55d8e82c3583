"""The operator/trainer contract, and the import boundaries that keep the images small."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpuop.api.spec import parse
from gpuop.backends.pod import trainer_settings
from gpuop.local.figures import sparkline
from gpuop.observing.scrape import MAX_METRICS_BYTES, parse_metrics
from gputrain.contract import (
    ContractError,
    HistoryPoint,
    Metric,
    Progress,
    Result,
    TrainerSettings,
    complete_checkpoint_step,
    env_name,
    read_history,
)
from gputrain.metrics import GpuReading, MetricsServer
from support.cost import thread_seconds
from support.specs import minimal


def test_every_setting_round_trips_through_the_environment() -> None:
    settings = trainer_settings("demo", parse(minimal(training={"channelsLast": True})).spec)
    env = settings.to_env()
    assert all(name.startswith("GPUTRAIN_") for name in env)
    assert env[env_name("channels_last")] == "true"
    assert TrainerSettings.from_env(env) == settings


def test_every_problem_in_the_environment_is_reported() -> None:
    env = trainer_settings("demo", parse(minimal()).spec).to_env()
    env["GPUTRAIN_EPOCHS"] = "ten"
    env["GPUTRAIN_PRECISION"] = "fp8"
    env["GPUTRAIN_COMPILE"] = "yes"
    del env["GPUTRAIN_SEED"]
    with pytest.raises(ContractError) as caught:
        TrainerSettings.from_env(env)
    assert str(caught.value).splitlines() == [
        "GPUTRAIN_EPOCHS: must be an integer (got 'ten')",
        "GPUTRAIN_PRECISION: must be one of fp32, bf16, fp16 (got 'fp8')",
        "GPUTRAIN_SEED: required but not set",
        "GPUTRAIN_COMPILE: must be auto, true or false (got 'yes')",
    ]


def _imported_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(' '.join(sorted(m.split('.')[0] for m in sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(result.stdout.split())


def test_the_operator_never_imports_torch() -> None:
    loaded = _imported_after("import gpuop.cli.commands, gpuop.backends.pod, gpuop.api.crd")
    assert "torch" not in loaded
    assert "gpuop" in loaded


def test_the_contract_imports_neither_torch_nor_kubernetes() -> None:
    loaded = _imported_after("import gputrain.contract")
    assert loaded.isdisjoint({"torch", "kopf", "kubernetes", "yaml", "gpuop"})


def test_figures_not_published_yet_are_absent_not_zero() -> None:
    """A status must not say "loss 0" or "accuracy 0" before the trainer has said anything."""
    server = MetricsServer(None)
    before = parse_metrics(generate_latest(server.registry).decode())
    assert (before.step, before.loss, before.accuracy, before.estimated_remaining_seconds) == (None,) * 4
    server.update(Progress(epoch=1, total_epochs=2, step=3, total_steps=10, loss=0.7, accuracy=None,
                           samples_per_second=None, estimated_remaining_seconds=None))  # fmt: skip
    after = parse_metrics(generate_latest(server.registry).decode())
    assert (after.step, after.loss, after.accuracy, after.samples_per_second) == (3, 0.7, None, None)


def _families(server: MetricsServer) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(generate_latest(server.registry).decode())}


def test_the_trainer_endpoint_follows_prometheus_conventions() -> None:
    """Counters for what only grows (``rate()`` works), 0..1 ratios, an info series for the GPU
    model, the process and Python collectors, and no series before it has a value."""
    server = MetricsServer(None)
    families = _families(server)
    assert not {n for n in families if n.startswith("gputrain_")} - {Metric.STEPS, Metric.SAMPLES}
    assert families[Metric.STEPS].type == "counter"
    assert {
        "process_cpu_seconds",
        "process_resident_memory_bytes",
        "python_info",
        "python_gc_objects_collected",
    } <= set(families)
    gpu = GpuReading(0, "NVIDIA H100 80GB HBM3", 87.0, 10 * 2**30, 80 * 2**30)
    server.update(Progress(step=30, total_steps=120, loss=0.5), gpus=[gpu])
    server.count(steps=10, samples=1280.0)
    server.count(steps=20, samples=2560.0)
    families = _families(server)
    assert families[Metric.PROGRESS_RATIO].samples[0].value == 0.25
    assert families[Metric.GPU_UTILIZATION_RATIO].samples[0].value == 0.87
    (info,) = families[f"{Metric.GPU_INFO}_info"].samples
    assert (info.name, info.labels, info.value) == ("gputrain_gpu_info", {"gpu": "0", "name": gpu.name}, 1)
    (steps,) = [s for s in families[Metric.STEPS].samples if s.name.endswith("_total")]
    (samples,) = [s for s in families[Metric.SAMPLES].samples if s.name.endswith("_total")]
    assert (steps.value, samples.value) == (30, 3840)
    assert Metric.ACCURACY not in families  # still nothing said: still no series
    for family in families.values():
        assert family.documentation, family.name
    # What the operator reads back is in its own units (percent), with the model.
    read = parse_metrics(generate_latest(server.registry).decode())
    assert (read.percent, read.gpus[0].utilization_percent, read.gpus[0].name) == (25.0, 87.0, gpu.name)


def test_a_pods_metrics_answer_costs_the_operator_milliseconds_at_most() -> None:
    """A pod's /metrics is untrusted input: one over the bound is refused unread, and one just
    under it parses in well under the 10 ms an object may cost the operator."""
    line = 'gputrain_gpu_utilization_ratio{gpu="%d"} 1e308\n'
    huge = "".join(line % i for i in range(5000))
    with pytest.raises(ValueError, match="over 32768 bytes"):
        parse_metrics(huge)
    largest = huge[: huge.rfind("\n", 0, MAX_METRICS_BYTES) + 1]
    figures, seconds = thread_seconds(lambda: parse_metrics(largest))
    assert seconds < 0.065  # measured 6.5 ms: fails at 10x, not on a busy machine
    assert len(figures.gpus) > 600


def test_a_history_reads_back_and_skips_a_line_cut_by_a_kill() -> None:
    points = [HistoryPoint(time=1.0, step=5, epoch=1, loss=2.3, learning_rate=1e-3, samples_per_second=900.0),
              HistoryPoint(time=2.0, step=10, epoch=1, accuracy=0.8, gpu_utilization_percent=87.5)]  # fmt: skip
    text = "".join(p.to_json() + "\n" for p in points) + '{"time": 3.0, "step": 1'
    assert read_history(text) == points
    assert HistoryPoint.from_json('{"time": 1, "step": "5", "epoch": 1}') is None  # the edge checks types
    assert "accuracy" not in json.loads(points[0].to_json())  # absent, not null


@pytest.mark.parametrize(
    ("values", "line"),
    [
        ([], ""),
        ([1.0], "▁"),
        ([3.0, 2.0, 1.0], "█▅▁"),
        ([1.0, 1.0], "▁▁"),
        (list(range(80)), "▁▁▂▂▃▃▄▄▅▅▆▆▇▇██"),
    ],
)
def test_sparkline(values: list[float], line: str) -> None:
    assert sparkline(values, width=16) == line


def test_a_picture_that_cannot_be_written_is_one_line_naming_the_path(tmp_path: Path) -> None:
    """`gpuop run --plot` after a finished run: a bad path is a PlotError (the CLI's one line),
    not an OSError traceback; a good one gets its PNG."""
    from gpuop.local import plots

    points = [HistoryPoint(time=float(i), step=i, epoch=1, loss=1.0 / (i + 1)) for i in range(5)]
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(plots.PlotError, match=r"^--plot .*a-file/curves\.png: cannot write it: "):
        plots.write_curves(points, blocker / "curves.png", "t")
    drawn = plots.write_curves(points, tmp_path / "out" / "curves.png", "t")
    assert drawn.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize(
    ("name", "step"),
    [
        ("step-00000020.json", 20),  # a manifest: written last, so its checkpoint is complete
        ("step-00000020.pt", 20),  # a state from before manifests: complete alone
        ("step-00000020-0badcafe.pt", None),  # a state: complete only if a manifest names it
        ("step-00000020.json.unreadable", None),  # set aside
        ("step-20.json", None),
        ("metrics.jsonl", None),
    ],
)
def test_the_names_a_listing_shows_of_complete_checkpoints(name: str, step: int | None) -> None:
    assert complete_checkpoint_step(name) == step


def test_a_record_says_whether_a_restart_would_fail_the_same_way() -> None:
    """Result.permanent round-trips; anything but a JSON boolean (a custom image's record) is
    dropped at the edge, never taken for True."""
    record = Result("Failed", reason="CheckpointStorageFailed", message="access denied", permanent=True)
    assert Result.from_json(record.to_json()) == record
    for written in ('"yes"', "1", "null"):
        text = f'{{"phase": "Failed", "reason": "X", "permanent": {written}}}'
        assert Result.from_json(text) == Result("Failed", reason="X")
