"""Unquantized weights (``bf16``, ``fp16``, ``fp32``) behind the same interface as the formats.

Layout: the tensor itself, [out, in] or [E, out, in]. matmul computes in the weight's dtype
(activations are cast to it, the result back to theirs), so a bf16 weight never becomes float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import FormatError, QuantizedWeight, check_weight_for_quantize, first_index, normalize_slice, shape_str

PLAIN_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class PlainWeight(QuantizedWeight):
    format = "plain"

    def __init__(self, weight: torch.Tensor):
        if weight.dtype not in PLAIN_DTYPES.values() or weight.dim() not in (2, 3):
            raise FormatError(
                f"plain weight must be bf16/fp16/fp32 [out, in] or [E, out, in], got {weight.dtype} of "
                f"shape {shape_str(weight.shape)}"
            )
        self.weight = weight
        self.format = next(name for name, dtype in PLAIN_DTYPES.items() if dtype == weight.dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.weight.shape)

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight}

    def dequantize(self) -> torch.Tensor:
        return self.weight.to(torch.float32)

    def _rows(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.weight[index].to(dtype)

    def _matmul_2d(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight).to(x.dtype)

    def expert(self, e: int) -> PlainWeight:
        self.check_expert_index(e)
        return PlainWeight(self.weight[e])

    def slice(self, dim: int, start: int, end: int) -> PlainWeight:
        dim = normalize_slice(self.shape, dim, start, end, self.format)
        return PlainWeight(self.weight.narrow(dim, start, end - start).clone())

    def to(self, device: torch.device | str) -> PlainWeight:
        return PlainWeight(self.weight.to(device))


def quantize_plain(weight: torch.Tensor, format_name: str) -> PlainWeight:
    """Cast to bf16/fp16/fp32; a finite value that overflows the target dtype is an error."""
    check_weight_for_quantize(weight, format_name, 1)
    cast = weight.to(PLAIN_DTYPES[format_name])
    overflow = torch.isinf(cast)
    if bool(overflow.any()):
        index = first_index(overflow)
        raise FormatError(
            f"{format_name} weight of shape {shape_str(weight.shape)}: value {weight[index].item():.6g} at "
            f"index {index} overflows {format_name}"
        )
    return PlainWeight(cast)
