"""A contiguous KV cache: one row of `max_len` positions per running sequence."""

from __future__ import annotations

import torch


class KVCache:
    def __init__(
        self,
        num_layers: int,
        max_seqs: int,
        max_len: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (max_seqs, max_len, kv_heads, head_dim)  # [rows, positions, kv_heads, d]
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_seqs = max_seqs
        self.max_len = max_len
