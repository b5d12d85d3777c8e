"""`loraplane worker serve`: start the engine (its core process, or a thread here), load the
start-up adapters, run uvicorn over the app."""

from __future__ import annotations

import logging
from pathlib import Path

from loraplane.worker.config import ConfigError
from loraplane.worker.server.app import WorkerServer, _allowed, create_app
from loraplane.worker.server.engine_client import EngineClient, InThreadEngineClient
from loraplane.worker.server.engine_process import CoreFaults, ProcessEngineClient
from loraplane.worker.server.factory import ServeConfig, build_engine
from loraplane.worker.server.faults import FaultInjector
from loraplane.worker.server.guards import read_admin_token
from loraplane.worker.server.metrics import WorkerMetrics

log = logging.getLogger("loraplane.worker.server")

LOG_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


def build_server(config: ServeConfig) -> WorkerServer:
    """Everything but the HTTP listener: the engine (in its core process when
    ``config.engine_process``) warmed up and holding the --lora adapters; raises ConfigError
    for a configuration that cannot run."""
    served = config.served_model_name or Path(config.model).resolve().name
    for name, path in config.loras:  # (checked before the model loads and warms up)
        if name == served:
            raise ConfigError(
                f"--lora {name}={path}: {name!r} is the name of the served base model "
                "(model=<name> would reach the base); choose another adapter name"
            )
        if not _allowed(path, config.allowed_lora_roots):
            raise ConfigError(
                f"--lora {name}={path}: outside the allowed adapter roots {list(config.allowed_lora_roots)}"
            )
    metrics = WorkerMetrics(config.dp, config.max_loras_per_batch, config.max_loaded_loras)
    client: EngineClient
    faults: FaultInjector | CoreFaults | None
    if config.engine_process:
        client = ProcessEngineClient(config, observer=metrics)
        faults = CoreFaults(client) if config.enable_fault_injection else None
    else:
        injector = FaultInjector(config.dp) if config.enable_fault_injection else None
        engine = build_engine(
            config, observer=metrics, fault_hook=injector.take if injector else None
        )
        client, faults = InThreadEngineClient(engine), injector
    metrics.set_info(served, config.tp, config.dp)
    server = WorkerServer(
        client,
        served_model=served,
        model_root=str(Path(config.model).resolve()),
        allowed_lora_roots=config.allowed_lora_roots,
        metrics=metrics,
        faults=faults,
        max_body_bytes=config.max_request_bytes,
        admin_token=read_admin_token(config.admin_token_file),
    )
    for name, path in config.loras:
        result = client.load_adapter(name, path, pinned=name in config.pinned).result()
        if not result.success:
            client.stop()
            raise ConfigError(f"--lora {name}={path}: {result.error_message or 'load failed'}")
    return server


def serve(config: ServeConfig) -> None:
    import uvicorn

    logging.basicConfig(level=config.log_level.upper(), format=LOG_FORMAT)
    server = build_server(config)
    log.info(
        "serving %s on http://%s:%d (engine %s; tp=%d dp=%d, K=%d slots, M=%d adapters, rank<=%d, backend=%s, sampler=%s, device=%s, cuda graphs %s)",
        server.served_model,
        config.host,
        config.port,
        "in its core process" if config.engine_process else "on a thread of this process",
        config.tp,
        config.dp,
        config.max_loras_per_batch,
        config.max_loaded_loras,
        config.max_lora_rank,
        config.lora_backend,
        config.sampler,
        config.device,
        # (engine.graphs.graphs_enabled: every rank its own; the torch LoRA kernels never)
        "on"
        if config.cuda_graphs and config.device == "cuda" and config.lora_backend == "triton"
        else "off",
    )
    app = create_app(server)
    try:
        uvicorn.run(
            app,
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            log_config=None,
            timeout_keep_alive=config.keep_alive_s,
        )
    finally:
        server.engine.stop()
