# The operator: Kopf and urllib3, no Kubernetes client, no torch. Runs as uid 65532 on a read-only root
# filesystem (the chart's securityContext).
# Build from the repository root:  docker build -f images/operator.Dockerfile -t ghcr.io/gpu-training-operator/operator:$(make -s version) .
FROM python:3.11.11-slim-bookworm

ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /opt/gpuop
COPY pyproject.toml README.md constraints.txt ./
# The distribution holds both packages; the operator imports only gputrain.contract (stdlib).
COPY operator/ operator/
COPY trainer/ trainer/
# Exactly what gpuop imports, at the versions CI tests (constraints.txt), and nothing else:
# --no-deps keeps the trainer extra (torch) out.
RUN python -m pip install --no-deps . \
 && python -m pip install -c constraints.txt kopf urllib3 pyyaml prometheus-client click rich \
 && python -c "import gpuop.controller.app, gpuop.cli.commands" \
 && ! python -c "import torch" 2>/dev/null \
 && ! python -c "import kubernetes" 2>/dev/null \
 && rm -rf /opt/gpuop/operator /opt/gpuop/trainer

# A fixed non-root uid (the chart runs as 65532 and checks runAsNonRoot); no home, no shell.
RUN useradd --uid 65532 --user-group --no-create-home --shell /usr/sbin/nologin gpuop
USER 65532
WORKDIR /tmp

# The operator's own /metrics and /healthz (the chart's metrics.port and health.port).
EXPOSE 8080 8081
ENTRYPOINT ["gpuop"]
CMD ["operator"]
