"""`loraplane demo run`: the whole stack on this machine, with embedded defaults.

1. Writes a tiny Qwen3 model and three PEFT adapters (fixtures, no downloads).
2. Runs one mixed batch through the worker runtime and prints the parity figures against
   HF transformers + PEFT and merged weights.
3. Starts the control plane (SQLite) and two workers (tp=2, dp=2 with DP attention, CPU) as
   real processes on 127.0.0.1, registers the pool, the workers and the adapters (one
   pinned) through the control plane's API, sends mixed traffic through its router, and
   prints each answer with its adapter and the registry per worker and DP group.

Everything it starts is stopped at the end (Ctrl-C too).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer

from loraplane.devcluster.processes import free_port

demo_app = typer.Typer(no_args_is_help=True, help="Run the whole stack on this machine.")

ADAPTERS = (
    ("sql", 8, 16.0, 1),
    ("poet", 16, 16.0, 2),
    ("pirate", 4, 8.0, 3),
)  # name, rank, alpha, seed
POOL = "demo"


def _say(console: Any, text: str) -> None:
    console.print(f"[bold cyan]==>[/] {text}")


@contextlib.contextmanager
def _processes(logdir: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.time() + 15
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, deadline - time.time()))
            if p.poll() is None:
                p.kill()


def _start(
    procs: list[subprocess.Popen[bytes]], args: list[str], log: Path, env: dict[str, str]
) -> subprocess.Popen[bytes]:
    exe = shutil.which("loraplane") or str(Path(sys.executable).with_name("loraplane"))
    handle = log.open("wb")
    p = subprocess.Popen([exe, *args], stdout=handle, stderr=subprocess.STDOUT, env=env)
    procs.append(p)
    return p


def _wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 300.0) -> None:
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"{url} exited with {proc.returncode}; see {log}:\n{log.read_text()[-2000:]}"
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {timeout:.0f}s; see {log}")


def _check(resp: Any, what: str) -> Any:
    if resp.status_code >= 400:
        raise RuntimeError(f"{what} failed: HTTP {resp.status_code} {resp.text}")
    return resp.json()


@demo_app.command("run")
def run(
    workdir: Annotated[Path, typer.Option(help="Where fixtures, databases and logs go")] = Path(
        ".demo"
    ),
    backend: Annotated[
        str, typer.Option(help="LoRA kernels: torch | triton (triton runs interpreted on CPU)")
    ] = "torch",
    workers: Annotated[int, typer.Option(help="Worker processes (each tp=2, dp=2)")] = 2,
    skip_parity: Annotated[bool, typer.Option(help="Skip the parity check (step 2)")] = False,
) -> None:
    """Run the whole stack on this machine and show adapters served in mixed batches."""
    import httpx
    from rich.console import Console
    from rich.table import Table

    console = Console()
    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    logs = workdir / "logs"
    logs.mkdir(exist_ok=True)

    _say(console, f"fixtures: a tiny Qwen3 model and {len(ADAPTERS)} PEFT adapters in {workdir}")
    from loraplane.worker.fixtures.adapters import make_adapter
    from loraplane.worker.fixtures.models import make_model

    model_dir = workdir / "qwen3-tiny"
    if not (model_dir / "config.json").exists():
        make_model(model_dir, "qwen3", seed=5)
    adapter_dirs: dict[str, Path] = {}
    for name, rank, alpha, seed in ADAPTERS:
        adapter_dirs[name] = workdir / "adapters" / name
        if not (adapter_dirs[name] / "adapter_config.json").exists():
            make_adapter(
                model_dir,
                adapter_dirs[name],
                rank=rank,
                alpha=alpha,
                seed=seed,
                targets=[
                    "q_proj",
                    "k_proj",
                    "v_proj",
                    "o_proj",
                    "gate_proj",
                    "up_proj",
                    "down_proj",
                ],
            )

    if not skip_parity:
        _say(
            console,
            "runtime: one mixed batch (3 adapters + base rows) vs HF transformers + PEFT and merged weights",
        )
        from loraplane.worker.check.parity import check_parity

        report = check_parity(
            model_dir, list(adapter_dirs.items()), prompts=8, max_new_tokens=5, backend=backend
        )
        table = Table("figure", "value", title=f"parity ({backend} kernels, fp32)")
        for key in (
            "max_abs_logprob_diff",
            "max_abs_logprob_diff_merged",
            "mean_abs_logprob_diff",
            "delta_corr",
            "lora_effect",
            "greedy_identical",
            "base_rows_bitwise_equal",
        ):
            value = getattr(report, key)
            table.add_row(key, f"{value:.3g}" if isinstance(value, float) else str(value))
        console.print(table)

    env = dict(os.environ)
    env.setdefault("TRITON_INTERPRET", "1")
    # the workers require this token on their adapter endpoints; the control plane sends it
    worker_token = secrets.token_urlsafe(24)
    env["LORAPLANE_WORKER_ADMIN_TOKEN"] = worker_token
    env["LORAPLANE_WORKERS__ADMIN_TOKEN"] = worker_token
    cp_port = free_port()
    cp = f"http://127.0.0.1:{cp_port}"
    with _processes(logs) as procs:
        _say(console, f"control plane on {cp} (SQLite {workdir / 'registry.db'})")
        db = workdir / "registry.db"
        db.unlink(missing_ok=True)
        cp_proc = _start(
            procs,
            [
                "controlplane",
                "serve",
                "--db",
                f"sqlite:///{db}",
                "--port",
                str(cp_port),
                "--no-auth",
                "--allowed-root",
                str(workdir),
                "--reconcile-interval",
                "5",
            ],
            logs / "controlplane.log",
            env,
        )
        worker_urls: list[tuple[str, str, subprocess.Popen[bytes]]] = []
        for i in range(workers):
            port = free_port()
            name = f"{POOL}-{i}"
            _say(
                console,
                f"worker {name} on 127.0.0.1:{port}: tp=2 dp=2 DP attention, K=4 slots, CPU",
            )
            proc = _start(
                procs,
                [
                    "worker",
                    "serve",
                    "--model",
                    str(model_dir),
                    "--tp",
                    "2",
                    "--dp",
                    "2",
                    "--dp-attention",
                    "--device",
                    "cpu",
                    "--max-loras-per-batch",
                    "4",
                    "--max-loaded-loras",
                    "8",
                    "--max-lora-rank",
                    "32",
                    "--lora-backend",
                    backend,
                    "--allowed-lora-root",
                    str(workdir),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--max-running",
                    "16",
                    "--served-model-name",
                    "qwen3-tiny",
                ],
                logs / f"{name}.log",
                env,
            )
            worker_urls.append((name, f"http://127.0.0.1:{port}", proc))
        _wait_http(f"{cp}/healthz", cp_proc, logs / "controlplane.log")
        for name, url, proc in worker_urls:
            _wait_http(f"{url}/health", proc, logs / f"{name}.log")

        client = httpx.Client(base_url=cp, timeout=120)
        _check(
            client.put(
                f"/v1/pools/default/{POOL}",
                json={
                    "model": str(model_dir),
                    "tp": 2,
                    "dp": 2,
                    "max_loras_per_batch": 4,
                    "max_loaded_loras": 8,
                    "max_lora_rank": 32,
                },
            ),
            "create pool",
        )
        for name, url, _ in worker_urls:
            _check(
                client.post(
                    "/v1/workers",
                    json={
                        "name": name,
                        "namespace": "default",
                        "pool": POOL,
                        "endpoint": url,
                        "dp_size": 2,
                    },
                ),
                f"register worker {name}",
            )
        # Placement "all" means every ready worker: wait until the registry has seen both.
        deadline = time.time() + 120
        while True:
            states = {
                w["name"]: w["state"]
                for w in _check(client.get("/v1/workers"), "list workers")["items"]
            }
            if len(states) == len(worker_urls) and set(states.values()) == {"ready"}:
                break
            if time.time() > deadline:
                raise RuntimeError(f"workers not ready in the registry after 120 s: {states}")
            time.sleep(0.5)
        for i, (name, _, _, _) in enumerate(ADAPTERS):
            pinned = i == 0
            _say(
                console,
                f"register + load adapter {name}{' (pinned)' if pinned else ''} on every worker and DP group",
            )
            _check(
                client.post(
                    "/v1/adapters",
                    json={
                        "namespace": "default",
                        "name": name,
                        "pool": POOL,
                        "source": {"uri": f"file://{adapter_dirs[name]}"},
                        "pinned": pinned,
                        "placement": "all",
                    },
                ),
                f"register adapter {name}",
            )

        _say(
            console,
            "mixed traffic through the router: every adapter and the base model in one burst",
        )
        prompts = [
            "Tell me about the sea",
            "Write a query for users",
            "A short poem on rain",
            "Hello there",
        ]
        jobs = [(model, p) for p in prompts for model in ("sql", "poet", "pirate", "qwen3-tiny")]

        def ask(job: tuple[str, str]) -> tuple[str, str, str]:
            model, prompt = job
            body = _check(
                client.post(
                    "/v1/completions",
                    json={"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0},
                ),
                f"completion for {model}",
            )
            return model, prompt, body["choices"][0]["text"]

        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            answers = list(pool.map(ask, jobs))
        table = Table(
            "adapter", "prompt", "output (greedy, 8 tokens)", title="served in mixed batches"
        )
        for model, prompt, text in answers:
            table.add_row(model if model != "qwen3-tiny" else "[dim]<base>[/]", prompt, repr(text))
        console.print(table)

        _say(console, "registry: which adapter is loaded on which DP group of which worker")
        placements = _check(client.get("/v1/placements"), "list placements")["items"]
        table = Table(
            "worker", "dp_group", "adapter", "state", "version", title="control plane registry"
        )
        for p in sorted(placements, key=lambda p: (p["worker"], p["dp_group"], p["adapter"])):
            table.add_row(
                p["worker"], str(p["dp_group"]), p["adapter"], p["state"], str(p["version"])
            )
        console.print(table)
        table = Table(
            "worker",
            "dp_group",
            "adapters (as the worker reports)",
            "slots",
            title="workers' own view (/lora_state)",
        )
        for name, url, _ in worker_urls:
            state = httpx.get(
                f"{url}/lora_state",
                headers={"Authorization": f"Bearer {worker_token}"},
                timeout=10,
            ).json()
            for g in state["dp_groups"]:
                table.add_row(
                    name,
                    str(g["dp_group"]),
                    ", ".join(sorted(g["adapters"])),
                    f"{g['slots_used']}/{g['slots_total']}",
                )
        console.print(table)
        adapters = _check(client.get("/v1/adapters"), "list adapters")["items"]
        table = Table(
            "adapter", "phase", "routable", "pinned", "rank", "loaded on", title="adapters"
        )
        for a in adapters:
            table.add_row(
                a["name"],
                a["phase"],
                str(a["routable"]),
                str(a["pinned"]),
                str(a["rank"]),
                ", ".join(a["loaded_workers"]),
            )
        console.print(table)
        _say(console, f"done; logs in {logs}. Stopping everything.")
