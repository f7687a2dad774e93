"""Triton kernels for small-M GEMMs (decode rows, M <= 64) that read quantized weights as stored.

Imported only when a CUDA weight meets an importable triton (see ``base.triton_available``);
nothing else in the engine imports triton. Each kernel computes out = x @ W.T for
x: [M, K] (bf16 or float32; fp16 runs as float32) and W in our layout, with no decoded copy:

- ``int4``/``int4_sym``: codes uint8 [N, K/2], fp16 scales [N, K/32], zero points uint8 [N, K/32]
  (unpacked by the caller: [N, G] bytes is 1/32 of a byte per weight, not worth the nibble math);
- ``mxfp4``: blocks uint8 [N, K/32, 16] read as [N, K/2], E8M0 bytes [N, K/32];
- ``int8``: codes int8 [N, K], float32 scales [N], applied to the accumulator.

Tiling: a program owns BLOCK_M rows x BLOCK_N outputs and one of SPLIT_K slices of K. Packed
nibbles split x into even and odd columns (low nibble = even input index), so each step is
two dots, x_even @ W_low + x_odd @ W_high, on [BLOCK_K/2, BLOCK_N] tiles; no interleave. Weights
decode to float32 exactly as the format says, then round to x's dtype for the dot (bf16 holds
E2M1 * 2^e exactly; an int4 value (q - z) * s rounds to 8 bits: the bf16 tolerance). float32
dots use input_precision="ieee". Partial sums from K slices meet in a float32 buffer through
atomic adds, so float32 results may differ in the last bits from run to run.

Guarantees are the formats' tolerances; these kernels are tested only on a GPU (and in
triton's interpreter, TRITON_INTERPRET=1), never on the CPU-only CI.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl
import triton.testing

from .banks import CONFIG

BLOCK_M = 16  # tl.dot's minimum; rows beyond M are masked
BLOCK_K = 64  # two 32-value groups per step; K is a multiple of 32, the tail is masked
GROUP = tl.constexpr(32)  # a global a kernel reads must be a constexpr


@triton.jit
def _nibble_gemm_kernel(
    x_ptr, codes_ptr, scales_ptr, zeros_ptr, out_ptr,
    M, N, K, K_PER_SPLIT,
    stride_xm, stride_cn, stride_sn, stride_zn, stride_om,
    MXFP4: tl.constexpr, HAS_ZEROS: tl.constexpr, IEEE: tl.constexpr, NIBBLE_MAJOR: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rj = tl.arange(0, BLOCK_K // 2)  # byte within the step; covers input columns 2j and 2j + 1
    m_mask, n_mask = rm < M, rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin = pid_k * K_PER_SPLIT  # K_PER_SPLIT is a multiple of BLOCK_K; the last split is masked at K
    for step in range(0, K_PER_SPLIT, BLOCK_K):
        k0 = k_begin + step
        k_even = k0 + 2 * rj  # [BLOCK_K/2]
        k_mask = k_even < K
        x_mask = m_mask[:, None] & k_mask[None, :]
        x_row = x_ptr + rm[:, None] * stride_xm
        x_low, x_high = _nibble_inputs(k_even // 2, NIBBLE_MAJOR)
        x_even = tl.load(x_row + x_low[None, :], mask=x_mask, other=0.0)
        x_odd = tl.load(x_row + x_high[None, :], mask=x_mask, other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]  # [BLOCK_K/2, BLOCK_N]
        byte = tl.load(codes_ptr + rn[None, :] * stride_cn + (k_even[:, None] // 2), mask=w_mask, other=0)
        byte = byte.to(tl.int32)
        low, high = byte & 0xF, (byte >> 4) & 0xF
        group = k_even[:, None] // GROUP
        if MXFP4:
            e = tl.load(scales_ptr + rn[None, :] * stride_sn + group, mask=w_mask, other=127).to(tl.int32)
            bits = tl.where(e == 0, 0x00400000, e << 23)  # 2^(e-127) as float32 bits; e = 0 is subnormal
            scale = bits.to(tl.float32, bitcast=True)
            w_low = _e2m1(low) * scale
            w_high = _e2m1(high) * scale
        else:
            scale = tl.load(scales_ptr + rn[None, :] * stride_sn + group, mask=w_mask, other=0.0).to(tl.float32)
            if HAS_ZEROS:
                z = tl.load(zeros_ptr + rn[None, :] * stride_zn + group, mask=w_mask, other=8).to(tl.int32)
            else:
                z = 8
            w_low = (low - z).to(tl.float32) * scale
            w_high = (high - z).to(tl.float32) * scale
        w_low = w_low.to(x_even.dtype)
        w_high = w_high.to(x_even.dtype)
        if IEEE:
            acc += tl.dot(x_even, w_low, input_precision="ieee")
            acc += tl.dot(x_odd, w_high, input_precision="ieee")
        else:
            acc += tl.dot(x_even, w_low)
            acc += tl.dot(x_odd, w_high)
    out = out_ptr + rm[:, None] * stride_om + rn[None, :]
    tl.atomic_add(out, acc, mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _nibble_inputs(byte, NIBBLE_MAJOR: tl.constexpr):
    """The inputs under a code byte's low and high nibbles: 2j and 2j + 1 in our order; in
    nibble-major order (see ``base.to_nibble_major``) byte j = 4t + b of a group holds inputs
    8b + t and 8b + 4 + t."""
    if NIBBLE_MAJOR:
        j = byte % 16
        low = (byte // 16) * 32 + 8 * (j % 4) + j // 4
        return low, low + 4
    return 2 * byte, 2 * byte + 1


# Small-M path: one program per (pair, BLOCK_N outputs, K slice); no tl.dot, which would waste 15
# of its 16 rows at M = 1. Each step covers GROUPS groups of 32 inputs as a [BLOCK_N, GROUPS, 16]
# byte tile (int8: [BLOCK_N, GROUPS * 32]), sums code x input per group, then applies the group's
# zero point and scale once. SPLIT programs share a row's K (enough of them to fill the GPU when
# pairs x N / BLOCK_N is small) and meet in a float32 buffer through atomic adds.
_GEMV_CONFIGS = [
    triton.Config({"BLOCK_N": bn, "GROUPS": g, "SPLIT": split}, num_warps=4)
    for bn in (16, 32, 64)
    for g in (4, 8)
    for split in (1, 2, 4, 8)
]
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # the interpreter cannot time configurations
# MODELFLEET_TRITON_TUNE=0: fixed configurations, no autotuning (fast start: tests, short runs)
TUNED = not INTERPRETED and os.environ.get("MODELFLEET_TRITON_TUNE", "1") != "0"


@triton.jit
def _gemv_program(index_ptr, N, K, ROW_DIV: tl.constexpr, GATHER: tl.constexpr, BLOCK_N: tl.constexpr,
                  CHUNK: tl.constexpr, SPLIT: tl.constexpr):  # fmt: skip
    """What a GEMV program owns: its pair, that pair's expert (0 for a 2-D weight) and input row,
    its BLOCK_N output rows and their mask, and its slice [k_begin, k_end) of K in CHUNK steps."""
    pair, block_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    expert = tl.load(index_ptr + pair).to(tl.int64) if GATHER else tl.full((), 0, tl.int64)
    rn = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_per_split = tl.cdiv(K, SPLIT * CHUNK) * CHUNK
    k_begin = split * k_per_split
    return pair, expert, pair // ROW_DIV, rn, rn < N, k_begin, k_begin + k_per_split


@triton.jit
def _nibble_gemv_kernel(
    x_ptr, codes_ptr, scales_ptr, zeros_ptr, index_ptr, out_ptr,
    N, K, NUM_GROUPS,
    stride_xm, stride_ce, stride_cn, stride_se, stride_sn, stride_ze, stride_zn, stride_om,
    ROW_DIV: tl.constexpr, GATHER: tl.constexpr, MXFP4: tl.constexpr, HAS_ZEROS: tl.constexpr,
    NIBBLE_MAJOR: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    pair, expert, row, rn, n_mask, k_begin, k_end = _gemv_program(
        index_ptr, N, K, ROW_DIV, GATHER, BLOCK_N, GROUPS * 32, SPLIT
    )
    rg = tl.arange(0, GROUPS)
    rj = tl.arange(0, 16)
    codes_row = codes_ptr + expert * stride_ce + rn[:, None, None] * stride_cn
    scales_row = scales_ptr + expert * stride_se + rn[:, None] * stride_sn
    zeros_row = zeros_ptr + expert * stride_ze + rn[:, None] * stride_zn
    x_row = x_ptr + row * stride_xm
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(k_begin, k_end, GROUPS * 32):
        g = k0 // 32 + rg
        g_mask = g < NUM_GROUPS
        byte_index = g[:, None] * 16 + rj[None, :]  # [GROUPS, 16]
        x_low, x_high = _nibble_inputs(byte_index, NIBBLE_MAJOR)
        x_even = tl.load(x_row + x_low, mask=g_mask[:, None], other=0.0).to(tl.float32)
        x_odd = tl.load(x_row + x_high, mask=g_mask[:, None], other=0.0).to(tl.float32)
        tile_mask = n_mask[:, None, None] & g_mask[None, :, None]
        byte = tl.load(codes_row + byte_index[None, :, :], mask=tile_mask, other=0).to(tl.int32)
        low, high = byte & 0xF, byte >> 4
        group_mask = n_mask[:, None] & g_mask[None, :]
        if MXFP4:
            # E2M1 as fp16 bits: sign to bit 15, the 3 magnitude bits to bits 11..9; that fp16 is
            # the E2M1 value x 2^-14 exactly (code 1 lands on fp16's subnormal 2^-15)
            w_low = (((low & 8) << 12) | ((low & 7) << 9)).to(tl.int16).to(tl.float16, bitcast=True)
            w_high = (((high & 8) << 12) | ((high & 7) << 9)).to(tl.int16).to(tl.float16, bitcast=True)
            part = tl.sum(w_low.to(tl.float32) * x_even[None] + w_high.to(tl.float32) * x_odd[None], axis=2)
            e = tl.load(scales_row + g[None, :], mask=group_mask, other=127).to(tl.int32)
            bits = tl.where(e == 0, 0x00400000, e << 23)  # 2^(e-127) as float32 bits; e = 0 is subnormal
            scale = bits.to(tl.float32, bitcast=True) * 16384.0
        else:
            part = tl.sum(low.to(tl.float32) * x_even[None] + high.to(tl.float32) * x_odd[None], axis=2)
            z = tl.load(zeros_row + g[None, :], mask=group_mask, other=8).to(tl.float32) if HAS_ZEROS else 8.0
            part -= z * tl.sum(x_even + x_odd, axis=1)[None, :]  # sum (q - z) x = sum q x - z sum x
            scale = tl.load(scales_row + g[None, :], mask=group_mask, other=0.0).to(tl.float32)
        acc += tl.sum(part * scale, axis=1)
    tl.atomic_add(out_ptr + pair * stride_om + rn, acc, mask=n_mask)


@triton.jit
def _int8_gemv_kernel(
    x_ptr, codes_ptr, scales_ptr, index_ptr, out_ptr,
    N, K,
    stride_xm, stride_ce, stride_cn, stride_se, stride_om,
    ROW_DIV: tl.constexpr, GATHER: tl.constexpr,
    BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    pair, expert, row, rn, n_mask, k_begin, k_end = _gemv_program(
        index_ptr, N, K, ROW_DIV, GATHER, BLOCK_N, GROUPS * 32, SPLIT
    )
    rk = tl.arange(0, GROUPS * 32)
    codes_row = codes_ptr + expert * stride_ce + rn[:, None] * stride_cn
    x_row = x_ptr + row * stride_xm
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(k_begin, k_end, GROUPS * 32):
        k = k0 + rk
        k_mask = k < K
        x = tl.load(x_row + k, mask=k_mask, other=0.0).to(tl.float32)
        q = tl.load(codes_row + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0)
        acc += tl.sum(q.to(tl.float32) * x[None, :], axis=1)
    scale = tl.load(scales_ptr + expert * stride_se + rn, mask=n_mask, other=0.0)
    tl.atomic_add(out_ptr + pair * stride_om + rn, acc * scale, mask=n_mask)


def _quick_bench(fn, quantiles):
    """The autotuners' timer: a few ms per configuration rather than triton's default 125 ms."""
    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


def _tuned(kernel, key: list[str]):
    if not TUNED:
        return kernel
    return triton.autotune(_GEMV_CONFIGS, key=key, reset_to_zero=["out_ptr"], do_bench=_quick_bench)(kernel)


_nibble_gemv = _tuned(_nibble_gemv_kernel, ["N", "K", "ROW_DIV", "MXFP4", "HAS_ZEROS", "GATHER"])
_int8_gemv = _tuned(_int8_gemv_kernel, ["N", "K", "ROW_DIV", "GATHER"])
_GEMV_FIXED = (
    {"BLOCK_N": 16, "GROUPS": 2, "SPLIT": 2}
    if INTERPRETED
    else {}
    if TUNED
    else {"BLOCK_N": 32, "GROUPS": 4, "SPLIT": 2}
)


def _gemv_grid(pairs: int, n: int):
    def grid(meta: dict[str, Any]) -> tuple[int, int, int]:
        return (pairs, triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT"])

    return grid


@triton.jit
def _e2m1(code):
    """int32 E2M1 codes -> float32 values: magnitudes [0, .5, 1, 1.5, 2, 3, 4, 6], bit 3 the sign."""
    exponent = (code >> 1) & 3
    mantissa = code & 1
    normal = ((2 + mantissa) << exponent).to(tl.float32) * 0.25
    magnitude = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.5, normal)
    return tl.where((code & 8) != 0, -magnitude, magnitude)


@triton.jit
def _int8_gemm_kernel(
    x_ptr, codes_ptr, scales_ptr, out_ptr,
    M, N, K, K_PER_SPLIT,
    stride_xm, stride_cn, stride_om,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask, n_mask = rm < M, rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin = pid_k * K_PER_SPLIT  # K_PER_SPLIT is a multiple of BLOCK_K; the last split is masked at K
    for step in range(0, K_PER_SPLIT, BLOCK_K):
        k0 = k_begin + step
        k = k0 + rk
        k_mask = k < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        q = tl.load(codes_ptr + rn[None, :] * stride_cn + k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0)
        w = q.to(x.dtype)  # int8 is exact in bf16 and float32
        if IEEE:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    scale = tl.load(scales_ptr + rn, mask=n_mask, other=0.0)
    out = out_ptr + rm[:, None] * stride_om + rn[None, :]
    tl.atomic_add(out, acc * scale[None, :], mask=m_mask[:, None] & n_mask[None, :])


def _launch_shape(m: int, n: int, k: int) -> tuple[tuple[int, int, int], int]:
    """Grid (n blocks, m blocks, k splits) and K per split (a multiple of BLOCK_K)."""
    n_blocks, m_blocks = triton.cdiv(n, CONFIG.gemm_block_n), triton.cdiv(m, BLOCK_M)
    k_steps = triton.cdiv(k, BLOCK_K)
    splits = max(1, min(k_steps, CONFIG.gemm_target_programs // (n_blocks * m_blocks)))
    k_per_split = triton.cdiv(k_steps, splits) * BLOCK_K
    return (n_blocks, m_blocks, triton.cdiv(k, k_per_split)), k_per_split


def _prepare_x(x: torch.Tensor) -> torch.Tensor:
    return (x if x.dtype in (torch.bfloat16, torch.float32) else x.to(torch.float32)).contiguous()


def _nibble_gemm(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    mxfp4: bool,
    nibble_major: bool = False,
) -> torch.Tensor:
    xc = _prepare_x(x)
    m, k = xc.shape
    n = codes.shape[0]
    codes, scales = codes.contiguous(), scales.contiguous()
    zeros = scales if zeros is None else zeros.contiguous()  # placeholder pointer when HAS_ZEROS is off
    out = torch.zeros((m, n), dtype=torch.float32, device=x.device)
    grid, k_per_split = _launch_shape(m, n, k)
    _nibble_gemm_kernel[grid](
        xc, codes, scales, zeros, out,
        m, n, k, k_per_split,
        xc.stride(0), codes.stride(0), scales.stride(0), zeros.stride(0), out.stride(0),
        MXFP4=mxfp4, HAS_ZEROS=zeros is not scales, IEEE=xc.dtype == torch.float32, NIBBLE_MAJOR=nibble_major,
        BLOCK_M=BLOCK_M, BLOCK_N=CONFIG.gemm_block_n, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    return out.to(x.dtype)


def nibble_gemv(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    index: torch.Tensor | None,
    row_div: int,
    mxfp4: bool,
    nibble_major: bool = False,
) -> torch.Tensor:
    """out[p] = x[p // row_div] @ W[index[p]].T for a bank (codes [E, N, K/2], scales and zero
    points [E, N, K/32]); with ``index`` None, W is 2-D and p runs over x's rows (row_div 1).
    No host synchronisation and no data-dependent shapes: safe inside a CUDA graph once the
    autotuner has picked its configuration (the first call per shape)."""
    xc = _prepare_x(x)
    n, k = codes.shape[-2], codes.shape[-1] * 2
    pairs = xc.shape[0] if index is None else index.numel()
    codes, scales = codes.contiguous(), scales.contiguous()
    zeros = scales if zeros is None else zeros.contiguous()  # placeholder pointer when HAS_ZEROS is off
    out = torch.zeros((pairs, n), dtype=torch.float32, device=x.device)
    bank = codes.dim() == 3

    def stride(t: torch.Tensor) -> int:
        return t.stride(0) if bank else 0

    _nibble_gemv[_gemv_grid(pairs, n)](
        xc, codes, scales, zeros, codes if index is None else index, out,
        n, k, k // 32,
        xc.stride(0), stride(codes), codes.stride(-2), stride(scales), scales.stride(-2),
        stride(zeros), zeros.stride(-2), out.stride(0),
        ROW_DIV=row_div, GATHER=index is not None, MXFP4=mxfp4, HAS_ZEROS=zeros is not scales,
        NIBBLE_MAJOR=nibble_major, **_GEMV_FIXED,
    )  # fmt: skip
    return out.to(x.dtype)


def int8_gemv(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, index: torch.Tensor | None, row_div: int
) -> torch.Tensor:
    """:func:`nibble_gemv` for int8: codes int8 [E, N, K] (or [N, K]), float32 scales [E, N]."""
    xc = _prepare_x(x)
    n, k = codes.shape[-2], codes.shape[-1]
    pairs = xc.shape[0] if index is None else index.numel()
    codes, scales = codes.contiguous(), scales.contiguous()
    out = torch.zeros((pairs, n), dtype=torch.float32, device=x.device)
    bank = codes.dim() == 3
    _int8_gemv[_gemv_grid(pairs, n)](
        xc, codes, scales, codes if index is None else index, out,
        n, k,
        xc.stride(0), codes.stride(0) if bank else 0, codes.stride(-2), scales.stride(0) if bank else 0,
        out.stride(0),
        ROW_DIV=row_div, GATHER=index is not None,
        **_GEMV_FIXED,
    )  # fmt: skip
    return out.to(x.dtype)


def int4_matmul(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    zero_points: torch.Tensor | None,
    nibble_major: bool = False,
) -> torch.Tensor:
    """x [M, K] @ int4 W.T: codes uint8 [N, K/2], scales fp16 [N, K/32], zero_points uint8 [N, K/32]
    (None: symmetric, z = 8)."""
    return _nibble_gemm(x, codes, scales, zero_points, mxfp4=False, nibble_major=nibble_major)


def mxfp4_matmul(
    x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, nibble_major: bool = False
) -> torch.Tensor:
    """x [M, K] @ MXFP4 W.T: blocks uint8 [N, K/32, 16] (or [N, K/2]), E8M0 scales uint8 [N, K/32]."""
    return _nibble_gemm(x, blocks.reshape(blocks.shape[0], -1), scales, None, mxfp4=True, nibble_major=nibble_major)


def int8_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ int8 W.T: codes int8 [N, K], float32 scales [N]."""
    xc = _prepare_x(x)
    m, k = xc.shape
    n = codes.shape[0]
    codes, scales = codes.contiguous(), scales.contiguous()
    out = torch.zeros((m, n), dtype=torch.float32, device=x.device)
    grid, k_per_split = _launch_shape(m, n, k)
    _int8_gemm_kernel[grid](
        xc, codes, scales, out,
        m, n, k, k_per_split,
        xc.stride(0), codes.stride(0), out.stride(0),
        IEEE=xc.dtype == torch.float32, BLOCK_M=BLOCK_M, BLOCK_N=CONFIG.gemm_block_n, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    return out.to(x.dtype)
