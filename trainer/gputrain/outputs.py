"""The run's outputs and the checkpoint it starts from, as every rank sees them: the result and
model rank 0 writes (and uploads where ``output_uri`` says), each pod's termination message,
and the newest checkpoint rank 0 reads for all.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gputrain.checkpoint import CheckpointManager, Saved
from gputrain.contract import HISTORY_FILE, MODEL_FILE, RESULT_FILE, Result, TrainerSettings
from gputrain.distributed import Cluster
from gputrain.storage import StorageError, open_location, write_atomically

log = logging.getLogger("gputrain")


class OutputUploadError(StorageError):
    """The outputs could not be uploaded to GPUTRAIN_OUTPUT_URI: the run trained, and its last
    checkpoint holds the trained model."""


def write_outputs(
    result: Result, model: nn.Module, cluster: Cluster, settings: TrainerSettings, termination_log: str | None
) -> None:
    """The run's result and final model (rank 0), uploaded where ``output_uri`` says, and each
    pod's termination message."""
    text = result.to_json()
    if cluster.is_main:
        output = Path(settings.output_dir)
        write_atomically(output / RESULT_FILE, lambda handle: handle.write((text + "\n").encode()))
        state = model.state_dict()
        write_atomically(output / MODEL_FILE, lambda handle: torch.save(state, handle))
        log.info("result %s", text)
        if settings.output_uri:
            upload_outputs(output, settings.output_uri)
    if cluster.is_local_main and termination_log:
        try:
            Path(termination_log).write_text(text[:4096])  # the kubelet keeps 4 KiB
        except OSError as exc:
            log.warning("cannot write the termination message to %s: %s", termination_log, exc)


def upload_outputs(output: Path, uri: str) -> None:
    """Copy the model, the history and the result to ``uri``, the result last: a reader that
    finds it there finds the rest. Each object is whole or absent (gputrain.storage); the store's
    retries hold the run for up to 2 minutes an object before it gives up."""
    started = time.perf_counter()
    try:
        store = open_location(uri)
        for name in (MODEL_FILE, HISTORY_FILE, RESULT_FILE):
            if (output / name).is_file():
                store.write(name, (output / name).read_bytes())
    except StorageError as exc:
        raise OutputUploadError(
            f"{exc}; the trained model is in {output / MODEL_FILE} and in the last checkpoint: with the "
            "store fixed, apply the training again (it resumes at its end and uploads)",
            # Never a stop, even refused (a key that may list but not write): the pods and their
            # emptyDir, which may hold the only trained model, stay; a restart uploads again.
            refused=False,
        ) from None
    log.info("outputs uploaded to %s (%.2f s)", store.uri, time.perf_counter() - started)


def newest_for_every_rank(
    checkpoints: CheckpointManager, cluster: Cluster, output_uri: str | None
) -> tuple[dict[str, Any], Saved] | None:
    """The newest complete checkpoint, as every rank resumes from it (None: start fresh).

    Only rank 0 reads: with a per-pod emptyDir the other pods have none, and they must all start
    from the same state anyway. A store that refuses rank 0 ends every rank, with its one line,
    not rank 0 alone while the others wait in the broadcast until the collective times out."""
    found: tuple[dict[str, Any], Saved] | StorageError | None = None
    if cluster.is_main:
        try:
            found = checkpoints.load_latest()
            check_output_store(output_uri)
        except StorageError as exc:
            found = exc
    box: list[Any] = [found]
    if cluster.distributed:
        dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], StorageError):
        raise type(box[0])(str(box[0]), refused=box[0].refused)
    newest: tuple[dict[str, Any], Saved] | None = box[0]
    return newest


def check_output_store(output_uri: str | None) -> None:
    """A list of GPUTRAIN_OUTPUT_URI before training: wrong credentials or a missing bucket
    found now, not once the whole run is trained."""
    if not output_uri:
        return
    try:
        open_location(output_uri).names()
    except StorageError as exc:
        raise OutputUploadError(
            f"{exc}; found before training (the outputs go there at the end)", refused=exc.refused
        ) from None
