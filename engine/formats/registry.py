"""Format names -> quantizers, and the format-independent entry points ``quantize`` and ``slice_weight``.

The names are :data:`engine.format_names.WEIGHT_FORMATS` (the vocabulary the plan, the command
line and the CRD use), in its order; importing this module checks that the two agree.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..format_names import WEIGHT_FORMATS
from .base import FormatError, QuantizedWeight
from .int4 import quantize_int4
from .int8 import quantize_int8
from .mxfp4 import quantize_mxfp4
from .plain import quantize_plain

Quantizer = Callable[[torch.Tensor], QuantizedWeight]

FORMATS: dict[str, Quantizer] = {
    "int4": lambda w: quantize_int4(w, symmetric=False),
    "int4_sym": lambda w: quantize_int4(w, symmetric=True),
    "int8": quantize_int8,
    "mxfp4": quantize_mxfp4,
    "bf16": lambda w: quantize_plain(w, "bf16"),
    "fp16": lambda w: quantize_plain(w, "fp16"),
    "fp32": lambda w: quantize_plain(w, "fp32"),
}
if tuple(FORMATS) != WEIGHT_FORMATS:  # a format registered here is named in the vocabulary, and only those
    raise ImportError(f"registered formats {tuple(FORMATS)} differ from engine.format_names {WEIGHT_FORMATS}")


def format_names() -> tuple[str, ...]:
    return tuple(FORMATS)


def check_format(name: str) -> str:
    """``name`` if it is a known format, else FormatError listing the known ones."""
    if name not in FORMATS:
        raise FormatError(f"unknown weight format {name!r}; known formats: {', '.join(FORMATS)}")
    return name


def quantize(weight: torch.Tensor, format: str) -> QuantizedWeight:
    """A float weight (out, in) or expert bank (E, out, in) in ``format``."""
    return FORMATS[check_format(format)](weight)


def slice_weight(weight: QuantizedWeight, dim: int, start: int, end: int) -> QuantizedWeight:
    """[start, end) of ``dim`` as a weight with its own storage; never cuts a 32-value block."""
    return weight.slice(dim, start, end)
