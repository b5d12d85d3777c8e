"""After the warm-up a worker logs each Triton kernel variant it first launches (what the
warm-up missed); the hook it installs is the one this Triton calls after a compile."""

from __future__ import annotations

import logging

import pytest

pytestmark = pytest.mark.unit


def test_a_kernel_compiled_after_the_warm_up_logs_its_name(
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
                key="k",
                repr="_decode_attention_kernel[num_warps=4]",
                fn=info,
                compile={},
                is_manual_warmup=False,
                already_compiled=False,
            )
        assert not skip
        assert [r.getMessage() for r in caplog.records] == [
            "a Triton kernel was compiled or loaded after the warm-up: "
            "_decode_attention_kernel _decode_attention_kernel[num_warps=4]"
        ]
    finally:
        knobs.runtime.jit_post_compile_hook = before
