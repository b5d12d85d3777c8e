"""`loraplane bench serve` says why a window is slow or failed: each process's CPU use, the
worker's own figures from its /metrics, and the failed requests' messages. One bench run on
the CPU starts a real worker on the tiny llama; its base row serves, its row of an adapter the
worker does not hold fails. No timing assertions."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from loraplane.worker.bench.serve import ENGINE_FIGURES, main

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def rows(
    suite: dict[str, tuple[Path, list[tuple[str, Path]]]], tmp_path_factory: pytest.TempPathFactory
) -> list[dict[str, Any]]:
    model_dir, _ = suite["llama"]
    tmp = tmp_path_factory.mktemp("bench-serve")
    out = tmp / "serve.json"
    args = [
        "--model", str(model_dir), "--adapter-names", "ghost", "--device", "cpu",
        "--lora-backend", "torch", "--slots", "1", "--max-running", "4", "--clients", "2",
        "--adapters", "0,1", "--prompt-len", "6", "--output-len", "4", "--vocab", "100",
        "--warmup", "0.5", "--duration", "2", "--workdir", str(tmp), "--out", str(out),
    ]  # fmt: skip
    assert main(args) == 1  # the ghost row's errors
    result: list[dict[str, Any]] = json.loads(out.read_text())["rows"]
    assert [(r["adapters"], r["errors"] > 0) for r in result] == [(0, False), (1, True)]
    return result


def test_a_window_says_how_much_cpu_each_worker_process_used(rows: list[dict[str, Any]]) -> None:
    cpu = rows[0]["cpu"]
    assert {"bench", "worker"} <= set(cpu)
    engine_cores = [k for k in cpu if k.startswith("engine-core:")]
    assert len(engine_cores) == 1 and engine_cores[0].split(":")[1].isdigit()
    assert all(isinstance(v, float | int) and v >= 0 for v in cpu.values())
    assert cpu[engine_cores[0]] > 0  # it served the row's steps


def test_a_window_carries_the_workers_own_figures(rows: list[dict[str, Any]]) -> None:
    engine = rows[0]["engine"]
    assert set(engine) == set(ENGINE_FIGURES)
    assert all(v is None or (isinstance(v, float | int) and v >= 0) for v in engine.values())
    # the prefix cache is looked up for every admitted request (random prompts: misses)
    assert engine["prefix_hit_rate"] == 0.0
    assert engine["decode_steps"] > 0 and engine["mixed_steps"] > 0  # prompts were fed
    assert None not in engine.values(), engine


def test_failed_requests_are_counted_by_their_message(rows: list[dict[str, Any]]) -> None:
    assert rows[0]["error_kinds"] == {}
    kinds = rows[1]["error_kinds"]
    assert len(kinds) == 1
    ((message, count),) = kinds.items()
    assert message.startswith("HTTP 404") and "ghost" in message, message
    assert len(message) <= 120
    assert count == rows[1]["errors"]


def test_engine_figures_are_the_window_deltas_of_the_workers_histograms() -> None:
    """The worker's queue, first-token and step histograms (as prometheus_client writes them,
    under the worker's names) and its prefix lookups (its own metrics), scraped at a window's
    two edges."""
    from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

    from loraplane.worker.bench.serve import EngineMetrics, parse_engine_totals
    from loraplane.worker.server.metrics import WorkerMetrics

    metrics = WorkerMetrics(dp_size=1, max_loras_per_batch=2, max_loaded_loras=2)
    r = CollectorRegistry()
    queue = Histogram("loraplane_worker_queue_seconds", "queue", registry=r)
    first = Histogram("loraplane_worker_first_token_seconds", "first token", registry=r)
    step = Histogram("loraplane_worker_step_seconds", "step", ["kind"], registry=r)

    def scrape() -> dict[str, float]:
        pages = (generate_latest(metrics.registry), generate_latest(r))
        return {k: v for page in pages for k, v in parse_engine_totals(page.decode()).items()}

    queue.observe(5.0)  # before the window: not counted
    metrics.prefix_lookup("a", 16, 20)
    before = scrape()
    queue.observe(0.010)
    queue.observe(0.030)
    first.observe(0.250)
    for _ in range(3):
        step.labels("decode").observe(0.020)
    metrics.prefix_lookup("a", 16, 20)
    metrics.prefix_lookup(None, 0, 20)
    metrics.prefix_lookup("b", 0, 20)
    metrics.prefix_lookup("b", 32, 40)
    assert EngineMetrics.delta(before, scrape()) == {
        "queue_ms_mean": 20.0,
        "first_token_ms_mean": 250.0,
        "decode_steps": 3,
        "mixed_steps": 0,  # its series was never born: none ran
        "decode_step_ms_mean": 20.0,
        "mixed_step_ms_mean": None,
        "prefix_hit_rate": 0.5,
    }
    # a server without these metrics (a gauge of its own only), or a failed scrape: nulls
    other = CollectorRegistry()
    Gauge("loraplane_router_up", "up", registry=other).set(1)
    totals = parse_engine_totals(generate_latest(other).decode())
    assert EngineMetrics.delta(totals, totals) == dict.fromkeys(ENGINE_FIGURES)
    assert EngineMetrics.delta(None, before) == dict.fromkeys(ENGINE_FIGURES)


def test_a_client_side_failure_is_named_by_its_type_and_url_rows_measure_only_the_bench(
    tmp_path: Path,
) -> None:
    """``--url`` at a port nothing listens on: every request fails in the client (aiohttp's
    ClientConnectorError), the scrapes too; the bench measures only its own CPU."""
    from loraplane.devcluster.processes import free_port

    out = tmp_path / "serve.json"
    args = [
        "--url", f"http://127.0.0.1:{free_port()}", "--device", "cpu", "--clients", "1",
        "--adapters", "0", "--prompt-len", "4", "--output-len", "2", "--vocab", "100",
        "--warmup", "0", "--duration", "0.3", "--out", str(out),
    ]  # fmt: skip
    assert main(args) == 1
    (row,) = json.loads(out.read_text())["rows"]
    ((message, count),) = row["error_kinds"].items()
    assert message.startswith("ClientConnectorError: Cannot connect to host"), message
    assert count == row["errors"] > 0
    assert set(row["cpu"]) == {"bench"}
    assert row["engine"] == dict.fromkeys(ENGINE_FIGURES)
