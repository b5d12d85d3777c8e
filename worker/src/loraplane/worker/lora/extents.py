"""How many rows of a stacked weight the staged GEMM reads (``lora/stage.py``, ADR 0007).

A staged projection computes ``x [W; A_staged]^T`` over the first ``N + need`` rows of its
stacked weight, ``need = width * slices * stage rank``. cuBLAS picks its kernel by shape, and
those few extra rows can move it to a slower one. Reading rows past ``need`` changes no
result: their output columns are never read (``kernels/stacked.py`` reads only ``N + need``).

``EXTENTS`` holds, per GPU model, ``(K, N) -> (need, rows) -> extent``, ``rows`` a decode
graph bucket; everything else reads ``need``. A table, not a measurement at start-up, so the
GEMM (and the bits of its output) is the same on every run of one GPU model. A stacking
wrapper allocates ``pad_rows`` extra zero rows when its shape has entries past its stage
positions.

The H200 entries are the 32-row bucket only. Alone, from cold L2
(``bench/probes/gemm_extents.py``), o_proj (4096 x 4096) at 32 rows took 17.4 us
at ``N + 16`` and 15.3 at ``N + 384``, down_proj 42.4 at ``N + 16`` and 41.5 at ``N + 128``;
wider extents were faster at 16 rows too. Inside the decode step (graphs, Llama-3-8B shape,
8 layers) a table with the 16-row entries lowered bs 16 (0.939 / 0.941 against 0.956 / 0.962
with one adapter) and raised bs 32 (0.980 / 0.960 against 0.958 / 0.955), two runs each
(docs/performance.md has the 32-row table measured in the step).
"""

from __future__ import annotations

# Set False to read exactly `need` rows (bench/probes/switches.py extents=0).
ENABLED = True

# GPU model (torch.cuda.get_device_name) -> (K, N) -> (need, rows) -> rows past N to read.
# Measured on an H200 with torch 2.11.0+cu130 (bench/results/2026-11-30-h200-s9/gemm_extents.json:
# at 32 rows every o_proj need was fastest at 384, every down_proj need up to 64 at 128).
EXTENTS: dict[str, dict[tuple[int, int], dict[tuple[int, int], int]]] = {
    "NVIDIA H200": {
        (4096, 4096): {(need, 32): 384 for need in (16, 32, 64, 128, 256)},  # o_proj
        (14336, 4096): {(need, 32): 128 for need in (16, 32, 64)},  # down_proj
    },
}


def extent_for(device_name: str, k: int, n: int, need: int, rows: int, available: int) -> int:
    """Rows past ``N`` the GEMM of ``rows`` input rows reads: the table's extent when there
    is one within the ``available`` rows, else ``need``."""
    if not ENABLED:
        return need
    extent = EXTENTS.get(device_name, {}).get((k, n), {}).get((need, rows), need)
    return extent if need <= extent <= available else need


def pad_rows(device_name: str, k: int, n: int, stage_rows: int) -> int:
    """Zero rows to allocate past the ``stage_rows`` of a stacked ``[N + stage_rows, K]``
    weight so that every table extent for a ``need`` it can have fits."""
    entries = EXTENTS.get(device_name, {}).get((k, n), {})
    widest = max((e for (need, _), e in entries.items() if need <= stage_rows), default=0)
    return max(0, widest - stage_rows)
