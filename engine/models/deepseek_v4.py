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

Modules: ``deepseek_v4_config`` (kinds, RoPE, validation, state layout), ``deepseek_v4_attention``,
``deepseek_v4_checkpoint`` (names, FP8/FP4, the published tensors), ``deepseek_v4_mtp``; this one holds
the hyper-connections, the MoE and the family surface the engine asks (``engine.models``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InputError
from ..kvcache import LayerKV
from ..layers import DecoderLayer, Dense, Experts, FrameContext, GatedMLP, RMSNorm, SparseMoE
from ..quantize import QuantizedExperts
from ..spec import ModelSpec
from ..weights import LayerWeights
from .deepseek_v3 import Float32Dense
from .deepseek_v4_attention import CompressedAttention, Indexer, Pooler, ropes, unit_rms
from .deepseek_v4_checkpoint import dense, fp4_experts, published_tensors, tensor_source
from .deepseek_v4_config import (
    CSA,
    HASH_MOE,
    attention_kind,
    cache_layout,
    compress_rate,
    mlp_kind,
    residual_shape,
    tensor_split_fields,
    validate,
)

__all__ = [  # the family surface (engine.models): what the shard, planner and tensor parallelism ask
    "build_layer",
    "cache_layout",
    "published_tensors",
    "residual_entry",
    "residual_exit",
    "residual_shape",
    "tensor_source",
    "tensor_split_fields",
    "validate",
]

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

    def forward(
        self, logits: torch.Tensor, token_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:  # token ids: hash layers only (a router called alone routes by score)
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
