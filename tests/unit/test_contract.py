"""The operator/trainer contract, and the import boundaries that keep the images small."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from prometheus_client import generate_latest

from gpuop.render import trainer_settings
from gpuop.scrape import MAX_METRICS_BYTES, parse_metrics
from gpuop.spec import parse
from gputrain.contract import ContractError, Progress, TrainerSettings, env_name
from gputrain.metrics import MetricsServer
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
        "GPUTRAIN_COMPILE: must be true or false (got 'yes')",
    ]


def _imported_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(' '.join(sorted(m.split('.')[0] for m in sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(result.stdout.split())


def test_the_operator_never_imports_torch() -> None:
    loaded = _imported_after("import gpuop.cli, gpuop.render, gpuop.crd")
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


def test_a_pods_metrics_answer_costs_the_operator_milliseconds_at_most() -> None:
    """A pod's /metrics is untrusted input: one over the bound is refused unread, and one just
    under it parses in well under the 10 ms an object may cost the operator."""
    line = 'gputrain_gpu_utilization_percent{gpu="%d"} 1e308\n'
    huge = "".join(line % i for i in range(5000))
    with pytest.raises(ValueError, match="over 32768 bytes"):
        parse_metrics(huge)
    largest = huge[: huge.rfind("\n", 0, MAX_METRICS_BYTES) + 1]
    started = time.process_time()
    figures = parse_metrics(largest)
    assert time.process_time() - started < 0.05  # measured 6.5 ms; a slow CI machine has headroom
    assert len(figures.gpus) > 600
