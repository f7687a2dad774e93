"""DeepSeek-V4's configuration read from the spec: attention and MoE kinds per layer, compression
rates, RoPE (main and compress), the residual's shape, what tensor parallelism divides, validation,
and each layer's per-stream state (:func:`cache_layout`). The overview is engine/models/deepseek_v4.py's."""

from __future__ import annotations

import dataclasses

from ..cache_layout import CacheEntry, LayerCache
from ..errors import ConfigError
from ..spec import ModelSpec, RopeSpec, _rope_from_raw

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
HASH_MOE, MOE = "hash_moe", "moe"
DEFAULT_COMPRESS_RATES = {CSA: 4, HCA: 128}
LEGACY_RATIO_KINDS = {0: SLIDING, 4: CSA, 128: HCA}
DEFAULT_HASH_LAYERS = 3

REQUIRED = (
    "q_lora_rank",
    "o_groups",
    "o_lora_rank",
    "hc_mult",
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "sliding_window",
    "routed_scaling_factor",
)


def layer_types(spec: ModelSpec) -> list[str]:
    """Attention kind per layer: ``layer_types``, else the legacy ``compress_ratios`` (0/4/128),
    else transformers' default (two HCA layers, then CSA and HCA alternating)."""
    types = spec.get("layer_types")
    if types is None and spec.get("compress_ratios") is not None:
        types = [LEGACY_RATIO_KINDS[int(r)] for r in spec.raw["compress_ratios"]]
    if types is None:
        types = [HCA] * min(spec.num_layers, 2) + [CSA if i % 2 else HCA for i in range(max(spec.num_layers - 2, 0))]
    return list(types)[: spec.num_layers]


def mlp_layer_types(spec: ModelSpec) -> list[str]:
    """MoE kind per layer: ``mlp_layer_types``, else ``num_hash_layers`` (default 3) hash layers first."""
    types = spec.get("mlp_layer_types")
    if types is None:
        hashed = int(spec.get("num_hash_layers", DEFAULT_HASH_LAYERS))
        types = [HASH_MOE] * min(spec.num_layers, hashed) + [MOE] * max(0, spec.num_layers - hashed)
    return list(types)[: spec.num_layers]


def attention_kind(spec: ModelSpec, i: int) -> str:
    """Layer ``i``'s attention kind; past ``num_hidden_layers`` (the MTP layers) the legacy
    ``compress_ratios`` entry if the config lists one, else sliding (DeepSeek-V4-Flash's MTP)."""
    if i < spec.num_layers:
        return layer_types(spec)[i]
    ratios = spec.get("compress_ratios") or []
    return LEGACY_RATIO_KINDS[int(ratios[i])] if i < len(ratios) else SLIDING


def mlp_kind(spec: ModelSpec, i: int) -> str:
    """Layer ``i``'s MoE kind; the MTP layers route by score."""
    return mlp_layer_types(spec)[i] if i < spec.num_layers else MOE


def compress_rate(spec: ModelSpec, i: int) -> int | None:
    """Positions per compressed block of layer ``i`` (None for a sliding layer)."""
    kind = attention_kind(spec, i)
    if kind == SLIDING:
        return None
    rates = {**DEFAULT_COMPRESS_RATES, **(spec.get("compress_rates") or {})}
    legacy = {CSA: spec.get("compress_rate_csa"), HCA: spec.get("compress_rate_hca")}
    return int(legacy[kind] or rates[kind])


def rope_dim(spec: ModelSpec) -> int:
    """Channels RoPE rotates at the end of each head: ``qk_rope_head_dim``, or partial_rotary_factor x head_dim."""
    if spec.get("qk_rope_head_dim") is not None:
        return int(spec.raw["qk_rope_head_dim"])
    return int(spec.head_dim * float(spec.get("partial_rotary_factor", 64 / 512)))


def rope_specs(spec: ModelSpec) -> tuple[RopeSpec, RopeSpec]:
    """(main, compress): sliding layers rotate at ``rope_theta``; compressed layers, their
    compressors and indexers at ``compress_rope_theta`` (with the YaRN scaling, whose cos/sin factor
    DeepSeek's reference leaves at 1)."""
    params = spec.get("rope_parameters") or {}
    nested = isinstance(params, dict) and isinstance(params.get("main"), dict)
    main = _rope_from_raw({"rope_parameters": params["main"]} if nested else {"rope_theta": spec.get("rope_theta")})
    if nested:
        compress = _rope_from_raw({"rope_parameters": params["compress"]})
    else:
        scaling = {k: v for k, v in {**(spec.get("rope_scaling") or {}), **params}.items() if k != "rope_theta"}
        compress = _rope_from_raw({"rope_scaling": scaling, "rope_theta": spec.get("compress_rope_theta", 160000.0)})
    if compress.rope_type == "yarn" and compress.attention_factor is None:
        compress = dataclasses.replace(compress, attention_factor=1.0)
    return main, compress


def residual_shape(spec: ModelSpec) -> tuple[int, int]:
    """One row of the residual a stage passes on: ``hc_mult`` streams of ``hidden_size``."""
    return int(spec.require("hc_mult")), spec.hidden_size


def tensor_split_fields(spec: ModelSpec) -> list[tuple[str, int]]:
    """What tensor parallelism divides: query heads and output groups (the one K=V head is shared)."""
    return [("num_attention_heads", spec.num_heads), ("o_groups", int(spec.raw["o_groups"]))]


def validate(spec: ModelSpec) -> None:
    for key in REQUIRED:
        spec.require(key)
    for name, types, allowed in (
        ("layer_types", layer_types(spec), (SLIDING, CSA, HCA)),
        ("mlp_layer_types", mlp_layer_types(spec), (HASH_MOE, MOE)),
    ):
        if len(types) != spec.num_layers or set(types) - set(allowed):
            raise ConfigError(
                f"config.json field '{name}' must list {spec.num_layers} values from {allowed}, got {types}"
            )
    if spec.get("scoring_func", "sqrtsoftplus") != "sqrtsoftplus":
        raise ConfigError(f"deepseek_v4 supports scoring_func='sqrtsoftplus', got {spec.raw['scoring_func']!r}")
    if spec.num_kv_heads != 1:
        raise ConfigError(
            f"deepseek_v4 shares one key-value head; config.json has num_key_value_heads={spec.num_kv_heads}"
        )
    groups = int(spec.raw["o_groups"])
    if spec.num_heads % groups:
        raise ConfigError(f"num_attention_heads={spec.num_heads} must be a multiple of o_groups={groups}")
    if rope_dim(spec) % 2 or rope_dim(spec) > min(spec.head_dim, int(spec.get("index_head_dim", spec.head_dim))):
        raise ConfigError(f"the RoPE width {rope_dim(spec)} must be even and fit head_dim and index_head_dim")
    if CSA in layer_types(spec):
        for key in ("index_n_heads", "index_head_dim", "index_topk"):
            spec.require(key)


# ---- per-stream state --------------------------------------------------------------------------


def cache_layout(spec: ModelSpec, i: int) -> LayerCache:
    """``kv`` over the sliding window; a compressed layer adds its blocks (stride m) and the raw
    projections its open blocks pool from (a window of m, 2m for CSA's overlap). Every rank keeps
    all of it: the K=V head and the compressors are shared by all query heads."""
    d = spec.head_dim
    entries = {"kv": CacheEntry((d,), window=int(spec.raw["sliding_window"]), split=False)}
    m = compress_rate(spec, i)
    if m is not None and attention_kind(spec, i) == HCA:
        entries["compressed"] = CacheEntry((d,), stride=m, split=False)
        entries["compressor_inputs"] = CacheEntry((2 * d,), window=m, split=False)
    elif m is not None:
        di = int(spec.raw["index_head_dim"])
        entries["compressed"] = CacheEntry((d,), stride=m, split=False)
        entries["indexer_keys"] = CacheEntry((di,), stride=m, split=False)
        entries["compressor_inputs"] = CacheEntry((4 * d + 4 * di,), window=2 * m, split=False)
    return LayerCache(entries)
