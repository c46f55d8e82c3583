"""The gpuop command line: output, and one clear line per problem for bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuop.cli import documents
from gpuop.cli.commands import main
from support.cost import thread_seconds
from support.paths import ROOT
from support.specs import minimal

GOOD = """\
apiVersion: gpuop.io/v1alpha1
kind: GpuTraining
metadata:
  name: {name}
spec:
  workers: 2
  dataset:
    name: digits
"""
# With its model kept on a claim: nothing to warn of.
KEPT = GOOD + "  output:\n    volume:\n      claimName: models\n"


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def write(tmp_path: Path, text: str, name: str = "job.yaml") -> str:
    path = tmp_path / name
    path.write_bytes(text.encode("utf-8", "surrogateescape"))  # a lone surrogate: a byte that is not UTF-8
    return str(path)


def test_render_prints_a_pytorchjob(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, err = run(capsys, "render", "-f", write(tmp_path, KEPT.format(name="a")))
    assert (code, err) == (0, "")
    job = yaml.safe_load(out)
    assert (job["kind"], job["metadata"]["name"]) == ("PyTorchJob", "a")


def test_render_multi_document_yaml_and_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = write(tmp_path, GOOD.format(name="a") + "---\n" + GOOD.format(name="b") + "---\n")
    code, out, _ = run(capsys, "render", "-f", path)
    assert code == 0
    assert [d["metadata"]["name"] for d in yaml.safe_load_all(out)] == ["a", "b"]
    code, out, _ = run(capsys, "render", "-f", path, "-o", "json")
    listing = json.loads(out)
    assert (listing["kind"], [i["metadata"]["name"] for i in listing["items"]]) == ("List", ["a", "b"])
    code, out, _ = run(capsys, "render", "-f", write(tmp_path, GOOD.format(name="c"), "c.yaml"), "-o", "json")
    assert json.loads(out)["metadata"]["name"] == "c"


def test_render_several_files_and_an_image(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    a = write(tmp_path, GOOD.format(name="a"), "a.yaml")
    b = write(tmp_path, GOOD.format(name="b"), "b.yaml")
    code, out, _ = run(capsys, "render", "-f", a, "-f", b, "--image", "reg.local/t:1")
    jobs = list(yaml.safe_load_all(out))
    assert code == 0
    assert [j["metadata"]["name"] for j in jobs] == ["a", "b"]
    assert jobs[0]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["image"] == (
        "reg.local/t:1"
    )


def test_render_for_trainer_v2_prints_the_runtime_then_the_trainjob(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = write(tmp_path, KEPT.format(name="a"))
    code, out, err = run(capsys, "render", "-f", path, "--backend", "trainjob")
    assert (code, err) == (0, "")
    assert [(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(out)] == [
        ("TrainingRuntime", "a"),
        ("TrainJob", "a"),
    ]
    elastic = write(tmp_path, (ROOT / "examples" / "kind-cpu-elastic.yaml").read_text(), "e.yaml")
    code, out, err = run(capsys, "render", "-f", elastic, "--backend", "trainjob")
    assert (code, out) == (2, "")
    assert err.startswith(f"error: {elastic}:")
    assert "spec.elastic: cannot be used with backend trainjob" in err
    assert len(err.strip().splitlines()) == 1


def test_validate(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = write(tmp_path, KEPT.format(name="a"))
    assert run(capsys, "validate", "-f", path) == (0, f"{path}: gputraining/a is valid\n", "")


def test_crd_prints_and_checks(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, _ = run(capsys, "crd")
    assert code == 0
    assert out == (ROOT / "crds" / "gputraining.yaml").read_text()
    stale = write(tmp_path, out.replace("Passes over the training set.", "Epochs."), "crd.yaml")
    code, out, err = run(capsys, "crd", "--check", stale)
    assert code == 1
    assert "\n-" in out
    assert "description: Epochs." in out
    assert "is stale: run `make crds`" in err


BAD_INPUT = [
    (
        "schema violations with lines",
        """\
apiVersion: gpuop.io/v1alpha1
kind: GpuTraining
metadata:
  name: bad
spec:
  workers: 0
  gpusPerWorker: 0
  dataset: {name: digits}
  training:
    precision: fp16
    epochs: ten
  trainng: {}
""",
        [
            "{f}:6: spec.workers: must be >= 1 (got 0)",
            '{f}:11: spec.training.epochs: must be an integer (got "ten")',
            '{f}:12: spec.trainng: unknown field; did you mean "training"?',
        ],
    ),
    (
        "rule across fields",
        GOOD.format(name="x").replace(
            "  workers: 2\n", "  gpusPerWorker: 0\n  training: {precision: fp16}\n"
        ),
        ["{f}:7: spec.training.precision: fp16 needs GPUs (gpusPerWorker >= 1); use bf16 or fp32 on CPU"],
    ),
    (
        "second document",
        GOOD.format(name="ok") + "---\n" + GOOD.format(name="x").replace("workers: 2", "workers: -1"),
        ["{f}:15: spec.workers: must be >= 1 (got -1)"],
    ),
    (
        "missing required nested field",
        GOOD.format(name="x") + "  elastic:\n    minWorkers: 1\n",
        ["{f}:9: spec.elastic.maxWorkers: required"],
    ),
    (
        "wrong kind",
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n",
        [
            '{f}:1: apiVersion: must be gpuop.io/v1alpha1 (got "v1")',
            '{f}:2: kind: must be GpuTraining (got "ConfigMap")',
        ],
    ),
    (
        "yaml syntax",
        "spec:\n  workers: [1, 2\n",
        ["{f}:3: YAML syntax error: expected ',' or ']', but got '<stream end>'"],
    ),
    (
        "yaml tab",
        "spec:\n\tworkers: 1\n",
        ["{f}:2: YAML syntax error: found character '\\t' that cannot start any token"],
    ),
    ("empty file", "", ["{f}: no YAML documents in the file"]),
    (
        "a list, not an object",
        "- a\n- b\n",
        ["{f}:1: (document): must be a GpuTraining object (got a non-object)"],
    ),
    # Hostile or careless files: one line each, in bounded time (issue 15).
    (
        "a number as a key",
        GOOD.format(name="x") + "  nccl: {env: {1: a}}\n",
        ["{f}:9: a mapping key must be a string; YAML reads '1' as int: quote it"],
    ),
    (
        "a YAML 1.1 boolean as a key",
        GOOD.format(name="x") + "  nodeSelector: {yes: a, b: c}\n",
        ["{f}:9: a mapping key must be a string; YAML reads 'yes' as bool: quote it"],
    ),
    (
        "a duplicate key (the last one would win silently)",
        GOOD.format(name="x") + "  workers: 3\n",
        ["{f}:9: duplicate key 'workers'; give it once"],
    ),
    (
        "a duplicate key in JSON",
        '{"apiVersion": "gpuop.io/v1alpha1", "kind": "GpuTraining", "metadata": {"name": "a", "name": "b"}}',
        ["{f}:1: duplicate key 'name'; give it once"],
    ),
    (
        "10,000-deep nesting",
        "a: " + "[" * 10000 + "]" * 10000 + "\n",
        ["{f}:1: nested more than 64 levels deep"],
    ),
    (
        "a billion laughs",
        "a: &a ["
        + ",".join(["xxxxxxxxxx"] * 10)
        + "]\n"
        + "".join(
            f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}" if i > 1 else "*a"] * 10) + "]\n" for i in range(1, 9)
        ),
        ["{f}:5: aliases expand past 1048576 characters; write the values out"],
    ),
    ("not UTF-8", "spec: \udcff\n", ["{f}: not UTF-8 text (byte 6)"]),
    (
        "NaN and a negative size",
        GOOD.format(name="x") + "  training: {learningRate: .nan}\n  shmSize: -1Gi\n",
        [
            "{f}:9: spec.training.learningRate: must be a finite number (got nan)",
            '{f}:10: spec.shmSize: must not be negative (got "-1Gi")',
        ],
    ),
    (
        "args without command (they were dropped silently)",
        GOOD.format(name="x") + "  args: [--fast]\n",
        [
            "{f}:9: spec.args: needs spec.command: args are passed to your command (the built-in trainer takes none)"
        ],
    ),
    (
        "a name with a trailing newline (Python's $ matched it, Go's does not)",
        GOOD.format(name='"x\\n"'),
        [
            "{f}:4: metadata.name: must be a DNS-1035 label: lowercase letters, digits and '-', starting with "
            'a letter (got "x\\n")'
        ],
    ),
    ("an unknown top-level key", GOOD.format(name="x") + "bogus: 1\n", ["{f}:9: bogus: unknown field"]),
    (
        "bad name",
        GOOD.format(name="My_Job"),
        [
            "{f}:4: metadata.name: must be a DNS-1035 label: lowercase letters, "
            "digits and '-', starting with a letter (got \"My_Job\")"
        ],
    ),
]


@pytest.mark.parametrize(("text", "expected"), [c[1:] for c in BAD_INPUT], ids=[c[0] for c in BAD_INPUT])
@pytest.mark.parametrize("command", ["validate", "render"])
def test_bad_input_exits_2_with_one_line_per_problem(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, command: str, text: str, expected: list[str]
) -> None:
    path = write(tmp_path, text)
    code, out, err = run(capsys, command, "-f", path)
    assert code == 2
    assert out == ""
    assert err.splitlines() == ["error: " + line.format(f=path) for line in expected]


@pytest.mark.parametrize(("text", "expected"), [c[1:] for c in BAD_INPUT], ids=[c[0] for c in BAD_INPUT])
def test_each_bad_file_costs_under_a_second_and_100_mb(
    tmp_path: Path, text: str, expected: list[str]
) -> None:
    path = write(tmp_path, text)
    code, seconds = thread_seconds(lambda: main(["validate", "-f", path]))
    assert code == 2
    assert seconds < 1.0  # the slowest case measured 0.155 s; before the bounds, 98 s or a RecursionError
    tracemalloc.start()  # a second run, as tracing slows the first several times over
    try:
        assert main(["validate", "-f", path]) == 2
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 100 * 2**20


def test_what_is_not_a_manifest_file_is_refused_unread(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A FIFO would block at open, /dev/zero would be read until memory runs out, a 100 MB
    file took 98 s: each is one line, at once."""
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    big = tmp_path / "big.yaml"
    big.write_bytes(b"# " + b"x" * (documents.MAX_FILE_BYTES + 10) + b"\n")
    for path, line in [
        (str(fifo), f"error: {fifo}: not a regular file (a device, FIFO or socket); give a YAML file"),
        ("/dev/zero", "error: /dev/zero: not a regular file (a device, FIFO or socket); give a YAML file"),
        (str(big), f"error: {big}: {documents.MAX_FILE_BYTES + 13} bytes; a manifest may be at most 1048576"),
    ]:
        assert run(capsys, "validate", "-f", path) == (2, "", line + "\n")


def test_missing_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.yaml")
    assert run(capsys, "render", "-f", missing) == (2, "", f"error: {missing}: no such file\n")


def test_a_directory_is_read_as_kubectl_reads_it(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """-f DIR: its .yaml, .yml and .json files in name order, not its subdirectories."""
    code, _, err = run(capsys, "validate", "-f", str(tmp_path))
    assert code == 2
    assert err == f"error: {tmp_path}: a directory with no .yaml, .yml, .json files\n"
    write(tmp_path, KEPT.format(name="b"), "b.yml")
    write(tmp_path, KEPT.format(name="a"), "a.yaml")
    write(tmp_path, json.dumps(yaml.safe_load(KEPT.format(name="c"))), "c.json")
    write(tmp_path, "not a manifest", "README.md")
    (tmp_path / "nested").mkdir()
    write(tmp_path / "nested", KEPT.format(name="d"), "d.yaml")
    code, out, err = run(capsys, "render", "-f", str(tmp_path))
    assert (code, err) == (0, "")
    assert [j["metadata"]["name"] for j in yaml.safe_load_all(out)] == ["a", "b", "c"]


def test_problems_of_all_files_are_reported_together(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    good = write(tmp_path, GOOD.format(name="a"), "good.yaml")
    bad = write(tmp_path, GOOD.format(name="b").replace("workers: 2", "workers: 0"), "bad.yaml")
    missing = str(tmp_path / "missing.yaml")
    code, out, err = run(capsys, "render", "-f", bad, "-f", good, "-f", missing)
    assert (code, out) == (2, "")
    assert err.splitlines() == [
        f"error: {bad}:6: spec.workers: must be >= 1 (got 0)",
        f"error: {missing}: no such file",
    ]


def test_the_installed_command_reads_stdin_and_never_prints_a_traceback() -> None:
    gpuop = Path(sys.executable).parent / "gpuop"
    ok = subprocess.run(
        [gpuop, "render", "-f", "-"], input=GOOD.format(name="s"), capture_output=True, text=True, check=False
    )
    assert ok.returncode == 0
    assert yaml.safe_load(ok.stdout)["metadata"]["name"] == "s"
    bad = subprocess.run(
        [gpuop, "validate", "-f", "-"], input="kind: [", capture_output=True, text=True, check=False
    )
    assert bad.returncode == 2
    assert "Traceback" not in bad.stderr
    assert bad.stderr.startswith("error: <stdin>:1: YAML syntax error")


def test_run_refuses_a_gpu_spec_on_a_machine_without_enough_gpus(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpuop.local import runner

    monkeypatch.setattr(runner, "visible_gpus", lambda: 1)
    path = write(
        tmp_path, GOOD.format(name="g").replace("  workers: 2\n", "  workers: 2\n  gpusPerWorker: 4\n")
    )
    code, out, err = run(capsys, "run", "-f", path, "--workdir", str(tmp_path))
    assert (code, out) == (2, "")
    assert err == (
        f"error: {path}:7: spec.gpusPerWorker: 8 GPU(s) needed here (2 worker(s) x 4) but 1 visible; set "
        "gpusPerWorker: 0 to train on CPU (gloo), or lower --workers\n"
    )
    code, _, err = run(capsys, "run", "-f", path, "--workers", "0")
    assert (code, err) == (
        2,
        "error: Invalid value for '--workers': 0 is not in the range x>=1 (see `gpuop run --help`)\n",
    )


def test_run_takes_exactly_one_gputraining(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = write(tmp_path, GOOD.format(name="a") + "---\n" + GOOD.format(name="b"))
    code, _, err = run(capsys, "run", "-f", path)
    assert (code, err) == (2, f"error: {path}: run takes one GpuTraining; the file has 2\n")


def test_a_local_run_of_the_built_in_trainer_picks_no_port_for_its_workers_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The workers' own store would listen on a port torchrun picked and let go, which another
    process on the machine took first once (EADDRINUSE, a failed run); the built-in trainer
    shares torchrun's, keyed per attempt. A user's command keeps its own store, as its code
    may not key a restart's rendezvous apart."""
    from gpuop.api.spec import parse
    from gpuop.local.runner import plan

    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    built_in = parse(yaml.safe_load(GOOD.format(name="b")))
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in plan(built_in, None, tmp_path).environment()
    own = parse(yaml.safe_load(GOOD.format(name="o").replace("spec:\n", "spec:\n  command: [torchrun]\n", 1)))
    assert plan(own, None, tmp_path).environment()["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"


def test_a_local_gpu_run_sees_only_the_gpus_it_uses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpuop.api.spec import parse
    from gpuop.local.runner import plan

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    gpu = parse(
        yaml.safe_load(GOOD.format(name="g").replace("  workers: 2\n", "  workers: 2\n  gpusPerWorker: 2\n"))
    )
    assert plan(gpu, None, tmp_path).environment()["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    assert plan(gpu, 1, tmp_path).environment()["CUDA_VISIBLE_DEVICES"] == "0,1"
    cpu = parse(
        yaml.safe_load(GOOD.format(name="c").replace("  workers: 2\n", "  workers: 2\n  gpusPerWorker: 0\n"))
    )
    assert "CUDA_VISIBLE_DEVICES" not in plan(cpu, None, tmp_path).environment()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")  # the user's choice stands
    assert plan(gpu, 1, tmp_path).environment()["CUDA_VISIBLE_DEVICES"] == "5,7"


TORCHRUN_SUMMARY = """\
Failures:
[1]:
  time      : 2026-11-22_14:56:12
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 30691)  (SIGTERM)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-22_14:56:12
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 30692)  (SIGKILL)
"""


@pytest.mark.parametrize(
    ("log", "said"),
    [
        (TORCHRUN_SUMMARY, "rank 1 was killed by SIGKILL (the kernel's OOM killer sends it when memory runs out); "
                           "torchrun then stopped the others"),
        ("  rank      : 3 (local_rank: 1)\n  exitcode  : 1 (pid: 7)\n", "rank 3 exited with code 1; torchrun then "
                                                                          "stopped the others"),
        ("a log without torchrun's summary", None),
    ],
)  # fmt: skip
def test_which_rank_stopped_a_local_run_and_how(log: str, said: str | None) -> None:
    from gpuop.local.runner import stopped_rank

    assert stopped_rank(log) == said


@pytest.mark.parametrize(("asked_to_stop", "phase"), [(False, "Failed"), (True, "Suspended")])
def test_a_rank_that_torchrun_stopped_after_another_died_is_no_pause(
    tmp_path: Path, asked_to_stop: bool, phase: str
) -> None:
    """When one rank is SIGKILLed, torchrun SIGTERMs the others, and a survivor may checkpoint
    and record "Preempted" before its next collective fails. That record is a pause only if
    `gpuop run` passed a signal on; otherwise the run failed, for the dead rank's reason (the
    race made a clean-clone run exit 143, Suspended, for an OOM-killed rank)."""
    from datetime import UTC, datetime

    from gpuop.api.spec import parse
    from gpuop.local.runner import final_status, plan
    from gputrain.contract import Result

    training = parse(minimal())
    run = plan(training, 2, tmp_path)
    (tmp_path / training.name).mkdir(parents=True)
    (tmp_path / training.name / "trainer.log").write_text(TORCHRUN_SUMMARY)
    run.termination_log.write_text(
        Result(phase="Failed", reason="Preempted", message="stopped by SIGTERM").to_json()
    )
    now = datetime(2026, 11, 23, tzinfo=UTC)
    status = final_status(run, 143, None, now, now, asked_to_stop=asked_to_stop)
    assert status.phase == phase
    if phase == "Failed":
        failed = next(c for c in status.conditions if c.type == "Failed")
        assert failed.message.startswith("rank 1 was killed by SIGKILL"), failed.message


def test_version_has_one_home(capsys: pytest.CaptureFixture[str]) -> None:
    """`gpuop --version` says what pyproject.toml says (the chart's appVersion is checked
    against the same in tests/chart)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"gpuop {project['version']}\n"


def _options() -> list[tuple[str, Any]]:
    import click

    from gpuop.cli.commands import cli

    return [
        (name, param)
        for name, command in cli.commands.items()
        for param in command.params
        if isinstance(param, click.Option) and param.name != "help"
    ]


def test_every_option_reads_a_gpuop_variable_and_says_which(capsys: pytest.CaptureFixture[str]) -> None:
    """click's envvar on every option: `GPUOP_<COMMAND>_<OPTION>` unless the option names its own
    (the operator's, which the chart sets), always shown in --help."""
    for command, option in _options():
        assert option.show_envvar, (command, option.name)
        envvar = option.envvar or f"GPUOP_{command.upper()}_{option.name.upper()}"
        assert str(envvar).startswith("GPUOP_"), (command, option.name)
        assert main([command, "--help"]) == 0
        assert f"env var: {envvar}" in " ".join(capsys.readouterr().out.split()), (command, option.name)
    # The one that had none: -v of the operator.
    assert {o.name: o.envvar for c, o in _options() if c == "operator"}["verbose"] == "GPUOP_VERBOSE"


def test_an_option_from_its_variable(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setenv("GPUOP_RENDER_OUTPUT", "json")
    code, out, _ = run(capsys, "render", "-f", write(tmp_path, GOOD.format(name="a")))
    assert code == 0
    assert json.loads(out)["kind"] == "PyTorchJob"
    monkeypatch.setenv("GPUOP_RENDER_OUTPUT", "xml")
    code, _, err = run(capsys, "render", "-f", write(tmp_path, GOOD.format(name="a")))
    assert code == 2
    assert err.count("\n") == 1  # one line, naming the option and where its value came from
    assert "GPUOP_RENDER_OUTPUT" in err
    assert "'xml' is not one of 'yaml', 'json'" in err


def test_one_spelling_of_the_output_flag() -> None:
    outputs = {command: option.opts for command, option in _options() if option.name == "output"}
    assert set(outputs) == {"render", "run", "crd"}
    assert all(opts == ["-o", "--output"] for opts in outputs.values())
    assert not [o for _, o in _options() if o.name in ("json", "format")]


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_shell_completion_scripts(shell: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["completion", shell]) == 0
    script = capsys.readouterr().out
    assert "_GPUOP_COMPLETE" in script
    if shell == "bash":  # and bash itself reads it
        checked = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True, check=False)
        assert checked.returncode == 0, checked.stderr


def test_completion_completes_commands_and_choices() -> None:
    """What the shell gets back when it asks (the script calls gpuop with _GPUOP_COMPLETE set)."""
    env = {**os.environ, "_GPUOP_COMPLETE": "bash_complete", "COMP_WORDS": "gpuop re", "COMP_CWORD": "1"}
    done = subprocess.run([str(ROOT / ".venv" / "bin" / "gpuop")], env=env, capture_output=True, text=True,
                          timeout=60, check=False)  # fmt: skip
    assert "plain,render" in done.stdout.splitlines()
    env |= {"COMP_WORDS": "gpuop render -o ", "COMP_CWORD": "3"}
    done = subprocess.run([str(ROOT / ".venv" / "bin" / "gpuop")], env=env, capture_output=True, text=True,
                          timeout=60, check=False)  # fmt: skip
    assert done.stdout.splitlines() == ["plain,yaml", "plain,json"]


def test_a_model_that_would_be_lost_is_warned_of(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Valid, so exit 0, but said: without output.volume the trained model dies with the pod."""
    path = write(tmp_path, GOOD.format(name="a"))
    for command in ("validate", "render"):
        code, out, err = run(capsys, command, "-f", path)
        assert code == 0
        assert out
        assert err == (
            f"warning: {path}:5: spec.output.volume: not set: the trained model is written to an emptyDir and "
            "lost with the pod (only the result in the termination message stays); set output.volume.claimName "
            "or output.uri to keep it\n"
        )
