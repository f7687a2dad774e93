"""Pieces the family builders share: the rotary table per spec, the standard GQA block and its cache."""

from __future__ import annotations

from functools import lru_cache

import torch

from ..cache_layout import LayerCache
from ..layers import Attention, Dense, RMSNorm
from ..rope import Rotary
from ..spec import ModelSpec, RopeSpec
from ..weights import LayerWeights


@lru_cache(maxsize=64)
def _rotary(rope: RopeSpec, dim: int, max_positions: int, interleaved: bool) -> Rotary:
    return Rotary(rope, dim, max_positions, interleaved)


def rotary_for(spec: ModelSpec, dim: int, interleaved: bool = False) -> Rotary:
    """One shared Rotary per (rope, dim): a frame computes its cos/sin once for all layers."""
    return _rotary(spec.rope, dim, spec.max_position_embeddings, interleaved)


def dense(w: LayerWeights, name: str) -> Dense:
    return Dense(w.get(f"{name}.weight"), w.optional(f"{name}.bias"))


def fused_dense(w: LayerWeights, names: list[str]) -> Dense:
    """One projection computing several: weights (and biases, if any) stacked along outputs."""
    weight = torch.cat([w.get(f"{name}.weight") for name in names])
    biases = [w.optional(f"{name}.bias") for name in names]
    bias = (
        None
        if all(b is None for b in biases)
        else torch.cat(
            [
                b if b is not None else weight.new_zeros(w.get(f"{n}.weight").shape[0])
                for b, n in zip(biases, names, strict=True)
            ]
        )
    )
    return Dense(weight, bias)


def gqa_attention(
    spec: ModelSpec, w: LayerWeights, qk_norm: bool = False, window: int | None = None, sinks: bool = False
) -> Attention:
    """Standard q/k/v/o attention under ``self_attn.``."""
    a = w.sub("self_attn.")
    return Attention(
        fused_dense(a, ["q_proj", "k_proj", "v_proj"]),
        dense(a, "o_proj"),
        spec.num_heads,
        spec.num_kv_heads,
        spec.head_dim,
        rotary_for(spec, spec.head_dim),
        q_norm=RMSNorm(a.get("q_norm.weight"), spec.rms_norm_eps) if qk_norm else None,
        k_norm=RMSNorm(a.get("k_norm.weight"), spec.rms_norm_eps) if qk_norm else None,
        window=window,
        sinks=a.get("sinks") if sinks else None,
    )


def gqa_cache(spec: ModelSpec, window: int | None = None) -> LayerCache:
    """The standard GQA layer's cache: per position, k and v, each [kv_heads, head_dim]."""
    shape = (spec.num_kv_heads, spec.head_dim)
    return LayerCache.attention({"k": shape, "v": shape}, window)


def norms(spec: ModelSpec, w: LayerWeights) -> tuple[RMSNorm, RMSNorm]:
    return (
        RMSNorm(w.get("input_layernorm.weight"), spec.rms_norm_eps),
        RMSNorm(w.get("post_attention_layernorm.weight"), spec.rms_norm_eps),
    )
