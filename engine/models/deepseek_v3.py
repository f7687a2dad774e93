"""DeepSeek-V3: multi-head latent attention (MLA) with decoupled RoPE, and sigmoid-scored,
group-limited top-k routing over routed experts plus always-active shared experts.

MLA cache: a position stores one latent row [kv_lora_rank + qk_rope_head_dim], the normalised
compressed KV ``c_kv`` followed by the rotated key ``k_pe`` that all heads share, instead of
per-head keys and values (576 values a position for V3 rather than 128 x (192 + 128)).
Attention runs in latent space by weight absorption: with kv_b_proj split per head into
W_uk [nope, r] and W_uv [v, r],

    q_nope . (W_uk c) = (W_uk^T q_nope) . c        and        W_uv (sum_j p_j c_j),

so queries become [W_uk^T q_nope | q_pe] over keys [c_kv | k_pe] with values c_kv, one shared
key-value head, and each head's output is lifted back through W_uv before o_proj.

Layers below ``first_k_dense_replace`` (and, as DeepSeek's own code does, layers off
``moe_layer_freq``) use a dense SwiGLU MLP of ``intermediate_size``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..cache_layout import LayerCache
from ..errors import ConfigError
from ..frame import Segment
from ..kvcache import LayerKV
from ..layers import (
    DecoderLayer,
    Dense,
    Experts,
    FrameContext,
    GatedMLP,
    RMSNorm,
    SparseMoE,
    _attention_core,
    attend,
    write_static_decode,
)
from ..rope import Rotary, _yarn_mscale
from ..spec import ModelSpec
from ..weights import LayerWeights
from .common import dense, norms, rotary_for

REQUIRED = (
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "n_shared_experts",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
    "first_k_dense_replace",
)


def validate(spec: ModelSpec) -> None:
    for key in REQUIRED:
        spec.require(key)
    experts, groups = int(spec.raw["n_routed_experts"]), int(spec.raw["n_group"])
    topk_group, top_k = int(spec.raw["topk_group"]), int(spec.raw["num_experts_per_tok"])
    if experts % groups:
        raise ConfigError(f"n_routed_experts={experts} must be a multiple of n_group={groups}")
    if not 1 <= topk_group <= groups:
        raise ConfigError(f"topk_group={topk_group} must be between 1 and n_group={groups}")
    if top_k > topk_group * (experts // groups):
        raise ConfigError(
            f"num_experts_per_tok={top_k} exceeds the {topk_group * (experts // groups)} experts that "
            f"topk_group={topk_group} groups of {experts // groups} hold"
        )
    if int(spec.raw["first_k_dense_replace"]) > 0:
        spec.require("intermediate_size")
    for key, supported in (("hidden_act", "silu"), ("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if spec.get(key, supported) != supported:
            raise ConfigError(f"deepseek_v3 supports {key}='{supported}', got {spec.raw[key]!r}")


def softmax_scale(spec: ModelSpec) -> float:
    """1/sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)^2 under scaled RoPE: the
    reference's correction for YaRN's sharper attention (transformers' ``yarn_apply_mscale``)."""
    qk_head_dim = int(spec.raw["qk_nope_head_dim"]) + int(spec.raw["qk_rope_head_dim"])
    scale = float(qk_head_dim) ** -0.5
    if spec.rope.rope_type != "default" and spec.rope.mscale_all_dim:
        mscale = _yarn_mscale(spec.rope.factor, float(spec.rope.mscale_all_dim))
        scale *= mscale * mscale
    return float(scale)


class LatentAttention(nn.Module):
    """MLA over a latent cache; see the module docstring for the absorbed form."""

    window: int | None = None  # full attention: every position stays cached
    static_decode = True  # runs static decode frames (ctx.segments None)

    def __init__(
        self,
        q_down: Dense | None,
        q_norm: RMSNorm | None,
        q_up: Dense,
        kv_down: Dense,
        kv_norm: RMSNorm,
        kv_up: Dense,
        o_proj: Dense,
        num_heads: int,
        dims: tuple[int, int, int, int],
        rotary: Rotary,
        scale: float,
    ):
        super().__init__()
        self.q_down, self.q_norm, self.q_up = q_down, q_norm, q_up  # q_down None: plain q_proj
        self.kv_down, self.kv_norm, self.kv_up, self.o_proj = kv_down, kv_norm, kv_up, o_proj
        self.num_heads = num_heads
        self.kv_rank, self.nope_dim, self.rope_dim, self.v_dim = dims
        self.rotary, self.scale = rotary, scale

    def cache_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"latent": (self.kv_rank + self.rope_dim,)}

    def forward(self, x: torch.Tensor, ctx: FrameContext, kv: LayerKV) -> torch.Tensor:
        rows, heads = x.shape[0], self.num_heads
        q_in = x if self.q_down is None or self.q_norm is None else self.q_norm(self.q_down(x))
        q = self.q_up(q_in).view(rows, heads, self.nope_dim + self.rope_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        c_kv, k_pe = self.kv_down(x).split([self.kv_rank, self.rope_dim], dim=-1)
        cos, sin = ctx.cos_sin(self.rotary, x.dtype)
        q_pe = self.rotary.apply(q_pe, cos, sin)
        k_pe = self.rotary.apply(k_pe.unsqueeze(1), cos, sin).squeeze(1)
        latent = torch.cat([self.kv_norm(c_kv), k_pe], dim=-1)  # [R, r + rope]
        # kv_up.weight: [heads * (nope + v), r] -> W_uk [heads, nope, r], W_uv [heads, v, r]
        w_up = self.kv_up.weight.view(heads, self.nope_dim + self.v_dim, self.kv_rank)
        w_uk, w_uv = w_up[:, : self.nope_dim], w_up[:, self.nope_dim :]
        query = torch.cat([torch.einsum("nhd,hdc->nhc", q_nope, w_uk), q_pe], dim=-1)  # [R, H, r + rope]
        if ctx.segments is None:
            out = self._attend_static_decode(kv, ctx, query, latent)
        else:
            out = self._attend_segments(kv, ctx.segments, query, latent)
        out_v = torch.einsum("nhc,hvc->nhv", out, w_uv)
        projected: torch.Tensor = self.o_proj(out_v.reshape(rows, heads * self.v_dim))
        return projected

    def _attend_static_decode(
        self, kv: LayerKV, ctx: FrameContext, query: torch.Tensor, latent: torch.Tensor
    ) -> torch.Tensor:
        """One row per slot over the whole latent capacity under the visibility mask:
        query [B, H, r + rope] -> [B, H, r]."""
        assert ctx.slots is not None
        write_static_decode(kv, ctx, {"latent": latent})
        past = kv.tensors["latent"][ctx.slots][:, None]  # [B, 1, cap, r + rope]: one head shared by all
        visible = ctx.static_mask(kv.capacity, kv.ring, None)
        out = _attention_core(query[:, :, None, :], past, past[..., : self.kv_rank], visible, self.scale, None)
        return out[:, :, 0, :]

    def _attend_segments(
        self, kv: LayerKV, segments: list[Segment], query: torch.Tensor, latent: torch.Tensor
    ) -> torch.Tensor:
        out = query.new_empty(query.shape[0], self.num_heads, self.kv_rank)
        for seg in segments:
            rs = slice(seg.row_start, seg.row_end)
            kv.write(seg.slot, seg.pos_start, {"latent": latent[rs]})
            past = kv.read(seg.slot, 0, seg.pos_end, ("latent",))["latent"].unsqueeze(1)  # [L, 1, r + rope]
            out[rs] = attend(query[rs], past, past[..., : self.kv_rank], seg.pos_start, 0, self.scale)
        return out


def cache_layout(spec: ModelSpec, i: int) -> LayerCache:
    """Every layer: one latent row [kv_lora_rank + qk_rope_head_dim] a position, at full context,
    shared by all heads (so every tensor rank holds all of it)."""
    latent = int(spec.require("kv_lora_rank")) + int(spec.require("qk_rope_head_dim"))
    return LayerCache.attention({"latent": (latent,)}, window=None, split_heads=False)


def latent_attention(spec: ModelSpec, w: LayerWeights) -> LatentAttention:
    a = w.sub("self_attn.")
    rope_dim = int(spec.raw["qk_rope_head_dim"])
    lora = spec.get("q_lora_rank") is not None
    kv_up = dense(a, "kv_b_proj")
    kv_up.keep_plain = True  # absorbed per head into the query and output: its weight is read directly
    return LatentAttention(
        q_down=dense(a, "q_a_proj") if lora else None,
        q_norm=RMSNorm(a.get("q_a_layernorm.weight"), spec.rms_norm_eps) if lora else None,
        q_up=dense(a, "q_b_proj") if lora else dense(a, "q_proj"),
        kv_down=dense(a, "kv_a_proj_with_mqa"),
        kv_norm=RMSNorm(a.get("kv_a_layernorm.weight"), spec.rms_norm_eps),
        kv_up=kv_up,
        o_proj=dense(a, "o_proj"),
        num_heads=spec.num_heads,
        dims=(int(spec.raw["kv_lora_rank"]), int(spec.raw["qk_nope_head_dim"]), rope_dim, int(spec.raw["v_head_dim"])),
        rotary=rotary_for(spec, rope_dim, interleaved=bool(spec.get("rope_interleave", True))),
        scale=softmax_scale(spec),
    )


def group_limited_top_k(
    logits: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 ("noaux_tc") routing. logits: [T, E] -> index, weight: [T, k] float32.

    Experts are chosen by sigmoid score + correction bias, only within the ``topk_group`` groups
    whose two best biased scores sum highest; weights are the unbiased sigmoid scores of the
    chosen experts, optionally renormalised, times ``scaling_factor``.
    """
    scores = logits.float().sigmoid()
    choice = scores + correction_bias.float()
    tokens, experts = scores.shape
    per_group = experts // n_group
    group_scores = choice.view(tokens, n_group, per_group).topk(min(2, per_group), dim=-1).values.sum(-1)
    kept = torch.zeros_like(group_scores, dtype=torch.bool)
    kept.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
    choice = choice.masked_fill(~kept.repeat_interleave(per_group, dim=1), float("-inf"))
    index = choice.topk(top_k, dim=-1).indices
    weight = scores.gather(1, index)
    if renormalize:
        weight = weight / (weight.sum(dim=-1, keepdim=True) + 1e-20)
    return index, weight * scaling_factor


class GroupLimitedRouter(nn.Module):
    """:func:`group_limited_top_k` with the layer's correction bias as a buffer."""

    correction_bias: torch.Tensor  # [E] float32

    def __init__(
        self,
        correction_bias: torch.Tensor,
        top_k: int,
        n_group: int,
        topk_group: int,
        renormalize: bool,
        scaling_factor: float,
    ):
        super().__init__()
        self.register_buffer("correction_bias", correction_bias)
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.renormalize, self.scaling_factor = renormalize, scaling_factor

    def forward(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return group_limited_top_k(
            logits,
            self.correction_bias,
            self.top_k,
            self.n_group,
            self.topk_group,
            self.renormalize,
            self.scaling_factor,
        )


class Float32Dense(Dense):
    """Router projection in float32 whatever the compute dtype, as the reference keeps
    ``gate.weight`` in float32: expert choice is discrete, and bf16 rounding would flip it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight)


def is_sparse(spec: ModelSpec, i: int) -> bool:
    return i >= int(spec.raw["first_k_dense_replace"]) and i % int(spec.get("moe_layer_freq", 1)) == 0


def sparse_moe(spec: ModelSpec, m: LayerWeights) -> SparseMoE:
    experts = int(spec.raw["n_routed_experts"])
    gate_up, down = m.sub("experts.").glu_experts(experts, spec.hidden_size)
    router = GroupLimitedRouter(
        m.get("gate.e_score_correction_bias", dtype=torch.float32),
        top_k=int(spec.raw["num_experts_per_tok"]),
        n_group=int(spec.raw["n_group"]),
        topk_group=int(spec.raw["topk_group"]),
        renormalize=bool(spec.get("norm_topk_prob", True)),
        scaling_factor=float(spec.raw["routed_scaling_factor"]),
    )
    shared = None
    if int(spec.raw["n_shared_experts"]) > 0:
        s = m.sub("shared_experts.")
        shared = GatedMLP(dense(s, "gate_proj"), dense(s, "up_proj"), dense(s, "down_proj"))
    proj = Float32Dense(m.get("gate.weight", dtype=torch.float32))
    return SparseMoE(proj, router, Experts(gate_up, down), shared)


def build_layer(spec: ModelSpec, i: int, w: LayerWeights) -> DecoderLayer:
    m = w.sub("mlp.")
    if is_sparse(spec, i):
        mlp: nn.Module = sparse_moe(spec, m)
    else:
        mlp = GatedMLP(dense(m, "gate_proj"), dense(m, "up_proj"), dense(m, "down_proj"))
    input_norm, post_norm = norms(spec, w)
    return DecoderLayer(input_norm, latent_attention(spec, w), post_norm, mlp)
