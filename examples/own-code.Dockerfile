# Your own training code in an image built on ours: our trainer image brings Python 3.11, PyPI's
# CUDA torch (CUDA, cuDNN and NCCL included), torchvision and gpureport; add what your code needs
# and the code. Here: the Hugging Face Trainer of hf-trainer/ and the plain DDP loop of
# plain-loop/, both run by torchrun with the command and args a GpuTraining gives, e.g.
#   spec: {image: registry.example.com/team/own-code:1, command: [torchrun],
#          args: [/workspace/hf-trainer/train.py, --epochs, "3"]}
# Build from examples/:
#   docker build -f own-code.Dockerfile -t registry.example.com/team/own-code:1 .
ARG TRAINER_IMAGE=ghcr.io/gpu-training-operator/trainer:0.1.0
FROM ${TRAINER_IMAGE}

# Pinned, as the versions your code was tried with (these are the ones our tests run).
USER root
RUN python -m pip install --no-cache-dir transformers==5.23.0 accelerate==1.15.0
COPY --chown=1000:1000 hf-trainer/train.py /workspace/hf-trainer/train.py
COPY --chown=1000:1000 plain-loop/train.py /workspace/plain-loop/train.py
RUN chown 1000:1000 /workspace

# Back to the trainer's non-root uid, which the operator's pod securityContext expects.
USER 1000
WORKDIR /workspace
# No entrypoint: the GpuTraining's command and args say what runs.
ENTRYPOINT []
CMD ["python3"]
