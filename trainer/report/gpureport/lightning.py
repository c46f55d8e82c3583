"""Progress reports from a Lightning run: ``Trainer(callbacks=[GpuopProgress()])``.

On rank 0 only (``trainer.is_global_zero``), after each training batch: the optimizer steps
done (``global_step``) of ``estimated_stepping_batches``, the epoch (from 1) of
``max_epochs``, and every scalar the module logged (``self.log("loss", ...)`` and the rest,
under the names it logged them by); the final report (100 %) when the fit ends. A logged
``loss`` is the loss; without one, the loss ``training_step`` returned. A validation run
inside the fit is a pause (``Reporter.pause("evaluating")``): the stall timeout does not count it.
A checkpoint a ``ModelCheckpoint`` wrote is said (``Reporter.checkpointed``) at the next hook,
once the write is over: status.checkpoint then names its step and file.

Cost: a report is gathered only when :meth:`gpureport.Reporter.due` says it would be sent,
once per 5 s: reading a GPU tensor's value waits for the device, and doing it every batch
would slow the loop.

Imports ``lightning.pytorch``, or ``pytorch_lightning`` where only the older package is
installed; ``gpureport`` itself needs neither.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from typing import Any

try:
    from lightning.pytorch import Callback, LightningModule, Trainer
except ImportError:  # the package's name before Lightning 2.0; the same classes
    from pytorch_lightning import Callback, LightningModule, Trainer  # type: ignore[assignment]

from gpureport import Reporter

__all__ = ["GpuopProgress"]


class GpuopProgress(Callback):
    """Reports a Lightning fit's progress; ``reporter`` defaults to one made from the
    environment when the fit starts (a no-op without ``KUBEFLOW_TRAINER_SERVER_URL``)."""

    def __init__(self, reporter: Reporter | None = None) -> None:
        super().__init__()
        self._reporter = reporter
        self._pausing: contextlib.ExitStack | None = None  # a validation run under way
        self._checkpoint_said: tuple[int, str] | None = None  # (step, file) last said

    @property
    def reporter(self) -> Reporter:
        # Made on first use, in the process that trains: Lightning may build the callback in a
        # launcher process whose environment (RANK) is not the worker's.
        if self._reporter is None:
            self._reporter = Reporter()
        return self._reporter

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.is_global_zero:
            self._say_checkpoint(trainer)
            if self.reporter.due():
                self._send(trainer, outputs, final=False)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.is_global_zero:
            self._say_checkpoint(trainer)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Within a fit only: a validate() call on its own trains nothing that could stall.
        if trainer.is_global_zero and self._pausing is None and _fitting(trainer):
            self._pausing = contextlib.ExitStack()
            self._pausing.enter_context(self.reporter.pause("evaluating"))

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._pausing is not None:
            self._pausing.close()
            self._pausing = None
        if trainer.is_global_zero:
            self._say_checkpoint(trainer)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.is_global_zero and self.reporter.enabled:
            self._say_checkpoint(trainer)  # the final report carries it
            self._send(trainer, None, final=True)

    def _say_checkpoint(self, trainer: Trainer) -> None:
        """The newest checkpoint the fit's ModelCheckpoint callbacks wrote, if not yet said.
        Lightning runs them after every other callback, and writes synchronously (unless an
        async CheckpointIO is configured), so a file seen here is whole. It keeps the file and
        step of its last save on private attributes (Lightning 2.x); without them, a file is
        said once, when it first appears as the last or best one, with the step then."""
        newest: tuple[int, str] | None = None
        try:
            for callback in getattr(trainer, "checkpoint_callbacks", ()):
                step = getattr(callback, "_last_global_step_saved", None)
                path = getattr(callback, "_last_checkpoint_saved", None)
                if not isinstance(step, int) or not isinstance(path, str):
                    path = getattr(callback, "last_model_path", "") or getattr(
                        callback, "best_model_path", ""
                    )
                    said = self._checkpoint_said is not None and self._checkpoint_said[1] == path
                    step = None if said else trainer.global_step
                if path and step and (newest is None or step > newest[0]):
                    newest = (step, str(path))
        except Exception:  # a report is never worth a failed fit
            return
        if newest is not None and newest != self._checkpoint_said:
            self._checkpoint_said = newest
            self.reporter.checkpointed(*newest)

    def _send(self, trainer: Trainer, outputs: Any, final: bool) -> None:
        try:
            figures = _figures(trainer, outputs)
        except Exception:  # a report is never worth a failed fit
            figures = {"step": getattr(trainer, "global_step", None)}
        logged = dict(figures.pop("logged", {}))
        self.reporter.report_metrics(logged, final=final, **figures)


def _fitting(trainer: Trainer) -> bool:
    state = getattr(trainer, "state", None)
    return str(getattr(getattr(state, "fn", None), "value", "")) == "fit"


def _figures(trainer: Trainer, outputs: Any) -> dict[str, Any]:
    total = trainer.estimated_stepping_batches  # inf when neither max_steps nor max_epochs bound it
    epochs = trainer.max_epochs  # None or -1: unbounded
    known_epochs = epochs if epochs is not None and epochs > 0 else None
    # After the last epoch current_epoch is max_epochs: the run is in its last epoch still.
    epoch = trainer.current_epoch + 1
    if known_epochs is not None:
        epoch = min(epoch, known_epochs)
    logged = dict(trainer.callback_metrics)  # tensors; gpureport keeps the scalar ones
    loss = logged.pop("loss", None)
    if loss is None:
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
    return {
        "step": trainer.global_step,
        "total_steps": total if isinstance(total, int) or math.isfinite(total) else None,
        "epoch": epoch,
        "total_epochs": known_epochs,
        "loss": loss,
        "logged": logged,
    }
