"""Inkling (Thinking Machines): the text decoder of ``inkling_text`` checkpoints and of multimodal
``inkling_mm_model`` ones (``text_config``; the vision and audio towers are never read).

A layer, pre-norm, with four short causal convolutions (each y = x + depthwise_conv(x) over
``conv_kernel_size`` positions, in float32):

    h = x + attn_conv(attention(input_norm(x)))
    out = h + mlp_conv(mlp(post_norm(h)))

Attention has no rotary embedding. k and v pass through their own convolutions (k_conv before
k's norm), q and k are RMS-normalised per head and the scale is 1/head_dim. Each query adds a
relative position bias of its own: ``r_proj`` gives [heads, d_rel] states that mix a learned bank
[d_rel, extent] of bias-vs-distance profiles, read at distance d = q_pos - k_pos and zero beyond
the extent (``rel_extent``; a sliding layer's extent is its window). The bias is a function of the
query's hidden state and the distance only, so it needs no per-key state. ``hybrid_sliding``
layers see d < ``sliding_window_size`` with their own head counts and dims (``swa_*``); ``hybrid``
layers see every position and, with ``log_scaling_n_floor``, scale q and the bias by
1 + alpha * log(max((pos + 1) / n_floor, 1)).

Feed-forward: dense SwiGLU times a learned ``global_scale`` on ``mlp_layer_types == "dense"``
layers, else a sparse MoE routed in float32 (:func:`sink_routing`) with shared experts weighted
per token by their own router weights (a bank of ``n_shared_experts`` experts every token uses).

Checkpoints: transformers' text layout, a multimodal one, or the released layout
(:mod:`.inkling_layout` reads them all by transformers' names).

Around the layers: the embedding is RMS-normalised (``embed_tokens.embed_norm``); the final
hidden state is divided by ``logits_mup_width_multiplier`` before the head (folded into the head's
weight at load); logits past ``unpadded_vocab_size`` are dropped (head rows cut at load).

Per-stream state (:func:`cache_layout`): attention's k and v (a ring over the window on sliding
layers) and each convolution's input history over its ``kernel`` positions, a ring whose rewind
slack is the carry journal. Under tensor parallelism k/v and their convolutions' channels follow
the kv heads; attn_conv and mlp_conv run after the all-reduce on the whole hidden state.

The multi-token-prediction layers (``num_mtp_layers``) are served by :mod:`.inkling_mtp`;
docs/inkling.md lists each feature with its test. One module of about 600 lines: the family's
config reading, cache layout, layers and builders, each small, read together.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..cache_layout import CacheEntry, LayerCache
from ..errors import CheckpointError, ConfigError
from ..kvcache import LayerKV
from ..layers import DecoderLayer, Dense, Experts, FrameContext, GatedMLP, RMSNorm, SparseMoE
from ..spec import ModelSpec
from ..weights import LayerWeights
from . import inkling_layout
from .common import dense

SLIDING, FULL = "hybrid_sliding", "hybrid"
DENSE, SPARSE = "dense", "sparse"
TEXT, MULTIMODAL = "inkling_text", "inkling_mm_model"
# transformers' InklingTextConfig spells some fields two ways (its attribute_map)
ALIASES = {"sconv_kernel_size": "conv_kernel_size", "sliding_window": "sliding_window_size"}


# ---- config ----------------------------------------------------------------------------------


def decoder_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The text decoder's config: ``raw`` itself for ``inkling_text``, a multimodal config's
    ``text_config`` (its MTP fields from ``mtp_config`` where the text config lacks them). Fields
    are normalised as transformers' InklingTextConfig does (aliases, ``dense_mlp_idx``,
    ``dense_intermediate_size``), so every later reader sees one spelling."""
    if raw.get("model_type") == MULTIMODAL:
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError("config.json of an inkling_mm_model checkpoint lacks the object 'text_config'")
        mtp = raw.get("mtp_config") or {}
        outer = ("eos_token_id", "bos_token_id", "quantization_config")  # a modelfleet-quantized one's plan too
        merged = {**{key: raw[key] for key in outer if key in raw}, **text}
        merged.setdefault("num_mtp_layers", mtp.get("num_nextn_predict_layers"))
        merged.setdefault("mtp_local_layer_ids", mtp.get("local_layer_ids"))
        merged.setdefault("chain_hidden_post_norm", mtp.get("chain_hidden_post_norm", False))
        merged["model_type"] = TEXT
        raw = merged
    out = dict(raw)
    for alias, name in ALIASES.items():
        if out.get(name) is None and out.get(alias) is not None:
            out[name] = out[alias]
    if out.get("dense_intermediate_size") is not None:  # then intermediate_size is the experts' width
        out["moe_intermediate_size"], out["intermediate_size"] = (
            out["intermediate_size"],
            out["dense_intermediate_size"],
        )
        del out["dense_intermediate_size"]
    return out


def tensor_source(spec: ModelSpec, source: Any) -> Any:
    """The checkpoint under transformers' text-model names, whichever Inkling layout it is in
    (:mod:`.inkling_layout`); the vision and audio towers are left out."""
    del spec  # the layout is told by the tensor names
    return inkling_layout.tensor_source(source)


def layer_types(spec: ModelSpec) -> list[str]:
    """Per-layer attention kind: ``layer_types``, else ``local_layer_ids`` are sliding, else every
    layer whose index + 1 is not a multiple of 6 (transformers' default)."""
    types = spec.get("layer_types")
    if types is not None:
        return list(types)
    local = spec.get("local_layer_ids")
    local_ids = set(local) if local is not None else {i for i in range(spec.num_layers) if (i + 1) % 6}
    return [SLIDING if i in local_ids else FULL for i in range(spec.num_layers)]


def mlp_layer_types(spec: ModelSpec) -> list[str]:
    """Per-layer feed-forward kind: ``mlp_layer_types``, else the first ``dense_mlp_idx`` dense."""
    types = spec.get("mlp_layer_types")
    if types is not None:
        return list(types)
    first_sparse = int(spec.get("dense_mlp_idx", 0))
    return [DENSE if i < first_sparse else SPARSE for i in range(spec.num_layers)]


def _check_kinds(name: str, kinds: list[str], allowed: tuple[str, str], layers: int) -> None:
    if len(kinds) != layers:
        raise ConfigError(f"config.json field '{name}' lists {len(kinds)} layers, but num_hidden_layers is {layers}")
    unknown = sorted(set(kinds) - set(allowed))
    if unknown:
        raise ConfigError(f"config.json field '{name}' holds {unknown}; inkling supports {', '.join(allowed)}")


def validate(spec: ModelSpec) -> None:
    _check_kinds("layer_types", layer_types(spec), (SLIDING, FULL), spec.num_layers)
    _check_kinds("mlp_layer_types", mlp_layer_types(spec), (DENSE, SPARSE), spec.num_layers)
    for key in ("d_rel", "rel_extent", "conv_kernel_size", "intermediate_size"):
        spec.require(key)
    if int(spec.raw["conv_kernel_size"]) < 2:
        raise ConfigError(f"config.json field 'conv_kernel_size' must be >= 2, got {spec.raw['conv_kernel_size']}")
    if SLIDING in layer_types(spec):
        for key in ("sliding_window_size", "swa_num_attention_heads", "swa_num_key_value_heads", "swa_head_dim"):
            spec.require(key)
    if SPARSE in mlp_layer_types(spec):
        for key in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "route_scale"):
            spec.require(key)
        if int(spec.get("n_shared_experts", 0)) < 1:
            raise ConfigError("inkling's router normalises over its shared experts: 'n_shared_experts' must be >= 1")
        if not spec.get("shared_expert_sink", True):
            raise ConfigError("inkling supports shared_expert_sink=true only (the reference router always sinks)")
    if spec.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"inkling supports hidden_act='silu', got {spec.raw['hidden_act']!r}")


# ---- attention shapes --------------------------------------------------------------------------


def attention_shape(spec: ModelSpec, i: int) -> tuple[int, int, int, int | None]:
    """(heads, kv_heads, head_dim, window) of layer ``i``: ``swa_*`` and the window on sliding layers."""
    if layer_types(spec)[i] == SLIDING:
        return (
            int(spec.raw["swa_num_attention_heads"]),
            int(spec.raw["swa_num_key_value_heads"]),
            int(spec.raw["swa_head_dim"]),
            int(spec.raw["sliding_window_size"]),
        )
    return spec.num_heads, spec.num_kv_heads, spec.head_dim, None


def conv_window(spec: ModelSpec) -> int:
    """A convolution's window: the ``kernel`` positions it spans, the newest included, as an
    attention window counts them. The convolution reads kernel - 1 stored inputs, but the cache's
    rewind limit (rows - window + 1, engine.cache_layout) holds for a window that counts the newest
    position: over kernel - 1 it would allow one position more than the ring keeps (a rewind of
    the slack + 1 would read an overwritten input)."""
    return int(spec.raw["conv_kernel_size"])


def cache_layout(spec: ModelSpec, i: int) -> LayerCache:
    """k and v ([kv_heads, head_dim] a position, over the window on sliding layers), then each
    convolution's input over its window (:func:`conv_window`): k's and v's (split with their heads) and the
    two on the residual branch ([hidden], whole on every tensor rank)."""
    _, kv_heads, head_dim, window = attention_shape(spec, i)
    history = conv_window(spec)
    heads_shape, hidden_shape = (kv_heads, head_dim), (spec.hidden_size,)
    return LayerCache(
        {
            "k": CacheEntry(heads_shape, window),
            "v": CacheEntry(heads_shape, window),
            "k_conv": CacheEntry(heads_shape, history),
            "v_conv": CacheEntry(heads_shape, history),
            "attn_conv": CacheEntry(hidden_shape, history, split=False),
            "mlp_conv": CacheEntry(hidden_shape, history, split=False),
        }
    )


# ---- modules -------------------------------------------------------------------------------------


def causal_conv(history: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Depthwise causal convolution of one stream's rows, float32.

    history: [kernel - 1, C] inputs before x (zeros before position 0); x: [n, C];
    weight: [C, kernel]. y[t] = sum_j weight[:, j] * [history; x][t + j]  -> [n, C].
    """
    extended = torch.cat([history, x])
    kernel, n = weight.shape[1], x.shape[0]
    return sum((weight[:, j] * extended[j : j + n] for j in range(kernel)), torch.zeros_like(x))


class ShortConv(nn.Module):
    """x + causal_conv(x) in float32, per stream; its input history is the cache entry ``entry``
    (rows of ``entry_shape``, whose product is the channel count C)."""

    def __init__(self, weight: torch.Tensor, entry: str):
        super().__init__()
        self.weight = nn.Parameter(weight.to(torch.float32).reshape(weight.shape[0], -1), requires_grad=False)
        self.entry = entry

    def forward(self, x: torch.Tensor, ctx: FrameContext, kv: LayerKV) -> torch.Tensor:
        """x: [R, C] in the compute dtype -> [R, C] in the same dtype."""
        assert ctx.segments is not None, "inkling runs general frames only (no static decode)"
        shape, history_rows = kv.tensors[self.entry].shape[2:], self.weight.shape[1] - 1
        out = torch.empty_like(x)
        for seg in ctx.segments:
            rows = x[seg.row_start : seg.row_end]
            start = max(0, seg.pos_start - history_rows)
            stored = kv.read(seg.slot, start, seg.pos_start, (self.entry,))[self.entry].reshape(-1, x.shape[1])
            history = torch.cat([stored.new_zeros(history_rows - stored.shape[0], x.shape[1]), stored]).float()
            u = rows.float()
            out[seg.row_start : seg.row_end] = (u + causal_conv(history, u, self.weight)).to(x.dtype)
            kv.write(seg.slot, seg.pos_start, {self.entry: rows.reshape(rows.shape[0], *shape)})
        return out


def log_scale(positions: torch.Tensor, n_floor: int, alpha: float) -> torch.Tensor:
    """1 + alpha * log(max((pos + 1) / n_floor, 1)) per position, float32: [n]."""
    return 1.0 + alpha * torch.log(((positions + 1).float() / n_floor).clamp(min=1.0))


def relative_bias(states: torch.Tensor, bank: torch.Tensor, distance: torch.Tensor) -> torch.Tensor:
    """states: [n, H, d_rel], bank: [d_rel, extent], distance: [n, L] -> bias [H, n, L], zero
    where distance < 0 or >= extent."""
    extent = bank.shape[1]
    profiles = (states @ bank).transpose(0, 1)  # [H, n, extent]
    index = distance.clamp(0, extent - 1)[None].expand(profiles.shape[0], -1, -1)
    bias = profiles.gather(-1, index)
    return bias.masked_fill(((distance < 0) | (distance >= extent))[None], 0.0)


class InklingAttention(nn.Module):
    """Attention without rotary embedding, per-head q/k RMS norms, k and v convolutions, a
    hidden-state-conditioned relative position bias and optional log scaling (module docstring)."""

    def __init__(
        self,
        projections: dict[str, Dense],
        k_conv: ShortConv,
        v_conv: ShortConv,
        qk_norms: tuple[torch.Tensor, torch.Tensor],
        rel_bank: torch.Tensor,
        shape: tuple[int, int, int, int | None],
        eps: float,
        log_scaling: tuple[int, float] | None,
    ):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = projections["q_proj"], projections["k_proj"], projections["v_proj"]
        self.r_proj, self.o_proj = projections["r_proj"], projections["o_proj"]
        self.k_conv, self.v_conv = k_conv, v_conv
        self.q_norm = nn.Parameter(qk_norms[0], requires_grad=False)  # [D]
        self.k_norm = nn.Parameter(qk_norms[1], requires_grad=False)  # [D]
        self.rel_bank = nn.Parameter(rel_bank, requires_grad=False)  # [d_rel, extent]
        self.num_heads, self.num_kv_heads, self.head_dim, self.window = shape
        self.eps, self.log_scaling = eps, log_scaling
        self.scale = 1.0 / self.head_dim  # q and k are unit-RMS per head

    def forward(self, x: torch.Tensor, ctx: FrameContext, kv: LayerKV) -> torch.Tensor:
        rows, d = x.shape[0], self.head_dim
        q = self.q_proj(x).view(rows, self.num_heads, d)
        k = self.k_conv(self.k_proj(x), ctx, kv).view(rows, self.num_kv_heads, d)
        v = self.v_conv(self.v_proj(x), ctx, kv).view(rows, self.num_kv_heads, d)
        states = self.r_proj(x).view(rows, self.num_heads, -1)
        q = self.q_norm * F.rms_norm(q, (d,), eps=self.eps)
        k = self.k_norm * F.rms_norm(k, (d,), eps=self.eps)
        out = torch.empty_like(q)
        assert ctx.segments is not None, "inkling runs general frames only (no static decode)"
        for seg in ctx.segments:
            rs = slice(seg.row_start, seg.row_end)
            new = {"k": k[rs], "v": v[rs]}
            out[rs] = self._attend_segment(kv, seg.slot, seg.pos_start, q[rs], new, states[rs], ctx.positions[rs])
        y: torch.Tensor = self.o_proj(out.reshape(rows, self.num_heads * d))
        return y

    def _attend_segment(
        self,
        kv: LayerKV,
        slot: int,
        pos_start: int,
        q: torch.Tensor,
        new: dict[str, torch.Tensor],
        states: torch.Tensor,
        positions: torch.Tensor,
    ) -> torch.Tensor:
        """Store one stream's k/v rows (at row indices from ``pos_start``) and attend its queries
        over the visible history. q: [n, H, D], states: [n, H, d_rel] -> [n, H, D]; ``positions``
        [n]: the queries' positions in the sequence, which log scaling reads (an MTP layer's rows
        sit ahead of their row indices)."""
        n = q.shape[0]
        # read what survives before this segment's rows overwrite a ring
        k_start = 0 if self.window is None else max(0, pos_start - self.window + 1)
        old = kv.read(slot, k_start, pos_start, ("k", "v"))
        keys, values = (torch.cat([old[name], new[name]]) for name in ("k", "v"))
        kv.write(slot, pos_start, new)
        q_pos = torch.arange(pos_start, pos_start + n, device=q.device)
        k_pos = torch.arange(k_start, pos_start + n, device=q.device)
        distance = q_pos[:, None] - k_pos[None, :]  # [n, L]
        bias = relative_bias(states, self.rel_bank.to(states.dtype), distance)  # [H, n, L]
        if self.log_scaling is not None:
            tau = log_scale(positions, *self.log_scaling)
            q = (q.float() * tau[:, None, None]).to(q.dtype)
            bias = (bias.float() * tau[None, :, None]).to(bias.dtype)
        groups = self.num_heads // self.num_kv_heads
        keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
        logits = torch.einsum("nhd,lhd->hnl", q, keys) * self.scale + bias
        visible = distance >= 0
        if self.window is not None:
            visible &= distance < self.window
        logits = logits.masked_fill(~visible[None], float("-inf"))
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.einsum("hnl,lhd->nhd", probs, values)


class ScaledGatedMLP(GatedMLP):
    """Dense SwiGLU times a learned scalar ``global_scale``."""

    def __init__(self, gate: Dense, up: Dense, down: Dense, scale: torch.Tensor):
        super().__init__(gate, up, down)
        self.global_scale = nn.Parameter(scale, requires_grad=False)  # [1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.global_scale.to(x.dtype)


def sink_routing(
    logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, shared: int, scale: float | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inkling's router. logits: [T, E + S] float32 (routed experts, then the S shared ones).

    Routed experts are chosen by sigmoid score + ``correction_bias`` (selection only); the chosen
    and the shared experts' weights are a softmax over their log-sigmoid logits (the shared ones
    act as a sink), times ``scale`` (route_scale x global_scale). -> index [T, k], weight [T, k],
    shared weights (gammas) [T, S], float32.
    """
    routed, shared_logits = logits[:, :-shared], logits[:, -shared:]
    index = torch.topk(routed.sigmoid() + correction_bias, top_k, dim=-1).indices
    log_probs = F.logsigmoid(torch.cat([routed.gather(1, index), shared_logits], dim=-1))
    weights = torch.softmax(log_probs, dim=-1) * scale
    return index, weights[:, :top_k], weights[:, top_k:]


class SinkRouter(nn.Module):
    """:func:`sink_routing` with the layer's correction bias and scales."""

    correction_bias: torch.Tensor  # [E] float32
    global_scale: torch.Tensor  # [1] float32

    def __init__(
        self, correction_bias: torch.Tensor, global_scale: torch.Tensor, top_k: int, shared: int, route_scale: float
    ):
        super().__init__()
        self.register_buffer("correction_bias", correction_bias.float())
        self.register_buffer("global_scale", global_scale.float())
        self.top_k, self.shared, self.route_scale = top_k, shared, route_scale

    def forward(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scale = self.global_scale.float() * self.route_scale
        return sink_routing(logits.float(), self.correction_bias, self.top_k, self.shared, scale)


class Float32Dense(Dense):
    """The router projection in float32 whatever the compute dtype (the reference's routing is
    float32: distinct scores must not round to ties before top-k)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())


class SinkMoE(SparseMoE):
    """Routed experts plus shared experts weighted per token by the router (their gammas); the
    shared experts are a bank of S experts that every token uses, so formats and tensor
    parallelism treat them like any expert bank."""

    def __init__(self, router_proj: Dense, router: SinkRouter, experts: Experts, shared: Experts):
        super().__init__(router_proj, router, experts, shared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        index, weight, gammas = cast(SinkRouter, self.route)(self.router_proj(x))
        out: torch.Tensor = self.experts(x, index, weight)
        shared_index = torch.arange(gammas.shape[1], device=x.device).expand(x.shape[0], -1)
        assert self.shared is not None
        shared: torch.Tensor = self.shared(x, shared_index, gammas)
        return out + shared


class InklingDecoderLayer(DecoderLayer):
    """x + attn_conv(attention(norm(x))), then h + mlp_conv(mlp(norm(h)))."""

    def __init__(
        self,
        norms: tuple[RMSNorm, RMSNorm],
        attention: InklingAttention,
        mlp: nn.Module,
        convs: tuple[ShortConv, ShortConv],
    ):
        super().__init__(norms[0], attention, norms[1], mlp)
        self.attn_conv, self.mlp_conv = convs

    def forward(self, x: torch.Tensor, ctx: FrameContext, kv: LayerKV) -> torch.Tensor:
        h = x + self.attn_conv(self.attention(self.input_norm(x), ctx, kv), ctx, kv)
        out: torch.Tensor = h + self.mlp_conv(self.mlp(self.post_norm(h)), ctx, kv)
        return out


# ---- building ------------------------------------------------------------------------------------


def conv(w: LayerWeights, name: str, entry: str, channels: int, kernel: int) -> ShortConv:
    """``{name}.conv1d.weight`` [C, 1, kernel], kept in float32."""
    weight = w.get(f"{name}.conv1d.weight", dtype=torch.float32)
    if tuple(weight.shape) != (channels, 1, kernel):
        raise CheckpointError(
            f"'{w.prefix}{name}.conv1d.weight' has shape {tuple(weight.shape)}, expected {(channels, 1, kernel)} "
            "(channels from the heads or hidden_size, conv_kernel_size from config.json)"
        )
    return ShortConv(weight, entry)


def attention(spec: ModelSpec, i: int, w: LayerWeights) -> InklingAttention:
    a = w.sub("self_attn.")
    shape = attention_shape(spec, i)
    _, kv_heads, head_dim, window = shape
    kernel = int(spec.raw["conv_kernel_size"])
    extent = window if window is not None else int(spec.raw["rel_extent"])
    bank = a.get("rel_logits_proj.proj")
    if tuple(bank.shape) != (int(spec.raw["d_rel"]), extent):
        raise CheckpointError(
            f"'{a.prefix}rel_logits_proj.proj' has shape {tuple(bank.shape)}, expected {(spec.raw['d_rel'], extent)} "
            "(d_rel, and rel_extent or a sliding layer's sliding_window_size, from config.json)"
        )
    n_floor = spec.get("log_scaling_n_floor")
    log_scaling = (int(n_floor), float(spec.get("log_scaling_alpha", 0.1))) if window is None and n_floor else None
    return InklingAttention(
        {name: dense(a, name) for name in ("q_proj", "k_proj", "v_proj", "r_proj", "o_proj")},
        conv(a, "k_sconv", "k_conv", kv_heads * head_dim, kernel),
        conv(a, "v_sconv", "v_conv", kv_heads * head_dim, kernel),
        (a.get("q_norm.weight"), a.get("k_norm.weight")),
        bank,
        shape,
        spec.rms_norm_eps,
        log_scaling,
    )


def shared_experts(spec: ModelSpec, s: LayerWeights) -> Experts:
    """gate_proj, up_proj [S, I, H] and down_proj [S, H, I] as one bank of S experts."""
    gate_up = torch.cat([s.get("gate_proj"), s.get("up_proj")], dim=1)
    if gate_up.shape[0] != int(spec.raw["n_shared_experts"]) or gate_up.shape[2] != spec.hidden_size:
        raise CheckpointError(
            f"'{s.prefix}gate_proj' has shape {tuple(s.raw('gate_proj').shape)}; expected "
            "[n_shared_experts, moe_intermediate_size, hidden_size] from config.json"
        )
    return Experts(gate_up, s.get("down_proj"))


def sparse_moe(spec: ModelSpec, m: LayerWeights) -> SinkMoE:
    router = SinkRouter(
        m.get("gate.e_score_correction_bias", dtype=torch.float32),
        m.get("gate.global_scale", dtype=torch.float32),
        top_k=int(spec.raw["num_experts_per_tok"]),
        shared=int(spec.raw["n_shared_experts"]),
        route_scale=float(spec.raw["route_scale"]),
    )
    gate_up, down = m.sub("experts.").glu_experts(int(spec.raw["n_routed_experts"]), spec.hidden_size)
    proj = Float32Dense(m.get("gate.weight", dtype=torch.float32))
    proj.keep_plain = True  # read in float32 by its forward: never packed or quantized
    return SinkMoE(proj, router, Experts(gate_up, down), shared_experts(spec, m.sub("shared_experts.")))


def dense_mlp(m: LayerWeights) -> ScaledGatedMLP:
    return ScaledGatedMLP(dense(m, "gate_proj"), dense(m, "up_proj"), dense(m, "down_proj"), m.get("global_scale"))


def build_layer(spec: ModelSpec, i: int, w: LayerWeights) -> InklingDecoderLayer:
    m = w.sub("mlp.")
    mlp: nn.Module = sparse_moe(spec, m) if mlp_layer_types(spec)[i] == SPARSE else dense_mlp(m)
    kernel = int(spec.raw["conv_kernel_size"])
    norms = (
        RMSNorm(w.get("input_layernorm.weight"), spec.rms_norm_eps),
        RMSNorm(w.get("post_attention_layernorm.weight"), spec.rms_norm_eps),
    )
    convs = (
        conv(w, "attn_sconv", "attn_conv", spec.hidden_size, kernel),
        conv(w, "mlp_sconv", "mlp_conv", spec.hidden_size, kernel),
    )
    return InklingDecoderLayer(norms, attention(spec, i, w), mlp, convs)


def adapt_shard(spec: ModelSpec, shard: nn.Module, w: LayerWeights) -> None:
    """The parts around the layers, in place (``w`` at the decoder's prefix): the embedding's RMS
    norm on a first shard, :func:`logits_head` on a last one."""
    if getattr(shard, "embed", None) is not None:
        shard.embed_norm = RMSNorm(w.get("embed_tokens.embed_norm.weight"), spec.rms_norm_eps)
    head = getattr(shard, "head", None)
    if isinstance(head, Dense):
        shard.head = logits_head(spec, head.weight.data)


def logits_head(spec: ModelSpec, weight: torch.Tensor) -> Dense:
    """The head as the family reads it: rows cut to ``unpadded_vocab_size`` and divided by the muP
    width multiplier (head(h / m) = (W / m) h), so the final norm's output stays the hidden state
    the MTP layers take."""
    unpadded = spec.get("unpadded_vocab_size")
    rows = weight.shape[0] if unpadded is None else min(int(unpadded), weight.shape[0])
    return Dense(weight[:rows] / float(spec.get("logits_mup_width_multiplier", 1.0)))


def layer_tensor_shapes(spec: ModelSpec, i: int) -> dict[str, tuple[int, ...]]:
    """Layer ``i``'s tensors by transformers' names (relative to the layer) and their shapes."""
    heads, kv_heads, head_dim, window = attention_shape(spec, i)
    hidden, d_rel, kernel = spec.hidden_size, int(spec.raw["d_rel"]), int(spec.raw["conv_kernel_size"])
    extent = window if window is not None else int(spec.raw["rel_extent"])
    shapes: dict[str, tuple[int, ...]] = {
        "self_attn.q_proj.weight": (heads * head_dim, hidden),
        "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
        "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
        "self_attn.r_proj.weight": (heads * d_rel, hidden),
        "self_attn.o_proj.weight": (hidden, heads * head_dim),
        "self_attn.q_norm.weight": (head_dim,),
        "self_attn.k_norm.weight": (head_dim,),
        "self_attn.k_sconv.conv1d.weight": (kv_heads * head_dim, 1, kernel),
        "self_attn.v_sconv.conv1d.weight": (kv_heads * head_dim, 1, kernel),
        "self_attn.rel_logits_proj.proj": (d_rel, extent),
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
        "attn_sconv.conv1d.weight": (hidden, 1, kernel),
        "mlp_sconv.conv1d.weight": (hidden, 1, kernel),
    }
    if mlp_layer_types(spec)[i] == DENSE:
        inter = int(spec.raw["intermediate_size"])
        shapes |= {"mlp.gate_proj.weight": (inter, hidden), "mlp.up_proj.weight": (inter, hidden)}
        return shapes | {"mlp.down_proj.weight": (hidden, inter), "mlp.global_scale": (1,)}
    experts, shared = int(spec.raw["n_routed_experts"]), int(spec.raw["n_shared_experts"])
    inter = int(spec.raw["moe_intermediate_size"])
    return shapes | {
        "mlp.gate.weight": (experts + shared, hidden),
        "mlp.gate.global_scale": (1,),
        "mlp.gate.e_score_correction_bias": (experts,),
        "mlp.experts.gate_up_proj": (experts, 2 * inter, hidden),
        "mlp.experts.down_proj": (experts, hidden, inter),
        "mlp.shared_experts.gate_proj": (shared, inter, hidden),
        "mlp.shared_experts.up_proj": (shared, inter, hidden),
        "mlp.shared_experts.down_proj": (shared, hidden, inter),
    }


def published_tensors(spec: ModelSpec) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """:func:`tensor_shapes` in bfloat16, as ``inspect`` sizes a config-only directory."""
    return {name: (torch.bfloat16, shape) for name, shape in tensor_shapes(spec).items()}


def tensor_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor the text decoder reads, by transformers' names, and its shape: what a summary
    of a directory holding only config.json is counted from (MTP layers and towers excluded)."""
    hidden = spec.hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (spec.vocab_size, hidden),
        "model.embed_tokens.embed_norm.weight": (hidden,),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (spec.vocab_size, hidden),
    }
    for i in range(spec.num_layers):
        shapes |= {f"model.layers.{i}.{name}": shape for name, shape in layer_tensor_shapes(spec, i).items()}
    return shapes


def vocab_size_out(spec: ModelSpec) -> int:
    """Logits per row: ``unpadded_vocab_size`` when it cuts the head, else ``vocab_size``."""
    unpadded = spec.get("unpadded_vocab_size")
    return min(spec.vocab_size, int(unpadded)) if unpadded is not None else spec.vocab_size


__all__ = [
    "InklingAttention",
    "InklingDecoderLayer",
    "ShortConv",
    "SinkMoE",
    "adapt_shard",
    "build_layer",
    "cache_layout",
    "decoder_config",
    "layer_types",
    "mlp_layer_types",
    "sink_routing",
    "published_tensors",
    "tensor_shapes",
    "tensor_source",
    "validate",
]
