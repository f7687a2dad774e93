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

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # tl.dot's minimum; rows beyond M are masked
BLOCK_N = 64
BLOCK_K = 64  # two 32-value groups per step; K is a multiple of 32, the tail is masked
GROUP = tl.constexpr(32)  # a global a kernel reads must be a constexpr
TARGET_PROGRAMS = 512  # enough CTAs to keep an H100/H200's memory system busy at M = 1


@triton.jit
def _nibble_gemm_kernel(
    x_ptr, codes_ptr, scales_ptr, zeros_ptr, out_ptr,
    M, N, K, K_PER_SPLIT,
    stride_xm, stride_cn, stride_sn, stride_zn, stride_om,
    MXFP4: tl.constexpr, HAS_ZEROS: tl.constexpr, IEEE: tl.constexpr,
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
        x_even = tl.load(x_row + k_even[None, :], mask=x_mask, other=0.0)
        x_odd = tl.load(x_row + k_even[None, :] + 1, mask=x_mask, other=0.0)
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
    n_blocks, m_blocks = triton.cdiv(n, BLOCK_N), triton.cdiv(m, BLOCK_M)
    k_steps = triton.cdiv(k, BLOCK_K)
    splits = max(1, min(k_steps, TARGET_PROGRAMS // (n_blocks * m_blocks)))
    k_per_split = triton.cdiv(k_steps, splits) * BLOCK_K
    return (n_blocks, m_blocks, triton.cdiv(k, k_per_split)), k_per_split


def _prepare_x(x: torch.Tensor) -> torch.Tensor:
    return (x if x.dtype in (torch.bfloat16, torch.float32) else x.to(torch.float32)).contiguous()


def _nibble_gemm(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, mxfp4: bool
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
        MXFP4=mxfp4, HAS_ZEROS=zeros is not scales, IEEE=xc.dtype == torch.float32,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    return out.to(x.dtype)


def int4_matmul(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor | None
) -> torch.Tensor:
    """x [M, K] @ int4 W.T: codes uint8 [N, K/2], scales fp16 [N, K/32], zero_points uint8 [N, K/32]
    (None: symmetric, z = 8)."""
    return _nibble_gemm(x, codes, scales, zero_points, mxfp4=False)


def mxfp4_matmul(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ MXFP4 W.T: blocks uint8 [N, K/32, 16], E8M0 scales uint8 [N, K/32]."""
    return _nibble_gemm(x, blocks.reshape(blocks.shape[0], -1), scales, None, mxfp4=True)


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
        IEEE=xc.dtype == torch.float32, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    return out.to(x.dtype)
