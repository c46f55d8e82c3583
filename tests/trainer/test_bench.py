"""The benchmark scripts still run: their flow on a few steps here, not their figures.

They are run by hand on quiet or GPU machines, so a change to the trainer that breaks them
would otherwise surface only when someone needs a number.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

from gputrain.checkpoint import CheckpointManager
from gputrain.contract import Progress
from gputrain.metrics import GpuReading, MetricsServer
from support import objectstore
from support.node.process import processes_naming
from support.paths import ROOT

BENCH = ROOT / "bench"


def _load(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """A script as a module; its directory on the path, as ``python bench/<name>.py`` puts it."""
    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_benchmark_times_exactly_the_steps_it_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its flow on the CPU: every run restarts the epoch, so each row's trainer times ``--steps``
    real steps of its own between the other rows' runs; the common loop runs beside them, on the
    trainer's batches, without moving their positions."""
    bench = _load("gpu_throughput", monkeypatch)
    # The compiled row runs eager: its flow is the subject here, not a compile of 20 s on 2 cores.
    monkeypatch.setattr(torch, "compile", lambda module, **_: module)
    options = ["--model=cnn", "--precision=fp32", "--batch-size=8", "--steps=3", "--warmup=2", "--repeats=2"]
    report = bench.measure(bench.arguments(options), torch.device("cpu"))
    rows = report["rows"]
    assert list(rows) == ["default", "eager", "compiled"]
    assert {name: row["compile_mode"] for name, row in rows.items()} == {
        "default": "EagerOnCpu", "eager": "EagerForced", "compiled": "CompiledCacheMiss"
    }  # fmt: skip
    for row in rows.values():
        assert row["optimizer_steps_done"] == 2 + 2 * 3
        assert len(row["images_per_second"]) == 2
        assert all(rate > 0 for rate in row["images_per_second"])
        assert row["ratio_to_common_loop"] > 0
        # No NVML and no nvidia-smi here: no utilization, rather than a made-up 0.
        assert row["status_gpu_utilization_percent"] == []
        assert row["nvidia_smi_utilization_percent"] == []
    assert len(report["common_loop"]["images_per_second"]) == 2
    assert all(rate > 0 for rate in report["common_loop"]["images_per_second"])
    alone = bench.measure(
        bench.arguments([*options, "--no-common-loop", "--compile=off"]), torch.device("cpu")
    )
    assert list(alone["rows"]) == ["eager"]
    assert alone["common_loop"] is None
    assert alone["rows"]["eager"]["ratio_to_common_loop"] is None


def test_gpu_benchmark_alternates_the_compile_settings_beside_the_common_loop(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A round runs the common loop, then default, eager and compiled, each its own trainer with a
    compile cache of its own; each row's figures are its own runs', over the common loop's median."""
    bench = _load("gpu_throughput", monkeypatch)
    monkeypatch.setattr(torch, "compile", lambda module, **_: module)
    rates = {"common": [100, 300, 200], "default": [250, 150, 300], "eager": [100, 120, 110],
             "compiled": [400, 500, 300]}  # fmt: skip
    order: list[str] = []
    cache_dirs: dict[str, str] = {}

    def run(name: str) -> dict[str, Any]:
        rate = rates[name][order.count(name)]
        order.append(name)
        return {"rate": float(rate), "status": [rate / 10, rate / 5], "smi": [rate / 4]}

    def gputrain_run(trainer: Any, steps: int) -> dict[str, Any]:
        name = {None: "default", False: "eager", True: "compiled"}[trainer.settings.compile]
        cache_dirs[name] = trainer.settings.checkpoint_dir
        return run(name)

    monkeypatch.setattr(bench, "common_run", lambda loop, steps, batch_size: run("common"))
    monkeypatch.setattr(bench, "gputrain_run", gputrain_run)
    options = ["--model=cnn", "--precision=fp32", "--batch-size=4", "--steps=1", "--warmup=1", "--repeats=3"]
    report = bench.measure(bench.arguments(options), torch.device("cpu"))
    assert order == ["common", "default", "eager", "compiled"] * 3
    assert len(set(cache_dirs.values())) == 3
    assert report["common_loop"]["images_per_second"] == [100, 300, 200]
    assert report["common_loop"]["median_images_per_second"] == 200
    assert report["common_loop"]["nvidia_smi_utilization_percent"] == [25, 75, 50]
    rows = report["rows"]
    assert [(name, row["compile"], row["images_per_second"], row["median_images_per_second"],
             row["ratio_to_common_loop"]) for name, row in rows.items()] == [
        ("default", "auto", [250, 150, 300], 250, 1.25),
        ("eager", "off", [100, 120, 110], 110, 0.55),
        ("compiled", "on", [400, 500, 300], 400, 2.0),
    ]  # fmt: skip
    assert rows["eager"]["status_gpu_utilization_percent"] == [15, 18, 16.5]
    assert rows["eager"]["status_gpu_utilization_lowest"] == 10
    assert rows["compiled"]["nvidia_smi_utilization_lowest"] == 75
    # The text: a line a row, in the order they ran.
    monkeypatch.setattr(bench, "measure", lambda args, device: report)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(sys, "argv", ["gpu_throughput.py"])
    bench.main()
    lines = capsys.readouterr().out.splitlines()
    table = [line.split() for line in lines if line.split()[0] in ("common", "default", "eager", "compiled")]
    assert table[:4] == [
        ["common", "loop", "200.0", "[100.0,", "300.0,", "200.0]"],
        ["default", "250.0", "[250.0,", "150.0,", "300.0]", "1.25", "auto", "(EagerOnCpu)"],
        ["eager", "110.0", "[100.0,", "120.0,", "110.0]", "0.55", "off", "(EagerForced)"],
        ["compiled", "400.0", "[400.0,", "500.0,", "300.0]", "2.0", "on", "(CompiledCacheMiss)"],
    ]
    assert bench.arguments(["--compile"]).compile == "on"  # as docs/benchmarks.md quotes it


def test_gpu_benchmark_reads_utilization_as_the_status_shows_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The figure is the trainer's endpoint read by the operator's own scrape and status code."""
    bench = _load("gpu_throughput", monkeypatch)
    reading = GpuReading(0, "NVIDIA H100 80GB HBM3", 73.0, 2**30, 80 * 2**30)
    with_gpu, without_gpu = MetricsServer(port=0), MetricsServer(port=0)
    try:
        assert with_gpu.port is not None
        assert without_gpu.port is not None
        with_gpu.update(Progress(step=1), gpus=[reading])
        assert bench.status_utilization(with_gpu.port) == 73.0
        without_gpu.update(Progress(step=1), gpus=[])  # no NVML: the status has no figure, not 0
        assert bench.status_utilization(without_gpu.port) is None
    finally:
        with_gpu.close()
        without_gpu.close()
    assert bench.status_utilization(with_gpu.port) is None  # the endpoint gone


def test_gpu_benchmark_samples_nvidia_smi(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """It asks nvidia-smi for the first visible GPU's utilization in a loop (the flags checked on
    an H100's nvidia-smi, docs/benchmarks.md), keeps the numbers, skips "[N/A]", and ends it."""
    bench = _load("gpu_throughput", monkeypatch)
    argv = tmp_path / "argv"
    fake = tmp_path / "nvidia-smi"
    fake.write_text(f'#!/bin/sh\necho "$@" > {argv}\nprintf "87\\n[N/A]\\n91\\n"\nexec sleep 60\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    with bench.NvidiaSmi() as smi:
        deadline = time.monotonic() + 10
        while len(smi.samples) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert smi.samples == [87.0, 91.0]
    assert smi.returncode == -signal.SIGTERM  # ended with the run, not left sampling
    assert argv.read_text().split() == [
        "--id=3", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "--loop-ms=100"
    ]  # fmt: skip


def test_first_step_benchmark_times_fresh_trainers_and_leaves_nothing_running(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Real trainers, eager (a compiled start costs a minute on 2 cores; that a second start
    reads the cache the first wrote is tests/trainer/test_compile_cache.py's): each row's start
    says the mode its setting gives. And nothing is left running: torchrun starts its rank in a
    session of its own, and killing torchrun's group alone left the rank training on while the
    next start was timed."""
    bench = _load("first_step", monkeypatch)
    report = bench.measure(bench.arguments(["--gpus=0", "--repeats=1", "--rows=default,eager"]))
    assert report["model"] == "cnn"
    assert {name: row["compile_modes"] for name, row in report["rows"].items()} == {
        "default": ["EagerOnCpu"], "eager": ["EagerForced"]
    }  # fmt: skip
    for row in report["rows"].values():
        (up,) = row["endpoint_up_seconds"]
        (first,) = row["first_step_seconds"]
        assert 0 < up <= first < 120
    assert processes_naming("first-step/termination-log") == {}  # the rank's own command line


# What the fake starts of the tests below report, per row and round.
FAKE_STARTS: dict[str, dict[str, list[Any]]] = {
    "default": {
        "endpoint_up": [2, 3, 1],
        "first_step": [6, 9, 7],
        "compile": ["EagerOnCpu", None, "EagerOnCpu"],
    },
    "eager": {"endpoint_up": [2, 2, 2], "first_step": [5, 4, 8], "compile": ["EagerForced"] * 3},
    "cold": {"endpoint_up": [3, 1, 2], "first_step": [60, 80, 70], "compile": ["CompiledCacheMiss"] * 3},
    "warm": {"endpoint_up": [1, 2, 3], "first_step": [35, 28, 40], "compile": ["CompiledCacheHit"] * 3},
}


def _fake_starts(bench: ModuleType, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Starts that record what they were given and leave what a trainer leaves: Inductor's files,
    a checkpoint, and for a cold start an entry of the compile cache naming its round."""
    starts: list[dict[str, Any]] = []

    def one_start(run: Any, timeout: float) -> dict[str, Any]:
        round_name, row = run.workdir.parent.name, run.workdir.name
        cache = run.checkpoint_dir / bench.CACHE_DIR
        found = sorted(str(p.relative_to(run.workdir)) for p in run.workdir.rglob("*") if p.is_file())
        given = {p.name: p.read_text() for p in cache.iterdir()} if cache.is_dir() else {}
        starts.append({"round": round_name, "row": row, "compile": run.training.spec.training.compile,
                       "workdir": run.workdir, "found": found, "cache": given})  # fmt: skip
        (run.workdir / "inductor").mkdir(parents=True)
        (run.workdir / "inductor" / "kernel.so").write_text(row)
        cache.mkdir(parents=True, exist_ok=True)
        (run.checkpoint_dir / "step-1.pt").write_text(row)
        if row == "cold":
            (cache / "entry.json").write_text(round_name)
        index = int(round_name.removeprefix("round-")) - 1
        return {mark: values[index] for mark, values in FAKE_STARTS[row].items()}

    monkeypatch.setattr(bench, "one_start", one_start)
    return starts


def test_first_step_benchmark_alternates_the_rows_by_round(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each round starts default, eager, cold and warm, each in directories of its own; the warm
    start finds the compile cache its round's cold start wrote and nothing else of it."""
    bench = _load("first_step", monkeypatch)
    starts = _fake_starts(bench, monkeypatch)
    report = bench.measure(bench.arguments(["--gpus=0", "--repeats=3"]))
    assert [(s["round"], s["row"]) for s in starts] == [
        (f"round-{n}", row) for n in (1, 2, 3) for row in ("default", "eager", "cold", "warm")
    ]
    assert [s["compile"] for s in starts[:4]] == [None, False, True, True]
    assert len({s["workdir"] for s in starts}) == 12
    cache = "first-step/checkpoints/compile-cache/entry.json"
    assert [(s["found"], s["cache"]) for s in starts if s["row"] == "warm"] == [
        ([cache], {"entry.json": f"round-{n}"}) for n in (1, 2, 3)
    ]
    assert all(s["found"] == [] for s in starts if s["row"] != "warm")
    rows = report["rows"]
    assert [(name, row["label"], row["compile"]) for name, row in rows.items()] == [
        ("default", "default", None), ("eager", "eager", False),
        ("cold", "compiled, cold cache", True), ("warm", "compiled, warm cache", True),
    ]  # fmt: skip
    assert rows["default"]["compile_modes"] == ["EagerOnCpu", None, "EagerOnCpu"]
    assert rows["default"]["first_step_seconds"] == [6, 9, 7]
    assert rows["default"]["median_first_step_seconds"] == 7
    assert rows["default"]["median_endpoint_up_seconds"] == 2
    assert rows["cold"]["median_first_step_seconds"] == 70
    assert rows["warm"]["median_endpoint_up_seconds"] == 2
    assert report["first_step_ratios"] == {"warm_to_cold": 0.5, "default_to_eager": 1.4}
    monkeypatch.setattr(sys, "argv", ["first_step.py", "--gpus=0", "--repeats=3", "--json"])
    bench.main()
    assert json.loads(capsys.readouterr().out) == report
    monkeypatch.setattr(sys, "argv", ["first_step.py", "--gpus=0", "--repeats=3"])
    bench.main()
    lines = capsys.readouterr().out.splitlines()
    assert lines[3:] == [
        "  default               2.00 [2.00, 3.00, 1.00]       7.00 [6.00, 9.00, 7.00]       EagerOnCpu, undecided, EagerOnCpu",
        "  eager                 2.00 [2.00, 2.00, 2.00]       5.00 [5.00, 4.00, 8.00]       EagerForced, EagerForced, EagerForced",
        "  compiled, cold cache  2.00 [3.00, 1.00, 2.00]       70.00 [60.00, 80.00, 70.00]   CompiledCacheMiss, CompiledCacheMiss, CompiledCacheMiss",
        "  compiled, warm cache  2.00 [1.00, 2.00, 3.00]       35.00 [35.00, 28.00, 40.00]   CompiledCacheHit, CompiledCacheHit, CompiledCacheHit",
        "  first step, ratio of the medians: warm / cold 0.5; default / eager 1.4",
    ]


def test_first_step_benchmark_measures_the_rows_named(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = _load("first_step", monkeypatch)
    starts = _fake_starts(bench, monkeypatch)
    report = bench.measure(bench.arguments(["--gpus=0", "--repeats=2", "--rows=eager,default"]))
    assert [(s["round"], s["row"]) for s in starts] == [
        ("round-1", "default"), ("round-1", "eager"), ("round-2", "default"), ("round-2", "eager")
    ]  # fmt: skip
    assert list(report["rows"]) == ["default", "eager"]
    assert report["first_step_ratios"] == {"warm_to_cold": None, "default_to_eager": 1.667}
    for rows, said in (("warm", "add cold"), ("eager,hot", "hot: name some of")):
        with pytest.raises(SystemExit):
            bench.arguments([f"--rows={rows}"])
        assert said in capsys.readouterr().err


def test_first_step_benchmark_reads_auto_s_choice_past_step_1(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Auto on a GPU says its mode after timed eager steps: the start is read on until it does,
    with step 1 timed when it came; a start that ends or times out undecided reports None."""
    bench = _load("first_step", monkeypatch)
    undecided, decided = (
        SimpleNamespace(step=1, compile=None),
        SimpleNamespace(step=3, compile="CompiledCacheHit"),
    )
    readings = [None, SimpleNamespace(step=0, compile=None), undecided, undecided]

    def scrape(port: int, timeout: float) -> Any:
        if readings:
            return readings.pop(0)
        time.sleep(0.5)  # the eager steps auto times, after step 1 was read
        return decided

    monkeypatch.setattr(bench, "scrape", scrape)
    sleeping = [sys.executable, "-c", "import sys, time; time.sleep(float(sys.argv[1]))"]
    monkeypatch.setattr(bench.LocalRun, "command", lambda self: [*sleeping, "60"])
    run = bench.training_run(bench.arguments(["--gpus=0"]), None, tmp_path)
    started = time.perf_counter()
    marks = bench.one_start(run, timeout=60)
    assert marks["compile"] == "CompiledCacheHit"
    assert time.perf_counter() - started - marks["first_step"] >= 0.5
    for command, timeout in (([*sleeping, "0.3"], 60), ([*sleeping, "60"], 0.5)):
        monkeypatch.setattr(bench, "scrape", lambda port, timeout: undecided)
        monkeypatch.setattr(bench.LocalRun, "command", lambda self, command=command: command)
        assert bench.one_start(run, timeout=timeout)["compile"] is None


def test_first_step_benchmark_names_a_trainer_that_exits_before_step_1(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bench = _load("first_step", monkeypatch)
    failing = [sys.executable, "-c", "import sys; print('no such model'); sys.exit(3)"]
    monkeypatch.setattr(bench.LocalRun, "command", lambda self: failing)
    with pytest.raises(SystemExit, match=r"^first_step: exit 3 before step 1:\nno such model\n$"):
        bench.measure(bench.arguments(["--gpus=0", "--repeats=1"]))


def test_first_step_benchmark_gives_up_at_its_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = _load("first_step", monkeypatch)
    with pytest.raises(SystemExit, match=r"^first_step: no step 1 in 0 s; log: .*trainer\.log$"):
        bench.measure(bench.arguments(["--gpus=0", "--repeats=1", "--timeout=0.2"]))


def test_start_phases_benchmark_times_every_phase_of_a_fresh_process_in_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its flow on the CPU: one fresh child, every phase timed from before its start, in order."""
    bench = _load("start_phases", monkeypatch)
    report = bench.measure(bench.arguments(["--device=cpu", "--repeats=1", "--batch-size=4"]))
    assert report["model"] == "cnn"
    since = [report["seconds_since_start"][phase] for phase in bench.PHASES]
    assert all(len(values) == 1 for values in since)
    marks = [values[0] for values in since]
    assert marks[0] >= 0
    assert marks == sorted(marks)
    assert marks[-1] < 120
    assert list(report["median_phase_seconds"]) == list(bench.PHASES)
    assert all(seconds >= 0 for seconds in report["median_phase_seconds"].values())


def test_gpu_benchmark_refuses_to_run_without_a_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here")
    done = subprocess.run(
        [sys.executable, BENCH / "gpu_throughput.py"], capture_output=True, text=True, check=False
    )
    assert done.returncode == 1
    assert done.stderr.strip() == "gpu_throughput: no CUDA GPU is visible here; this benchmark measures one"


def test_cpu_benchmark_reports_both_loops_and_the_convolution_ceiling() -> None:
    done = subprocess.run(
        [sys.executable, BENCH / "trainer_throughput.py", "--steps", "5", "--repeats", "1", "--json"],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert set(report["median"]) == {"baseline", "gputrain"}
    assert all(v > 0 for v in report["median"].values())
    ceiling = report["convolution_ceiling"]
    # The bounds at the precision gputrain ran (bf16 where this CPU computes it, else fp32).
    assert ceiling["precision"] == report["gputrain_settings"]["precision"]
    assert ceiling["conv_ms_per_step"] > 0
    assert ceiling["samples_per_second"] > 0
    alone = report["model_alone"]
    # The model alone runs the convolutions and more, so it is slower than the convolutions.
    assert alone["ms_per_step"] > ceiling["conv_ms_per_step"]
    assert 0 < alone["share_of_convolution_ceiling"] < 1
    assert alone["costliest_other_kernels_ms_per_step"]  # named, whichever they are on this machine
    # gputrain ran with the spec's defaults, as this machine runs them.
    assert report["gputrain_settings"]["channels_last"] is True
    assert report["gputrain_settings"]["max_grad_norm"] == 1.0


def test_checkpoint_store_benchmark_saves_and_loads_in_a_directory_and_a_bucket(
    s3: objectstore.S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bench = _load("checkpoint_store", monkeypatch)
    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    state = bench.trained_state("cnn")
    assert state["optimizer"]["state"]  # the moments are there: one step was taken
    for where in (tmp_path / "volume", "s3://checkpoints/test-checkpoint-store-benchmark"):
        saving, loading, size = bench.timed(CheckpointManager(where, keep=1), state, 7)
        assert saving > 0
        assert loading > 0
        assert size > sum(t.numel() * t.element_size() for t in state["model"].values())
