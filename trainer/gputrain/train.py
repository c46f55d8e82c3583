"""The training loop: DDP, mixed precision, gradient accumulation, checkpoints, preemption.

Hot-path rules: the loop never reads a tensor back to the host between logging intervals
(loss, accuracy and sample counts accumulate on the device), gradients are synchronised
only on the last micro-step of an accumulation group (``no_sync`` on the others), and the
optimizer is fused.
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional
from torch.nn.parallel import DistributedDataParallel

from gputrain.checkpoint import CheckpointManager, write_atomically
from gputrain.contract import (
    MODEL_FILE,
    RESULT_FILE,
    ContractError,
    HistoryPoint,
    Progress,
    Result,
    TrainerSettings,
)
from gputrain.data import DataSource, build_data
from gputrain.distributed import Cluster
from gputrain.history import History
from gputrain.metrics import MetricsServer
from gputrain.models import build_model

log = logging.getLogger("gputrain")

WARMUP_FRACTION = 0.05


class PreemptedError(Exception):
    """SIGTERM arrived; a checkpoint was written where this rank is its pod's writer."""


@dataclass
class Position:
    """Where training stands: the next batch to run, optimizer steps done, and the batches an
    epoch had when this was written (they follow the world size: each rank takes 1/world of
    the data; 0 in checkpoints from before this field: the current count)."""

    epoch: int = 0
    next_batch: int = 0
    step: int = 0
    batches: int = 0


def warmup_cosine(fraction: float) -> float:
    """LR multiplier at ``fraction`` of the run done: linear warmup over the first 5%, then
    cosine decay towards 0. Of the run's data, not of its steps, so a run resumed with another
    world size (another number of steps per epoch) continues the same curve."""
    if fraction < WARMUP_FRACTION:
        return max(fraction, 0.0) / WARMUP_FRACTION
    done = (fraction - WARMUP_FRACTION) / (1.0 - WARMUP_FRACTION)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, done)))


def resume_at(position: Position, batches: int, accum: int) -> Position:
    """``position`` for an epoch of ``batches`` batches (the world size changed since it was
    written): the same fraction of the epoch, rounded up to the next accumulation group, so
    progress never goes back; less than one group's samples of this epoch go unseen. Each
    rank's shard is strided over one permutation (DistributedSampler's arithmetic), so the
    first k batches of every rank together are the permutation's first k x world x batch
    samples, whatever the world: the same fraction is the same samples, to that rounding."""
    if not position.batches or position.batches == batches:
        return Position(position.epoch, position.next_batch, position.step, batches)
    fraction = position.next_batch / position.batches
    next_batch = min(batches, math.ceil(fraction * batches / accum) * accum)
    return Position(position.epoch, next_batch, position.step, batches)


def _autocast(settings: TrainerSettings, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    if settings.precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if settings.precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


class Trainer:
    """One rank's training run."""

    def __init__(self, settings: TrainerSettings, cluster: Cluster, *, termination_log: str | None) -> None:
        self.settings = settings
        self.cluster = cluster
        self.termination_log = termination_log
        self.device = cluster.device
        self.stop_requested = False
        self.stop_signal: int | None = None  # SIGTERM or SIGINT, once one came

        torch.manual_seed(settings.seed)  # the same initial weights on every rank
        if self.device.type == "cuda":
            # A run's batches share one shape (an epoch's smaller last batch and the evaluation
            # aside), so timing cuDNN's algorithms once per layer shape pays for itself within
            # the first steps.
            torch.backends.cudnn.benchmark = True
        self.data: DataSource = build_data(settings, cluster.rank, cluster.world, self.device)
        self.model = build_model(
            settings.model, self.data.in_channels, self.data.num_classes, self.data.image_size
        )
        self.model.to(self.device)
        if settings.channels_last:
            self.model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        self.ddp: DistributedDataParallel | None = None
        if cluster.distributed:
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            self.ddp = DistributedDataParallel(self.model, device_ids=device_ids)
        wrapped: nn.Module = self.ddp if self.ddp is not None else self.model
        self.forward: Any = torch.compile(wrapped) if settings.compile else wrapped

        # One fused kernel instead of a handful of foreach ops per parameter group. torch >= 2.4 has
        # it on both devices the trainer uses (CUDA and CPU); on CPU it cut the CNN's optimizer
        # step from 1.46 to 0.37 ms.
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=settings.learning_rate, fused=True)
        self.batches = self.data.batches_per_epoch()
        self.steps_per_epoch = math.ceil(self.batches / settings.grad_accum_steps)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=settings.precision == "fp16")
        self.checkpoints = CheckpointManager(settings.checkpoint_dir, settings.checkpoint_keep)
        self.position = Position(batches=self.batches)
        self.total_steps = self.steps_per_epoch * settings.epochs  # from here on: steps done + to do
        self.accuracy: float | None = None
        self.test_loss: float | None = None
        self.last_loss: float | None = None
        # Samples trained on by all ranks, and the seconds spent doing it, over every attempt:
        # a run resumed from its last checkpoint still reports the whole run.
        self.samples_trained = 0.0
        self.seconds_trained = 0.0
        # One endpoint per pod: the other local ranks neither serve nor read NVML.
        self.metrics = MetricsServer(settings.metrics_port) if cluster.is_local_main else None
        # The curves, kept with the outputs: rank 0 writes them for the job.
        self.history = History(settings.output_dir) if cluster.is_main else None

    # ---------------------------------------------------------------------------------------
    # Checkpoints

    def _state(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "position": asdict(self.position),
            "model_name": self.settings.model,
            "figures": {
                "loss": self.last_loss,
                "accuracy": self.accuracy,
                "test_loss": self.test_loss,
                "samples_trained": self.samples_trained,
                "seconds_trained": self.seconds_trained,
            },
            "rng": {
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if self.device.type == "cuda" else [],
            },
        }

    def save_checkpoint(self) -> None:
        path = self.checkpoints.save(self._state(), self.position.step)
        log.info("checkpoint %s at step %d", path, self.position.step)

    def resume(self) -> None:
        """Load the newest checkpoint on rank 0 and send it to every rank.

        Only rank 0 reads: with a per-pod emptyDir the other pods have none, and they must
        all start from the same state anyway.
        """
        found = self.checkpoints.load_latest() if self.cluster.is_main else None
        box: list[Any] = [found]
        if self.cluster.distributed:
            dist.broadcast_object_list(box, src=0)
        found = box[0]
        if found is None:
            return
        state, path = found
        if state.get("model_name") != self.settings.model:
            raise ContractError(
                f"GPUTRAIN_CHECKPOINT_DIR: {path} holds a {state.get('model_name')} model, not "
                f"{self.settings.model}; give the job a new name or empty the directory"
            )
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        written = Position(**state["position"])
        self.position = resume_at(written, self.batches, self.settings.grad_accum_steps)
        self.total_steps = self.position.step + self._steps_left()
        if written.batches and written.batches != self.batches:
            log.info("the world size changed: an epoch is %d batches per rank, not %d; resuming at batch %d "
                     "(%.1f%% of the run done, as before)", self.batches, written.batches,
                     self.position.next_batch, 100 * self._fraction(self.position))  # fmt: skip
        figures = state["figures"]
        self.last_loss, self.accuracy, self.test_loss = (
            figures["loss"],
            figures["accuracy"],
            figures["test_loss"],
        )
        self.samples_trained = figures["samples_trained"]
        self.seconds_trained = figures["seconds_trained"]
        torch.set_rng_state(state["rng"]["torch"])
        if state["rng"]["cuda"] and self.device.type == "cuda":
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        log.info("resumed from %s at epoch %d, step %d", path, self.position.epoch + 1, self.position.step)

    # ---------------------------------------------------------------------------------------
    # Progress, by the data: what stays true when the world size (the steps per epoch) changes

    def _fraction(self, position: Position) -> float:
        """The run's data done at ``position``: epochs done plus this epoch's share, of all."""
        return min(1.0, (position.epoch + position.next_batch / self.batches) / self.settings.epochs)

    def _steps_left(self) -> int:
        """Optimizer steps from the position to the end, at this world size."""
        epoch, next_batch = self.position.epoch, self.position.next_batch
        if epoch >= self.settings.epochs:
            return 0
        this_epoch = math.ceil(max(0, self.batches - next_batch) / self.settings.grad_accum_steps)
        return this_epoch + (self.settings.epochs - epoch - 1) * self.steps_per_epoch

    def _set_learning_rate(self, epoch: int, first_batch: int, end_batch: int) -> None:
        """The LR for the step over batches [first_batch, end_batch) of ``epoch``: the schedule
        at the middle of that step's share of the data (the first step's LR is not 0, nor the
        last's)."""
        middle = (
            self._fraction(Position(epoch, first_batch)) + self._fraction(Position(epoch, end_batch))
        ) / 2
        rate = self.settings.learning_rate * warmup_cosine(middle)
        for group in self.optimizer.param_groups:
            group["lr"] = rate

    # ---------------------------------------------------------------------------------------
    # The loop

    def _request_stop(self, signum: int, frame: FrameType | None) -> None:
        # Ctrl-C as an eviction: finish the step, checkpoint, stop (Python's default for SIGINT,
        # KeyboardInterrupt mid-step, lost everything since the last periodic checkpoint).
        self.stop_requested = True
        self.stop_signal = self.stop_signal or signum

    def _preempt(self) -> None:
        # The state at the last step boundary is the same on every rank, so each pod's local
        # rank 0 can write it: a pod on its own emptyDir keeps its progress too.
        if self.cluster.is_local_main:
            self.save_checkpoint()
        raise PreemptedError

    def _reduce(self, values: list[torch.Tensor | float]) -> list[float]:
        """Sum figures over ranks: the one host sync of a logging interval."""
        tensor = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=self.device) for v in values])
        if self.cluster.distributed:
            dist.all_reduce(tensor)
        return [float(v) for v in tensor.tolist()]

    def _report(self, loss_sum: torch.Tensor, seen: torch.Tensor, started: float, steps: int) -> None:
        """Log and publish one interval's figures, and count them into the run's totals."""
        total_loss, samples = self._reduce([loss_sum, seen])
        elapsed = max(time.perf_counter() - started, 1e-9)
        self.samples_trained += samples
        self.seconds_trained += elapsed
        self.last_loss = total_loss / max(samples, 1.0)
        rate = samples / elapsed
        eta = (self.total_steps - self.position.step) * elapsed / max(steps, 1)
        if self.metrics is not None:
            self.metrics.count(steps, samples)
        self._publish(rate, eta)
        self._remember(loss=self.last_loss, samples_per_second=rate,
                       learning_rate=self.optimizer.param_groups[0]["lr"])  # fmt: skip
        if self.cluster.is_main:
            log.info(
                "epoch %d/%d step %d/%d loss %.4f lr %.3g %.0f samples/s eta %.0fs",
                self.position.epoch + 1,
                self.settings.epochs,
                self.position.step,
                self.total_steps,
                self.last_loss,
                self.optimizer.param_groups[0]["lr"],
                rate,
                eta,
            )

    def _remember(self, **figures: float | None) -> None:
        """Add a point to the run's history (rank 0 only: one history per job)."""
        if self.history is None:
            return
        gpu = self.metrics.gpu_utilization_percent() if self.metrics is not None else None
        epoch = min(self.position.epoch + 1, self.settings.epochs)
        percent = 100.0 * self._fraction(self.position)
        self.history.add(HistoryPoint(
            time=time.time(), step=self.position.step, epoch=epoch, percent=percent,
            gpu_utilization_percent=gpu, **figures,
        ))  # fmt: skip

    def _publish(self, rate: float | None, eta: float | None) -> None:
        if self.metrics is None:
            return
        self.metrics.update(
            Progress(
                epoch=min(self.position.epoch + 1, self.settings.epochs),
                total_epochs=self.settings.epochs,
                step=self.position.step,
                total_steps=self.total_steps,
                percent=100.0 * self._fraction(self.position),
                loss=self.last_loss,
                accuracy=self.accuracy,
                samples_per_second=rate,
                estimated_remaining_seconds=eta,
            )
        )

    def _sync_buffers(self) -> None:
        """Give every rank rank 0's buffers (BatchNorm running statistics).

        DDP broadcasts buffers only at the start of each training forward, so after the last
        step each rank holds the statistics of its own last batch; evaluating, checkpointing
        and exporting must all see one model.
        """
        if self.cluster.distributed:
            for buffer in self.model.buffers():
                dist.broadcast(buffer, src=0)

    def evaluate(self) -> None:
        self._sync_buffers()
        self.model.eval()
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        correct = torch.zeros((), device=self.device, dtype=torch.int64)
        count = 0
        with torch.no_grad(), _autocast(self.settings, self.device):
            for x, y in self.data.eval_batches():
                logits = self.model(x)
                loss_sum += functional.cross_entropy(logits.float(), y, reduction="sum")
                correct += (logits.argmax(1) == y).sum()
                count += len(y)
        total_loss, total_correct, total = self._reduce([loss_sum, correct, float(count)])
        self.model.train()
        self.test_loss = total_loss / max(total, 1.0)
        self.accuracy = total_correct / max(total, 1.0)
        self._remember(accuracy=self.accuracy)
        if self.cluster.is_main:
            log.info(
                "epoch %d/%d test loss %.4f accuracy %.4f",
                self.position.epoch + 1,
                self.settings.epochs,
                self.test_loss,
                self.accuracy,
            )

    def _train_epoch(self, epoch: int) -> None:
        """One epoch from the current position."""
        settings = self.settings
        accum = settings.grad_accum_steps
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        seen = torch.zeros((), device=self.device, dtype=torch.float64)
        interval_start, interval_steps = time.perf_counter(), 0
        start = self.position.next_batch
        for b, (x, y) in enumerate(self.data.train_batches(epoch, start), start=start):
            group_start = b - b % accum
            group_size = min(accum, self.batches - group_start)
            last_micro = b == group_start + group_size - 1
            # Gradients are all-reduced on the last micro-step of a group only.
            sync = self.ddp.no_sync() if self.ddp is not None and not last_micro else contextlib.nullcontext()
            with sync:
                with _autocast(settings, self.device):
                    logits = self.forward(x)
                    loss = functional.cross_entropy(logits.float(), y)
                self.scaler.scale(loss / group_size).backward()  # type: ignore[no-untyped-call]
            loss_sum += loss.detach() * len(y)
            seen += len(y)
            if not last_micro:
                continue
            if settings.max_grad_norm > 0:
                self.scaler.unscale_(self.optimizer)
                nn.utils.clip_grad_norm_(self.model.parameters(), settings.max_grad_norm)
            self._set_learning_rate(epoch, group_start, b + 1)
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
            self.position = Position(epoch, b + 1, self.position.step + 1, self.batches)
            interval_steps += 1
            if self.stop_requested:
                self._preempt()
            if self.position.step % settings.log_every_steps == 0 or b == self.batches - 1:
                self._report(loss_sum, seen, interval_start, interval_steps)
                loss_sum.zero_()
                seen.zero_()
                interval_start, interval_steps = time.perf_counter(), 0
            if self.cluster.is_main and self.position.step % settings.checkpoint_every_steps == 0:
                self.save_checkpoint()

    def run(self) -> Result:
        previous = {sig: signal.signal(sig, self._request_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        started = time.perf_counter()
        try:
            self.resume()
            self._publish(None, None)  # totals are known now: scrapers see 0 of N, not 0 of 0
            self.model.train()
            for epoch in range(self.position.epoch, self.settings.epochs):
                if self.position.next_batch < self.batches:
                    try:
                        self._train_epoch(epoch)
                    except PreemptedError:
                        raise
                    except Exception:
                        if self.stop_requested:  # a peer left first, mid-collective
                            self._preempt()
                        raise
                    self.evaluate()
                    self._publish(None, None)
                # The epoch is done; a restart continues with the next one.
                self.position = Position(epoch + 1, 0, self.position.step, self.batches)
                if self.cluster.is_main:
                    self.save_checkpoint()
                if self.stop_requested:
                    self._preempt()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        duration = time.perf_counter() - started
        result = Result(
            phase="Succeeded",
            epoch=self.settings.epochs,
            total_epochs=self.settings.epochs,
            step=self.position.step,
            total_steps=self.total_steps,
            loss=self.last_loss,
            accuracy=self.accuracy,
            test_loss=self.test_loss,
            samples_per_second=self.samples_trained / self.seconds_trained if self.seconds_trained else None,
            duration_seconds=round(duration, 3),
            world_size=self.cluster.world,
        )
        self._write_result(result)
        return result

    def _write_result(self, result: Result) -> None:
        text = result.to_json()
        if self.cluster.is_main:
            output = Path(self.settings.output_dir)
            write_atomically(output / RESULT_FILE, lambda handle: handle.write((text + "\n").encode()))
            state = self.model.state_dict()
            write_atomically(output / MODEL_FILE, lambda handle: torch.save(state, handle))
            log.info("result %s", text)
        if self.cluster.is_local_main and self.termination_log:
            try:
                Path(self.termination_log).write_text(text[:4096])  # the kubelet keeps 4 KiB
            except OSError as exc:
                log.warning("cannot write the termination message to %s: %s", self.termination_log, exc)

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        if self.history is not None:
            self.history.close()
