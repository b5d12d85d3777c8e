"""GPU tier: a worker warmed up before it serves (``engine.warmup``, on by default with CUDA)
captured every decode bucket's graph, every prompt-step graph and the LoRA graphs its first
requests need, and serves
the tokens a worker without the warm-up serves."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from tests.engine_requests import generate

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU: run scripts/gpu-numerics.sh through the device tool",
    ),
]


def _server(model_dir: Any, warmup: bool) -> Any:
    from loraplane.worker.server.factory import ServeConfig, build_engine

    config = ServeConfig(
        model=str(model_dir),
        device="cuda",
        warmup=warmup,
        max_running=8,
        max_loras_per_batch=3,
        max_loaded_loras=3,
        max_lora_rank=32,
        max_model_len=64,
    )
    engine = build_engine(config)  # (serve.build_server's engine; the image has no FastAPI)
    engine.start()
    return SimpleNamespace(engine=engine)


def test_the_first_requests_capture_no_graph_and_get_the_same_tokens(suite) -> None:  # type: ignore[no-untyped-def]
    model_dir, adapters = suite["llama"]
    paths = dict(adapters)
    servers = {warmup: _server(model_dir, warmup) for warmup in (True, False)}
    try:
        graphs = servers[True].engine.executor.runner.graphs
        assert graphs is not None
        captured = set(graphs._graphs)
        assert {(b, None) for b in graphs.buckets} <= captured  # every LoRA-off bucket
        assert not graphs._failed  # (a failed capture would run eagerly, keyed nowhere)
        prompt = servers[True].engine.executor.runner.prompt_graphs
        assert prompt is not None and not prompt._failed
        prompt_captured = prompt.keys
        # every prompt bucket a step of 8 rows of 63 tokens reaches (<= 504 tokens: up to
        # 512), without an adapter and with 1, 2 and 3 (the class of 4) adapters
        want = {(b, c) for b in prompt.buckets if b <= 512 for c in (None, 1, 2, 4)}
        classes = {(b, shape[0] if shape else None) for b, shape in prompt_captured}
        assert want <= classes, want - classes
        assert servers[True].engine.lora_state()["slots"] == [None, None, None]
        outputs = {}
        for warmup, server in servers.items():
            for name in ("a8", "a16"):
                assert server.engine.load_adapter(name, str(paths[name])).result().success
            outputs[warmup] = [
                generate(server, [[5, 9, 200, 31]], [None]),
                generate(server, [[44, 2, 2]], ["a8"]),  # rank 8 stages at rank 16
                generate(server, [[7, 7, 8], [90, 1]], ["a8", "a16"]),
            ]
        # the warmed worker's first requests replayed graphs it had captured before
        assert set(graphs._graphs) == captured
        assert prompt.keys == prompt_captured and prompt.replays > 0
        cold = servers[False].engine.executor.runner.graphs
        assert cold is not None and len(cold._graphs) > 0  # the cold one captured them now
        assert outputs[True] == outputs[False]
    finally:
        for server in servers.values():
            server.engine.stop()
