"""What a trainer pod needs for its collectives and its data loading: NCCL's environment per
cloud network, and the size of its /dev/shm (DataLoader batches in flight and NCCL's buffers).
Pure.
"""

from __future__ import annotations

from typing import Final

from gpuop._kits.quantity import MI, parse_quantity
from gpuop.api.spec import GpuTrainingSpec

# NCCL environment per cloud network. Values a user sets in spec.nccl.env win.
NCCL_PROFILES: Final[dict[str, dict[str, str]]] = {
    "none": {},
    # EFA through the aws-ofi-nccl plugin; RDMA reads on p4d/p5, fork-safe libfabric because
    # DataLoader workers fork after NCCL initialised.
    "eks-efa": {
        "FI_PROVIDER": "efa",
        "FI_EFA_USE_DEVICE_RDMA": "1",
        "FI_EFA_FORK_SAFE": "1",
        "NCCL_SOCKET_IFNAME": "^lo",
    },
    # Standard GKE pod networking: sockets over eth0, no InfiniBand to probe for.
    "gke": {"NCCL_SOCKET_IFNAME": "eth0", "NCCL_IB_DISABLE": "1"},
    # AKS ND-series: InfiniBand for data, eth0 for bootstrap.
    "aks-infiniband": {
        "NCCL_IB_DISABLE": "0",
        "NCCL_SOCKET_IFNAME": "eth0",
        "NCCL_IB_PCI_RELAXED_ORDERING": "1",
    },
}

# Bytes of one float32 sample as DataLoader workers hand it over through /dev/shm; an upper
# bound for synthetic data, whose shape follows the model.
_SAMPLE_BYTES: Final = {
    "mnist": 1 * 28 * 28 * 4,
    "digits": 1 * 8 * 8 * 4,
    "cifar10": 3 * 32 * 32 * 4,
    "imagefolder": 3 * 224 * 224 * 4,
    "synthetic": 3 * 224 * 224 * 4,
}
_PREFETCH_FACTOR: Final = 2  # PyTorch's DataLoader default
_NCCL_SHM_PER_PROCESS: Final = 64 * MI  # ~33 MiB per communicator; DDP may hold two
_SHM_FLOOR: Final = 512 * MI
_SHM_STEP: Final = 256 * MI


def shm_size_bytes(spec: GpuTrainingSpec) -> int:
    """The /dev/shm size for one worker pod.

    The user's ``shmSize`` when given. Otherwise: per training process, the batches its
    DataLoader workers keep in flight (workers x prefetch x batch x sample size, doubled for
    headroom) plus NCCL's buffers; rounded up to 256Mi, at least 512Mi, at most half the
    memory limit. A tmpfs only takes memory as it is written, so a generous limit is cheap,
    while one too small kills the job with a bus error.
    """
    if spec.shm_size is not None:
        return int(parse_quantity(spec.shm_size))
    sample = _SAMPLE_BYTES[spec.dataset.name] if spec.dataset is not None else _SAMPLE_BYTES["synthetic"]
    loader_workers = spec.dataset.loader_workers if spec.dataset is not None else 0
    in_flight = loader_workers * _PREFETCH_FACTOR * spec.training.batch_size * sample * 2
    nccl = _NCCL_SHM_PER_PROCESS if spec.uses_gpus else 0
    wanted = max(_SHM_FLOOR, spec.processes_per_worker * (in_flight + nccl))
    size = -(-wanted // _SHM_STEP) * _SHM_STEP
    if spec.resources.memory is not None:
        half = int(parse_quantity(spec.resources.memory)) // 2 // MI * MI
        size = min(size, max(half, 64 * MI))
    return size


def nccl_env(spec: GpuTrainingSpec) -> dict[str, str]:
    """NCCL variables: the profile's, then NCCL_DEBUG, then the user's overrides. None on CPU."""
    if not spec.uses_gpus:
        return {}
    env = dict(NCCL_PROFILES[spec.nccl.profile])
    if spec.nccl.debug:
        env["NCCL_DEBUG"] = spec.nccl.debug
    env.update(spec.nccl.env)
    return env
