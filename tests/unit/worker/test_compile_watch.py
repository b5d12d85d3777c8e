"""After the warm-up a worker logs each Triton kernel variant it first launches (what the
warm-up missed); the hook it installs is the one this Triton calls after a compile."""

from __future__ import annotations

import logging

import pytest

pytestmark = pytest.mark.unit


def test_a_kernel_compiled_after_the_warm_up_logs_its_name_and_specialization(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from triton import knobs
    from triton.runtime.jit import JitFunctionInfo

    from loraplane.worker.engine.compile_watch import watch_compiles
    from loraplane.worker.kernels.attention import _decode_attention_kernel

    before = knobs.runtime.jit_post_compile_hook
    try:
        assert watch_compiles()
        hook = knobs.runtime.jit_post_compile_hook
        assert hook is not None
        info = JitFunctionInfo(
            "loraplane.worker.kernels.attention",
            "_decode_attention_kernel",
            _decode_attention_kernel,
        )
        with caplog.at_level(logging.WARNING, logger="loraplane.worker.compile_watch"):
            # (the arguments JITFunction._call_hook passes, those this hook reads)
            skip = hook(
                key="(('*bf16', 'D'), ('i32', ''))",
                repr="_decode_attention_kernel[num_warps=4]",
                fn=info,
                compile={},
                is_manual_warmup=False,
                already_compiled=False,
            )
        assert not skip
        assert [r.getMessage() for r in caplog.records] == [
            "a Triton kernel was compiled or loaded after the warm-up: "
            "_decode_attention_kernel _decode_attention_kernel[num_warps=4] "
            "key=\"(('*bf16', 'D'), ('i32', ''))\""
        ]
    finally:
        knobs.runtime.jit_post_compile_hook = before


def test_a_settled_heap_is_frozen_and_a_long_full_collection_logs_its_pause(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """After the warm-up the start-up heap is out of the collector's reach, and a full
    collection that stops the process past the threshold says how long it took."""
    import gc

    from loraplane.worker.engine import compile_watch

    try:
        compile_watch.settle_heap()
        assert gc.get_freeze_count() > 0
        monkeypatch.setattr(compile_watch, "GC_PAUSE_WARN_S", 0.0)
        with caplog.at_level(logging.WARNING, logger="loraplane.worker.compile_watch"):
            gc.collect(1)  # a young collection is not a full one: no line
            assert not caplog.records
            gc.collect()
        assert any("full garbage collection paused" in r.getMessage() for r in caplog.records)
    finally:
        gc.callbacks.remove(compile_watch._on_gc)
        gc.unfreeze()
