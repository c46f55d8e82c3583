"""A Lightning module that reports its progress through one callback:
``Trainer(callbacks=[GpuopProgress()])`` from ``gpureport.lightning``.

Run by a GpuTraining (or ``gpuop run``), status.progress shows its global step of the run's
estimated steps, its epoch, and what the module logs (``self.log("loss", ...)``). A small
regression on data the script makes: nothing is downloaded; CPU or GPUs, under torchrun.
"""

from __future__ import annotations

import argparse
import os

import lightning.pytorch as pl
import torch
from gpureport.lightning import GpuopProgress


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(16, 1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        inputs, targets = batch
        loss = torch.nn.functional.mse_loss(self.layer(inputs), targets)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=512)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(args.samples, 16, generator=generator)
    targets = inputs @ torch.randn(16, 1, generator=generator)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs, targets), batch_size=32)
    # Nodes and processes a node from torchrun's variables: left at Lightning's defaults (one
    # node, one device), every rank of a two-worker training trains alone on all the data.
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    nodes = int(os.environ.get("WORLD_SIZE", "1")) // per_node
    trainer = pl.Trainer(
        max_epochs=args.epochs, accelerator="auto", devices=per_node, num_nodes=nodes,
        callbacks=[GpuopProgress()], enable_progress_bar=False, logger=False, enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(Regression(), data)


if __name__ == "__main__":
    main()
