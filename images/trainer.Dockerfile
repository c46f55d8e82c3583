# The GPU trainer: CUDA PyTorch, non-root, `torchrun -m gputrain` ready.
# Build from the repository root:  docker build -f images/trainer.Dockerfile -t ghcr.io/gpu-training-operator/trainer:$(make -s version) .
FROM pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime

# The base image already holds torch and torchvision built for CUDA; install only what the
# trainer adds, without letting pip replace that torch.
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
WORKDIR /opt/gputrain
COPY pyproject.toml README.md constraints.txt ./
COPY trainer/ trainer/
COPY operator/ operator/
RUN python -m pip install --no-deps . \
 && python -m pip install -c constraints.txt prometheus-client nvidia-ml-py scikit-learn obstore \
 && python -c "import gputrain.contract, torch, torchvision"

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
ENV LD_LIBRARY_PATH=/opt/amazon/ofi-nccl/lib:/opt/amazon/aws-ofi-nccl/lib:/opt/amazon/efa/lib:${LD_LIBRARY_PATH}

# The uid the operator's pod securityContext runs as (runAsUser: 1000, fsGroup: 1000).
RUN useradd --uid 1000 --create-home --shell /usr/sbin/nologin trainer
USER 1000
ENV HOME=/home/trainer
WORKDIR /home/trainer

# Metrics (Prometheus) and the torch.distributed rendezvous, as in gputrain.contract.
EXPOSE 9090 23456
ENTRYPOINT ["torchrun"]
CMD ["--nproc-per-node=gpu", "-m", "gputrain"]
