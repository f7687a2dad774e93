"""GPT-OSS: GQA with q/k/v/o biases and a learned sink logit per head, layers alternating
between sliding-window and full attention (``layer_types``), YaRN rope, and a sparse MoE whose
router has a bias, picks the top k logits and softmaxes over just those, and whose experts use
a clamped SwiGLU with biases.

On disk the experts are fused in transformers' layout: ``gate_up_proj`` [E, H, 2I] with gate and
up interleaved along the last dim (gate = [..., ::2], up = [..., 1::2]), ``gate_up_proj_bias``
[E, 2I], ``down_proj`` [E, I, H], ``down_proj_bias`` [E, H]. They are converted once at load into
:class:`~engine.layers.Experts`' layout (gate_up [E, 2I, H] as [gate rows; up rows], down
[E, H, I]). MXFP4 checkpoints (the released gpt-oss ones) store ``gate_up_proj_blocks``
[E, 2I, H/32, 16] and ``_scales`` [E, 2I, H/32] (rows interleaved gate, up), ``down_proj_blocks``
[E, H, I/32, 16] and ``_scales``: those stay packed (:class:`~engine.formats.MXFP4Weight`). Per-expert keys (``{e}.gate_proj``, ``{e}.up_proj``, ``{e}.down_proj``, each with a
weight and a bias) are accepted too.

Sliding window: a key at distance d = q_pos - k_pos is visible when 0 <= d < sliding_window,
as in transformers' ``sliding_window_overlay`` (kv_idx > q_idx - sliding_window) and the
original GPT-OSS mask, which is exactly :func:`engine.layers.attend`'s rule.
"""

from __future__ import annotations

from functools import partial

import torch

from ..cache_layout import LayerCache
from ..errors import CheckpointError, ConfigError
from ..formats import BLOCK, FormatError, MXFP4Weight
from ..layers import ClampedSwiGLU, DecoderLayer, Experts, SparseMoE
from ..quantize import QuantizedExperts
from ..spec import ModelSpec
from ..weights import LayerWeights
from .common import dense, gqa_attention, gqa_cache, norms

SLIDING, FULL = "sliding_attention", "full_attention"


def layer_types(spec: ModelSpec) -> list[str]:
    """Per-layer attention kind; without ``layer_types`` transformers alternates, sliding first."""
    types = spec.get("layer_types")
    if types is None:
        return [SLIDING if (i + 1) % 2 else FULL for i in range(spec.num_layers)]
    return list(types)


def validate(spec: ModelSpec) -> None:
    spec.require("num_local_experts")
    spec.require("num_experts_per_tok")
    spec.require("intermediate_size")
    types = layer_types(spec)
    if len(types) != spec.num_layers:
        raise ConfigError(
            f"config.json field 'layer_types' lists {len(types)} layers, but num_hidden_layers is {spec.num_layers}"
        )
    unknown = sorted(set(types) - {SLIDING, FULL})
    if unknown:
        raise ConfigError(f"config.json field 'layer_types' holds {unknown}; gpt_oss supports {SLIDING}, {FULL}")
    if SLIDING in types:
        window = spec.require("sliding_window")
        if not isinstance(window, int) or window < 1:
            raise ConfigError(f"config.json field 'sliding_window' must be a positive integer, got {window!r}")


def top_k_then_softmax(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the k largest router logits, softmax over those k. -> index, weight [T, k]."""
    values, index = torch.topk(logits, top_k, dim=-1)
    return index, torch.softmax(values, dim=-1, dtype=torch.float32).to(logits.dtype)


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """[..., 2I] with gate/up interleaved -> [..., 2I] as [gate | up]."""
    return torch.cat((t[..., 0::2], t[..., 1::2]), dim=-1)


def _fused_experts(w: LayerWeights, num_experts: int, hidden: int, inter: int) -> tuple[torch.Tensor, ...]:
    """gate_up [E, 2I, H], down [E, H, I], gate_up_bias [E, 2I], down_bias [E, H] from fused tensors."""
    expected = {
        "gate_up_proj": (num_experts, hidden, 2 * inter),
        "gate_up_proj_bias": (num_experts, 2 * inter),
        "down_proj": (num_experts, inter, hidden),
        "down_proj_bias": (num_experts, hidden),
    }
    tensors = {}
    for name, shape in expected.items():
        if name not in w:
            raise CheckpointError(f"'{w.prefix}{name}' is missing; gpt_oss fused experts need it")
        tensors[name] = w.get(name)
        if tuple(tensors[name].shape) != shape:
            raise CheckpointError(
                f"'{w.prefix}{name}' has shape {tuple(tensors[name].shape)}, expected {shape} "
                f"(num_local_experts, hidden_size, intermediate_size from config.json)"
            )
    gate_up = _deinterleave(tensors["gate_up_proj"]).transpose(1, 2).contiguous()
    down = tensors["down_proj"].transpose(1, 2).contiguous()
    return gate_up, down, _deinterleave(tensors["gate_up_proj_bias"]), tensors["down_proj_bias"]


def _per_expert(w: LayerWeights, num_experts: int, hidden: int) -> tuple[torch.Tensor, ...]:
    """The same four tensors from ``{e}.gate_proj``/``{e}.up_proj``/``{e}.down_proj`` weights and biases."""
    gate_up, down = w.glu_experts(num_experts, hidden)
    gate_up_bias = torch.stack(
        [torch.cat((w.get(f"{e}.gate_proj.bias"), w.get(f"{e}.up_proj.bias"))) for e in range(num_experts)]
    )
    down_bias = torch.stack([w.get(f"{e}.down_proj.bias") for e in range(num_experts)])
    return gate_up, down, gate_up_bias, down_bias


def _mxfp4_bank(w: LayerWeights, name: str, shape: tuple[int, int, int], interleaved: bool) -> MXFP4Weight:
    """``{name}_blocks`` uint8 [E, out, in/32, 16] and ``{name}_scales`` uint8 [E, out, in/32]
    (already (out, in) per expert) as one MXFP4 bank; gate/up rows de-interleaved."""
    experts, out, inner = shape
    expected = {"blocks": (experts, out, inner // BLOCK, BLOCK // 2), "scales": (experts, out, inner // BLOCK)}
    parts = {}
    for part, part_shape in expected.items():
        key = f"{name}_{part}"
        if key not in w:
            raise CheckpointError(f"'{w.prefix}{key}' is missing; gpt_oss MXFP4 experts need it")
        tensor = w.raw(key)
        if tensor.dtype != torch.uint8 or tuple(tensor.shape) != part_shape:
            raise CheckpointError(
                f"'{w.prefix}{key}' is {tensor.dtype} of shape {tuple(tensor.shape)}, expected uint8 {part_shape} "
                "(num_local_experts, hidden_size, intermediate_size from config.json)"
            )
        if interleaved:  # rows alternate gate, up: make them [gate rows; up rows]
            tensor = torch.cat((tensor[:, 0::2], tensor[:, 1::2]), dim=1)
        parts[part] = tensor.to(w.device)
    try:
        return MXFP4Weight(parts["blocks"], parts["scales"])
    except FormatError as exc:
        raise CheckpointError(f"'{w.prefix}{name}_blocks/_scales': {exc}") from exc


def _mxfp4_experts(w: LayerWeights, num_experts: int, hidden: int, inter: int) -> tuple[MXFP4Weight, ...]:
    """gate_up (E, 2I, H) and down (E, H, I) kept packed, as the real gpt-oss checkpoints store them."""
    gate_up = _mxfp4_bank(w, "gate_up_proj", (num_experts, 2 * inter, hidden), interleaved=True)
    down = _mxfp4_bank(w, "down_proj", (num_experts, hidden, inter), interleaved=False)
    return gate_up, down


def experts(spec: ModelSpec, w: LayerWeights) -> Experts | QuantizedExperts:
    num_experts, inter = int(spec.require("num_local_experts")), int(spec.require("intermediate_size"))
    alpha, limit = float(spec.get("swiglu_alpha", 1.702)), float(spec.get("swiglu_limit", 7.0))
    activation = ClampedSwiGLU(alpha, limit)
    if "gate_up_proj_blocks" in w:  # MXFP4 on disk: stays packed in memory (a per-parameter loader)
        packed_gate_up, packed_down = _mxfp4_experts(w, num_experts, spec.hidden_size, inter)
        biases = (_deinterleave(w.get("gate_up_proj_bias")), w.get("down_proj_bias"))
        return QuantizedExperts(packed_gate_up, packed_down, *biases, activation)
    if "gate_up_proj" in w:
        gate_up, down, gate_up_bias, down_bias = _fused_experts(w, num_experts, spec.hidden_size, inter)
    else:
        gate_up, down, gate_up_bias, down_bias = _per_expert(w, num_experts, spec.hidden_size)
    return Experts(gate_up, down, gate_up_bias, down_bias, activation)


def window(spec: ModelSpec, i: int) -> int | None:
    """A sliding layer's window (``layer_types``, alternating from sliding when absent); None for a full one."""
    return int(spec.require("sliding_window")) if layer_types(spec)[i] == SLIDING else None


def cache_layout(spec: ModelSpec, i: int) -> LayerCache:
    """k and v, over the layer's window."""
    return gqa_cache(spec, window(spec, i))


def build_layer(spec: ModelSpec, i: int, w: LayerWeights) -> DecoderLayer:
    attention = gqa_attention(spec, w, window=window(spec, i), sinks=True)
    m = w.sub("mlp.")
    route = partial(top_k_then_softmax, top_k=int(spec.require("num_experts_per_tok")))
    mlp = SparseMoE(dense(m, "router"), route, experts(spec, m.sub("experts.")))
    input_norm, post_norm = norms(spec, w)
    return DecoderLayer(input_norm, attention, post_norm, mlp)
