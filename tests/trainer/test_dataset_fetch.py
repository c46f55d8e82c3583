"""The dataset step (spec.dataset.uri, gputrain.fetch) against the real S3 store
(:mod:`support.objectstore`): a prefix copied with its folders, a second copy that takes only what
changed, a copy cut short and resumed, a file that came wrong copied again, a missing bucket as
one line and exit code 6; and ``gpuop run`` training from a dataset it copied from the bucket."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from gputrain import fetch
from gputrain.storage import Bucket, StorageError
from support import datasets, objectstore
from support.training import GPUOP

BUCKET = "checkpoints"  # the session's bucket (support.fixtures.BUCKETS); each test its own prefix


@pytest.fixture
def prefix(s3: objectstore.S3Server, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """A prefix of this test's own, the store's credentials in the environment."""
    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    return f"datasets/{re.sub(r'[^a-zA-Z0-9-]', '-', request.node.name)}"


def _files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file() and p.name != fetch.JOURNAL}  # fmt: skip


def test_a_prefix_is_copied_whole_then_only_what_changed(
    s3: objectstore.S3Server, prefix: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    files = {"train/cat/1.jpg": b"c1" * 1000, "train/dog/1.jpg": b"d1" * 3000, "val/cat/2.jpg": b"c2",
             "labels.txt": b"cat\ndog\n"}  # fmt: skip
    s3.put(BUCKET, {f"{prefix}/{name}": data for name, data in files.items()})
    # Folder markers, as the S3 console's "Create folder" and Hadoop make them: not files.
    s3.put(BUCKET, {f"{prefix}/train/": b"", f"{prefix}/train/cat/": b"", f"{prefix}/": b""})
    uri, target = f"s3://{BUCKET}/{prefix}", tmp_path / "data"
    with caplog.at_level(logging.INFO, logger="gputrain.fetch"):
        first = fetch.fetch(uri, target, concurrency=2, every=0)
    assert (first.objects, first.copied, first.bytes_total) == (4, 4, sum(map(len, files.values())))
    assert _files(target) == files
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == f"fetching {uri} into {target}: 4 objects, 7.8 KiB (0 there already)"
    assert re.fullmatch(r"fetched 4/4 objects, 7\.8 KiB of 7\.8 KiB \(100%\), [\d.]+ \w+/s", lines[-1]), lines
    # Upstream: one changed, one removed, one added. The copy follows, taking only those.
    s3.put(BUCKET, {f"{prefix}/val/cat/2.jpg": b"changed", f"{prefix}/val/dog/3.jpg": b"new"})
    Bucket(uri).delete("labels.txt")
    second = fetch.fetch(uri, target, every=0)
    assert (second.objects, second.copied) == (4, 2)
    assert _files(target) == {**{k: v for k, v in files.items() if k != "labels.txt"},
                              "val/cat/2.jpg": b"changed", "val/dog/3.jpg": b"new"}  # fmt: skip
    assert fetch.fetch(uri, target, every=0).copied == 0


def test_a_copy_cut_short_resumes_and_a_file_that_came_wrong_is_copied_again(
    s3: objectstore.S3Server, prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step killed midway leaves what it finished recorded (and a half file never: each lands
    whole); a file whose bytes do not match its size or its S3 ETag (an MD5) is copied again."""
    files = {f"part-{i}.bin": bytes([i]) * (1000 + i) for i in range(6)}
    s3.put(BUCKET, {f"{prefix}/{name}": data for name, data in files.items()})
    uri, target = f"s3://{BUCKET}/{prefix}", tmp_path / "data"
    real = Bucket.download
    calls: list[str] = []

    def cut_after_three(self: Bucket, name: str, path: Path, arrived: Any = None) -> str:
        if len(calls) == 3:
            raise KeyboardInterrupt  # what a SIGKILL's effect on the remaining copies amounts to
        calls.append(name)
        return real(self, name, path, arrived)

    monkeypatch.setattr(Bucket, "download", cut_after_three)
    with pytest.raises(KeyboardInterrupt):
        fetch.fetch(uri, target, concurrency=1, every=0)
    journal = (target / fetch.JOURNAL).read_text().splitlines()
    assert sorted(json.loads(line)["name"] for line in journal) == sorted(calls)
    monkeypatch.setattr(Bucket, "download", real)
    assert fetch.fetch(uri, target, every=0).copied == 3
    assert _files(target) == files

    # Bytes that are not the object's (a proxy that mangled them, a disk that lied), once: the
    # MD5 against S3's ETag tells, and the object is copied again.
    (target / "part-0.bin").unlink()
    mangled: list[str] = []

    def mangled_once(self: Bucket, name: str, path: Path, arrived: Any = None) -> str:
        md5 = real(self, name, path, arrived)
        if not mangled:
            mangled.append(name)
            path.write_bytes(b"y" * path.stat().st_size)
            return "0" * 32
        return md5

    monkeypatch.setattr(Bucket, "download", mangled_once)
    assert fetch.fetch(uri, target, every=0).copied == 1
    assert mangled == ["part-0.bin"]
    assert _files(target) == files

    # An ETag that is no MD5 (S3 with SSE-KMS): the same bytes twice are the object's.
    (target / "part-1.bin").unlink()
    monkeypatch.setattr(
        Bucket, "download", lambda self, name, path, arrived=None: (real(self, name, path), "f" * 32)[1]
    )
    assert fetch.fetch(uri, target, every=0).copied == 1
    assert _files(target) == files
    # Different bytes each time: the step fails, in one line, the file not left there.
    (target / "part-2.bin").unlink()
    answers = iter(["1" * 32, "2" * 32])
    monkeypatch.setattr(
        Bucket, "download", lambda self, name, path, arrived=None: (real(self, name, path), next(answers))[1]
    )
    with pytest.raises(
        StorageError, match=r"part-2\.bin: its MD5 is 2{32}, its ETag says [0-9a-f]{32} \(twice\)"
    ):
        fetch.fetch(uri, target, every=0)
    assert not (target / "part-2.bin").exists()


def test_a_missing_bucket_is_one_line_and_exit_code_6(s3: objectstore.S3Server, tmp_path: Path) -> None:
    record = tmp_path / "term"
    done = subprocess.run(
        [sys.executable, "-m", "gputrain.fetch", "s3://no-such-bucket/data", str(tmp_path / "data"),
         f"--termination-log={record}"],
        env={**s3.env(), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 6, done.stdout + done.stderr
    said = json.loads(record.read_text())
    assert said["reason"] == "DatasetFetchFailed"
    assert said["permanent"] is True  # the operator stops the job rather than let the step retry
    assert (
        said["message"]
        == "s3://no-such-bucket/data: list failed: the bucket does not exist; create it or correct the URI"
    )
    assert said["message"] in done.stdout
    assert "Traceback" not in done.stdout + done.stderr


def test_gpuop_run_trains_on_a_dataset_it_copied_from_the_bucket(
    s3: objectstore.S3Server, prefix: str, tmp_path: Path
) -> None:
    """A small MNIST (support.datasets) in the bucket, spec.dataset.uri naming it: `gpuop run`
    copies it into its work directory, as a pod's dataset step does, and trains on it to
    Succeeded; a second run (--fresh) copies nothing."""
    s3.put(
        BUCKET, {f"{prefix}/{name}": data for name, data in datasets.mnist_files(train=256, test=64).items()}
    )
    spec = {"apiVersion": "gpuop.io/v1alpha1", "kind": "GpuTraining", "metadata": {"name": "fetched"},
            "spec": {"workers": 1, "gpusPerWorker": 0, "model": {"name": "cnn"},
                     "dataset": {"name": "mnist", "uri": f"s3://{BUCKET}/{prefix}", "loaderWorkers": 0},
                     "training": {"epochs": 1, "batchSize": 32, "precision": "fp32", "logEverySteps": 2}}}  # fmt: skip
    path = tmp_path / "fetched.yaml"
    path.write_text(yaml.safe_dump(spec))
    work = tmp_path / "work"
    for again in ((), ("--fresh",)):  # --fresh starts the training over; the copy stays
        done = subprocess.run([str(GPUOP), "run", "-f", str(path), "--workdir", str(work), "-o", "json", *again],
                              capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        assert json.loads(done.stdout)["phase"] == "Succeeded"
    copied = work / "fetched" / "data"
    assert sorted(p.name for p in copied.iterdir() if p.name != fetch.JOURNAL) == sorted(datasets.MNIST_NAMES)
    log = "".join(p.read_text() for p in sorted((work / "fetched").glob("trainer*.log")))
    assert log.count("fetched 4 objects (4 copied") == 1
    assert log.count("fetched 4 objects (0 copied") == 1
