"""CPU expert banks (engine/cpu_moe.py): every format's bank, at the row counts of decode frames
(1 row, a few, a full frame, many), equals an independent dense reference: per token, the sum over
its k experts of weight x down(glu(gate_up(x))) with the format's exact decode in float32."""

from __future__ import annotations

import pytest
import torch

from modelfleet.engine.formats import quantize
from modelfleet.engine.layers import Experts, silu_glu
from modelfleet.engine.quantize import QuantizedExperts

E, H, I, TOP_K = 8, 64, 32, 3


def bank_weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * I, H, generator=g) * 0.1, torch.randn(E, H, I, generator=g) * 0.1


def routing(rows: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(rows)])
    return index, torch.softmax(torch.randn(rows, TOP_K, generator=g), dim=-1)


def dense_reference(gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor, index, weight) -> torch.Tensor:
    """Per token t: sum_k weight[t, k] * down[e](glu(gate_up[e] x_t)), e = index[t, k], in float64."""
    out = torch.zeros(x.shape[0], H, dtype=torch.float64)
    for k in range(index.shape[1]):
        e = index[:, k]
        h = torch.bmm(gate_up.double()[e], x.double()[:, :, None])[:, :, 0]
        y = torch.bmm(down.double()[e], silu_glu(h)[:, :, None])[:, :, 0]
        out += weight[:, k, None].double() * y
    return out


def bank(fmt: str, gate_up: torch.Tensor, down: torch.Tensor, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    if fmt == "plain":
        experts = Experts(gate_up.to(dtype), down.to(dtype))
        experts.pack_for_cpu()  # oneDNN's layout in bf16, as loaded shards hold it
        return experts, gate_up.to(dtype).float(), down.to(dtype).float()
    gu, dn = quantize(gate_up, fmt), quantize(down, fmt)
    return QuantizedExperts(gu, dn), gu.dequantize(), dn.dequantize()


@pytest.mark.parametrize("fmt", ["plain", "int4", "int8", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 9, 64, 256])
def test_a_cpu_expert_bank_equals_the_dense_reference_of_its_exact_decode(fmt, dtype, rows) -> None:
    gate_up, down = bank_weights()
    experts, gu_exact, dn_exact = bank(fmt, gate_up, down, dtype)
    x = torch.randn(rows, H, generator=torch.Generator().manual_seed(rows)).to(dtype)
    index, weight = routing(rows)
    got = experts(x, index, weight.to(dtype))
    assert got.shape == (rows, H) and got.dtype == dtype
    expected = dense_reference(gu_exact, dn_exact, x.float(), index, weight.to(dtype).float())
    scale = expected.abs().max().item()
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: activations and products round to 8 bits
    assert (got.double() - expected).abs().max().item() <= tol * scale


def test_rows_routed_to_the_same_experts_in_any_order_get_the_same_outputs() -> None:
    gate_up, down = bank_weights()
    experts = Experts(gate_up, down)
    x = torch.randn(5, H)
    index, weight = routing(5)
    shuffled = torch.randperm(5)
    together = experts(x[shuffled], index[shuffled], weight[shuffled])
    assert torch.allclose(experts(x, index, weight)[shuffled], together, atol=1e-6)
