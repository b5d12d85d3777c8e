# loraplane control plane: `loraplane controlplane serve` (FastAPI, SQLAlchemy, Redis). Slim: no torch.
# Build from the repository root:  docker build -f docker/controlplane.Dockerfile -t ghcr.io/loraplane/controlplane:0.1.0 .
# Dependencies: the base and the `controlplane` extra of pyproject.toml.
FROM python:3.11.7-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml setup.py ./
COPY operator/src operator/src
COPY controlplane/src controlplane/src
COPY worker/src worker/src
RUN touch README.md \
 && pip install ".[controlplane]" \
 && rm -rf /src \
 && mkdir -p /data && chown 10001:10001 /data

USER 10001:10001
WORKDIR /data
EXPOSE 8080
ENTRYPOINT ["loraplane"]
CMD ["controlplane", "serve", "--host", "0.0.0.0"]
