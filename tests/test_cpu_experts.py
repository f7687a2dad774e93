"""The compiled CPU expert kernel (engine/kernels/cpu_experts.c) against the exact decode: int4,
int4_sym and MXFP4 banks, our code order and the CUDA kernels' nibble-major one, SiLU and GPT-OSS's
GLU with biases; and the store's builder over a bank's tensors (the pinned mirror's names)."""

from __future__ import annotations

import os

import pytest
import torch

from modelfleet.engine.expert_store import _bank_tensors, compiled_cpu_share, compiled_kernel_takes
from modelfleet.engine.formats import quantize
from modelfleet.engine.formats.base import nibble_major_bank, unpack_nibbles
from modelfleet.engine.kernels import cpu_experts
from modelfleet.engine.kernels.grouped_moe import ACT_CLAMPED_SWIGLU, ACT_SILU
from modelfleet.engine.layers import ClampedSwiGLU, Experts, silu_glu
from modelfleet.engine.quantize import QuantizedExperts

pytestmark = pytest.mark.skipif(not cpu_experts.available(), reason=f"{cpu_experts.unavailable_reason()}")

E, H, I = 6, 128, 64  # noqa: E741  (I: the expert width)
GPT_OSS = ClampedSwiGLU(1.702, 7.0)


def bank_of(fmt: str, gpt_oss: bool, seed: int = 0) -> QuantizedExperts:
    g = torch.Generator().manual_seed(seed)
    gate_up = quantize(torch.randn(E, 2 * I, H, generator=g) * 0.05, fmt)
    down = quantize(torch.randn(E, H, I, generator=g) * 0.05, fmt)
    biases = (
        (torch.randn(E, 2 * I, generator=g) * 0.1, torch.randn(E, H, generator=g) * 0.1) if gpt_oss else (None, None)
    )
    return QuantizedExperts(gate_up, down, *biases, GPT_OSS if gpt_oss else silu_glu)


def projection(weight, bias: torch.Tensor | None, major: bool) -> cpu_experts.PackedProjection:  # type: ignore[no-untyped-def]
    if weight.format == "mxfp4":
        codes, zeros = weight._blocks.reshape(E, weight.shape[1], -1), None
    else:
        codes = weight.codes
        zeros = weight.zero_points().contiguous() if weight.format == "int4" else None
    codes = nibble_major_bank(codes) if major else codes
    bias32 = None if bias is None else bias.float().contiguous()
    return cpu_experts.PackedProjection(codes.contiguous(), weight.scales.contiguous(), zeros, bias32)


def kernel_of(bank: QuantizedExperts, major: bool, threads: int = 2, library=None) -> cpu_experts.CpuExperts:  # type: ignore[no-untyped-def]
    act = (ACT_CLAMPED_SWIGLU, GPT_OSS.alpha, GPT_OSS.limit) if bank.activation is GPT_OSS else (ACT_SILU, 1.0, 0.0)
    gate_up = projection(bank.gate_up, bank.gate_up_bias, major)
    down = projection(bank.down, bank.down_bias, major)
    return cpu_experts.CpuExperts(bank.format, gate_up, down, major, act, threads, library)


def reference(bank: QuantizedExperts, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor, chosen: set[int]):  # type: ignore[no-untyped-def]
    """The weighted sum over each row's chosen pairs, from the format's own (exact) decode."""
    out = torch.zeros(x.shape[0], H)
    for t in range(x.shape[0]):
        for j in range(index.shape[1]):
            e = int(index[t, j])
            if e in chosen:
                out[t] += weight[t, j] * bank.expert(e, x[t : t + 1].float())[0]
    return out


def routing(tokens: int, k: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g)
    index = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)])
    return x, index, torch.rand(tokens, k, generator=g)


@pytest.mark.parametrize("fmt", ["int4", "int4_sym", "mxfp4"])
@pytest.mark.parametrize("major", [False, True], ids=["our-order", "nibble-major"])
@pytest.mark.parametrize("gpt_oss", [False, True], ids=["silu", "gpt-oss-glu-biases"])
def test_the_kernel_matches_the_exact_decode(fmt: str, major: bool, gpt_oss: bool) -> None:
    bank = bank_of(fmt, gpt_oss)
    # 9 tokens x top-3 of 6 experts: most experts get more than the kernel's 4-pair chunk
    x, index, weight = routing(9, 3)
    chosen = {0, 2, 3, 5}
    out = kernel_of(bank, major)(x, index, weight, chosen)
    expected = reference(bank, x, index, weight, chosen)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert out.dtype == torch.float32 and out.shape == (9, H)


def test_results_do_not_depend_on_the_thread_count_and_rows_without_cpu_pairs_are_zero() -> None:
    bank = bank_of("int4", False)
    x, index, weight = routing(7, 2, seed=3)
    chosen = {1, 4}
    outs = [kernel_of(bank, True, threads)(x, index, weight, chosen) for threads in (1, 2, 5)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    untouched = [t for t in range(7) if not set(index[t].tolist()) & chosen]
    assert untouched and bool((outs[0][untouched] == 0).all())
    assert bool((outs[0].abs().sum(dim=1) > 0).sum() == 7 - len(untouched))


def test_bf16_rows_in_give_bf16_sums_out_and_other_dtypes_are_read_as_they_are() -> None:
    bank = bank_of("mxfp4", True, seed=7)
    x, index, weight = routing(6, 3, seed=8)
    kernel = kernel_of(bank, True)
    chosen = {1, 2, 4}
    x16 = x.to(torch.bfloat16)
    expected = reference(bank, x16.float(), index, weight.to(torch.bfloat16).float(), chosen)
    out = kernel(x16, index.to(torch.int32), weight.to(torch.bfloat16), chosen)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, rtol=8e-3, atol=1e-5)  # one bf16 rounding of the sum
    half = kernel(x.half(), index, weight.half(), chosen)
    assert half.dtype == torch.float32
    torch.testing.assert_close(half, reference(bank, x.half().float(), index, weight.half().float(), chosen))


def test_the_portable_c_path_agrees_with_the_vectorized_one() -> None:
    portable, why = cpu_experts.build(cpu_experts.PORTABLE)
    if portable is None or not cpu_experts.PORTABLE:
        pytest.skip(why or "no portable target on this machine")
    assert cpu_experts.instruction_set(portable) == "c"
    for fmt in ("int4", "mxfp4"):
        bank = bank_of(fmt, True, seed=4)
        x, index, weight = routing(5, 3, seed=5)
        fast = kernel_of(bank, True)(x, index, weight, {0, 1, 2, 3, 4, 5})
        plain = kernel_of(bank, True, library=portable)(x, index, weight, {0, 1, 2, 3, 4, 5})
        torch.testing.assert_close(plain, fast, rtol=1e-5, atol=1e-5)


def test_every_e8m0_scale_byte_decodes_as_the_table_says() -> None:
    """The vectorized scale decode (exponent bits built in registers, subnormal below 2^-126)
    against the portable path's table, over every scale byte but NaN."""
    portable, why = cpu_experts.build(cpu_experts.PORTABLE)
    if portable is None or not cpu_experts.PORTABLE:
        pytest.skip(why or "no portable target on this machine")
    hidden, inner = 512, 64  # 16 groups per gate_up row: the vector loop's width
    g = torch.Generator().manual_seed(9)
    gate_up = quantize(torch.randn(1, 2 * inner, hidden, generator=g), "mxfp4")
    down = quantize(torch.randn(1, hidden, inner, generator=g) * 0.05, "mxfp4")
    every = torch.arange(255, dtype=torch.uint8).repeat(9)[torch.randperm(255 * 9, generator=g)]
    gate_up.scales.copy_(every[: gate_up.scales.numel()].view_as(gate_up.scales))
    assert set(gate_up.scales.unique().tolist()) == set(range(255))
    x = torch.randn(1, hidden, generator=g) * 1e-30  # keeps most products finite
    index, weight = torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1)

    def run(library):  # type: ignore[no-untyped-def]
        gu = cpu_experts.PackedProjection(
            gate_up._blocks.reshape(1, 2 * inner, -1).contiguous(), gate_up.scales, None, None
        )
        dn = cpu_experts.PackedProjection(down._blocks.reshape(1, hidden, -1).contiguous(), down.scales, None, None)
        return cpu_experts.CpuExperts("mxfp4", gu, dn, False, (ACT_SILU, 1.0, 0.0), 2, library)(x, index, weight, {0})

    torch.testing.assert_close(run(None), run(portable), rtol=1e-5, atol=0, equal_nan=True)


def test_the_store_builds_the_kernel_from_a_banks_tensors_by_name() -> None:
    bank = bank_of("int4", True)
    x, index, weight = routing(4, 2, seed=6)
    tensors = {name: t.contiguous() for name, t in _bank_tensors(bank).items()}
    assert "gate_up.codes" in tensors and "gate_up.zeros" in tensors  # our order, zero points packed
    kernel = compiled_cpu_share(tensors, bank, threads=2)
    assert kernel is not None and not kernel.nibble_major
    torch.testing.assert_close(
        kernel(x, index, weight, {0, 1, 2, 3, 4, 5}), reference(bank, x, index, weight, set(range(E)))
    )
    codes_and_scales = sum(
        tensors[f"{part}.{name}"][0].numel() * tensors[f"{part}.{name}"].element_size()
        for part in ("gate_up", "down")
        for name in ("codes", "scales")
    )
    assert kernel.expert_nbytes == codes_and_scales + 2 * I * H // 32 + H * I // 32  # and a zero byte per group
    # what the mirror holds on CUDA: nibble-major codes and one zero point per byte
    mirror = dict(tensors)
    for part in ("gate_up", "down"):
        mirror[f"{part}.major_codes"] = nibble_major_bank(mirror.pop(f"{part}.codes"))
        mirror[f"{part}.zero_bytes"] = unpack_nibbles(mirror[f"{part}.zeros"])[
            ..., : mirror[f"{part}.scales"].shape[-1]
        ]
        mirror[f"{part}.zero_bytes"] = mirror[f"{part}.zero_bytes"].contiguous()
    major = compiled_cpu_share(mirror, bank, threads=2)
    assert major is not None and major.nibble_major
    torch.testing.assert_close(major(x, index, weight, {2, 5}), reference(bank, x, index, weight, {2, 5}))


def test_banks_the_kernel_does_not_take_stay_with_torch() -> None:
    plain = Experts(torch.randn(E, 2 * I, H), torch.randn(E, H, I))
    assert not compiled_kernel_takes(plain) and compiled_cpu_share(_bank_tensors(plain), plain, 1) is None
    int8 = QuantizedExperts(quantize(torch.randn(E, 2 * I, H), "int8"), quantize(torch.randn(E, H, I), "int8"))
    assert not compiled_kernel_takes(int8)
    relu = QuantizedExperts(
        quantize(torch.randn(E, 2 * I, H), "int4"), quantize(torch.randn(E, H, I), "int4"), activation=torch.relu
    )
    assert not compiled_kernel_takes(relu)


def test_bad_banks_and_inputs_are_refused_with_the_reason() -> None:
    bank = bank_of("int4", False)
    good = projection(bank.gate_up, None, True)
    with pytest.raises(ValueError, match="int4 banks take zero points"):
        cpu_experts.CpuExperts("int4", cpu_experts.PackedProjection(good.codes, good.scales, None, None), good, True)
    with pytest.raises(ValueError, match="takes"):
        cpu_experts.CpuExperts("nf4", good, good, True)
    with pytest.raises(ValueError, match="disagree"):
        cpu_experts.CpuExperts("int4", good, good, True)  # gate_up given as down
    kernel = kernel_of(bank, True)
    x, index, weight = routing(3, 2)
    with pytest.raises(ValueError, match="do not match"):
        kernel(x[:, :64], index, weight, {0})
    with pytest.raises(ValueError, match="do not match"):
        kernel(x, index, weight[:, :1], {0})


def test_a_forked_child_computes_with_a_pool_of_its_own() -> None:
    bank = bank_of("int4", False, seed=10)
    x, index, weight = routing(4, 3, seed=11)
    kernel = kernel_of(bank, True, threads=3)
    expected = kernel(x, index, weight, {0, 1, 2, 3, 4, 5})  # the parent's pool is running
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe and exits
        ok = torch.equal(kernel(x, index, weight, {0, 1, 2, 3, 4, 5}), expected)
        os.write(write, b"1" if ok else b"0")
        os._exit(0)
    os.close(write)
    _, status = os.waitpid(child, 0)
    assert os.read(read, 1) == b"1" and status == 0


def test_without_a_compiler_the_kernel_is_unavailable_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_experts, "_compiler", lambda: None)
    library, why = cpu_experts.build(cpu_experts.NATIVE)
    assert library is None and "no C compiler" in why and "$CC" in why
