"""How many rows of a stacked weight the staged GEMM reads (``lora/stage.py``, ADR 0007).

A staged projection computes ``x [W; A_staged]^T`` over the first ``N + need`` rows of its
stacked weight, ``need = width * slices * stage rank``. cuBLAS picks its kernel by shape, and
those few extra rows can move it to a slower one: on an H200, o_proj (4096 x 4096) at 16-32
rows takes 16.8 us at ``N + 16`` and 15.1 at ``N + 384``, down_proj 42.1 at ``N + 16`` and 40.9
at ``N + 128`` (``bench/probes/gemm_extents.py``, session 9). Reading rows past ``need`` has no
effect on any result: their output columns are never read.

``EXTENTS`` holds, per GPU model, the cases the probe found at least 2% faster at a wider
extent: ``(K, N) -> (need, rows) -> extent``, ``rows`` a decode graph bucket. Everything else
reads ``need``. A table, not a measurement at start-up, so the GEMM (and the bits of its
output) is the same on every run of one GPU model. A stacking wrapper allocates
``pad_rows`` extra zero rows when its shape has entries past its stage positions.
"""

from __future__ import annotations

# Set False to read exactly `need` rows (bench/probes/switches.py extents=0).
ENABLED = True

# GPU model (torch.cuda.get_device_name) -> (K, N) -> (need, rows) -> rows past N to read.
# Measured on an H200 with torch 2.11.0+cu130 (bench/results/2026-11-30-h200-s9/gemm_extents.json).
EXTENTS: dict[str, dict[tuple[int, int], dict[tuple[int, int], int]]] = {
    "NVIDIA H200": {
        (4096, 4096): {
            (16, 16): 384,
            (16, 24): 384,
            (16, 32): 384,
            (16, 48): 256,
            (16, 96): 512,
            (32, 16): 384,
            (32, 24): 384,
            (32, 32): 384,
            (32, 48): 256,
            (32, 96): 512,
            (64, 1): 128,
            (64, 8): 256,
            (64, 16): 384,
            (64, 24): 384,
            (64, 32): 384,
            (64, 48): 256,
            (64, 96): 512,
            (64, 160): 384,
            (64, 256): 256,
            (128, 16): 384,
            (128, 24): 384,
            (128, 32): 384,
            (128, 48): 256,
            (128, 96): 512,
            (128, 256): 256,
            (256, 16): 384,
            (256, 24): 384,
            (256, 32): 384,
            (256, 64): 384,
            (256, 96): 512,
            (256, 192): 512,
        },
        (14336, 4096): {
            (16, 1): 128,
            (16, 2): 128,
            (16, 8): 128,
            (16, 16): 128,
            (16, 24): 128,
            (16, 32): 128,
            (16, 48): 128,
            (32, 1): 128,
            (32, 2): 128,
            (32, 4): 128,
            (32, 16): 128,
            (32, 24): 128,
            (32, 32): 128,
            (64, 1): 128,
            (64, 2): 128,
            (64, 4): 128,
            (64, 8): 128,
            (64, 16): 128,
            (64, 24): 128,
            (64, 32): 128,
            (64, 48): 128,
            (256, 64): 384,
        },
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
