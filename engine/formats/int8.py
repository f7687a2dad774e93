"""int8, symmetric, one scale per output channel.

Layout of a weight of shape (out, in) (an expert bank prepends E):

- ``codes``  int8    [out, in]: q (the quantizer produces [-127, 127]; -128 loads and decodes).
- ``scales`` float32 [out]:     s per output row.

Decode: w = q * s in float32 (one rounding at most; none when s has <= 16 significant bits).
The quantizer sets s = absmax / 127 rounded *up* to a bf16 value, so q * s is exact in float32
and in torch's bf16 kernel alike, and every value lands within s / 2 of its decode.

Kernels: CPU uses ``_weight_int8pack_mm`` on our layout as is (no copy of the codes; it needs
in % 16 == 0, otherwise the decode-in-tiles matmul runs): bf16 activations with bf16 scales,
others in float32. CUDA uses the Triton kernel when triton is importable.
"""

from __future__ import annotations

import torch

from .banks import CONFIG
from .base import (
    FormatError,
    QuantizedWeight,
    check_finite,
    check_same_device,
    check_tensor,
    check_weight_for_quantize,
    normalize_slice,
    shape_str,
    triton_available,
)
from .tiled import tiled_matmul

QMAX = 127
KERNEL_K_MULTIPLE = 16  # _weight_int8pack_mm silently miscomputes (or crashes) for other K


class Int8Weight(QuantizedWeight):
    format = "int8"
    gathered_kernels = True

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor):
        if codes.dtype != torch.int8 or codes.dim() not in (2, 3):
            raise FormatError(
                f"int8 codes must be int8 [out, in] or [E, out, in], got {codes.dtype} of shape "
                f"{shape_str(codes.shape)}"
            )
        check_tensor(scales, "int8 scales", torch.float32, codes.shape[:-1])
        check_same_device(self.format, codes=codes, scales=scales)
        check_finite(scales, "int8 scales")
        self.codes, self.scales = codes, scales
        self._kernel_scales: dict[torch.dtype, torch.Tensor] = {}

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.codes.shape)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def tensors(self) -> dict[str, torch.Tensor]:
        held = {"codes": self.codes, "scales": self.scales}
        held.update({f"scales_{str(d).removeprefix('torch.')}": t for d, t in self._kernel_scales.items()})
        return held

    def dequantize(self) -> torch.Tensor:
        return self.codes.to(torch.float32) * self.scales[..., None]

    def _rows(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return (self.codes[index].to(torch.float32) * self.scales[index][:, None]).to(dtype)

    def decode_columns(self, k_start: int, k_end: int, dtype: torch.dtype) -> torch.Tensor:
        return (self.codes[:, k_start:k_end].to(torch.float32) * self.scales[:, None]).to(dtype)

    def _scales_for(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype == torch.float32:
            return self.scales
        if dtype not in self._kernel_scales:
            self._kernel_scales[dtype] = self.scales.to(dtype)
        return self._kernel_scales[dtype]

    def prepare_for(self, x: torch.Tensor) -> None:
        if x.device.type == "cpu":
            self._scales_for(_kernel_dtype(x.dtype))

    def _matmul_2d(self, x: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu" and self.in_features % KERNEL_K_MULTIPLE == 0:
            dtype = _kernel_dtype(x.dtype)
            rows = x if x.dtype == dtype else x.to(dtype)  # no-op casts cost a dispatch each on the CPU
            y: torch.Tensor = torch.ops.aten._weight_int8pack_mm(rows, self.codes, self._scales_for(dtype))
            return y if y.dtype == x.dtype else y.to(x.dtype)
        if self.device.type == "cuda" and triton_available():
            from . import triton_kernels

            if x.shape[0] <= CONFIG.gemv_max_rows:
                return triton_kernels.int8_gemv(x, self.codes, self.scales, None, 1)
            return triton_kernels.int8_matmul(x, self.codes, self.scales)
        return tiled_matmul(x, self.decode_columns, self.out_features)

    def _gathered_kernel(self, x: torch.Tensor, index: torch.Tensor, row_div: int) -> torch.Tensor:
        from . import triton_kernels

        return triton_kernels.int8_gemv(x, self.codes, self.scales, index, row_div)

    def expert(self, e: int) -> Int8Weight:
        self.check_expert_index(e)
        view = Int8Weight.__new__(Int8Weight)
        view.codes, view.scales = self.codes[e], self.scales[e]
        view._kernel_scales = {d: t[e] for d, t in self._kernel_scales.items()}
        return view

    def slice(self, dim: int, start: int, end: int) -> Int8Weight:
        dim = normalize_slice(self.shape, dim, start, end, self.format)
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, end)
        codes = self.codes[tuple(index)]
        scales = self.scales if dim == len(self.shape) - 1 else self.scales[tuple(index[:-1])]
        return Int8Weight(codes.clone(), scales.clone())

    def to(self, device: torch.device | str) -> Int8Weight:
        device = torch.device(device)
        if device == self.device:
            return self
        return Int8Weight(self.codes.to(device), self.scales.to(device))


def _kernel_dtype(x_dtype: torch.dtype) -> torch.dtype:
    return torch.bfloat16 if x_dtype == torch.bfloat16 else torch.float32


def bf16_round_up(value: torch.Tensor) -> torch.Tensor:
    """float32 -> float32 holding the smallest bf16 value >= it."""
    rounded = value.to(torch.bfloat16)
    low = rounded.to(torch.float32) < value
    bumped = torch.where(low, torch.nextafter(rounded, torch.full_like(rounded, float("inf"))), rounded)
    return bumped.to(torch.float32)


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """Quantize a float weight (out, in) or (E, out, in) to int8 with per-output-channel scales."""
    check_weight_for_quantize(weight, "int8", 1)
    w = weight.to(torch.float32)
    scale = bf16_round_up(w.abs().amax(-1) / QMAX)
    s = scale[..., None]
    q = torch.where(s > 0, torch.round(w / s), 0.0).clamp(-QMAX, QMAX)
    return Int8Weight(q.to(torch.int8), scale)
