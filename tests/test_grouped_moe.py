"""Grouped expert execution (engine.kernels.grouped_moe): pairs aligned by expert on the device,
one launch per projection, every format decoded in the kernel.

The alignment is checked on the CPU (plain torch); the kernel in triton's interpreter (CI runs
the tests named ``interpreter`` with TRITON_INTERPRET=1) and on a GPU. References are float64
products of the exact decode (test_fused_moe's helpers). Tolerances: the interpreter computes in
float32 (norm-relative 1e-4 per token); bf16 on a GPU rounds activations and outputs (1e-2).
"""

from __future__ import annotations

import os

import pytest
import torch
from gpu_cases import cuda_only
from test_fused_moe import ACTIVATIONS, EXPERTS, TOP_K, assert_tokens_close, bank, moe_layer, reference_moe

from modelfleet.engine.formats import Int4Weight, Int8Weight, MXFP4Weight, QuantizedWeight
from modelfleet.engine.formats.base import triton_available
from modelfleet.engine.formats.plain import PlainWeight
from modelfleet.engine.kernels import grouped_moe
from modelfleet.engine.layers import GATHER_MAX_PAIRS_OTHERS, Experts, gathered_wins, glu_kind
from modelfleet.engine.quantize import QuantizedExperts

FORMATS = ("fp32", "int8", "int4", "int4_sym", "mxfp4")
ROWS = (1, 9, 64, 256)
interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or not triton_available(),
    reason="runs the Triton kernels on CPU only under TRITON_INTERPRET=1 with triton installed",
)


def routing_of(tokens: int, experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random distinct experts per token, skewed so that some experts get many pairs and some none."""
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=generator) + torch.linspace(0, 1, experts)
    index = torch.topk(scores, top_k, dim=-1).indices
    return index, torch.softmax(torch.randn(tokens, top_k, generator=generator), dim=-1)


@pytest.mark.parametrize("pairs", [1, 7, 64, 300])
@pytest.mark.parametrize("block_m", [16, 64])
def test_alignment_holds_every_pair_once_in_blocks_of_one_expert(pairs, block_m):
    experts = 10
    flat = torch.randint(0, experts, (pairs,), generator=torch.Generator().manual_seed(pairs))
    flat[flat == 3] = 4  # an expert with no pairs
    aligned = grouped_moe.align_pairs(flat, experts, block_m)
    held = aligned.sorted_pairs[aligned.sorted_pairs < pairs]
    assert sorted(held.tolist()) == list(range(pairs))
    blocks = aligned.sorted_pairs.view(-1, block_m)
    for b, expert in enumerate(aligned.block_expert.tolist()):
        members = blocks[b][blocks[b] < pairs]
        if expert < 0:
            assert members.numel() == 0  # a block past the used ones is all padding
        else:
            assert members.numel() > 0 and bool((flat[members] == expert).all())
    assert 3 not in aligned.block_expert.tolist()


def test_blocks_follow_the_pairs_an_expert_holds():
    assert grouped_moe.block_m_for(8, 128) == 16
    assert grouped_moe.block_m_for(2048, 128) == 16
    assert grouped_moe.block_m_for(512, 6) == 64


def test_the_crossover_sends_few_pairs_to_the_gathered_kernels():
    assert gathered_wins(GATHER_MAX_PAIRS_OTHERS, "bf16") and not gathered_wins(GATHER_MAX_PAIRS_OTHERS + 1, "int8")
    assert gathered_wins(512, "int4") and not gathered_wins(513, "mxfp4")  # fused 4-bit pairs stay ahead longer
    assert glu_kind(ACTIVATIONS["silu"]) == (grouped_moe.ACT_SILU, 1.0, 0.0)
    assert glu_kind(torch.tanh) is None


def banks_by_hand(layer: QuantizedExperts) -> tuple[grouped_moe.GroupedBank, grouped_moe.GroupedBank]:
    """The banks as the kernel reads them, built from CPU tensors (the engine builds them only for CUDA)."""

    def one(w: QuantizedWeight) -> grouped_moe.GroupedBank:
        if isinstance(w, PlainWeight):
            return grouped_moe.GroupedBank(grouped_moe.FMT_PLAIN, w.weight)
        if isinstance(w, Int8Weight):
            return grouped_moe.GroupedBank(grouped_moe.FMT_INT8, w.codes, w.scales)
        w.to_nibble_major()  # type: ignore[attr-defined]
        if isinstance(w, MXFP4Weight):
            return grouped_moe.GroupedBank(grouped_moe.FMT_MXFP4, w._major, w.scales)
        assert isinstance(w, Int4Weight)
        zeros = None if w.symmetric else w.zero_points().contiguous()
        return grouped_moe.GroupedBank(grouped_moe.FMT_INT4, w._major_codes, w.scales, zeros)

    return one(layer.gate_up), one(layer.down)


def small_layer(name: str, act: str, biased: bool) -> QuantizedExperts:
    """4 experts of 64 -> 2 x 32 -> 64: the interpreter's cost grows with programs and groups."""
    generator = torch.Generator().manual_seed(7)
    gate_up, down = bank(name, (4, 64, 64), seed=2), bank(name, (4, 64, 32), seed=3)
    biases = (torch.randn(4, 64, generator=generator) * 0.1, torch.randn(4, 64, generator=generator))
    return QuantizedExperts(gate_up, down, *(biases if biased else (None, None)), ACTIVATIONS[act])


@interpreted
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("name", FORMATS)
def test_the_grouped_kernel_matches_the_exact_decode_in_the_interpreter(name, rows):
    act = "gpt_oss" if rows == 9 else "silu"
    layer = small_layer(name, act, rows == 9)
    index, weight = routing_of(rows, 4, TOP_K, seed=rows)
    x = torch.randn(rows, layer.gate_up.shape[2], generator=torch.Generator().manual_seed(1))
    kind = glu_kind(ACTIVATIONS[act])
    assert kind is not None
    y = grouped_moe.grouped_experts(x, index, weight, *banks_by_hand(layer), layer.gate_up_bias, layer.down_bias, kind)
    assert_tokens_close(y, reference_moe(layer, x, index, weight), tolerance=1e-4)


@cuda_only
@pytest.mark.gpu
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("name", ("bf16", "int8", "int4", "int4_sym", "mxfp4"))
def test_quantized_experts_match_the_exact_decode_at_every_row_count_on_cuda(name, rows):
    for act, biased in (("silu", False), ("gpt_oss", True)):
        layer = moe_layer(name, ACTIVATIONS[act], biased, "cuda")
        index, weight = routing_of(rows, EXPERTS, TOP_K, seed=rows)
        x = torch.randn(rows, layer.gate_up.shape[2], generator=torch.Generator().manual_seed(1))
        reference = reference_moe(layer, x, index, weight)
        x, index, weight = x.to("cuda", torch.bfloat16), index.cuda(), weight.cuda()
        assert layer.grouped_banks(x) is not None
        assert_tokens_close(layer(x, index, weight), reference)  # the dispatch: gathered or grouped
        kind = glu_kind(ACTIVATIONS[act])
        assert kind is not None
        banks = layer.grouped_banks(x)
        assert banks is not None
        forced = grouped_moe.grouped_experts(x, index, weight, *banks, layer.gate_up_bias, layer.down_bias, kind)
        assert_tokens_close(forced, reference)


@cuda_only
@pytest.mark.gpu
@pytest.mark.parametrize("rows", ROWS)
def test_a_plain_bf16_expert_bank_runs_grouped_beyond_the_crossover_on_cuda(rows):
    generator = torch.Generator().manual_seed(3)
    hidden, inter = 128, 96
    gate_up = torch.randn(EXPERTS, 2 * inter, hidden, generator=generator) * 0.1
    down = torch.randn(EXPERTS, hidden, inter, generator=generator) * 0.1
    bank = Experts(gate_up.to("cuda", torch.bfloat16), down.to("cuda", torch.bfloat16))
    index, weight = routing_of(rows, EXPERTS, TOP_K, seed=rows)
    x = torch.randn(rows, hidden, generator=generator)
    reference = torch.zeros(rows, hidden, dtype=torch.float64)
    w_gate_up, w_down = bank.gate_up.double().cpu(), bank.down.double().cpu()
    for t in range(rows):
        for k in range(TOP_K):
            e = int(index[t, k])
            h = w_gate_up[e] @ x[t].to(torch.bfloat16).double()
            reference[t] += float(weight[t, k]) * (w_down[e] @ ACTIVATIONS["silu"](h[None])[0])
    y = bank(x.to("cuda", torch.bfloat16), index.cuda(), weight.cuda())
    assert_tokens_close(y, reference)
