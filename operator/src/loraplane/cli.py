"""The one `loraplane` command that fronts every process.

Each component owns its sub-command group in its own `cli` module; this file only
mounts them. Sub-command modules import heavy libraries (torch, kopf, SQLAlchemy)
inside their commands, so `loraplane --help` stays fast.
"""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
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
