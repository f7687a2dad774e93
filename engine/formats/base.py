"""The contract every weight format keeps, and the checks they share.

A :class:`QuantizedWeight` is a linear layer's weight W of logical shape ``(out, in)``, or a
stacked bank of experts ``(E, out, in)``, held in its own storage layout. Invariants:

- ``dequantize()`` is the exact decode of the stored codes to float32: the format's spec, no
  rounding other than what float32 itself forces (documented per format).
- ``matmul(x)`` computes ``x @ W.T`` with the fastest kernel for ``x``'s device and dtype; it
  agrees with ``x @ dequantize().T`` within the tolerance its format documents.
- ``rows(index)`` (an embedding lookup) decodes only the rows asked for, bit for bit as
  ``dequantize()[index]``.
- Slices are copies (``clone``), never views of the parent's storage, and never cut a block
  or scale group; ``nbytes`` counts every byte the object keeps resident, kernel layouts included.

NaN/Inf policy: quantizing a tensor that holds NaN or Inf raises :class:`FormatError` naming the
tensor's shape, the first bad index and its value; loading scales that decode to NaN/Inf (E8M0
0xFF, a non-finite fp16/fp32 scale) raises the same way. Nothing non-finite gets in silently.
"""

from __future__ import annotations

import functools
import importlib.util
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

import torch

from ..errors import ModelfleetError
from .banks import PackedBank

BLOCK = 32  # values per int4 scale group and per MX block, along the input dimension


class FormatError(ModelfleetError, ValueError):
    """A weight format name, layout, shape, slice boundary or value that the format cannot hold."""


@functools.cache
def triton_available() -> bool:
    """Whether the CUDA kernels can run (triton importable); they import it, nothing else does."""
    return importlib.util.find_spec("triton") is not None


def shape_str(shape: Sequence[int]) -> str:
    return str(tuple(int(s) for s in shape))


def first_index(mask: torch.Tensor) -> tuple[int, ...]:
    """Index of the first True element of ``mask`` (row-major)."""
    flat = int(torch.nonzero(mask.reshape(-1))[0, 0])
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), mask.shape))


def check_finite(tensor: torch.Tensor, what: str) -> None:
    """Raise FormatError naming the shape and first index if ``tensor`` holds NaN or Inf."""
    if tensor.device.type == "meta":  # a skeleton's placeholder holds no values to check
        return
    bad = ~torch.isfinite(tensor)
    if bool(bad.any()):
        index = first_index(bad)
        raise FormatError(
            f"{what} of shape {shape_str(tensor.shape)} holds {tensor[index].item()} at index {index}; "
            "weights and scales must be finite"
        )


def check_weight_for_quantize(weight: torch.Tensor, format_name: str, block: int) -> None:
    if weight.dim() not in (2, 3):
        raise FormatError(
            f"{format_name} weight must be 2-D (out, in) or 3-D (experts, out, in), got shape {shape_str(weight.shape)}"
        )
    if not weight.is_floating_point():
        raise FormatError(f"{format_name} quantizes floating-point weights, got dtype {weight.dtype}")
    if block > 1 and weight.shape[-1] % block:
        raise FormatError(
            f"{format_name} weight of shape {shape_str(weight.shape)}: input dimension {weight.shape[-1]} "
            f"is not divisible by the group size {block}"
        )
    check_finite(weight, f"{format_name} weight to quantize")


def check_tensor(tensor: torch.Tensor, name: str, dtype: torch.dtype, shape: Sequence[int]) -> None:
    """Raise FormatError unless ``tensor`` has exactly ``dtype`` and ``shape``."""
    if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
        raise FormatError(
            f"{name} must be {dtype} of shape {shape_str(shape)}, got {tensor.dtype} of shape {shape_str(tensor.shape)}"
        )


def check_same_device(format_name: str, **tensors: torch.Tensor | None) -> None:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        raise FormatError(f"{format_name} tensors must share one device, got {devices}")


def normalize_slice(shape: Sequence[int], dim: int, start: int, end: int, format_name: str) -> int:
    """Validate a half-open slice [start, end) of ``dim``; return the non-negative dim."""
    ndim = len(shape)
    if not -ndim <= dim < ndim:
        raise FormatError(f"{format_name} weight of shape {shape_str(shape)} has no dim {dim}")
    dim %= ndim
    if not 0 <= start < end <= shape[dim]:
        raise FormatError(
            f"slice [{start}, {end}) of dim {dim} is empty or outside {format_name} weight of shape {shape_str(shape)}"
        )
    return dim


def check_block_boundary(shape: Sequence[int], dim: int, start: int, end: int, format_name: str) -> None:
    """Input-dimension boundaries must fall on a BLOCK multiple (a block and its scale stay whole)."""
    for boundary in (start, end):
        if boundary % BLOCK:
            low = boundary - boundary % BLOCK
            raise FormatError(
                f"cannot slice {format_name} weight of shape {shape_str(shape)} along dim {dim} at "
                f"boundary {boundary}: it cuts a {BLOCK}-value block (legal neighbours: {low} or {low + BLOCK})"
            )


def flat_rows(x: torch.Tensor, in_features: int) -> torch.Tensor:
    """x: [..., in] -> contiguous [rows, in]."""
    if x.shape[-1] != in_features:
        raise FormatError(f"activation of shape {shape_str(x.shape)} does not end in in_features={in_features}")
    if x.dim() == 2 and x.is_contiguous():  # a decode frame's rows already: no reshape to dispatch
        return x
    return x.reshape(-1, in_features).contiguous()


class QuantizedWeight(ABC):
    """A weight in one format. ``shape`` is (out, in) or, for an expert bank, (E, out, in)."""

    format: str  # the registry name; a class attribute, per instance only for plain dtypes

    @property
    @abstractmethod
    def shape(self) -> tuple[int, ...]: ...

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    @abstractmethod
    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor held resident, by name (storage layout plus any kernel layouts)."""

    @abstractmethod
    def dequantize(self) -> torch.Tensor:
        """The exact decode, float32, of ``shape``."""

    @abstractmethod
    def expert(self, e: int) -> QuantizedWeight:
        """Expert ``e`` of a 3-D bank as a 2-D weight sharing this bank's storage (for compute)."""

    @abstractmethod
    def _matmul_2d(self, x: torch.Tensor) -> torch.Tensor:
        """x: [rows, in] contiguous -> [rows, out] in x's dtype."""

    @abstractmethod
    def slice(self, dim: int, start: int, end: int) -> QuantizedWeight:
        """Rows/columns/experts [start, end) of ``dim`` as a weight with storage of its own."""

    @abstractmethod
    def to(self, device: torch.device | str) -> QuantizedWeight:
        """The same weight with its storage on ``device``."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    @property
    def out_features(self) -> int:
        return self.shape[-2]

    @property
    def in_features(self) -> int:
        return self.shape[-1]

    @property
    def num_experts(self) -> int | None:
        return self.shape[0] if len(self.shape) == 3 else None

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in] -> x @ W.T: [..., out], in x's dtype."""
        if len(self.shape) != 2:
            raise FormatError(
                f"matmul needs a 2-D weight; this {self.format} bank has shape {shape_str(self.shape)}: "
                "use expert_matmul(e, x)"
            )
        if x.device != self.device:
            raise FormatError(f"activation on {x.device} but {self.format} weight on {self.device}")
        rows = flat_rows(x, self.in_features)
        if rows.shape[0] == 0:  # torch's packed kernels reject empty inputs
            return x.new_zeros(*x.shape[:-1], self.out_features)
        y = self._matmul_2d(rows)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)

    def rows(self, index: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows ``index`` (int [n], any order, repeats allowed) of a 2-D weight decoded to [n, in]
        in ``dtype``: bit for bit ``dequantize()[index].to(dtype)``, reading only those rows'
        codes and scales (an embedding lookup never decodes the table)."""
        if len(self.shape) != 2:
            raise FormatError(f"rows needs a 2-D weight; this {self.format} bank has shape {shape_str(self.shape)}")
        if index.dim() != 1 or index.dtype not in (torch.int64, torch.int32) or index.device != self.device:
            raise FormatError(
                f"row index must be int64/int32 [n] on {self.device}, got {index.dtype} of shape "
                f"{shape_str(index.shape)} on {index.device}"
            )
        if index.device.type == "cpu" and index.numel():  # elsewhere the check would sync with the host
            low, high = int(index.min()), int(index.max())
            if low < 0 or high >= self.out_features:
                bad = low if low < 0 else high
                raise FormatError(f"row {bad} is outside {self.format} weight of shape {shape_str(self.shape)}")
        return self._rows(index, dtype)

    @abstractmethod
    def _rows(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """index: int [n] within range -> the decode of those rows, [n, in] in ``dtype``."""

    def keep_storage_layout(self) -> None:
        """Keep the storage layout resident even once a kernel layout is built (:meth:`rows`
        reads it: an embedding table is looked up, and matmul'd too when the head is tied to it)."""
        return None  # formats whose kernels read the stored layout never drop it

    def prepare_for(self, x: torch.Tensor) -> None:
        """Build, once, whatever kernel layout activations like ``x`` need (a bank: for all experts)."""
        return None  # formats whose kernels read the stored layout need nothing

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x)

    def expert_matmul(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e of a 3-D bank applied to rows x: [..., in] -> [..., out]. The expert's view is
        made once per activation dtype and device, after the bank's kernel layout for them exists
        (building views per call costs more than a small expert's matmul on the CPU)."""
        views: dict[tuple[int, torch.dtype, torch.device], QuantizedWeight]
        views = self.__dict__.setdefault("_expert_views", {})
        key = (e, x.dtype, x.device)
        view = views.get(key)
        if view is None:
            self.prepare_for(x)
            view = views[key] = self.expert(e)
        return view.matmul(x)

    gathered_kernels: ClassVar[bool] = False  # the format has a gathered Triton kernel for CUDA banks

    def has_gathered_kernel(self, device: torch.device) -> bool:
        """Whether :meth:`gathered_matmul` runs on ``device`` (callers otherwise run experts grouped)."""
        return self.gathered_kernels and self.num_experts is not None and device.type == "cuda" and triton_available()

    def fused_bank(self) -> PackedBank | None:
        """The bank as the fused CUDA MoE kernels (:mod:`.triton_moe`) read it, once prepared for
        CUDA activations; None where they do not apply (every format but int4, int4_sym, mxfp4)."""
        return None

    def gathered_matmul(self, x: torch.Tensor, index: torch.Tensor, row_div: int) -> torch.Tensor:
        """For a bank: out[p] = x[p // row_div] @ W[index[p]].T, [P, out], reading each pair's expert
        in place with no host synchronisation (so decode steps can be graph-captured)."""
        if not (self.has_gathered_kernel(x.device) and self.device == x.device):
            raise FormatError(f"{self.format} has no gathered expert kernel on {x.device}")
        return self._gathered_kernel(x, index, row_div)

    def _gathered_kernel(self, x: torch.Tensor, index: torch.Tensor, row_div: int) -> torch.Tensor:
        """The format's gathered CUDA kernel (formats with ``gathered_kernels`` implement it)."""
        raise NotImplementedError

    def check_expert_index(self, e: int) -> None:
        if len(self.shape) != 3:
            raise FormatError(f"{self.format} weight of shape {shape_str(self.shape)} is not an expert bank")
        if not 0 <= e < self.shape[0]:
            raise FormatError(f"expert {e} outside {self.format} bank of {self.shape[0]} experts")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(format={self.format!r}, shape={self.shape}, device={self.device})"


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n] -> uint8 [..., 2n]; the low nibble of byte j is value 2j, the high one 2j + 1."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def pack_nibbles(values: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2n] of values 0..15 -> uint8 [..., n] (low nibble first); an odd length pads a 0."""
    if values.shape[-1] % 2:
        values = torch.nn.functional.pad(values, (0, 1))
    pairs: torch.Tensor = values.to(torch.uint8).unflatten(-1, (-1, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def to_nibble_major(codes: torch.Tensor) -> torch.Tensor:
    """Packed 4-bit codes uint8 [..., in/2] (byte j: inputs 2j low, 2j + 1 high) -> the CUDA
    kernels' order: in each group of 32 inputs (16 bytes), nibble i (bits 4i..4i+3) of 32-bit word
    t holds input 4i + t, so one 8-byte load of inputs serves one nibble of four words. The same
    bytes, permuted within each group; :func:`from_nibble_major` undoes it."""
    q = unpack_nibbles(codes).unflatten(-1, (-1, 8, 4)).transpose(-1, -2)  # [..., G, t, i]
    return pack_nibbles(q.flatten(-3))


def from_nibble_major(codes: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`to_nibble_major`."""
    q = unpack_nibbles(codes).unflatten(-1, (-1, 4, 8)).transpose(-1, -2)  # [..., G, i, t]
    return pack_nibbles(q.flatten(-3))


def nibble_major_bank(codes: torch.Tensor) -> torch.Tensor:
    """:func:`to_nibble_major` of a bank [E, out, in/2], one expert at a time (bounded scratch)."""
    out = torch.empty_like(codes)
    for e in range(codes.shape[0]):
        out[e] = to_nibble_major(codes[e])
    return out
