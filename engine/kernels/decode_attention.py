"""A static decode step's attention in one kernel: per-head q/k norms, RoPE, the cache write and
attention over the slot's cache in place.

The plain-torch static step spends about a dozen kernels per layer on this: a norm and its
scale, three for RoPE, two cache writes, two gathers of each slot's whole KV capacity (and two
more when SDPA repeats KV heads for grouped queries), a mask conversion and the attention. At
one row each costs more than its arithmetic. Here one program handles one (row, KV head): it
normalises and rotates the row's q heads of the group and its k head, stores k and v at the
row's cache entry (a padded row, ``valid`` 0, stores nothing), and attends its q heads over the
visible entries of its slot with an online softmax (and the learned sink logit, if any).

Verify windows (speculative decoding's 1 + k rows of one stream, at consecutive positions): a
row must see the entries of its window's earlier rows, which other programs write. Then the
kernel runs twice, first only writing every row's k/v, then only attending; each row attends up
to its own position (its causal limit), so a window's later entries, written already, stay
invisible to its earlier rows. A ring (sliding-window cache) keeps them correct while a window's
rows span at most ``capacity - window + 1`` positions: a later row's entry then never replaces
one an earlier row still sees (:func:`~engine.static_decode.rows_per_stream_limit`).

Rounding follows the torch path: the norm is computed in float32 and rounded to the
activations' dtype, then scaled and rounded; RoPE rounds x * cos, then adds the rotated half
times sin in float32 and rounds once (as ``addcmul``); probabilities are rounded to the dtype
before the product with v, as flash attention does.

Shapes: qkv: [B, (Hq + 2 Hkv) * D] (q heads, k heads, v heads); cos, sin: [B, 1, D] (sin
sign-folded, :class:`~engine.rope.Rotary`); k/v caches: [slots, capacity, Hkv, D]; slots,
positions: [B] int64; valid: [B] bool or None. Returns [B, Hq, D].
"""

from __future__ import annotations

import torch

from .expert_gemv import HAVE_TRITON

MAX_GROUP = 64  # q heads per KV head one program holds
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _norm_rope(ptr, heads, hmask, offs_d, swap_d, D: tl.constexpr, EPS, norm_ptr, cos, sin, HAS_NORM: tl.constexpr):
        """Rows ``heads`` ([G]) of the head-major row at ``ptr``, normed (optionally) and rotated."""
        x = tl.load(ptr + heads[:, None] * D + offs_d[None, :], mask=hmask[:, None], other=0.0)
        xs = tl.load(ptr + heads[:, None] * D + swap_d[None, :], mask=hmask[:, None], other=0.0)
        dtype = x.dtype
        if HAS_NORM:
            xf = x.to(tl.float32)
            r = tl.rsqrt(tl.sum(xf * xf, axis=1) / D + EPS)[:, None]
            w = tl.load(norm_ptr + heads[:, None] * D + offs_d[None, :], mask=hmask[:, None], other=0.0)
            ws = tl.load(norm_ptr + heads[:, None] * D + swap_d[None, :], mask=hmask[:, None], other=0.0)
            x = (w.to(tl.float32) * (xf * r).to(dtype).to(tl.float32)).to(dtype)
            xs = (ws.to(tl.float32) * (xs.to(tl.float32) * r).to(dtype).to(tl.float32)).to(dtype)
        rotated = (x.to(tl.float32) * cos[None, :]).to(dtype).to(tl.float32) + xs.to(tl.float32) * sin[None, :]
        return rotated.to(dtype)

    @triton.jit
    def _decode_attention_kernel(
        qkv_ptr, qkv_stride, cos_ptr, sin_ptr, cs_stride, norm_ptr, EPS,
        k_ptr, v_ptr, c_slot, c_pos, slots_ptr, pos_ptr, valid_ptr, sinks_ptr, out_ptr,
        SCALE, CAP, WINDOW,
        HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
        BLOCK_N: tl.constexpr, HAS_NORM: tl.constexpr, HAS_VALID: tl.constexpr, HAS_SINKS: tl.constexpr,
        RING: tl.constexpr, HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr, WRITE: tl.constexpr, ATTEND: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        g = tl.program_id(1)
        slot = tl.load(slots_ptr + b)
        pos = tl.load(pos_ptr + b)
        offs_d = tl.arange(0, D)
        swap_d = (offs_d + D // 2) % D
        cos = tl.load(cos_ptr + b * cs_stride + offs_d).to(tl.float32)
        sin = tl.load(sin_ptr + b * cs_stride + offs_d).to(tl.float32)
        row = qkv_ptr + b * qkv_stride
        cache_k = k_ptr + slot * c_slot + g * D
        cache_v = v_ptr + slot * c_slot + g * D
        gi = tl.arange(0, GP)
        qmask = gi < G
        if ATTEND:
            q = _norm_rope(row, g * G + gi, qmask, offs_d, swap_d, D, EPS, norm_ptr, cos, sin, HAS_NORM)
        if WRITE:
            one = tl.arange(0, 1)
            k_new = _norm_rope(row, HQ + g + one, one < 1, offs_d, swap_d, D, EPS, norm_ptr, cos, sin, HAS_NORM)
            v_new = tl.load(row + (HQ + HKV + g) * D + offs_d)
            entry = pos % CAP if RING else pos
            store = offs_d < D
            if HAS_VALID:
                store = store & (tl.load(valid_ptr + b) != 0)
            tl.store(cache_k + entry * c_pos + offs_d[None, :], k_new, mask=store[None, :])
            tl.store(cache_v + entry * c_pos + offs_d, v_new, mask=store)
            if ATTEND:
                tl.debug_barrier()  # this program's stores are visible to all its threads
        if ATTEND:
            _attend(
                q, gi, qmask, cache_k, cache_v, c_pos, pos, sinks_ptr, out_ptr + b * HQ * D, g, SCALE, CAP, WINDOW,
                offs_d, D, G, GP, BLOCK_N, HAS_SINKS, RING, HAS_WINDOW, IEEE,
            )  # fmt: skip

    @triton.jit
    def _attend(
        q, gi, qmask, cache_k, cache_v, c_pos, pos, sinks_ptr, out_ptr, g, SCALE, CAP, WINDOW, offs_d,
        D: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SINKS: tl.constexpr,
        RING: tl.constexpr, HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        """The row's q heads ``q`` ([GP, D], of KV group ``g``) over the visible entries of its slot's
        cache (held positions up to ``pos``, inside the window), written to ``out_ptr`` ([Hq, D])."""
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + g * G + gi, mask=qmask, other=0.0)
            m_i = sink.to(q.dtype).to(tl.float32)  # rounded to the activations' dtype, as the torch path
            l_i = tl.full((GP,), 1.0, tl.float32)
        else:
            m_i = tl.full((GP,), -1.0e30, tl.float32)
            l_i = tl.zeros((GP,), tl.float32)
        acc = tl.zeros((GP, D), tl.float32)
        start = pos * 0
        end = pos + 1
        if RING:
            end = start + CAP
        elif HAS_WINDOW:
            start = tl.maximum(pos - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
        for n0 in range(start, end, BLOCK_N):
            j = n0 + tl.arange(0, BLOCK_N)
            inside = j < end
            k = tl.load(cache_k + j[:, None] * c_pos + offs_d[None, :], mask=inside[:, None], other=0.0)
            v = tl.load(cache_v + j[:, None] * c_pos + offs_d[None, :], mask=inside[:, None], other=0.0)
            held = j  # the position each entry holds
            if RING:
                held = pos - ((pos - j) % CAP + CAP) % CAP
            visible = inside & (held >= 0) & (held <= pos)
            if HAS_WINDOW:
                visible &= (pos - held) < WINDOW
            s = tl.dot(q, tl.trans(k), input_precision="ieee") if IEEE else tl.dot(q, tl.trans(k))
            s = tl.where(visible[None, :], s * SCALE, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee") if IEEE else tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        out = acc / l_i[:, None]
        heads = g * G + gi
        tl.store(out_ptr + heads[:, None] * D + offs_d[None, :], out.to(q.dtype), mask=qmask[:, None])


def applies(qkv: torch.Tensor, cache: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the fused kernel runs this step: CUDA, a power-of-two head size, the cache in the
    activations' dtype, at most :data:`MAX_GROUP` q heads per KV head."""
    return (
        HAVE_TRITON
        and qkv.is_cuda
        and qkv.dtype in DTYPES
        and cache.dtype == qkv.dtype
        and head_dim & (head_dim - 1) == 0
        and 16 <= head_dim <= 256
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= MAX_GROUP
    )


def decode_attention(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    qk_norm: tuple[torch.Tensor, float] | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    valid: torch.Tensor | None,
    num_heads: int,
    scale: float,
    ring: bool,
    window: int | None,
    sinks: torch.Tensor | None,
    windows: bool = False,
) -> torch.Tensor:
    """Write each row's k/v and attend over its slot (module docstring). ``windows``: a slot may
    have several rows (at consecutive positions, a verify window), so every row's k/v is written
    (one launch) before any row attends (a second launch); else one launch does both per row."""
    rows = qkv.shape[0]
    slot_count, capacity, num_kv_heads, head_dim = k_cache.shape
    qkv = qkv if qkv.stride(1) == 1 else qkv.contiguous()
    cos, sin = cos.reshape(rows, head_dim), sin.reshape(rows, head_dim)
    assert cos.stride(1) == 1 and sin.stride(1) == 1 and cos.stride(0) == sin.stride(0)
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    group = num_heads // num_kv_heads
    out = torch.empty((rows, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    norm_weight, eps = qk_norm if qk_norm is not None else (qkv, 0.0)
    for write, attend in ((True, False), (False, True)) if windows else ((True, True),):
        _decode_attention_kernel[(rows, num_kv_heads)](
            qkv, qkv.stride(0), cos, sin, cos.stride(0), norm_weight, eps,
            k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), slots, positions,
            valid if valid is not None else slots, sinks if sinks is not None else qkv, out,
            scale, capacity, window or 0,
            HQ=num_heads, HKV=num_kv_heads, D=head_dim, G=group, GP=max(16, triton.next_power_of_2(group)),
            BLOCK_N=32 if head_dim > 128 else 64, HAS_NORM=qk_norm is not None, HAS_VALID=valid is not None,
            HAS_SINKS=sinks is not None, RING=ring, HAS_WINDOW=window is not None, IEEE=qkv.dtype == torch.float32,
            WRITE=write, ATTEND=attend, num_warps=4,
        )  # fmt: skip
    return out
