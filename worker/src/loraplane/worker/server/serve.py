"""`loraplane worker serve`: build executor, engine and app, load the start-up adapters, run uvicorn."""

from __future__ import annotations

import logging
from pathlib import Path

from loraplane.worker.config import ConfigError, ModelConfig
from loraplane.worker.engine.engine import Engine
from loraplane.worker.engine.tokenizer import TextTokenizer
from loraplane.worker.server.app import WorkerServer, _allowed, create_app
from loraplane.worker.server.factory import ServeConfig, make_executor
from loraplane.worker.server.faults import FaultInjector
from loraplane.worker.server.metrics import WorkerMetrics

log = logging.getLogger("loraplane.worker.server")

LOG_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


def build_server(config: ServeConfig) -> WorkerServer:
    """Everything but the HTTP listener; raises ConfigError for a configuration that cannot run."""
    model_config = ModelConfig.from_dir(config.model)
    max_len = config.max_model_len or min(model_config.max_position_embeddings, 4096)
    tokenizer = TextTokenizer(config.model)
    executor = make_executor(config, max_len)
    if config.warms_up:
        from loraplane.worker.engine.warmup import plan_for, warm_up

        plan = plan_for(
            executor.max_seqs, executor.max_len, config.max_loras_per_batch, config.max_lora_rank
        )
        try:
            warm_up(executor, plan)
        except BaseException:
            executor.shutdown()
            raise
    faults = FaultInjector(executor.dp_size) if config.enable_fault_injection else None
    metrics = WorkerMetrics(executor.dp_size, config.max_loras_per_batch, config.max_loaded_loras)
    engine = Engine(
        executor,
        tokenizer,
        max_loras_per_batch=config.max_loras_per_batch,
        max_loaded_loras=config.max_loaded_loras,
        max_running=config.max_running,
        max_model_len=max_len,
        observer=metrics,
        fault_hook=faults.take if faults else None,
    )
    engine.start()
    served = config.served_model_name or Path(config.model).resolve().name
    metrics.set_info(served, config.tp, executor.dp_size)
    server = WorkerServer(
        engine,
        served_model=served,
        model_root=str(Path(config.model).resolve()),
        allowed_lora_roots=config.allowed_lora_roots,
        metrics=metrics,
        faults=faults,
    )
    for name, path in config.loras:
        if name == served:
            engine.stop()
            raise ConfigError(
                f"--lora {name}={path}: {name!r} is the name of the served base model "
                "(model=<name> would reach the base); choose another adapter name"
            )
        if not _allowed(path, config.allowed_lora_roots):
            engine.stop()
            raise ConfigError(
                f"--lora {name}={path}: outside the allowed adapter roots {list(config.allowed_lora_roots)}"
            )
        result = engine.load_adapter(name, path, pinned=name in config.pinned).result()
        if not result.success:
            engine.stop()
            raise ConfigError(f"--lora {name}={path}: {result.error_message or 'load failed'}")
    return server


def serve(config: ServeConfig) -> None:
    import uvicorn

    logging.basicConfig(level=config.log_level.upper(), format=LOG_FORMAT)
    server = build_server(config)
    log.info(
        "serving %s on http://%s:%d (tp=%d dp=%d, K=%d slots, M=%d adapters, rank<=%d, backend=%s, sampler=%s, device=%s, cuda graphs %s)",
        server.served_model,
        config.host,
        config.port,
        config.tp,
        config.dp,
        config.max_loras_per_batch,
        config.max_loaded_loras,
        config.max_lora_rank,
        config.lora_backend,
        config.sampler,
        config.device,
        "on"
        if config.cuda_graphs and config.device == "cuda" and config.tp == config.dp == 1
        else "off",
    )
    app = create_app(server)
    try:
        uvicorn.run(
            app, host=config.host, port=config.port, log_level=config.log_level, log_config=None
        )
    finally:
        server.engine.stop()
