"""The trainer's checkpointed state: each piece an object that saves and loads itself.

A checkpoint is ``{name: component.state_dict()}`` over the trainer's components plus the
model's name, which identifies what the file holds. The model, optimizer and GradScaler are
torch's own components; this module has the others: :class:`Position` (where training
stands), :class:`Figures` (the run's results so far) and :class:`RngState`.

The keys are a file format: checkpoints on users' volumes were written with ``model``,
``optimizer``, ``scaler``, ``position``, ``figures``, ``rng`` and ``model_name``, and must
keep loading. ``torch.load(weights_only=True)`` reads them, so a state holds tensors, dicts,
lists, numbers, strings and None only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, Protocol

import torch

MODEL_NAME = "model_name"


class Stateful(Protocol):
    """What a checkpointed component is: torch's modules, optimizers and scalers are ones."""

    def state_dict(self) -> dict[str, Any]: ...

    # Positional-only, so each may name the parameter its own way; returning object, since
    # nn.Module's returns the keys it did not match.
    def load_state_dict(self, state_dict: dict[str, Any], /) -> object: ...


def checkpoint_of(components: Mapping[str, Stateful], model_name: str) -> dict[str, Any]:
    """The checkpoint of ``components``, marked with the model it is of."""
    return {name: component.state_dict() for name, component in components.items()} | {MODEL_NAME: model_name}


def load_checkpoint(components: Mapping[str, Stateful], state: Mapping[str, Any]) -> None:
    """Give each component its part of ``state``, a checkpoint of the same model."""
    for name, component in components.items():
        component.load_state_dict(state[name])


def _load_fields(target: Any, state: dict[str, Any]) -> None:
    # Through the constructor, so a key the class does not know fails loudly and a field
    # the file predates (Position.batches) takes its default.
    loaded = type(target)(**state)
    for field in fields(target):
        setattr(target, field.name, getattr(loaded, field.name))


@dataclass
class Position:
    """Where training stands: the next batch to run, optimizer steps done, and the batches an
    epoch had when this was written (they follow the world size: each rank takes 1/world of
    the data; 0 in checkpoints from before this field: the current count)."""

    epoch: int = 0
    next_batch: int = 0
    step: int = 0
    batches: int = 0

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _load_fields(self, state)


@dataclass
class Figures:
    """The run's figures over every attempt: a run resumed from its last checkpoint still
    reports the whole run."""

    loss: float | None = None  # training loss over the last logging interval
    accuracy: float | None = None  # on the evaluation split, after the last epoch done
    test_loss: float | None = None
    samples_trained: float = 0.0  # by all ranks
    seconds_trained: float = 0.0

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _load_fields(self, state)

    def count(self, loss_sum: float, samples: float, seconds: float) -> None:
        """Add one logging interval: the loss summed over its samples, and its duration."""
        self.samples_trained += samples
        self.seconds_trained += seconds
        self.loss = loss_sum / max(samples, 1.0)

    def evaluated(self, loss_sum: float, correct: float, samples: float) -> None:
        self.test_loss = loss_sum / max(samples, 1.0)
        self.accuracy = correct / max(samples, 1.0)

    @property
    def samples_per_second(self) -> float | None:
        """Over the whole run's training time (evaluation and checkpoints left out)."""
        return self.samples_trained / self.seconds_trained if self.seconds_trained else None


class RngState:
    """The random generators: torch's, and on a GPU every CUDA device's. Restored on a resume,
    so a resumed run draws what the interrupted one would have drawn next."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def state_dict(self) -> dict[str, Any]:
        return {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if self.device.type == "cuda" else [],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
        # A CPU run's checkpoint has none; a GPU run resumed on a CPU has no devices for them.
        if state["cuda"] and self.device.type == "cuda":
            torch.cuda.set_rng_state_all(state["cuda"])
