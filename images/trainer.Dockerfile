# The GPU trainer: Python 3.11 and PyPI's CUDA build of torch, non-root, `torchrun -m gputrain`.
# Build from the repository root:  docker build -f images/trainer.Dockerfile -t ghcr.io/gpu-training-operator/trainer:$(make -s version) .
# (`make release` builds it with BuildKit from this file, unchanged.)
#
# Two stages meet in the last: `runtime` holds the 5 GB of dependencies and nothing of ours, so a
# change to our code rebuilds only `ours` (seconds) and the final COPY --link, which lays our
# layer on the cached ones without unpacking them.
FROM python:3.11.11-slim-bookworm AS runtime

ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
# PyPI's torch is the CUDA build: its nvidia-* wheels carry the CUDA runtime, cuBLAS, cuDNN and
# NCCL, so the image needs only the NVIDIA driver on the node (the device plugin mounts it), and
# the same image runs on a CPU node with gloo. triton comes with it: torch.compile's GPU kernels.
COPY constraints.txt /tmp/constraints.txt
RUN python -m pip install -c /tmp/constraints.txt torch torchvision prometheus-client nvidia-ml-py scikit-learn obstore \
 && python -c "import torch, torchvision, sklearn, obstore, pynvml, prometheus_client" \
 && rm /tmp/constraints.txt
# A C compiler, for torch.compile: Triton builds its CUDA launcher from C source at a process's
# first compiled kernel (Inductor's CPU kernels are C++). Without one, spec.training.compile's
# default (compile where it pays) stays eager. About 200 MB unpacked; a layer of its own after
# torch's, so that the 5 GB one stays cached.
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ libc6-dev \
 && rm -rf /var/lib/apt/lists/* \
 && cc --version >/dev/null

# The EFA variant (the release's `-efa` tag, for spec.nccl.profile eks-efa): AWS's EFA
# installer puts libfabric and the aws-ofi-nccl plugin under /opt/amazon; the kernel module and
# limits belong to the node, not the image. Empty (the default) builds the plain trainer.
#   docker build --build-arg EFA_INSTALLER_VERSION=1.51.0 -f images/trainer.Dockerfile -t ...:<version>-efa .
ARG EFA_INSTALLER_VERSION=""
RUN if [ -n "$EFA_INSTALLER_VERSION" ]; then \
      apt-get update && apt-get install -y --no-install-recommends curl ca-certificates \
      && curl -fsSL "https://efa-installer.amazonaws.com/aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz" | tar -xz -C /tmp \
      && cd /tmp/aws-efa-installer && ./efa_installer.sh -y --skip-kmod --skip-limit-conf --no-verify \
      && cd / && rm -rf /tmp/aws-efa-installer /var/lib/apt/lists/* \
      && ls /opt/amazon/*ofi-nccl*/lib*/libnccl-net*.so; \
    fi
# NCCL finds its network plugin (libnccl-net*.so) on the library path; the directories are
# absent, and harmless, in the plain image. The installer has used both names.
ENV LD_LIBRARY_PATH=/opt/amazon/ofi-nccl/lib:/opt/amazon/aws-ofi-nccl/lib:/opt/amazon/efa/lib

# The uid the operator's pod securityContext runs as (runAsUser: 1000, fsGroup: 1000), its home
# the working directory. The stage ends with a step that writes a layer: a WORKDIR last would
# have no layer in the layer cache, so every build would unpack the 5 GB to run it again.
WORKDIR /home/trainer
RUN useradd --uid 1000 --home-dir /home/trainer --shell /usr/sbin/nologin trainer \
 && chown 1000:1000 /home/trainer
USER 1000
ENV HOME=/home/trainer

# Our distribution, built apart: it holds the operator's packages too, and --no-deps keeps the
# CLI's and operator's dependencies out (the trainer imports only gputrain).
FROM python:3.11.11-slim-bookworm AS ours
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY trainer/ trainer/
COPY operator/ operator/
RUN python -m pip install --no-deps --root /ours .

# Nothing after the COPY touches the file system: a step that did would unpack the 5 GB below.
FROM runtime
COPY --link --from=ours /ours/ /

# Metrics (Prometheus) and the torch.distributed rendezvous, as in gputrain.contract.
EXPOSE 9090 23456
ENTRYPOINT ["torchrun"]
CMD ["--nproc-per-node=gpu", "-m", "gputrain"]
