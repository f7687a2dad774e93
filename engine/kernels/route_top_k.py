"""Softmax-top-k routing in one kernel: pick each row's k largest router logits and return their
softmax (which equals softmax over all experts renormalised over the chosen k).

Plain torch spends a radix-select kernel plus a softmax and casts on this per layer; at decode
sizes (a few rows, <= 256 experts) each launch costs more than the arithmetic. One program
handles one row: k rounds of max/argmax with the winner masked out, then the k weights.
"""

from __future__ import annotations

import torch

from .expert_gemv import HAVE_TRITON

MAX_EXPERTS = 1024

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _route_top_k_kernel(logits_ptr, index_ptr, weight_ptr, E, stride, K: tl.constexpr, BLOCK_E: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK_E)
        x = tl.load(logits_ptr + row * stride + offs, mask=offs < E, other=float("-inf")).to(tl.float32)
        top = tl.max(x, axis=0)
        total = 0.0
        for i in tl.static_range(K):
            m = tl.max(x, axis=0)
            j = tl.argmax(x, axis=0)
            tl.store(index_ptr + row * K + i, j.to(tl.int64))
            total += tl.exp(m - top)
            x = tl.where(offs == j, float("-inf"), x)
        tl.debug_barrier()
        ks = tl.arange(0, K)
        picked = tl.load(logits_ptr + row * stride + tl.load(index_ptr + row * K + ks)).to(tl.float32)
        tl.store(weight_ptr + row * K + ks, tl.exp(picked - top) / total)


def available(logits: torch.Tensor) -> bool:
    return HAVE_TRITON and logits.is_cuda and logits.shape[-1] <= MAX_EXPERTS


def route_top_k(
    logits: torch.Tensor, top_k: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [T, E] -> index [T, k] int64, weight [T, k] (softmax over the chosen k, computed in
    float32 and stored in ``dtype``: the layer's dtype saves a cast kernel per layer)."""
    rows, experts = logits.shape
    logits = logits.contiguous()
    index = torch.empty((rows, top_k), dtype=torch.int64, device=logits.device)
    weight = torch.empty((rows, top_k), dtype=dtype, device=logits.device)
    block = triton.next_power_of_2(experts)
    _route_top_k_kernel[(rows,)](logits, index, weight, experts, logits.stride(0), K=top_k, BLOCK_E=block)
    return index, weight
