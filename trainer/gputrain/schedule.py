"""Progress by the data: what stays true when the world size (the steps per epoch) changes.

Each rank takes 1/world of the data, so the batches of an epoch, the steps of the run and a
step's place in it all change with the world size; the share of the run's data done does
not. The LR schedule, the reported percentage and a resumed position are all of that share.
"""

from __future__ import annotations

import math

from gputrain.state import Position

WARMUP_FRACTION = 0.05


def warmup_cosine(fraction: float) -> float:
    """LR multiplier at ``fraction`` of the run done: linear warmup over the first 5%, then
    cosine decay towards 0. Of the run's data, not of its steps, so a run resumed with another
    world size (another number of steps per epoch) continues the same curve."""
    if fraction < WARMUP_FRACTION:
        return max(fraction, 0.0) / WARMUP_FRACTION
    done = (fraction - WARMUP_FRACTION) / (1.0 - WARMUP_FRACTION)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, done)))


def fraction_done(position: Position, batches: int, epochs: int) -> float:
    """The run's data done at ``position``, of epochs of ``batches`` batches: epochs done plus
    this epoch's share, of all."""
    return min(1.0, (position.epoch + position.next_batch / batches) / epochs)


def steps_left(position: Position, batches: int, epochs: int, accum: int) -> int:
    """Optimizer steps from ``position`` to the end, at epochs of ``batches`` batches."""
    if position.epoch >= epochs:
        return 0
    this_epoch = math.ceil(max(0, batches - position.next_batch) / accum)
    return this_epoch + (epochs - position.epoch - 1) * math.ceil(batches / accum)


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
