"""How long a checkpoint takes to save and to load, in a bucket of a real S3-compatible store
against a local directory, side by side in one run.

The state is what the built-in trainer checkpoints: the model's weights, its AdamW state after
one step (two moments per weight) and the scaler, through gputrain's own CheckpointManager
(serialise with torch.save, write the state, then the manifest; load: read both, check the
SHA-256, torch.load). The bucket is SeaweedFS on loopback (tests/support/objectstore.py; a
server of the same kind as the cloud's, with no network between), the directory is on the
machine's disk, with its fsyncs. Repeats alternate between the two; medians are quoted.

    .venv/bin/python bench/checkpoint_store.py --models cnn resnet50 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from gputrain.checkpoint import CheckpointManager  # noqa: E402
from gputrain.models import build_model  # noqa: E402
from support import objectstore  # noqa: E402

BUCKET = "bench"


def trained_state(model_name: str) -> dict[str, Any]:
    """The checkpoint of ``model_name`` after one AdamW step (its moments filled in)."""
    size, channels = (28, 1) if model_name == "cnn" else (224, 3)
    model = build_model(model_name, channels, 10 if model_name == "cnn" else 1000, size)  # type: ignore[arg-type]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, channels, size, size)).sum().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "model_name": model_name}


def timed(manager: CheckpointManager, state: dict[str, Any], step: int) -> tuple[float, float, int]:
    """Seconds to save, seconds to load the newest, and the state's size in bytes."""
    started = time.perf_counter()
    saved = manager.save(state, step)
    saving = time.perf_counter() - started
    started = time.perf_counter()
    found = manager.load_latest()
    loading = time.perf_counter() - started
    if found is None or found[1].step != step:
        raise RuntimeError(f"the checkpoint of step {step} did not load back from {manager.location.uri}")
    size = len(manager.location.read(saved.name))
    return saving, loading, size


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models", nargs="+", default=["cnn", "resnet50"], choices=["cnn", "resnet18", "resnet50"]
    )
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    with (
        tempfile.TemporaryDirectory(prefix="bench-ckpt-") as scratch,
        objectstore.running_server(Path(scratch) / "s3", (BUCKET,)) as server,
    ):
        os.environ.update(server.env())
        print("| model | state | where | save median (min..max) | load median (min..max) |")
        print("| --- | --- | --- | --- | --- |")
        for model_name in args.models:
            state = trained_state(model_name)
            places = {
                "directory": CheckpointManager(Path(scratch) / "volume" / model_name, keep=1),
                "bucket": CheckpointManager(f"s3://{BUCKET}/{model_name}", keep=1),
            }
            figures: dict[str, list[tuple[float, float, int]]] = {where: [] for where in places}
            for repeat in range(args.repeats):
                for where, manager in places.items():
                    figures[where].append(timed(manager, state, repeat + 1))
            for where, runs in figures.items():
                saves, loads = [r[0] for r in runs], [r[1] for r in runs]
                megabytes = runs[0][2] / 1e6
                print(f"| {model_name} | {megabytes:.1f} MB | {where} | {statistics.median(saves):.3f} s "
                      f"({min(saves):.3f}..{max(saves):.3f}) | {statistics.median(loads):.3f} s "
                      f"({min(loads):.3f}..{max(loads):.3f}) |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
