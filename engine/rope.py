"""Rotary position embeddings: default, linear and YaRN, computed for arbitrary row positions.

Rows of a frame carry their own positions, so cos/sin are computed per row rather than for a
contiguous range. Frequencies follow the YaRN paper and the reference implementation
(transformers' ``_compute_yarn_parameters``): an extrapolation/interpolation ramp between the
``beta_fast``/``beta_slow`` correction dims and an attention factor that scales cos and sin.
"""

from __future__ import annotations

import math

import torch

from .spec import RopeSpec


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _correction_dim(rotations: float, dim: int, base: float, max_pos: int) -> float:
    return (dim * math.log(max_pos / (rotations * 2 * math.pi))) / (2 * math.log(base))


def inv_freq_and_factor(rope: RopeSpec, dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """inv_freq: [dim // 2] float32, and the factor applied to cos/sin."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    pos_freqs = rope.theta**exponents
    inv_freq = 1.0 / pos_freqs
    if rope.rope_type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.rope_type != "yarn":
        return inv_freq, 1.0
    original = rope.original_max_position_embeddings or max_position_embeddings
    factor = rope.factor
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    low = _correction_dim(rope.beta_fast, dim, rope.theta, original)
    high = _correction_dim(rope.beta_slow, dim, rope.theta, original)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
    return inv_freq, float(attention_factor)


class Rotary:
    """cos/sin for row positions; ``apply`` rotates the last dim of [rows, heads, dim] tensors."""

    def __init__(self, rope: RopeSpec, dim: int, max_position_embeddings: int, interleaved: bool = False):
        inv_freq, self.factor = inv_freq_and_factor(rope, dim, max_position_embeddings)
        self.inv_freq = inv_freq
        self._inv_freq_on: dict[torch.device, torch.Tensor] = {}
        self.interleaved = interleaved

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin, [rows, 1, dim]: computed in float32 then cast, as the reference does."""
        inv_freq = self._inv_freq_on.get(positions.device)
        if inv_freq is None:  # copied once per device: a graph capture must not copy from the host
            inv_freq = self._inv_freq_on[positions.device] = self.inv_freq.to(positions.device)
        angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
        cos = torch.cat((angles, angles), dim=-1).cos() * self.factor
        sin = angles.sin() * self.factor
        signed_sin = torch.cat((-sin, sin), dim=-1)  # rotate_half's sign folded into sin
        return cos.to(dtype)[:, None, :], signed_sin.to(dtype)[:, None, :]

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.interleaved:
            # pairs (x0, x1), (x2, x3)... become halves, as DeepSeek's rope_interleave does
            rows, heads, dim = x.shape
            x = x.view(rows, heads, dim // 2, 2).transpose(-1, -2).reshape(rows, heads, dim)
        half = x.shape[-1] // 2
        swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
        return torch.addcmul(x * cos, swapped, sin)  # sin is signed: x*cos + rotate_half(x)*sin
