"""The training loop: DDP, mixed precision, gradient accumulation, checkpoints, preemption.

Hot-path rules: the loop never reads a tensor back to the host between logging intervals
(loss, accuracy and sample counts accumulate on the device), gradients are synchronised
only on the last micro-step of an accumulation group (``no_sync`` on the others), and the
optimizer is fused.

The rest lives beside it: the checkpointed state that is not torch's in
:mod:`gputrain.state`, the schedule by the run's data in :mod:`gputrain.schedule`, metrics,
history and log lines in :mod:`gputrain.reporting`, files in :mod:`gputrain.checkpoint`, the
outputs in :mod:`gputrain.outputs`, whether and how the model is compiled in
:mod:`gputrain.compiling`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import platform
import signal
import time
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional
from torch.nn.parallel import DistributedDataParallel

from gputrain.checkpoint import CheckpointManager
from gputrain.compiling import ModelCompiler, cache_key
from gputrain.contract import ContractError, Precision, Result, TrainerSettings
from gputrain.data import DataSource, build_data
from gputrain.distributed import Cluster, sum_over_ranks
from gputrain.metrics import MetricsServer
from gputrain.models import build_model
from gputrain.outputs import OutputUploadError, newest_for_every_rank, write_outputs
from gputrain.reporting import Interval, RankOutlets, Standing
from gputrain.schedule import fraction_done, resume_at, steps_left, warmup_cosine
from gputrain.state import (
    MODEL_NAME,
    Figures,
    Position,
    RngState,
    Stateful,
    checkpoint_of,
    load_checkpoint,
)
from gputrain.storage import StorageError

log = logging.getLogger("gputrain")

# Imported from here by tests and benchmarks, from before they had modules of their own.
__all__ = ["OutputUploadError", "Position", "PreemptedError", "Trainer", "resume_at", "warmup_cosine"]


class PreemptedError(Exception):
    """SIGTERM arrived; a checkpoint was written where this rank is its pod's writer, unless
    ``saved`` says the store refused it."""

    def __init__(self, saved: bool = True) -> None:
        super().__init__()
        self.saved = saved


def cpu_computes_bf16_natively() -> bool:
    """Whether this CPU has bf16 arithmetic (AVX512-BF16 or AMX): without it, oneDNN emulates
    bf16 in fp32 registers plus conversions, and autocast to bf16 runs slower than fp32 (the
    CNN at 373 against 745 samples/s on a 2-core AVX-512 machine without it, docs/benchmarks.md).
    With it (Sapphire Rapids and later, Zen 4 and later), bf16 is oneDNN's fast path."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return True  # the probes know x86 only; an Arm CPU's bf16 (Neoverse V1 on) is its own
    names = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # private, in torch >= 2.3
    probes = [getattr(torch.cpu, name, None) for name in names]
    if all(probe is None for probe in probes):
        return True  # a torch that cannot tell: keep what the spec asked for
    return any(probe is not None and probe() for probe in probes)


def effective_precision(settings: TrainerSettings, device: torch.device) -> Precision:
    """The precision the loop runs in: the spec's, except bf16 on a CPU without bf16 arithmetic,
    which is fp32 (slower in bf16 and no more memory to save on a CPU's host RAM)."""
    if settings.precision == "bf16" and device.type == "cpu" and not cpu_computes_bf16_natively():
        return "fp32"
    return settings.precision


def _autocast(settings: TrainerSettings, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    if settings.precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if settings.precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def _evaluation_sums(
    model: nn.Module, data: DataSource, settings: TrainerSettings, device: torch.device
) -> list[torch.Tensor | float]:
    """This rank's share of the evaluation split: its loss summed, answers right, samples."""
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    correct = torch.zeros((), device=device, dtype=torch.int64)
    count = 0
    with torch.no_grad(), _autocast(settings, device):
        for x, y in data.eval_batches():
            logits = model(x)
            loss_sum += functional.cross_entropy(logits.float(), y, reduction="sum")
            correct += (logits.argmax(1) == y).sum()
            count += len(y)
    return [loss_sum, correct, float(count)]


def _precision_here(settings: TrainerSettings, device: torch.device) -> TrainerSettings:
    """The settings with the precision this device runs well (said when it differs)."""
    precision = effective_precision(settings, device)
    if precision == settings.precision:
        return settings
    log.warning(
        "precision %s: this CPU has no bf16 arithmetic (AVX512-BF16 or AMX), where bf16 runs slower "
        "than fp32; training in %s",
        settings.precision,
        precision,
    )
    return settings.replace(precision=precision)


class Trainer:
    """One rank's training run."""

    def __init__(self, settings: TrainerSettings, cluster: Cluster, *, termination_log: str | None) -> None:
        self.settings = settings
        self.cluster = cluster
        self.termination_log = termination_log
        self.device = cluster.device
        self.stop_requested = False
        self.stop_signal: int | None = None  # SIGTERM or SIGINT, once one came
        settings = self.settings = _precision_here(settings, self.device)

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
        self.wrapped: nn.Module = self.ddp if self.ddp is not None else self.model

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
        self.figures = Figures()
        self.rng = RngState(self.device)
        self.outlets = RankOutlets(settings, cluster)
        shape = (settings.batch_size, self.data.in_channels, self.data.image_size, self.data.image_size)
        key = cache_key(settings, cluster.world, self.device, shape)
        self.compiler = ModelCompiler(settings, cluster, key, self.outlets.compiled)
        self.forward: Any = self.compiler.begin(self.wrapped)

    @property
    def components(self) -> dict[str, Stateful]:
        """What a checkpoint holds, under its key in the file. Built at each use: the loop
        replaces ``position`` at every step."""
        return {
            "model": self.model,
            "optimizer": self.optimizer,
            "scaler": self.scaler,
            "position": self.position,
            "figures": self.figures,
            "rng": self.rng,
        }

    @property
    def metrics(self) -> MetricsServer | None:
        """This pod's endpoint, where this rank serves it (benchmarks read its GPU monitor)."""
        return self.outlets.metrics

    # ---------------------------------------------------------------------------------------
    # Checkpoints

    def save_checkpoint(self) -> bool:
        """Checkpoint the current step; False when the store refused it (a warning is logged)."""
        started = time.perf_counter()
        with self.outlets.pause("saving"):
            state = checkpoint_of(self.components, self.settings.model)
            try:
                saved = self.checkpoints.save(state, self.position.step)
            except StorageError as exc:
                # A store down past its retries (gputrain.storage) costs this checkpoint, not the
                # run: the last complete one stays, and the next save tries again.
                log.warning("checkpoint at step %d not saved: %s; training goes on", self.position.step, exc)
                return False
            self.outlets.checkpointed(saved)
        # Its time says what terminationGracePeriodSeconds a preemption's save needs here.
        log.info(
            "checkpoint %s at step %d (%.2f s)", saved.uri, self.position.step, time.perf_counter() - started
        )
        return True

    def resume(self) -> None:
        """Load the newest checkpoint into every component, at this world size."""
        found = newest_for_every_rank(self.checkpoints, self.cluster, self.settings.output_uri)
        if found is None:
            return
        state, saved = found
        if state.get(MODEL_NAME) != self.settings.model:
            raise ContractError(
                f"GPUTRAIN_CHECKPOINT_DIR: {saved.uri} holds a {state.get(MODEL_NAME)} model, not "
                f"{self.settings.model}; give the job a new name or empty the directory"
            )
        load_checkpoint(self.components, state)
        written = self.position
        self.position = resume_at(written, self.batches, self.settings.grad_accum_steps)
        self.total_steps = self.position.step + steps_left(
            self.position, self.batches, self.settings.epochs, self.settings.grad_accum_steps
        )
        if written.batches and written.batches != self.batches:
            log.info("the world size changed: an epoch is %d batches per rank, not %d; resuming at batch %d "
                     "(%.1f%% of the run done, as before)", self.batches, written.batches,
                     self.position.next_batch, 100 * self._fraction(self.position))  # fmt: skip
        log.info("resumed from %s at epoch %d, step %d", saved.uri, self.position.epoch + 1,
                 self.position.step)  # fmt: skip
        if saved.time is not None:  # one from before manifests has no time to tell
            self.outlets.checkpointed(saved)

    # ---------------------------------------------------------------------------------------
    # Progress, by the data (gputrain.schedule), at the current batches per epoch

    def _fraction(self, position: Position) -> float:
        return fraction_done(position, self.batches, self.settings.epochs)

    def _standing(self) -> Standing:
        return Standing(
            epoch=self.position.epoch,
            epochs=self.settings.epochs,
            step=self.position.step,
            total_steps=self.total_steps,
            percent=100.0 * self._fraction(self.position),
        )

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
    # Reports

    def _publish(self) -> None:
        self.outlets.publish(self._standing(), self.figures)

    def _report(self, loss_sum: torch.Tensor, seen: torch.Tensor, started: float, steps: int) -> None:
        """Log and publish one interval's figures, and count them into the run's totals."""
        total_loss, samples = sum_over_ranks(self.cluster, [loss_sum, seen])
        seconds = max(time.perf_counter() - started, 1e-9)
        self.figures.count(total_loss, samples, seconds)
        interval = Interval(steps, samples, seconds, learning_rate=self.optimizer.param_groups[0]["lr"])
        self.outlets.interval(self._standing(), self.figures, interval)

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
        saved = self.save_checkpoint() if self.cluster.is_local_main else True
        raise PreemptedError(saved)

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
        with self.outlets.pause("evaluating"):
            self._sync_buffers()
            self.model.eval()
            sums = _evaluation_sums(self.model, self.data, self.settings, self.device)
            self.figures.evaluated(*sum_over_ranks(self.cluster, sums))
            self.model.train()
        self.outlets.evaluated(self._standing(), self.figures)

    def _micro_step(self, x: torch.Tensor, y: torch.Tensor, group_size: int, last: bool) -> torch.Tensor:
        """Forward and backward over one micro-batch of a group of ``group_size``; its loss."""
        # Gradients are all-reduced on the last micro-step of a group only.
        sync = self.ddp.no_sync() if self.ddp is not None and not last else contextlib.nullcontext()
        with sync:
            with _autocast(self.settings, self.device):
                logits = self.forward(x)
                loss = functional.cross_entropy(logits.float(), y)
            self.scaler.scale(loss / group_size).backward()  # type: ignore[no-untyped-call]
        return loss

    def _optimizer_step(self, epoch: int, first_batch: int, end_batch: int) -> None:
        """The step over batches [first_batch, end_batch) of ``epoch``, whose gradients are in."""
        if self.settings.max_grad_norm > 0:
            self.scaler.unscale_(self.optimizer)
            nn.utils.clip_grad_norm_(self.model.parameters(), self.settings.max_grad_norm)
        self._set_learning_rate(epoch, first_batch, end_batch)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.position = Position(epoch, end_batch, self.position.step + 1, self.batches)
        forward = self.compiler.step_done(self.total_steps - self.position.step, self.wrapped)
        if forward is not None:  # compiled from now on
            self.forward = forward

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
            loss = self._micro_step(x, y, group_size, last_micro)
            loss_sum += loss.detach() * len(y)
            seen += len(y)
            if not last_micro:
                continue
            self._optimizer_step(epoch, group_start, b + 1)
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

    def _run_epoch(self, epoch: int) -> None:
        """Train and evaluate ``epoch`` (unless a resume found it trained), then checkpoint its end."""
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
            self._publish()
            self.compiler.keep_new_artifacts()
        # The epoch is done; a restart continues with the next one.
        self.position = Position(epoch + 1, 0, self.position.step, self.batches)
        if self.cluster.is_main:
            self.save_checkpoint()
        if self.stop_requested:
            self._preempt()

    def run(self) -> Result:
        previous = {sig: signal.signal(sig, self._request_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        started = time.perf_counter()
        try:
            self.resume()
            self._publish()  # totals are known now: scrapers see 0 of N, not 0 of 0
            self.model.train()
            for epoch in range(self.position.epoch, self.settings.epochs):
                self._run_epoch(epoch)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        result = Result(
            phase="Succeeded",
            epoch=self.settings.epochs,
            total_epochs=self.settings.epochs,
            step=self.position.step,
            total_steps=self.total_steps,
            loss=self.figures.loss,
            accuracy=self.figures.accuracy,
            test_loss=self.figures.test_loss,
            samples_per_second=self.figures.samples_per_second,
            duration_seconds=round(time.perf_counter() - started, 3),
            world_size=self.cluster.world,
            compile=self.compiler.mode,
        )
        write_outputs(result, self.model, self.cluster, self.settings, self.termination_log)
        self.outlets.finished(self._standing(), self.figures)
        return result

    def close(self) -> None:
        self.outlets.close()
