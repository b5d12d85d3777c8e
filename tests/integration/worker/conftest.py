"""Real `loraplane worker serve` processes on 127.0.0.1 (CPU, tiny models, torch LoRA backend)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from workerkit import TARGETS, WorkerProcess, start_worker


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from loraplane.worker.fixtures.models import make_model

    return make_model(
        tmp_path_factory.mktemp("model") / "tiny-llama",
        "llama",
        seed=0,
        hidden_size=64,
        num_layers=2,
        vocab_size=512,
    )


@pytest.fixture(scope="session")
def adapter_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("adapters")


@pytest.fixture(scope="session")
def make_adapter_dir(tiny_model: Path, adapter_root: Path) -> Callable[..., Path]:
    from loraplane.worker.fixtures.adapters import make_adapter

    def make(name: str, *, seed: int = 0, rank: int = 4, targets: list[str] | None = None) -> Path:
        out = adapter_root / name
        if not out.exists():
            make_adapter(
                tiny_model, out, rank=rank, alpha=2.0 * rank, targets=targets or TARGETS, seed=seed
            )
        return out

    return make


@pytest.fixture
def worker_factory(tiny_model: Path, tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    started: list[WorkerProcess] = []

    def start(*args: str, env: dict[str, str | None] | None = None) -> WorkerProcess:
        worker = start_worker(tiny_model, tmp_path, *args, env=env)
        started.append(worker)
        return worker

    yield start
    for w in started:
        w.stop()
