"""A weight's storage tensors by name, and the weight back from them: how formats go to disk.

Only the storage layout is written (never a kernel layout, which is rebuilt at load):

| format           | tensors                                    |
|------------------|--------------------------------------------|
| int4             | ``codes``, ``scales``, ``zeros``           |
| int4_sym, int8   | ``codes``, ``scales``                      |
| mxfp4            | ``blocks``, ``scales``                     |
| bf16, fp16, fp32 | ``weight``                                 |

Rebuilding runs each format's constructor, so a wrong dtype or shape, or a non-finite scale,
raises :class:`FormatError` before the weight is used.
"""

from __future__ import annotations

import torch

from .base import FormatError, QuantizedWeight
from .int4 import Int4SymWeight, Int4Weight
from .int8 import Int8Weight
from .mxfp4 import MXFP4Weight
from .plain import PLAIN_DTYPES, PlainWeight

STORAGE: dict[str, tuple[str, ...]] = {
    "int4": ("codes", "scales", "zeros"),
    "int4_sym": ("codes", "scales"),
    "int8": ("codes", "scales"),
    "mxfp4": ("blocks", "scales"),
    **{name: ("weight",) for name in PLAIN_DTYPES},
}


def storage_tensors(weight: QuantizedWeight) -> dict[str, torch.Tensor]:
    """The tensors that define ``weight`` in its format's storage layout (contiguous)."""
    if isinstance(weight, Int4Weight):
        held = {"codes": weight.codes, "scales": weight.scales, "zeros": weight.zeros}
    elif isinstance(weight, Int8Weight | MXFP4Weight):
        held = {name: getattr(weight, name) for name in STORAGE[weight.format]}
    elif isinstance(weight, PlainWeight):
        held = {"weight": weight.weight}
    else:
        raise FormatError(f"no storage layout for {type(weight).__name__}")
    return {name: t.contiguous() for name, t in held.items() if t is not None}


def from_storage(format_name: str, tensors: dict[str, torch.Tensor]) -> QuantizedWeight:
    """The weight in ``format_name`` from its storage tensors (validated by the format)."""
    if format_name not in STORAGE:
        raise FormatError(f"unknown stored format {format_name!r}; known: {', '.join(STORAGE)}")
    missing = [name for name in STORAGE[format_name] if name not in tensors]
    if missing:
        raise FormatError(f"{format_name} weight lacks stored tensor(s) {missing}")
    t = tensors
    if format_name == "int4":
        return Int4Weight(t["codes"], t["scales"], t["zeros"])
    if format_name == "int4_sym":
        return Int4SymWeight(t["codes"], t["scales"])
    if format_name == "int8":
        return Int8Weight(t["codes"], t["scales"])
    if format_name == "mxfp4":
        return MXFP4Weight(t["blocks"], t["scales"])
    weight = t["weight"]
    if weight.dtype != PLAIN_DTYPES[format_name]:
        raise FormatError(f"{format_name} weight is stored as {weight.dtype}")
    return PlainWeight(weight)
