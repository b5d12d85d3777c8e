"""Compile the LoRA kernels that mask B and y by rank for an H100/H200 (sm_90) and count their
16-bit global loads, and the fused sampler and count its spills: run with
``TRITON_INTERPRET=0`` (``test_vector_loads.py`` does).

Triton compiles to PTX and a cubin without a GPU (its wheel carries ptxas), so which loads
become 16-byte vectors, and whether a kernel compiles at all, can be checked on any machine.
Prints one JSON object: case -> number of ``ld.global`` instructions that move 16-bit
elements one at a time, or bytes of spill stores.
"""

from __future__ import annotations

import inspect
import json
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from loraplane.worker.kernels import attention, expand, rope, sampling, stacked

SCALAR_16BIT = re.compile(r"ld\.global(?:\.[a-z0-9_]+)*\.b16\b")


def compile_sm90(
    kernel: Any,
    types: dict[str, str],
    consts: dict[str, Any],
    div16: set[str],
    num_warps: int = 4,
) -> Any:
    """``kernel`` compiled for sm_90. ``types``: Triton types of the runtime arguments;
    ``div16``: the arguments Triton may assume divisible by 16 (as it specializes pointers
    and ints that are at launch)."""
    names = list(inspect.signature(kernel.fn).parameters)
    signature = {n: types.get(n, "constexpr") for n in names}
    src = ASTSource(
        fn=kernel,
        signature=signature,
        constexprs={(names.index(k),): v for k, v in consts.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in div16},
    )
    options = {"num_warps": num_warps}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def scalar_loads(
    kernel: Any, types: dict[str, str], consts: dict[str, Any], div16: set[str]
) -> int:
    """16-bit element loads in ``kernel``'s PTX for sm_90 (``compile_sm90``)."""
    compiled = compile_sm90(kernel, types, consts, div16)
    return len(SCALAR_16BIT.findall(compiled.asm["ptx"]))


def spill_bytes(ptx: str) -> int:
    """Bytes of register spill stores ptxas reports for ``ptx`` (the ptxas in Triton's wheel)."""
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        done = subprocess.run(
            [str(ptxas), "-arch=sm_90a", "-v", str(src), "-o", str(Path(tmp) / "k.cubin")],
            capture_output=True,
            text=True,
            check=True,
        )
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", done.stderr))


def _types(pointers: dict[str, str], ints: tuple[str, ...]) -> dict[str, str]:
    return {**pointers, **{n: "i32" for n in ints}}


def expand_cases() -> dict[str, int]:
    ptrs = {n: "*bf16" for n in ("y_ptr", "b_ptr", "out_ptr")}
    ptrs |= {
        n: "*i32"
        for n in (
            "seg_indptr_ptr",
            "seg_slots_ptr",
            "slot_ranks_ptr",
            "slice_offsets_ptr",
            "tile_seg_ptr",
            "tile_len_ptr",
            "tile_rank_ptr",
            "y_seg_col_ptr",
        )
    }
    ptrs |= {"slot_scalings_ptr": "*fp32", "row_order_ptr": "*i64", "tile_rows_ptr": "*i64"}
    ints = ("n_total", "rank_max", "y_stride_row", "out_stride_row", "b_stride_slot")
    ints += ("b_stride_row", "weights_per_slot")
    div16 = set(ptrs) | set(ints) - {"weights_per_slot"}
    out = {}
    for align in (8, 1):  # the MoE expand: the rank comes with the tile
        consts = dict(
            TILE_RANK=True,
            NUM_SLICES=1,
            HAS_ROW_ORDER=True,
            USE_TILE_MAP=True,
            Y_BY_ROW=True,
            DOT_PRECISION="tf32",
            BLOCK_S=16,
            BLOCK_R=64,
            BLOCK_N=128,
            RANK_ALIGN=align,
        )
        kernel = expand._lora_expand_kernel
        out[f"expand_rank_align_{align}"] = scalar_loads(kernel, _types(ptrs, ints), consts, div16)
    return out


def stacked_cases() -> dict[str, int]:
    ptrs = {n: "*bf16" for n in ("full_ptr", "b_ptr", "res_ptr", "out_ptr")}
    ptrs |= {n: "*i32" for n in ("row_pos_ptr", "pos_slots_ptr", "slice_offsets_ptr")}
    ptrs |= {"pos_scal_ptr": "*fp32", "tiles_ptr": "*i32"}
    ints = ("n_rows", "n_cols", "n_base", "n_r", "rank_max", "full_stride", "res_stride")
    ints += ("out_stride",)
    ints += ("b_stride_slot", "b_stride_row")
    # A stage rank of 16 (every int a multiple of 16, as Triton then specializes them) and
    # one of 8: rank_max and n_r are 8 and the full output's rows N + 8 elements apart.
    layouts = {16: set(), 8: {"rank_max", "n_r", "full_stride"}}
    out = {}
    for mode, name in ((1, "residual"), (2, "silu_mul")):
        for rank, odd in layouts.items():
            consts = dict(  # the decode steps' tiles (StageInfo.tiles), as launched
                MODE=mode,
                NUM_SLICES=1,
                WIDTH=4,
                DOT_PRECISION="tf32",
                BLOCK_S=16,
                BLOCK_R=16,
                BLOCK_N=64 if mode == 1 else 128,
                TILE_WORDS=20,
            )
            div16 = (set(ptrs) | set(ints)) - odd - {"n_rows"}
            kernel = stacked._stacked_lora_kernel
            key = f"stacked_{name}_stage_rank_{rank}"
            out[key] = scalar_loads(kernel, _types(ptrs, ints), consts, div16)
            if rank == 16:  # the prompt steps' kernel (ROWS_KERNEL_MIN), as launched
                consts |= {"BLOCK_S": 16, "BLOCK_N": 128, "BY_ROWS": True}
                key = f"stacked_rows_{name}_stage_rank_{rank}"
                out[key] = scalar_loads(kernel, _types(ptrs, ints), consts, div16)
    return out


def rope_cases() -> dict[str, int]:
    ptrs = {
        n: "*bf16"
        for n in ("src_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr", "cos_sin_ptr", "b_ptr")
    }
    ptrs |= {n: "*bf16" for n in ("q_norm_ptr", "k_norm_ptr")}
    ptrs |= {n: "*i32" for n in ("row_pos_ptr", "pos_slots_ptr")}
    ptrs |= {n: "*i64" for n in ("slots_ptr", "positions_ptr")}
    ptrs |= {"pos_scal_ptr": "*fp32", "tiles_ptr": "*i32"}
    ints = ("n_tokens", "num_heads", "num_kv_heads", "half", "n_base", "n_r", "rank_max")
    ints += ("src_stride", "q_stride_t", "q_stride_h", "c_stride_page", "c_stride_pos")
    ints += ("c_stride_head", "cs_stride", "b_stride_slot", "b_stride_row")
    types = _types(ptrs, ints) | {"eps": "fp32", "page_size": "i32"}
    layouts = {16: set(), 8: {"rank_max", "n_r", "src_stride"}}  # as for the epilogues
    out = {}
    for rank, odd in layouts.items():
        consts = dict(  # the decode steps' tiles
            HAS_LORA=True,
            WIDTH=4,
            QK_NORM=False,
            DOT_PRECISION="tf32",
            BLOCK_S=16,
            BLOCK_D=64,
            BLOCK_R=16,
            TILE_WORDS=20,
        )
        div16 = (set(ptrs) | set(ints)) - odd - {"n_tokens"}
        kernel = rope._rope_qkv_kernel
        out[f"rope_stage_rank_{rank}"] = scalar_loads(kernel, types, consts, div16)
        if rank == 16:  # the prompt steps' variant
            out["rope_by_rows_stage_rank_16"] = scalar_loads(
                kernel, types, consts | {"BY_ROWS": True}, div16
            )
    return out


def sampler_cases() -> dict[str, int]:
    """The fused sampler's kernels, compiled as ``sample_table`` launches them: per logits
    dtype, without the top_k candidates' buffer, after chunks, and the chunks' two kernels.
    The bytes each spills (they must compile: the interpreter accepts what the compiler
    refuses)."""
    cases = {}
    div16 = {"logits_ptr", "table_ptr", "out_ptr", "scratch_ptr", "part_ptr", "row_stride"}
    div16 |= {"vocab", "chunk"}  # (real vocabularies, chunks of CHUNK_BLOCK tokens)
    main = [("bf16", sampling.CANDIDATES, False), ("fp16", sampling.CANDIDATES, False),
            ("fp32", sampling.CANDIDATES, False), ("bf16", 0, False), ("bf16", 0, True),
            ("bf16", sampling.CANDIDATES, True)]  # fmt: skip
    for dtype, candidates, chunks in main:
        types = {
            "logits_ptr": f"*{dtype}",
            "table_ptr": "*i64",
            "out_ptr": "*i64",
            "scratch_ptr": "*i32" if candidates else "*i64",
            "part_ptr": "*i32" if chunks else "*i64",
            "row_stride": "i64",
            "vocab": "i32",
            "n_chunks": "i32",
            "seg": "i32",
            "chunk_k": "i32",
            "max_rounds": "i32",
        }
        consts = {"BLOCK": sampling.BLOCK, "BINS": sampling.BINS, "CANDIDATES": candidates,
                  "CHUNKS": chunks, "CHUNKS_P2": 16 if chunks else 1,
                  "CHUNK_TOP_K": chunks and candidates > 0}  # fmt: skip
        compiled = compile_sm90(
            sampling._sample_kernel, types, consts, div16 - {"chunk"}, num_warps=sampling.NUM_WARPS
        )
        name = f"sampler_{dtype}" + ("" if candidates else "_no_candidates")
        name += "_after_chunks" if chunks else ""
        cases[f"{name}_spill_bytes"] = spill_bytes(compiled.asm["ptx"])
    for kernel in (sampling._race_chunks_kernel, sampling._check_chunks_kernel):
        types = {
            "logits_ptr": "*bf16",
            "table_ptr": "*i64",
            "part_ptr": "*i32",
            "scratch_ptr": "*i32",
            "row_stride": "i64",
            "vocab": "i32",
            "chunk": "i32",
            "chunk_k": "i32",
            "seg": "i32",
            "max_rounds": "i32",
        }
        consts = {"BLOCK": sampling.CHUNK_BLOCK, "CHUNKS_P2": 16, "BINS": sampling.BINS,
                  "TOP_K": True, "CANDIDATES": sampling.CANDIDATES}  # fmt: skip
        names = set(inspect.signature(kernel.fn).parameters)
        types = {k: v for k, v in types.items() if k in names}
        consts = {k: v for k, v in consts.items() if k in names}
        compiled = compile_sm90(
            kernel, types, consts, div16 & set(types), num_warps=sampling.CHUNK_WARPS
        )
        cases[f"sampler{kernel.fn.__name__}_spill_bytes"] = spill_bytes(compiled.asm["ptx"])
    return cases


def attention_cases() -> dict[str, int]:
    """The decode and prompt-chunk attention kernels as the model launches them on the 8B
    shape (bf16, d 128, four query heads per KV head, pages of 16): the shared memory each
    program asks for, which a launch past the SM's 227 KiB refuses, and the bytes spilled."""
    cache = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")}
    ints = ("q_stride_t", "q_stride_h", "table_stride", "kv_stride_page", "kv_stride_pos")
    ints += ("kv_stride_head", "out_stride_t", "out_stride_h")
    common = {"PAGE_SIZE": 16, "GROUP": 4, "HEAD_DIM": 128, "BLOCK_D": 128}
    common |= {"DOT_PRECISION": "tf32"}
    cases = {}
    for splits in (1, 4):
        types = _types(cache, (*ints, "num_heads")) | {
            "part_ptr": "*fp32",
            "count_ptr": "*i32",
            "table_ptr": "*i32",
            "cache_rows_ptr": "*i64",
            "seq_lens_ptr": "*i64",
            "scale": "fp32",
        }
        consts = common | {"BLOCK_G": 16, "BLOCK_L": attention.BLOCK_L, "CHUNK": attention.CHUNK}
        compiled = compile_sm90(
            attention._decode_attention_kernel,
            types,
            consts | {"SPLITS": splits},
            set(cache) | set(ints) | {"part_ptr", "count_ptr", "table_ptr"},
            num_warps=attention.NUM_WARPS,
        )
        cases[f"attention_decode_splits_{splits}_shared"] = compiled.metadata.shared
        cases[f"attention_decode_splits_{splits}_spill_bytes"] = spill_bytes(compiled.asm["ptx"])
    types = _types(cache, ints) | {"table_ptr": "*i32", "tiles_ptr": "*i32", "scale": "fp32"}
    names = list(inspect.signature(attention._extend_attention_kernel.fn).parameters)
    src = ASTSource(
        fn=attention._extend_attention_kernel,
        signature={n: types.get(n, "constexpr") for n in names},
        constexprs={
            (names.index(k),): v
            for k, v in (common | {"BLOCK_M": 64, "BLOCK_N": attention.EXTEND_BLOCK_N}).items()
        },
        attrs={
            (names.index(n),): [["tt.divisibility", 16]]
            for n in set(cache) | set(ints) | {"table_ptr", "tiles_ptr"}
        },
    )
    options = {"num_warps": attention.EXTEND_NUM_WARPS, "num_stages": attention.EXTEND_NUM_STAGES}
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    cases["attention_extend_shared"] = compiled.metadata.shared
    cases["attention_extend_spill_bytes"] = spill_bytes(compiled.asm["ptx"])
    return cases


if __name__ == "__main__":
    cases = expand_cases() | stacked_cases() | rope_cases() | sampler_cases() | attention_cases()
    print(json.dumps(cases))
