# loraplane operator: `loraplane operator run` (kopf). Slim: no torch.
# Build from the repository root:  docker build -f docker/operator.Dockerfile -t ghcr.io/loraplane/operator:0.1.0 .
# Versions: the ones the test suite runs with (.venv).
FROM python:3.11.7-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml setup.py ./
COPY operator/src operator/src
COPY controlplane/src controlplane/src
COPY worker/src worker/src
# The one distribution without its heavy dependencies, then exactly what the operator imports.
RUN touch README.md \
 && pip install --no-deps . \
 && pip install "kopf==1.45.2" "kubernetes==37.0.2" "httpx==0.28.1" "typer==0.29.2" "rich==15.0.0" "PyYAML==6.0.4" \
 && rm -rf /src

USER 10001:10001
WORKDIR /
ENTRYPOINT ["loraplane"]
CMD ["operator", "run", "--help"]
