"""Weight formats: quantized (and plain) weights with exact decodes, fused kernels and
block-preserving slices. See :mod:`.base` for the contract and the NaN/Inf policy, and each
format's module for its layout:

| name       | module   | layout (weight (out, in); a bank prepends E)                        |
|------------|----------|---------------------------------------------------------------------|
| int4       | int4     | u4 codes [out, in/2], fp16 scales [out, in/32], u4 zeros packed      |
| int4_sym   | int4     | u4 codes [out, in/2], fp16 scales [out, in/32], zero point 8         |
| int8       | int8     | int8 codes [out, in], float32 scales [out]                           |
| mxfp4      | mxfp4    | E2M1 blocks uint8 [out, in/32, 16], E8M0 scales uint8 [out, in/32]   |
| bf16/fp16/fp32 | plain | the tensor                                                          |

    w = quantize(weight, "int4"); y = w.matmul(x); part = slice(w, 1, 0, 1024)
"""

from .base import BLOCK, FormatError, QuantizedWeight
from .int4 import Int4SymWeight, Int4Weight, quantize_int4
from .int8 import Int8Weight, quantize_int8
from .mxfp4 import MXFP4Weight, quantize_mxfp4
from .plain import PlainWeight, quantize_plain
from .registry import FORMATS, check_format, format_names, quantize, slice_weight

slice = slice_weight  # the name; shadows the builtin only as modelfleet.engine.formats.slice

__all__ = [
    "BLOCK",
    "FORMATS",
    "FormatError",
    "Int4SymWeight",
    "Int4Weight",
    "Int8Weight",
    "MXFP4Weight",
    "PlainWeight",
    "QuantizedWeight",
    "check_format",
    "format_names",
    "quantize",
    "quantize_int4",
    "quantize_int8",
    "quantize_mxfp4",
    "quantize_plain",
    "slice",
    "slice_weight",
]
