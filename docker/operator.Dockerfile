# loraplane operator: `loraplane operator run` (kopf). Slim: no torch.
# Build from the repository root:  docker build -f docker/operator.Dockerfile -t ghcr.io/loraplane/operator:0.1.0 .
# Dependencies: the base and the `operator` extra of pyproject.toml.
FROM python:3.11.7-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml setup.py ./
COPY operator/src operator/src
COPY controlplane/src controlplane/src
COPY worker/src worker/src
RUN touch README.md \
 && pip install ".[operator]" \
 && rm -rf /src

USER 10001:10001
WORKDIR /
ENTRYPOINT ["loraplane"]
CMD ["operator", "run", "--help"]
