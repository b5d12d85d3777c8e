"""Control-plane benchmark; prints one JSON document.

1. Fan-out and merge over 2..64 simulated DP groups: the control plane's `_fanout` + fail-first
   merge over N in-process targets that answer after a fixed delay, so `overhead_ms` is what the
   control plane adds on top of the slowest target (scheduling, timing, merge).
2. Registry operations per second through the HTTP API (FastAPI + SQLAlchemy), on PostgreSQL
   (``--pg-url``, e.g. ``$LORAPLANE_TEST_PG_URL``) and SQLite: adapter registrations (each a
   journalled operation with preflight), adapter reads, and operation-journal reads.

    python bench/controlplane_bench.py --pg-url "$LORAPLANE_TEST_PG_URL" > bench/results/controlplane.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import sqlalchemy as sa

from loraplane.controlplane.events import EventBus
from loraplane.controlplane.merge import UpdateResult, merge_results
from loraplane.controlplane.metrics import Metrics
from loraplane.controlplane.operations import Inflight, Operations, WorkerRef

ADMIN = {"Authorization": "Bearer bench"}


async def fanout_case(groups: int, delay_s: float, repeats: int) -> dict[str, Any]:
    metrics = Metrics()
    ops = Operations(None, None, EventBus(metrics), metrics, Inflight())  # type: ignore[arg-type]
    targets = [WorkerRef(i, f"w{i}", f"http://w{i}", 1) for i in range(groups)]

    async def answer(target: WorkerRef) -> UpdateResult:
        await asyncio.sleep(delay_s)
        if target.id == groups - 1:
            return UpdateResult(False, f"group {target.id}: injected", {})
        return UpdateResult(True, "", {"a": "/a"})

    walls = []
    for _ in range(repeats):
        start = time.perf_counter()
        results, _per_target = await ops._fanout("load", targets, answer)
        merged = merge_results(results)
        walls.append(time.perf_counter() - start)
        assert merged.success is False
    walls_ms = sorted(w * 1000 for w in walls)
    return {
        "dp_groups": groups,
        "target_delay_ms": delay_s * 1000,
        "p50_ms": round(statistics.median(walls_ms), 3),
        "p99_ms": round(walls_ms[int(0.99 * (len(walls_ms) - 1))], 3),
        "overhead_ms_p50": round(statistics.median(walls_ms) - delay_s * 1000, 3),
    }


def write_adapter(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": 8,
                "lora_alpha": 16,
                "target_modules": ["q_proj", "v_proj"],
                "base_model_name_or_path": "/models/bench",
            }
        )
    )
    header: dict[str, Any] = {}
    blobs = []
    offset = 0
    for module in ("q_proj", "v_proj"):
        for part, shape in (("lora_A", [8, 256]), ("lora_B", [256, 8])):
            raw = np.random.default_rng(0).standard_normal(shape).astype(np.float32).tobytes()
            header[f"base_model.model.layers.0.self_attn.{module}.{part}.weight"] = {
                "dtype": "F32",
                "shape": shape,
                "data_offsets": [offset, offset + len(raw)],
            }
            offset += len(raw)
            blobs.append(raw)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    (directory / "adapter_model.safetensors").write_bytes(
        len(encoded).to_bytes(8, "little") + encoded + b"".join(blobs)
    )
    return directory


def registry_case(db_url: str, n: int, tmp: Path) -> dict[str, Any]:
    from fastapi.testclient import TestClient

    from loraplane.controlplane.app import create_app
    from loraplane.controlplane.settings import Settings

    settings = Settings(db_url=db_url, admin_token="bench", redis_url=None)
    settings.sources.allowed_roots = [tmp]
    settings.reconciler.enabled = False
    adapter = write_adapter(tmp / "bench-adapter")
    with TestClient(create_app(settings)) as client:
        client.put(
            "/v1/pools/default/bench",
            headers=ADMIN,
            json={
                "model": "/models/bench",
                "tp": 1,
                "dp": 1,
                "max_loras_per_batch": 4,
                "max_loaded_loras": 8,
                "max_lora_rank": 64,
            },
        )
        start = time.perf_counter()
        for i in range(n):
            response = client.post(
                "/v1/adapters",
                headers={**ADMIN, "Idempotency-Key": f"bench-{i}"},
                json={
                    "name": f"a{i}",
                    "pool": "bench",
                    "source": {"uri": f"file://{adapter}"},
                    "load": False,
                },
            )
            assert response.status_code == 201, response.text
        registrations = n / (time.perf_counter() - start)
        start = time.perf_counter()
        for i in range(n):
            assert client.get(f"/v1/adapters/default/a{i}", headers=ADMIN).status_code == 200
        reads = n / (time.perf_counter() - start)
        start = time.perf_counter()
        for i in range(n):  # idempotent replays: journal lookups
            response = client.post(
                "/v1/adapters",
                headers={**ADMIN, "Idempotency-Key": f"bench-{i}"},
                json={
                    "name": f"a{i}",
                    "pool": "bench",
                    "source": {"uri": f"file://{adapter}"},
                    "load": False,
                },
            )
            assert response.status_code == 201
        replays = n / (time.perf_counter() - start)
    return {
        "database": sa.engine.make_url(db_url).get_backend_name(),
        "operations": n,
        "registrations_per_s": round(registrations, 1),
        "adapter_reads_per_s": round(reads, 1),
        "idempotent_replays_per_s": round(replays, 1),
    }


def fresh_pg_database(url: str) -> tuple[str, sa.Engine, str]:
    base = sa.engine.make_url(url)
    name = f"lp_bench_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    return base.set(database=name).render_as_string(hide_password=False), admin, name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--pg-url", help="PostgreSQL server URL (a scratch database is created and dropped)"
    )
    parser.add_argument("--operations", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--delay-ms", type=float, default=5.0)
    args = parser.parse_args()

    fanout = [
        asyncio.run(fanout_case(g, args.delay_ms / 1000, args.repeats))
        for g in (2, 4, 8, 16, 32, 64)
    ]
    registry = []
    with tempfile.TemporaryDirectory() as tmp:
        registry.append(registry_case(f"sqlite:///{tmp}/bench.db", args.operations, Path(tmp)))
        if args.pg_url:
            url, admin, name = fresh_pg_database(args.pg_url)
            try:
                registry.append(registry_case(url, args.operations, Path(tmp)))
            finally:
                with admin.connect() as conn:
                    conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    json.dump(
        {
            "benchmark": "controlplane",
            "python": sys.version.split()[0],
            "machine": platform.machine(),
            "fanout": fanout,
            "registry": registry,
        },
        sys.stdout,
        indent=2,
    )
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
