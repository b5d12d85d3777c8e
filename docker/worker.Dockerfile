# loraplane worker: `loraplane worker serve` (PyTorch + Triton, CUDA). The torch wheel bundles
# the CUDA runtime; the node needs only the NVIDIA driver and device plugin.
# Build from the repository root:  docker build -f docker/worker.Dockerfile -t ghcr.io/loraplane/worker:0.1.0 .
# Dependencies: the base and the `worker` extra of pyproject.toml.
FROM python:3.11.7-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml setup.py ./
COPY operator/src operator/src
COPY controlplane/src controlplane/src
COPY worker/src worker/src
# CUDA torch wheels come from PyTorch's index (TORCH_INDEX), within pyproject.toml's bounds.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
RUN touch README.md \
 && pip install --extra-index-url "$TORCH_INDEX" ".[worker]" \
 && rm -rf /src \
 && mkdir -p /var/cache/loraplane/triton && chown -R 10001:10001 /var/cache/loraplane
# Triton writes each kernel it compiles under its cache; by default that is ~/.triton, and a
# user without a home (10001 here) gets HOME=/, which it cannot write: the first compile
# would fail. Mount a volume here to keep compiled kernels across pod restarts (the warm-up,
# docs/worker-server.md, then compiles nothing).
ENV TRITON_HOME=/var/cache/loraplane TRITON_CACHE_DIR=/var/cache/loraplane/triton

USER 10001:10001
WORKDIR /
EXPOSE 8000
ENTRYPOINT ["loraplane"]
CMD ["worker", "serve", "--help"]
