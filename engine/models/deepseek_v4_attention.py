"""DeepSeek-V4's attention: one K=V head over a sliding window and, for the compressed kinds, pooled
blocks (:class:`Pooler`) chosen by a lightning indexer (CSA). See engine/models/deepseek_v4.py for
the design and the per-stream state it reads and writes."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import nn

from ..frame import Segment
from ..kvcache import LayerKV
from ..layers import Dense, FrameContext, RMSNorm
from ..rope import inv_freq_and_factor
from ..spec import ModelSpec, RopeSpec
from .deepseek_v4_config import rope_dim, rope_specs

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
