"""Checkpoints in a bucket of a real S3-compatible store (SeaweedFS, :mod:`support.objectstore`):
the same promises as on a volume (complete or invisible, the newest K kept, a corrupt one set
aside, the newest complete one never pruned), the faults a store has (503s, slowness, wrong
credentials, a missing bucket), a real run preempted and resumed from the bucket, and a run's
outputs uploaded to a bucket when it ends (spec.output.uri)."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml

from gputrain.checkpoint import CheckpointManager
from gputrain.storage import StorageError, _advice, open_location
from support import objectstore
from support.training import (
    digits_run,
    finish,
    hold_dir,
    hold_env,
    log_of,
    release,
    start,
    start_gpuop_run,
    train,
    wait_for_step,
    wait_held,
)

BUCKET = "checkpoints"


@pytest.fixture
def uri(s3: objectstore.S3Server, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """A prefix of this test's own in the session's bucket, the store's credentials in the
    environment as a pod's Secret would put them there."""
    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    return f"s3://{BUCKET}/{re.sub(r'[^a-zA-Z0-9-]', '-', request.node.name)}"


def _names(uri: str) -> list[str]:
    return sorted(open_location(uri).names())


def test_a_bucket_keeps_the_newest_k_complete_checkpoints_and_loads_the_newest(uri: str) -> None:
    manager = CheckpointManager(uri, keep=2)
    for step in (5, 10, 15):
        manager.save({"step": step, "w": torch.full((3,), float(step))}, step)
    assert [s.step for s in manager.checkpoints()] == [10, 15]
    states = [s.name for s in manager.checkpoints()]
    assert _names(uri) == sorted(["step-00000010.json", "step-00000015.json", *states])
    found = CheckpointManager(uri, keep=2).load_latest()  # a new process, as a restarted pod
    assert found is not None
    state, saved = found
    assert state["step"] == 15
    assert saved.uri == f"{uri}/{states[-1]}"
    assert saved.time is not None
    manifest = json.loads(open_location(uri).read("step-00000015.json"))
    assert (manifest["state"], manifest["size"]) == (states[-1], len(open_location(uri).read(states[-1])))


def test_a_save_cut_before_its_manifest_is_invisible_and_goes_once_a_newer_one_is_complete(uri: str) -> None:
    manager = CheckpointManager(uri, keep=1)
    manager.save({"step": 10}, 10)
    # What a SIGKILL between the state's upload and the manifest's leaves: a whole state object
    # (S3 publishes an object at once) that no manifest vouches for.
    open_location(uri).write("step-00000020-0badcafe.pt", b"a state whose manifest never came")
    assert [s.step for s in manager.checkpoints()] == [10]
    found = manager.load_latest()
    assert found is not None
    assert found[0]["step"] == 10
    newest = manager.save({"step": 30}, 30)
    assert _names(uri) == sorted(["step-00000030.json", newest.name])


def test_keep_1_never_prunes_the_checkpoint_just_written_for_a_newer_save_in_progress(uri: str) -> None:
    manager = CheckpointManager(uri, keep=1)
    open_location(uri).write("step-00000500-0badcafe.pt", b"another writer's save, not finished")
    manager.save({"step": 30}, 30)
    assert [s.step for s in manager.checkpoints()] == [30]
    assert "step-00000500-0badcafe.pt" in _names(uri)  # newer: its manifest may still come


def test_a_corrupt_checkpoint_is_set_aside_with_a_warning_and_the_one_before_loads(
    uri: str, caplog: pytest.LogCaptureFixture
) -> None:
    manager = CheckpointManager(uri, keep=3)
    manager.save({"step": 1}, 1)
    newest = manager.save({"step": 2, "w": torch.randn(1000)}, 2)
    data = bytearray(open_location(uri).read(newest.name))
    data[len(data) // 2] ^= 0xFF  # one flipped byte: the size still matches, the hash does not
    open_location(uri).write(newest.name, bytes(data))
    with caplog.at_level(logging.WARNING):
        found = manager.load_latest()
    assert found is not None
    assert found[0]["step"] == 1
    assert f"checkpoint {newest.uri} is unreadable (its SHA-256 differs from its manifest's)" in caplog.text
    assert {newest.name + ".unreadable", "step-00000002.json.unreadable"} <= set(_names(uri))
    assert [s.step for s in manager.checkpoints()] == [1]


def test_a_store_answering_503_then_slowly_is_retried_until_the_checkpoint_is_complete(
    uri: str, s3: objectstore.S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy = objectstore.FaultyStore(s3.endpoint)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        manager = CheckpointManager(uri, keep=2)
        manager.save({"step": 1}, 1)
        proxy.fail_next(5)  # a store throttling: SlowDown, and again, ...
        saved = manager.save({"step": 2, "w": torch.randn(10_000)}, 2)  # retried until it goes through
        assert proxy.answered_503 > 0
        assert [s.step for s in manager.checkpoints()] == [1, 2]
        proxy.slow_next(2, delay=1.0)  # the next requests held a second each: slower, not failed
        started = time.monotonic()
        found = manager.load_latest()
        assert time.monotonic() - started >= 1.0
        assert found is not None
        assert (found[0]["step"], found[1]) == (2, saved)
    finally:
        proxy.close()


def test_a_run_trains_on_through_a_throttling_store_and_a_refused_save_leaving_only_complete_ones(
    tmp_path: Path, uri: str, s3: objectstore.S3Server
) -> None:
    """A real DDP run whose store, mid-run, answers 503 to three requests (the save is retried
    until it goes through) and then refuses a save's manifest (403: the save fails, a warning,
    and training goes on): it reaches Succeeded, and the bucket holds complete checkpoints only,
    the refused save's state pruned once a newer one was complete."""
    proxy = objectstore.FaultyStore(s3.endpoint)
    try:
        run = digits_run(tmp_path, epochs=2)
        env = {**s3.env(), "AWS_ENDPOINT_URL": proxy.endpoint, "GPUTRAIN_CHECKPOINT_DIR": uri}
        process = start(run, hold_at=15, extra_env=env)
        wait_for_step(run, process, 15)  # past the first save (step 10), before the next
        proxy.fail_next(3)
        proxy.refuse_puts(1, after=1)  # the next state goes through, its manifest is refused
        release(hold_dir(run))
        assert finish(run, process) == 0, log_of(run)
        assert (proxy.answered_503, proxy.refused) == (3, 1)
    finally:
        proxy.close()
    said = re.search(r"checkpoint at step (\d+) not saved: (.*); training goes on", log_of(run))
    assert said is not None, log_of(run)
    assert "access denied (AccessDenied)" in said.group(2), said.group(2)
    result = json.loads(run.termination_log.read_text())
    assert (result["phase"], result["step"]) == ("Succeeded", result["totalSteps"])
    names = _names(uri)
    complete = CheckpointManager(uri, keep=3).checkpoints()
    assert names == sorted(n for s in complete for n in (s.name, str(s.manifest))), names
    assert int(said.group(1)) not in [s.step for s in complete]
    assert complete[-1].step == result["step"]


def test_wrong_credentials_fail_in_one_line_that_names_the_uri_and_the_fix(
    uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(StorageError) as refused:
        CheckpointManager(uri, keep=1).load_latest()
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"{uri}: list failed: access denied")
    assert "spec.checkpoint.secretName" in message
    assert refused.value.refused  # no restart mends it: the operator stops the job (Result.permanent)


def test_a_missing_bucket_fails_in_one_line_that_names_it(uri: str) -> None:
    with pytest.raises(StorageError) as refused:
        CheckpointManager("s3://no-such-bucket/run", keep=1).save({"step": 1}, 1)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("s3://no-such-bucket/run: write step-00000001-")
    assert message.endswith(".pt failed: the bucket does not exist; create it or correct the URI")
    assert refused.value.refused


@pytest.fixture
def bucket_run_env(uri: str, s3: objectstore.S3Server) -> dict[str, str]:
    return {"GPUTRAIN_CHECKPOINT_DIR": uri, **s3.env()}


def test_a_preempted_run_resumes_from_the_bucket_in_an_empty_work_directory(
    tmp_path: Path, uri: str, bucket_run_env: dict[str, str]
) -> None:
    """SIGTERM as a preemption: the checkpoint goes to the bucket, and a run with nothing on its
    disk (another node) resumes from it and finishes."""
    first = digits_run(tmp_path / "first", epochs=2)
    process = start(first, hold_at=15, extra_env=bucket_run_env)
    wait_for_step(first, process, 15)
    process.send_signal(signal.SIGTERM)
    assert finish(first, process) != 0
    record = json.loads(first.termination_log.read_text())
    assert record["reason"] == "Preempted", record
    stopped_at = int(re.search(r"at step (\d+)", record["message"]).group(1))  # type: ignore[union-attr]
    assert f"step-{stopped_at:08d}.json" in _names(uri)

    second = digits_run(tmp_path / "second", epochs=2)
    assert train(second, extra_env=bucket_run_env) == 0, log_of(second)
    assert f"resumed from {uri}/step-{stopped_at:08d}-" in log_of(second)
    result = json.loads(second.termination_log.read_text())
    assert (result["phase"], result["step"]) == ("Succeeded", result["totalSteps"])


def test_the_outputs_go_to_the_bucket_when_the_run_ends(
    tmp_path: Path, uri: str, s3: objectstore.S3Server
) -> None:
    """spec.output.uri: the model, the history and the result, as written to the output
    directory, each whole in the bucket; the result last."""
    run = digits_run(tmp_path, workers=1, epochs=1)
    out = f"{uri}/out"
    assert train(run, extra_env={"GPUTRAIN_OUTPUT_URI": out, **s3.env()}) == 0, log_of(run)
    assert re.search(rf"outputs uploaded to {re.escape(out)} \(\d+\.\d\d s\)", log_of(run)), log_of(run)
    assert _names(out) == ["metrics.jsonl", "model.pt", "result.json"]
    store = open_location(out)
    for name in ("metrics.jsonl", "model.pt", "result.json"):
        assert store.read(name) == (run.output_dir / name).read_bytes(), name
    state = torch.load(io.BytesIO(store.read("model.pt")), weights_only=True)
    assert any(key.endswith("weight") for key in state)
    assert json.loads(store.read("result.json"))["phase"] == "Succeeded"


def test_an_output_store_that_refuses_fails_the_run_before_training_in_one_line(
    tmp_path: Path, s3: objectstore.S3Server
) -> None:
    """A missing bucket for the outputs is found before any step, not once the run is trained:
    every rank ends (two here), the trainer with exit 5 (torchrun, its parent, then 1) and the
    reason OutputStorageFailed."""
    run = digits_run(tmp_path, workers=2, epochs=1)
    code = train(run, extra_env={"GPUTRAIN_OUTPUT_URI": "s3://no-such-bucket/out/t", **s3.env()})
    assert code != 0, log_of(run)
    assert "exitcode  : 5" in log_of(run)
    assert " loss " not in log_of(run)  # no logging interval: nothing trained
    record = json.loads(run.termination_log.read_text())
    assert record["reason"] == "OutputStorageFailed", record
    assert record["message"] == (
        "s3://no-such-bucket/out/t: list failed: the bucket does not exist; create it or correct the URI; "
        "found before training (the outputs go there at the end)"
    )
    assert record["permanent"] is True  # a restart meets the same answer: the operator stops the job


def test_a_finished_run_applied_again_with_an_output_uri_uploads_without_training(
    tmp_path: Path, uri: str, s3: objectstore.S3Server
) -> None:
    """What a restart after a failed upload does (Kubeflow restarts the container): it resumes
    at the end, from the last checkpoint, and uploads; no step is trained again."""
    run = digits_run(tmp_path, workers=1, epochs=1)
    assert train(run) == 0, log_of(run)
    out = f"{uri}/out"
    assert train(run, extra_env={"GPUTRAIN_OUTPUT_URI": out, **s3.env()}) == 0, log_of(run)
    second = log_of(run).rsplit("resumed from ", 1)[1]
    assert f"outputs uploaded to {out}" in second
    assert " loss " not in second, second
    assert _names(out) == ["metrics.jsonl", "model.pt", "result.json"]


def _gpuop_run(
    tmp_path: Path, workdir: Path, uri: str, *extra: str, hold_at: int | None = None
) -> subprocess.Popen[str]:
    """`gpuop run` of a digits spec whose checkpoints are in the bucket at ``uri``."""
    body = {"apiVersion": "gpuop.io/v1alpha1", "kind": "GpuTraining", "metadata": {"name": "t"},
            "spec": {"workers": 2, "gpusPerWorker": 0, "dataset": {"name": "digits", "loaderWorkers": 0},
                     "training": {"epochs": 2, "batchSize": 32, "precision": "fp32", "logEverySteps": 5},
                     "checkpoint": {"uri": uri, "everySteps": 1000, "keep": 1}}}  # fmt: skip
    spec = tmp_path / "t.yaml"
    spec.write_text(yaml.safe_dump(body))
    hold = hold_env(tmp_path / "hold", hold_at) if hold_at is not None else {}
    return start_gpuop_run(spec, workdir, *extra, env=hold)


def test_gpuop_run_ctrl_c_then_a_run_in_an_empty_work_directory_resumes_from_the_bucket(
    tmp_path: Path, uri: str
) -> None:
    first = _gpuop_run(tmp_path, tmp_path / "laptop", uri, hold_at=15)
    wait_held(tmp_path / "hold", 2, lambda: first.poll() is None)
    os.killpg(first.pid, signal.SIGINT)
    out, err = first.communicate(timeout=120)
    assert first.returncode == 130, err
    condition = next(c for c in json.loads(out)["conditions"] if c["type"] == "Suspended")
    stopped_at = int(re.search(r"at step (\d+)", condition["message"]).group(1))  # type: ignore[union-attr]
    assert f"step-{stopped_at:08d}.json" in _names(f"{uri}/t")
    assert not (tmp_path / "laptop" / "t" / "checkpoints").exists()  # nothing of it on this disk

    again = _gpuop_run(tmp_path, tmp_path / "elsewhere", uri)  # another machine: an empty work directory
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err
    assert json.loads(out)["phase"] == "Succeeded"
    assert (
        f"resumed from {uri}/t/step-{stopped_at:08d}-"
        in (tmp_path / "elsewhere" / "t" / "trainer.log").read_text()
    )

    fresh = _gpuop_run(tmp_path, tmp_path / "elsewhere", uri, "--fresh")
    _, err = fresh.communicate(timeout=60)
    assert fresh.returncode == 2
    assert (
        "spec.checkpoint.uri: --fresh moves this machine's checkpoints aside and leaves a bucket's alone"
        in err
    )


@pytest.mark.parametrize(
    ("said", "refused"),
    [
        ("Generic S3 error: <Code>InvalidAccessKeyId</Code>", True),
        ("Generic S3 error: <Code>SignatureDoesNotMatch</Code>", True),
        ("Generic S3 error: 403 Forbidden", True),
        ("Generic S3 error: <Code>NoSuchBucket</Code>", True),
        ("Generic S3 error: 503 Service Unavailable, after 20 retries", False),
        ("Generic S3 error: error sending request: connection refused", False),
    ],
)
def test_a_store_refuses_only_on_an_answer_that_holds_until_someone_changes_something(
    said: str, refused: bool
) -> None:
    """What the operator stops a job for (StorageError.refused, then Result.permanent): access
    denied and a missing bucket; a store down or throttling past its retries may be back."""
    assert _advice(RuntimeError(said))[1] is refused
