"""Fused Triton kernels for a decode step of a quantized MoE bank: two launches per step.

- ``moe_up``: for each (token, expert) pair p and a block of intermediate rows n, the gate row n
  and the up row n + I of expert index[p], both dotted with x[p // top_k], then the bias and the
  GLU activation, stored as the pair's activation a[p, n] in x's dtype.
- ``moe_down``: for each token t and a block of output rows, the sum over its top_k pairs of
  weight[t, k] * (a[p] @ W_down[index[p]].T + bias), stored as out[t] in x's dtype.

No float32 scratch buffers, memsets, conversions or separate activation and sum kernels: what
the layer needs from the two matmuls comes out of their epilogues.

Layout: every tensor is [groups, ..., 4 words] with the lanes of a warp along the groups (groups
first, so triton's coalescing gives each lane whole 16-byte groups): ``moe_up`` is one warp on
ROWS gate and ROWS up rows of a pair, or (WIDE) several warps along the rows with chunks of 32
groups, so the lanes exhaust the groups and no sum crosses warps; ``moe_down`` has a warp per pair of the token (the
[groups, pairs, ROWS, 4] tile puts warps along the pairs), summed across warps once at the end.
A program loads all its rows' codes before any decode (``_after`` makes the decode depend on
every loaded word: ptxas would otherwise issue each row's load just before its first use, one
load in flight per warp), and the inputs once for all its rows. Codes are held in nibble-major
order (``base.to_nibble_major``, built once when a bank is prepared for CUDA; the same bytes):
nibble i of 32-bit word t of a group holds input 4i + t, so the inputs under nibble i of a
lane's four words are four consecutive values (one 8-byte load).

On Hopper and later both kernels are launched as programmatic dependents (PDL): ``moe_down``
starts while ``moe_up`` finishes, issues its code loads, and waits only before reading the
activations.

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

MXFP4 (E2M1 codes, E8M0 scale per 32): nibbles i and i + 4 of a word become the two halves of
a float16 pair (magnitude bits to 9..11, sign to 15): exactly 2^-14 times the E2M1 value for
every code, subnormal ones included; one conversion each to float32 (HADD2.F32), and 2^14
joins the E8M0 scale.

Guarantees: results within the bf16 tolerance of exact decode followed by a float32 matmul;
tested on a GPU, and in triton's interpreter (CI runs those tests on the CPU). MXFP4 and int4
steps of up to ``CONFIG.max_tokens`` tokens on Hopper run on tensor cores instead
(:mod:`.mma_moe`), :func:`moe_pair` passing the activations t-major. Measurements:
``docs/results/kernel_tuning_history.md``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl
import triton.testing
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from . import mma_moe
from .banks import CONFIG, Activation, PackedBank

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# MODELFLEET_TRITON_TUNE=0: one fixed configuration (no measured table, no autotuning; fast start: tests, short runs)
TUNED = not INTERPRETED and os.environ.get("MODELFLEET_TRITON_TUNE", "1") != "0"


@triton.jit
def _after(magic, words, ROW_AXIS: tl.constexpr, WORD_AXIS: tl.constexpr):
    """magic, unchanged (program_id(2) is 0: the grids have no third axis, but the compiler cannot
    know), as a value that depends on every word of the tile: decoding then waits for all of
    the tile's loads, so they are issued together. Otherwise ptxas issues each row's load just
    before its first use, and a warp has one load in flight."""
    dep = tl.xor_sum(tl.xor_sum(words, axis=WORD_AXIS, keep_dims=True), axis=ROW_AXIS, keep_dims=True)
    return magic | (dep & tl.program_id(2))


@triton.jit
def _x_planes(x_row, gg, t, ok):
    """The inputs of groups gg as 8 float32 tiles shaped like gg + t: tile i is input 4i + t of
    word t of each group."""
    at = x_row + gg * 32 + t
    return (
        tl.load(at, mask=ok, other=0.0).to(tl.float32),
        tl.load(at + 4, mask=ok, other=0.0).to(tl.float32),
        tl.load(at + 8, mask=ok, other=0.0).to(tl.float32),
        tl.load(at + 12, mask=ok, other=0.0).to(tl.float32),
        tl.load(at + 16, mask=ok, other=0.0).to(tl.float32),
        tl.load(at + 20, mask=ok, other=0.0).to(tl.float32),
        tl.load(at + 24, mask=ok, other=0.0).to(tl.float32),
        tl.load(at + 28, mask=ok, other=0.0).to(tl.float32),
    )


@triton.jit
def _x_sums(xs):
    """Per group: the sums of the inputs under even and under odd nibbles (last axis kept, 1)."""
    return (
        tl.sum(xs[0] + xs[2] + xs[4] + xs[6], axis=-1, keep_dims=True),
        tl.sum(xs[1] + xs[3] + xs[5] + xs[7], axis=-1, keep_dims=True),
    )


@triton.jit
def _low_half(pair):
    """The float16 in bits 0..15 of each int32, as float32."""
    return pair.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _high_half(pair):
    """The float16 in bits 16..31 of each int32, as float32."""
    return (pair >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _dot(
    words, scales, zeros, xs, x_lo, x_hi, magic, HAS_ZEROS: tl.constexpr, MXFP4: tl.constexpr, GROUP_AXIS: tl.constexpr
):
    """sum over the groups (axis -2) of the rows' decoded words . x: words [.., G, 4] int32,
    scales and zeros [.., G, 1] as loaded, xs / x_lo / x_hi broadcastable; [.., 1, 1] float32."""
    if MXFP4:
        acc = tl.zeros(words.shape, dtype=tl.float32)
        for i in tl.static_range(4):  # nibbles i and i + 4 as the two halves of a float16 pair
            mag = words << (9 - 4 * i) if i < 3 else words >> 3  # magnitude bits to 9..11 and 25..27
            sign = words << (12 - 4 * i) if i < 3 else words  # sign bits to 15 and 31
            half2 = (mag & 0x0E000E00) | (sign & -2147450880)  # 0x80008000
            acc += _low_half(half2) * xs[i]
            acc += _high_half(half2) * xs[i + 4]
        e = scales.to(tl.int32)
        bits = tl.where(e == 0, 0x00400000, e << 23)  # 2^(e-127) as float32 bits; e = 0 is subnormal
        per_group = tl.sum(acc, axis=-1, keep_dims=True) * bits.to(tl.float32, bitcast=True) * 16384.0
        return tl.sum(per_group, axis=GROUP_AXIS, keep_dims=True)
    acc_lo = tl.zeros(words.shape, dtype=tl.float32)  # sum (1 + q/256) x over even nibbles
    acc_hi = tl.zeros(words.shape, dtype=tl.float32)  # sum (1 + q/16) x over odd nibbles
    for i in tl.static_range(4):  # nibbles 2i (bits 8i..8i+3) and 2i + 1 to bits 15..18 and 19..22
        s = words << (15 - 8 * i) if i < 2 else words >> (8 * i - 15)
        acc_lo += ((s & 0x00078000) | magic).to(tl.float32, bitcast=True) * xs[2 * i]
        acc_hi += ((s & 0x00780000) | magic).to(tl.float32, bitcast=True) * xs[2 * i + 1]
    lo = tl.sum(acc_lo, axis=-1, keep_dims=True)
    hi = tl.sum(acc_hi, axis=-1, keep_dims=True)
    qx = 256.0 * (lo - x_lo) + 16.0 * (hi - x_hi)
    z = zeros.to(tl.float32) if HAS_ZEROS else 8.0
    qx -= z * (x_lo + x_hi)
    return tl.sum(qx * scales.to(tl.float32), axis=GROUP_AXIS, keep_dims=True)


@triton.jit
def _up_chunk_loads(
    codes, scales, zeros, x_row, gg, t, n, n_ok, I, stride_cn, stride_sn, stride_zn,
    NUM_GROUPS: tl.constexpr, HAS_ZEROS: tl.constexpr, WIDE: tl.constexpr,
):  # fmt: skip
    """Every load of one chunk of groups gg for moe_up, codes first (HBM before L2): the gate and
    up rows' words [C, ROWS, 4], scales and zero points [C, ROWS, 1], the input planes and sums.
    WIDE (warps along the rows): each lane loads its own group's scale (xor with program_id(2),
    0, hides the groups' contiguity, which would otherwise vectorize the load across lanes and
    cost a layout conversion through shared memory), and the inputs through pointers broadcast
    over the rows (one load per element, in the words' layout; a [C, 1, 4] tile would be spread
    over all the warps' lanes and converted)."""
    ok = (gg < NUM_GROUPS) & n_ok  # [C, ROWS, 1]
    gate_w = tl.load(codes + gg * 4, mask=ok, other=0)
    up_w = tl.load(codes + I * stride_cn + gg * 4, mask=ok, other=0)
    sg = gg ^ tl.program_id(2) if WIDE else gg
    gate_s = tl.load(scales + sg, mask=ok, other=0)
    up_s = tl.load(scales + I * stride_sn + sg, mask=ok, other=0)
    if HAS_ZEROS:
        gate_z = tl.load(zeros + sg, mask=ok, other=8)
        up_z = tl.load(zeros + I * stride_zn + sg, mask=ok, other=8)
    else:
        gate_z = gate_s
        up_z = up_s
    if WIDE:
        xs = _x_planes(x_row, gg + t * 0 + n * 0, t, (gg < NUM_GROUPS) & (n >= 0))  # [C, ROWS, 4]
    else:
        xs = _x_planes(x_row, gg + t * 0, t, (gg < NUM_GROUPS) & (t < 4))  # [C, 1, 4]
    x_lo, x_hi = _x_sums(xs)
    return gate_w, up_w, gate_s, up_s, gate_z, up_z, xs, x_lo, x_hi


@triton.jit
def _moe_up_kernel(
    x_ptr, codes_ptr, scales_ptr, zeros_ptr, index_ptr, bias_ptr, out_ptr,
    I, alpha, limit, magic,
    stride_xm, stride_ce, stride_cn, stride_se, stride_sn, stride_ze, stride_zn, stride_be, stride_om,
    TOP_K: tl.constexpr, NUM_GROUPS: tl.constexpr, HAS_ZEROS: tl.constexpr, MXFP4: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, CHUNK: tl.constexpr, ROWS: tl.constexpr, WIDE: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    pair, block = tl.program_id(0), tl.program_id(1)
    if PDL:  # x and index come from the kernels before; moe_down may start loading its codes
        gdc_wait()
        gdc_launch_dependents()
    expert = tl.load(index_ptr + pair).to(tl.int64)
    x_row = x_ptr + (pair // TOP_K) * stride_xm
    n = block * ROWS + tl.arange(0, ROWS)[None, :, None]  # [1, ROWS, 1]: gate rows; up rows n + I
    n_ok = n < I
    # WIDE: several warps along the rows, so the lanes must exhaust a chunk's groups (at most 32)
    C: tl.constexpr = 32 if WIDE and CHUNK > 32 else CHUNK
    g = tl.arange(0, C)[:, None, None]  # groups first: lanes go along them
    t = tl.arange(0, 4)[None, None, :]
    codes = codes_ptr + expert * stride_ce + n * stride_cn + t
    scales = scales_ptr + expert * stride_se + n * stride_sn
    zeros = zeros_ptr + expert * stride_ze + n * stride_zn
    gate = tl.zeros((1, ROWS, 1), dtype=tl.float32)
    up = tl.zeros((1, ROWS, 1), dtype=tl.float32)
    for g0 in tl.static_range(0, NUM_GROUPS, 2 * C):  # two chunks' loads in flight together
        ca = _up_chunk_loads(codes, scales, zeros, x_row, g0 + g, t, n, n_ok, I, stride_cn, stride_sn, stride_zn,
                            NUM_GROUPS, HAS_ZEROS, WIDE)  # fmt: skip
        words = ca[0] ^ ca[1]
        if g0 + C < NUM_GROUPS:
            cb = _up_chunk_loads(codes, scales, zeros, x_row, g0 + C + g, t, n, n_ok, I, stride_cn, stride_sn,
                                stride_zn, NUM_GROUPS, HAS_ZEROS, WIDE)  # fmt: skip
            words = words ^ cb[0] ^ cb[1]
        loaded = _after(magic, words, 1, 2)
        gate += _dot(ca[0], ca[2], ca[4], ca[6], ca[7], ca[8], loaded, HAS_ZEROS, MXFP4, 0)
        up += _dot(ca[1], ca[3], ca[5], ca[6], ca[7], ca[8], loaded, HAS_ZEROS, MXFP4, 0)
        if g0 + C < NUM_GROUPS:
            gate += _dot(cb[0], cb[2], cb[4], cb[6], cb[7], cb[8], loaded, HAS_ZEROS, MXFP4, 0)
            up += _dot(cb[1], cb[3], cb[5], cb[6], cb[7], cb[8], loaded, HAS_ZEROS, MXFP4, 0)
    if HAS_BIAS:
        gate += tl.load(bias_ptr + expert * stride_be + n, mask=n_ok, other=0.0).to(tl.float32)
        up += tl.load(bias_ptr + expert * stride_be + I + n, mask=n_ok, other=0.0).to(tl.float32)
    if ACT == 1:
        a = gate * tl.sigmoid(gate) * up
    else:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        a = (up + 1.0) * gate * tl.sigmoid(alpha * gate)
    tl.store(out_ptr + pair * stride_om + n, a.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _down_chunk_loads(codes, scales, zeros, gg, ok, NUM_GROUPS: tl.constexpr, HAS_ZEROS: tl.constexpr):
    """moe_down's words, scales and zero points of the groups gg."""
    ok = (gg < NUM_GROUPS) & ok
    s = tl.load(scales + gg, mask=ok, other=0)
    return tl.load(codes + gg * 4, mask=ok, other=0), s, tl.load(zeros + gg, mask=ok, other=8) if HAS_ZEROS else s


@triton.jit
def _moe_down_kernel(
    a_ptr, codes_ptr, scales_ptr, zeros_ptr, index_ptr, weight_ptr, bias_ptr, out_ptr,
    N, magic,
    stride_am, stride_ce, stride_cn, stride_se, stride_sn, stride_ze, stride_zn, stride_be, stride_wt, stride_om,
    TOP_K: tl.constexpr, NUM_GROUPS: tl.constexpr, HAS_ZEROS: tl.constexpr, MXFP4: tl.constexpr,
    HAS_BIAS: tl.constexpr, CHUNK: tl.constexpr, ROWS: tl.constexpr, PAIRS: tl.constexpr, PDL: tl.constexpr,
    EARLY: tl.constexpr = 1,
):  # fmt: skip
    token, block = tl.program_id(0), tl.program_id(1)
    k = tl.arange(0, PAIRS)[None, :, None, None]  # [1, PAIRS, 1, 1]: the token's top_k, padded
    k_ok = k < TOP_K
    pair = token * TOP_K + k
    expert = tl.load(index_ptr + pair, mask=k_ok, other=0).to(tl.int64)
    n = block * ROWS + tl.arange(0, ROWS)[None, None, :, None]  # [1, 1, ROWS, 1]
    n_ok = n < N
    g = tl.arange(0, CHUNK)[:, None, None, None]  # groups first: lanes go along them
    t = tl.arange(0, 4)[None, None, None, :]
    codes = codes_ptr + expert * stride_ce + n * stride_cn + t
    scales = scales_ptr + expert * stride_se + n * stride_sn
    zeros = zeros_ptr + expert * stride_ze + n * stride_zn
    NCH: tl.constexpr = (NUM_GROUPS + CHUNK - 1) // CHUNK
    ws = ()
    ss = ()
    zs = ()
    for c in tl.static_range(EARLY):  # the first EARLY chunks' codes in flight before the wait
        w, s, z = _down_chunk_loads(codes, scales, zeros, c * CHUNK + g, n_ok & k_ok, NUM_GROUPS, HAS_ZEROS)
        ws, ss, zs = ws + (w,), ss + (s,), zs + (z,)  # type: ignore[assignment]
    if PDL:  # the activations are moe_up's output
        gdc_wait()
    y = tl.zeros((1, PAIRS, ROWS, 1), dtype=tl.float32)
    for c in tl.static_range(NCH):
        gg = c * CHUNK + g
        if c < EARLY:
            w, s, z = ws[c], ss[c], zs[c]
        else:
            w, s, z = _down_chunk_loads(codes, scales, zeros, gg, n_ok & k_ok, NUM_GROUPS, HAS_ZEROS)
        xs = _x_planes(
            a_ptr + pair * stride_am, gg + t * 0, t, (gg < NUM_GROUPS) & k_ok & (t < 4)
        )  # [CHUNK, PAIRS, 1, 4]
        x_lo, x_hi = _x_sums(xs)
        y += _dot(w, s, z, xs, x_lo, x_hi, _after(magic, w, 2, 3), HAS_ZEROS, MXFP4, 0)
    if HAS_BIAS:
        y += tl.load(bias_ptr + expert * stride_be + n, mask=n_ok & k_ok, other=0.0).to(tl.float32)
    wk = tl.load(weight_ptr + token * stride_wt + k, mask=k_ok, other=0.0).to(tl.float32)
    out = tl.sum(y * wk, axis=1, keep_dims=True)  # [1, 1, ROWS, 1]
    tl.store(out_ptr + token * stride_om + n, out.to(out_ptr.dtype.element_ty), mask=n_ok)


_UP_CONFIGS = [triton.Config({"ROWS": r, "WIDE": False}, num_warps=1) for r in (1, 2, 4, 8)] + [
    triton.Config({"ROWS": r, "WIDE": True}, num_warps=w) for r, w in ((8, 2), (8, 4), (16, 4), (16, 8))
]
_DOWN_CONFIGS = [triton.Config({"ROWS": r}, num_warps=w) for r in (1, 2, 4, 8) for w in (2, 4, 8)]


def _quick_bench(fn, quantiles):
    """The autotuners' timer: a few ms per configuration rather than triton's default 125 ms."""
    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


def _tuned(kernel, configs: list[Any], key: list[str]):
    if not TUNED:
        return kernel
    return triton.autotune(configs, key=key, do_bench=_quick_bench)(kernel)


_up = _tuned(_moe_up_kernel, _UP_CONFIGS, ["I", "TOP_K", "NUM_GROUPS", "HAS_ZEROS", "MXFP4", "HAS_BIAS", "ACT"])
_down = _tuned(_moe_down_kernel, _DOWN_CONFIGS, ["N", "TOP_K", "NUM_GROUPS", "HAS_ZEROS", "MXFP4", "HAS_BIAS"])
# (moe_up, moe_down) configurations measured for the pair in a CUDA graph, by (compute capability
# major, MXFP4) and token count: entries (up to this many tokens, moe_up's, moe_down's), ascending,
# the last one serving larger counts too, as vLLM keys its tuned fused-MoE configurations by batch
# size. ``benchmarks/tune_fused_moe.py --rows ...`` sweeps them (H200, Qwen3-30B-A3B layer). A
# moe_down CHUNK (groups per load) applies where it divides the bank's groups into at most
# ``CONFIG.max_down_chunks`` loads (``_down_meta``): 768 inputs are 24 groups, whose one padded
# chunk of 32 idles a quarter of the lanes. Triton's autotuner times each kernel alone between eager
# launches, where launch noise decides at a few microseconds and the kernels' overlap (PDL) is not
# seen; it serves devices without an entry.
MEASURED: dict[tuple[int, bool], list[tuple[int, dict[str, Any], dict[str, Any]]]] = {
    (9, False): [(8, {"ROWS": 4, "WIDE": False, "num_warps": 1}, {"ROWS": 4, "num_warps": 2, "CHUNK": 8})],
    (9, True): [
        (1, {"ROWS": 16, "WIDE": True, "num_warps": 4}, {"ROWS": 4, "num_warps": 4}),
        (8, {"ROWS": 8, "WIDE": True, "num_warps": 4}, {"ROWS": 4, "num_warps": 2, "CHUNK": 8}),
    ],
}
_UP_FIXED = {"ROWS": 2, "WIDE": False} if INTERPRETED else {} if TUNED else {"ROWS": 2, "WIDE": False, "num_warps": 1}
_DOWN_FIXED = {"ROWS": 2} if INTERPRETED else {} if TUNED else {"ROWS": 2, "num_warps": 4}


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
    return min(CONFIG.max_chunk, int(triton.next_power_of_2(bank.in_features // 32)))


def _down_meta(bank: PackedBank, meta: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """moe_down's compile-time constants and launch configuration: a configuration's CHUNK
    replaces the bank's where it splits the groups exactly into at most ``CONFIG.max_down_chunks``
    loads, and then every chunk's codes are loaded before the wait (EARLY); otherwise the first
    chunk's."""
    merged = {**meta, **config, "EARLY": 1}
    groups, chunk = meta["NUM_GROUPS"], config.get("CHUNK")
    if chunk is None or groups % chunk or groups // chunk > CONFIG.max_down_chunks or chunk > meta["CHUNK"]:
        merged["CHUNK"] = meta["CHUNK"]
    else:
        merged["EARLY"] = groups // chunk
    return merged


def _bank_launch(bank: PackedBank) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...], dict[str, Any]]:
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
    }
    return (words, bank.scales, zeros), (*strides, zeros.stride(0), zeros.stride(1)), meta


def _bias_args(bias: torch.Tensor | None, fallback: torch.Tensor) -> tuple[torch.Tensor, int]:
    if bias is None:
        return fallback, 0
    return bias, bias.stride(0)


def measured_configs(major: int, mxfp4: bool, tokens: int) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The measured (moe_up, moe_down) configurations for a step of ``tokens`` tokens: the first
    entry whose token bound covers them, else the last; None without an entry."""
    entries = MEASURED.get((major, mxfp4))
    if not entries:
        return None
    up, down = next(((u, d) for bound, u, d in entries if tokens <= bound), entries[-1][1:])
    return up, down


def _launch(x: torch.Tensor, bank: PackedBank, which: int, tokens: int):
    """The kernel (0: moe_up, 1: moe_down) and its launch configuration for x's device and the
    step's token count: the measured pair configuration when there is one, else the autotuner or
    the fixed one."""
    if TUNED:
        measured = measured_configs(torch.cuda.get_device_capability(x.device)[0], bank.mxfp4, tokens)
        if measured is not None:
            return (_moe_up_kernel, _moe_down_kernel)[which], measured[which]
    return (_up, _down)[which], (_UP_FIXED, _DOWN_FIXED)[which]


def _pdl(x: torch.Tensor) -> dict[str, Any]:
    """Programmatic dependent launch (Hopper and later): each kernel may start while the one
    before it finishes and waits (griddepcontrol.wait) only where it reads that kernel's output."""
    on = not INTERPRETED and torch.cuda.get_device_capability(x.device)[0] >= 9
    return {"PDL": on, "launch_pdl": on} if on else {"PDL": False}


def _check_bank(bank: PackedBank, what: str) -> None:
    if bank.codes.dim() != 3 or bank.in_features % 32:
        raise ValueError(f"{what}: codes {tuple(bank.codes.shape)} are not an [E, N, K/2] bank with K % 32 == 0")


@dataclass(frozen=True)
class _Call:
    """What both kernels take from a bank, a routing and a bias: the flat expert index per pair,
    top_k, the bank's tensors, strides and constants (``_bank_launch``), the bias (or a
    placeholder) and its expert stride."""

    flat: torch.Tensor
    top_k: int
    tensors: tuple[torch.Tensor, ...]
    strides: tuple[int, ...]
    meta: dict[str, Any]
    bias: torch.Tensor
    stride_be: int

    @classmethod
    def of(cls, bank: PackedBank, what: str, index: torch.Tensor, bias: torch.Tensor | None) -> _Call:
        _check_bank(bank, what)
        tensors, strides, meta = _bank_launch(bank)
        bias_t, stride_be = _bias_args(bias, bank.scales)
        return cls(index.reshape(-1), index.shape[1], tensors, strides, meta, bias_t, stride_be)


def moe_up(
    x: torch.Tensor, index: torch.Tensor, bank: PackedBank, bias: torch.Tensor | None, act: Activation
) -> torch.Tensor:
    """x [T, H] (bf16 or fp16), index [T, k] -> the pairs' activations [T*k, I] in x's dtype.
    MXFP4 and int4 steps of up to ``CONFIG.max_tokens`` tokens on Hopper run on tensor cores (:mod:`.mma_moe`)."""
    call = _Call.of(bank, "gate_up", index, bias)
    if not INTERPRETED and mma_moe.up_applies(x, index, bank):
        return mma_moe.moe_up(x, index, bank, bias, act)
    pairs, inter = call.flat.numel(), bank.rows // 2
    x = x.contiguous()
    out = torch.empty((pairs, inter), dtype=x.dtype, device=x.device)

    def grid(meta: dict[str, Any]) -> tuple[int, int]:
        return (pairs, triton.cdiv(inter, meta["ROWS"]))

    kernel, config = _launch(x, bank, 0, index.shape[0])
    kernel[grid](
        x, *call.tensors, call.flat, call.bias, out,
        inter, act.alpha, act.limit, _magic(bank),
        x.stride(0), *call.strides, call.stride_be, out.stride(0),
        TOP_K=call.top_k, HAS_BIAS=bias is not None, ACT=act.kind, **call.meta, **config, **_pdl(x),
    )  # fmt: skip
    return out


def moe_pair(
    x: torch.Tensor,
    index: torch.Tensor,
    weight: torch.Tensor,
    gate_up: PackedBank,
    down: PackedBank,
    gate_up_bias: torch.Tensor | None,
    down_bias: torch.Tensor | None,
    act: Activation,
) -> torch.Tensor:
    """A decode step's two kernels, :func:`moe_up` then :func:`moe_down` (x [T, H] -> [T, H]). When
    both run on tensor cores (:mod:`.mma_moe`) the activations pass between them t-major
    (``mma_moe.t_major``), so moe_down reads each lane's inputs in two 8-byte loads."""
    if not INTERPRETED and mma_moe.up_applies(x, index, gate_up) and mma_moe.down_applies(x, index, down):
        _check_bank(gate_up, "gate_up")
        _check_bank(down, "down")
        a = mma_moe.moe_up(x, index, gate_up, gate_up_bias, act, t_major=True)
        return mma_moe.moe_down(a, index, weight, down, down_bias, t_major=True)
    return moe_down(moe_up(x, index, gate_up, gate_up_bias, act), index, weight, down, down_bias)


def moe_down(
    a: torch.Tensor, index: torch.Tensor, weight: torch.Tensor, bank: PackedBank, bias: torch.Tensor | None
) -> torch.Tensor:
    """a [T*k, I], index and weight [T, k] -> sum_k weight * (a @ W_down[index].T + bias): [T, H].
    MXFP4 and int4 steps of up to ``CONFIG.max_tokens`` tokens on Hopper run on tensor cores (:mod:`.mma_moe`)."""
    call = _Call.of(bank, "down", index, bias)
    if not INTERPRETED and mma_moe.down_applies(a, index, bank):
        return mma_moe.moe_down(a, index, weight, bank, bias)
    tokens, n = index.shape[0], bank.rows
    a, weight = a.contiguous(), weight.contiguous()
    out = torch.empty((tokens, n), dtype=a.dtype, device=a.device)

    def grid(meta: dict[str, Any]) -> tuple[int, int]:
        return (tokens, triton.cdiv(n, meta["ROWS"]))

    kernel, config = _launch(a, bank, 1, tokens)
    kernel[grid](
        a, *call.tensors, call.flat, weight, call.bias, out,
        n, _magic(bank),
        a.stride(0), *call.strides, call.stride_be, weight.stride(0), out.stride(0),
        TOP_K=call.top_k, HAS_BIAS=bias is not None, PAIRS=triton.next_power_of_2(call.top_k),
        **_down_meta(bank, call.meta, config), **_pdl(a),
    )  # fmt: skip
    return out
