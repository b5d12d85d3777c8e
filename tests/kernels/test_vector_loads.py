"""The LoRA kernels' B and y loads stay 16-byte vectors, and the sampler and attention kernels
compile within an SM's budget: PTX for sm_90, compiled on any machine.

A mask Triton cannot prove constant over a group of columns along B's contiguous rank axis
splits every load into single elements. The MoE expand ran L1-bound that way on an H200 (ncu:
L1/TEX 91%, DRAM 35%) until its loads covered the loaded rank rounded up to 8
columns (``expand.RANK_ALIGN``). A stage rank of 8 does the same to the stacked epilogues and
the rotation (their rank, ``y`` offsets and row stride are then not multiples of 16, which is
what Triton specializes on), so the stage rank is at least 16 (``stage.MIN_STAGE_RANK``).
``ptx_loads.py`` compiles each kernel both ways in a subprocess with ``TRITON_INTERPRET=0``
(the tier's interpreter replaces ``triton.jit``) and counts the 16-bit element loads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.kernels

HERE = Path(__file__).parent
ROOT = HERE.parents[1]


@pytest.fixture(scope="module")
def loads() -> dict[str, int]:
    env = dict(os.environ, TRITON_INTERPRET="0")
    src = [str(ROOT / d / "src") for d in ("worker", "controlplane", "operator")]
    env["PYTHONPATH"] = os.pathsep.join([*src, env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, str(HERE / "ptx_loads.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_the_expand_loads_whole_vectors_over_a_loaded_rank(loads: dict[str, int]) -> None:
    assert loads["expand_rank_align_8"] == 0, loads
    assert loads["expand_rank_align_1"] > 0, loads  # the rank-masked loads it replaced


@pytest.mark.parametrize("mode", ["residual", "silu_mul"])
def test_the_stacked_epilogues_load_whole_vectors_at_the_smallest_stage_rank(
    loads: dict[str, int], mode: str
) -> None:
    """Stage ranks are at least 16 (``stage.MIN_STAGE_RANK``): at 8 the same kernel splits."""
    assert loads[f"stacked_{mode}_stage_rank_16"] == 0, loads
    assert loads[f"stacked_{mode}_stage_rank_8"] > 0, loads
    assert loads[f"stacked_rows_{mode}_stage_rank_16"] == 0, loads  # (prompt steps' kernel)


def test_the_rotation_with_lora_loads_whole_vectors_at_the_smallest_stage_rank(
    loads: dict[str, int],
) -> None:
    assert loads["rope_stage_rank_16"] == 0, loads
    assert loads["rope_stage_rank_8"] > 0, loads
    assert loads["rope_by_rows_stage_rank_16"] == 0, loads


def test_the_fused_sampler_compiles_without_spills(loads: dict[str, int]) -> None:
    """The fused sampler's kernels compile for sm_90 (every logits dtype), registers in budget
    (a global Python float in it once passed the interpreter and failed the compiler)."""
    spills = {k: v for k, v in loads.items() if k.startswith("sampler_")}
    names = ("bf16", "fp16", "fp32", "bf16_no_candidates", "bf16_no_candidates_after_chunks")
    names += ("bf16_after_chunks",)
    names += ("race_chunks_kernel", "check_chunks_kernel")
    assert spills == {f"sampler_{d}_spill_bytes": 0 for d in names}


def test_the_attention_kernels_compile_within_an_sms_shared_memory(loads: dict[str, int]) -> None:
    """The decode kernel (one split and four) and the prompt-chunk kernel compile for sm_90 at
    the 8B shape in bf16, each program's shared memory within the 227 KiB an H100/H200 SM
    grants one block, nothing spilled (the interpreter runs kernels the compiler refuses)."""
    kernels = ("decode_splits_1", "decode_splits_4", "extend")
    for name in kernels:
        assert 0 < loads[f"attention_{name}_shared"] <= 227 * 1024, loads
        assert loads[f"attention_{name}_spill_bytes"] == 0, loads
