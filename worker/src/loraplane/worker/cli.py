"""Worker-side commands: `worker`, `fixtures`, `check`, `bench`.

Heavy imports (torch, transformers) happen inside the commands so `--help` stays fast.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

worker_app = typer.Typer(no_args_is_help=True, help="Serve a model with many LoRA adapters.")
fixtures_app = typer.Typer(
    no_args_is_help=True, help="Write tiny HF-format checkpoints and PEFT adapters."
)
check_app = typer.Typer(
    no_args_is_help=True, help="Check the runtime against independent references."
)
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks; each prints one JSON document.")


def _fail(message: str) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


@fixtures_app.command("make-model")
def make_model_cmd(
    arch: Annotated[str, typer.Option(help="llama | qwen2 | qwen3 | qwen3-moe")],
    out: Annotated[
        Path, typer.Option(help="Directory to write config.json, model.safetensors, tokenizer")
    ],
    seed: Annotated[int, typer.Option(help="Seed of the random weights")] = 0,
    dtype: Annotated[str, typer.Option(help="float32 | bfloat16")] = "float32",
    hidden: Annotated[int, typer.Option(help="hidden_size")] = 64,
    layers: Annotated[int, typer.Option(help="num_hidden_layers")] = 2,
    heads: Annotated[int, typer.Option(help="num_attention_heads")] = 4,
    kv_heads: Annotated[int, typer.Option(help="num_key_value_heads")] = 2,
    intermediate: Annotated[int, typer.Option(help="intermediate_size (dense MLP)")] = 128,
    vocab: Annotated[int, typer.Option(help="vocab_size")] = 512,
    experts: Annotated[int, typer.Option(help="num_experts (qwen3-moe)")] = 8,
    experts_per_tok: Annotated[int, typer.Option(help="num_experts_per_tok (qwen3-moe)")] = 2,
    moe_intermediate: Annotated[int, typer.Option(help="moe_intermediate_size (qwen3-moe)")] = 32,
) -> None:
    """Write a small random model as a real HF checkpoint (loads with transformers)."""
    from loraplane.worker.fixtures.models import make_model

    archs = ("llama", "qwen2", "qwen3", "qwen3-moe")
    if arch not in archs:
        _fail(f"--arch {arch!r} is not supported; expected one of {', '.join(archs)}")
    if dtype not in ("float32", "bfloat16"):
        _fail(f"--dtype {dtype!r} is not supported; expected float32 or bfloat16")
    path = make_model(
        out,
        arch,  # type: ignore[arg-type]
        seed=seed,
        dtype=dtype,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        intermediate_size=intermediate,
        vocab_size=vocab,
        num_experts=experts,
        num_experts_per_tok=experts_per_tok,
        moe_intermediate_size=moe_intermediate,
    )
    typer.echo(str(path))


@fixtures_app.command("make-adapter")
def make_adapter_cmd(
    model: Annotated[Path, typer.Option(help="The base model directory")],
    rank: Annotated[int, typer.Option(help="LoRA rank r")],
    alpha: Annotated[float, typer.Option(help="lora_alpha (scaling = alpha / r)")],
    targets: Annotated[
        str, typer.Option(help="Comma-separated target modules, e.g. q_proj,v_proj,down_proj")
    ],
    out: Annotated[
        Path,
        typer.Option(help="Directory to write adapter_config.json and adapter_model.safetensors"),
    ],
    seed: Annotated[int, typer.Option(help="Seed of the random A and B")] = 0,
    experts: Annotated[
        bool,
        typer.Option("--experts/--no-experts", help="Also target the routed experts (qwen3-moe)"),
    ] = False,
    init_scale: Annotated[
        float,
        typer.Option(
            help="Size of the LoRA term relative to the base projection's output (0.08: moderate)"
        ),
    ] = 0.08,
) -> None:
    """Write a PEFT-format LoRA adapter with non-zero A and B for a base model."""
    from loraplane.worker.fixtures.adapters import make_adapter

    if not (model / "config.json").is_file():
        _fail(f"--model {model} has no config.json; make one with `loraplane fixtures make-model`")
    path = make_adapter(
        model,
        out,
        rank=rank,
        alpha=alpha,
        targets=[t for t in targets.split(",") if t],
        seed=seed,
        experts=experts,
        init_scale=init_scale,
    )
    typer.echo(str(path))


def _parse_adapters(specs: list[str]) -> list[tuple[str, str]]:
    adapters = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            _fail(f"--adapter {spec!r} must be NAME=DIR")
        adapters.append((name, path))
    return adapters


@check_app.command("parity")
def parity_cmd(
    model: Annotated[Path, typer.Option(help="HF-format model directory")],
    adapter: Annotated[
        list[str], typer.Option(help="NAME=DIR of a PEFT adapter; repeat for several")
    ] = [],  # noqa: B006
    prompts: Annotated[
        int, typer.Option(help="Prompts in the mixed batch (spread over adapters and none)")
    ] = 10,
    max_new_tokens: Annotated[int, typer.Option(help="Greedy tokens to decode per prompt")] = 6,
    backend: Annotated[str, typer.Option(help="LoRA kernels: triton | torch")] = "triton",
    device: Annotated[str, typer.Option(help="cpu | cuda")] = "cpu",
    dtype: Annotated[
        str | None, typer.Option(help="float32 | bfloat16 (default: the checkpoint's)")
    ] = None,
    tp: Annotated[int, typer.Option(help="Tensor-parallel ranks (started by this command)")] = 1,
    dp: Annotated[int, typer.Option(help="DP-attention groups (tp must be divisible by dp)")] = 1,
    dp_attention: Annotated[
        bool, typer.Option("--dp-attention/--no-dp-attention", help="Attention per DP group")
    ] = False,
    idle_rank: Annotated[
        int | None, typer.Option(help="Give this DP group no requests (idle rank test)")
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the prompts")] = 0,
    fp32_reference: Annotated[
        bool,
        typer.Option(
            "--fp32-reference",
            help="Also compare our run and HF + PEFT in --dtype against HF + PEFT in fp32 "
            "(one rank): is a gap ours or the dtype's?",
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object")] = False,
) -> None:
    """Run one mixed batch through our runtime and HF transformers + PEFT (and merged weights)."""
    if backend not in ("triton", "torch"):
        _fail(f"--backend {backend!r} is not supported; expected triton or torch")
    if fp32_reference and (tp > 1 or dp > 1):
        _fail("--fp32-reference runs with one rank; drop --tp / --dp")
    adapters = _parse_adapters(adapter)
    if tp > 1 or dp > 1:
        from loraplane.worker.check.parity_dist import check_parity_dist

        report = check_parity_dist(
            model,
            adapters,
            prompts=prompts,
            max_new_tokens=max_new_tokens,
            backend=backend,
            device=device,
            dtype=dtype,
            seed=seed,
            tp=tp,
            dp=dp,
            dp_attention=dp_attention,
            idle_rank=idle_rank,
        )
    else:
        from loraplane.worker.check.parity import check_parity

        report = check_parity(
            model,
            adapters,
            prompts=prompts,
            max_new_tokens=max_new_tokens,
            backend=backend,
            device=device,
            dtype=dtype,
            seed=seed,
            fp32_reference=fp32_reference,
        )
    data = report.as_dict()
    if as_json:
        json.dump(data, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"parity: {data['arch']} {data['dtype']} backend={data['backend']}")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key, value in data.items():
        if key in ("arch", "dtype", "backend", "extra"):
            continue
        table.add_row(key, f"{value:.3g}" if isinstance(value, float) else str(value))
    for key, value in data.get("extra", {}).items():
        if isinstance(value, dict):  # fp32_reference: one row per figure
            for sub, v in value.items():
                table.add_row(f"{key}.{sub}", f"{v:.3g}" if isinstance(v, float) else str(v))
            continue
        table.add_row(key, f"{value:.3g}" if isinstance(value, float) else str(value))
    Console().print(table)


@worker_app.command("serve")
def serve_cmd(
    model: Annotated[
        Path,
        typer.Option(help="HF-format model directory (config.json, safetensors, tokenizer.json)"),
    ],
    tp: Annotated[int, typer.Option(help="Tensor-parallel ranks")] = 1,
    dp: Annotated[int, typer.Option(help="DP-attention groups (tp must be divisible by dp)")] = 1,
    dp_attention: Annotated[
        bool, typer.Option("--dp-attention/--no-dp-attention", help="Attention per DP group")
    ] = False,
    device: Annotated[str, typer.Option(help="cpu | cuda")] = "cpu",
    dtype: Annotated[
        str | None, typer.Option(help="float32 | bfloat16 (default: the checkpoint's)")
    ] = None,
    max_loras_per_batch: Annotated[
        int, typer.Option(help="K: GPU LoRA slots; distinct adapters per batch")
    ] = 4,
    max_loaded_loras: Annotated[int, typer.Option(help="M: adapters kept in host memory")] = 8,
    max_lora_rank: Annotated[int, typer.Option(help="R: largest adapter rank a slot holds")] = 64,
    stage_slots: Annotated[
        int | None,
        typer.Option(
            help="P: adapters of rank R whose A rows sit under the base weights (and a copy of "
            "whose B sits beside them), so a batch of that many adapters shrinks in one GEMM "
            "and expands inside the next kernel "
            "(CUDA, one rank: decode and prompt-step graphs, eager batches of up to 256 rows); "
            "adapters of a lower rank r get P*R/r positions in the same memory, at most K. "
            "0: off. "
            "Default: enough for every slot's adapter at rank 16 (K*16/R), from 4 to 8; "
            "16 on a model with routed experts (only its attention stacks)",
            show_default=False,
        ),
    ] = None,
    lora: Annotated[
        list[str], typer.Option(help="NAME=PATH of an adapter to load at start; repeat")
    ] = [],  # noqa: B006
    pinned: Annotated[
        list[str], typer.Option(help="NAME of a --lora adapter to pin (never evicted); repeat")
    ] = [],  # noqa: B006
    host: Annotated[str, typer.Option(help="Address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on")] = 30000,
    lora_backend: Annotated[str, typer.Option(help="LoRA kernels: triton | torch")] = "triton",
    cuda_graphs: Annotated[
        bool,
        typer.Option(
            help="Replay decode steps from CUDA graphs (CUDA, every rank its own; else ignored)"
        ),
    ] = True,
    graph_max_tokens: Annotated[
        int,
        typer.Option(
            help="Replay prompt steps (prefills, prompt chunks beside running decodes) of up "
            "to this many tokens from CUDA graphs, one per token bucket, captured in the "
            "warm-up (one rank, with --cuda-graphs); longer steps run eagerly, where the "
            "GPU's time covers their launches. 0: every prompt step eagerly"
        ),
    ] = 1024,
    overlap: Annotated[
        bool,
        typer.Option(
            "--overlap/--no-overlap",
            help="Overlapped steps: launch the next step before reading this one's tokens, "
            "which are read one step late (ADR 0014), on one rank or on every rank of "
            "--tp/--dp; --no-overlap steps in turn",
        ),
    ] = True,
    chunked_prefill_size: Annotated[
        int | None,
        typer.Option(
            help="Prompt tokens fed per step at most, across the requests being prefilled: a "
            "long prompt goes in chunks between the running requests' decode steps instead "
            "of stalling them for its whole prefill (ADR 0017). 0 feeds whole prompts. "
            "Default: a step's tokens, its decode rows included, stay under --graph-max-tokens "
            "where prompt steps replay graphs (one rank, CUDA graphs on), so every step "
            "replays one; 4096 prompt tokens a step elsewhere",
            show_default=False,
        ),
    ] = None,
    warmup: Annotated[
        bool | None,
        typer.Option(
            "--warmup/--no-warmup",
            help="Before listening, run the steps that compile the Triton kernels and capture "
            "the decode graphs (base, sampler, LoRA in 1..K slots of a blank adapter), so the "
            "first requests do not wait for them. Default: on with --device cuda",
            show_default=False,
        ),
    ] = None,
    sampler: Annotated[
        str,
        typer.Option(
            help="How sampled requests pick their tokens: auto (triton on a GPU, torch on a "
            "CPU) | triton (one fused launch a step) | torch (torch ops on the device; the "
            "same tokens for a seed, up to rounding)"
        ),
    ] = "auto",
    allowed_lora_root: Annotated[
        list[str], typer.Option(help="Adapter paths must lie under one of these; repeat")
    ] = [],  # noqa: B006
    enable_fault_injection: Annotated[
        bool, typer.Option(help="Test only: enable POST /debug/fault")
    ] = False,
    max_running: Annotated[
        int, typer.Option(help="At most this many running requests per DP group")
    ] = 32,
    max_model_len: Annotated[
        int | None, typer.Option(help="Prompt + generated tokens per request")
    ] = None,
    kv_tokens: Annotated[
        int | None,
        typer.Option(
            help="KV-cache positions per DP group (pages of 16). Default: on CUDA what "
            "--mem-fraction leaves; on a CPU --max-running x --max-model-len",
            show_default=False,
        ),
    ] = None,
    mem_fraction: Annotated[
        float,
        typer.Option(
            help="Share of the GPU's memory for the weights, LoRA slots and KV pool; the rest "
            "is left to activations and CUDA graphs"
        ),
    ] = 0.85,
    served_model_name: Annotated[
        str | None, typer.Option(help="Base model id in /v1/models (default: dir name)")
    ] = None,
    log_level: Annotated[str, typer.Option(help="debug | info | warning")] = "info",
    engine_process: Annotated[
        bool,
        typer.Option(
            "--engine-process/--no-engine-process",
            help="Run the engine core (scheduler, executor, warm-up) in a process of its own, "
            "apart from the HTTP front end, so its steps never wait on the front end's "
            "Python; --no-engine-process runs it on a thread of the front end's process",
        ),
    ] = True,
    max_request_bytes: Annotated[
        int, typer.Option(help="A request body larger than this is refused with 413")
    ] = 16 * 1024 * 1024,
    keep_alive_timeout: Annotated[
        int,
        typer.Option(
            help="Seconds an idle keep-alive connection stays open. Keep it above what the "
            "clients (the router: 30 s) keep one idle, so they close first: a connection the "
            "worker closes just as a client reuses it fails that request"
        ),
    ] = 75,
    admin_token_file: Annotated[
        str | None,
        typer.Option(
            help="File holding the bearer token the adapter and debug endpoints require "
            "(default: $LORAPLANE_WORKER_ADMIN_TOKEN; neither: no token is required)"
        ),
    ] = None,
) -> None:
    """Serve a model with many LoRA adapters over HTTP (SGLang- and OpenAI-compatible)."""
    from loraplane.worker.config import ConfigError, ModelConfig
    from loraplane.worker.lora.adapter import AdapterError
    from loraplane.worker.server.factory import ServeConfig
    from loraplane.worker.server.serve import serve

    loras = []
    for spec in lora:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            _fail(f"--lora {spec!r} must be NAME=PATH")
        loras.append((name, path))
    try:
        # config.json's refusals here, before any engine process or rank starts
        ModelConfig.from_dir(model)
        config = ServeConfig(
            model=str(model),
            tp=tp,
            dp=dp,
            dp_attention=dp_attention,
            device=device,
            dtype=dtype,
            max_loras_per_batch=max_loras_per_batch,
            max_loaded_loras=max_loaded_loras,
            max_lora_rank=max_lora_rank,
            stage_slots=stage_slots,
            lora_backend=lora_backend,
            cuda_graphs=cuda_graphs,
            graph_max_tokens=graph_max_tokens,
            warmup=warmup,
            sampler=sampler,
            max_running=max_running,
            max_model_len=max_model_len,
            kv_tokens=kv_tokens,
            mem_fraction=mem_fraction,
            loras=tuple(loras),
            pinned=tuple(pinned),
            allowed_lora_roots=tuple(allowed_lora_root),
            enable_fault_injection=enable_fault_injection,
            served_model_name=served_model_name,
            host=host,
            port=port,
            log_level=log_level,
            overlap=overlap,
            chunked_prefill_size=chunked_prefill_size,
            engine_process=engine_process,
            max_request_bytes=max_request_bytes,
            keep_alive_s=keep_alive_timeout,
            admin_token_file=admin_token_file,
        )
        serve(config)
    except (ConfigError, AdapterError) as exc:
        _fail(str(exc))


_PASSTHROUGH = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


@bench_app.command("kernels", context_settings=_PASSTHROUGH)
def bench_kernels_cmd(ctx: typer.Context) -> None:
    """Shrink/expand (plain, stacked, MoE) vs peak copy bandwidth, torch and cuBLAS; `--help` for options."""
    from loraplane.worker.bench.kernels import main

    raise typer.Exit(main(list(ctx.args)))


@bench_app.command("decode", context_settings=_PASSTHROUGH)
def bench_decode_cmd(ctx: typer.Context) -> None:
    """End-to-end decode tokens/s, LoRA off vs on (1/4/16 adapters); `--help` for options."""
    from loraplane.worker.bench.decode import main

    raise typer.Exit(main(list(ctx.args)))


@bench_app.command("prefill-attention", context_settings=_PASSTHROUGH)
def bench_prefill_attention_cmd(ctx: typer.Context) -> None:
    """A mixed step's attention on CUDA: prompt chunks in one Triton launch vs SDPA per chunk."""
    from loraplane.worker.bench.prefill_attention import main

    raise typer.Exit(main(list(ctx.args)))


@bench_app.command("serve", context_settings=_PASSTHROUGH)
def bench_serve_cmd(ctx: typer.Context) -> None:
    """Streaming clients over HTTP (or in-process): out tok/s, TTFT, ITL, GPU busy; `--help` for options."""
    from loraplane.worker.bench.serve import main

    raise typer.Exit(main(list(ctx.args)))


@bench_app.command("router", context_settings=_PASSTHROUGH)
def bench_router_cmd(ctx: typer.Context) -> None:
    """The control plane's router: routed vs direct streams to a stub upstream (added TTFT, gap)."""
    _run_bench_script("router_bench.py", ctx.args)


@bench_app.command("worker-cpu", context_settings=_PASSTHROUGH)
def bench_worker_cpu_cmd(ctx: typer.Context) -> None:
    """Requests/s and tokens/s of a real `worker serve` process on CPU, LoRA on vs off."""
    _run_bench_script("worker_cpu_bench.py", ctx.args)


def _run_bench_script(name: str, args: list[str]) -> None:
    """Run ``bench/<name>`` of the source checkout as ``__main__`` with ``args``."""
    import runpy

    script = Path(__file__).resolve().parents[4] / "bench" / name
    if not script.is_file():
        _fail(f"{script} not found: this command runs from a source checkout")
    sys.argv = [str(script), *args]
    runpy.run_path(str(script), run_name="__main__")
