"""MXFP4 (OCP Microscaling): E2M1 elements, one E8M0 scale per block of 32, as GPT-OSS stores it.

Layout of a weight of shape (out, in), B = in / 32 blocks per row (an expert bank prepends E):

- ``blocks`` uint8 [out, B, 16]: 32 E2M1 codes per block, two per byte, low nibble first
  (value 2j in the low nibble of byte j). Checkpoint name ``*_blocks``.
- ``scales`` uint8 [out, B]: E8M0 exponent byte e, scale 2^(e - 127); 0xFF is NaN and is
  rejected on load. Checkpoint name ``*_scales``.

E2M1 code: sign bit 3, magnitude table [0, 0.5, 1, 1.5, 2, 3, 4, 6] on bits 0-2 (code 8 is -0).
Decode: w = element * 2^(e - 127), exact in float32 and in bf16 (2 significant bits times a
power of two; 2^-128 and below are subnormal but representable) except that values of magnitude
>= 2^128 (scale bytes 253-254 with large elements) overflow to +-inf in either type.

Quantizer: the scale exponent is the smallest X with 6 * 2^X >= absmax(block), so no element
saturates (the OCP reference rule floor(log2(absmax)) - 2 can clip by up to 25%); elements
round to nearest, ties to even code. An all-zero block gets exponent byte 0.

Kernels: CPU and any device without a fused kernel use the decode-in-tiles matmul (a tile of
input columns is decoded through 256-entry byte tables into a small buffer; the full float
weight never exists). CUDA uses the Triton kernel when triton is importable.
"""

from __future__ import annotations

import sys

import torch

from .banks import CONFIG, PackedBank
from .base import (
    BLOCK,
    FormatError,
    QuantizedWeight,
    check_block_boundary,
    check_same_device,
    check_tensor,
    check_weight_for_quantize,
    first_index,
    from_nibble_major,
    nibble_major_bank,
    normalize_slice,
    shape_str,
    triton_available,
)
from .tiled import tiled_matmul

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E8M0_BIAS = 127
E8M0_NAN = 0xFF
BYTES_PER_BLOCK = BLOCK // 2
assert sys.byteorder == "little", "the MXFP4 decode reads byte pairs as little-endian int16"


def e2m1_values() -> torch.Tensor:
    """float32 [16]: the value of each 4-bit code (codes 8-15 are the negatives, 8 is -0.0)."""
    magnitudes = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32)
    return torch.cat((magnitudes, -magnitudes))


_TABLES: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}


def _pair_table(device: torch.device) -> torch.Tensor:
    """int64 [65536]: the 4 bf16 values of every byte pair (read as a little-endian int16, low
    nibble first), as raw bits; one gather per 4 weights is the cheapest decode torch offers."""
    key = ("pairs", torch.bfloat16, device)
    if key not in _TABLES:
        pair = torch.arange(1 << 16)
        values = torch.stack([e2m1_values()[(pair >> (4 * i)) & 0x0F] for i in range(4)], dim=-1)
        _TABLES[key] = values.to(torch.bfloat16).view(torch.int64).reshape(-1).to(device)
    return _TABLES[key]


def _scale_table(device: torch.device) -> torch.Tensor:
    """bf16 [256]: 2^(e - 127) per exponent byte e (255, NaN, never reaches it: loading rejects it)."""
    key = ("scales", torch.bfloat16, device)
    if key not in _TABLES:
        exponent = (torch.arange(256, dtype=torch.float64) - E8M0_BIAS).clamp(max=E8M0_BIAS)
        _TABLES[key] = torch.pow(2.0, exponent).to(torch.bfloat16).to(device)
    return _TABLES[key]


def decode(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks uint8 [..., B, 16], scales uint8 [..., B] -> [..., B * 32] in ``dtype``.

    Decodes in bf16, which is exact: every MXFP4 value has at most 2 significant bits and lies
    in [2^-128, 6 * 2^127], inside bf16's range (float32's exponents; subnormals to 2^-133), and
    scaling by a power of two rounds only on overflow (to inf, as float32 would). Converting to
    float32 is then exact too.
    """
    pairs = blocks.view(torch.int16)  # [..., B, 8]
    index = (pairs.to(torch.int32) & 0xFFFF).reshape(-1)
    values = _pair_table(blocks.device).index_select(0, index).view(torch.bfloat16)
    values = values.reshape(*blocks.shape[:-1], BLOCK)  # [..., B, 32]
    decoded = (values * _scale_table(blocks.device)[scales.to(torch.int32)][..., None]).flatten(-2)
    return decoded.to(dtype)


class MXFP4Weight(QuantizedWeight):
    format = "mxfp4"
    gathered_kernels = True

    def __init__(self, blocks: torch.Tensor, scales: torch.Tensor):
        if blocks.dtype != torch.uint8 or blocks.dim() not in (3, 4) or blocks.shape[-1] != BYTES_PER_BLOCK:
            raise FormatError(
                f"mxfp4 blocks must be uint8 [out, in/32, 16] or [E, out, in/32, 16], got {blocks.dtype} "
                f"of shape {shape_str(blocks.shape)}"
            )
        check_tensor(scales, "mxfp4 scales", torch.uint8, blocks.shape[:-1])
        check_same_device(self.format, blocks=blocks, scales=scales)
        nan = scales == E8M0_NAN
        if scales.device.type != "meta" and bool(nan.any()):
            raise FormatError(
                f"mxfp4 scales of shape {shape_str(scales.shape)} hold E8M0 NaN (0xFF) at index {first_index(nan)}"
            )
        self._blocks: torch.Tensor | None = blocks
        self._major: torch.Tensor | None = None  # CUDA banks: [..., out, in/2] in nibble-major order
        self.scales = scales

    @property
    def blocks(self) -> torch.Tensor:
        """uint8 [..., out, in/32, 16] in the checkpoint's layout (recovered if a kernel layout replaced it)."""
        if self._blocks is not None:
            return self._blocks
        assert self._major is not None
        blocks: torch.Tensor = from_nibble_major(self._major).unflatten(-1, (-1, BYTES_PER_BLOCK))
        return blocks

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.scales.shape[:-1], self.scales.shape[-1] * BLOCK)

    @property
    def device(self) -> torch.device:
        return self.scales.device

    def tensors(self) -> dict[str, torch.Tensor]:
        held = {"blocks": self._blocks, "major_blocks": self._major, "scales": self.scales}
        return {name: t for name, t in held.items() if t is not None}

    def prepare_for(self, x: torch.Tensor) -> None:
        on_cuda = x.device.type == "cuda" and self.device.type == "cuda"
        if on_cuda and self.num_experts is not None and triton_available():
            self.to_nibble_major()

    def to_nibble_major(self) -> None:
        """Hold a bank's blocks in the CUDA kernels' nibble-major order (see
        :func:`~.base.to_nibble_major`) instead of the checkpoint's: the same bytes, once."""
        if self._major is None and self.num_experts is not None:
            self._major = nibble_major_bank(self.blocks.flatten(-2))
            self._blocks = None

    def _cuda_codes(self) -> tuple[torch.Tensor, bool]:
        if self._major is not None:
            return self._major, True
        return self.blocks.flatten(-2), False

    def fused_bank(self) -> PackedBank | None:
        if self._major is None or not self._major.is_cuda:
            return None
        return PackedBank(self._major, self.scales, None, mxfp4=True)

    def dequantize(self) -> torch.Tensor:
        return decode(self.blocks, self.scales)

    def _rows(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return decode(self.blocks[index], self.scales[index], dtype)

    def decode_columns(self, k_start: int, k_end: int, dtype: torch.dtype) -> torch.Tensor:
        b_start, b_end = k_start // BLOCK, k_end // BLOCK
        return decode(self.blocks[:, b_start:b_end], self.scales[:, b_start:b_end], dtype)

    def _matmul_2d(self, x: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda" and triton_available():
            from . import triton_kernels

            codes, major = self._cuda_codes()
            if x.shape[0] <= CONFIG.gemv_max_rows:
                return triton_kernels.nibble_gemv(x, codes, self.scales, None, None, 1, mxfp4=True, nibble_major=major)
            return triton_kernels.mxfp4_matmul(x, codes, self.scales, nibble_major=major)
        return tiled_matmul(x, self.decode_columns, self.out_features)

    def _gathered_kernel(self, x: torch.Tensor, index: torch.Tensor, row_div: int) -> torch.Tensor:
        from . import triton_kernels

        codes, major = self._cuda_codes()
        return triton_kernels.nibble_gemv(x, codes, self.scales, None, index, row_div, mxfp4=True, nibble_major=major)

    def expert(self, e: int) -> MXFP4Weight:
        self.check_expert_index(e)
        view = MXFP4Weight.__new__(MXFP4Weight)
        view._blocks = None if self._blocks is None else self._blocks[e]
        view._major = None if self._major is None else self._major[e]
        view.scales = self.scales[e]
        return view

    def slice(self, dim: int, start: int, end: int) -> MXFP4Weight:
        dim = normalize_slice(self.shape, dim, start, end, self.format)
        blocks, scales = self.blocks, self.scales
        if dim == len(self.shape) - 1:
            check_block_boundary(self.shape, dim, start, end, self.format)
            blocks, scales = blocks[..., start // BLOCK : end // BLOCK, :], scales[..., start // BLOCK : end // BLOCK]
        else:
            index = (slice(None),) * dim + (slice(start, end),)
            blocks, scales = blocks[index], scales[index]
        return MXFP4Weight(blocks.clone(), scales.clone())

    def to(self, device: torch.device | str) -> MXFP4Weight:
        device = torch.device(device)
        if device == self.device:
            return self
        return MXFP4Weight(self.blocks.to(device), self.scales.to(device))


def block_exponents(absmax: torch.Tensor) -> torch.Tensor:
    """int32: the smallest X with 6 * 2^X >= absmax, clamped to E8M0's [-127, 127]."""
    _, e = torch.frexp(absmax)  # absmax = m * 2^e, m in [0.5, 1): 6 * 2^(e-3) = 0.75 * 2^e
    fits_lower = absmax <= torch.ldexp(torch.full_like(absmax, 0.75), e)
    exponent = torch.where(fits_lower, e - 3, e - 2).to(torch.int32)
    exponent = torch.where(absmax > 0, exponent, -E8M0_BIAS)
    return exponent.clamp(-E8M0_BIAS, E8M0_BIAS)


def round_to_e2m1(v: torch.Tensor) -> torch.Tensor:
    """float32 values with |v| <= 6 -> uint8 codes, round to nearest, ties to the even code."""
    magnitudes = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=v.device)
    midpoints = (magnitudes[:-1] + magnitudes[1:]) / 2
    a = v.abs().clamp(max=6.0)
    code = torch.searchsorted(midpoints, a.contiguous(), side="left")  # lower neighbour on a tie
    tie = (code < midpoints.numel()) & (a == midpoints[code.clamp(max=midpoints.numel() - 1)])
    code = torch.where(tie & (code % 2 == 1), code + 1, code)
    return (code | (torch.signbit(v).to(torch.int64) << 3)).to(torch.uint8)


def quantize_mxfp4(weight: torch.Tensor) -> MXFP4Weight:
    """Quantize a float weight (out, in) or (E, out, in) to MXFP4 blocks of 32."""
    check_weight_for_quantize(weight, "mxfp4", BLOCK)
    groups = weight.to(torch.float32).unflatten(-1, (-1, BLOCK))  # [..., out, B, 32]
    exponent = block_exponents(groups.abs().amax(-1))
    codes = round_to_e2m1(torch.ldexp(groups, -exponent[..., None]))
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return MXFP4Weight(blocks, (exponent + E8M0_BIAS).to(torch.uint8))
