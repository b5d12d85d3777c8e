"""Argument checks and block-size heuristics shared by the Triton LoRA kernels.

Nothing here launches a kernel or reads a device tensor back: the wrappers stay free of host
syncs, so they can run inside CUDA-graph capture.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# tl.dot needs every block dimension >= 16.
MIN_DOT_BLOCK = 16

# Row kernels that hold a whole row in one program (kernels/norm.py) take at most this many
# columns; wider rows would spill registers.
MAX_ROW_COLUMNS = 32768


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` on host ints. (``triton.cdiv`` is a constexpr function: called from host
    code it unwraps its arguments through Triton's machinery: about 2 us a call.)"""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


# Registers per thread the shrink and expand may use (ptxas ``.maxnreg``), None: the
# compiler's choice (bench/probes/kernel_variants.py). Fewer registers let more programs
# share a multiprocessor, at the risk of spills.
MAXNREG: int | None = None


def launch_options(num_warps: int, num_stages: int | None = None) -> dict[str, int]:
    """Launch keywords of the LoRA kernels: warps, pipeline stages, and ``MAXNREG`` if set."""
    options = {"num_warps": num_warps}
    if num_stages is not None:
        options["num_stages"] = num_stages
    if MAXNREG is not None:
        options["maxnreg"] = MAXNREG
    return options


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: exact IEEE fp32 for fp32 (no TF32), the default otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_tensor(
    fn: str,
    name: str,
    tensor: object,
    *,
    ndim: int,
    dtypes: Sequence[torch.dtype],
    device: torch.device | None = None,
    contiguous: bool = False,
    unit_last_stride: bool = False,
) -> torch.Tensor:
    """Raise ``ValueError`` naming ``fn``/``name``, the value and what is accepted."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{fn}: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != ndim:
        raise ValueError(f"{fn}: {name} must be a {ndim}-D tensor, got shape {tuple(tensor.shape)}")
    if tensor.dtype not in dtypes:
        accepted = ", ".join(str(d) for d in dtypes)
        raise ValueError(f"{fn}: {name} must have dtype in ({accepted}), got {tensor.dtype}")
    if device is not None and tensor.device != device:
        raise ValueError(
            f"{fn}: {name} must be on device {device} (the device of x), got {tensor.device}"
        )
    if contiguous and not tensor.is_contiguous():
        raise ValueError(
            f"{fn}: {name} must be contiguous, got strides {tuple(tensor.stride())} "
            f"for shape {tuple(tensor.shape)}"
        )
    if unit_last_stride and tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise ValueError(
            f"{fn}: {name} must have unit stride in its last dimension, got strides "
            f"{tuple(tensor.stride())}"
        )
    return tensor


def check_interpretable(fn: str, name: str, tensor: torch.Tensor) -> None:
    """Refuse bfloat16 on the CPU: Triton runs there through its interpreter, which keeps
    bfloat16 values as raw uint16 and multiplies them as integers in ``tl.dot``."""
    if tensor.dtype == torch.bfloat16 and tensor.device.type == "cpu":
        raise ValueError(
            f"{fn}: {name} is bfloat16 on the CPU, where Triton runs through its interpreter, "
            "whose tl.dot multiplies bfloat16 operands as raw 16-bit integers; use float32 or "
            "float16 tensors on the CPU (or the torch reference kernels)"
        )


def check_dim(fn: str, name: str, tensor: torch.Tensor, dim: int, expected: int, why: str) -> None:
    if tensor.shape[dim] != expected:
        raise ValueError(
            f"{fn}: {name}.shape[{dim}] must be {expected} ({why}), got shape {tuple(tensor.shape)}"
        )


def check_same_dtype(
    fn: str, name: str, tensor: torch.Tensor, other: str, dtype: torch.dtype
) -> None:
    if tensor.dtype != dtype:
        raise ValueError(
            f"{fn}: {name} must have dtype {dtype} (same as {other}), got {tensor.dtype}"
        )


def check_max_seg_len(fn: str, max_seg_len: object) -> int:
    if isinstance(max_seg_len, bool) or not isinstance(max_seg_len, int) or max_seg_len < 0:
        raise ValueError(f"{fn}: max_seg_len must be a host int >= 0, got {max_seg_len!r}")
    return max_seg_len


@dataclass(slots=True)
class StageInfo:
    """Which rows read which stage position, row by row (no segments, no row order).

    ``row_pos`` int32 [T]: each row's stage position (-1: no LoRA, the base value only);
    ``pos_slots`` int32 [width]: which B a position reads, its index into the kernels'
    ``lora_b`` (-1: no row of this batch uses the position). A worker passes the stage's own B
    (``LoRALayer.staged_b``: position ``p``'s at ``p``), tests may pass slot buffers;
    ``pos_scalings`` float32 [width]: the position's adapter's scaling. ``width`` is how
    many stage positions the stacked GEMM computes (the row-block programs visit those their
    rows hold); ``rank``: y columns per slice of a position (the stage rank, at most B's last
    dimension).

    The epilogues read rows in place, and each row's position picks its own ``y`` columns of
    the stacked GEMM's output (ADR 0007). Below ``stacked.ROWS_KERNEL_MIN`` rows a program
    takes one of ``tiles`` (a position's rows, listed with the position's slot and scaling:
    one round trip for the tile, one for the rows' values); from it, or without tiles, one
    block of consecutive rows, visiting the positions they hold. A row at -1, at a position
    past ``width`` or at one with no slot gets the base value.
    """

    row_pos: torch.Tensor
    pos_slots: torch.Tensor
    pos_scalings: torch.Tensor
    width: int
    rank: int
    # int32 [capacity * TILE_WORDS] (``stage_tiles``): the rows grouped by stage position in
    # tiles of TILE_ROWS, for steps below ``stacked.ROWS_KERNEL_MIN`` rows; None: those steps
    # run by row blocks too.
    tiles: torch.Tensor | None = None


# Staged steps below this many rows (decode steps, eager staged steps and prompt-step graphs
# up to 4,096 tokens; the largest is 1,024 by default) come with tiles (``StageInfo.tiles``,
# written by ``StaticLoRABatch``), and a program of the stacked epilogues and the LoRA
# rotation takes one of them. From it, and for a ``StageInfo`` without tiles, they run
# ``BY_ROWS``: programs over (row block, column block) that visit the positions their rows
# hold. At 816 rows over 16 positions (a mixed step's, H100, bench/probes/stacked_width.py)
# the tiles took the four epilogues of a layer from 109.6 to 82.7 us (base ops 53.7). Read as
# ``stacked.ROWS_KERNEL_MIN`` by the kernels (probes and tests set it there); here so that
# ``StaticLoRABatch`` reads it without importing Triton.
ROWS_KERNEL_MIN = 4097

# Rows per tile of a staged step's epilogues (``stage_tiles``; tl.dot needs 16).
TILE_ROWS = 16
# int32 words per tile: its rows (-1: none), then its stage position, its slot, its scaling's
# float32 bits and one word of padding (16-byte aligned tiles).
TILE_WORDS = TILE_ROWS + 4


def stage_tile_capacity(rows: int, width: int) -> int:
    """The most tiles ``stage_tiles`` makes of ``rows`` rows over ``width`` positions: each
    position's rows and the rows with no adapter leave at most one partial tile."""
    return cdiv(rows, TILE_ROWS) + width + 1


def stage_tiles(
    row_pos: Sequence[int],
    pos_slots: Sequence[int],
    scaling_bits: Sequence[int],
    capacity: int,
) -> list[int]:
    """A staged step's rows grouped by stage position in tiles of ``TILE_ROWS`` rows, each
    tile with its position, slot and scaling (``scaling_bits``: the positions' float32
    scalings as int32 words), padded to ``capacity`` tiles: ``capacity * TILE_WORDS`` int32.

    The epilogues below ``stacked.ROWS_KERNEL_MIN`` rows run a program per (tile, columns):
    its first round trip loads the tile's rows, position, slot and scaling from the tile
    alone, the second the rows' values, their ``y`` and the position's B, and no program is
    launched for a (row block, position) pair that holds no row. Rows at -1, past the width or
    at a position with no slot form tiles of their own (position and slot -1): the base value
    only. A padding tile has no rows (its programs return after the first round trip)."""
    width = len(pos_slots)
    groups: dict[int, list[int]] = {}
    for row, p in enumerate(row_pos):
        key = p if 0 <= p < width and pos_slots[p] >= 0 else -1
        groups.setdefault(key, []).append(row)
    words: list[int] = []
    for p, rows in sorted(groups.items(), key=lambda kv: (kv[0] < 0, kv[0])):
        slot, bits = (pos_slots[p], scaling_bits[p]) if p >= 0 else (-1, 0)
        for lo in range(0, len(rows), TILE_ROWS):
            chunk = rows[lo : lo + TILE_ROWS]
            words += [*chunk, *[-1] * (TILE_ROWS - len(chunk)), p, slot, bits, 0]
    tiles = len(words) // TILE_WORDS
    if tiles > capacity:
        raise ValueError(f"{tiles} stage tiles do not fit a capacity of {capacity}")
    pad = [*[-1] * TILE_ROWS, -1, -1, 0, 0]
    return words + pad * (capacity - tiles)


def with_tiles(stage: StageInfo) -> StageInfo:
    """``stage`` with the tiles of its rows as they are now, built on the host from its
    tensors read back (tests, probes; the runtime's ``StaticLoRABatch`` writes the same tiles
    into its packed buffer, with no read back)."""
    tiles = stage_tiles(
        stage.row_pos.tolist(),
        stage.pos_slots.tolist(),
        stage.pos_scalings.float().cpu().view(torch.int32).tolist(),
        stage_tile_capacity(stage.row_pos.shape[0], stage.width),
    )
    device = stage.row_pos.device
    return dataclasses.replace(stage, tiles=torch.tensor(tiles, dtype=torch.int32, device=device))


@dataclass(frozen=True, slots=True)
class TileMap:
    """Programs over tiles whose rows are listed, not derived (the MoE kernels' grid).

    Program ``t`` computes the rows ``rows[t * BLOCK_S : t * BLOCK_S + lens[t]]`` of weight slot
    ``segs[t]`` (-1: a padding tile, the program returns); ``ranks[t]`` is that slot's rank
    (None: the kernel reads ``slot_ranks`` at the slot, one round trip later). Built on the
    device by ``moe_lora_routing``.
    """

    segs: torch.Tensor  # int32 [tiles]
    lens: torch.Tensor  # int32 [tiles]
    rows: torch.Tensor  # int64 [tiles * BLOCK_S]
    ranks: torch.Tensor | None  # int32 [tiles]


@dataclass(frozen=True, slots=True)
class ShrinkConfig:
    block_s: int
    block_r: int
    block_k: int
    num_warps: int
    num_stages: int = 3  # the software pipeline's depth over the K loop (Triton's default)


@dataclass(frozen=True, slots=True)
class ExpandConfig:
    block_s: int
    block_r: int
    block_n: int
    num_warps: int


def segment_block(max_seg_len: int) -> int:
    """Rows per program: 16 covers decode (segments of a few tokens), larger for prefill."""
    if max_seg_len <= 16:
        return 16
    if max_seg_len <= 32:
        return 32
    return 64


def rank_block(rank_max: int) -> int:
    return max(MIN_DOT_BLOCK, next_power_of_2(rank_max))


# (block_k, num_warps, num_stages) for every shrink instead of the rule below when set
# (bench/probes/shrink_tune.py).
SHRINK_OVERRIDE: tuple[int, int, int] | None = None


def shrink_config(
    max_seg_len: int, rank_max: int, hidden: int, elem_bytes: int = 2
) -> ShrinkConfig:
    """Fixed configs (no autotune): a K-loop over ``block_k`` columns of x and A."""
    return _shrink_config(max_seg_len, rank_max, hidden, elem_bytes, SHRINK_OVERRIDE)


@functools.lru_cache(maxsize=1024)
def _shrink_config(
    max_seg_len: int,
    rank_max: int,
    hidden: int,
    elem_bytes: int,
    override: tuple[int, int, int] | None,
) -> ShrinkConfig:
    # Cached: it runs on every eager launch, and its arguments take few values.
    block_s = segment_block(max_seg_len)
    block_r = rank_block(rank_max)
    # Keep the x tile + A tile around 32 KB, in K steps of at most 128 columns. (fp32 at
    # 64 x 64 with 256-wide K steps asked an H200 for 256 KB of shared memory over the
    # software pipeline's stages, more than its 227 KB.) 128 against 256, on an H200 over
    # 15 decode cases (bench/probes/shrink_tune.py): 1.055 of the
    # best config's time against 1.124 for the dense shapes (qkv rank 64: 16.8 -> 13.5 us),
    # 1.043 against 1.058 for the MoE; stages and warps changed under 3%.
    budget = 16384 * 2 // max(1, elem_bytes)
    block_k = max(MIN_DOT_BLOCK, min(128, budget // max(block_s, block_r)))
    num_warps, num_stages = 4, 3
    if override is not None:
        block_k, num_warps, num_stages = override
    block_k = min(block_k, max(MIN_DOT_BLOCK, next_power_of_2(hidden)))
    return ShrinkConfig(
        block_s=block_s,
        block_r=block_r,
        block_k=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
    )


# Programs wanted in flight: about two per multiprocessor of an H100/H200 (132).
TARGET_PROGRAMS = 264
# Each K split covers at least this many columns of K. The shrink's last program per tile
# sums the splits, so their number costs no expand column block a re-read; what
# is left is each program's fixed cost against its share of K, and that last program's serial
# sum. Measured on an H200 at decode (bench/probes/shrink_split.py, rank 16, 1/4
# adapters, 16-128 tokens), graph-timed shrink: K 4096 best at 8 splits (one 256-column step
# each at 16: up to 1.9 us slower), K 14336 at 28 (8 splits: 7.7-9.6 us, 28: 5.9-8.4 us): 512
# columns per split picks both. (Counted in K steps instead, two 128-column steps a split, a
# one-adapter down shrink at rank 64 splits 56 ways and its last program sums 56 partials:
# 14 -> 20 us; bench/results/2026-11-30-h200-s13/kernels.json.)
MIN_K_PER_SPLIT = 512
# A fixed cap on the splits instead of the rule above when set (bench/probes/switches.py split=N).
MAX_SPLIT_K: int | None = None


def split_k_for(programs: int, hidden: int, block_k: int, cap: int | None = None) -> int:
    """Split the K loop when the (segment, block, slice) grid alone cannot fill the GPU.

    At most one split per ``MIN_K_PER_SPLIT`` columns (whole K steps), or ``cap``
    (``MAX_SPLIT_K`` when set) splits; 1 keeps the shrink on few programs.

    The split count is a constexpr of the kernel, so each value is a variant Triton
    compiles apart: the wanted count (``TARGET_PROGRAMS / programs``) is rounded down to a
    power of two, which gives a projection a handful of variants over every grid an eager
    step can launch instead of one per grid size, and lets the warm-up cover them
    (``split_class``)."""
    k_blocks = max(1, cdiv(hidden, block_k))
    # Past a quarter of the target the extra partial buffer and reduction cost more than the
    # idle multiprocessors (measured on an H200: qkv prefill, 96 programs, 20 -> 36 us).
    if programs <= 0 or programs >= TARGET_PROGRAMS // 4:
        return 1
    if cap is None:
        steps = max(1, MIN_K_PER_SPLIT // block_k)
        cap = MAX_SPLIT_K if MAX_SPLIT_K is not None else k_blocks // steps
    wanted = 1 << (cdiv(TARGET_PROGRAMS, programs).bit_length() - 1)
    return max(1, min(k_blocks, cap, wanted))


def split_class(grid: int) -> tuple[int, int, int]:
    """The split counts (``split_k_for``) of shrinks of 1, 2 and 3 slices over a grid of
    ``grid`` (segment, block) programs per slice, before any cap. Grids of one class give
    every projection the same variants (a cap only merges counts), so an eager step of each
    class warms them all (``engine/warmup.py``)."""
    uncapped = 1 << 30
    return (
        split_k_for(grid, uncapped, 1, uncapped),
        split_k_for(2 * grid, uncapped, 1, uncapped),
        split_k_for(3 * grid, uncapped, 1, uncapped),
    )


# (block_n, num_warps) for every expand instead of the rule below when set
# (bench/probes/expand_tune.py).
EXPAND_OVERRIDE: tuple[int, int] | None = None


def expand_config(max_seg_len: int, rank_max: int, n_total: int) -> ExpandConfig:
    """Fixed configs: one rank tile (whole rank), ``block_n`` output columns per program."""
    return _expand_config(max_seg_len, rank_max, n_total, EXPAND_OVERRIDE)


@functools.lru_cache(maxsize=1024)
def _expand_config(
    max_seg_len: int, rank_max: int, n_total: int, override: tuple[int, int] | None
) -> ExpandConfig:
    block_s = segment_block(max_seg_len)
    block_r = rank_block(rank_max)
    block_n = 128 if block_r <= 64 else 64
    num_warps = 4
    if override is not None:
        block_n, num_warps = override
    block_n = min(block_n, max(MIN_DOT_BLOCK, next_power_of_2(n_total)))
    return ExpandConfig(block_s=block_s, block_r=block_r, block_n=block_n, num_warps=num_warps)
