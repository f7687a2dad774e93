"""Decode-in-tiles matmul: x @ W.T for a weight that is only ever decoded a few columns at a time.

The format supplies ``decode_columns(k_start, k_end, dtype) -> [out, k_end - k_start]``; this loop
decodes one tile of input columns into a small buffer, multiplies, and accumulates in float32,
so the full float weight is never materialised (the buffer holds at most ``TILE_ELEMENTS``).
It is the CPU kernel for MXFP4 and the fallback on any device where no fused kernel applies.

Precision: bf16 activations multiply bf16 tiles (each tile's product rounds to bf16 before the
float32 sum); every other dtype computes in float32 and the result is cast back to x's dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .base import BLOCK

TILE_ELEMENTS = 1 << 20  # decoded weights per tile (2 MiB bf16): fewer, larger tiles win while torch
# op overhead, not cache misses, dominates (measured: 2^17 -> 2^20 is 2x faster at 1536x2048)

DecodeColumns = Callable[[int, int, torch.dtype], torch.Tensor]


def compute_dtype(x_dtype: torch.dtype) -> torch.dtype:
    return torch.bfloat16 if x_dtype == torch.bfloat16 else torch.float32


def tile_columns(out_features: int, in_features: int) -> int:
    """Input columns per tile: a multiple of BLOCK, at least one block."""
    columns = max(BLOCK, TILE_ELEMENTS // max(out_features, 1) // BLOCK * BLOCK)
    return min(columns, in_features)


def tiled_matmul(x: torch.Tensor, decode_columns: DecodeColumns, out_features: int) -> torch.Tensor:
    """x: [rows, in] -> [rows, out] in x's dtype."""
    rows, in_features = x.shape
    dtype = compute_dtype(x.dtype)
    xc = x.to(dtype)
    acc = torch.zeros((rows, out_features), dtype=torch.float32, device=x.device)
    step = tile_columns(out_features, in_features)
    for k_start in range(0, in_features, step):
        k_end = min(in_features, k_start + step)
        w_tile = decode_columns(k_start, k_end, dtype)  # [out, k_end - k_start]
        if dtype == torch.float32:
            acc.addmm_(xc[:, k_start:k_end], w_tile.t())
        else:
            acc.add_(torch.mm(xc[:, k_start:k_end], w_tile.t()))
    return acc.to(x.dtype)
