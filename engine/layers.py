"""Building blocks shared by the model families: norms, projections, attention over frames,
dense and sparse (MoE) feed-forward blocks, and the pre-norm decoder layer.

Shapes: a frame's activations are x: [R, hidden]; per-head tensors are [R, heads, head_dim].
Model code here is plain: no ranks, stages or formats. Projections are :class:`Dense` modules
so that weight formats can replace them without touching the layers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_moe
from .frame import Segment
from .kernels import add_rms_norm, cpu_linear, decode_attention, expert_gemv, grouped_moe, route_top_k
from .kvcache import LayerKV
from .rope import Rotary


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one fused kernel, accumulating in float32; in bf16 the reference rounds to x's dtype once
        # more before scaling, a difference of at most one unit in the last place
        weight = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)
        return F.rms_norm(x, (x.shape[-1],), weight, self.eps)

    def after_add(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h = x + delta and this norm of h: one kernel on CUDA (:mod:`.kernels.add_rms_norm`)."""
        if add_rms_norm.applies(x, delta) and self.weight.dtype == x.dtype:
            return add_rms_norm.add_rms_norm(x, delta, self.weight, self.eps)
        h = x + delta
        return h, self(h)


class Dense(nn.Module):
    """y = x @ weight.T + bias; weight: [out, in]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.packed: torch.Tensor | None = None  # oneDNN layout on CPU (bf16), replacing weight
        self.packed_nbytes = 0
        self.keep_plain = False  # set by layers that read .weight directly

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return cpu_linear.linear(x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16), self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)

    def pack_for_cpu(self) -> None:
        if self.keep_plain or self.packed is not None or not cpu_linear.available(self.weight):
            return
        self.packed = cpu_linear.pack(self.weight)
        self.packed_nbytes = self.weight.numel() * self.weight.element_size()
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)


@dataclass
class FrameContext:
    """What every layer needs to know about the frame being computed.

    ``segments`` describes a general frame (prefill windows and decode rows, computed per
    stream). When it is None the frame is a *static decode* frame: rows at (``slots``,
    ``positions``), every index a device tensor, so the step has fixed shapes, no host
    synchronisation, and can be captured in a CUDA graph. A slot has one row, or with ``windows``
    several at consecutive positions (a speculative verify window): every row's cache entries are
    written before any row attends, and each row sees its slot up to its own position.
    """

    segments: list[Segment] | None
    positions: torch.Tensor  # [R] int64 on the compute device
    slots: torch.Tensor | None = None  # [R] int64 on the compute device (static decode only)
    rope_cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    mask_cache: dict[tuple[int, bool, int | None], torch.Tensor] = field(default_factory=dict)
    token_ids: torch.Tensor | None = None  # [R] int64 on the device: the rows' tokens (hash routing)
    valid: torch.Tensor | None = None  # [R] bool (static decode only): False for a padded row
    # [R] int64 (static decode with padded rows): the position a padded row writes back unchanged,
    # one past its slot's last row in the step (no real row writes that entry)
    spare_positions: torch.Tensor | None = None
    windows: bool = False  # static decode: a slot may have several rows (verify windows)

    def static_mask(self, capacity: int, ring: bool, window: int | None) -> torch.Tensor:
        """[B, 1, 1, capacity]: which cache entries each static decode row sees (shared by layers)."""
        key = (capacity, ring, window)
        if key not in self.mask_cache:
            j = torch.arange(capacity, device=self.positions.device)[None, :]
            pos = self.positions[:, None]
            held = pos - torch.remainder(pos - j, capacity) if ring else j  # the position each entry holds
            visible = (held >= 0) & (held <= pos)
            if window is not None:
                visible &= (pos - held) < window
            self.mask_cache[key] = visible[:, None, None, :]
        return self.mask_cache[key]

    def cos_sin(self, rotary: Rotary, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = id(rotary)
        if key not in self.rope_cache:
            self.rope_cache[key] = rotary.cos_sin(self.positions, dtype)
        return self.rope_cache[key]


def _attention_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """q: [B, Hq, n, D], k: [B, Hkv, L, D], v: [B, Hkv, L, Dv], mask: [B, 1, n, L] (True = visible)."""
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    logits = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, Hq, n, L]
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    sink = sinks.to(logits.dtype)[None, :, None, None].expand(*logits.shape[:-1], 1)
    combined = torch.cat([logits, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)[..., :-1]
    return torch.matmul(probs, v)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos_start: int,
    k_pos_start: int,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of one stream's rows over its keys.

    q: [n, Hq, D] at positions q_pos_start + i; k: [L, Hkv, D], v: [L, Hkv, Dv] at positions
    k_pos_start + j. A key is visible when k_pos <= q_pos (and q_pos - k_pos < window).
    sinks: [Hq] learned logits joining each softmax (GPT-OSS). Returns [n, Hq, Dv].
    """
    n, L = q.shape[0], k.shape[0]
    # decided on the host: is every key visible to every query? (no device sync)
    full = q_pos_start >= k_pos_start + L - 1 and (window is None or q_pos_start + n - 1 - k_pos_start < window)
    mask = None
    if not full:
        q_pos = torch.arange(q_pos_start, q_pos_start + n, device=q.device)[:, None]
        k_pos = torch.arange(k_pos_start, k_pos_start + L, device=q.device)[None, :]
        mask = k_pos <= q_pos
        if window is not None:
            mask &= (q_pos - k_pos) < window
        mask = mask[None, None]
    out = _attention_core(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask, scale, sinks)
    return out[0].transpose(0, 1)


def write_static_decode(kv: LayerKV, ctx: FrameContext, new: dict[str, torch.Tensor]) -> None:
    """Store each static decode row's cache entries at (slot, position). A padded row (``ctx.valid``
    False) writes back what its slot holds one past the step's rows of that slot
    (``ctx.spare_positions``): it changes nothing, and never shares an entry with a real row (each
    padded row i reuses real row i's slot)."""
    assert ctx.slots is not None
    slots, positions, cap = ctx.slots, ctx.positions, kv.capacity
    index = positions % cap if kv.ring else positions
    if ctx.valid is not None:
        assert ctx.spare_positions is not None
        index = torch.where(ctx.valid, index, ctx.spare_positions % cap)
    for name, rows in new.items():
        if ctx.valid is not None:
            keep = ctx.valid.view(-1, *([1] * (rows.dim() - 1)))
            rows = torch.where(keep, rows, kv.tensors[name][slots, index])
        kv.tensors[name].index_put_((slots, index), rows)


def attend_static_decode(
    kv: LayerKV,
    ctx: FrameContext,
    q: torch.Tensor,
    new: dict[str, torch.Tensor],
    scale: float,
    window: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Static decode rows, fixed shapes: store every row's k/v, then attend each over its slot's
    whole capacity with a visibility mask computed on the device (up to the row's own position,
    so a verify window's rows are causal). q: [B, Hq, D] -> [B, Hq, D]."""
    assert ctx.slots is not None
    write_static_decode(kv, ctx, new)
    keys, values = kv.tensors["k"][ctx.slots], kv.tensors["v"][ctx.slots]  # [B, cap, Hkv, D]
    visible = ctx.static_mask(kv.capacity, kv.ring, window)
    out = _attention_core(q[:, :, None, :], keys.transpose(1, 2), values.transpose(1, 2), visible, scale, sinks)
    return out[:, :, 0, :]


class Attention(nn.Module):
    """Grouped-query attention with optional per-head q/k norms, biases, sliding window, sinks.

    q, k and v come from one fused projection ``qkv`` (rows: q heads, then k heads, then v heads).
    """

    static_decode = True  # runs static decode frames (ctx.segments None)

    def __init__(
        self,
        qkv: Dense,
        o_proj: Dense,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary: Rotary,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ):
        super().__init__()
        self.qkv, self.o_proj = qkv, o_proj
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.qk_norm_weight: nn.Parameter | None = None  # [Hq + Hkv, D]: q_norm's rows, then k_norm's
        self.qk_norm_eps = 0.0
        if q_norm is not None and k_norm is not None:
            weight = torch.cat([q_norm.weight.expand(num_heads, -1), k_norm.weight.expand(num_kv_heads, -1)])
            self.qk_norm_weight = nn.Parameter(weight.contiguous(), requires_grad=False)
            self.qk_norm_eps = q_norm.eps
        self.rotary = rotary
        self.window = window
        self.sinks = None if sinks is None else nn.Parameter(sinks, requires_grad=False)
        self.scale = head_dim**-0.5

    def cache_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"k": (self.num_kv_heads, self.head_dim), "v": (self.num_kv_heads, self.head_dim)}

    def forward(self, x: torch.Tensor, ctx: FrameContext, kv: LayerKV) -> torch.Tensor:
        y: torch.Tensor = self.o_proj(self.attend_projected(self.qkv(x), ctx, kv, x.dtype))
        return y

    def attend_projected(
        self, qkv: torch.Tensor, ctx: FrameContext, kv: LayerKV, dtype: torch.dtype, qk_normed: bool = False
    ) -> torch.Tensor:
        """Attention between the projections: the rows' fused q/k/v [R, (Hq + 2 Hkv) D] (with
        ``qk_normed``, q and k heads already through the q/k norms), in a layer whose activations
        are ``dtype`` -> the heads' outputs [R, Hq D], for ``o_proj``."""
        rows = qkv.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if ctx.segments is None and not qk_normed and self._fused_decode_applies(qkv, kv):
            return self._fused_decode(qkv, ctx, kv).reshape(rows, q_size)
        qk, v = qkv.split([q_size + kv_size, kv_size], dim=-1)
        # q and k heads side by side: [rows, Hq + Hkv, D], normed and rotated together
        qk = qk.reshape(rows, self.num_heads + self.num_kv_heads, self.head_dim)
        if (
            self.qk_norm_weight is not None and not qk_normed
        ):  # normalised in float32, rounded, then scaled: as the reference
            qk = self.qk_norm_weight * F.rms_norm(qk, (self.head_dim,), eps=self.qk_norm_eps)
        cos, sin = ctx.cos_sin(self.rotary, dtype)
        qk = self.rotary.apply(qk, cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = v.reshape(rows, self.num_kv_heads, self.head_dim)
        if ctx.segments is None:
            out = attend_static_decode(kv, ctx, q, {"k": k, "v": v}, self.scale, self.window, self.sinks)
        elif (
            len(ctx.segments) == 1 and ctx.segments[0].rows == rows
        ):  # one stream's rows (a batch-1 decode step): no slices, no copy back
            out = attend_with_cache(kv, ctx.segments[0], q, {"k": k, "v": v}, self.scale, self.window, self.sinks)
        else:
            out = torch.empty_like(q)
            batched = decode_rows_to_batch(ctx.segments, qkv, kv)
            if batched:  # CPU decode rows of several streams: one attention call, not one per stream
                picked = torch.tensor([seg.row_start for seg in batched])
                out[picked] = attend_decode_rows(kv, batched, q[picked], {"k": k[picked], "v": v[picked]}, self)
            for seg in ctx.segments if not batched else [s for s in ctx.segments if s.rows > 1]:
                rs = slice(seg.row_start, seg.row_end)
                out[rs] = attend_with_cache(
                    kv, seg, q[rs], {"k": k[rs], "v": v[rs]}, self.scale, self.window, self.sinks
                )
        return out.reshape(rows, q_size)

    def _fused_decode_applies(self, qkv: torch.Tensor, kv: LayerKV) -> bool:
        return not self.rotary.interleaved and decode_attention.applies(
            qkv, kv.tensors["k"], self.num_heads, self.num_kv_heads, self.head_dim
        )

    def _fused_decode(self, qkv: torch.Tensor, ctx: FrameContext, kv: LayerKV) -> torch.Tensor:
        """A static decode step's norms, RoPE, cache write and attention in one kernel
        (:mod:`.kernels.decode_attention`). -> [B, Hq, D]"""
        assert ctx.slots is not None
        cos, sin = ctx.cos_sin(self.rotary, qkv.dtype)
        norm = None if self.qk_norm_weight is None else (self.qk_norm_weight, self.qk_norm_eps)
        k_cache, v_cache = kv.tensors["k"], kv.tensors["v"]
        return decode_attention.decode_attention(
            qkv, cos, sin, norm, k_cache, v_cache, ctx.slots, ctx.positions, ctx.valid,
            self.num_heads, self.scale, kv.ring, self.window, self.sinks, ctx.windows,
        )  # fmt: skip


def decode_rows_to_batch(segments: list[Segment], x: torch.Tensor, kv: LayerKV) -> list[Segment]:
    """The one-row (decode) segments of a CPU frame's general path to attend as one batch: at least
    two, of distinct slots, over a cache kept at every position (not a ring); else none."""
    if x.device.type != "cpu" or kv.ring:
        return []
    decode = [seg for seg in segments if seg.rows == 1]
    return decode if len(decode) > 1 and len({seg.slot for seg in decode}) == len(decode) else []


def attend_decode_rows(
    kv: LayerKV,
    segments: list[Segment],
    q: torch.Tensor,
    new: dict[str, torch.Tensor],
    attn: Attention,
) -> torch.Tensor:
    """One decode row per stream: store each row's k/v, then attend every row over its slot's
    history [0, pos] at once (histories padded to the longest, the padding masked).
    q: [B, Hq, D] -> [B, Hq, D]."""
    slots = torch.tensor([seg.slot for seg in segments])
    positions = torch.tensor([seg.pos_start for seg in segments])
    for name, rows in new.items():
        kv.tensors[name].index_put_((slots, positions), rows)
    length = int(positions.max()) + 1
    keys, values = kv.tensors["k"][slots, :length], kv.tensors["v"][slots, :length]  # [B, L, Hkv, D]
    j = torch.arange(length)[None, :]
    visible = j <= positions[:, None]
    if attn.window is not None:
        visible &= (positions[:, None] - j) < attn.window
    out = _attention_core(
        q[:, :, None, :],
        keys.transpose(1, 2),
        values.transpose(1, 2),
        visible[:, None, None, :],
        attn.scale,
        attn.sinks,
    )
    return out[:, :, 0, :]


def attend_with_cache(
    kv: LayerKV,
    seg: Segment,
    q: torch.Tensor,
    new: dict[str, torch.Tensor],
    scale: float,
    window: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Store a segment's keys/values and attend its queries over the slot's visible history."""
    if not kv.ring:
        kv.write(seg.slot, seg.pos_start, new)
        past = kv.read(seg.slot, 0, seg.pos_end, new)
        k_start = 0
    else:
        # read the surviving window before this segment overwrites ring entries
        k_start = max(0, seg.pos_start - (window or kv.capacity) + 1)
        old = kv.read(seg.slot, k_start, seg.pos_start, new)
        past = {name: torch.cat([old[name], new[name]]) for name in new}
        kv.write(seg.slot, seg.pos_start, new)
    return attend(q, past["k"], past["v"], seg.pos_start, k_start, scale, window, sinks)


class GatedMLP(nn.Module):
    """Dense SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, gate: Dense, up: Dense, down: Dense):
        super().__init__()
        self.gate, self.up, self.down = gate, up, down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.down(F.silu(self.gate(x)) * self.up(x))
        return y


def silu_glu(h: torch.Tensor) -> torch.Tensor:
    """h: [T, 2I] as [gate | up] -> [T, I]."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


@dataclass(frozen=True)
class ClampedSwiGLU:
    """GPT-OSS's GLU on h = [gate | up]: (clamp(up, +-limit) + 1) * g * sigmoid(alpha * g) with
    g = min(gate, limit). A value, not a closure, so fused kernels can read alpha and limit."""

    alpha: float
    limit: float

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = h.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(self.alpha * gate))


# (token, expert) pairs up to which CUDA runs experts pair by pair (the one-row gathered kernels)
# rather than grouped by expert, by weight format: measured on an H200 at the Qwen3-30B-A3B layer
# (docs/results/grouped_moe.md); the 4-bit formats' fused one-row kernels stay ahead longer
GATHER_MAX_PAIRS = {"int4": 512, "int4_sym": 512, "mxfp4": 512}
GATHER_MAX_PAIRS_OTHERS = 128  # bf16, fp16, fp32, int8


def gathered_wins(pairs: int, format_name: str) -> bool:
    """Whether a CUDA step of ``pairs`` (token, expert) pairs over experts in ``format_name`` runs
    pair by pair rather than grouped by expert (:mod:`.kernels.grouped_moe`)."""
    return pairs <= GATHER_MAX_PAIRS.get(format_name, GATHER_MAX_PAIRS_OTHERS)


def glu_kind(activation: Callable[[torch.Tensor], torch.Tensor]) -> tuple[int, float, float] | None:
    """The GLU as the fused kernels take it, (kind, alpha, limit), or None for another activation."""
    if activation is silu_glu:
        return (grouped_moe.ACT_SILU, 1.0, 0.0)
    if isinstance(activation, ClampedSwiGLU):
        return (grouped_moe.ACT_CLAMPED_SWIGLU, activation.alpha, activation.limit)
    return None


class Experts(nn.Module):
    """A bank of E experts. gate_up: [E, 2I, H] ([gate; up] rows), down: [E, H, I]."""

    def __init__(
        self,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        gate_up_bias: torch.Tensor | None = None,
        down_bias: torch.Tensor | None = None,
        activation: Callable[[torch.Tensor], torch.Tensor] = silu_glu,
    ):
        super().__init__()
        self.gate_up = nn.Parameter(gate_up, requires_grad=False)
        self.down = nn.Parameter(down, requires_grad=False)
        self.gate_up_bias = None if gate_up_bias is None else nn.Parameter(gate_up_bias, requires_grad=False)
        self.down_bias = None if down_bias is None else nn.Parameter(down_bias, requires_grad=False)
        self.activation = activation
        self.packed: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # CPU oneDNN layout, per expert
        self.packed_nbytes = 0

    @property
    def num_experts(self) -> int:
        return len(self.packed) if self.packed is not None else int(self.gate_up.shape[0])

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gu_bias = None if self.gate_up_bias is None else self.gate_up_bias[e]
        d_bias = None if self.down_bias is None else self.down_bias[e]
        if self.packed is not None:
            gate_up, down = self.packed[e]
            h = cpu_linear.linear(x, gate_up, gu_bias)
            return cpu_linear.linear(self.activation(h), down, d_bias)
        return F.linear(self.activation(F.linear(x, self.gate_up[e], gu_bias)), self.down[e], d_bias)

    def pack_for_cpu(self) -> None:
        """Reorder every expert's weights into oneDNN's layout (bf16 on CPU); the plain stacked
        tensors are released, so memory does not grow."""
        if self.packed is not None or not cpu_linear.available(self.gate_up[0]):
            return
        self.packed = [
            (cpu_linear.pack(self.gate_up[e]), cpu_linear.pack(self.down[e])) for e in range(self.num_experts)
        ]
        self.packed_nbytes = (self.gate_up.numel() + self.down.numel()) * self.gate_up.element_size()
        self.gate_up = nn.Parameter(self.gate_up.new_empty(0), requires_grad=False)
        self.down = nn.Parameter(self.down.new_empty(0), requires_grad=False)

    def forward(self, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x: [T, H]; index, weight: [T, k] -> sum_k weight * expert_index(x): [T, H]."""
        act = glu_kind(self.activation)
        if act is not None and self._grouped_kernel_applies(x) and not gathered_wins(index.numel(), "bf16"):
            gate_up = grouped_moe.GroupedBank(grouped_moe.FMT_PLAIN, self.gate_up)
            down = grouped_moe.GroupedBank(grouped_moe.FMT_PLAIN, self.down)
            return grouped_moe.grouped_experts(x, index, weight, gate_up, down, self.gate_up_bias, self.down_bias, act)
        if use_gathered(x, index):
            return self._forward_gathered(x, index, weight)
        return self._forward_grouped(x, index, weight)

    def _grouped_kernel_applies(self, x: torch.Tensor) -> bool:
        banks = (self.gate_up, self.down)
        return grouped_moe.available(x) and all(b.dtype == x.dtype and b.dim() == 3 and b.stride(2) == 1 for b in banks)

    def _forward_gathered(self, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Few (token, expert) pairs: gather the chosen experts' weights and batch the matmuls.
        No host synchronisation, so decode steps can be queued (and graph-captured) freely."""
        tokens, top_k = index.shape
        flat = index.reshape(-1)
        if expert_gemv.available(x) and self.gate_up.stride(2) == 1 and self.down.stride(2) == 1:
            h = expert_gemv.expert_gemv(x.contiguous(), self.gate_up, flat, top_k)  # [T*k, 2I]
        else:
            xs = x.repeat_interleave(top_k, dim=0)[:, :, None]  # [T*k, H, 1]
            h = torch.bmm(self.gate_up[flat], xs)[:, :, 0]  # [T*k, 2I]
        if self.gate_up_bias is not None:
            h = h + self.gate_up_bias[flat]
        a = self.activation(h).contiguous()
        if expert_gemv.available(x) and self.down.stride(2) == 1:
            y = expert_gemv.expert_gemv(a, self.down, flat, 1)  # [T*k, H]
        else:
            y = torch.bmm(self.down[flat], a[:, :, None])[:, :, 0]  # [T*k, H]
        if self.down_bias is not None:
            y = y + self.down_bias[flat]
        return weighted_sum_of_pairs(y, weight)

    def _forward_grouped(self, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return forward_grouped(self.expert, self.num_experts, x, index, weight)


def use_gathered(x: torch.Tensor, index: torch.Tensor, format_name: str = "bf16") -> bool:
    """Whether a CUDA expert bank without a grouped kernel for x runs pair by pair (few pairs, or
    inside a graph capture, which cannot hold the host-synchronising grouped loop)."""
    return x.is_cuda and (gathered_wins(index.numel(), format_name) or torch.cuda.is_current_stream_capturing())


def weighted_sum_of_pairs(y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """y: [T*k, H] per (token, expert) pair, weight: [T, k] -> sum_k weight * y: [T, H]."""
    tokens, top_k = weight.shape
    return torch.bmm(weight.to(y.dtype)[:, None, :], y.view(tokens, top_k, -1))[:, 0]


def forward_grouped(
    expert: Callable[[int, torch.Tensor], torch.Tensor],
    num_experts: int,
    x: torch.Tensor,
    index: torch.Tensor,
    weight: torch.Tensor,
) -> torch.Tensor:
    """Sort (token, expert) pairs by expert and run each used expert once over its tokens:
    ``expert(e, rows)`` -> rows' outputs. Any bank (plain or quantized) runs through this."""
    if x.device.type == "cpu":  # fewer ops around the experts: host time is the CPU's decode cost
        return cpu_moe.grouped_cpu(expert, num_experts, x, index, weight)
    top_k = index.shape[1]
    flat = index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    token_of = order // top_k
    ys = []
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        ys.append(expert(e, x[token_of[start : start + count]]))
        start += count
    # one weighted scatter for all pairs: a per-expert index_add_ costs more than its expert on CPU
    y = torch.cat(ys) * weight.reshape(-1)[order, None].to(x.dtype)
    return torch.zeros_like(x).index_add_(0, token_of, y)


Router = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def softmax_top_k(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts, keep the top k (optionally renormalised). -> index, weight [T, k]."""
    if renormalize:
        # softmax then renormalising the top k equals a softmax over the top k logits
        if route_top_k.available(logits) and top_k & (top_k - 1) == 0:
            return route_top_k.route_top_k(logits, top_k, logits.dtype)
        top, index = torch.topk(logits, top_k, dim=-1)
        return index, torch.softmax(top, dim=-1, dtype=torch.float32).to(logits.dtype)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weight, index = torch.topk(probs, top_k, dim=-1)
    return index, weight.to(logits.dtype)


class SparseMoE(nn.Module):
    """Routed experts plus optional always-active shared experts."""

    def __init__(self, router_proj: Dense, route: Router, experts: nn.Module, shared: nn.Module | None = None):
        super().__init__()
        self.router_proj, self.experts, self.shared = router_proj, experts, shared
        self.route = route

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        index, weight = self.route(self.router_proj(x))
        out: torch.Tensor = self.experts(x, index, weight)
        if self.shared is not None:
            out = out + self.shared(x)
        return out


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then h + mlp(norm(h))."""

    def __init__(self, input_norm: RMSNorm, attention: nn.Module, post_norm: RMSNorm, mlp: nn.Module):
        super().__init__()
        self.input_norm, self.attention, self.post_norm, self.mlp = input_norm, attention, post_norm, mlp

    def forward(self, x: torch.Tensor, ctx: FrameContext, kv: LayerKV) -> torch.Tensor:
        h, normed = self.post_norm.after_add(x, self.attention(self.input_norm(x), ctx, kv))
        out: torch.Tensor = h + self.mlp(normed)
        return out
