"""Gathered expert matmul for a few (row, expert) pairs, reading expert weights in place.

For decode, a batch touches only a few experts. The plain-torch path gathers each pair's expert
weights into a temporary and runs a batched matmul, reading and writing every weight byte twice
more than needed. This Triton kernel reads each pair's weight rows directly from the expert bank:

    out[p, n] = sum_k w[index[p], n, k] * x[p // row_div, k]

w: [E, N, K] with K contiguous; x: [rows, K]; index: [P] int64; out: [P, N] in x's dtype,
accumulated in float32. ``row_div`` = top_k maps pairs to tokens for the first projection, 1 for
the second (whose input is already per pair).
"""

from __future__ import annotations

import torch

try:  # triton ships with CUDA builds of torch; CPU machines have none
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the machine
    HAVE_TRITON = False


def available(x: torch.Tensor) -> bool:
    return HAVE_TRITON and x.is_cuda


if HAVE_TRITON:
    _CONFIGS = [
        triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=nw)
        for bn in (8, 16, 32, 64)
        for bk in (128, 256, 512)
        for nw in (4, 8)
        if bn * bk <= 16384
    ]

    @triton.autotune(configs=_CONFIGS, key=["N", "K", "ROW_DIV"])
    @triton.jit
    def _expert_gemv_kernel(
        x_ptr,
        w_ptr,
        index_ptr,
        out_ptr,
        N,
        K,
        stride_xm,
        stride_we,
        stride_wn,
        stride_om,
        ROW_DIV: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        pair = tl.program_id(0)
        block_n = tl.program_id(1)
        expert = tl.load(index_ptr + pair)
        row = pair // ROW_DIV
        offs_n = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        w_base = w_ptr + expert * stride_we + offs_n[:, None] * stride_wn
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            x = tl.load(x_ptr + row * stride_xm + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            w = tl.load(w_base + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
            acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        tl.store(out_ptr + pair * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=mask_n)


def expert_gemv(x: torch.Tensor, w: torch.Tensor, index: torch.Tensor, row_div: int) -> torch.Tensor:
    """x: [rows, K], w: [E, N, K], index: [P] -> [P, N]."""
    pairs, (_, n, k) = index.numel(), w.shape
    assert w.stride(2) == 1 and x.stride(1) == 1, "expert_gemv needs K-contiguous weights and inputs"
    out = torch.empty((pairs, n), dtype=x.dtype, device=x.device)

    def grid(meta: dict[str, int]) -> tuple[int, int]:
        return (pairs, triton.cdiv(n, meta["BLOCK_N"]))

    # the autotuner times its configs on first use per shape (before any graph capture)
    _expert_gemv_kernel[grid](
        x, w, index, out, n, k, x.stride(0), w.stride(0), w.stride(1), out.stride(0), ROW_DIV=row_div
    )
    return out
