"""The one `loraplane` command that fronts every process.

Each component owns its sub-command group in its own `cli` module; this file only
mounts them. Sub-command modules import heavy libraries (torch, kopf, SQLAlchemy)
inside their commands, so `loraplane --help` stays fast.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

import typer

# What a command raises when it refuses what it was given: a value (ConfigError, AdapterError,
# pydantic's ValidationError and the other ValueErrors) or a path. Printed as one line.
REFUSALS: tuple[type[Exception], ...] = (
    ValueError,
    FileNotFoundError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
)


def refusal_line(exc: BaseException | str) -> str:
    """``error: …`` on one line: pydantic's errors as ``field: reason; …``, any other
    message with its line breaks folded."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            parts = [
                f"{'.'.join(str(x) for x in e.get('loc', ())) or '?'}: {e.get('msg', '')}"
                for e in errors()
            ]
        except (TypeError, AttributeError):
            parts = []
        if parts:
            return "error: " + "; ".join(parts)
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"error: {text}"


# click's exceptions, from the click that typer uses (its own copy in typer >= 0.25)
_CLICK = sys.modules[typer.BadParameter.__module__]
_ABORT: tuple[type[BaseException], ...] = (typer.Abort, getattr(_CLICK, "Abort", typer.Abort))


class LoraplaneApp(typer.Typer):
    """The `loraplane` command: a refusal (``REFUSALS``) raised by any sub-command, and a
    usage error (a bad or missing option), print one ``error: …`` line on stderr and exit 2;
    LORAPLANE_TRACEBACK=1 shows a refusal's traceback instead (for a bug that raises one)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("standalone_mode", False)  # click's errors come here, not printed
        try:
            code = super().__call__(*args, **kwargs)
        except _CLICK.ClickException as exc:
            if type(exc).__name__ == "NoArgsIsHelpError":  # no arguments: the help, exit 2
                exc.show()
                raise SystemExit(exc.exit_code) from None
            where = f" (see `{exc.ctx.command_path} --help`)" if getattr(exc, "ctx", None) else ""
            print(refusal_line(exc.format_message()) + where, file=sys.stderr)
            raise SystemExit(exc.exit_code) from None
        except _ABORT:
            print("aborted", file=sys.stderr)
            raise SystemExit(1) from None
        except REFUSALS as exc:
            if os.environ.get("LORAPLANE_TRACEBACK") == "1":
                raise
            print(refusal_line(exc), file=sys.stderr)
            raise SystemExit(2) from None
        raise SystemExit(code if isinstance(code, int) else 0)


app = LoraplaneApp(
    name="loraplane",
    help=(
        "Run many LoRA adapters on a fleet of GPU inference workers.\n\n"
        "Start with `make demo` for the whole stack on one machine, or see the\n"
        "README for each process: worker, controlplane, operator, cluster."
    ),
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)

# (module, attribute, name, help): mounted in this order in `loraplane --help`.
_GROUPS: list[tuple[str, str, str, str]] = [
    ("loraplane.worker.cli", "worker_app", "worker", "Serve a model with many LoRA adapters."),
    (
        "loraplane.worker.cli",
        "fixtures_app",
        "fixtures",
        "Write tiny HF checkpoints and PEFT adapters.",
    ),
    (
        "loraplane.worker.cli",
        "check_app",
        "check",
        "Check numerics against HF transformers + PEFT.",
    ),
    ("loraplane.worker.cli", "bench_app", "bench", "Benchmarks that print JSON."),
    (
        "loraplane.controlplane.cli",
        "controlplane_app",
        "controlplane",
        "The registry, router and API.",
    ),
    ("loraplane.operator.cli", "operator_app", "operator", "The Kubernetes operator (kopf)."),
    (
        "loraplane.devcluster.cli",
        "cluster_app",
        "cluster",
        "A real local Kubernetes control plane.",
    ),
    ("loraplane.demo", "demo_app", "demo", "Run the whole stack on this machine."),
]

for _module, _attr, _name, _help in _GROUPS:
    try:
        _group = getattr(importlib.import_module(_module), _attr)
    except ModuleNotFoundError as exc:  # a component not installed in this environment
        if exc.name is not None and exc.name.startswith("loraplane"):
            continue
        raise
    app.add_typer(_group, name=_name, help=_help)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
