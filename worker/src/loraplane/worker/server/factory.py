"""Build the executor a worker runs on: `make_executor` is the one place that knows which
(tp, dp, dp_attention) combinations exist. The multi-rank executor plugs in here."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from loraplane.worker.config import ConfigError, LoRARuntimeConfig, ModelConfig
from loraplane.worker.engine.compile_watch import settle_heap
from loraplane.worker.engine.engine import Engine, EngineObserver, FaultHook
from loraplane.worker.engine.executor import Executor
from loraplane.worker.engine.pages import pages_for
from loraplane.worker.engine.sampling import SAMPLERS
from loraplane.worker.engine.tokenizer import TextTokenizer
from loraplane.worker.engine.warmup import plan_for, warm_up

log = logging.getLogger(__name__)

# Prompt tokens a step at most by default where no prompt-step graph bounds a step (ADR 0017).
DEFAULT_CHUNK = 4096


@dataclass(frozen=True, slots=True)
class ServeConfig:
    model: str
    tp: int = 1
    dp: int = 1
    dp_attention: bool = False
    device: str = "cpu"
    dtype: str | None = None
    max_loras_per_batch: int = 4
    max_loaded_loras: int = 8
    max_lora_rank: int = 64
    stage_slots: int | None = None  # None: the model's default (lora.stage.default_positions)
    lora_backend: str = "triton"
    sampler: str = "auto"  # engine.sampling.SAMPLERS
    cuda_graphs: bool = True  # decode steps replayed from CUDA graphs (CUDA; every rank its own)
    graph_max_tokens: int = 1024  # prompt steps of up to this many tokens from graphs; 0: none
    warmup: bool | None = None  # engine.warmup before serving; None: on CUDA only
    max_running: int = 32  # a cap on running requests per DP group (page-table rows)
    max_model_len: int | None = None  # None: min(config max_position_embeddings, 4096)
    # The paged KV pool per DP group (ADR 0015): ``kv_tokens`` positions when given; else on
    # CUDA what ``mem_fraction`` of the GPU's memory leaves beside the weights and LoRA slots
    # (at most max_running full-length requests); else max_running x max_model_len.
    kv_tokens: int | None = None
    mem_fraction: float = 0.85
    loras: tuple[tuple[str, str], ...] = ()
    pinned: tuple[str, ...] = ()
    allowed_lora_roots: tuple[str, ...] = ()
    enable_fault_injection: bool = False
    served_model_name: str | None = None
    engine_process: bool = True  # the engine core in a process of its own (ADR 0012)
    overlap: bool = True  # overlapped steps, one rank or several (ADR 0014)
    # Prompt tokens a step at most; 0: whole prompts; None: a step fits the largest prompt-step
    # graph, else DEFAULT_CHUNK (``step_budget``, ADR 0017).
    chunked_prefill_size: int | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    log_level: str = "info"
    max_request_bytes: int = 16 * 1024 * 1024  # a larger body is refused with 413
    # An idle keep-alive connection stays open this long. Longer than its clients keep one
    # idle (the router 30 s, httpx 5 s), so the client closes first: a server that closes a
    # connection as a client reuses it fails that request (a reset the client reports).
    keep_alive_s: int = 75
    admin_token_file: str | None = None  # adapter and debug endpoints need this bearer token

    def __post_init__(self) -> None:
        if self.tp < 1 or self.dp < 1:
            raise ConfigError(f"--tp ({self.tp}) and --dp ({self.dp}) must be >= 1")
        if self.tp % self.dp:
            raise ConfigError(f"--tp ({self.tp}) must be divisible by --dp ({self.dp})")
        if self.dp > 1 and not self.dp_attention:
            raise ConfigError(
                f"--dp {self.dp} needs --dp-attention (data parallelism is DP attention inside one TP group)"
            )
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"--device {self.device!r} is not supported; expected cpu or cuda")
        if self.lora_backend not in ("triton", "torch"):
            raise ConfigError(
                f"--lora-backend {self.lora_backend!r} is not supported; expected triton or torch"
            )
        if self.sampler not in SAMPLERS:
            raise ConfigError(
                f"--sampler {self.sampler!r} is not supported; expected one of {', '.join(SAMPLERS)}"
            )
        if not 1 <= self.keep_alive_s <= 3600:
            raise ConfigError(
                f"--keep-alive-timeout must be in 1..3600 seconds, got {self.keep_alive_s}"
            )
        if self.max_request_bytes < 1024:
            raise ConfigError(f"--max-request-bytes must be >= 1024, got {self.max_request_bytes}")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size < 0:
            raise ConfigError(
                f"--chunked-prefill-size must be >= 0 (0 feeds whole prompts), "
                f"got {self.chunked_prefill_size}"
            )
        if self.graph_max_tokens < 0:
            raise ConfigError(
                f"--graph-max-tokens must be >= 0 (0 runs every prompt step eagerly), "
                f"got {self.graph_max_tokens}"
            )
        if self.max_running < 1:
            raise ConfigError(f"--max-running must be >= 1, got {self.max_running}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"--max-model-len must be >= 2, got {self.max_model_len}")
        if self.kv_tokens is not None and self.kv_tokens < 1:
            raise ConfigError(f"--kv-tokens must be >= 1, got {self.kv_tokens}")
        if not 0.0 < self.mem_fraction < 1.0:
            raise ConfigError(
                f"--mem-fraction must be in (0, 1) (the share of GPU memory for weights, LoRA "
                f"slots and the KV pool), got {self.mem_fraction}"
            )
        names = [n for n, _ in self.loras]
        unknown = [p for p in self.pinned if p not in names]
        if unknown:
            raise ConfigError(
                f"--pinned {unknown} name no --lora NAME=PATH; pinned adapters must be loaded at start"
            )

    @property
    def lora_config(self) -> LoRARuntimeConfig:
        return LoRARuntimeConfig(
            max_loras_per_batch=self.max_loras_per_batch,
            max_loaded_loras=self.max_loaded_loras,
            max_lora_rank=self.max_lora_rank,
            pinned=self.pinned,
            stage_slots=self.stage_slots,
        )

    @property
    def warms_up(self) -> bool:
        """Whether the worker runs ``engine.warmup`` before it serves (default: on a GPU,
        where kernels compile and graphs capture; a CPU runs Triton interpreted)."""
        return self.warmup if self.warmup is not None else self.device == "cuda"

    @property
    def rows_per_group(self) -> int:
        return self.max_running

    def step_budget(self, prompt_buckets: tuple[int, ...]) -> tuple[int, int]:
        """``(chunked_prefill_size, step_tokens)`` of the engine (``Engine``) on an executor
        whose prompt steps of fewer tokens than a bucket of ``prompt_buckets`` replay graphs.
        ``--chunked-prefill-size`` given: that budget and no step cap. By default, where
        there are prompt graphs, a step's tokens (decode rows and prompt chunks) stay under
        the largest bucket, so every step replays a graph; where there are none,
        ``DEFAULT_CHUNK`` prompt tokens a step."""
        if self.chunked_prefill_size is not None:
            return self.chunked_prefill_size, 0
        if prompt_buckets:
            return 0, prompt_buckets[-1] - 1
        return DEFAULT_CHUNK, 0


def unsupported_reason(config: ServeConfig) -> str | None:
    """Why `make_executor` cannot build this configuration, or None if it can."""
    if config.device == "cuda":
        import torch

        if torch.cuda.device_count() < config.tp:
            return f"--tp {config.tp} needs {config.tp} GPUs; this machine has {torch.cuda.device_count()}"
    elif config.lora_backend == "triton" and _serving_dtype(config) == "bfloat16":
        return (
            "--lora-backend triton on the CPU runs Triton's interpreter, whose tl.dot multiplies "
            "bfloat16 values as raw 16-bit integers, so LoRA outputs would be garbage: serve "
            "this bfloat16 model on the CPU with --dtype float32 or --lora-backend torch"
        )
    return None


def _serving_dtype(config: ServeConfig) -> str | None:
    """--dtype, else the checkpoint's own (None if its config.json cannot be read: loading
    the model reports that)."""
    if config.dtype is not None:
        return config.dtype
    try:
        return ModelConfig.from_dir(config.model).torch_dtype
    except ConfigError:
        return None


def make_executor(config: ServeConfig, max_len: int) -> Executor:
    """The executor for `config`: page-table rows per DP group = max_running, positions per
    request = max_len, a KV pool of `kv_tokens` (or sized by `mem_fraction` on CUDA).

    tp = dp = 1 runs in this process; otherwise one process per rank (gloo on CPU, NCCL on
    GPUs) driven from this one.
    """
    reason = unsupported_reason(config)
    if reason is not None:
        raise ConfigError(reason)
    from loraplane.worker.engine.executor import LocalExecutor
    from loraplane.worker.engine.runner import RunnerConfig
    from loraplane.worker.models.kv_cache import DEFAULT_PAGE_SIZE

    runner = RunnerConfig(
        model=config.model,
        device=config.device,
        dtype=config.dtype,
        max_seqs=config.rows_per_group,
        max_len=max_len,
        kv_pages=pages_for(config.kv_tokens, DEFAULT_PAGE_SIZE) if config.kv_tokens else None,
        mem_fraction=config.mem_fraction,
        lora_backend=config.lora_backend,
        cuda_graphs=config.cuda_graphs,
        graph_max_tokens=config.graph_max_tokens,
        sampler=config.sampler,
    )
    if config.tp == 1 and config.dp == 1:
        return LocalExecutor(runner, config.lora_config)
    from loraplane.worker.parallel.executor import MultiRankExecutor
    from loraplane.worker.parallel.state import ParallelConfig

    pconf = ParallelConfig(tp=config.tp, dp=config.dp, dp_attention=config.dp_attention)
    return MultiRankExecutor(pconf, runner, config.lora_config)


def build_engine(
    config: ServeConfig,
    *,
    observer: EngineObserver | None = None,
    fault_hook: FaultHook | None = None,
) -> Engine:
    """The engine of ``config`` (not started): its executor built and, when
    ``config.warms_up``, warmed up (``engine.warmup``), which is where a worker spends its
    start after loading the model. Needs no HTTP stack (``serve.build_server`` adds it)."""
    model_config = ModelConfig.from_dir(config.model)
    max_len = config.max_model_len or min(model_config.max_position_embeddings, 4096)
    tokenizer = TextTokenizer(config.model)
    executor = make_executor(config, max_len)
    chunk, step_tokens = config.step_budget(executor.prompt_graph_buckets)
    if step_tokens:
        log.info(
            "a step's decode rows and prompt chunks stay under %d tokens (the largest "
            "prompt-step graph; --chunked-prefill-size N sets a budget instead)",
            step_tokens + 1,
        )
    else:
        log.info("a step feeds at most %s prompt tokens", chunk or "all its")
    try:
        if config.warms_up:
            moe = model_config.is_moe
            plan = plan_for(
                executor.max_seqs,
                executor.max_len,
                config.max_loras_per_batch,
                config.max_lora_rank,
                (model_config.num_experts, model_config.num_experts_per_tok) if moe else None,
                stage_positions=executor.stage_positions,
                dp=executor.dp_size,
                chunked_prefill_size=chunk or step_tokens,
                prompt_buckets=executor.prompt_graph_buckets,
            )
            report = warm_up(executor, plan)
            executor.after_warmup()  # (a kernel the warm-up missed then logs a line, any rank)
            settle_heap()  # this process steps the engine too (rank 0 may live elsewhere)
            if observer is not None:
                observer.warmed_up(report.seconds)
        return Engine(
            executor,
            tokenizer,
            max_loras_per_batch=config.max_loras_per_batch,
            max_loaded_loras=config.max_loaded_loras,
            max_running=config.max_running,
            max_model_len=max_len,
            observer=observer,
            fault_hook=fault_hook,
            overlap=config.overlap,
            chunked_prefill_size=chunk,
            step_tokens=step_tokens,
        )
    except BaseException:
        executor.shutdown()
        raise
