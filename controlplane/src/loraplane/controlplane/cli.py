"""``loraplane controlplane serve``: the registry, router and API."""

from __future__ import annotations

from typing import Annotated

import typer

controlplane_app = typer.Typer(no_args_is_help=True, help="The registry, router and API.")


@controlplane_app.command()
def serve(
    db: Annotated[
        str | None,
        typer.Option(
            "--db", help="SQLAlchemy URL (env LORAPLANE_DB_URL; default sqlite:///./loraplane.db)"
        ),
    ] = None,
    redis: Annotated[
        str | None,
        typer.Option("--redis", help="redis://host:port/db for events (env LORAPLANE_REDIS_URL)"),
    ] = None,
    host: Annotated[
        str | None, typer.Option(help="bind address (env LORAPLANE_HOST; default 127.0.0.1)")
    ] = None,
    port: Annotated[
        int | None, typer.Option(help="port (env LORAPLANE_PORT; default 8080)")
    ] = None,
    auth: Annotated[
        bool | None,
        typer.Option(
            "--auth/--no-auth",
            help="require bearer tokens (--no-auth: demo only) (env LORAPLANE_AUTH)",
        ),
    ] = None,
    allowed_root: Annotated[
        list[str] | None,
        typer.Option("--allowed-root", help="directory file:// sources may use (repeatable)"),
    ] = None,
    reconcile_interval: Annotated[
        float | None, typer.Option(help="seconds between reconciler passes")
    ] = None,
    log_level: Annotated[str, typer.Option(help="uvicorn log level")] = "info",
) -> None:
    """Serve the control plane; applies database migrations first."""
    import logging

    import uvicorn

    from loraplane.controlplane.app import create_app
    from loraplane.controlplane.settings import Settings

    settings = Settings()
    overrides: dict[str, object] = {}
    if db is not None:
        overrides["db_url"] = db
    if redis is not None:
        overrides["redis_url"] = redis
    if host is not None:
        overrides["host"] = host
    if port is not None:
        overrides["port"] = port
    if auth is not None:
        overrides["auth"] = auth
    settings = settings.model_copy(update=overrides)
    _check_urls(settings.db_url, settings.redis_url)
    if allowed_root:
        from pathlib import Path

        settings.sources.allowed_roots = [Path(p) for p in allowed_root]
    if reconcile_interval is not None:
        settings.reconciler.interval_s = reconcile_interval
    if settings.auth and settings.admin_token is None:
        typer.echo(
            "warning: LORAPLANE_ADMIN_TOKEN is not set; only tokens already in the database work",
            err=True,
        )
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=log_level,
        timeout_keep_alive=settings.keep_alive_s,
    )


def _check_urls(db_url: str, redis_url: str | None) -> None:
    """Refuse (ValueError, one line: ``loraplane.cli``) a URL that cannot be parsed, before
    the server starts and fails inside its lifespan."""
    from urllib.parse import urlparse

    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        make_url(db_url)
    except ArgumentError as exc:
        raise ValueError(
            f"--db / LORAPLANE_DB_URL {db_url!r} is not a SQLAlchemy URL "
            "(e.g. postgresql+psycopg://user@host/db or sqlite:///./loraplane.db)"
        ) from exc
    if redis_url and urlparse(redis_url).scheme not in ("redis", "rediss", "unix"):
        raise ValueError(
            f"--redis / LORAPLANE_REDIS_URL {redis_url!r} must be a redis://host:port/db URL"
        )
