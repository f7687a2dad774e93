"""Numerical range across the FP16/FP32 boundary (seed 000 §3.3, Eq. 1), as pure functions.

An expert block executed in FP16 (OpenVINO's GPU default) can overflow in two places: the expert
outputs themselves and their routing-weighted sum. Two powers of two keep both in range:

- the layer attenuation A_l = 2^n_l, applied at export to the up projection (its scales for int4,
  its values for float weights): SwiGLU is linear in the up branch, so every expert output
  E_le(x) becomes E_le(x) / A_l exactly (a power of two changes only exponents);
- the row factor F_i = 2^ceil(log2 max(1, sum_e |w_ie|)), dividing the row's routing weights so
  that they sum to at most 1 in absolute value (DeepSeek's routed_scaling_factor, shared experts
  entering with weight 1 and all-active dense slices all push the sum above 1).

The host restores y_i = A_l * F_i * y~_i in FP32. The exponent n_l is layer metadata, recorded
with the compiled block, chosen so the largest expert output seen at calibration stays under
:data:`FP16_SAFE_PEAK`.
"""

from __future__ import annotations

import math

import torch

FP16_MAX = 65504.0
# the largest magnitude a block's expert outputs may reach after attenuation: one eighth of the
# FP16 range, leaving room for the weighted sum of K outputs and the next rounding
FP16_SAFE_PEAK = FP16_MAX / 8


def row_factors(weights: torch.Tensor) -> torch.Tensor:
    """weights [R, K] -> F [R, 1]: the smallest power of two >= max(1, sum_k |w_rk|)."""
    total = weights.abs().sum(dim=-1, keepdim=True).clamp(min=1.0)
    return torch.exp2(torch.ceil(torch.log2(total)))


def attenuation_exponent(peak: float, limit: float = FP16_SAFE_PEAK) -> int:
    """The n with 2^n the smallest power of two bringing ``peak`` (the largest expert output
    magnitude seen) under ``limit``; 0 when it already is."""
    if not math.isfinite(peak):
        raise ValueError(f"peak expert output {peak} is not finite; calibrate in float32")
    if peak <= limit:
        return 0
    return math.ceil(math.log2(peak / limit))


def restore(y: torch.Tensor, factors: torch.Tensor, exponent: int) -> torch.Tensor:
    """y~ [R, H] from the device -> y [R, H] = A * F * y~, in float32."""
    return y.to(torch.float32) * (factors.to(torch.float32) * float(2**exponent))
