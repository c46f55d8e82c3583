# The GPU trainer: CUDA PyTorch, non-root, `torchrun -m gputrain` ready.
# Build from the repository root:  docker build -f images/trainer.Dockerfile -t gpu-training-operator/trainer:0.1.0 .
FROM pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime

# The base image already holds torch and torchvision built for CUDA; install only what the
# trainer adds, without letting pip replace that torch.
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
WORKDIR /opt/gputrain
COPY pyproject.toml README.md ./
COPY trainer/ trainer/
COPY operator/ operator/
RUN python -m pip install --no-deps . \
 && python -m pip install "prometheus-client>=0.20" "nvidia-ml-py>=12.535" "scikit-learn>=1.3" \
 && python -c "import gputrain.contract, torch, torchvision"

# The uid the operator's pod securityContext runs as (runAsUser: 1000, fsGroup: 1000).
RUN useradd --uid 1000 --create-home --shell /usr/sbin/nologin trainer
USER 1000
ENV HOME=/home/trainer
WORKDIR /home/trainer

# Metrics (Prometheus) and the torch.distributed rendezvous, as in gputrain.contract.
EXPOSE 9090 23456
ENTRYPOINT ["torchrun"]
CMD ["--nproc-per-node=gpu", "-m", "gputrain"]
