"""The gathered-expert Triton kernel against a float32 gather-and-matmul (GPU only)."""

from __future__ import annotations

import pytest
import torch

from modelfleet.engine.kernels import expert_gemv

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and expert_gemv.HAVE_TRITON), reason="needs a CUDA GPU and triton"
)


@pytest.mark.parametrize("pairs,row_div", [(1, 1), (8, 8), (64, 8), (64, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_gemv_matches_a_float32_gather_and_matmul(pairs: int, row_div: int, dtype: torch.dtype) -> None:
    gen = torch.Generator(device="cuda").manual_seed(pairs)
    experts, n, k = 16, 96, 160  # not multiples of the kernel's blocks
    w = torch.randn(experts, n, k, device="cuda", generator=gen).to(dtype)
    x = torch.randn(pairs // row_div if row_div > 1 else pairs, k, device="cuda", generator=gen).to(dtype)
    index = torch.randint(0, experts, (pairs,), device="cuda", generator=gen)
    rows = torch.arange(pairs, device="cuda") // row_div
    ref = torch.einsum("pnk,pk->pn", w[index].float(), x[rows].float())
    out = expert_gemv.expert_gemv(x, w, index, row_div)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert out.dtype == dtype
    assert (out.float() - ref).abs().max() <= tol * ref.abs().max()
