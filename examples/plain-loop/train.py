"""A hand-written PyTorch DDP loop that reports its progress with one call a step: ``gpureport``
(standard library only; `pip install gpuop-report`, or ./trainer/report from this repository).

Run by a GpuTraining (or ``gpuop run``) it fills status.progress (percent, step, epoch, loss,
samples/s, ETA): the operator gives the pod Kubeflow's variables, and gpureport reports from
rank 0, at most every 5 s, on a thread of its own. With ``--checkpoint-dir`` it saves every
``--checkpoint-every`` steps and says so with ``gpureport.checkpointed``: status.checkpoint (and
``kubectl get -o wide``'s Checkpoint age) follow. A linear regression on data the script
makes: nothing is downloaded; gloo on CPU, nccl on GPUs, under torchrun.
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import gpureport
import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--checkpoint-dir", default=None, help="save checkpoints here (rank 0)")
    parser.add_argument("--checkpoint-every", type=int, default=20)
    args = parser.parse_args()

    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    torch.manual_seed(rank)
    model = torch.nn.Linear(32, 1)
    if distributed:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    truth = torch.randn(32, 1, generator=torch.Generator().manual_seed(0))
    started = time.monotonic()
    loss = torch.tensor(0.0)
    for step in range(1, args.steps + 1):
        inputs = torch.randn(args.batch_size, 32)
        loss = torch.nn.functional.mse_loss(model(inputs), inputs @ truth)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        # Rank 0 alone sends (gpureport checks RANK); a throttled call costs a clock read.
        gpureport.report(
            step=step, total_steps=args.steps, loss=loss.item(),
            samples_per_second=step * args.batch_size * world / (time.monotonic() - started),
        )  # fmt: skip
        if args.checkpoint_dir and rank == 0 and step % args.checkpoint_every == 0:
            save(model, optimizer, step, args.checkpoint_dir)
    gpureport.finish(step=args.steps, total_steps=args.steps, loss=loss.item())
    if rank == 0:
        # What reached the operator. A report that found no server (the operator's leader
        # changing hands) is not lost: the newest is sent again in its place.
        sent = gpureport.default_reporter()
        print(f"progress reports: {sent.delivered} delivered, {sent.failures} failed", flush=True)
    if distributed:
        # The DDP model first, then the group: freed last by the model, the group is torn down
        # holding the GIL that gloo's worker thread may need, and a rank aborts or deadlocks
        # (docs/troubleshooting.md, "A rank aborts or hangs as the training ends").
        del model
        gc.collect()
        dist.destroy_process_group()


def save(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, directory: str) -> None:
    """Write the checkpoint whole (a temporary name, then a rename), then say it is complete:
    said before the rename, a preemption in between would point status at a file not there."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"step-{step:06d}.pt")
    state = {"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict()}
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)
    gpureport.checkpointed(step, path)


if __name__ == "__main__":
    main()
