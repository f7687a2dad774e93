"""The fused CUDA MoE kernels (engine.formats.triton_moe) and the nibble-major code order they read.

The order is checked here on the CPU (CI); the kernels on a GPU and, with TRITON_INTERPRET=1 and
triton installed, in triton's interpreter. References are float64 products of the exact decode.
Tolerance: norm-relative 1e-2 per token for bf16/fp16 activations (the kernels round the
pairs' activations and the output to the activation dtype once each; a wrong code order or
scale gives errors of order 1).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import subprocess
import sys
from collections import defaultdict

import numpy as np
import pytest
import torch
from gpu_cases import cuda_matmul_cases, cuda_only

from modelfleet.engine.formats import Int4Weight, MXFP4Weight, QuantizedWeight, quantize
from modelfleet.engine.formats.banks import ACT_SILU, CONFIG, Activation, KernelConfig, PackedBank
from modelfleet.engine.formats.base import from_nibble_major, to_nibble_major, triton_available, unpack_nibbles
from modelfleet.engine.layers import ClampedSwiGLU, silu_glu
from modelfleet.engine.quantize import QuantizedExperts

FUSED = ("int4", "int4_sym", "mxfp4")
EXPERTS, HIDDEN, INTER, TOP_K = 6, 128, 96, 2  # INTER / 32 = 3 groups: a masked chunk
interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or not triton_available(),
    reason="runs the Triton kernels on CPU only under TRITON_INTERPRET=1 with triton installed",
)


def bank(name: str, shape: tuple[int, ...], seed: int) -> QuantizedWeight:
    generator = torch.Generator().manual_seed(seed)
    return quantize(torch.randn(*shape, generator=generator) * 0.5, name)


def stored_codes(weight: QuantizedWeight) -> torch.Tensor:
    return weight.blocks.flatten(-2) if isinstance(weight, MXFP4Weight) else weight.codes  # type: ignore[attr-defined]


def test_nibble_major_puts_input_4i_plus_t_in_nibble_i_of_word_t():
    codes = torch.randint(0, 256, (3, 5, 64), dtype=torch.uint8)
    major = to_nibble_major(codes)
    assert torch.equal(from_nibble_major(major), codes)
    inputs = unpack_nibbles(codes)  # [3, 5, 128]: input k in our order
    words = major.view(3, 5, 4, 4, 4)  # [.., group, word t, byte b]
    for k in range(128):
        group, rest = divmod(k, 32)
        i, t = divmod(rest, 4)
        byte, high = divmod(i, 2)
        assert torch.equal((words[..., group, t, byte] >> (4 * high)) & 0xF, inputs[..., k]), k


@pytest.mark.parametrize("name", FUSED)
def test_a_bank_held_nibble_major_keeps_its_codes_bytes_and_views(name):
    weight = bank(name, (EXPERTS, 64, HIDDEN), seed=1)
    codes, decoded, nbytes = stored_codes(weight).clone(), weight.dequantize(), weight.nbytes
    weight.to_nibble_major()  # type: ignore[attr-defined]
    assert weight.nbytes == nbytes  # the order replaces ours: no second copy
    assert torch.equal(stored_codes(weight), codes)
    assert torch.equal(weight.dequantize(), decoded)
    assert torch.equal(weight.expert(4).dequantize(), decoded[4])
    assert torch.equal(weight.slice(0, 2, 5).dequantize(), decoded[2:5])
    assert torch.equal(weight.slice(1, 32, 64).dequantize(), decoded[:, 32:64])
    x = torch.randn(3, HIDDEN)
    torch.testing.assert_close(weight.expert_matmul(1, x), x @ decoded[1].T, rtol=1e-5, atol=1e-5)


def reference_moe(layer: QuantizedExperts, x, index, weight) -> torch.Tensor:
    """float64 pair by pair from the exact decode: sum_k weight * down(act(gate_up(x) + b) ) + b."""
    gate_up, down = layer.gate_up.dequantize().double().cpu(), layer.down.dequantize().double().cpu()
    out = torch.zeros(x.shape[0], down.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(index.shape[1]):
            e = int(index[t, k])
            h = gate_up[e] @ x[t].double()
            if layer.gate_up_bias is not None:
                h = h + layer.gate_up_bias[e].double().cpu()
            a = layer.activation(h[None])[0]
            y = down[e] @ a
            if layer.down_bias is not None:
                y = y + layer.down_bias[e].double().cpu()
            out[t] += float(weight[t, k]) * y
    return out


def moe_layer(name: str, activation, biased: bool, device: str) -> QuantizedExperts:
    generator = torch.Generator().manual_seed(7)
    gate_up = bank(name, (EXPERTS, 2 * INTER, HIDDEN), seed=2).to(device)
    down = bank(name, (EXPERTS, HIDDEN, INTER), seed=3).to(device)
    if not biased:
        return QuantizedExperts(gate_up, down, None, None, activation)
    gate_up_bias = torch.randn(EXPERTS, 2 * INTER, generator=generator) * 0.1
    down_bias = torch.randn(EXPERTS, HIDDEN, generator=generator)
    return QuantizedExperts(gate_up, down, gate_up_bias.to(device), down_bias.to(device), activation)


def routing(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(EXPERTS, generator=generator)[:TOP_K] for _ in range(tokens)])
    return index, torch.softmax(torch.randn(tokens, TOP_K, generator=generator), dim=-1)


def assert_tokens_close(y: torch.Tensor, reference: torch.Tensor, tolerance: float = 1e-2) -> None:
    error = (y.double().cpu() - reference).norm(dim=-1) / reference.norm(dim=-1)
    assert float(error.max()) <= tolerance, f"worst token's relative error {float(error.max()):.3g}"


ACTIVATIONS = {"silu": silu_glu, "gpt_oss": ClampedSwiGLU(alpha=1.702, limit=7.0)}


@cuda_only
@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 32])
@pytest.mark.parametrize(
    ("act", "biased", "dtype"),
    [("silu", False, torch.bfloat16), ("gpt_oss", True, torch.bfloat16), ("silu", False, torch.float16)],
    ids=["silu-bf16", "gpt_oss-bias-bf16", "silu-fp16"],
)
@pytest.mark.parametrize("wide", [False, True], ids=["one-warp", "wide"])
@pytest.mark.parametrize("name", FUSED)
def test_the_fused_moe_kernels_match_the_exact_decode(name, wide, act, biased, dtype, tokens, monkeypatch):
    from modelfleet.engine.formats import triton_moe

    if triton_moe.TUNED:  # the autotuner picks moe_up's layout
        if wide:
            pytest.skip("autotuned (MODELFLEET_TRITON_TUNE unset): the tuner picks moe_up's layout")
    else:
        config = {"ROWS": 8, "WIDE": True, "num_warps": 4} if wide else {"ROWS": 2, "WIDE": False, "num_warps": 1}
        monkeypatch.setattr(triton_moe, "_UP_FIXED", config)
    layer = moe_layer(name, ACTIVATIONS[act], biased, "cuda")
    index, weight = routing(tokens, seed=tokens)
    x = torch.randn(tokens, HIDDEN).to(dtype)
    y = layer(x.cuda(), index.cuda(), weight.to(dtype).cuda())
    assert layer.fused_kernels(x.cuda()) is not None, "the fused kernels did not apply"
    assert y.dtype == dtype and y.shape == (tokens, HIDDEN)
    assert_tokens_close(y, reference_moe(layer, x.float(), index, weight.to(dtype).float()))


def mxfp4_layer(
    experts: int, hidden: int, inter: int, activation, biased: bool, name: str = "mxfp4"
) -> QuantizedExperts:
    generator = torch.Generator().manual_seed(11)
    gate_up = bank(name, (experts, 2 * inter, hidden), seed=12).to("cuda")
    down = bank(name, (experts, hidden, inter), seed=13).to("cuda")
    if not biased:
        return QuantizedExperts(gate_up, down, None, None, activation)
    gate_up_bias = (torch.randn(experts, 2 * inter, generator=generator) * 0.1).cuda()
    return QuantizedExperts(
        gate_up, down, gate_up_bias, torch.randn(experts, hidden, generator=generator).cuda(), activation
    )


@cuda_only
@pytest.mark.gpu
@pytest.mark.parametrize(
    ("hidden", "inter", "top_k", "tokens"),
    [(512, 256, 2, 1), (1024, 256, 8, 1), (1024, 256, 8, 3), (2880, 384, 4, 1), (512, 768, 8, 1)],
    ids=["2-warp-up", "4-warp-up-top8", "3-tokens-2-tile-up", "gpt-oss-hidden-masked-chunks", "three-chunk-down"],
)
@pytest.mark.parametrize("name", FUSED)
@pytest.mark.parametrize(
    ("act", "biased", "dtype", "scale"),
    [
        ("silu", False, torch.bfloat16, 1.0),
        ("gpt_oss", True, torch.bfloat16, 1.0),
        ("silu", False, torch.float16, 1.0),
        ("silu", False, torch.bfloat16, 3e5),
    ],
    ids=["silu-bf16", "gpt_oss-bias-bf16", "silu-fp16", "inputs-past-f16-range"],
)
def test_the_tensor_core_kernels_match_the_exact_decode(
    name, hidden, inter, top_k, tokens, act, biased, dtype, scale, monkeypatch
):
    """MXFP4 and int4 decode steps on Hopper run on tensor cores (mma_moe): against the float64
    exact decode, and against the Triton kernels on the same step; inputs beyond f16's range are
    scaled per warp; group counts that are not whole chunks of 8 (90 and 12 here) are masked;
    int4 with and without zero points; from two tokens on, moe_up's programs take two tiles."""
    from modelfleet.engine.formats import mma_moe

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the tensor-core kernels run on compute capability 9 (Hopper)")
    layer = mxfp4_layer(8, hidden, inter, ACTIVATIONS[act], biased, name)
    generator = torch.Generator().manual_seed(hidden + top_k)
    index = torch.stack([torch.randperm(8, generator=generator)[:top_k] for _ in range(tokens)])
    weight = torch.softmax(torch.randn(tokens, top_k, generator=generator), dim=-1).to(dtype)
    x = (torch.randn(tokens, hidden, generator=generator) * scale).to(dtype)
    gate_up, down, _ = layer.fused_kernels(x.cuda())
    assert mma_moe.up_applies(x.cuda(), index.cuda(), gate_up) and mma_moe.down_applies(x.cuda(), index.cuda(), down)
    chunks = -(-hidden // 32 // mma_moe.CHUNK)
    tiles = mma_moe._up_tiles(tokens, chunks // mma_moe._up_warps(hidden // 32), inter // 8)
    assert tiles == (2 if tokens > 1 else 1)
    y = layer(x.cuda(), index.cuda(), weight.cuda())
    assert y.dtype == dtype and y.shape == (tokens, hidden)
    assert_tokens_close(y, reference_moe(layer, x.float(), index, weight.float()))
    monkeypatch.setattr(mma_moe, "CONFIG", dataclasses.replace(mma_moe.CONFIG, max_tokens=0))  # the Triton kernels
    assert not mma_moe.up_applies(x.cuda(), index.cuda(), gate_up)
    assert_tokens_close(y, layer(x.cuda(), index.cuda(), weight.cuda()).double().cpu())


@cuda_only
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["mxfp4", "int4"])
def test_the_ptx_pass_leaves_eight_tokens_bit_for_bit_with_fewer_cta_barriers(name, monkeypatch):
    """The PTX pass (``mma_moe.warp_barriers``) from two tokens on too (two tiles per moe_up
    program: more conversions): the kernels compiled with it carry fewer CTA barriers than those
    compiled without it, the step is the same bit for bit, and it matches the float64 exact decode."""
    from triton import knobs

    from modelfleet.engine.formats import mma_moe

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the tensor-core kernels run on compute capability 9 (Hopper)")
    layer = mxfp4_layer(8, 2048, 768, silu_glu, False, name)
    generator = torch.Generator().manual_seed(8)
    index = torch.stack([torch.randperm(8, generator=generator)[:4] for _ in range(8)]).cuda()
    weight = torch.softmax(torch.randn(8, 4, generator=generator), dim=-1).to(torch.bfloat16).cuda()
    x = torch.randn(8, 2048, generator=generator).to(torch.bfloat16).cuda()

    kernels = (mma_moe._mma_up_kernel, mma_moe._mma_down_kernel)
    monkeypatch.setenv("TRITON_ALWAYS_COMPILE", "1")  # Triton's disk cache does not key on the pass

    def step_and_cta_barriers() -> tuple[torch.Tensor, int]:
        for kernel in kernels:  # this step's compilations only
            monkeypatch.setattr(kernel, "device_caches", defaultdict(kernel.create_binder))
        y = layer(x, index, weight)
        ptx = [k.asm["ptx"] for f in kernels for c in f.device_caches.values() for k in c[0].values()]
        assert len(ptx) == 2 and all(mma_moe.WARP_BARRIERS_MARK in p for p in ptx)  # moe_up and moe_down
        return y, sum(p.count("bar.sync") for p in ptx)

    mma_moe.install_ptx_pass()
    y, with_pass = step_and_cta_barriers()
    monkeypatch.setattr(knobs.runtime, "add_stages_inspection_hook", None)  # installed once: stays off
    y_plain, without_pass = step_and_cta_barriers()
    assert torch.equal(y, y_plain) and with_pass < without_pass
    assert_tokens_close(y, reference_moe(layer, x.float().cpu(), index.cpu(), weight.float().cpu()))


@cuda_only
@pytest.mark.gpu
@pytest.mark.parametrize(("tokens", "top_k"), [(2, 8), (8, 4)])
@pytest.mark.parametrize(
    ("act", "biased", "dtype"), [("silu", False, torch.bfloat16), ("gpt_oss", True, torch.float16)]
)
def test_the_tensor_core_pair_passes_its_activations_t_major(tokens, top_k, act, biased, dtype):
    """moe_pair on tensor cores: moe_up stores the activations t-major (exactly ``t_major`` of the
    plain order), moe_down reads them so to the same result bit for bit, and the step matches the
    float64 exact decode, up to CONFIG.max_tokens tokens (GPT-OSS's 90 groups: masked chunks)."""
    from modelfleet.engine.formats import mma_moe, triton_moe

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the tensor-core MXFP4 kernels run on compute capability 9 (Hopper)")
    layer = mxfp4_layer(8, 2880, 352, ACTIVATIONS[act], biased)
    generator = torch.Generator().manual_seed(tokens * top_k)
    index = torch.stack([torch.randperm(8, generator=generator)[:top_k] for _ in range(tokens)])
    weight = torch.softmax(torch.randn(tokens, top_k, generator=generator), dim=-1).to(dtype)
    x = torch.randn(tokens, 2880, generator=generator).to(dtype).cuda()
    gate_up, down, kind = layer.fused_kernels(x)
    assert tokens <= CONFIG.max_tokens and mma_moe.up_applies(x, index.cuda(), gate_up)
    act_ = Activation(*kind)
    bias_up, bias_down = layer.gate_up_bias, layer.down_bias
    plain = mma_moe.moe_up(x, index.cuda(), gate_up, bias_up, act_)
    stored = mma_moe.moe_up(x, index.cuda(), gate_up, bias_up, act_, t_major=True)
    assert torch.equal(stored, mma_moe.t_major(plain))
    y = mma_moe.moe_down(stored, index.cuda(), weight.cuda(), down, bias_down, t_major=True)
    assert torch.equal(y, mma_moe.moe_down(plain, index.cuda(), weight.cuda(), down, bias_down))
    pair = triton_moe.moe_pair(x, index.cuda(), weight.cuda(), gate_up, down, bias_up, bias_down, act_)
    assert torch.equal(pair, y) and torch.equal(layer(x, index.cuda(), weight.cuda()), y)
    assert_tokens_close(y, reference_moe(layer, x.float().cpu(), index, weight.float()))


@cuda_only
@pytest.mark.gpu
def test_the_tensor_core_mxfp4_kernels_leave_other_steps_to_triton():
    """A top_k that is not a power of two, or more tokens than CONFIG.max_tokens, run on the Triton
    kernels, with the same results."""
    from modelfleet.engine.formats import mma_moe

    layer = mxfp4_layer(4, 512, 256, silu_glu, False)
    for tokens, top_k in ((1, 3), (CONFIG.max_tokens + 1, 2)):
        x = torch.randn(tokens, 512).to(torch.bfloat16)
        index = torch.stack([torch.randperm(4)[:top_k] for _ in range(tokens)])
        weight = torch.softmax(torch.randn(tokens, top_k), dim=-1).to(torch.bfloat16)
        gate_up, down, _ = layer.fused_kernels(x.cuda())
        assert not mma_moe.up_applies(x.cuda(), index.cuda(), gate_up)
        assert not mma_moe.down_applies(x.cuda(), index.cuda(), down)
        y = layer(x.cuda(), index.cuda(), weight.cuda())
        assert_tokens_close(y, reference_moe(layer, x.float(), index, weight.float()))


def run_ptx(text: str, regs: dict) -> dict:
    """A model of the few PTX instructions the tensor-core kernels' decode uses (integer: shl, shr,
    and, or, lop3, prmt, mov of a b64 into two b32 or of a b32 into two b16, setp.lt / gt / eq, selp,
    max of u32, u16 and u16x2, cvt.u32.u16; float: cvt.f32 of bf16 / f16, mul.f32,
    cvt.rn.f16x2.f32, on bit patterns), run over ``text`` with ``regs`` (names, $n or %laneid ->
    int) as inputs; returns the registers."""
    regs = dict(regs)

    def f32(bits: int) -> np.ndarray:
        return np.array(bits, dtype=np.uint32).view(np.float32)

    def f16_bits(value: np.ndarray) -> int:
        return int(np.array(value, dtype=np.float32).astype(np.float16).view(np.uint16))

    def value(operand: str) -> int:
        operand = operand.strip()
        return regs[operand] if operand in regs else int(operand, 0) & 0xFFFFFFFF

    for statement in filter(None, (part.strip(" \n{}") for part in text.split(";"))):
        op, _, rest = statement.partition(" ")
        if op == ".reg":
            continue
        if op in ("mov.b64", "mov.b32") and rest.lstrip().startswith("{"):  # unpack into two halves
            pair, source = rest.split("}")
            lo, hi = (name.strip() for name in pair.strip(" {").split(","))
            bits, half = value(source.strip(" ,")), 32 if op == "mov.b64" else 16
            regs[lo], regs[hi] = bits & ((1 << half) - 1), bits >> half
            continue
        dst, *args = (operand.strip() for operand in rest.split(","))
        if op == "shl.b32":
            regs[dst] = (value(args[0]) << value(args[1])) & 0xFFFFFFFF
        elif op == "shr.u32":
            regs[dst] = value(args[0]) >> value(args[1])
        elif op == "and.b32":
            regs[dst] = value(args[0]) & value(args[1])
        elif op == "or.b32":
            regs[dst] = value(args[0]) | value(args[1])
        elif op in ("max.u32", "max.u16"):
            regs[dst] = max(value(args[0]), value(args[1]))
        elif op == "max.u16x2":
            a, b = value(args[0]), value(args[1])
            regs[dst] = max(a & 0xFFFF, b & 0xFFFF) | max(a >> 16, b >> 16) << 16
        elif op == "cvt.rn.f32.u32":
            regs[dst] = int(np.array(float(value(args[0])), dtype=np.float32).view(np.uint32))
        elif op == "cvt.u32.u16":
            regs[dst] = value(args[0]) & 0xFFFF
        elif op == "setp.lt.u32":
            regs[dst] = int(value(args[0]) < value(args[1]))
        elif op == "setp.gt.u32":
            regs[dst] = int(value(args[0]) > value(args[1]))
        elif op == "setp.eq.u32":
            regs[dst] = int(value(args[0]) == value(args[1]))
        elif op == "prmt.b32":  # default mode: byte k of the result is byte sel_k (0..7) of {b, a}
            source, selector = value(args[0]) | value(args[1]) << 32, value(args[2])
            regs[dst] = sum((source >> 8 * (selector >> 4 * k & 7) & 0xFF) << 8 * k for k in range(4))
            assert not selector & 0x8888, "sign-replicate selectors are not modelled"
        elif op == "selp.b32":
            regs[dst] = value(args[0]) if regs[args[2]] else value(args[1])
        elif op in ("mov.b32", "mov.u32"):
            regs[dst] = value(args[0])
        elif op in ("cvt.f32.bf16", "cvt.f32.f16"):
            bits = value(args[0])
            regs[dst] = (
                bits << 16
                if op.endswith("bf16")
                else int(np.array(bits, np.uint16).view(np.float16).astype(np.float32).view(np.uint32))
            )
        elif op == "mul.f32":
            regs[dst] = int((f32(value(args[0])) * f32(value(args[1]))).view(np.uint32))
        elif op == "cvt.rn.f16x2.f32":
            regs[dst] = f16_bits(f32(value(args[0]))) << 16 | f16_bits(f32(value(args[1])))
        elif op == "lop3.b32":
            a, b, c, lut = (value(arg) for arg in args)
            regs[dst] = _lop3(a, b, c, lut)
        else:
            raise AssertionError(f"no model of {op}")
    return regs


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    """LOP3.LUT: bit i of the result is bit (4 a_i + 2 b_i + c_i) of lut (a = 0xF0, b = 0xCC, c = 0xAA)."""
    return sum(((lut >> ((a >> i & 1) << 2 | (b >> i & 1) << 1 | (c >> i & 1))) & 1) << i for i in range(32))


def e2m1(code: int) -> float:
    """The OCP MX spec's E2M1: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0."""
    exponent, mantissa = (code >> 1) & 3, code & 1
    magnitude = mantissa * 0.5 if exponent == 0 else 2.0 ** (exponent - 1) * (1 + mantissa / 2)
    return -magnitude if code & 8 else magnitude


_CONVERSION = """\
\tst.shared.v4.b32 \t[%r{a}], {{%r1, %r2, %r3, %r4}};
\tadd.s32 \t%r9, %r8, 1;
\tst.shared.v4.b32 \t[%r{b}+4096], {{%r5, %r6, %r7, %r8}};
\tbar.warp.sync \t-1;
\tldmatrix.sync.aligned.m8n8.x4.shared.b16 {{%r10, %r11, %r12, %r13}}, [%r{c}];
\tld.global.v2.b32 \t{{%r20, %r21}}, [%rd1];
\tldmatrix.sync.aligned.m8n8.x4.shared.b16 {{%r14, %r15, %r16, %r17}}, [%r{d}];"""


def _conversion(a: int = 233, b: int = 235, c: int = 240, d: int = 242) -> str:
    return _CONVERSION.format(a=a, b=b, c=c, d=d)


def test_the_ptx_pass_makes_only_a_warp_local_conversions_reuse_guard_a_warp_barrier():
    """The PTX pass (``mma_moe.warp_barriers``): a CTA barrier between two warp-local conversions at
    the same addresses (each warp rewrites only what it read back) becomes a warp barrier; one
    before a conversion at other addresses, before a cross-warp exchange (a CTA barrier between its
    stores and loads), before stmatrix, or after other shared-memory work stays."""
    mma_moe = pytest.importorskip("modelfleet.engine.formats.mma_moe", reason="needs triton")
    cta, warp = "\tbar.sync \t0;", "\tbar.warp.sync \t-1;"
    same = "\n".join([_conversion(), cta, "\tmul.lo.s32 \t%r30, %r9, 3;", _conversion(), cta, _conversion()])
    out, n = mma_moe.warp_barriers(same)
    assert n == 2 and out == same.replace(cta, warp)
    unchanged = [
        "\n".join([_conversion(), cta, _conversion(a=250)]),  # another conversion's stores
        "\n".join([_conversion(), cta, _conversion(c=251)]),  # its loads elsewhere
        "\n".join([_conversion(), cta, _conversion().replace("bar.warp.sync \t-1", "bar.sync \t0")]),  # cross-warp
        "\n".join([_conversion(), cta, "\tstmatrix.sync.aligned.m8n8.x1.shared.b16 [%r263], {%r258};"]),
        "\n".join([_conversion(), "\tst.shared.b32 \t[%r40], %r41;", cta, _conversion()]),
        "\n".join([_conversion(), cta, "\tld.shared.b32 \t%r42, [%r40];", _conversion()]),
    ]
    for ptx in unchanged:
        assert mma_moe.warp_barriers(ptx) == (ptx, 0)


def test_the_tensor_core_decode_makes_exact_f16_pairs_in_a_ptx_model():
    """mma_moe's A registers: nibbles i and i + 4 of a code word become one f16 pair equal to
    2^-14 x their E2M1 values, for every code in either half (the asm text the GPU runs, in a model
    of its integer instructions)."""
    mma_moe = pytest.importorskip("modelfleet.engine.formats.mma_moe", reason="needs triton")
    f16 = {c: int(np.array(e2m1(c) * 2.0**-14, dtype=np.float16).view(np.uint16)) for c in range(16)}
    words = [sum(((k + j * 5 + (k >> 4) * 3) % 16) << (4 * j) for j in range(8)) for k in range(256)]
    words += [int(w) for w in np.random.default_rng(3).integers(0, 2**32, 512)]  # neighbours' signs too
    words += [0xFFFFFFFF, 0x88888888, 0x77777777, 0xF0F0F0F0, 0x0F0F0F0F]
    for w in words:
        regs = run_ptx(mma_moe._EO.format(w="$2", e="e", o="o"), {"$2": w})
        for i in range(4):
            a = run_ptx(mma_moe._pair(i, "e", "o", "a"), regs)["a"]
            assert a & 0xFFFF == f16[(w >> 4 * i) & 15], (i, hex(w))
            assert a >> 16 == f16[(w >> (4 * i + 16)) & 15], (i, hex(w))


def test_the_tensor_core_int4_decode_and_scales_in_a_ptx_model():
    """mma_moe's int4 A registers: nibbles i and i + 4 of a word become the f16 subnormals q x 2^-24
    (bits q) for even i and 16 q x 2^-24 for odd i (the B registers they meet hold the inputs / 16),
    in the asm moe_up runs and from moe_down's halfway-decoded words (w, w >> 8) alike; a row's
    operand of two fp16 scales and two zero points reads back as float32."""
    mma_moe = pytest.importorskip("modelfleet.engine.formats.mma_moe", reason="needs triton")
    words = [sum(((k + j * 5 + (k >> 4) * 3) % 16) << (4 * j) for j in range(8)) for k in range(256)]
    assert "shr.u32 ea, $16, 8;" in mma_moe.CHUNK_ASM_INT4.value
    for w, i in itertools.product(words, range(4)):
        a = run_ptx("shr.u32 w8, $2, 8; " + mma_moe._pair_int4(i, "$2", "w8", "a"), {"$2": w})["a"]
        unit = 16 if i % 2 else 1
        assert (a & 0xFFFF, a >> 16) == (unit * (w >> 4 * i & 15), unit * (w >> (4 * i + 16) & 15)), (i, hex(w))
        predecoded = w >> 8 if w < 1 << 31 else (w >> 8) | 0xFF000000  # gluon's w >> 8 on int32
        assert run_ptx(mma_moe._pair_int4(i, "$2", "$3", "a"), {"$2": w, "$3": predecoded})["a"] == a
    text = mma_moe._SCALES_INT4.format(e="$8", s0="s0", s1="s1", z0="z0", z1="z1")
    assert mma_moe._SCALES_INT4.format(e="$64", s0="sa0", s1="sa1", z0="z0", z1="z1") in mma_moe.CHUNK_ASM_INT4.value
    bits = lambda v: int(np.array(v, dtype=np.float32).view(np.uint32))  # noqa: E731
    for s0, s1, z0, z1 in (
        (0.013, -2.5e-3, 0, 15),
        (6.1e-5, 1.0, 255, 8),
        *((1.0, 1.0, z, 255 - z) for z in range(256)),
    ):
        h0, h1 = (int(np.array(v, dtype=np.float16).view(np.uint16)) for v in (s0, s1))
        regs = run_ptx(text, {"$8": h0 | h1 << 16 | (z0 | z1 << 8 | 0xAB0000) << 32})
        assert [regs[r] for r in ("s0", "s1")] == [bits(np.float16(v)) for v in (s0, s1)]
        assert [regs[r] for r in ("z0", "z1")] == [bits(z0), bits(z1)]


@pytest.mark.parametrize("kind", ["bf16", "f16"])
def test_the_tensor_core_inputs_pair_as_the_codes_do_in_a_ptx_model(kind):
    """mma_moe's B registers: a lane's 8 inputs x[4i + t] (i = 0..7), times the warp's 2^-k ($12;
    pairs 1 and 3 times $13, int4's 2^-k / 16), become the f16 pairs (x[4i + t], x[4i + 16 + t])
    for i = 0..3, low half first, as the A registers pair nibbles i and i + 4; rounded to nearest
    even."""
    mma_moe = pytest.importorskip("modelfleet.engine.formats.mma_moe", reason="needs triton")
    text = (mma_moe.PACK_BF16 if kind == "bf16" else mma_moe.PACK_F16).value
    generator = torch.Generator().manual_seed(3)
    dtype = torch.bfloat16 if kind == "bf16" else torch.float16
    for k in (0, 3):
        x = (torch.randn(8, generator=generator) * 4).to(dtype)
        x[5] = 2.0**-20  # an f16 subnormal once converted
        bits = x.view(torch.int16).to(torch.int32) & 0xFFFF
        scale = 2.0**-k
        regs = {f"${4 + i}": int(bits[i]) for i in range(8)}
        regs["$12"] = int(np.array(scale, dtype=np.float32).view(np.uint32))
        regs["$13"] = int(np.array(scale / 16, dtype=np.float32).view(np.uint32))
        out = run_ptx(text, regs)
        for i in range(4):
            times = scale / 16 if i % 2 else scale
            lo = np.array(float(x[i]) * times, dtype=np.float32).astype(np.float16)
            hi = np.array(float(x[i + 4]) * times, dtype=np.float32).astype(np.float16)
            assert out[f"${i}"] == int(hi.view(np.uint16)) << 16 | int(lo.view(np.uint16)), (kind, k, i)


@pytest.mark.parametrize("kind", ["bf16", "f16"])
def test_the_tensor_core_inputs_pair_the_same_from_t_major_activations_in_a_ptx_model(kind):
    """moe_down's B registers from activations stored t-major (``mma_moe.t_major``): a lane's two
    8-byte loads (four words of x'[8t .. 8t + 7]) pack into the same f16 pairs as its 8 inputs
    x[4i + t] do, and give the same largest |x| (the warp's input scale)."""
    mma_moe = pytest.importorskip("modelfleet.engine.formats.mma_moe", reason="needs triton")
    pack, pack_words = (
        (mma_moe.PACK_BF16, mma_moe.PACK_W_BF16) if kind == "bf16" else (mma_moe.PACK_F16, mma_moe.PACK_W_F16)
    )
    dtype = torch.bfloat16 if kind == "bf16" else torch.float16
    generator = torch.Generator().manual_seed(5)
    a = (torch.randn(2, 64, generator=generator) * 3).to(dtype)  # two pairs' activations, two groups
    bits = a.view(torch.int16).to(torch.int32) & 0xFFFF
    stored = mma_moe.t_major(a).view(torch.int16).to(torch.int32) & 0xFFFF
    scale, odd = (int(np.array(v, dtype=np.float32).view(np.uint32)) for v in (0.5, 0.5 / 16))
    for pair, group, t in itertools.product(range(2), range(2), range(4)):
        x = [int(bits[pair, 32 * group + 4 * i + t]) for i in range(8)]  # the lane's 8 inputs
        lane = stored[pair, 32 * group + 8 * t : 32 * group + 8 * t + 8].tolist()  # its 16 contiguous bytes
        words = {f"${4 + j}": lane[2 * j] | lane[2 * j + 1] << 16 for j in range(4)}
        expected = run_ptx(pack.value, {**{f"${4 + i}": x[i] for i in range(8)}, "$12": scale, "$13": odd})
        got = run_ptx(pack_words.value, {**words, "$8": scale, "$9": odd})
        assert [got[f"${i}"] for i in range(4)] == [expected[f"${i}"] for i in range(4)], (kind, pair, group, t)
        magnitude = run_ptx(mma_moe.MAGNITUDE_W.value, {f"${1 + j}": words[f"${4 + j}"] for j in range(4)})["$0"]
        assert magnitude == max(v & 0x7FFF for v in x), (kind, pair, group, t)


def test_the_tensor_core_scales_are_exact_powers_of_two_in_a_ptx_model():
    """mma_moe's E8M0 scales: lane t takes bytes 2t and 2t + 1 of a row's 8 (the groups whose sums
    it holds) as float32 2^(e - 127), e = 0 included (2^-127, subnormal), and its predicate p_t."""
    mma_moe = pytest.importorskip("modelfleet.engine.formats.mma_moe", reason="needs triton")
    text = mma_moe._LANE + mma_moe._SCALES.format(e="$8", s0="s0", s1="s1")
    assert mma_moe._LANE in mma_moe.CHUNK_ASM.value
    assert mma_moe._SCALES.format(e="$64", s0="sa0", s1="sa1") in mma_moe.CHUNK_ASM.value
    power = {e: int(np.array(2.0 ** (e - 127), dtype=np.float32).view(np.uint32)) for e in range(255)}
    for e, lane in itertools.product(range(255), range(0, 32, 3)):
        t = lane % 4
        row = [(e + 37 * j) % 255 for j in range(8)]
        row[2 * t] = e
        regs = run_ptx(text, {"$8": sum(b << (8 * j) for j, b in enumerate(row)), "%laneid": lane})
        assert (regs["s0"], regs["s1"]) == (power[e], power[row[2 * t + 1]]), (e, lane)
        assert [regs[f"p{k}"] for k in range(4)] == [int(k == t) for k in range(4)], lane


@cuda_matmul_cases(FUSED)
def test_a_nibble_major_bank_runs_every_cuda_path(name, rows, dtype):
    """Once prepared for CUDA, a bank's gathered and per-expert matmuls read the nibble-major codes."""
    weight = bank(name, (EXPERTS, 200, 512), seed=5).to("cuda")
    x = torch.randn(rows, 512).to(dtype)
    weight.prepare_for(x.cuda())
    assert weight.fused_bank() is not None
    decoded = weight.dequantize().cpu().double()
    y = weight.expert_matmul(3, x.cuda()).cpu().double()
    torch.testing.assert_close(y, x.double() @ decoded[3].T, rtol=2e-2, atol=2e-2 * float(y.abs().max()))
    index = torch.tensor([5, 0] * rows)[: 2 * rows]
    pairs = weight.gathered_matmul(x.cuda(), index.cuda(), 2).cpu().double()
    expected = torch.stack([x[p // 2].double() @ decoded[int(index[p])].T for p in range(index.numel())])
    torch.testing.assert_close(pairs, expected, rtol=2e-2, atol=2e-2 * float(expected.abs().max()))


@interpreted
@pytest.mark.parametrize("name", FUSED)
def test_the_fused_moe_kernels_in_the_interpreter(name):
    from modelfleet.engine.formats import triton_moe

    layer = moe_layer(name, ACTIVATIONS["gpt_oss"], True, "cpu")
    for weight in (layer.gate_up, layer.down):
        weight.to_nibble_major()  # type: ignore[attr-defined]
    gate_up, down = layer.gate_up.fused_bank, layer.down.fused_bank
    assert gate_up() is None  # CPU tensors: not for the engine; built by hand below

    def packed(w: QuantizedWeight) -> PackedBank:
        if isinstance(w, MXFP4Weight):
            return PackedBank(w._major, w.scales, None, mxfp4=True)
        assert isinstance(w, Int4Weight)
        zeros = None if w.symmetric else w.zero_points()
        return PackedBank(w._major_codes, w.scales, zeros, mxfp4=False)

    index, weight = routing(3, seed=0)
    x = torch.randn(3, HIDDEN)  # float32: the interpreter's bf16 arithmetic is numpy's float32 anyway
    act = Activation(2, 1.702, 7.0)
    a = triton_moe.moe_up(x, index, packed(layer.gate_up), layer.gate_up_bias, act)
    y = triton_moe.moe_down(a, index, weight, packed(layer.down), layer.down_bias)
    assert_tokens_close(y, reference_moe(layer, x, index, weight), tolerance=5e-5)  # the decode costs ~1e-5
    assert down() is None


@interpreted
@pytest.mark.parametrize("name", FUSED)
def test_the_per_matmul_kernels_read_nibble_major_codes_in_the_interpreter(name):
    from modelfleet.engine.formats import triton_kernels

    weight = bank(name, (3, 80, 96), seed=4)
    mxfp4 = isinstance(weight, MXFP4Weight)
    zeros = None if mxfp4 or weight.symmetric else weight.zero_points()  # type: ignore[attr-defined]
    major = to_nibble_major(stored_codes(weight))
    decoded = weight.dequantize().double()
    index, x = torch.tensor([2, 0, 1, 1]), torch.randn(2, 96)
    pairs = triton_kernels.nibble_gemv(x, major, weight.scales, zeros, index, 2, mxfp4=mxfp4, nibble_major=True)
    expected = torch.stack([x[p // 2].double() @ decoded[int(index[p])].T for p in range(4)])
    torch.testing.assert_close(pairs.double(), expected, rtol=1e-5, atol=1e-5)
    rows = torch.randn(20, 96)
    e_zeros = None if zeros is None else zeros[1]
    if mxfp4:
        y = triton_kernels.mxfp4_matmul(rows, major[1], weight.scales[1], nibble_major=True)
    else:
        y = triton_kernels.int4_matmul(rows, major[1], weight.scales[1], e_zeros, nibble_major=True)
    torch.testing.assert_close(y.double(), rows.double() @ decoded[1].T, rtol=1e-5, atol=1e-5)


@interpreted
@pytest.mark.parametrize("wide", [False, True], ids=["one-warp", "wide"])
@pytest.mark.parametrize("name", FUSED)
def test_the_fused_moe_kernels_loop_over_chunks_of_groups_in_the_interpreter(name, wide, monkeypatch):
    """K = 2112 inputs is 66 groups: a chunk of 64 (a lane's two groups) and a masked one of 2; for
    moe_up's wide programs (warps along the rows) chunks of 32: two pairs, the second pair's second
    chunk absent."""
    from modelfleet.engine.formats import triton_moe

    monkeypatch.setattr(triton_moe, "_UP_FIXED", {"ROWS": 4 if wide else 2, "WIDE": wide})

    k, rows, experts = 2112, 8, 3
    gate_up = bank(name, (experts, 2 * rows, k), seed=8)
    down = bank(name, (experts, rows, k), seed=9)
    banks = []
    for weight in (gate_up, down):
        weight.to_nibble_major()  # type: ignore[attr-defined]
        if isinstance(weight, MXFP4Weight):
            banks.append(PackedBank(weight._major, weight.scales, None, mxfp4=True))
        else:
            assert isinstance(weight, Int4Weight)
            zeros = None if weight.symmetric else weight.zero_points()
            banks.append(PackedBank(weight._major_codes, weight.scales, zeros, mxfp4=False))
    index = torch.tensor([[2, 0], [1, 2]])
    weight = torch.tensor([[0.25, 0.75], [0.5, 0.5]])
    generator = torch.Generator().manual_seed(10)
    x, a = torch.randn(2, k, generator=generator), torch.randn(4, k, generator=generator)
    up = triton_moe.moe_up(x, index, banks[0], None, Activation(ACT_SILU))
    h = torch.stack([gate_up.dequantize()[int(e)].double() @ x[p // 2].double() for p, e in enumerate(index.flatten())])
    assert_tokens_close(up, silu_glu(h), tolerance=5e-5)
    y = triton_moe.moe_down(a, index, weight, banks[1], None)
    decoded = down.dequantize().double()
    expected = torch.stack(
        [
            sum(float(weight[t, j]) * (decoded[int(index[t, j])] @ a[2 * t + j].double()) for j in range(2))
            for t in range(2)
        ]
    )
    assert_tokens_close(y, expected, tolerance=5e-5)


@interpreted
@pytest.mark.parametrize("name", FUSED)
def test_moe_down_takes_a_configured_chunk_of_groups_in_the_interpreter(name, monkeypatch):
    """768 inputs are 24 groups: the bank's one chunk of 32 (8 masked) or, configured, three
    chunks of 8 whose codes are all loaded before the wait; both give the exact-decode sums. A
    chunk that does not divide the groups, or would need more than CONFIG.max_down_chunks loads, falls
    back to the bank's."""
    from modelfleet.engine.formats import triton_moe

    k, rows, experts = 768, 8, 3
    down = bank(name, (experts, rows, k), seed=11)
    down.to_nibble_major()  # type: ignore[attr-defined]
    if isinstance(down, MXFP4Weight):
        packed = PackedBank(down._major, down.scales, None, mxfp4=True)
    else:
        assert isinstance(down, Int4Weight)
        zeros = None if down.symmetric else down.zero_points()
        packed = PackedBank(down._major_codes, down.scales, zeros, mxfp4=False)
    meta = triton_moe._bank_launch(packed)[2]
    assert triton_moe._down_meta(packed, meta, {"CHUNK": 8})["EARLY"] == 3
    assert triton_moe._down_meta(packed, meta, {"ROWS": 2}) == {**meta, "ROWS": 2, "EARLY": 1}  # the bank's chunk
    assert triton_moe._down_meta(packed, meta, {"CHUNK": 16}) == {**meta, "CHUNK": 32, "EARLY": 1}  # 24 % 16
    assert triton_moe._down_meta(packed, meta, {"CHUNK": 4})["CHUNK"] == 32  # 6 loads
    index = torch.tensor([[2, 0], [1, 2]])
    weight = torch.tensor([[0.25, 0.75], [0.5, 0.5]])
    a = torch.randn(4, k, generator=torch.Generator().manual_seed(12))
    decoded = down.dequantize().double()
    expected = torch.stack(
        [
            sum(float(weight[t, j]) * (decoded[int(index[t, j])] @ a[2 * t + j].double()) for j in range(2))
            for t in range(2)
        ]
    )
    for config in ({"ROWS": 2}, {"ROWS": 2, "CHUNK": 8}):
        monkeypatch.setattr(triton_moe, "_DOWN_FIXED", config)
        assert_tokens_close(triton_moe.moe_down(a, index, weight, packed, None), expected, tolerance=5e-5)


@interpreted
def test_the_measured_launch_configurations_fit_the_kernels_in_the_interpreter():
    """The measured (moe_up, moe_down) configurations name the kernels' own parameters with
    values their layouts need; a slip there would only show on the GPUs they are for. Checked
    where triton is installed (the interpreter run)."""
    from modelfleet.engine.formats import triton_moe

    launch = {"num_warps"}
    up_params = set(triton_moe._moe_up_kernel.arg_names) | launch
    down_params = set(triton_moe._moe_down_kernel.arg_names) | launch
    assert triton_moe.MEASURED, "no measured configurations"
    for (major, mxfp4), entries in triton_moe.MEASURED.items():
        bounds = [bound for bound, _, _ in entries]
        assert bounds and bounds == sorted(set(bounds)) and bounds[0] >= 1, f"token bounds {bounds}"
        for bound, up, down in entries:
            where = f"MEASURED[({major}, {mxfp4})], up to {bound} tokens"
            assert major >= 7 and isinstance(mxfp4, bool), where
            assert set(up) == {"ROWS", "WIDE", "num_warps"} <= up_params, f"{where}: moe_up keys {sorted(up)}"
            assert {"ROWS", "num_warps"} <= set(down) <= {"ROWS", "num_warps", "CHUNK"}, f"{where}: moe_down {down}"
            assert set(down) <= down_params, f"{where}: moe_down keys {sorted(down)}"
            for config in (up, down):
                for key in ("ROWS", "num_warps", "CHUNK"):
                    if key not in config:
                        continue
                    value = config[key]
                    assert value >= 1 and value & (value - 1) == 0, f"{where}: {key} {value} is not a power of two"
            if up["WIDE"]:  # warps go along the rows: at least one row per warp
                assert up["ROWS"] >= up["num_warps"] > 1, f"{where}: WIDE moe_up needs ROWS >= num_warps > 1, got {up}"
            else:
                assert up["num_warps"] == 1, f"{where}: a one-warp moe_up with {up['num_warps']} warps"


@interpreted
def test_the_measured_configurations_are_chosen_by_token_count_in_the_interpreter(monkeypatch):
    """The first entry whose token bound covers the step, the last beyond every bound, none for a
    device without entries."""
    from modelfleet.engine.formats import triton_moe

    one, eight = ({"ROWS": 1}, {"ROWS": 2}), ({"ROWS": 4}, {"ROWS": 8})
    monkeypatch.setattr(triton_moe, "MEASURED", {(9, True): [(1, *one), (8, *eight)]})
    assert triton_moe.measured_configs(9, True, 1) == one
    assert triton_moe.measured_configs(9, True, 2) == eight
    assert triton_moe.measured_configs(9, True, 64) == eight
    assert triton_moe.measured_configs(9, False, 1) is None
    assert triton_moe.measured_configs(8, True, 1) is None


@interpreted
def test_moe_down_is_held_to_its_register_cap_where_its_words_fit_in_the_interpreter():
    """MXFP4's moe_down at one token is held to ``CONFIG.down_regs_mxfp4`` registers where a warp's code
    words fit under it (Qwen3's 768-wide experts: 3 chunks of 8 groups), not for GPT-OSS's 2880 (12
    chunks, which spill even uncapped), nor from two tokens on, nor for int4."""
    from types import SimpleNamespace

    from modelfleet.engine.formats import mma_moe

    def regs(inter: int, mxfp4: bool, tokens: int) -> dict[str, int]:
        return mma_moe._down_regs(SimpleNamespace(in_features=inter, mxfp4=mxfp4), tokens)  # type: ignore[arg-type]

    cap = {"maxnreg": CONFIG.down_regs_mxfp4}
    assert regs(768, True, 1) == cap and regs(256, True, 1) == cap
    assert regs(2880, True, 1) == {} and regs(768, True, 2) == {} and regs(768, False, 1) == {}


@interpreted
def test_only_int4_predecodes_and_only_one_token_evicts_its_scales_first_in_the_interpreter():
    """At one token int4's moe_down decodes every chunk halfway before its wait and the scales and
    zero points are loaded evict-first; MXFP4 predecodes nothing (it is register-capped instead),
    and from two tokens on neither happens."""
    from types import SimpleNamespace

    from modelfleet.engine.formats import mma_moe

    def predecoded(inter: int, mxfp4: bool, tokens: int) -> int:
        return mma_moe._predecoded(SimpleNamespace(in_features=inter, mxfp4=mxfp4), tokens)  # type: ignore[arg-type]

    assert predecoded(768, False, 1) == 3 and predecoded(2880, False, 1) == 12
    assert predecoded(768, True, 1) == 0 and predecoded(768, False, 2) == 0
    assert mma_moe._scales_evict(1) == "evict_first" and mma_moe._scales_evict(2) == ""
    with pytest.raises(ValueError, match="int4"):
        mma_moe._chunk_asm(pre=True)


def test_importing_the_kernels_leaves_triton_alone_until_install_ptx_pass_chains_it_once():
    """``import mma_moe`` sets no Triton hook. ``install_ptx_pass()`` chains the hook set before it
    (called first, with the same arguments) and makes the PTX stage rewrite the marked kernels'
    barriers (only theirs); a second call changes nothing. In a fresh process: the import is the
    point."""
    pytest.importorskip("triton", reason="needs triton")
    same = "\n".join([_conversion(), "\tbar.sync \t0;", _conversion()])
    script = f"""
from triton import knobs
assert knobs.runtime.add_stages_inspection_hook is None
from modelfleet.engine.formats import mma_moe, triton_moe
assert knobs.runtime.add_stages_inspection_hook is None, "the import installed a hook"
seen = []
knobs.runtime.add_stages_inspection_hook = lambda *args: seen.append(args)
mma_moe.install_ptx_pass()
hook = knobs.runtime.add_stages_inspection_hook
mma_moe.install_ptx_pass()
assert knobs.runtime.add_stages_inspection_hook is hook, "installed twice"
stages = {{"ptx": lambda src, metadata: src}}
hook("backend", stages, "options", "language", 90)
assert [args[1] is stages for args in seen] == [True], seen
marked = mma_moe.WARP_BARRIERS_MARK + "\\n" + {same!r}
assert stages["ptx"](marked, None) == mma_moe.warp_barriers(marked)[0] != marked
assert stages["ptx"]({same!r}, None) == {same!r}
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)


@pytest.mark.parametrize(
    ("field", "value"), [("max_chunk", 48), ("gemm_block_n", 0), ("max_tokens", -1), ("down_regs_mxfp4", 1.5)]
)
def test_the_kernel_config_rejects_a_bad_tunable_naming_it(field, value):
    with pytest.raises(ValueError, match=f"KernelConfig.{field}"):
        KernelConfig(**{field: value})
    assert KernelConfig() == CONFIG  # the one in use is the defaults


def _read_bound_module():  # type: ignore[no-untyped-def]
    """benchmarks/read_bound.py (the formats benchmark's read bound), loaded by path."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "benchmarks" / "read_bound.py"
    spec = importlib.util.spec_from_file_location("read_bound", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_read_bound_reads_each_routed_slab(device: str) -> None:
    """Every program folds (xor) its 16 KB chunk of one routed expert's slab of one tensor: the
    folds equal the same chunks' folds taken in torch, so the bound reads exactly those bytes."""
    read_bound = _read_bound_module()
    generator = torch.Generator().manual_seed(7)
    tensors = [
        torch.randint(-(2**31), 2**31 - 1, (6, 3, 1000), generator=generator, dtype=torch.int32),  # 1 chunk, masked
        torch.randn(6, 100, 100, generator=generator).half(),  # 5000 words: 2 chunks
        torch.randint(0, 256, (6, 10, 40), generator=generator, dtype=torch.uint8),  # 100 words
    ]
    index = torch.tensor([[4, 1], [1, 5]])
    reader = read_bound.SlabReader([t.to(device) for t in tensors])
    folds = reader(index.to(device))[: index.numel() * reader.chunks].cpu().view(index.numel(), reader.chunks)
    chunk = read_bound.CHUNK
    for p, expert in enumerate(index.flatten().tolist()):
        expected = []
        for t in tensors:
            words = read_bound.slab_words(t)[expert]
            words = torch.cat([words, words.new_zeros(-words.numel() % chunk)]).view(-1, chunk)
            expected += np.bitwise_xor.reduce(words.numpy(), axis=1).tolist()
        assert folds[p].tolist() == expected, p


@interpreted
def test_the_read_bound_reads_each_routed_slab_in_the_interpreter():
    check_read_bound_reads_each_routed_slab("cpu")


@cuda_only
def test_the_read_bound_reads_each_routed_slab_on_the_gpu():
    check_read_bound_reads_each_routed_slab("cuda")
