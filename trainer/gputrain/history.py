"""A run's metric history, kept where its outputs are.

JSON Lines in the output directory (:data:`gputrain.contract.HISTORY_FILE`) for every run, so
the curves outlive the pods and `gpuop run` can draw them; TensorBoard event files beside them
(``tensorboard/``) when the ``tensorboard`` package is installed (the ``tensorboard`` extra).
Rank 0 writes; a resumed run appends, so one file holds every attempt.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from gputrain.contract import HISTORY_FILE, TENSORBOARD_DIR, HistoryPoint

log = logging.getLogger(__name__)

# TensorBoard tag of each figure (grouped as TensorBoard shows them: train/, eval/, gpu/).
_TAGS = {
    "loss": "train/loss",
    "learning_rate": "train/learning_rate",
    "samples_per_second": "train/samples_per_second",
    "percent": "train/progress_percent",
    "accuracy": "eval/accuracy",
    "gpu_utilization_percent": "gpu/utilization_percent",
}


class History:
    """Appends :class:`HistoryPoint` records to the run's history (and TensorBoard)."""

    def __init__(self, output_dir: str | Path, tensorboard: bool = True) -> None:
        directory = Path(output_dir)
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / HISTORY_FILE
        # Line-buffered: a kill loses at most the line being written, which the reader skips.
        self._file = self.path.open("a", buffering=1, encoding="utf-8")
        self._board: Any = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package
            except ImportError:
                log.debug("tensorboard is not installed: the history is %s only", self.path)
            else:
                self._board = SummaryWriter(log_dir=str(directory / TENSORBOARD_DIR))

    def add(self, point: HistoryPoint) -> None:
        self._file.write(point.to_json() + "\n")
        if self._board is not None:
            for field, tag in _TAGS.items():
                value = getattr(point, field)
                if value is not None:
                    self._board.add_scalar(tag, value, global_step=point.step, walltime=point.time)

    def close(self) -> None:
        self._file.close()
        if self._board is not None:
            self._board.close()
