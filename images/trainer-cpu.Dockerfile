# The CPU trainer for kind clusters and CI (gloo backend): small, no CUDA libraries.
# Build from the repository root:  docker build -f images/trainer-cpu.Dockerfile -t gpu-training-operator/trainer-cpu:dev .
FROM python:3.11.11-slim-bookworm

ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
WORKDIR /opt/gputrain
# CPU wheels of torch and torchvision come from PyTorch's CPU index; the rest from PyPI. A mirror
# of that index (or PyPI's, whose torch is the CUDA build: ~3 GB more) goes in as a build arg:
#   docker build --build-arg TORCH_INDEX_URL=https://mirror.example.com/whl/cpu ...
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN python -m pip install --index-url "$TORCH_INDEX_URL" torch==2.13.0 torchvision==0.28.0
COPY pyproject.toml README.md constraints.txt ./
COPY trainer/ trainer/
COPY operator/ operator/
RUN python -m pip install --no-deps . \
 && python -m pip install -c constraints.txt prometheus-client nvidia-ml-py scikit-learn obstore \
 && python -c "import gputrain.contract, torch, torchvision, sklearn"

RUN useradd --uid 1000 --create-home --shell /usr/sbin/nologin trainer
USER 1000
ENV HOME=/home/trainer
WORKDIR /home/trainer

EXPOSE 9090 23456
ENTRYPOINT ["torchrun"]
CMD ["--nproc-per-node=1", "-m", "gputrain"]
