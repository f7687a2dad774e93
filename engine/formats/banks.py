"""What the CUDA kernels of the formats take, as plain data importable without triton: an expert
bank as the fused MoE kernels read it (:class:`PackedBank`), the GLU they apply
(:class:`Activation`), and the kernels' tunables (:class:`KernelConfig`, one frozen ``CONFIG``).

The format ABC (:mod:`.base`) and the formats import these; only the kernel modules
(:mod:`.triton_kernels`, :mod:`.triton_moe`, :mod:`.mma_moe`) import triton. The measurements
behind each tunable are in ``docs/results/kernel_tuning_history.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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


@dataclass(frozen=True)
class KernelConfig:
    """The kernels' tunables (the measured launch tables stay with their kernels:
    ``triton_moe.MEASURED``). Validated when built."""

    # mma_moe: the tensor-core pair serves steps of up to this many tokens (faster than the Triton pair at 1-8)
    max_tokens: int = 8
    # mma_moe: MXFP4's one-token moe_down register cap (8 warps x 112 fit beside four moe_up programs, not three)
    down_regs_mxfp4: int = 112
    # mma_moe: the cap applies up to this many chunks of 8 groups per warp (768-wide experts); more spill under it
    max_capped_chunks: int = 3
    # triton_moe: groups per load, 1 KB of codes per row
    max_chunk: int = 64
    # triton_moe: moe_down holds every chunk's codes before its wait, so registers bound the chunk count
    max_down_chunks: int = 4
    # triton_kernels: output columns per GEMM program
    gemm_block_n: int = 64
    # triton_kernels: K splits until about this many programs, enough to keep an H100/H200's memory busy at M = 1
    gemm_target_programs: int = 512
    # triton_kernels: up to this many rows a dense matmul runs one GEMV per row (weights stay in L2)
    gemv_max_rows: int = 4

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"KernelConfig.{name} must be an int >= 0, got {value!r}")
        for name in ("max_chunk", "gemm_block_n"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"KernelConfig.{name} must be a power of two, got {value}")


CONFIG = KernelConfig()
