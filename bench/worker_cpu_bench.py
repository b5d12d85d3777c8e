"""CPU throughput of `loraplane worker serve`: requests/s and tokens/s, LoRA on vs off; one JSON document.

    .venv/bin/python bench/worker_cpu_bench.py --requests 32 --concurrency 8 --max-tokens 16

Starts a real worker process on a tiny fixture model (or --model DIR) and drives it over HTTP.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from loraplane.devcluster.processes import free_port

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [
    "The quick brown fox",
    "Adapters change the",
    "What is the capital",
    "for i in range(10):",
]


def _run(
    url: str, adapters: list[str | None], requests: int, concurrency: int, max_tokens: int
) -> dict[str, float]:
    client = httpx.Client(base_url=url, timeout=600)

    def one(i: int) -> int:
        body: dict = {
            "text": PROMPTS[i % len(PROMPTS)],
            "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
        }
        adapter = adapters[i % len(adapters)]
        if adapter:
            body["lora_path"] = adapter
        r = client.post("/generate", json=body)
        r.raise_for_status()
        return int(r.json()["meta_info"]["completion_tokens"])

    one(0)  # warm-up
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(one, range(requests)))
    wall = time.perf_counter() - t0
    client.close()
    return {
        "requests": requests,
        "wall_s": round(wall, 3),
        "requests_per_s": round(requests / wall, 3),
        "tokens_per_s": round(tokens / wall, 2),
        "generated_tokens": tokens,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--lora-backend", default="torch")
    args = ap.parse_args()

    from loraplane.worker.fixtures.adapters import make_adapter
    from loraplane.worker.fixtures.models import make_model

    tmp = Path(tempfile.mkdtemp(prefix="lp-bench-"))
    model = args.model or make_model(tmp / "tiny-llama", "llama", seed=0)
    names = []
    lora_args: list[str] = []
    for i in range(args.adapters):
        out = make_adapter(
            model,
            tmp / f"a{i}",
            rank=8,
            alpha=16,
            targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            seed=i,
        )
        names.append(f"a{i}")
        lora_args += ["--lora", f"a{i}={out}"]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp / "worker.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            str(REPO / ".venv/bin/loraplane"),
            "worker",
            "serve",
            "--model",
            str(model),
            "--port",
            str(port),
            "--lora-backend",
            args.lora_backend,
            "--max-loras-per-batch",
            str(max(1, args.adapters)),
            "--max-loaded-loras",
            str(max(1, args.adapters)),
            "--max-running",
            str(args.concurrency),
            *lora_args,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ},
    )
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        else:
            sys.exit(f"worker did not start; see {tmp / 'worker.log'}")
        result = {
            "model": str(model),
            "lora_backend": args.lora_backend,
            "concurrency": args.concurrency,
            "max_tokens": args.max_tokens,
            "adapters": args.adapters,
            "lora_off": _run(url, [None], args.requests, args.concurrency, args.max_tokens),
            "lora_on": _run(
                url, list(names) or [None], args.requests, args.concurrency, args.max_tokens
            ),
        }
        off, on = result["lora_off"]["tokens_per_s"], result["lora_on"]["tokens_per_s"]
        result["lora_on_over_off"] = round(on / off, 3) if off else None
        json.dump(result, sys.stdout, indent=2)
        sys.stdout.write("\n")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
