"""Fusion is asserted, not hoped for: after compiling a MoE graph, read the runtime model's layer
types and refuse to serve unless OpenVINO lowered it to its gathered-expert primitives.

Without fusion the tiled graph still computes the right numbers, by running every expert over
every row (about E / K times the work): a silent slowdown, hence an error naming what was found.
"""

from __future__ import annotations

from collections import Counter

import openvino as ov

from ..errors import ConfigError

# the layer types that execute only the selected experts, per device kind
FUSED_LAYER_TYPES = {
    "CPU": ("GatherMatmul",),
    "GPU": ("moe_3gemm_fused_compressed", "MOE3GemmFusedCompressed", "GatherMatmul", "moe_gemm"),
}
MATMULS_PER_BLOCK = 3  # gate, up, down


def layer_types(compiled: ov.CompiledModel) -> Counter[str]:
    """How many runtime nodes of each layer type the compiled model executes."""
    found: Counter[str] = Counter()
    for node in compiled.get_runtime_model().get_ordered_ops():
        info = node.get_rt_info()
        found[info["layerType"].astype(str) if "layerType" in info else node.get_type_name()] += 1
    return found


def fused_count(types: Counter[str], device: str) -> int:
    """Gathered-expert nodes among ``types`` for ``device`` (CPU: 3 per fused block; GPU: 1 or 3)."""
    kind = device.split(".")[0].upper()
    return sum(types[t] for t in FUSED_LAYER_TYPES.get(kind, ()))


def check_fused(compiled: ov.CompiledModel, device: str, layer: str) -> None:
    """Raise unless the compiled MoE block of ``layer`` runs as a gathered-expert primitive."""
    types = layer_types(compiled)
    if fused_count(types, device) == 0:
        top = ", ".join(f"{t} x{n}" for t, n in types.most_common(6))
        expected = " or ".join(FUSED_LAYER_TYPES.get(device.split(".")[0].upper(), ("a fused MoE primitive",)))
        raise ConfigError(
            f"{layer}: OpenVINO did not fuse the MoE block on {device} (expected {expected}; found {top}); "
            "it would compute every expert for every row. The graph needs dynamic rows and a one-input Swish; "
            "check the OpenVINO version pinned in pyproject.toml"
        )
