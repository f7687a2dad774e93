"""Our int4 layout <-> the layout of torch's CPU int4 kernel (``_weight_int4pack_mm_for_cpu``).

The kernel computes, per group g of 32 input columns and output row n::

    w[n, k] = (q[n, k] - 8) * scale[g, n] + bias[g, n]     # qScaleAndZeros: [K/32, N, 2]

where q is the unsigned nibble and ``[..., 0]`` is the scale, ``[..., 1]`` the bias, both in the
activation's dtype (bf16 with bf16, float32 with float32). Our format says w = (q - z) * s, so
bias = (8 - z) * s. In float32 that is exact: s is an fp16 value (11 significant bits) and 8 - z
a 4-bit integer, so the kernel's decode equals ours bit for bit. In bf16, s and bias round to
8 significant bits (relative error <= 2^-9 per weight): the documented bf16 tolerance.

``_convert_weight_to_int4pack_for_cpu`` takes int32 codes [N, K] (N a multiple of 16) and returns
uint8 [N, K/2] in a blocked order that depends on N. The order is a permutation of nibbles, so
:func:`kernel_permutation` learns it from the op itself (a few passes that pack the base-16 digits
of each element's index) instead of hard-coding one torch version's blocking; recovering our
codes from the kernel layout is then a scatter.
"""

from __future__ import annotations

import torch

from .base import BLOCK, unpack_nibbles

KERNEL_ROW_MULTIPLE = 16  # the op requires N % 16 == 0


def kernel_supports(out_features: int, in_features: int) -> bool:
    return out_features % KERNEL_ROW_MULTIPLE == 0 and in_features % BLOCK == 0


def to_kernel_codes(codes: torch.Tensor) -> torch.Tensor:
    """Our packed codes uint8 [N, K/2] -> the kernel's uint8 [N, K/2]."""
    values = unpack_nibbles(codes).to(torch.int32)
    kernel_codes: torch.Tensor = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, 1)
    return kernel_codes


def kernel_scale_bias(scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """scales fp16 [N, G], zero points uint8 [N, G] -> qScaleAndZeros [G, N, 2] in ``dtype``."""
    scale = scales.to(torch.float32)
    bias = (8.0 - zeros.to(torch.float32)) * scale
    return torch.stack((scale, bias), dim=-1).transpose(0, 1).contiguous().to(dtype)


def kernel_matmul(x: torch.Tensor, kernel_codes: torch.Tensor, scale_bias: torch.Tensor) -> torch.Tensor:
    """x: [rows, K] in scale_bias's dtype -> [rows, N]."""
    y: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(x, kernel_codes, BLOCK, scale_bias)
    return y


def kernel_permutation(out_features: int, in_features: int) -> torch.Tensor:
    """int64 [N*K]: for each nibble of the kernel layout (low nibble first), its row-major index n*K + k."""
    count = out_features * in_features
    index = torch.arange(count, dtype=torch.int64)
    permutation = torch.zeros(count, dtype=torch.int64)
    shift = 0
    while (1 << shift) < count:
        digit = ((index >> shift) & 0x0F).to(torch.int32).reshape(out_features, in_features)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(digit, 1)
        permutation |= unpack_nibbles(packed).reshape(-1).to(torch.int64) << shift
        shift += 4
    return permutation


def from_kernel_codes(kernel_codes: torch.Tensor, in_features: int, permutation: torch.Tensor) -> torch.Tensor:
    """The kernel's uint8 [N, K/2] -> our packed codes uint8 [N, K/2]."""
    out_features = kernel_codes.shape[0]
    values = torch.empty(out_features * in_features, dtype=torch.uint8)
    values[permutation] = unpack_nibbles(kernel_codes).reshape(-1)
    packed = values.reshape(out_features, in_features // 2, 2)
    return packed[..., 0] | (packed[..., 1] << 4)
