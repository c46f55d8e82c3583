"""Whether the trainer compiles (the auto rule), and the compile cache's entries, without
compiling: the rule is pure, and an entry is bytes in a location whatever torch makes of them."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from gpuop.api.spec import parse
from gpuop.backends.pod import trainer_settings
from gputrain.compiling import (
    CACHE_DIR,
    COLD_COMPILE_SECONDS,
    COMPILED_SPEEDUP,
    WARM_COMPILE_SECONDS,
    CompileCache,
    c_compiler,
    cache_key,
    digest,
    fixed_choice,
    pays,
)
from gputrain.contract import TrainerSettings
from support.specs import minimal


@pytest.mark.parametrize(
    ("setting", "device", "compiler", "mode"),
    [
        (True, "cpu", None, "CompiledCacheMiss"),  # forced: wherever asked, until an entry loads
        (True, "cuda", "/usr/bin/gcc", "CompiledCacheMiss"),
        (False, "cuda", "/usr/bin/gcc", "EagerForced"),
        (False, "cpu", None, "EagerForced"),
        (None, "cpu", "/usr/bin/gcc", "EagerOnCpu"),
        (None, "cuda", None, "EagerNoCompiler"),
        (None, "cuda", "/usr/bin/gcc", None),  # left to the steps: pays()
    ],
)
def test_what_the_settings_and_the_machine_decide_alone(
    setting: bool | None, device: str, compiler: str | None, mode: str | None
) -> None:
    assert fixed_choice(setting, device, compiler) == mode


@pytest.mark.parametrize(
    ("steps_left", "step_seconds", "warm", "compiles"),
    [
        # ResNet-50 bf16 b256 on an H100: 0.064 s a step eager, so 0.0183 s saved a step.
        (20_000, 0.064, False, True),  # a real run: 365 s saved against 45
        (2_000, 0.064, False, False),  # 36.6 s saved: under a cold compile
        (2_000, 0.064, True, True),  # over a warm one
        (500, 0.064, True, False),  # 9.1 s: under even a warm one
        (100, 1.0, False, False),  # slow steps, few of them: 28.6 s
        (1_000, 1.0, False, True),  # 286 s
        (0, 1.0, True, False),  # nothing left to save on
    ],
)
def test_the_auto_rule_compiles_when_the_steps_left_win_the_compile_back(
    steps_left: int, step_seconds: float, warm: bool, compiles: bool
) -> None:
    assert pays(steps_left, step_seconds, cache_warm=warm) is compiles
    # Its break-even, from the figures it documents.
    saved = steps_left * step_seconds * (1 - 1 / COMPILED_SPEEDUP)
    assert compiles is (saved > (WARM_COMPILE_SECONDS if warm else COLD_COMPILE_SECONDS))


def test_the_compiler_is_looked_for_as_triton_looks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    assert c_compiler() is None  # the slim image: no gcc, no clang
    clang = tmp_path / "clang"
    clang.write_text("#!/bin/sh\n")
    clang.chmod(0o755)
    assert c_compiler() == str(clang)
    monkeypatch.setenv("CC", "my-cc")  # $CC wins, and must be there
    assert c_compiler() is None


def _settings(tmp_path: Path, **changes: object) -> TrainerSettings:
    parsed = parse(minimal(gpusPerWorker=0, dataset={"name": "digits"}, checkpoint={"path": str(tmp_path)}))
    return trainer_settings(parsed.name, parsed.spec).replace(
        **{"compile": None, "precision": "fp32", **changes}
    )


def _key(tmp_path: Path, world: int = 1, **changes: object) -> dict[str, str]:
    return cache_key(_settings(tmp_path, **changes), world, torch.device("cpu"), (32, 1, 8, 8))


def test_an_entry_is_read_back_for_its_key_only(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache = CompileCache(str(tmp_path / "ck"))
    key = _key(tmp_path)
    assert cache.write(key, b"artifacts")
    assert cache.read(key) == b"artifacts"
    assert (tmp_path / "ck" / CACHE_DIR / f"{digest(key)}.json").is_file()
    # What shapes the code is in the key: another precision, model or world is a miss.
    for other in (
        _key(tmp_path, precision="bf16"),
        _key(tmp_path, model="resnet18"),
        _key(tmp_path, world=2),
    ):
        assert other != key
        with caplog.at_level(logging.INFO, logger="gputrain"):
            assert cache.read(other) is None
        assert "compile cache: no entry in" in caplog.text
    # Not what does not: the epochs, the learning rate, the world size beyond DDP or not.
    assert _key(tmp_path, epochs=90, learning_rate=0.1) == key
    assert _key(tmp_path, world=2) == _key(tmp_path, world=16)


def test_a_rewritten_entry_replaces_its_blob(tmp_path: Path) -> None:
    cache = CompileCache(str(tmp_path))
    key = _key(tmp_path)
    assert cache.write(key, b"first")
    assert cache.write(key, b"second, with more")
    assert cache.read(key) == b"second, with more"
    assert len(list((tmp_path / CACHE_DIR).glob("*.bin"))) == 1


@pytest.mark.parametrize("damage", ["truncated", "bit flipped", "other key", "not json"])
def test_a_damaged_entry_is_ignored_with_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    cache = CompileCache(str(tmp_path))
    key = _key(tmp_path)
    assert cache.write(key, b"0123456789" * 100)
    folder = tmp_path / CACHE_DIR
    manifest_path = folder / f"{digest(key)}.json"
    manifest = json.loads(manifest_path.read_text())
    blob = folder / manifest["blob"]
    if damage == "truncated":
        blob.write_bytes(blob.read_bytes()[:500])
    elif damage == "bit flipped":
        data = bytearray(blob.read_bytes())
        data[7] ^= 0x10
        blob.write_bytes(bytes(data))
    elif damage == "other key":  # a manifest under this name written for other settings
        manifest["key"] = {**key, "precision": "bf16"}
        manifest_path.write_text(json.dumps(manifest))
    else:
        manifest_path.write_text("{not json")
    with caplog.at_level(logging.INFO, logger="gputrain"):
        assert cache.read(key) is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"compile cache: entry {folder}/{digest(key)}.json ignored: ")
    if damage == "other key":
        assert lines[0].endswith("written for other settings (precision)")


def test_a_store_that_refuses_costs_the_entry_not_the_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("a file where the directory would go")
    cache = CompileCache(str(blocked))
    with caplog.at_level(logging.WARNING, logger="gputrain"):
        assert cache.write(_key(tmp_path), b"artifacts") is False
    assert "compile cache: entry not written to" in caplog.text
