"""The operator's series that users sum and alert on: GPU-hours per namespace (a counter that only
grows), trainings by phase per namespace, and the few per-training series the chart's alerts
read, set from the state table at each tick and gone with the training."""

from __future__ import annotations

import copy
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from gpuop.controller.reconciler import Reconciler
from gpuop.controller.settings import OperatorSettings
from gpuop.controller.table import Tracked
from gpuop.controller.telemetry import OperatorMetrics
from gpuop.observing.records import ReceivedReport
from gpuop.observing.reports import parse_report
from support.specs import minimal
from support.toyjob import Store, ToyJobApi

T0 = datetime(2026, 11, 24, 10, 0, 0, tzinfo=UTC)


def _at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def _stamp(seconds: float) -> str:
    return _at(seconds).strftime("%Y-%m-%dT%H:%M:%SZ")


def _condition(kind: str, status: str, since: float) -> dict[str, Any]:
    return {
        "type": kind,
        "status": status,
        "reason": kind,
        "message": "",
        "lastTransitionTime": _stamp(since),
    }


def _training(
    name: str,
    namespace: str = "team-a",
    *,
    uid: str | None = None,
    phase: str | None = "Running",
    **status: Any,
) -> Tracked:
    body: dict[str, Any] = {
        "metadata": {"name": name, "namespace": namespace, "uid": uid or f"uid-{name}",
                     "creationTimestamp": _stamp(-600)},
        "spec": {},
    }  # fmt: skip
    if phase is not None:
        body["status"] = {"phase": phase, **status}
    return Tracked(body=body)


def _running(name: str, namespace: str = "team-a", *, gpus: int, hours: float, counted: float,
             **status: Any) -> Tracked:  # fmt: skip
    """A training whose last status write said it holds ``gpus`` GPUs, counted up to ``counted``."""
    status = {"conditions": [_condition("Running", "True", 0)], **status}
    return _training(name, namespace, gpu={"count": gpus}, gpuHours=hours, gpuHoursCountedAt=_stamp(counted),
                     **status)  # fmt: skip


def _value(metrics: OperatorMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def _series(metrics: OperatorMetrics, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {
        tuple(sorted(s.labels.items())): s.value
        for family in metrics.registry.collect()
        for s in family.samples
        if s.name == name
    }


def _tick(metrics: OperatorMetrics, seconds: float, *trainings: Tracked) -> None:
    items = [((t.body["metadata"]["namespace"], t.body["metadata"]["name"]), t) for t in trainings]
    metrics.observe_trainings(items, _at(seconds))


def test_gpu_hours_grow_with_the_clock_between_status_writes_and_never_count_twice() -> None:
    metrics = OperatorMetrics()
    hours = "gpuop_gpu_hours_total"
    # First seen with 10 GPU-hours in its status (held before this process): not this process's
    # to bill, but the namespace's series is there from 0 on.
    _tick(metrics, 0, _running("llm", gpus=4, hours=10.0, counted=0))
    assert _value(metrics, hours, namespace="team-a") == 0
    _tick(metrics, 900, _running("llm", gpus=4, hours=10.0, counted=0))
    assert _value(metrics, hours, namespace="team-a") == pytest.approx(1.0)  # 4 GPUs x 15 min
    # The status is written: the span moves into gpuHours, with no jump.
    _tick(metrics, 900, _running("llm", gpus=4, hours=11.0, counted=900))
    assert _value(metrics, hours, namespace="team-a") == pytest.approx(1.0)
    _tick(metrics, 1800, _running("llm", gpus=4, hours=11.0, counted=900))
    assert _value(metrics, hours, namespace="team-a") == pytest.approx(2.0)
    # It finished at 1700 s, which the operator learnt at 1800: its final gpuHours is under what was
    # counted. The counter keeps its value (a counter never goes down) and counts none of it again.
    finished = _training("llm", phase="Succeeded", gpu={"count": 4}, gpuHours=11.0 + 4 * 800 / 3600)
    _tick(metrics, 1800, finished)
    _tick(metrics, 3600, finished)
    assert _value(metrics, hours, namespace="team-a") == pytest.approx(2.0)


def test_gpu_hours_are_per_namespace_and_only_for_trainings_holding_gpus() -> None:
    metrics = OperatorMetrics()
    trainings = [
        _running("a", "team-a", gpus=8, hours=0.0, counted=0),
        _running("b", "team-b", gpus=1, hours=0.0, counted=0),
        _training("queued", "team-b", phase="Queued", gpu={"count": 16}, gpuHours=3.0),  # no pods: no count
        _running("cpu", "team-c", gpus=0, hours=0.0, counted=0),
    ]
    _tick(metrics, 0, *trainings)
    _tick(metrics, 3600, *trainings)
    assert _series(metrics, "gpuop_gpu_hours_total") == {
        (("namespace", "team-a"),): pytest.approx(8.0),
        (("namespace", "team-b"),): pytest.approx(1.0),
        (("namespace", "team-c"),): 0.0,
    }


def test_a_restarted_operator_or_a_recreated_training_bills_only_from_then_on() -> None:
    before = _running("llm", gpus=2, hours=50.0, counted=0)
    restarted = OperatorMetrics()
    _tick(restarted, 1800, before)  # 50 + 1 GPU-hours held, none of them since this process began
    assert _value(restarted, "gpuop_gpu_hours_total", namespace="team-a") == 0
    _tick(restarted, 3600, before)
    assert _value(restarted, "gpuop_gpu_hours_total", namespace="team-a") == pytest.approx(1.0)
    # Deleted and made again under the same name: a new uid, a new count from its own start.
    again = _running("llm", uid="uid-2", gpus=2, hours=0.0, counted=3600)
    _tick(restarted, 3600, again)
    _tick(restarted, 5400, again)
    assert _value(restarted, "gpuop_gpu_hours_total", namespace="team-a") == pytest.approx(2.0)


def test_a_namespace_this_replica_stops_leading_is_neither_shown_nor_billed_again_for_its_absence() -> None:
    metrics = OperatorMetrics()
    llm = _running("llm", gpus=4, hours=0.0, counted=0)
    _tick(metrics, 0, llm)
    _tick(metrics, 900, llm)
    assert _value(metrics, "gpuop_gpu_hours_total", namespace="team-a") == pytest.approx(1.0)
    _tick(metrics, 1800)  # another replica leads team-a now: it bills 900..1800
    assert _series(metrics, "gpuop_trainings") == {}
    assert _series(metrics, "gpuop_training_phase") == {}
    _tick(metrics, 2700, llm)  # led here again: from now on, not from 900
    _tick(metrics, 3600, llm)
    assert _value(metrics, "gpuop_gpu_hours_total", namespace="team-a") == pytest.approx(2.0)


def test_trainings_by_phase_count_every_phase_of_each_namespace_and_drop_an_emptied_namespace() -> None:
    metrics = OperatorMetrics()
    a = _running("a", "team-a", gpus=1, hours=0.0, counted=0)
    b = _training("b", "team-a", phase="Queued")
    new = _training("new", "team-b", phase=None)  # no status yet
    _tick(metrics, 0, a, b, new)
    counts = _series(metrics, "gpuop_trainings")
    assert len(counts) == 2 * 9  # every phase (and Unknown) of each namespace, zeros included
    assert counts[(("namespace", "team-a"), ("phase", "Running"))] == 1
    assert counts[(("namespace", "team-a"), ("phase", "Queued"))] == 1
    assert counts[(("namespace", "team-a"), ("phase", "Failed"))] == 0
    assert counts[(("namespace", "team-b"), ("phase", "Unknown"))] == 1
    _tick(metrics, 10, a, b)  # team-b's only training was deleted
    assert {dict(k)["namespace"] for k in _series(metrics, "gpuop_trainings")} == {"team-a"}


def test_per_training_series_name_the_training_follow_its_phase_and_go_with_it() -> None:
    metrics = OperatorMetrics()
    queued = _training("big", phase="Queued", conditions=[_condition("Queued", "True", 120)])
    pending = _training("fresh", "team-b", phase="Pending")
    _tick(metrics, 300, queued, pending)
    assert _series(metrics, "gpuop_training_phase") == {
        (("gputraining", "big"), ("namespace", "team-a"), ("phase", "Queued")): 1,
        (("gputraining", "fresh"), ("namespace", "team-b"), ("phase", "Pending")): 1,
    }
    assert _series(metrics, "gpuop_training_phase_since_timestamp_seconds") == {
        (("gputraining", "big"), ("namespace", "team-a"), ("phase", "Queued")): _at(120).timestamp(),
        # Pending has no condition of its name: since the GpuTraining was made.
        (("gputraining", "fresh"), ("namespace", "team-b"), ("phase", "Pending")): _at(-600).timestamp(),
    }
    # Admitted: the Queued series go, the Running ones come, with no second series per training.
    running = _running("big", gpus=8, hours=0.0, counted=400,
                       conditions=[_condition("Queued", "False", 400), _condition("Running", "True", 400)])  # fmt: skip
    _tick(metrics, 500, running, pending)
    assert _series(metrics, "gpuop_training_phase") == {
        (("gputraining", "big"), ("namespace", "team-a"), ("phase", "Running")): 1,
        (("gputraining", "fresh"), ("namespace", "team-b"), ("phase", "Pending")): 1,
    }
    assert _value(metrics, "gpuop_training_phase_since_timestamp_seconds", namespace="team-a",
                  gputraining="big", phase="Running") == _at(400).timestamp()  # fmt: skip
    _tick(metrics, 600)  # both deleted
    for name in ("gpuop_training_phase", "gpuop_training_phase_since_timestamp_seconds",
                 "gpuop_training_condition", "gpuop_training_last_progress_timestamp_seconds"):  # fmt: skip
        assert _series(metrics, name) == {}, name


def test_the_alarm_conditions_are_1_while_they_hold_and_0_once_cleared() -> None:
    metrics = OperatorMetrics()
    conditions = [_condition("Running", "True", 0), _condition("Stalled", "True", 900),
                  _condition("Underutilized", "False", 800), _condition("SpecNotApplied", "True", 0)]  # fmt: skip
    _tick(metrics, 1000, _running("llm", gpus=1, hours=0.0, counted=0, conditions=conditions))
    assert _series(metrics, "gpuop_training_condition") == {
        (("condition", "Stalled"), ("gputraining", "llm"), ("namespace", "team-a")): 1,
        (("condition", "Underutilized"), ("gputraining", "llm"), ("namespace", "team-a")): 0,
    }


def test_each_trainings_figures_are_its_status_for_any_code_and_the_running_ones_go_when_it_stops() -> None:
    """What the dashboards chart, read from status (a team's own code's reports, dcgm-exporter's
    GPU figures) rather than from the built-in trainer's own series, which other code lacks."""
    metrics = OperatorMetrics()
    progress = {"percent": 40.0, "loss": 1.25, "accuracy": 0.5, "samplesPerSecond": 300.0,
                "estimatedRemainingSeconds": 90, "step": 40}  # fmt: skip
    gpu = {"count": 2, "model": "NVIDIA H100 80GB HBM3", "source": "DcgmExporter", "perWorker": [
        {"pod": "llm-worker-0", "utilizationPercent": 4.0, "memoryUsedBytes": 2048},
        {"pod": "llm-worker-1", "utilizationPercent": 96.0},  # no memory figure: none shown
        {"utilizationPercent": 50.0},  # no pod: not a series
    ]}  # fmt: skip
    running = [_condition("Running", "True", 0)]
    _tick(metrics, 100, _training("llm", conditions=running, progress=progress, gpu=gpu))

    def of(name: str) -> float | None:
        return _value(metrics, name, namespace="team-a", gputraining="llm")

    assert of("gpuop_training_progress_ratio") == 0.4
    assert of("gpuop_training_loss") == 1.25
    assert of("gpuop_training_accuracy_ratio") == 0.5
    assert of("gpuop_training_samples_per_second") == 300.0
    assert of("gpuop_training_estimated_remaining_seconds") == 90
    assert _series(metrics, "gpuop_training_gpu_utilization_ratio") == {
        (("gputraining", "llm"), ("namespace", "team-a"), ("pod", "llm-worker-0")): 0.04,
        (("gputraining", "llm"), ("namespace", "team-a"), ("pod", "llm-worker-1")): 0.96,
    }
    assert _series(metrics, "gpuop_training_gpu_memory_used_bytes") == {
        (("gputraining", "llm"), ("namespace", "team-a"), ("pod", "llm-worker-0")): 2048,
    }
    assert _series(metrics, "gpuop_training_gpus") == {
        (("gputraining", "llm"), ("model", "NVIDIA H100 80GB HBM3"), ("namespace", "team-a")): 2,
    }
    # Stalled: its throughput is 0, whatever its last report said (status keeps that figure).
    stalled = [*running, _condition("Stalled", "True", 150)]
    _tick(metrics, 180, _training("llm", conditions=stalled, progress=progress, gpu=gpu))
    assert of("gpuop_training_samples_per_second") == 0
    assert of("gpuop_training_loss") == 1.25
    # Restarting: status keeps the last perWorker, but those pods may be gone; so do their series.
    _tick(metrics, 190, _training("llm", phase="Restarting", conditions=running, progress=progress, gpu=gpu))
    assert _series(metrics, "gpuop_training_gpu_utilization_ratio") == {}
    # Its GPUs, with no figures that named their model (no dcgm-exporter, a custom image).
    _tick(metrics, 195, _training("llm", conditions=running, progress=progress, gpu={"count": 8}))
    assert _series(metrics, "gpuop_training_gpus") == {
        (("gputraining", "llm"), ("model", "unknown"), ("namespace", "team-a")): 8,
    }
    # Finished: its last loss, progress and accuracy stay; throughput, time to go and GPUs go.
    _tick(metrics, 200, _training("llm", phase="Succeeded", progress={**progress, "percent": 100.0}, gpu=gpu))
    assert of("gpuop_training_progress_ratio") == 1.0
    assert of("gpuop_training_loss") == 1.25
    for gone in ("gpuop_training_samples_per_second", "gpuop_training_estimated_remaining_seconds",
                 "gpuop_training_gpu_utilization_ratio", "gpuop_training_gpu_memory_used_bytes",
                 "gpuop_training_gpus"):  # fmt: skip
        assert _series(metrics, gone) == {}, gone
    # A figure that is not a number (a hand-edited status) is no series, and no error.
    _tick(metrics, 300, _training("llm", conditions=running, progress={"loss": "NaN?", "percent": True},
                                  gpu={"count": "8", "perWorker": ["x"]}))  # fmt: skip
    assert of("gpuop_training_loss") is None
    assert of("gpuop_training_progress_ratio") is None
    # Deleted while it runs: every series of it goes at the next tick.
    alarms = [*running, _condition("Underutilized", "False", 0)]
    _tick(metrics, 350, _training("llm", conditions=alarms, progress=progress, gpu=gpu))
    every = [
        family.name for family in metrics.registry.collect() if family.name.startswith("gpuop_training_")
    ]
    assert len(every) == 12
    assert all(_series(metrics, name) for name in every), [
        name for name in every if not _series(metrics, name)
    ]
    _tick(metrics, 400)
    for name in every:
        assert _series(metrics, name) == {}, name


def _report(seconds: float) -> ReceivedReport:
    body = b'{"trainerStatus": {"progressPercentage": 10}}'
    return ReceivedReport("llm-node-0", parse_report(body), _at(seconds))


def test_the_last_progress_is_the_newest_report_figures_or_start_of_the_run_and_only_while_running() -> None:
    metrics = OperatorMetrics()
    name = "gpuop_training_last_progress_timestamp_seconds"
    silent = _running("llm", gpus=1, hours=0.0, counted=0)  # Running since 0, nothing sent yet
    _tick(metrics, 100, silent)
    assert _value(metrics, name, namespace="team-a", gputraining="llm") == _at(0).timestamp()
    scraped = _running("llm", gpus=1, hours=0.0, counted=0, progress={"step": 5, "updatedAt": _stamp(200)})
    _tick(metrics, 300, scraped)
    assert _value(metrics, name, namespace="team-a", gputraining="llm") == _at(200).timestamp()
    scraped.reports = (_report(250), _report(280))  # the same figures again, but it is alive
    _tick(metrics, 300, scraped)
    assert _value(metrics, name, namespace="team-a", gputraining="llm") == _at(280).timestamp()
    _tick(metrics, 400, _training("llm", phase="Succeeded", progress={"updatedAt": _stamp(390)}))
    assert _series(metrics, name) == {}


def test_the_reconcilers_tick_sets_them_while_it_leads(toy: ToyJobApi) -> None:
    """Through the real Reconciler and a toy job API: a running job's training is counted by
    phase, shown per training and billed as the clock runs; a standby (not leading) shows none
    of it, and keeps the GPU-hours already counted."""
    store = Store()
    body = minimal(workers=2, gpusPerWorker=4)
    body["metadata"] |= {"name": "t", "namespace": "team-a", "uid": "u-1", "generation": 1}
    store.trainings[("team-a", "t")] = store._stamp(copy.deepcopy(body))
    now = [T0]
    leading = [True]
    metrics = OperatorMetrics()
    reconciler = Reconciler(
        store,  # type: ignore[arg-type]
        OperatorSettings(),
        metrics,
        clock=lambda: now[0],
        leading=lambda: leading[0],
    )
    try:
        reconciler.training_event("ADDED", store.get_training("team-a", "t") or {})
        reconciler.run_pending()
        job = store.job()
        job["status"] = {"state": "Running", "began": _stamp(0)}
        reconciler.job_event("MODIFIED", store._stamp(copy.deepcopy(job)))
        reconciler.run_pending()
        reconciler.tick()
        reconciler.run_pending()
        assert _value(metrics, "gpuop_trainings", namespace="team-a", phase="Running") == 1
        phase = _value(metrics, "gpuop_training_phase", namespace="team-a", gputraining="t", phase="Running")
        assert phase == 1
        assert _value(metrics, "gpuop_gpu_hours_total", namespace="team-a") == 0
        now[0] = _at(1800)
        reconciler.tick()
        reconciler.run_pending()
        # 8 GPUs x 30 min
        assert _value(metrics, "gpuop_gpu_hours_total", namespace="team-a") == pytest.approx(4.0)
        leading[0] = False
        reconciler.tick()
        reconciler.run_pending()
        assert _series(metrics, "gpuop_trainings") == {}
        assert _series(metrics, "gpuop_training_phase") == {}
        assert _value(metrics, "gpuop_gpu_hours_total", namespace="team-a") == pytest.approx(4.0)
    finally:
        reconciler.close()
