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
with the compiled block and chosen at export, automatically (:func:`layer_exponent`). The seed
records A_8 = 16 without spelling out how it was picked; its bound gives the rule: with the row
factors, a row's weighted sum is bounded componentwise by the largest attenuated expert value, so
the values A_l divides (the up projection, the SwiGLU product and the expert output) are what must
stay in range. n_l is the smallest n >= 0 bringing their calibrated peak (:func:`expert_peak`
over :func:`calibration_rows`, in float32 on the host) under the execution type's largest finite
value divided by :data:`HEADROOM`; a block executing in f32 or bf16 (a CPU) never needs one.
"""

from __future__ import annotations

import math

import torch

FP16_MAX = 65504.0
# the largest finite value of each type a compiled block may execute in
LARGEST = {"f16": FP16_MAX, "bf16": 3.3895e38, "f32": 3.4028e38}
# how far under that the calibrated peak must stay: room for peaks calibration did not see, the
# weighted sum of K outputs and the next rounding
HEADROOM = 8
FP16_SAFE_PEAK = FP16_MAX / HEADROOM
CALIBRATION_ROWS = 16  # per layer: half random unit-RMS rows, half single-channel ones


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


def execution_type(device: str, precision: str) -> str:
    """The type a compiled block's arithmetic runs in: ``f32`` at the exact precision; otherwise
    the device's own (f16 on GPUs; bf16 on CPUs, or f32 where the CPU has no bf16: same range)."""
    if precision == "f32":
        return "f32"
    return "f16" if device.split(".")[0].upper() == "GPU" else "bf16"


def layer_exponent(peak: float, execution: str) -> int:
    """Eq. 1's n_l for a layer whose attenuated values reach ``peak`` (calibrated in float32) when
    executed in ``execution`` (:data:`LARGEST`): 0 unless the peak exceeds that type's largest
    finite value / :data:`HEADROOM`."""
    if execution not in LARGEST:
        raise ValueError(f"execution type {execution!r} is not one of {', '.join(LARGEST)}")
    return attenuation_exponent(peak, LARGEST[execution] / HEADROOM)


def needs_calibration(execution: str) -> bool:
    """Whether any float32 peak could need attenuation in ``execution`` (only f16's range is small)."""
    return LARGEST[execution] < LARGEST["bf16"]


def calibration_rows(norm_weight: torch.Tensor, count: int = CALIBRATION_ROWS, seed: int = 0) -> torch.Tensor:
    """Rows [count, H] shaped like what a feed-forward block receives: an RMS norm's output, gamma
    times a unit-RMS row. Half are random directions; half put the whole norm (sqrt(H)) on one of
    the channels of largest |gamma|, the norm's output for a residual dominated by one channel
    (the massive activations of LLM residual streams), where a block's outputs peak."""
    gamma = norm_weight.detach().to(torch.float32).flatten()
    hidden = gamma.numel()
    generator = torch.Generator().manual_seed(seed)
    random = torch.randn(count - count // 2, hidden, generator=generator)
    random = random / random.pow(2).mean(dim=-1, keepdim=True).sqrt()
    channels = gamma.abs().argsort(descending=True)[: count // 2]
    single = torch.zeros(channels.numel(), hidden)
    single[torch.arange(channels.numel()), channels] = math.sqrt(hidden)
    return torch.cat([random, single]) * gamma


def expert_peak(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, rows: torch.Tensor) -> float:
    """The largest magnitude among the values Eq. 1's A divides (up projection, SwiGLU product,
    expert output) of one expert (float32 gate, up [I, H], down [H, I]) over ``rows`` [R, H]."""
    u = rows @ up.T
    h = torch.nn.functional.silu(rows @ gate.T) * u
    y = h @ down.T
    return max(float(t.abs().max()) for t in (u, h, y))
