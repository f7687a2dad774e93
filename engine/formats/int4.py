"""int4 with groups of 32 along the input dimension: ``int4`` (asymmetric) and ``int4_sym``.

Layout of a weight of shape (out, in), with G = in / 32 groups per row (an expert bank prepends E):

- ``codes``  uint8 [out, in/2]: u4 codes q, two per byte, low nibble = even input index.
- ``scales`` fp16  [out, G]:    one scale s per group.
- ``zeros``  uint8 [out, ceil(G/2)]: u4 zero points z, two per byte, low nibble = even group
  (an odd G pads a 0 nibble). ``int4_sym`` stores none: z = 8.

Decode: w = (q - z) * s, exact in float32 (q - z has 5 bits, s 11 significant bits).

Quantizer: the asymmetric range is widened to include 0, s = (max - min) / 15 rounded *up* to
fp16 and z = round(-min / s), so every value lands within half a step (s / 2) of its decode and
a group already on the grid decodes bit-identically. Symmetric: s = absmax / 7 (rounded up),
q - 8 in [-7, 7]; code 0 (-8) is accepted on load but never produced.

Kernels: CPU uses torch's int4 kernel (see :mod:`.int4_cpu`; exact in float32, bf16 scale/bias
in bf16). The first CPU matmul (or :meth:`Int4Weight.prepare`) converts codes into the kernel's
layout and frees ours; :attr:`codes` recovers them on demand (slow; for slicing and moving). A
weight told to :meth:`~Int4Weight.keep_storage_layout` (an embedding table, whose row lookups read
our codes, also matmul'd as a tied head) holds both layouts.
CUDA uses the Triton kernel when triton is importable; elsewhere, the decode-in-tiles matmul.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from . import int4_cpu
from .banks import CONFIG, PackedBank
from .base import (
    BLOCK,
    FormatError,
    QuantizedWeight,
    check_block_boundary,
    check_finite,
    check_same_device,
    check_tensor,
    check_weight_for_quantize,
    first_index,
    from_nibble_major,
    nibble_major_bank,
    normalize_slice,
    pack_nibbles,
    shape_str,
    triton_available,
    unpack_nibbles,
)
from .tiled import tiled_matmul

SYMMETRIC_ZERO = 8


class Int4Weight(QuantizedWeight):
    """Asymmetric int4: w = (q - z) * s per group of 32 input values."""

    format = "int4"
    gathered_kernels = True
    symmetric: ClassVar[bool] = False

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None = None):
        self._check_layout(codes, scales, zeros)
        self._codes: torch.Tensor | None = codes
        self.scales = scales
        self.zeros = zeros
        self._shape = (*codes.shape[:-1], codes.shape[-1] * 2)
        self._kernel_codes: torch.Tensor | None = None  # torch CPU kernel layout, [..., out, in/2]
        self._scale_bias: dict[torch.dtype, torch.Tensor] = {}  # [..., G, out, 2] per activation dtype
        self._zero_bytes: torch.Tensor | None = None  # CUDA kernels read z unpacked, uint8 [..., out, G]
        self._major_codes: torch.Tensor | None = None  # CUDA banks: codes in nibble-major order
        self._keep_codes = False  # an embedding table: row lookups read our codes, so they stay

    def _check_layout(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None) -> None:
        name = self.format
        check_same_device(name, codes=codes, scales=scales, zeros=zeros)
        if codes.dtype != torch.uint8 or codes.dim() not in (2, 3):
            raise FormatError(
                f"{name} codes must be uint8 [out, in/2] or [E, out, in/2], got {codes.dtype} of shape "
                f"{shape_str(codes.shape)}"
            )
        lead, in_features = tuple(codes.shape[:-1]), codes.shape[-1] * 2
        if in_features % BLOCK:
            raise FormatError(
                f"{name} weight of shape {shape_str((*lead, in_features))}: input dimension {in_features} "
                f"is not divisible by the group size {BLOCK}"
            )
        groups = in_features // BLOCK
        check_tensor(scales, f"{name} scales", torch.float16, (*lead, groups))
        check_finite(scales, f"{name} scales")
        if self.symmetric:
            if zeros is not None:
                raise FormatError(f"{name} stores no zero points (z = {SYMMETRIC_ZERO}); got a zeros tensor")
        elif zeros is None:
            raise FormatError(f"{name} needs zero points: uint8 {shape_str((*lead, (groups + 1) // 2))}")
        else:
            check_tensor(zeros, f"{name} zeros", torch.uint8, (*lead, (groups + 1) // 2))

    @classmethod
    def _assemble(
        cls,
        codes: torch.Tensor | None,
        scales: torch.Tensor,
        zeros: torch.Tensor | None,
        shape: tuple[int, ...],
        kernel_codes: torch.Tensor | None = None,
        scale_bias: dict[torch.dtype, torch.Tensor] | None = None,
        zero_bytes: torch.Tensor | None = None,
        major_codes: torch.Tensor | None = None,
    ) -> Int4Weight:
        """An instance from parts already validated (views, slices, moves)."""
        weight = cls.__new__(cls)
        weight._codes, weight.scales, weight.zeros, weight._shape = codes, scales, zeros, shape
        weight._kernel_codes, weight._scale_bias = kernel_codes, dict(scale_bias or {})
        weight._zero_bytes = zero_bytes
        weight._major_codes = major_codes
        weight._keep_codes = False
        return weight

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def device(self) -> torch.device:
        return self.scales.device

    @property
    def groups(self) -> int:
        return self.in_features // BLOCK

    @property
    def codes(self) -> torch.Tensor:
        """uint8 [..., out, in/2] in our layout (recovered from the kernel layout if that replaced it)."""
        if self._codes is not None:
            return self._codes
        if self._major_codes is not None:
            return from_nibble_major(self._major_codes)
        assert self._kernel_codes is not None
        permutation = int4_cpu.kernel_permutation(self.out_features, self.in_features)
        flat = self._kernel_codes.reshape(-1, *self._kernel_codes.shape[-2:])
        recovered = [int4_cpu.from_kernel_codes(k, self.in_features, permutation) for k in flat]
        return torch.stack(recovered).reshape(self._kernel_codes.shape)

    def zero_points(self) -> torch.Tensor:
        """uint8 [..., out, G]: z per group."""
        if self.zeros is None:
            return torch.full(self.scales.shape, SYMMETRIC_ZERO, dtype=torch.uint8, device=self.device)
        return unpack_nibbles(self.zeros)[..., : self.groups]

    def tensors(self) -> dict[str, torch.Tensor]:
        held = {
            "codes": self._codes,
            "scales": self.scales,
            "zeros": self.zeros,
            "kernel_codes": self._kernel_codes,
            "zero_bytes": self._zero_bytes,
            "major_codes": self._major_codes,
        }
        held.update({f"scale_bias_{str(dtype).removeprefix('torch.')}": t for dtype, t in self._scale_bias.items()})
        return {name: t for name, t in held.items() if t is not None}

    def dequantize(self) -> torch.Tensor:
        q: torch.Tensor = unpack_nibbles(self.codes).to(torch.float32).unflatten(-1, (self.groups, BLOCK))
        z = self.zero_points().to(torch.float32)[..., None]
        return ((q - z) * self.scales.to(torch.float32)[..., None]).flatten(-2)

    def _rows(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # q: [n, G, 32]
        q: torch.Tensor = unpack_nibbles(self.codes[index]).to(torch.float32).unflatten(-1, (self.groups, BLOCK))
        z: torch.Tensor | float = float(SYMMETRIC_ZERO)  # a Python float: no host copy (graph capture)
        if self.zeros is not None:
            z = unpack_nibbles(self.zeros[index])[:, : self.groups].to(torch.float32)[..., None]
        return ((q - z) * self.scales[index].to(torch.float32)[..., None]).flatten(-2).to(dtype)

    def keep_storage_layout(self) -> None:
        self._keep_codes = True

    def decode_columns(self, k_start: int, k_end: int, dtype: torch.dtype) -> torch.Tensor:
        """Input columns [k_start, k_end) (block-aligned) of a 2-D weight, decoded: [out, k_end - k_start]."""
        g_start, g_end = k_start // BLOCK, k_end // BLOCK
        q = unpack_nibbles(self.codes[:, k_start // 2 : k_end // 2]).to(torch.float32)
        z = self.zero_points()[:, g_start:g_end].to(torch.float32)[..., None]
        s = self.scales[:, g_start:g_end].to(torch.float32)[..., None]
        columns: torch.Tensor = ((q.unflatten(-1, (g_end - g_start, BLOCK)) - z) * s).flatten(-2).to(dtype)
        return columns

    # --- kernels -------------------------------------------------------------------------------

    def _uses_cpu_kernel(self) -> bool:
        return self.device.type == "cpu" and int4_cpu.kernel_supports(self.out_features, self.in_features)

    def prepare(self, dtype: torch.dtype = torch.bfloat16) -> None:
        """Build the CPU kernel layout for activations of ``dtype`` now (loaders call it once)."""
        if not self._uses_cpu_kernel():
            return
        if self._kernel_codes is None:
            codes = self.codes
            flat = codes.reshape(-1, *codes.shape[-2:])
            self._kernel_codes = torch.stack([int4_cpu.to_kernel_codes(c) for c in flat]).reshape(codes.shape)
            self._codes = codes if self._keep_codes else None
        kernel_dtype = _kernel_dtype(dtype)
        if kernel_dtype not in self._scale_bias:
            scales = self.scales.reshape(-1, *self.scales.shape[-2:])
            zeros = self.zero_points().reshape(scales.shape)
            stacked = [int4_cpu.kernel_scale_bias(s, z, kernel_dtype) for s, z in zip(scales, zeros, strict=True)]
            groups_first = (*self.shape[:-2], self.groups, self.out_features, 2)
            self._scale_bias[kernel_dtype] = torch.stack(stacked).reshape(groups_first)

    def prepare_for(self, x: torch.Tensor) -> None:
        if x.device.type == "cpu":
            self.prepare(x.dtype)
        elif self.device.type == "cuda":
            self._cuda_zero_points()
            if self.num_experts is not None and triton_available():
                self.to_nibble_major()

    def to_nibble_major(self) -> None:
        """Hold a bank's codes in the CUDA kernels' nibble-major order (see
        :func:`~.base.to_nibble_major`) instead of ours: the same bytes, once."""
        if self._major_codes is None and self.num_experts is not None:
            codes = self.codes
            self._major_codes = nibble_major_bank(codes)
            self._codes = codes if self._keep_codes else None

    def _cuda_codes(self) -> tuple[torch.Tensor, bool]:
        """The codes the CUDA kernels read and whether they are nibble-major."""
        if self._major_codes is not None:
            return self._major_codes, True
        return self.codes, False

    def fused_bank(self) -> PackedBank | None:
        """The bank as :mod:`.triton_moe`'s fused kernels read it, or None (not a prepared CUDA bank)."""
        if self._major_codes is None or not self._major_codes.is_cuda:
            return None
        return PackedBank(self._major_codes, self.scales, self._cuda_zero_points(), mxfp4=False)

    def _cuda_zero_points(self) -> torch.Tensor | None:
        if self.zeros is None:
            return None
        if self._zero_bytes is None:
            self._zero_bytes = self.zero_points().contiguous()
        return self._zero_bytes

    def _matmul_2d(self, x: torch.Tensor) -> torch.Tensor:
        if self._uses_cpu_kernel():
            kernel_dtype = _kernel_dtype(x.dtype)
            self.prepare(kernel_dtype)
            assert self._kernel_codes is not None
            # casts only where the dtypes differ: a no-op cast still costs a dispatch on the CPU's decode path
            rows = x if x.dtype == kernel_dtype else x.to(kernel_dtype)
            y = int4_cpu.kernel_matmul(rows, self._kernel_codes, self._scale_bias[kernel_dtype])
            return y if y.dtype == x.dtype else y.to(x.dtype)
        if self.device.type == "cuda" and triton_available():
            from . import triton_kernels

            codes, major = self._cuda_codes()
            if x.shape[0] <= CONFIG.gemv_max_rows:
                return triton_kernels.nibble_gemv(
                    x, codes, self.scales, self._cuda_zero_points(), None, 1, mxfp4=False, nibble_major=major
                )
            return triton_kernels.int4_matmul(x, codes, self.scales, self._cuda_zero_points(), nibble_major=major)
        return tiled_matmul(x, self.decode_columns, self.out_features)

    def _gathered_kernel(self, x: torch.Tensor, index: torch.Tensor, row_div: int) -> torch.Tensor:
        from . import triton_kernels

        codes, major = self._cuda_codes()
        zeros = self._cuda_zero_points()
        return triton_kernels.nibble_gemv(x, codes, self.scales, zeros, index, row_div, mxfp4=False, nibble_major=major)

    # --- views, slices, moves ------------------------------------------------------------------

    def expert(self, e: int) -> Int4Weight:
        self.check_expert_index(e)
        return self._assemble(
            None if self._codes is None else self._codes[e],
            self.scales[e],
            None if self.zeros is None else self.zeros[e],
            self.shape[1:],
            None if self._kernel_codes is None else self._kernel_codes[e],
            {dtype: t[e] for dtype, t in self._scale_bias.items()},
            None if self._zero_bytes is None else self._zero_bytes[e],
            None if self._major_codes is None else self._major_codes[e],
        )

    def slice(self, dim: int, start: int, end: int) -> Int4Weight:
        dim = normalize_slice(self.shape, dim, start, end, self.format)
        if dim == len(self.shape) - 1:
            check_block_boundary(self.shape, dim, start, end, self.format)
        if len(self.shape) == 3 and dim == 0:  # whole experts: every held layout slices as is
            shape = (end - start, *self.shape[1:])

            def part(t: torch.Tensor | None) -> torch.Tensor | None:
                return None if t is None else t[start:end].clone()

            kernel = {dtype: t[start:end].clone() for dtype, t in self._scale_bias.items()}
            return self._assemble(
                part(self._codes),
                self.scales[start:end].clone(),
                part(self.zeros),
                shape,
                part(self._kernel_codes),
                kernel,
                major_codes=part(self._major_codes),
            )
        codes, scales, zero_points = self.codes, self.scales, self.zero_points()
        if dim == len(self.shape) - 2:
            rows = slice(start, end)
            codes, scales, zero_points = codes[..., rows, :], scales[..., rows, :], zero_points[..., rows, :]
        else:
            groups = slice(start // BLOCK, end // BLOCK)
            codes = codes[..., start // 2 : end // 2]
            scales, zero_points = scales[..., groups], zero_points[..., groups]
        zeros = None if self.symmetric else pack_nibbles(zero_points)
        return type(self)(codes.clone(), scales.clone(), None if zeros is None else zeros.clone())

    def to(self, device: torch.device | str) -> Int4Weight:
        device = torch.device(device)
        if device == self.device:
            return self
        zeros = None if self.zeros is None else self.zeros.to(device)
        return self._assemble(self.codes.to(device), self.scales.to(device), zeros, self.shape)


class Int4SymWeight(Int4Weight):
    """Symmetric int4: w = (q - 8) * s per group of 32 input values; no zero points stored."""

    format = "int4_sym"
    symmetric: ClassVar[bool] = True


def _kernel_dtype(x_dtype: torch.dtype) -> torch.dtype:
    """bf16 activations use the bf16 kernel; everything else the exact float32 one."""
    return torch.bfloat16 if x_dtype == torch.bfloat16 else torch.float32


def fp16_scale_round_up(scale: torch.Tensor, what: str, weight_shape: torch.Size) -> torch.Tensor:
    """float32 scales -> fp16 scales >= them (so no value lands beyond its half step)."""
    half = scale.to(torch.float16)
    if bool(torch.isinf(half).any()):
        index = first_index(torch.isinf(half))
        raise FormatError(
            f"{what} scale {scale[index].item():.6g} for group {index} of weight shape "
            f"{shape_str(weight_shape)} exceeds fp16's maximum 65504"
        )
    low = half.to(torch.float32) < scale
    return torch.where(low, torch.nextafter(half, torch.full_like(half, float("inf"))), half)


def quantize_int4(weight: torch.Tensor, symmetric: bool = False) -> Int4Weight:
    """Quantize a float weight (out, in) or (E, out, in) to int4 / int4_sym, groups of 32."""
    cls = Int4SymWeight if symmetric else Int4Weight
    check_weight_for_quantize(weight, cls.format, BLOCK)
    groups = weight.to(torch.float32).unflatten(-1, (-1, BLOCK))  # [..., out, G, 32]
    if symmetric:
        scale = fp16_scale_round_up(groups.abs().amax(-1) / 7, cls.format, weight.shape)
        zero = torch.full(scale.shape, SYMMETRIC_ZERO, dtype=torch.float32, device=weight.device)
    else:
        low, high = groups.amin(-1).clamp(max=0.0), groups.amax(-1).clamp(min=0.0)
        scale = fp16_scale_round_up((high - low) / 15, cls.format, weight.shape)
        s32 = scale.to(torch.float32)
        zero = torch.where(s32 > 0, torch.round(-low / s32), 0.0).clamp(0, 15)
    s = scale.to(torch.float32)[..., None]
    q = torch.where(s > 0, torch.round(groups / s), 0.0) + zero[..., None]
    codes = pack_nibbles(q.clamp(0, 15).to(torch.uint8).flatten(-2))
    zeros = None if symmetric else pack_nibbles(zero.to(torch.uint8))
    return cls(codes, scale, zeros)
