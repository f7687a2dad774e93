"""Linear layers on CPU through oneDNN's prepacked bfloat16 weights.

For the small row counts of decode, ``F.linear`` on bfloat16 weights in their plain layout
reaches roughly half the machine's memory bandwidth; the same weights reordered once into
oneDNN's blocked layout (``mkldnn._reorder_linear_weight``) run 1.5-2x faster and give
bit-identical results. Packed weights are opaque tensors: they are used only through
:func:`linear` and cannot be sliced or stacked.
"""

from __future__ import annotations

import torch


def available(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight: [out, in] bfloat16 on CPU -> an opaque packed weight for :func:`linear`."""
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1)
    return packed


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T + bias with x: [rows, in] bfloat16."""
    y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return y
