"""The checkpoints of a Hugging Face ``Trainer``: ``Trainer(..., callbacks=[GpuopCheckpoints()])``.

Transformers reports progress by itself (its ``KubeflowCallback``, on wherever the operator's
variables are set), but says nothing of checkpoints: the protocol has no word for them. This
callback says each one (``Reporter.checkpointed``) once the Trainer has written it whole, from
its ``on_save`` hook, which Transformers calls after the model, optimizer, scheduler and RNG
states and ``trainer_state.json`` are on disk: status.checkpoint then names its step and folder
(``<output_dir>/checkpoint-<step>``, the folder ``resume_from_checkpoint`` takes). On the main
process only (``state.is_world_process_zero``); ``gpureport`` itself needs no Transformers.
"""

from __future__ import annotations

import os
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from gpureport import Reporter

__all__ = ["GpuopCheckpoints"]


class GpuopCheckpoints(TrainerCallback):
    """Says each checkpoint the Trainer saved; ``reporter`` defaults to one made from the
    environment at the first save (a no-op without ``KUBEFLOW_TRAINER_SERVER_URL``)."""

    def __init__(self, reporter: Reporter | None = None) -> None:
        self._reporter = reporter

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if not state.is_world_process_zero:
            return
        if self._reporter is None:
            self._reporter = Reporter()
        folder = os.path.join(args.output_dir or "", f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        self._reporter.checkpointed(state.global_step, folder)
