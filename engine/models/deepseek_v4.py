"""DeepSeek-V4: hyper-connected residual streams, shared-KV attention over a sliding window plus
compressed blocks, and sqrt-softplus routing (hash-routed in the first layers).

Residual: every row carries ``hc_mult`` streams, [R, hc_mult, hidden] (:func:`residual_shape`, the
one answer the shard, the wire and the planner ask). Each block (attention, then MoE) reads one
collapse of the streams, ``sum_j pre_j s_j``, and writes ``s'_k = post_k y + sum_j comb[j, k] s_j``,
with pre, post and comb computed from the normed, flattened streams and comb made doubly
stochastic by Sinkhorn iterations. The first shard copies the embedding into every stream; the
last collapses them with the hyper head before the final norm.

Attention (one K=V head shared by all query heads, per-head sinks, partial interleaved RoPE on the
trailing ``qk_rope_head_dim`` channels, output de-rotated at the query position, then a grouped
low-rank output projection ``wo_a`` per head group and ``wo_b``). ``layer_types`` gives each layer:
- ``sliding_attention``: the last ``sliding_window`` positions, main RoPE;
- ``heavily_compressed_attention`` (HCA): also every complete block of m' positions pooled into one
  entry (softmax over the block of gate + position bias, per channel), compress RoPE at the block's
  first position; a query sees the blocks that closed at or before it;
- ``compressed_sparse_attention`` (CSA): blocks of m with overlapping pooling (block b pools the
  first half-channels of block b-1 with the second half of block b), and a lightning indexer (its own
  pooled keys, queries from the q latent) choosing each query's top ``index_topk`` visible blocks.

Per-stream state (:func:`cache_layout`; names are the KV entries): ``kv`` (window), ``compressed``
(and ``indexer_keys`` for CSA), one row per block (stride m), and ``compressor_inputs``: the raw
per-position projections (kv and gate, compressor's then indexer's) over the window a block needs
(m for HCA, 2m for CSA). A block is pooled from those raw rows when its last position is computed,
so a stream rewound into a pooled block re-pools it when it reaches the block's end again: rewind
is exact within the ring's slack, for every state kind (the ring is the carry journal).

MoE: scores sqrt(softplus(logits)); the ``moe`` layers choose the top k of score + correction
bias, the ``hash_moe`` layers take the experts ``tid2eid[token id]`` (so every stage needs the
frame's token ids: :attr:`FrameContext.token_ids`); weights are the chosen scores, normalised, times
``routed_scaling_factor``; experts and the shared expert clamp gate (above) and up (both sides) at
``swiglu_limit`` before SiLU-gating.

Checkpoint: DeepSeek's names, as transformers saves them (``model.layers.{i}.attn.wq_a.weight``,
``ffn.experts.{e}.w1.weight`` ...). Experts stored as DeepSeek publishes them, FP4 E2M1 two to a byte
(``w1.weight`` int8/uint8 [I, H/2]) with an E8M0 scale per 32 (``w1.scale`` [I, H/32]), are exactly
the engine's ``mxfp4`` and stay packed (:func:`fp4_experts`). The MTP layer is :class:`MTPHead`.

One module over ~400 lines because the attention kinds, their state and the hyper-connections are
one design: the state layout is only right together with the code that reads it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..cache_layout import REWIND_SLACK_POSITIONS, CacheEntry, LayerCache
from ..checkpoint import TensorInfo, TensorSource
from ..errors import CheckpointError, ConfigError, InputError
from ..formats import BLOCK, FormatError, MXFP4Weight
from ..frame import Frame, Segment, segments_of
from ..kvcache import LayerKV
from ..layers import DecoderLayer, Dense, Experts, FrameContext, GatedMLP, RMSNorm, SparseMoE
from ..quantize import QuantizedExperts
from ..rope import inv_freq_and_factor
from ..spec import ModelSpec, RopeSpec, _rope_from_raw
from ..weights import LayerWeights
from .deepseek_v3 import Float32Dense

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


# ---- the spec ----------------------------------------------------------------------------------


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


# ---- math --------------------------------------------------------------------------------------


def unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, computed in float32, in x's dtype (no weight)."""
    return (x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps)).to(x.dtype)


class InterleavedRope:
    """RoPE on the trailing ``dim`` channels, pairs (2i, 2i + 1) rotated in place (layout kept,
    since values are rotated keys and the output is rotated back)."""

    def __init__(self, rope: RopeSpec, dim: int, max_positions: int):
        self.inv_freq, self.factor = inv_freq_and_factor(rope, dim, max_positions)
        self.dim = dim

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 [rows, 1, dim / 2] each."""
        angles = positions.to(torch.float32)[:, None] * self.inv_freq.to(positions.device)[None, :]
        return (angles.cos() * self.factor)[:, None], (angles.sin() * self.factor)[:, None]

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [rows, heads, D]; rotated in float32, returned in x's dtype."""
        rest, rope = x[..., : -self.dim], x[..., -self.dim :].float()
        even, odd = rope[..., 0::2], rope[..., 1::2]
        rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
        return torch.cat((rest, rotated.to(x.dtype)), dim=-1)


@lru_cache(maxsize=16)
def _ropes(spec_key: tuple[RopeSpec, RopeSpec, int, int]) -> tuple[InterleavedRope, InterleavedRope]:
    main, compress, dim, max_positions = spec_key
    return InterleavedRope(main, dim, max_positions), InterleavedRope(compress, dim, max_positions)


def ropes(spec: ModelSpec) -> tuple[InterleavedRope, InterleavedRope]:
    main, compress = rope_specs(spec)
    return _ropes((main, compress, rope_dim(spec), spec.max_position_embeddings))


class Pooler(nn.Module):
    """Pools blocks of m raw (kv, gate) rows into one entry each: softmax over the block of
    gate + position bias, per channel, then RMSNorm and RoPE at the block's first position.
    ``overlap`` (CSA): rows carry two halves and block b pools b-1's first half with b's second."""

    def __init__(self, kv: Dense, gate: Dense, bias: torch.Tensor, norm: RMSNorm, rate: int, overlap: bool):
        super().__init__()
        self.kv, self.gate, self.norm = kv, gate, norm
        self.bias = nn.Parameter(bias, requires_grad=False)  # [m, width]
        self.rate, self.overlap = rate, overlap
        self.dim = norm.weight.shape[0]

    @property
    def raw_width(self) -> int:
        return 2 * self.bias.shape[1]

    def raw(self, x: torch.Tensor) -> torch.Tensor:
        """[R, 2 * width]: kv then gate projections of each position."""
        return torch.cat((self.kv(x), self.gate(x)), dim=-1)

    def pool(self, raw: torch.Tensor, first_block: int, rope: InterleavedRope) -> torch.Tensor:
        """raw: rows of positions [(first_block - overlap) * m, ...) (from 0 when first_block is 0),
        whole blocks -> [blocks, dim] for blocks first_block, first_block + 1, ..."""
        m, width = self.rate, self.bias.shape[1]
        kv, gate = raw.split(width, dim=-1)
        if self.overlap and first_block == 0:  # block 0 has no predecessor: its half weighs nothing
            kv = torch.cat((kv.new_zeros(m, width), kv))
            gate = torch.cat((gate.new_full((m, width), float("-inf")), gate))
        kv, gate = kv.unflatten(0, (-1, m)), gate.unflatten(0, (-1, m)) + self.bias.to(gate.dtype)
        if self.overlap:  # [blocks, 2m, dim]: predecessor's first half, then own second half
            kv = torch.cat((kv[:-1, :, : self.dim], kv[1:, :, self.dim :]), dim=1)
            gate = torch.cat((gate[:-1, :, : self.dim], gate[1:, :, self.dim :]), dim=1)
        pooled = (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)
        pooled = self.norm(pooled)
        starts = torch.arange(first_block, first_block + pooled.shape[0], device=raw.device) * m
        cos, sin = rope.cos_sin(starts)
        return rope.apply(pooled[:, None], cos, sin)[:, 0]


class Indexer(nn.Module):
    """Lightning indexer: score_t(b) = sum_h w_{t,h} relu(q_{t,h} . k_b) / sqrt(d_I); each query keeps
    its top ``top_k`` visible blocks."""

    def __init__(self, pooler: Pooler, q_up: Dense, weights: Dense, heads: int, top_k: int):
        super().__init__()
        self.pooler, self.q_up, self.weights = pooler, q_up, weights
        self.heads, self.top_k = heads, top_k

    def queries(
        self, q_latent: torch.Tensor, x: torch.Tensor, positions: torch.Tensor, rope: InterleavedRope
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """([R, heads, d_I] rotated queries, [R, heads] float32 head weights)."""
        q = self.q_up(q_latent).unflatten(-1, (self.heads, -1))
        cos, sin = rope.cos_sin(positions)
        return rope.apply(q, cos, sin), self.weights(x).float() * self.heads**-0.5

    def choose(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """q [n, heads, d_I], w [n, heads], keys [B, d_I], visible [n, B] -> chosen [n, B] (bool)."""
        scores = torch.einsum("nhd,bd->nhb", q.float(), keys.float()).relu() * q.shape[-1] ** -0.5
        scores = (scores * w[..., None]).sum(dim=1).masked_fill(~visible, float("-inf"))
        k = min(self.top_k, keys.shape[0])
        picked = scores.topk(k, dim=-1).indices
        chosen = torch.zeros_like(visible).scatter_(1, picked, True)
        return chosen & visible


@dataclass
class _Rows:
    """One segment's rows of the attention's per-row tensors."""

    q: torch.Tensor  # [n, H, D] rotated
    kv: torch.Tensor  # [n, D] rotated
    raw: torch.Tensor | None  # [n, raw width]
    index_q: torch.Tensor | None  # [n, Hi, Di]
    index_w: torch.Tensor | None  # [n, Hi]

    def take(self, rows: slice) -> _Rows:
        def cut(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[rows]

        return _Rows(self.q[rows], self.kv[rows], cut(self.raw), cut(self.index_q), cut(self.index_w))


class CompressedAttention(nn.Module):
    """One K=V head over a sliding window (and, for HCA/CSA, compressed blocks); see the module docstring."""

    def __init__(
        self,
        q_down: Dense,
        q_norm: RMSNorm,
        q_up: Dense,
        kv_proj: Dense,
        kv_norm: RMSNorm,
        o_groups_proj: Dense,
        o_proj: Dense,
        sinks: torch.Tensor,
        dims: tuple[int, int, int],
        window: int,
        rope: InterleavedRope,
        compress_rope: InterleavedRope,
        compressor: Pooler | None = None,
        indexer: Indexer | None = None,
        eps: float = 1e-6,
    ):
        super().__init__()
        self.q_down, self.q_norm, self.q_up, self.kv_proj, self.kv_norm = q_down, q_norm, q_up, kv_proj, kv_norm
        self.o_groups_proj, self.o_proj = o_groups_proj, o_proj
        self.o_groups_proj.keep_plain = True  # read per group (a block-diagonal projection)
        self.sinks = nn.Parameter(sinks, requires_grad=False)
        self.num_heads, self.head_dim, self.o_groups = dims
        self.window, self.eps = window, eps
        self.rope, self.compress_rope = rope, compress_rope
        self.compressor, self.indexer = compressor, indexer

    @property
    def position_rope(self) -> InterleavedRope:
        return self.rope if self.compressor is None else self.compress_rope

    def forward(self, x: torch.Tensor, ctx: FrameContext, kv: LayerKV) -> torch.Tensor:
        assert ctx.segments is not None, "compressed attention runs general frames only"
        rows = self._rows(x, ctx.positions)
        out = x.new_empty(x.shape[0], self.num_heads, self.head_dim)
        for seg in ctx.segments:
            rs = slice(seg.row_start, seg.row_end)
            part = rows.take(rs)
            out[rs] = self._segment(seg, part, kv)
        cos, sin = self.position_rope.cos_sin(ctx.positions)
        out = self.position_rope.apply(out, cos, -sin)  # K=V: take the values' rotation back out
        grouped = out.reshape(x.shape[0], self.o_groups, -1)
        weight = self.o_groups_proj.weight.view(self.o_groups, -1, grouped.shape[-1])
        y: torch.Tensor = self.o_proj(torch.einsum("rgi,goi->rgo", grouped, weight).flatten(1))
        return y

    def _rows(self, x: torch.Tensor, positions: torch.Tensor) -> _Rows:
        q_latent = self.q_norm(self.q_down(x))
        q = unit_rms(self.q_up(q_latent).unflatten(-1, (self.num_heads, self.head_dim)), self.eps)
        cos, sin = self.position_rope.cos_sin(positions)
        q = self.position_rope.apply(q, cos, sin)
        k = self.position_rope.apply(self.kv_norm(self.kv_proj(x))[:, None], cos, sin)[:, 0]
        raw = index_q = index_w = None
        if self.compressor is not None:
            raw = self.compressor.raw(x)
        if self.indexer is not None:
            raw = torch.cat((raw, self.indexer.pooler.raw(x)), dim=-1)  # type: ignore[arg-type]
            index_q, index_w = self.indexer.queries(q_latent, x, positions, self.compress_rope)
        return _Rows(q, k, raw, index_q, index_w)

    def _segment(self, seg: Segment, rows: _Rows, kv: LayerKV) -> torch.Tensor:
        k_start = max(0, seg.pos_start - self.window + 1)
        old = kv.read(seg.slot, k_start, seg.pos_start, ("kv",))["kv"]
        kv.write(seg.slot, seg.pos_start, {"kv": rows.kv})
        keys = torch.cat((old, rows.kv))
        q_pos = torch.arange(seg.pos_start, seg.pos_end, device=keys.device)[:, None]
        k_pos = torch.arange(k_start, seg.pos_end, device=keys.device)[None, :]
        visible = (k_pos <= q_pos) & (q_pos - k_pos < self.window)
        if self.compressor is not None:
            blocks, seen = self._compressed(seg, rows, kv)
            keys, visible = torch.cat((keys, blocks)), torch.cat((visible, seen), dim=1)
        return self._attend(rows.q, keys, visible)

    def _compressed(self, seg: Segment, rows: _Rows, kv: LayerKV) -> tuple[torch.Tensor, torch.Tensor]:
        """Pool the blocks this segment closes, store them; -> (stored blocks [B, D], which each
        query may read [n, B])."""
        assert self.compressor is not None and rows.raw is not None
        m = self.compressor.rate
        first, end = seg.pos_start // m, seg.pos_end // m  # blocks closing here: [first, end)
        if end > first:
            lo = max(0, (first - (1 if self.compressor.overlap else 0)) * m)
            old = kv.read(seg.slot, lo, seg.pos_start, ("compressor_inputs",))["compressor_inputs"]
            raw = torch.cat((old, rows.raw))[: end * m - lo]
            self._store_blocks(seg.slot, raw, first, kv)
        kv.write(seg.slot, seg.pos_start, {"compressor_inputs": rows.raw})
        q_pos = torch.arange(seg.pos_start, seg.pos_end, device=rows.raw.device)[:, None]
        seen = torch.arange(end, device=rows.raw.device)[None, :] < (q_pos + 1) // m
        stored = kv.read(seg.slot, 0, end, ("compressed", "indexer_keys") if self.indexer else ("compressed",))
        if self.indexer is not None and end > 0:
            assert rows.index_q is not None and rows.index_w is not None
            seen = self.indexer.choose(rows.index_q, rows.index_w, stored["indexer_keys"], seen)
        return stored["compressed"], seen

    def _store_blocks(self, slot: int, raw: torch.Tensor, first: int, kv: LayerKV) -> None:
        assert self.compressor is not None
        width = self.compressor.raw_width
        values = {"compressed": self.compressor.pool(raw[:, :width], first, self.compress_rope)}
        if self.indexer is not None:
            values["indexer_keys"] = self.indexer.pooler.pool(raw[:, width:], first, self.compress_rope)
        kv.write(slot, first, values)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """q [n, H, D] over shared keys = values [L, D], visible [n, L], with a sink logit per head."""
        logits = torch.einsum("nhd,ld->nhl", q, keys) * self.head_dim**-0.5
        logits = logits.masked_fill(~visible[:, None, :], float("-inf"))
        sink = self.sinks.to(logits.dtype)[None, :, None].expand(*logits.shape[:2], 1)
        combined = torch.cat((logits, sink), dim=-1)
        probs = torch.softmax(combined - combined.max(dim=-1, keepdim=True).values, dim=-1)[..., :-1]
        return torch.einsum("nhl,ld->nhd", probs, keys)


# ---- hyper-connections -------------------------------------------------------------------------


class HyperMix(nn.Module):
    """Per row: (collapse [R, D], post [R, n], comb [R, n, n]) from the streams [R, n, D], in float32."""

    def __init__(
        self, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int, eps: float, norm_eps: float
    ):
        super().__init__()
        self.fn = nn.Parameter(fn.float(), requires_grad=False)  # [(2 + n) * n, n * D]
        self.base = nn.Parameter(base.float(), requires_grad=False)
        self.scale = nn.Parameter(scale.float(), requires_grad=False)  # [3]: pre, post, comb
        self.iters, self.eps, self.norm_eps = iters, eps, norm_eps

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = streams.shape[1]
        mixes = F.linear(unit_rms(streams.flatten(1).float(), self.norm_eps), self.fn)
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre = torch.sigmoid(pre_w * self.scale[0] + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * self.scale[1] + post_b)
        comb = torch.softmax((comb_w * self.scale[2] + comb_b).unflatten(-1, (n, n)), dim=-1) + self.eps
        comb = sinkhorn(comb, self.iters, self.eps)
        collapse = (pre[..., None] * streams).sum(dim=1).to(streams.dtype)
        return collapse, post, comb


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Columns, then (rows, columns) iters - 1 times, normalised to sum to 1: doubly stochastic."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def hyper_update(streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """s'_k = post_k y + sum_j comb[j, k] s_j; streams [R, n, D], y [R, D]."""
    dtype = streams.dtype
    return post.to(dtype)[..., None] * y[:, None, :] + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


class HyperHead(nn.Module):
    """The last collapse of the streams [R, n, D] -> [R, D], before the final norm."""

    def __init__(self, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, eps: float, norm_eps: float):
        super().__init__()
        self.fn = nn.Parameter(fn.float(), requires_grad=False)  # [n, n * D]
        self.base = nn.Parameter(base.float(), requires_grad=False)
        self.scale = nn.Parameter(scale.float(), requires_grad=False)  # [1]
        self.eps, self.norm_eps = eps, norm_eps

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mixes = F.linear(unit_rms(streams.flatten(1).float(), self.norm_eps), self.fn)
        pre = torch.sigmoid(mixes * self.scale + self.base) + self.eps
        return (pre[..., None] * streams).sum(dim=1).to(streams.dtype)


class HyperEntry(nn.Module):
    """The embedding copied into every stream: [R, D] -> [R, n, D]."""

    def __init__(self, streams: int):
        super().__init__()
        self.streams = streams

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, None, :].expand(-1, self.streams, -1).contiguous()


class HyperDecoderLayer(DecoderLayer):
    """Attention then MoE, each reading one collapse of the streams and writing all of them."""

    def __init__(self, input_norm: RMSNorm, attention: nn.Module, post_norm: RMSNorm, mlp: nn.Module,
                 attn_mix: HyperMix, mlp_mix: HyperMix):  # fmt: skip
        super().__init__(input_norm, attention, post_norm, mlp)
        self.attn_mix, self.mlp_mix = attn_mix, mlp_mix

    def forward(self, x: torch.Tensor, ctx: FrameContext, kv: LayerKV) -> torch.Tensor:
        collapse, post, comb = self.attn_mix(x)
        x = hyper_update(x, self.attention(self.input_norm(collapse), ctx, kv), post, comb)
        collapse, post, comb = self.mlp_mix(x)
        return hyper_update(x, self.mlp(self.post_norm(collapse), ctx.token_ids), post, comb)


# ---- MoE ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClampedSiluGLU:
    """DeepSeek-V4's GLU on h = [gate | up]: silu(min(gate, limit)) * clamp(up, +-limit)."""

    limit: float

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate.clamp(max=self.limit)) * up.clamp(min=-self.limit, max=self.limit)


class ClampedGatedMLP(GatedMLP):
    """The shared expert: a dense GLU with the routed experts' clamp."""

    def __init__(self, gate: Dense, up: Dense, down: Dense, limit: float):
        super().__init__(gate, up, down)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate(x).clamp(max=self.limit)
        y: torch.Tensor = self.down(F.silu(gate) * self.up(x).clamp(min=-self.limit, max=self.limit))
        return y


class SqrtSoftplusRouter(nn.Module):
    """Scores sqrt(softplus(logits)); experts by top k of score + bias, or by ``tid2eid[token]``
    (hash layers); weights the chosen scores, normalised, times ``scaling``."""

    def __init__(self, top_k: int, scaling: float, bias: torch.Tensor | None, tid2eid: torch.Tensor | None):
        super().__init__()
        self.top_k, self.scaling = top_k, scaling
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self.tid2eid: torch.Tensor | None
        self.register_buffer("tid2eid", tid2eid)

    def forward(self, logits: torch.Tensor, token_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.softplus(logits.float()).sqrt()
        if self.tid2eid is not None:
            if token_ids is None:
                raise InputError(
                    "a hash-routed (hash_moe) layer needs the frame's token ids; send token_ids with the hidden states"
                )
            index = self.tid2eid[token_ids].long()
        else:
            assert self.bias is not None
            index = torch.topk(scores + self.bias, self.top_k, dim=-1, sorted=False).indices
        weight = scores.gather(1, index)
        return index, weight / (weight.sum(dim=-1, keepdim=True) + 1e-20) * self.scaling


class RoutedMoE(SparseMoE):
    """Routed experts (by score or by token) plus the shared expert."""

    route: SqrtSoftplusRouter

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        index, weight = self.route(self.router_proj(x), token_ids)
        out: torch.Tensor = self.experts(x, index, weight)
        if self.shared is not None:
            out = out + self.shared(x)
        return out


def fp4_experts(w: LayerWeights, num_experts: int) -> tuple[MXFP4Weight, MXFP4Weight]:
    """DeepSeek's FP4 experts (``{e}.w1.weight`` [I, H/2] two E2M1 codes a byte, low nibble first,
    ``{e}.w1.scale`` [I, H/32] E8M0) as mxfp4 banks gate_up [E, 2I, H], down [E, H, I]: the bytes are
    moved, never decoded."""

    def bank(names: tuple[str, ...]) -> MXFP4Weight:
        blocks, scales = [], []
        for e in range(num_experts):
            codes = [w.raw(f"{e}.{n}.weight").view(torch.uint8) for n in names]
            blocks.append(torch.cat(codes).unflatten(-1, (-1, BLOCK // 2)))
            scales.append(torch.cat([e8m0_bytes(w.raw(f"{e}.{n}.scale")) for n in names]))
        try:
            return MXFP4Weight(torch.stack(blocks).to(w.device), torch.stack(scales).to(w.device))
        except FormatError as exc:
            raise CheckpointError(f"'{w.prefix}*.{'/'.join(names)}': {exc}") from exc

    return bank(("w1", "w3")), bank(("w2",))


def e8m0_bytes(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 exponent bytes of a scale stored as E8M0 (or its raw bytes)."""
    if scale.dtype not in (torch.uint8, torch.float8_e8m0fnu):
        raise CheckpointError(f"an FP4 expert's scale must be E8M0 (F8_E8M0 or U8), got {scale.dtype}")
    return scale.view(torch.uint8)


def experts(spec: ModelSpec, w: LayerWeights) -> Experts | QuantizedExperts:
    count, limit = int(spec.raw["n_routed_experts"]), float(spec.get("swiglu_limit", 10.0))
    if "0.w1.scale" in w:
        return QuantizedExperts(*fp4_experts(w, count), activation=ClampedSiluGLU(limit))
    gate_up, down = w.glu_experts(count, spec.hidden_size, names=("w1", "w3", "w2"))
    return Experts(gate_up, down, activation=ClampedSiluGLU(limit))


def routed_moe(spec: ModelSpec, i: int, m: LayerWeights) -> RoutedMoE:
    hashed = mlp_kind(spec, i) == HASH_MOE
    router = SqrtSoftplusRouter(
        int(spec.raw["num_experts_per_tok"]),
        float(spec.raw["routed_scaling_factor"]),
        None if hashed else m.get("gate.bias", dtype=torch.float32),
        m.raw("gate.tid2eid").to(m.device, torch.int64) if hashed else None,
    )
    shared = None
    if int(spec.get("n_shared_experts", 1)) > 0:
        s, limit = m.sub("shared_experts."), float(spec.get("swiglu_limit", 10.0))
        shared = ClampedGatedMLP(dense(s, "w1"), dense(s, "w3"), dense(s, "w2"), limit)
    proj = Float32Dense(m.get("gate.weight", dtype=torch.float32))
    return RoutedMoE(proj, router, experts(spec, m.sub("experts.")), shared)


# ---- the checkpoint ----------------------------------------------------------------------------

FP8_BLOCK = 128  # DeepSeek's FP8 projections: one E8M0 (or float32) scale per 128 x 128 block
PUBLISHED_NAMES = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "model.hc_head.hc_fn": "hc_head_fn",
    "model.hc_head.hc_base": "hc_head_base",
    "model.hc_head.hc_scale": "hc_head_scale",
}


class PublishedNames:
    """A checkpoint read under the names transformers saves (``model.layers.N.``...), whether it
    holds those or DeepSeek's own (``layers.N.``, ``embed.weight``, ``norm.weight``, ``hc_head_fn``)."""

    def __init__(self, source: TensorSource):
        self.source = source

    def stored(self, name: str) -> str:
        if name in self.source:
            return name
        alias = PUBLISHED_NAMES.get(name) or (name.removeprefix("model.") if name.startswith("model.") else None)
        return alias if alias is not None and alias in self.source else name

    def __contains__(self, name: str) -> bool:
        return self.stored(name) in self.source

    def read(self, name: str) -> torch.Tensor:
        return self.source.read(self.stored(name))


def tensor_source(spec: ModelSpec, source: TensorSource) -> TensorSource:
    """How the shard reads this family's checkpoints: both naming schemes (:class:`PublishedNames`)."""
    return PublishedNames(source)


def e8m0_or_float(scale: torch.Tensor) -> torch.Tensor:
    """A scale tensor as float32: E8M0 bytes are 2^(e - 127)."""
    if scale.dtype in (torch.uint8, torch.float8_e8m0fnu):
        return torch.pow(2.0, scale.view(torch.uint8).to(torch.float32) - 127)
    return scale.to(torch.float32)


def fp8_dequantized(weight: torch.Tensor, scale: torch.Tensor, name: str) -> torch.Tensor:
    """An FP8 E4M3 weight [out, in] times its per-128x128-block scale, in float32."""
    out, inner = weight.shape
    grid = (-(-out // FP8_BLOCK), -(-inner // FP8_BLOCK))
    if tuple(scale.shape) != grid:
        raise CheckpointError(
            f"'{name}.scale' has shape {tuple(scale.shape)}; an FP8 weight of shape {(out, inner)} needs "
            f"{grid} (one scale per {FP8_BLOCK}x{FP8_BLOCK} block)"
        )
    full = e8m0_or_float(scale).repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)
    return weight.to(torch.float32) * full[:out, :inner]


def dense(w: LayerWeights, name: str) -> Dense:
    """A projection ``{name}.weight``, decoded from FP8 with its block scales where DeepSeek stores it so."""
    weight = w.raw(f"{name}.weight")
    if weight.dtype == torch.float8_e4m3fn and f"{name}.scale" in w:
        weight = fp8_dequantized(weight, w.raw(f"{name}.scale"), w.prefix + name)
    return Dense(weight.to(device=w.device, dtype=w.dtype))


# ---- building ----------------------------------------------------------------------------------


def pooler(spec: ModelSpec, w: LayerWeights, rate: int, overlap: bool) -> Pooler:
    norm = RMSNorm(w.get("norm.weight", dtype=torch.float32), spec.rms_norm_eps)
    return Pooler(dense(w, "wkv"), dense(w, "wgate"), w.get("ape", dtype=torch.float32), norm, rate, overlap)


def attention(spec: ModelSpec, i: int, w: LayerWeights) -> CompressedAttention:
    a, kind, rate = w.sub("attn."), attention_kind(spec, i), compress_rate(spec, i)
    main_rope, compress_rope = ropes(spec)
    compressor = indexer = None
    if rate is not None:
        compressor = pooler(spec, a.sub("compressor."), rate, overlap=kind == CSA)
    if kind == CSA:
        ix = a.sub("indexer.")
        index_pooler = pooler(spec, ix.sub("compressor."), rate or 0, overlap=True)
        heads, top_k = int(spec.raw["index_n_heads"]), int(spec.raw["index_topk"])
        indexer = Indexer(index_pooler, dense(ix, "wq_b"), dense(ix, "weights_proj"), heads, top_k)
    return CompressedAttention(
        q_down=dense(a, "wq_a"),
        q_norm=RMSNorm(a.get("q_norm.weight", dtype=torch.float32), spec.rms_norm_eps),
        q_up=dense(a, "wq_b"),
        kv_proj=dense(a, "wkv"),
        kv_norm=RMSNorm(a.get("norm.weight", dtype=torch.float32), spec.rms_norm_eps),
        o_groups_proj=dense(a, "wo_a"),
        o_proj=dense(a, "wo_b"),
        sinks=a.get("attn_sink", dtype=torch.float32),
        dims=(spec.num_heads, spec.head_dim, int(spec.raw["o_groups"])),
        window=int(spec.raw["sliding_window"]),
        rope=main_rope,
        compress_rope=compress_rope,
        compressor=compressor,
        indexer=indexer,
        eps=spec.rms_norm_eps,
    )


def hyper_mix(spec: ModelSpec, w: LayerWeights, name: str) -> HyperMix:
    iters, eps = int(spec.get("hc_sinkhorn_iters", 20)), float(spec.get("hc_eps", 1e-6))
    f32 = torch.float32
    return HyperMix(w.get(f"{name}_fn", f32), w.get(f"{name}_base", f32), w.get(f"{name}_scale", f32), iters, eps,
                    spec.rms_norm_eps)  # fmt: skip


def build_layer(spec: ModelSpec, i: int, w: LayerWeights) -> HyperDecoderLayer:
    return HyperDecoderLayer(
        RMSNorm(w.get("attn_norm.weight", dtype=torch.float32), spec.rms_norm_eps),
        attention(spec, i, w),
        RMSNorm(w.get("ffn_norm.weight", dtype=torch.float32), spec.rms_norm_eps),
        routed_moe(spec, i, w.sub("ffn.")),
        hyper_mix(spec, w, "hc_attn"),
        hyper_mix(spec, w, "hc_ffn"),
    )


def residual_entry(spec: ModelSpec) -> HyperEntry:
    """What the first shard applies to the embedding: a copy per stream."""
    return HyperEntry(int(spec.raw["hc_mult"]))


def residual_exit(spec: ModelSpec, root: LayerWeights) -> HyperHead:
    """What the last shard applies before the final norm: the hyper head's collapse."""
    h, f32 = root.sub("model.hc_head."), torch.float32
    eps = float(spec.get("hc_eps", 1e-6))
    return HyperHead(h.get("hc_fn", f32), h.get("hc_base", f32), h.get("hc_scale", f32), eps, spec.rms_norm_eps)


# ---- multi-token prediction --------------------------------------------------------------------


class MTPHead(nn.Module):
    """DeepSeek-V4's next-token-prediction layer (``mtp.{k}.``, ``num_nextn_predict_layers``): from
    the last layer's streams at position t and the embedding of token t + 1, the logits of token t + 2:

        x = e_proj(enorm(embed(next))) + h_proj(hnorm(streams))   (the embedding added to every stream)
        logits = head(norm(hyper_head(block(x))))

    ``block`` is a full decoder layer (layer index ``num_hidden_layers + k``); the embedding and the
    head are the model's. It keeps its own per-stream state (:meth:`allocate`), as a shard does.
    """

    def __init__(self, spec: ModelSpec, index: int, w: LayerWeights, embed: torch.Tensor, head: torch.Tensor):
        super().__init__()
        f32 = torch.float32
        self.spec, self.layer_index = spec, spec.num_layers + index
        self.block = build_layer(spec, self.layer_index, w)
        self.e_proj, self.h_proj = dense(w, "e_proj"), dense(w, "h_proj")
        self.enorm, self.hnorm, self.norm = (RMSNorm(w.get(f"{n}.weight", f32), spec.rms_norm_eps) for n in
                                             ("enorm", "hnorm", "norm"))  # fmt: skip
        eps = float(spec.get("hc_eps", 1e-6))
        self.hyper_head = HyperHead(w.get("hc_head_fn", f32), w.get("hc_head_base", f32), w.get("hc_head_scale", f32),
                                    eps, spec.rms_norm_eps)  # fmt: skip
        self.embed = nn.Parameter(embed, requires_grad=False)
        self.head = Dense(head)
        self.kv: LayerKV | None = None

    def allocate(self, max_slots: int, max_context: int, rewind_slack: int = REWIND_SLACK_POSITIONS) -> None:
        entries = cache_layout(self.spec, self.layer_index).entries
        self.kv = LayerKV(
            max_slots,
            {name: e.rows(max_context, rewind_slack) for name, e in entries.items()},
            {name: e.shape for name, e in entries.items()},
            self.embed.dtype,
            self.embed.device,
            {name: e.is_ring(max_context, rewind_slack) for name, e in entries.items()},
        )

    @torch.inference_mode()
    def forward(self, frame: Frame) -> torch.Tensor:
        """frame.hidden: the last layer's streams [R, hc_mult, hidden] at positions t; frame.token_ids:
        the tokens at t + 1; segments as a shard's (each slot's state advances with its rows).
        -> float32 logits [R, vocab] for the tokens at t + 2."""
        if self.kv is None:
            self.allocate(1, min(self.spec.max_position_embeddings, 4096))
        assert self.kv is not None and frame.hidden is not None and frame.token_ids is not None
        ids = frame.token_ids.to(self.embed.device)
        streams = frame.hidden.to(self.embed.device, self.embed.dtype)
        x = self.e_proj(self.enorm(self.embed[ids]))[:, None, :] + self.h_proj(self.hnorm(streams))
        segments = segments_of(frame.slots.tolist(), frame.positions.tolist())
        ctx = FrameContext(segments, frame.positions.to(ids.device), token_ids=ids)
        x = self.block(x, ctx, self.kv)
        logits: torch.Tensor = self.head(self.norm(self.hyper_head(x)))
        return logits.to(torch.float32)


def load_mtp(model_dir: str | Path, index: int = 0, *, dtype: torch.dtype = torch.float32,
             device: str | torch.device = "cpu") -> MTPHead:  # fmt: skip
    """MTP layer ``index`` of a checkpoint (``mtp.{index}.``), with the model's embedding and head."""
    from ..checkpoint import Checkpoint
    from ..spec import load_spec

    spec = load_spec(model_dir)
    count = int(spec.get("num_nextn_predict_layers", 0))
    if not 0 <= index < count:
        raise ConfigError(f"config.json's num_nextn_predict_layers={count} has no MTP layer {index}")
    root = LayerWeights(PublishedNames(Checkpoint(model_dir)), "", dtype, torch.device(device))
    if f"mtp.{index}.e_proj.weight" not in root:
        raise CheckpointError(f"{model_dir} holds no 'mtp.{index}.' tensors (transformers does not save them)")
    head_name = "head.weight" if "head.weight" in root else "lm_head.weight"
    return MTPHead(spec, index, root.sub(f"mtp.{index}."), root.get("model.embed_tokens.weight"), root.get(head_name))


# ---- the published checkpoint's tensors, from the config alone ---------------------------------


def published_tensors(spec: ModelSpec) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Name -> (dtype, shape) of every served tensor of DeepSeek's published checkpoint (DeepSeek's
    names; FP4 experts with E8M0 scales per 32, FP8 projections with a scale per 128x128 block,
    bf16 compressor/indexer projections, float32 hyper-connections, sinks and position biases): so
    ``inspect`` and ``render`` size the real model from its config.json alone. MTP layers are not
    served by the pipeline and not listed."""
    out: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    h, n, vocab = spec.hidden_size, int(spec.raw["hc_mult"]), spec.vocab_size
    out["embed.weight"], out["head.weight"], out["norm.weight"] = (
        (torch.bfloat16, (vocab, h)), (torch.bfloat16, (vocab, h)), (torch.bfloat16, (h,)),
    )  # fmt: skip
    out.update({"hc_head_fn": (torch.float32, (n, n * h)), "hc_head_base": (torch.float32, (n,)),
                "hc_head_scale": (torch.float32, (1,))})  # fmt: skip
    for i in range(spec.num_layers):
        out.update({f"layers.{i}.{name}": v for name, v in _published_layer(spec, i).items()})
    return out


def _fp8(out: dict[str, tuple[torch.dtype, tuple[int, ...]]], name: str, shape: tuple[int, int]) -> None:
    out[f"{name}.weight"] = (torch.float8_e4m3fn, shape)
    out[f"{name}.scale"] = (torch.float8_e8m0fnu, (-(-shape[0] // FP8_BLOCK), -(-shape[1] // FP8_BLOCK)))


def _fp4(out: dict[str, tuple[torch.dtype, tuple[int, ...]]], name: str, shape: tuple[int, int]) -> None:
    out[f"{name}.weight"] = (torch.int8, (shape[0], shape[1] // 2))
    out[f"{name}.scale"] = (torch.float8_e8m0fnu, (shape[0], shape[1] // BLOCK))


def _published_layer(spec: ModelSpec, i: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    h, d, heads, n = spec.hidden_size, spec.head_dim, spec.num_heads, int(spec.raw["hc_mult"])
    q_rank, groups, o_rank = int(spec.raw["q_lora_rank"]), int(spec.raw["o_groups"]), int(spec.raw["o_lora_rank"])
    experts, inter = int(spec.raw["n_routed_experts"]), int(spec.raw["moe_intermediate_size"])
    bf16, f32 = torch.bfloat16, torch.float32
    out: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for name, (rows, cols) in {"attn.wq_a": (q_rank, h), "attn.wq_b": (heads * d, q_rank), "attn.wkv": (d, h),
                               "attn.wo_a": (groups * o_rank, heads * d // groups), "attn.wo_b": (h, groups * o_rank),
                               "ffn.shared_experts.w1": (inter, h), "ffn.shared_experts.w3": (inter, h),
                               "ffn.shared_experts.w2": (h, inter)}.items():  # fmt: skip
        _fp8(out, name, (rows, cols))
    for name, size in {"attn_norm.weight": h, "ffn_norm.weight": h, "attn.q_norm.weight": q_rank,
                       "attn.kv_norm.weight": d}.items():  # fmt: skip
        out[name] = (bf16, (size,))
    out["attn.attn_sink"] = (f32, (heads,))
    for mix in ("hc_attn", "hc_ffn"):
        out.update({f"{mix}_fn": (f32, ((2 + n) * n, n * h)), f"{mix}_base": (f32, ((2 + n) * n,)),
                    f"{mix}_scale": (f32, (3,))})  # fmt: skip
    rate, kind = compress_rate(spec, i), attention_kind(spec, i)
    if rate is not None:
        out.update(_published_compressor("attn.compressor", rate, d, h, 2 if kind == CSA else 1))
    if kind == CSA:
        di, index_heads = int(spec.raw["index_head_dim"]), int(spec.raw["index_n_heads"])
        out.update(_published_compressor("attn.indexer.compressor", rate or 0, di, h, 2))
        _fp8(out, "attn.indexer.wq_b", (index_heads * di, q_rank))
        out["attn.indexer.weights_proj.weight"] = (bf16, (index_heads, h))
    out["ffn.gate.weight"] = (bf16, (experts, h))
    if mlp_kind(spec, i) == HASH_MOE:
        out["ffn.gate.tid2eid"] = (torch.int32, (spec.vocab_size, int(spec.raw["num_experts_per_tok"])))
    else:
        out["ffn.gate.bias"] = (f32, (experts,))
    for e in range(experts):
        for name, shape in (("w1", (inter, h)), ("w3", (inter, h)), ("w2", (h, inter))):
            _fp4(out, f"ffn.experts.{e}.{name}", shape)
    return out


def _published_compressor(prefix: str, rate: int, dim: int, h: int, halves: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:  # fmt: skip
    return {
        f"{prefix}.ape": (torch.float32, (rate, halves * dim)),
        f"{prefix}.wkv.weight": (torch.bfloat16, (halves * dim, h)),
        f"{prefix}.wgate.weight": (torch.bfloat16, (halves * dim, h)),
        f"{prefix}.norm.weight": (torch.bfloat16, (dim,)),
    }


class PublishedIndex:
    """:func:`published_tensors` as a tensor index (names and infos, no data): what a directory
    holding only DeepSeek-V4's config.json stands for when it is inspected."""

    def __init__(self, spec: ModelSpec, where: Path):
        self.tensors, self.where = published_tensors(spec), where

    def names(self) -> list[str]:
        return list(self.tensors)

    def info(self, name: str) -> TensorInfo:
        dtype, shape = self.tensors[name]
        return TensorInfo(self.where, dtype, shape, 0, math.prod(shape) * dtype.itemsize)


def published_index(spec: ModelSpec, where: Path) -> PublishedIndex:
    return PublishedIndex(spec, where)
