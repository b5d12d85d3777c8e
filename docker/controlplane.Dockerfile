# loraplane control plane: `loraplane controlplane serve` (FastAPI, SQLAlchemy, Redis). Slim: no torch.
# Build from the repository root:  docker build -f docker/controlplane.Dockerfile -t ghcr.io/loraplane/controlplane:0.1.0 .
# Versions: the ones the test suite runs with (.venv).
FROM python:3.11.7-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml setup.py ./
COPY operator/src operator/src
COPY controlplane/src controlplane/src
COPY worker/src worker/src
RUN touch README.md \
 && pip install --no-deps . \
 && pip install "fastapi==0.165.0" "uvicorn==0.54.0" "httpx==0.28.1" "pydantic==2.14.4" \
      "pydantic-settings==2.16.3" "sqlalchemy==2.1.9" "alembic==1.20.1" "psycopg[binary]==3.3.9" \
      "redis==8.1.0" "prometheus-client==0.26.0" "boto3==1.44.8" "safetensors==0.8.0" \
      "numpy==2.4.6" "typer==0.29.2" "rich==15.0.0" "PyYAML==6.0.4" \
 && rm -rf /src \
 && mkdir -p /data && chown 10001:10001 /data

USER 10001:10001
WORKDIR /data
EXPOSE 8080
ENTRYPOINT ["loraplane"]
CMD ["controlplane", "serve", "--host", "0.0.0.0"]
