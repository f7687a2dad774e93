"""Grouped expert execution on CUDA for any number of rows, with no host synchronisation.

A step's (token, expert) pairs are sorted by expert on the device and each expert's run is padded
to a multiple of BLOCK_M (:func:`align_pairs`, in the style of vLLM's ``moe_align_block_size``);
then one Triton launch per projection multiplies every block of BLOCK_M pairs by its expert's
weights (:func:`grouped_matmul`, in the style of vLLM/SGLang's ``fused_moe``). Every size is fixed
by the pair count, so the step can be captured in a CUDA graph; blocks past the used ones exit
without reading weights.

Weights are read in their stored format and decoded inside the kernel (:class:`GroupedBank`):

- ``plain``: [E, N, K] in the activations' dtype.
- ``int8``: int8 codes [E, N, K], float32 scales [E, N] (applied once, after the K loop).
- ``int4``: uint8 codes [E, N, K/2] in nibble-major order (``formats.base.to_nibble_major``), fp16
  scales and uint8 zero points [E, N, K/32] (no zero points: 8); q - z, an integer in [-15, 15].
- ``mxfp4``: the same code order, E2M1 codes as twice their value (integers up to 12, signed),
  uint8 E8M0 scales [E, N, K/32].

Decoded codes are small integers, exact in bf16/fp16, so the tensor-core products are exact up to
float32 accumulation and each group's scale multiplies its partial sum: the result agrees with the
exact decode followed by a float32 matmul up to the rounding of the output. The order of inputs
inside a group does not matter to a dot product, so a group's 16 code bytes are read in storage
order (low nibbles, then high nibbles) and the activations are gathered in the matching order.

The first projection may fuse the GLU: output column n is act(gate_n, up_n) from weight rows n and
n + N (ACT 1: SiLU; ACT 2: GPT-OSS's clamped SwiGLU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:  # triton ships with CUDA builds of torch; CPU machines have none
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the machine
    HAVE_TRITON = False

FMT_PLAIN, FMT_INT8, FMT_INT4, FMT_MXFP4 = 0, 1, 2, 3
ACT_NONE, ACT_SILU, ACT_CLAMPED_SWIGLU = 0, 1, 2


@dataclass(frozen=True)
class GroupedBank:
    """An expert bank as :func:`grouped_matmul` reads it (layouts in the module docstring)."""

    fmt: int
    data: torch.Tensor
    scales: torch.Tensor | None = None
    zeros: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return int(self.data.shape[1])

    @property
    def in_features(self) -> int:
        packed = self.fmt in (FMT_INT4, FMT_MXFP4)
        return int(self.data.shape[2]) * (2 if packed else 1)


@dataclass(frozen=True)
class Alignment:
    """Pairs sorted by expert, each expert's run padded to a multiple of ``block_m``.

    sorted_pairs: int64 [blocks * block_m], a pair index or ``pairs`` (padding);
    block_expert: int64 [blocks], the block's expert or -1 (a block past the used ones)."""

    sorted_pairs: torch.Tensor
    block_expert: torch.Tensor
    pairs: int
    block_m: int


def block_m_for(pairs: int, num_experts: int) -> int:
    """Rows per block: about the pairs an active expert holds, at least 16 (tensor-core tiles)."""
    per_expert = pairs / max(1, min(num_experts, pairs))
    return 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64


def align_pairs(flat: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """flat: int64 [P] expert per pair -> the pairs grouped by expert (device ops only)."""
    pairs = flat.numel()
    blocks = triton_cdiv(pairs + min(num_experts, pairs) * (block_m - 1), block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    run_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)  # sorted position -> pair
    expert_of = flat[order]
    dest = padded_end[expert_of] - padded[expert_of] + torch.arange(pairs, device=flat.device) - run_start[expert_of]
    sorted_pairs = torch.full((blocks * block_m,), pairs, dtype=torch.int64, device=flat.device)
    sorted_pairs[dest] = order
    first_row = torch.arange(blocks, device=flat.device) * block_m
    block_expert = torch.searchsorted(padded_end, first_row, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return Alignment(sorted_pairs, block_expert, pairs, block_m)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


if HAVE_TRITON:

    @triton.jit
    def _nibble_tiles(w_base, g, offs_n, n_ok, stride_wn, FMT: tl.constexpr):
        """Group g's codes of the rows offs_n as two [16, BN] integer tiles (low, high nibbles),
        decoded to integers: int4 the raw code, MXFP4 twice the signed E2M1 value."""
        b = tl.arange(0, 16)
        codes = tl.load(w_base + offs_n[None, :] * stride_wn + g * 16 + b[:, None], mask=n_ok[None, :], other=0)
        codes = codes.to(tl.int32)
        lo = codes & 0xF
        hi = (codes >> 4) & 0xF
        if FMT == 3:
            lo = _e2m1_twice(lo)
            hi = _e2m1_twice(hi)
        return lo, hi

    @triton.jit
    def _e2m1_twice(c):
        """An E2M1 code's value times two, as an integer: magnitudes 0, 1, 2, 3, 4, 6, 8, 12."""
        e = (c >> 1) & 3
        m = c & 1
        mag = tl.where(e == 0, m, (2 + m) << tl.maximum(e - 1, 0))
        return tl.where((c & 8) != 0, -mag, mag)

    @triton.jit
    def _group_scale(s_base, z_base, g, offs_n, n_ok, stride_sn, stride_zn, FMT: tl.constexpr, HAS_ZEROS: tl.constexpr):
        """Group g's scale [BN] as float32 (MXFP4: 2^(e-127) / 2, undoing the doubled codes) and
        zero point [BN] (int4; 8 without stored zero points)."""
        s = tl.load(s_base + offs_n * stride_sn + g, mask=n_ok, other=0)
        if FMT == 3:
            e = s.to(tl.int32)
            scale = tl.where(e == 0, 0x00400000, e << 23).to(tl.float32, bitcast=True) * 0.5
        else:
            scale = s.to(tl.float32)
        if HAS_ZEROS:
            zero = tl.load(z_base + offs_n * stride_zn + g, mask=n_ok, other=8).to(tl.int32)
        else:
            zero = offs_n * 0 + 8
        return scale, zero

    @triton.jit
    def _project(
        a_ptr, rows, m_ok, stride_am, w_base, s_base, z_base, offs_n, n_ok, k_end,
        K, stride_wn, stride_sn, stride_zn,
        FMT: tl.constexpr, HAS_ZEROS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """[BM, BN] float32: the rows' activations times the weight rows offs_n, over K."""
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        a_rows = a_ptr + rows[:, None] * stride_am
        if FMT == 2 or FMT == 3:
            b = tl.arange(0, 16)
            k_lo = 8 * (b % 4) + b // 4  # input of byte b's low nibble in nibble-major order; high: + 4
            for g in range(0, k_end // 32):
                lo, hi = _nibble_tiles(w_base, g, offs_n, n_ok, stride_wn, FMT)
                scale, zero = _group_scale(s_base, z_base, g, offs_n, n_ok, stride_sn, stride_zn, FMT, HAS_ZEROS)
                if FMT == 2:
                    lo = lo - zero[None, :]
                    hi = hi - zero[None, :]
                x_lo = tl.load(a_rows + g * 32 + k_lo[None, :], mask=m_ok[:, None], other=0.0)
                x_hi = tl.load(a_rows + g * 32 + k_lo[None, :] + 4, mask=m_ok[:, None], other=0.0)
                part = _dot(x_lo, lo.to(x_lo.dtype), IEEE) + _dot(x_hi, hi.to(x_hi.dtype), IEEE)
                acc += part * scale[None, :]
        else:
            for k0 in range(0, k_end, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                k_ok = offs_k < K
                x = tl.load(a_rows + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(
                    w_base + offs_n[None, :] * stride_wn + offs_k[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0
                )
                acc += _dot(x, w.to(x.dtype), IEEE)
            if FMT == 1:
                acc *= tl.load(s_base + offs_n * stride_sn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        return acc

    @triton.jit
    def _dot(x, w, IEEE: tl.constexpr):
        if IEEE:
            return tl.dot(x, w, input_precision="ieee")
        return tl.dot(x, w)

    @triton.jit
    def _grouped_kernel(
        a_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, pairs_ptr, block_expert_ptr, out_ptr,
        N, K, num_pairs, alpha, limit,
        stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_ze, stride_zn, stride_be, stride_om,
        ROW_DIV: tl.constexpr, FMT: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
        HAS_ZEROS: tl.constexpr, IEEE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """out[p, n] = act(a[p // ROW_DIV] @ W[e(p)][n (, n + N)].T + bias) for the pairs of one
        block (one expert) and BLOCK_N output columns."""
        block, block_n = tl.program_id(0), tl.program_id(1)
        expert = tl.load(block_expert_ptr + block)
        k_end = tl.where(expert >= 0, K, 0)  # a block past the used ones reads nothing
        expert = tl.maximum(expert, 0).to(tl.int64)
        pair = tl.load(pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
        m_ok = pair < num_pairs
        rows = tl.where(m_ok, pair // ROW_DIV, 0)
        offs_n = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        w_base = w_ptr + expert * stride_we
        s_base = s_ptr + expert * stride_se
        z_base = z_ptr + expert * stride_ze
        y = _project(a_ptr, rows, m_ok, stride_am, w_base, s_base, z_base, offs_n, n_ok, k_end, K,
                     stride_wn, stride_sn, stride_zn, FMT, HAS_ZEROS, IEEE, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
        if HAS_BIAS:
            y += tl.load(bias_ptr + expert * stride_be + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if ACT != 0:
            up_n = offs_n + N
            up = _project(a_ptr, rows, m_ok, stride_am, w_base, s_base, z_base, up_n, n_ok, k_end, K,
                          stride_wn, stride_sn, stride_zn, FMT, HAS_ZEROS, IEEE, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
            if HAS_BIAS:
                up += tl.load(bias_ptr + expert * stride_be + up_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            if ACT == 1:
                y = y * tl.sigmoid(y) * up
            else:
                gate = tl.minimum(y, limit)
                up = tl.minimum(tl.maximum(up, -limit), limit)
                y = (up + 1.0) * gate * tl.sigmoid(alpha * gate)
        out = out_ptr + pair[:, None] * stride_om + offs_n[None, :]
        tl.store(out, y.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def available(x: torch.Tensor) -> bool:
    return HAVE_TRITON and x.is_cuda


def grouped_matmul(
    a: torch.Tensor,
    bank: GroupedBank,
    alignment: Alignment,
    row_div: int,
    bias: torch.Tensor | None = None,
    act: tuple[int, float, float] = (ACT_NONE, 1.0, 0.0),
) -> torch.Tensor:
    """out[p] = a[p // row_div] @ W[e(p)].T + bias[e(p)] for every pair p of ``alignment``: [P, N]
    in a's dtype, N = the bank's rows; with an activation (kind, alpha, limit) the bank's rows are
    [gate; up] and out[p] = act(gate, up): [P, rows / 2]."""
    if bank.fmt in (FMT_INT4, FMT_MXFP4) and bank.in_features % 32:
        raise ValueError(f"a packed expert bank needs in_features % 32 == 0, got {bank.in_features}")
    a = a.contiguous()
    n = bank.rows // 2 if act[0] != ACT_NONE else bank.rows
    out = torch.empty((alignment.pairs, n), dtype=a.dtype, device=a.device)
    scales = bank.scales if bank.scales is not None else bank.data
    zeros = bank.zeros if bank.zeros is not None else scales
    bias_t = bias if bias is not None else scales
    block_n = 32 if n <= 256 else 64
    blocks = alignment.block_expert.numel()
    _grouped_kernel[(blocks, triton.cdiv(n, block_n))](
        a, bank.data, scales, zeros, bias_t, alignment.sorted_pairs, alignment.block_expert, out,
        n, bank.in_features, alignment.pairs, act[1], act[2],
        a.stride(0), bank.data.stride(0), bank.data.stride(1), scales.stride(0), _row_stride(scales),
        zeros.stride(0), _row_stride(zeros), bias_t.stride(0) if bias is not None else 0, out.stride(0),
        ROW_DIV=row_div, FMT=bank.fmt, ACT=act[0], HAS_BIAS=bias is not None, HAS_ZEROS=bank.zeros is not None,
        IEEE=a.dtype == torch.float32, BLOCK_M=alignment.block_m, BLOCK_N=block_n, BLOCK_K=64,
        num_warps=4,
    )  # fmt: skip
    return out


def _row_stride(t: torch.Tensor) -> int:
    return t.stride(1) if t.dim() > 1 else 0


def grouped_experts(
    x: torch.Tensor,
    index: torch.Tensor,
    weight: torch.Tensor,
    gate_up: GroupedBank,
    down: GroupedBank,
    gate_up_bias: torch.Tensor | None,
    down_bias: torch.Tensor | None,
    act: tuple[int, float, float],
) -> torch.Tensor:
    """x [T, H], index and weight [T, k] -> sum_k weight * down(act(gate_up(x))): [T, H], two
    grouped launches sharing one alignment."""
    tokens, top_k = index.shape
    flat = index.reshape(-1).to(torch.int64)
    num_experts = int(gate_up.data.shape[0])
    alignment = align_pairs(flat, num_experts, block_m_for(flat.numel(), num_experts))
    h = grouped_matmul(x, gate_up, alignment, top_k, gate_up_bias, act)
    y = grouped_matmul(h, down, alignment, 1, down_bias)
    return torch.bmm(weight.to(y.dtype)[:, None, :], y.view(tokens, top_k, -1))[:, 0]
