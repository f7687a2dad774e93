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


@pytest.mark.parametrize("rows,experts,top_k", [(1, 128, 8), (8, 128, 8), (3, 60, 4), (64, 256, 8)])
def test_route_top_k_kernel_picks_the_top_k_and_their_softmax(rows: int, experts: int, top_k: int) -> None:
    from modelfleet.engine.kernels import route_top_k

    gen = torch.Generator(device="cuda").manual_seed(rows)
    logits = torch.randn(rows, experts, device="cuda", generator=gen).to(torch.bfloat16)
    index, weight = route_top_k.route_top_k(logits, top_k)
    ref_top, ref_index = torch.topk(logits.float(), top_k, dim=-1)
    assert torch.equal(torch.sort(index, dim=-1).values, torch.sort(ref_index, dim=-1).values)
    ref_weight = torch.softmax(ref_top, dim=-1)
    assert torch.allclose(torch.sort(weight, dim=-1).values, torch.sort(ref_weight, dim=-1).values, atol=1e-5)
