"""The real trainer entry point under torchrun, then this rank's final model state saved.

``--dump-dir=DIR`` is where rank R writes ``rank-R.pt``. ``--no-batchnorm`` swaps BatchNorm
for identity before the model is built (its statistics depend on the micro-batch size,
which would hide what an accumulation test compares). ``--steps=N`` ends the epoch after N
optimizer steps.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from gputrain.__main__ import run_and_exit
from gputrain.train import Trainer


def run() -> None:
    own = [a for a in sys.argv[1:] if a.startswith(("--dump-dir=", "--steps=")) or a == "--no-batchnorm"]
    argv = [a for a in sys.argv[1:] if a not in own]
    options = dict(a.removeprefix("--").split("=", 1) for a in own if "=" in a)
    if "--no-batchnorm" in own:
        import gputrain.models

        gputrain.models.nn.BatchNorm2d = lambda channels: torch.nn.Identity()  # type: ignore[assignment,misc]
    if "steps" in options:
        steps = int(options["steps"])
        build = Trainer.__init__

        def limited(self: Trainer, *args: object, **kwargs: object) -> None:
            build(self, *args, **kwargs)  # type: ignore[arg-type]
            self.batches = min(self.batches, steps * self.settings.grad_accum_steps)

        Trainer.__init__ = limited  # type: ignore[method-assign]

    def dump(trainer: Trainer) -> None:
        directory = Path(options["dump-dir"])
        directory.mkdir(parents=True, exist_ok=True)
        torch.save(trainer.model.state_dict(), directory / f"rank-{trainer.cluster.rank}.pt")

    run_and_exit(argv, after=dump)


if __name__ == "__main__":
    run()
