"""A residual add and the RMS norm after it in one kernel: h = x + delta, y = rms_norm(h) * weight.

A decoder layer adds the attention's output to its residual and normalises the sum; at decode
sizes the two launches cost more than their arithmetic. One program handles one row: h is
rounded to the activations' dtype (as the torch add), the norm is computed from the rounded h in
float32 and rounded once after the scale (as ``F.rms_norm``'s fused kernel).

Shapes: x, delta: [R, H] (rows contiguous); weight: [H]. Returns h, y: [R, H] in x's dtype.
"""

from __future__ import annotations

import torch

from .expert_gemv import HAVE_TRITON

MAX_HIDDEN = 16384

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, h_ptr, y_ptr, H, EPS, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        inside = offs < H
        x = tl.load(x_ptr + row * H + offs, mask=inside, other=0.0)
        d = tl.load(d_ptr + row * H + offs, mask=inside, other=0.0)
        h = (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)
        tl.store(h_ptr + row * H + offs, h, mask=inside)
        hf = h.to(tl.float32)
        r = tl.rsqrt(tl.sum(hf * hf, axis=0) / H + EPS)
        w = tl.load(w_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * H + offs, (hf * r * w).to(x.dtype), mask=inside)


def applies(x: torch.Tensor, delta: torch.Tensor) -> bool:
    return (
        HAVE_TRITON
        and x.is_cuda
        and x.dim() == 2
        and x.dtype == delta.dtype
        and x.shape == delta.shape
        and x.shape[1] <= MAX_HIDDEN
        and x.is_contiguous()
        and delta.is_contiguous()
    )


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    rows, hidden = x.shape
    h, y = torch.empty_like(x), torch.empty_like(x)
    block = triton.next_power_of_2(hidden)
    _add_rms_norm_kernel[(rows,)](x, delta, weight, h, y, hidden, eps, BLOCK=block, num_warps=8 if block >= 4096 else 4)
    return h, y
