"""Joining the process group torchrun (or the training-operator's pods) set up.

Restarts: when torchrun restarts the worker group (``--max-restarts``, elastic membership
changes), the new workers share the agent's TCPStore, which still holds the previous
attempt's keys, and gloo then tries to connect to the dead workers' addresses ("Gloo
connectFullMesh failed ... Connection refused", pytorch/pytorch#135712). Each attempt
therefore keys its rendezvous under its own prefix, from TORCHELASTIC_RESTART_COUNT.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gputrain.contract import CommBackend, ContractError

# Long enough for a slow checkpoint load on one rank; short enough that a dead peer fails
# the job in minutes rather than NCCL's default half hour.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True)
class Cluster:
    """Where this process sits in the job."""

    rank: int
    local_rank: int
    world: int
    device: torch.device
    backend: CommBackend

    @property
    def is_main(self) -> bool:
        """Rank 0 alone logs, writes checkpoints and outputs."""
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        """Local rank 0 serves the pod's metrics and writes its termination message."""
        return self.local_rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1


def _store(restart: str) -> Any:
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(  # type: ignore[attr-defined]
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=COLLECTIVE_TIMEOUT,
        wait_for_workers=False,
    )
    return dist.PrefixStore(f"gputrain/attempt-{restart}/", store)  # type: ignore[attr-defined]


def join(backend: CommBackend) -> Cluster:
    """Join the job's process group (a world of one when not launched by torchrun)."""
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if backend == "nccl":
        if not torch.cuda.is_available() or torch.cuda.device_count() <= local_rank:
            raise ContractError(
                f"GPUTRAIN_BACKEND: nccl needs a CUDA GPU for local rank {local_rank} "
                f"(visible: {torch.cuda.device_count()}); use gloo on CPU"
            )
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if world > 1:
        store = _store(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if store is None:
            dist.init_process_group(backend, timeout=COLLECTIVE_TIMEOUT)
        else:
            dist.init_process_group(
                backend, store=store, rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT
            )
    return Cluster(rank=rank, local_rank=local_rank, world=world, device=device, backend=backend)


def sum_over_ranks(cluster: Cluster, values: Sequence[torch.Tensor | float]) -> list[float]:
    """``values`` summed over every rank, in float64: one collective and one host sync for
    them all (the loop keeps its figures on the device until a logging interval ends)."""
    tensor = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=cluster.device) for v in values])
    if cluster.distributed:
        dist.all_reduce(tensor)
    return [float(v) for v in tensor.tolist()]


def leave(cluster: Cluster) -> None:
    """Leave together: a rank that tears its group down while another still works aborts."""
    if cluster.distributed and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
