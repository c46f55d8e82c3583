"""The compile cache beside a training's checkpoints, through real trainer starts on the CPU.

``compile: true`` forces the compile here (auto never compiles on a CPU). One cold compile
writes the entry; later starts get a copy of it in checkpoint directories of their own, and
each start has an Inductor cache directory of its own unless it says otherwise, so a hit can
only come from the entry. The CNN on scikit-learn's digits in batches of 479, a third of the
1,437 training images: no smaller last batch, so one compile a start (about 25 s cold on 2
cores), and three steps that take well under a second.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpuop.api.spec import parse
from gpuop.local.runner import LocalRun, plan
from gputrain.compiling import CACHE_DIR
from support.specs import minimal
from support.training import finish, log_of, start


@dataclass(frozen=True)
class Start:
    run: LocalRun
    code: int
    inductor: Path  # the Inductor cache directory it used

    @property
    def log(self) -> str:
        return log_of(self.run)

    @property
    def result(self) -> dict[str, object]:
        record: dict[str, object] = json.loads(self.run.termination_log.read_text())
        return record

    @property
    def cache(self) -> Path:
        return self.run.checkpoint_dir / CACHE_DIR


def compiled_start(workdir: Path, *, cache_from: Path | None = None, inductor: Path | None = None) -> Start:
    """A one-rank start with compile: true, the cache entry in ``cache_from`` copied in first."""
    body = minimal(
        workers=1,
        gpusPerWorker=0,
        model={"name": "cnn"},
        dataset={"name": "digits", "loaderWorkers": 0},
        training={"epochs": 1, "batchSize": 479, "precision": "fp32", "compile": True, "logEverySteps": 1},
        checkpoint={"everySteps": 10**6},
    )
    run = plan(parse(body), 1, workdir)
    if cache_from is not None:
        shutil.copytree(cache_from, run.checkpoint_dir / CACHE_DIR)
    inductor = inductor or workdir / "inductor"
    process = start(run, extra_env={"TORCHINDUCTOR_CACHE_DIR": str(inductor)})
    return Start(run, finish(run, process, timeout=300), inductor)


@pytest.fixture(scope="module")
def cold(tmp_path_factory: pytest.TempPathFactory) -> Start:
    return compiled_start(tmp_path_factory.mktemp("cold"))


def test_the_first_start_compiles_and_writes_the_entry(cold: Start) -> None:
    assert cold.code == 0, cold.log
    assert "compile: compiled, cache miss (forced by compile: true)" in cold.log
    assert "compile cache: entry written to" in cold.log
    assert cold.result["compile"] == "CompiledCacheMiss"
    manifests = list(cold.cache.glob("*.json"))
    assert len(manifests) == 1, list(cold.cache.iterdir())
    manifest = json.loads(manifests[0].read_text())
    blob = cold.cache / manifest["blob"]
    assert blob.stat().st_size == manifest["size"] > 0
    assert manifest["key"]["model"] == "cnn"
    assert manifest["key"]["precision"] == "fp32"


def test_a_later_start_loads_the_entry(cold: Start, tmp_path: Path) -> None:
    assert cold.code == 0, cold.log
    later = compiled_start(tmp_path, cache_from=cold.cache)
    assert later.code == 0, later.log
    assert "compile: compiled, cache hit (forced by compile: true)" in later.log
    assert later.result["compile"] == "CompiledCacheHit"
    # Nothing new was compiled: the entry it loaded stays as it was.
    assert sorted(p.name for p in later.cache.iterdir()) == sorted(p.name for p in cold.cache.iterdir())


def test_a_corrupt_entry_is_ignored_with_one_line_and_the_run_succeeds(cold: Start, tmp_path: Path) -> None:
    assert cold.code == 0, cold.log
    workdir = tmp_path / "flipped"
    # The cold start's Inductor cache, so that the compile after the skip is quick: the entry
    # is what this test is about, and it is judged before Inductor's caches are consulted.
    copy = tmp_path / "copy"
    shutil.copytree(cold.cache, copy)
    blob = next(copy.glob("*.bin"))
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x01
    blob.write_bytes(bytes(data))
    flipped = compiled_start(workdir, cache_from=copy, inductor=cold.inductor)
    assert flipped.code == 0, flipped.log
    ignored = [
        line for line in flipped.log.splitlines() if "compile cache: entry" in line and "ignored" in line
    ]
    assert len(ignored) == 1, flipped.log
    assert "SHA-256 differs from its manifest's" in ignored[0]
    assert "compile: compiled, cache miss" in flipped.log
    assert flipped.result["compile"] == "CompiledCacheMiss"
    # The miss wrote a good entry over it: its manifest names a blob that matches.
    manifest = json.loads(next(flipped.cache.glob("*.json")).read_text())
    assert (flipped.cache / manifest["blob"]).stat().st_size == manifest["size"]
    assert not (flipped.cache / blob.name).exists()
