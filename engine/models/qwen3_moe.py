"""Qwen3-MoE: GQA with per-head q/k RMSNorm, softmax top-k routing (optionally renormalised),
SwiGLU experts; layers listed in ``mlp_only_layers`` or off the ``decoder_sparse_step`` are dense."""

from __future__ import annotations

from functools import partial

from torch import nn

from ..cache_layout import LayerCache
from ..errors import ConfigError
from ..layers import DecoderLayer, Experts, GatedMLP, SparseMoE, softmax_top_k
from ..spec import ModelSpec
from ..weights import LayerWeights
from .common import dense, gqa_attention, gqa_cache, norms


def num_experts(spec: ModelSpec) -> int:
    value = spec.raw.get("num_experts") or spec.raw.get("num_local_experts")
    if not value:
        raise ConfigError("config.json of this qwen3_moe checkpoint lacks 'num_experts', which routing needs")
    return int(value)


def validate(spec: ModelSpec) -> None:
    num_experts(spec)
    spec.require("num_experts_per_tok")
    spec.require("moe_intermediate_size")


def is_sparse(spec: ModelSpec, i: int) -> bool:
    step = int(spec.get("decoder_sparse_step", 1))
    return i not in (spec.get("mlp_only_layers") or []) and (i + 1) % step == 0


def cache_layout(spec: ModelSpec, i: int) -> LayerCache:
    """Every layer: k and v at full context (the engine serves Qwen3-MoE without sliding windows)."""
    return gqa_cache(spec)


def build_layer(spec: ModelSpec, i: int, w: LayerWeights) -> DecoderLayer:
    attention = gqa_attention(spec, w, qk_norm=True)
    m = w.sub("mlp.")
    mlp: nn.Module
    if is_sparse(spec, i):
        gate_up, down = m.sub("experts.").glu_experts(num_experts(spec), spec.hidden_size)
        route = partial(
            softmax_top_k,
            top_k=int(spec.require("num_experts_per_tok")),
            renormalize=bool(spec.get("norm_topk_prob", False)),
        )
        mlp = SparseMoE(dense(m, "gate"), route, Experts(gate_up, down))
    else:
        mlp = GatedMLP(dense(m, "gate_proj"), dense(m, "up_proj"), dense(m, "down_proj"))
    input_norm, post_norm = norms(spec, w)
    return DecoderLayer(input_norm, attention, post_norm, mlp)
