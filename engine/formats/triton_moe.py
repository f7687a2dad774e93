"""Fused Triton kernels for a decode step of a quantized MoE bank: two launches per step.

- ``moe_up``: for each (token, expert) pair p and a block of intermediate rows n, the gate row n
  and the up row n + I of expert index[p], both dotted with x[p // top_k], then the bias and the
  GLU activation, stored as the pair's activation a[p, n] in x's dtype.
- ``moe_down``: for each token t and a block of output rows, the sum over its top_k pairs of
  weight[t, k] * (a[p] @ W_down[index[p]].T + bias), stored as out[t] in x's dtype.

No float32 scratch buffers, memsets, conversions or separate activation and sum kernels: what
the layer needs from the two matmuls comes out of their epilogues.

Layout: a program is one warp on one row at a time (ROWS rows per program, autotuned), so every
tensor shares one [CHUNK groups, 4 words] layout and nothing moves through shared memory. Codes
are held in nibble-major order (``base.to_nibble_major``, built once when a bank is prepared
for CUDA; the same bytes): nibble i of 32-bit word t of a group holds input 4i + t, so the
inputs under nibble i of a lane's four words are four consecutive values (one 8-byte load).

Decoding without integer-to-float conversions (they run at a fraction of the FMA rate and bounded
the per-matmul kernels of :mod:`.triton_kernels`): a shift puts nibbles 2i and 2i + 1 of a word
at float32 mantissa bits 15..18 and 19..22; or-ing the exponent of 1.0 (a kernel argument, so
it is one bit operation) makes each a float equal to 1 + q / 256 or 1 + q / 16, exactly. So per
group

    sum_j q_j x_j = 256 (sum_even (1 + q/256) x - sum_even x) + 16 (sum_odd (1 + q/16) x - sum_odd x)

costs one shift per two nibbles, one bit operation and one FMA per nibble. The cancellation
costs about 8 of float32's 24 bits on the even half: relative error ~1e-5 of the group's
|x|-sum, far below a bf16 result's 4e-3, so these kernels serve bf16 and fp16 activations;
float32 activations keep the exact per-matmul kernels.

MXFP4 (E2M1 codes, E8M0 scale per 32): the magnitude bits m (3) go to float32 bits 22..24
under exponent 124, giving f = 2^(e-3) (1 + m/2) for m = 2e + mantissa; min(f, 2f - 1/4) is
then exactly |value| / 4 for every code (e = 0 included: 0 and 1/8), the sign bit flips x,
and the 4 joins the E8M0 scale.

Guarantees: results within the bf16 tolerance of exact decode followed by a float32 matmul;
tested on a GPU and in triton's interpreter, never on the CPU-only CI. Measured (H200, Qwen3-30B-
A3B layer, one row): 27% of copy bandwidth for int4, 21% for MXFP4 (``benchmarks/formats.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
import triton.testing

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# MODELFLEET_TRITON_TUNE=0: a fixed configuration, no autotuning (fast start: tests, short runs)
TUNED = not INTERPRETED and os.environ.get("MODELFLEET_TRITON_TUNE", "1") != "0"

ACT_SILU, ACT_CLAMPED_SWIGLU = 1, 2


@dataclass(frozen=True)
class PackedBank:
    """One expert bank as the kernels read it: codes uint8 [E, N, K/2] (int4 nibbles or MXFP4
    blocks flattened), scales [E, N, K/32] (fp16 for int4, E8M0 bytes for MXFP4), zero points
    uint8 [E, N, K/32] or None (int4_sym: 8; MXFP4: none)."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    mxfp4: bool

    @property
    def rows(self) -> int:
        return self.codes.shape[1]

    @property
    def in_features(self) -> int:
        return self.codes.shape[2] * 2


@dataclass(frozen=True)
class Activation:
    """The GLU applied to [gate | up]: ACT_SILU silu(g) * u; ACT_CLAMPED_SWIGLU GPT-OSS's
    (clamp(u, +-limit) + 1) * g' * sigmoid(alpha g'), g' = min(g, limit)."""

    kind: int
    alpha: float = 1.0
    limit: float = 0.0


@triton.jit
def _x_tiles(x_row, g, g_mask):
    """The inputs of groups g as 8 float32 [CHUNK, 4] tiles, tile i = input 4i + t of word t."""
    at = x_row + g[:, None] * 32 + tl.arange(0, 4)[None, :]
    m = g_mask[:, None]
    return (
        tl.load(at, mask=m, other=0.0).to(tl.float32),
        tl.load(at + 4, mask=m, other=0.0).to(tl.float32),
        tl.load(at + 8, mask=m, other=0.0).to(tl.float32),
        tl.load(at + 12, mask=m, other=0.0).to(tl.float32),
        tl.load(at + 16, mask=m, other=0.0).to(tl.float32),
        tl.load(at + 20, mask=m, other=0.0).to(tl.float32),
        tl.load(at + 24, mask=m, other=0.0).to(tl.float32),
        tl.load(at + 28, mask=m, other=0.0).to(tl.float32),
    )


@triton.jit
def _row_dot(
    xs, x_lo, x_hi, words_row, scales_row, zeros_row, g, g_mask, magic,
    HAS_ZEROS: tl.constexpr, MXFP4: tl.constexpr,
):  # fmt: skip
    """sum over groups g of W[row, group] . x[group]: a float32 scalar. words_row, scales_row and
    zeros_row point at one row (masked rows pass an all-false g_mask)."""
    words = tl.load(words_row + g[:, None] * 4 + tl.arange(0, 4)[None, :], mask=g_mask[:, None], other=0)
    if MXFP4:
        acc = tl.zeros(words.shape, dtype=tl.float32)
        for i in tl.static_range(8):  # nibble i (bits 4i..4i+3): magnitude to bits 22..24, sign to 31
            m = words << (22 - 4 * i) if i < 6 else words >> (4 * i - 22)
            f = ((m & 0x01C00000) | magic).to(tl.float32, bitcast=True)
            quarter = tl.minimum(f, 2.0 * f - 0.25)  # |E2M1 value| / 4, exactly
            signed_x = xs[i].to(tl.int32, bitcast=True) ^ ((words << (28 - 4 * i)) & -2147483648)
            acc += quarter * signed_x.to(tl.float32, bitcast=True)
        e = tl.load(scales_row + g, mask=g_mask, other=127).to(tl.int32)
        bits = tl.where(e == 0, 0x00400000, e << 23)  # 2^(e-127) as float32 bits; e = 0 is subnormal
        return tl.sum(tl.sum(acc, axis=1) * bits.to(tl.float32, bitcast=True)) * 4.0
    acc_lo = tl.zeros(words.shape, dtype=tl.float32)  # sum (1 + q/256) x over even nibbles
    acc_hi = tl.zeros(words.shape, dtype=tl.float32)  # sum (1 + q/16) x over odd nibbles
    for i in tl.static_range(4):  # nibbles 2i (bits 8i..8i+3) and 2i + 1 to bits 15..18 and 19..22
        s = words << (15 - 8 * i) if i < 2 else words >> (8 * i - 15)
        acc_lo += ((s & 0x00078000) | magic).to(tl.float32, bitcast=True) * xs[2 * i]
        acc_hi += ((s & 0x00780000) | magic).to(tl.float32, bitcast=True) * xs[2 * i + 1]
    qx = 256.0 * (tl.sum(acc_lo, axis=1) - x_lo) + 16.0 * (tl.sum(acc_hi, axis=1) - x_hi)
    z = tl.load(zeros_row + g, mask=g_mask, other=8).to(tl.float32) if HAS_ZEROS else 8.0
    qx -= z * (x_lo + x_hi)
    return tl.sum(qx * tl.load(scales_row + g, mask=g_mask, other=0.0).to(tl.float32))


@triton.jit
def _x_sums(xs):
    """Per group: the sums of the inputs under even and under odd nibbles, float32 [CHUNK]."""
    return (
        tl.sum(xs[0] + xs[2] + xs[4] + xs[6], axis=1),
        tl.sum(xs[1] + xs[3] + xs[5] + xs[7], axis=1),
    )


@triton.jit
def _moe_up_kernel(
    x_ptr, codes_ptr, scales_ptr, zeros_ptr, index_ptr, bias_ptr, out_ptr,
    I, alpha, limit, magic,
    stride_xm, stride_ce, stride_cn, stride_se, stride_sn, stride_ze, stride_zn, stride_be, stride_om,
    TOP_K: tl.constexpr, NUM_GROUPS: tl.constexpr, HAS_ZEROS: tl.constexpr, MXFP4: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, CHUNK: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    pair, block = tl.program_id(0), tl.program_id(1)
    expert = tl.load(index_ptr + pair).to(tl.int64)
    x_row = x_ptr + (pair // TOP_K) * stride_xm
    codes = codes_ptr + expert * stride_ce
    scales = scales_ptr + expert * stride_se
    zeros = zeros_ptr + expert * stride_ze
    rn = block * ROWS + tl.arange(0, ROWS)
    gate = tl.zeros((ROWS,), dtype=tl.float32)
    up = tl.zeros((ROWS,), dtype=tl.float32)
    for g0 in tl.static_range(0, NUM_GROUPS, CHUNK):
        g = g0 + tl.arange(0, CHUNK)
        g_mask = g < NUM_GROUPS
        xs = _x_tiles(x_row, g, g_mask)
        x_lo, x_hi = _x_sums(xs)
        for r in tl.static_range(ROWS):
            n = block * ROWS + r
            m = g_mask & (n < I)
            gate_r = _row_dot(
                xs, x_lo, x_hi, codes + n * stride_cn, scales + n * stride_sn, zeros + n * stride_zn,
                g, m, magic, HAS_ZEROS, MXFP4,
            )  # fmt: skip
            up_r = _row_dot(
                xs, x_lo, x_hi, codes + (n + I) * stride_cn, scales + (n + I) * stride_sn,
                zeros + (n + I) * stride_zn, g, m, magic, HAS_ZEROS, MXFP4,
            )  # fmt: skip
            gate = tl.where(rn == n, gate + gate_r, gate)
            up = tl.where(rn == n, up + up_r, up)
    n_mask = rn < I
    if HAS_BIAS:
        gate += tl.load(bias_ptr + expert * stride_be + rn, mask=n_mask, other=0.0).to(tl.float32)
        up += tl.load(bias_ptr + expert * stride_be + I + rn, mask=n_mask, other=0.0).to(tl.float32)
    if ACT == 1:
        a = gate * tl.sigmoid(gate) * up
    else:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        a = (up + 1.0) * gate * tl.sigmoid(alpha * gate)
    tl.store(out_ptr + pair * stride_om + rn, a.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _moe_down_kernel(
    a_ptr, codes_ptr, scales_ptr, zeros_ptr, index_ptr, weight_ptr, bias_ptr, out_ptr,
    N, magic,
    stride_am, stride_ce, stride_cn, stride_se, stride_sn, stride_ze, stride_zn, stride_be, stride_wt, stride_om,
    TOP_K: tl.constexpr, NUM_GROUPS: tl.constexpr, HAS_ZEROS: tl.constexpr, MXFP4: tl.constexpr,
    HAS_BIAS: tl.constexpr, CHUNK: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    token, block = tl.program_id(0), tl.program_id(1)
    rn = block * ROWS + tl.arange(0, ROWS)
    n_mask = rn < N
    out = tl.zeros((ROWS,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        pair = token * TOP_K + k
        expert = tl.load(index_ptr + pair).to(tl.int64)
        codes = codes_ptr + expert * stride_ce
        scales = scales_ptr + expert * stride_se
        zeros = zeros_ptr + expert * stride_ze
        y = tl.zeros((ROWS,), dtype=tl.float32)
        for g0 in tl.static_range(0, NUM_GROUPS, CHUNK):
            g = g0 + tl.arange(0, CHUNK)
            g_mask = g < NUM_GROUPS
            xs = _x_tiles(a_ptr + pair * stride_am, g, g_mask)
            x_lo, x_hi = _x_sums(xs)
            for r in tl.static_range(ROWS):
                n = block * ROWS + r
                y_r = _row_dot(
                    xs, x_lo, x_hi, codes + n * stride_cn, scales + n * stride_sn, zeros + n * stride_zn,
                    g, g_mask & (n < N), magic, HAS_ZEROS, MXFP4,
                )  # fmt: skip
                y = tl.where(rn == n, y + y_r, y)
        if HAS_BIAS:
            y += tl.load(bias_ptr + expert * stride_be + rn, mask=n_mask, other=0.0).to(tl.float32)
        out += tl.load(weight_ptr + token * stride_wt + k).to(tl.float32) * y
    tl.store(out_ptr + token * stride_om + rn, out.to(out_ptr.dtype.element_ty), mask=n_mask)


_CONFIGS = [triton.Config({"ROWS": r}, num_warps=1) for r in (1, 2, 4)]  # one warp: no cross-warp sums
MAX_CHUNK = 64  # groups per load: 1 KB of codes per row


def _quick_bench(fn, quantiles):  # type: ignore[no-untyped-def]
    """The autotuners' timer: a few ms per configuration rather than triton's default 125 ms."""
    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


def _tuned(kernel, key: list[str]):  # type: ignore[no-untyped-def]
    if not TUNED:
        return kernel
    return triton.autotune(_CONFIGS, key=key, do_bench=_quick_bench)(kernel)


_up = _tuned(_moe_up_kernel, ["I", "TOP_K", "NUM_GROUPS", "HAS_ZEROS", "MXFP4", "HAS_BIAS", "ACT"])
_down = _tuned(_moe_down_kernel, ["N", "TOP_K", "NUM_GROUPS", "HAS_ZEROS", "MXFP4", "HAS_BIAS"])
_FIXED = {"ROWS": 2} if INTERPRETED else {} if TUNED else {"ROWS": 1, "num_warps": 1}


def _words(bank: PackedBank) -> torch.Tensor:
    codes = bank.codes
    if codes.stride(-1) != 1 or codes.shape[-1] % 4 or codes.data_ptr() % 16 or codes.stride(1) % 4:
        codes = codes.contiguous()
    return codes.view(torch.int32)


def _magic(bank: PackedBank) -> int:
    """The exponent bits or-ed onto shifted codes (a kernel argument, so it sits in a register
    and each decode is one bit operation, not two with immediates)."""
    return 0x3E000000 if bank.mxfp4 else 0x3F800000


def _chunk(bank: PackedBank) -> int:
    return min(MAX_CHUNK, triton.next_power_of_2(bank.in_features // 32))


def _bank_launch(bank: PackedBank) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...], dict]:
    """A bank's tensor arguments (words, scales, zero points), their expert and row strides, and
    its compile-time constants, as both kernels take them."""
    words = _words(bank)
    zeros = bank.scales if bank.zeros is None else bank.zeros  # a placeholder when HAS_ZEROS is off
    strides = (words.stride(0), words.stride(1), bank.scales.stride(0), bank.scales.stride(1))
    meta = {
        "NUM_GROUPS": bank.in_features // 32,
        "HAS_ZEROS": bank.zeros is not None,
        "MXFP4": bank.mxfp4,
        "CHUNK": _chunk(bank),
        **_FIXED,
    }
    return (words, bank.scales, zeros), (*strides, zeros.stride(0), zeros.stride(1)), meta


def _bias_args(bias: torch.Tensor | None, fallback: torch.Tensor) -> tuple[torch.Tensor, int]:
    if bias is None:
        return fallback, 0
    return bias, bias.stride(0)


def _check_bank(bank: PackedBank, what: str) -> None:
    if bank.codes.dim() != 3 or bank.in_features % 32:
        raise ValueError(f"{what}: codes {tuple(bank.codes.shape)} are not an [E, N, K/2] bank with K % 32 == 0")


def moe_up(
    x: torch.Tensor, index: torch.Tensor, bank: PackedBank, bias: torch.Tensor | None, act: Activation
) -> torch.Tensor:
    """x [T, H] (bf16 or fp16), index [T, k] -> the pairs' activations [T*k, I] in x's dtype."""
    _check_bank(bank, "gate_up")
    tokens, top_k = index.shape
    pairs, inter = tokens * top_k, bank.rows // 2
    x = x.contiguous()
    flat = index.reshape(-1)
    tensors, strides, meta = _bank_launch(bank)
    bias_t, stride_be = _bias_args(bias, bank.scales)
    out = torch.empty((pairs, inter), dtype=x.dtype, device=x.device)

    def grid(meta: dict) -> tuple[int, int]:
        return (pairs, triton.cdiv(inter, meta["ROWS"]))

    _up[grid](
        x, *tensors, flat, bias_t, out,
        inter, act.alpha, act.limit, _magic(bank),
        x.stride(0), *strides, stride_be, out.stride(0),
        TOP_K=top_k, HAS_BIAS=bias is not None, ACT=act.kind, **meta,
    )  # fmt: skip
    return out


def moe_down(
    a: torch.Tensor, index: torch.Tensor, weight: torch.Tensor, bank: PackedBank, bias: torch.Tensor | None
) -> torch.Tensor:
    """a [T*k, I], index and weight [T, k] -> sum_k weight * (a @ W_down[index].T + bias): [T, H]."""
    _check_bank(bank, "down")
    tokens, top_k = index.shape
    n = bank.rows
    a, weight = a.contiguous(), weight.contiguous()
    flat = index.reshape(-1)
    tensors, strides, meta = _bank_launch(bank)
    bias_t, stride_be = _bias_args(bias, bank.scales)
    out = torch.empty((tokens, n), dtype=a.dtype, device=a.device)

    def grid(meta: dict) -> tuple[int, int]:
        return (tokens, triton.cdiv(n, meta["ROWS"]))

    _down[grid](
        a, *tensors, flat, weight, bias_t, out,
        n, _magic(bank),
        a.stride(0), *strides, stride_be, weight.stride(0), out.stride(0),
        TOP_K=top_k, HAS_BIAS=bias is not None, **meta,
    )  # fmt: skip
    return out
