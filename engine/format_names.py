"""The weight-format vocabulary: every format's name and which roles may hold it, names only.

This is the one list. :mod:`engine.formats.registry` checks at import that it registers exactly
these formats, :mod:`engine.formats.plan` validates roles against :data:`ROLE_FORMATS`, and the
fleet plan (:mod:`modelfleet.plan`), the command line and the operator's CRD take their choices
from here. It imports nothing, so that the plan (and the operator) stay free of torch: the
``engine.formats`` package itself imports torch.
"""

from __future__ import annotations

PLAIN_FORMATS: tuple[str, ...] = ("bf16", "fp16", "fp32")  # the tensor as it is, in that dtype
PACKED_FORMATS: tuple[str, ...] = ("int4", "int4_sym", "int8", "mxfp4")  # quantized, 32-value blocks
WEIGHT_FORMATS: tuple[str, ...] = (*PACKED_FORMATS, *PLAIN_FORMATS)

ROLES: tuple[str, ...] = ("experts", "attention", "head", "embeddings")
# a matmul role takes the formats that have a dense kernel; a bank or a row lookup takes them all
MATMUL_FORMATS: tuple[str, ...] = ("int4", "int4_sym", "int8", *PLAIN_FORMATS)
ROLE_FORMATS: dict[str, tuple[str, ...]] = {
    "experts": WEIGHT_FORMATS,
    "attention": MATMUL_FORMATS,
    "head": MATMUL_FORMATS,
    "embeddings": WEIGHT_FORMATS,  # a row lookup decodes only the rows asked for
}


def unsupported(role: str, name: str) -> str | None:
    """Why ``role`` cannot hold format ``name`` (a message naming both and the choices), or None."""
    if name not in WEIGHT_FORMATS:
        return f"{name!r} is not a weight format; formats are {', '.join(WEIGHT_FORMATS)}"
    if name not in ROLE_FORMATS[role]:
        return f"format {name!r} is not supported for {role}; {role} supports {', '.join(ROLE_FORMATS[role])}"
    return None
