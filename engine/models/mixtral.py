"""Mixtral: GQA (optionally sliding-window), softmax top-k routing renormalised over the chosen
experts, SwiGLU experts stored as w1 (gate), w3 (up), w2 (down)."""

from __future__ import annotations

from functools import partial

from ..cache_layout import LayerCache
from ..layers import DecoderLayer, Experts, SparseMoE, softmax_top_k
from ..spec import ModelSpec
from ..weights import LayerWeights
from .common import dense, gqa_attention, gqa_cache, norms


def validate(spec: ModelSpec) -> None:
    spec.require("num_local_experts")
    spec.require("num_experts_per_tok")


def window(spec: ModelSpec) -> int | None:
    """Every layer's window when ``sliding_window`` is set."""
    size = spec.get("sliding_window")
    return int(size) if size else None


def cache_layout(spec: ModelSpec, i: int) -> LayerCache:
    """Every layer: k and v, over the window."""
    return gqa_cache(spec, window(spec))


def build_layer(spec: ModelSpec, i: int, w: LayerWeights) -> DecoderLayer:
    attention = gqa_attention(spec, w, window=window(spec))
    m = w.sub("block_sparse_moe.")
    gate_up, down = m.sub("experts.").glu_experts(
        int(spec.require("num_local_experts")), spec.hidden_size, names=("w1", "w3", "w2")
    )
    route = partial(softmax_top_k, top_k=int(spec.require("num_experts_per_tok")), renormalize=True)
    input_norm, post_norm = norms(spec, w)
    return DecoderLayer(input_norm, attention, post_norm, SparseMoE(dense(m, "gate"), route, Experts(gate_up, down)))
