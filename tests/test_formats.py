"""Weight formats: exact decodes, kernels against the decode, block-preserving slices, errors.

Tolerances (stated once): a kernel's y = x @ W.T is compared with the float64 product of the same
x and the exact decode, relative to the magnitude bound |x| @ |W|.T element by element:
1e-5 for float32 activations (decodes are exact; only summation order differs) and 1e-2 for
bf16 activations (bf16 tiles, bf16 int4 scales, bf16 output rounding).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.utils._pytree as pytree
from gpu_cases import cuda_matmul_cases, cuda_only
from torch.utils._python_dispatch import TorchDispatchMode

from modelfleet.engine.formats import (
    FormatError,
    Int4SymWeight,
    Int4Weight,
    Int8Weight,
    MXFP4Weight,
    QuantizedWeight,
    format_names,
    int4_cpu,
    quantize,
    slice_weight,
)
from modelfleet.engine.formats.base import triton_available

QUANTIZED = ("int4", "int4_sym", "int8", "mxfp4")
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32).view(torch.int32)


def assert_bit_identical(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape
    assert torch.equal(bits(actual), bits(expected))


def assert_matmul_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, tolerance: float) -> None:
    reference = x.double() @ w.double().T
    bound = x.double().abs() @ w.double().abs().T
    excess = (y.double() - reference).abs() - tolerance * bound
    assert float(excess.max()) <= 1e-30, f"worst excess {float(excess.max()):.3g}"


# --- an MXFP4 decoder written from the OCP MX spec, independent of the engine's -----------------


def spec_e2m1(code: int) -> float:
    """OCP MX v1.0, FP4 E2M1: 1 sign, 2 exponent (bias 1), 1 mantissa bit; exponent 0 is subnormal."""
    sign = -1.0 if code & 0b1000 else 1.0
    exponent, mantissa = (code >> 1) & 0b11, code & 0b1
    if exponent == 0:
        return sign * 2.0 ** (1 - 1) * (mantissa / 2)
    return sign * 2.0 ** (exponent - 1) * (1 + mantissa / 2)


def spec_mxfp4_decode(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks [rows, B, 16], scales [rows, B] -> float32 [rows, B * 32], one element at a time."""
    rows, nblocks, _ = blocks.shape
    out = torch.empty(rows, nblocks * 32, dtype=torch.float32)
    for r in range(rows):
        for b in range(nblocks):
            scale = 2.0 ** (int(scales[r, b]) - 127)  # E8M0
            for j in range(16):
                byte = int(blocks[r, b, j])
                for half, code in enumerate((byte & 0x0F, byte >> 4)):
                    value = spec_e2m1(code) * scale
                    out[r, b * 32 + 2 * j + half] = value if abs(value) < 2.0**128 else math.copysign(math.inf, value)
    return out


def test_every_mxfp4_byte_and_exponent_decodes_bit_identically_to_the_spec():
    byte_rows = torch.arange(256, dtype=torch.uint8).reshape(16, 16)  # 16 bytes = one block
    exponents = torch.cat((torch.arange(255), torch.zeros(16), torch.full((16,), 254))).to(torch.uint8)
    rows = torch.arange(exponents.numel()) % 16  # every exponent meets bytes; 0 and 254 meet all
    blocks, scales = byte_rows[rows][:, None, :].contiguous(), exponents[:, None].contiguous()
    weight = MXFP4Weight(blocks, scales)
    assert_bit_identical(weight.dequantize(), spec_mxfp4_decode(blocks, scales))


def test_mxfp4_negative_zero_and_largest_magnitude_decode_as_the_spec_says():
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0] = 0x87  # element 0: code 7 (+6), element 1: code 8 (-0)
    weight = MXFP4Weight(blocks, torch.tensor([[127]], dtype=torch.uint8))
    decoded = weight.dequantize()[0]
    assert decoded[0].item() == 6.0
    assert decoded[1].item() == 0.0 and math.copysign(1.0, decoded[1].item()) == -1.0


def random_mxfp4_grid(rows: int, nblocks: int, low: int, high: int, generator: torch.Generator) -> MXFP4Weight:
    blocks = torch.randint(0, 256, (rows, nblocks, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(low, high + 1, (rows, nblocks), dtype=torch.uint8, generator=generator)
    return MXFP4Weight(blocks, scales)


@pytest.mark.parametrize("exponents", [(100, 140), (0, 3), (250, 252)], ids=["typical", "smallest", "large"])
def test_mxfp4_values_on_the_grid_quantize_back_bit_identically(exponents):
    grid = random_mxfp4_grid(8, 4, *exponents, torch.Generator().manual_seed(1)).dequantize()
    assert_bit_identical(quantize(grid, "mxfp4").dequantize(), grid)


def test_mxfp4_largest_exponent_with_small_elements_round_trips():
    blocks = torch.full((2, 1, 16), 0x33, dtype=torch.uint8)  # every element 1.5
    grid = MXFP4Weight(blocks, torch.tensor([[254], [254]], dtype=torch.uint8)).dequantize()
    assert grid[0, 0].item() == 1.5 * 2.0**127
    assert_bit_identical(quantize(grid, "mxfp4").dequantize(), grid)


def e2m1_half_steps(scaled: torch.Tensor) -> torch.Tensor:
    """Half the gap between the E2M1 neighbours of |v| (gaps 0.5 below 2, 1 below 4, 2 up to 6)."""
    a = scaled.abs()
    return torch.where(a < 2, 0.25, torch.where(a < 4, 0.5, 1.0))


def test_mxfp4_random_values_decode_within_half_a_step():
    weight = torch.randn(16, 128, generator=torch.Generator().manual_seed(2)) * 0.05
    q = quantize(weight, "mxfp4")
    assert isinstance(q, MXFP4Weight)
    scale = torch.pow(2.0, q.scales.to(torch.float32) - 127).repeat_interleave(32, dim=-1)
    error = (q.dequantize() - weight).abs()
    assert bool((error <= e2m1_half_steps(weight / scale) * scale).all())


# --- int4 and int8 round trips ------------------------------------------------------------------


def int4_grid(symmetric: bool, generator: torch.Generator) -> torch.Tensor:
    """(q - z) * s with fp16 s, every group using its full code range."""
    rows, groups = 8, 4
    low = 1 if symmetric else 0
    q = torch.randint(low, 16, (rows, groups, 32), generator=generator)
    q[..., 0], q[..., 1] = low, 15  # full range: the quantizer recovers s exactly
    z = torch.full((rows, groups, 1), 8) if symmetric else torch.randint(0, 16, (rows, groups, 1), generator=generator)
    s = (torch.rand(rows, groups, 1, generator=generator) * 0.1 + 1e-3).half().float()
    return ((q - z).float() * s).reshape(rows, groups * 32)


@pytest.mark.parametrize("name", ["int4", "int4_sym"])
def test_int4_values_on_the_grid_decode_bit_identically(name):
    grid = int4_grid(name == "int4_sym", torch.Generator().manual_seed(3))
    assert_bit_identical(quantize(grid, name).dequantize(), grid)


@pytest.mark.parametrize("name", ["int4", "int4_sym"])
def test_int4_random_values_decode_within_half_a_step(name):
    weight = torch.randn(16, 256, generator=torch.Generator().manual_seed(4))
    q = quantize(weight, name)
    assert isinstance(q, Int4Weight)
    half_step = q.scales.float().repeat_interleave(32, dim=-1) / 2
    assert bool(((q.dequantize() - weight).abs() <= half_step * (1 + 1e-6)).all())


@pytest.mark.parametrize("name", ["int4", "int4_sym", "int8", "mxfp4"])
@pytest.mark.parametrize("constant", [0.0, 0.37, -5.0])
def test_constant_groups_decode_within_half_a_step_and_zeros_exactly(name, constant):
    weight = torch.full((2, 64), constant)
    decoded = quantize(weight, name).dequantize()
    if constant == 0.0:
        assert bool((decoded == 0).all())
    else:
        # half a step: int4 s = |c|/15 (range widened to 0), int4_sym |c|/7, int8 |c|/127; MXFP4's
        # widest gap for |c| / 2^X in (3, 6] is 2 * 2^X < 2|c|/3
        half_step = {"int4": 1 / 30, "int4_sym": 1 / 14, "int8": 1 / 254, "mxfp4": 1 / 3}[name] * abs(constant)
        assert float((decoded - weight).abs().max()) <= half_step * (1 + 1e-3)


def test_int8_values_on_the_grid_decode_bit_identically():
    g = torch.Generator().manual_seed(5)
    q = torch.randint(-127, 128, (8, 96), generator=g)
    q[:, 0] = 127
    s = (torch.rand(8, 1, generator=g) * 0.01 + 1e-4).bfloat16().float()
    grid = q.float() * s
    assert_bit_identical(quantize(grid, "int8").dequantize(), grid)


def test_int8_random_values_decode_within_half_a_step():
    weight = torch.randn(16, 96, generator=torch.Generator().manual_seed(6))
    q = quantize(weight, "int8")
    assert isinstance(q, Int8Weight)
    assert bool(((q.dequantize() - weight).abs() <= q.scales[:, None] / 2 * (1 + 1e-6)).all())


@pytest.mark.parametrize("name", ["bf16", "fp16", "fp32"])
def test_plain_formats_decode_to_the_cast_weight(name):
    weight = torch.randn(4, 64)
    decoded = quantize(weight, name).dequantize()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]
    assert_bit_identical(decoded, weight.to(dtype).float())


# --- kernels against the exact decode -----------------------------------------------------------


def weight_for(name: str, shape: tuple[int, ...], seed: int = 7) -> QuantizedWeight:
    return quantize(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.05, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 8, 64])
@pytest.mark.parametrize("name", [*QUANTIZED, "bf16"])
def test_cpu_kernels_match_the_exact_decode(name, rows, dtype):
    weight = weight_for(name, (96, 256))
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).to(dtype)
    y = weight.matmul(x)
    assert y.dtype == dtype and y.shape == (rows, 96)
    tolerance = TOLERANCE[dtype] if name != "bf16" else 1e-2
    assert_matmul_close(y, x, weight.dequantize(), tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("name", "shape"), [("int4", (40, 96)), ("int4_sym", (8, 64)), ("int8", (24, 40))])
def test_shapes_outside_torch_kernel_limits_fall_back_to_tiled_decode(name, shape, dtype):
    weight = weight_for(name, shape)
    x = torch.randn(3, shape[1]).to(dtype)
    assert_matmul_close(weight.matmul(x), x, weight.dequantize(), TOLERANCE[dtype])


@pytest.mark.parametrize("name", QUANTIZED)
def test_expert_bank_applies_one_expert_to_rows(name):
    bank = weight_for(name, (4, 32, 64))
    x = torch.randn(5, 64).to(torch.bfloat16)
    decoded = bank.dequantize()
    for e in (0, 3):
        assert_matmul_close(bank.expert_matmul(e, x), x, decoded[e], TOLERANCE[torch.bfloat16])
    with pytest.raises(FormatError, match="use expert_matmul"):
        bank.matmul(x)


def test_int4_codes_survive_conversion_to_the_cpu_kernel_layout():
    weight = weight_for("int4", (3, 48, 128))
    codes = weight.codes.clone()
    weight.expert_matmul(1, torch.randn(2, 128).to(torch.bfloat16))
    assert "kernel_codes" in weight.tensors() and "codes" not in weight.tensors()
    assert torch.equal(weight.codes, codes)


@pytest.mark.parametrize("name", format_names())
def test_activations_keep_their_leading_shape_even_when_empty(name):
    weight = weight_for(name, (32, 64))
    assert weight(torch.randn(2, 3, 64)).shape == (2, 3, 32)
    assert weight(torch.randn(0, 64).to(torch.bfloat16)).shape == (0, 32)


# --- row lookups (embedding tables) ------------------------------------------------------------

VOCAB = 1009  # prime: no multiple of a block, a group or a kernel tile
IDS = [1008, 5, 5, 0, 731, 5, 1008, 17, 64, 63]  # unsorted, repeated, both ends of the table


def embedding_table(name: str, vocab: int = VOCAB, hidden: int = 96) -> QuantizedWeight:
    generator = torch.Generator().manual_seed(3)
    row_scale = torch.rand(vocab, 1, generator=generator) * 4  # rows of very different magnitudes
    return quantize(torch.randn(vocab, hidden, generator=generator) * row_scale, name)


class LargestTensor(TorchDispatchMode):
    """Records the most elements any torch op produced while active."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        sizes = [t.numel() for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.numel = max([self.numel, *sizes])
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", format_names())
def test_row_lookup_is_bit_identical_to_indexing_the_exact_decode_of_the_table(name, dtype):
    table = embedding_table(name)
    ids = torch.tensor(IDS + torch.randint(0, VOCAB, (50,), generator=torch.Generator().manual_seed(1)).tolist())
    rows = table.rows(ids, dtype)
    assert rows.dtype == dtype
    assert_bit_identical(rows, table.dequantize()[ids].to(dtype))
    assert table.rows(torch.tensor([], dtype=torch.int64), dtype).shape == (0, 96)


@pytest.mark.parametrize("name", QUANTIZED)
def test_row_lookup_decodes_only_the_rows_asked_for(name):
    table = embedding_table(name, vocab=4099, hidden=256)
    ids = torch.tensor([4098, 7, 7, 300])
    table.rows(ids)  # builds mxfp4's byte tables, once per process
    with LargestTensor() as largest:
        table.rows(ids)
    assert largest.numel <= 4 * 256 * 2  # the decoded rows (mxfp4: as byte pairs, then values)


def test_an_int4_table_tied_to_a_head_keeps_its_codes_for_lookups_beside_the_kernel_layout(monkeypatch):
    table = embedding_table("int4", vocab=96, hidden=256)  # 96 rows: torch's int4 CPU kernel applies
    codes = table.codes.clone()
    table.keep_storage_layout()
    table.matmul(torch.randn(2, 256).to(torch.bfloat16))  # the tied head's first matmul
    assert {"codes", "kernel_codes"} <= set(table.tensors())
    assert table.nbytes == 96 * 256 // 2 * 2 + sum(
        t.numel() * t.element_size() for n, t in table.tensors().items() if n not in ("codes", "kernel_codes")
    )

    def no_recovery(*args: object) -> None:
        raise AssertionError("a row lookup must not recover codes from the kernel layout")

    monkeypatch.setattr(int4_cpu, "from_kernel_codes", no_recovery)
    assert torch.equal(table.codes, codes)
    ids = torch.tensor([95, 0, 3, 3])
    assert_bit_identical(table.rows(ids), table.dequantize()[ids])


def test_row_lookups_refuse_banks_bad_indices_and_ids_outside_the_table():
    table = embedding_table("int8", vocab=10, hidden=32)
    with pytest.raises(FormatError, match=r"row 10 is outside int8 weight of shape \(10, 32\)"):
        table.rows(torch.tensor([3, 10]))
    with pytest.raises(FormatError, match=r"row -1 is outside"):
        table.rows(torch.tensor([-1]))
    with pytest.raises(FormatError, match=r"row index must be int64/int32 \[n\].*shape \(2, 2\)"):
        table.rows(torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(FormatError, match=r"rows needs a 2-D weight; this int4 bank has shape \(2, 8, 32\)"):
        weight_for("int4", (2, 8, 32)).rows(torch.tensor([0]))


# --- slicing ------------------------------------------------------------------------------------


def storages(weight: QuantizedWeight) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in weight.tensors().values()}


@pytest.mark.parametrize("name", [*QUANTIZED, "bf16"])
@pytest.mark.parametrize(("dim", "start", "end"), [(0, 16, 48), (1, 32, 96), (-1, 0, 32)])
def test_slices_at_block_boundaries_equal_slices_of_the_decoded_weight(name, dim, start, end):
    weight = weight_for(name, (64, 128))
    part = slice_weight(weight, dim, start, end)
    assert_bit_identical(part.dequantize(), weight.dequantize().narrow(dim, start, end - start))
    assert part.format == weight.format
    assert not storages(part) & storages(weight)


@pytest.mark.parametrize("name", QUANTIZED)
def test_expert_slices_of_a_bank_prepared_for_the_cpu_kernel_still_compute(name):
    bank = weight_for(name, (4, 32, 64))
    x = torch.randn(2, 64).to(torch.bfloat16)
    bank.prepare_for(x)
    part = bank.slice(0, 1, 3)
    assert part.shape == (2, 32, 64)
    assert not storages(part) & storages(bank)
    assert_bit_identical(part.dequantize(), bank.dequantize()[1:3])
    assert torch.equal(part.expert_matmul(0, x), bank.expert_matmul(1, x))


@pytest.mark.parametrize("name", ["int4", "int4_sym", "mxfp4"])
def test_a_boundary_inside_a_block_is_refused_with_shape_and_boundary(name):
    weight = weight_for(name, (64, 128))
    with pytest.raises(FormatError, match=r"\(64, 128\).*boundary 40"):
        slice_weight(weight, 1, 40, 96)
    with pytest.raises(FormatError, match=r"\(64, 128\).*boundary 100"):
        slice_weight(weight, 1, 0, 100)


def test_int8_slices_anywhere_along_the_input_dimension():
    weight = weight_for("int8", (8, 64))
    part = slice_weight(weight, 1, 5, 41)
    assert_bit_identical(part.dequantize(), weight.dequantize()[:, 5:41])


def test_an_odd_group_offset_repacks_int4_zero_points():
    weight = weight_for("int4", (16, 160))  # 5 groups: zero points pad a nibble
    part = slice_weight(weight, 1, 32, 128)  # groups 1..3: every zero point moves a nibble
    assert_bit_identical(part.dequantize(), weight.dequantize()[:, 32:128])


def test_empty_or_outside_slices_are_refused():
    weight = weight_for("int4", (16, 64))
    with pytest.raises(FormatError, match="outside"):
        slice_weight(weight, 0, 8, 8)
    with pytest.raises(FormatError, match="outside"):
        slice_weight(weight, 0, 0, 17)


# --- registry, sizes, bad input -----------------------------------------------------------------


def test_registry_names_every_format_and_each_quantizes_to_its_name():
    assert set(format_names()) == {"int4", "int4_sym", "int8", "mxfp4", "bf16", "fp16", "fp32"}
    for name in format_names():
        assert weight_for(name, (32, 64)).format == name


def test_resident_bytes_follow_the_documented_layouts():
    out, inp = 64, 256
    assert weight_for("mxfp4", (out, inp)).nbytes == out * inp // 2 + out * inp // 32
    assert weight_for("int4", (out, inp)).nbytes == out * inp // 2 + out * inp // 32 * 2 + out * inp // 64
    assert weight_for("int4_sym", (out, inp)).nbytes == out * inp // 2 + out * inp // 32 * 2
    assert weight_for("int8", (out, inp)).nbytes == out * inp + out * 4
    assert weight_for("bf16", (out, inp)).nbytes == out * inp * 2


def test_an_unknown_format_lists_the_known_ones():
    with pytest.raises(FormatError, match="unknown weight format 'int3'.*int4, int4_sym, int8, mxfp4, bf16"):
        quantize(torch.zeros(4, 32), "int3")


@pytest.mark.parametrize("name", ["int4", "int4_sym", "mxfp4"])
def test_an_input_dimension_not_divisible_by_the_group_size_is_refused(name):
    with pytest.raises(FormatError, match=r"\(8, 48\).*48 is not divisible by the group size 32"):
        quantize(torch.zeros(8, 48), name)


@pytest.mark.parametrize("name", format_names())
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_quantizing_nan_or_inf_names_the_shape_and_index(name, bad):
    weight = torch.zeros(4, 64)
    weight[2, 33] = bad
    with pytest.raises(FormatError, match=r"shape \(4, 64\) holds .* at index \(2, 33\)"):
        quantize(weight, name)


def test_a_value_beyond_fp16_range_is_refused_for_fp16():
    with pytest.raises(FormatError, match="overflows fp16"):
        quantize(torch.full((2, 32), 1e6), "fp16")


def test_mxfp4_scales_holding_e8m0_nan_are_refused_on_load():
    blocks = torch.zeros(4, 2, 16, dtype=torch.uint8)
    scales = torch.full((4, 2), 127, dtype=torch.uint8)
    scales[3, 1] = 0xFF
    with pytest.raises(FormatError, match=r"shape \(4, 2\).*NaN \(0xFF\) at index \(3, 1\)"):
        MXFP4Weight(blocks, scales)


def test_corrupt_scales_tensors_are_refused_on_load():
    blocks = torch.zeros(4, 2, 16, dtype=torch.uint8)
    with pytest.raises(FormatError, match=r"mxfp4 scales must be torch.uint8 of shape \(4, 2\).*\(4, 3\)"):
        MXFP4Weight(blocks, torch.zeros(4, 3, dtype=torch.uint8))
    codes = torch.zeros(4, 32, dtype=torch.uint8)
    with pytest.raises(FormatError, match="int4 scales must be torch.float16"):
        Int4Weight(codes, torch.ones(4, 2), torch.zeros(4, 1, dtype=torch.uint8))
    bad = torch.ones(4, 2, dtype=torch.float16)
    bad[1, 0] = math.inf
    with pytest.raises(FormatError, match=r"int4_sym scales of shape \(4, 2\) holds inf at index \(1, 0\)"):
        Int4SymWeight(codes, bad)
    with pytest.raises(FormatError, match="needs zero points"):
        Int4Weight(codes, torch.ones(4, 2, dtype=torch.float16))
    with pytest.raises(FormatError, match=r"int8 scales must be torch.float32 of shape \(4,\)"):
        Int8Weight(torch.zeros(4, 8, dtype=torch.int8), torch.ones(4, 1))


# --- GPU (Triton) -------------------------------------------------------------------------------


@cuda_matmul_cases(QUANTIZED)
def test_cuda_kernels_match_the_exact_decode(name, rows, dtype):
    weight = weight_for(name, (200, 512)).to("cuda")
    x = torch.randn(rows, 512, device="cuda").to(dtype)
    y = weight.matmul(x)
    assert y.dtype == dtype and y.shape == (rows, 200) and y.device.type == "cuda"
    assert_matmul_close(y.cpu(), x.cpu(), weight.dequantize().cpu(), TOLERANCE[dtype])


@cuda_only
@pytest.mark.gpu
@pytest.mark.parametrize("name", QUANTIZED)
def test_cuda_expert_bank_matches_the_cpu_decode(name):
    bank = weight_for(name, (3, 64, 128))
    on_gpu = bank.to("cuda")
    x = torch.randn(4, 128).to(torch.bfloat16)
    for e in range(3):
        y = on_gpu.expert_matmul(e, x.cuda()).cpu()
        assert_matmul_close(y, x, bank.dequantize()[e], TOLERANCE[torch.bfloat16])


@cuda_only
@pytest.mark.gpu
@pytest.mark.parametrize("name", format_names())
def test_cuda_row_lookup_is_bit_identical_to_the_cpu_decode(name):
    table = embedding_table(name)
    ids = torch.tensor(IDS)
    rows = table.to("cuda").rows(ids.cuda(), torch.bfloat16)
    assert rows.device.type == "cuda"
    assert_bit_identical(rows.cpu(), table.dequantize()[ids].to(torch.bfloat16))


GATHERED_BANKS = ("int4", "int4_sym", "int8", "mxfp4")  # the formats with a gathered expert kernel


def gathered_reference(bank: QuantizedWeight, x: torch.Tensor, index: torch.Tensor, row_div: int):
    """Pair by pair from the exact decode: (x rows [P, in], weights [P, out, in])."""
    decoded = bank.dequantize()
    rows = torch.arange(index.numel()) // row_div
    return x[rows], decoded[index.cpu()]


@cuda_only
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens", [1, 8, 64])
@pytest.mark.parametrize("name", GATHERED_BANKS)
def test_cuda_gathered_expert_kernel_matches_the_exact_decode(name, tokens, dtype):
    bank = weight_for(name, (6, 200, 512)).to("cuda")
    top_k = 2
    generator = torch.Generator().manual_seed(tokens)
    index = torch.stack([torch.randperm(6, generator=generator)[:top_k] for _ in range(tokens)]).reshape(-1)
    x = torch.randn(tokens, 512, generator=generator).to(dtype)
    assert bank.has_gathered_kernel(torch.device("cuda"))
    y = bank.gathered_matmul(x.cuda(), index.cuda(), top_k)
    assert y.dtype == dtype and y.shape == (tokens * top_k, 200)
    rows, weights = gathered_reference(bank, x, index, top_k)
    for p in range(index.numel()):
        assert_matmul_close(y[p : p + 1].cpu(), rows[p : p + 1], weights[p].cpu(), TOLERANCE[dtype])


@pytest.mark.parametrize("name", [*QUANTIZED, "bf16"])
def test_a_bank_without_a_gathered_kernel_here_says_so(name):
    bank = weight_for(name, (2, 32, 64))
    assert not bank.has_gathered_kernel(torch.device("cpu"))
    with pytest.raises(FormatError, match="no gathered expert kernel on cpu"):
        bank.gathered_matmul(torch.randn(1, 64), torch.zeros(2, dtype=torch.int64), 2)
    if name == "bf16":  # plain banks run through engine.layers.Experts' own gathered path
        assert not bank.has_gathered_kernel(torch.device("cuda"))


@cuda_only
@pytest.mark.gpu
def test_triton_is_present_where_cuda_is():
    assert triton_available(), "CUDA weights would fall back to the slow tiled decode"


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or not triton_available(),
    reason="runs the Triton kernels on CPU only under TRITON_INTERPRET=1 with triton installed",
)
@pytest.mark.parametrize("name", QUANTIZED)
def test_triton_kernels_in_the_interpreter_match_the_exact_decode(name):
    from modelfleet.engine.formats import triton_kernels

    weight = weight_for(name, (80, 96))
    x = torch.randn(20, 96)  # float32: the interpreter's bf16 tl.dot is wrong (triton 3.6)
    if isinstance(weight, Int4Weight):
        zeros = None if weight.symmetric else weight.zero_points()
        y = triton_kernels.int4_matmul(x, weight.codes, weight.scales, zeros)
    elif isinstance(weight, Int8Weight):
        y = triton_kernels.int8_matmul(x, weight.codes, weight.scales)
    else:
        assert isinstance(weight, MXFP4Weight)
        y = triton_kernels.mxfp4_matmul(x, weight.blocks, weight.scales)
    assert_matmul_close(y, x, weight.dequantize(), TOLERANCE[torch.float32])


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or not triton_available(),
    reason="runs the Triton kernels on CPU only under TRITON_INTERPRET=1 with triton installed",
)
@pytest.mark.parametrize("name", GATHERED_BANKS)
def test_the_gemv_kernels_in_the_interpreter_match_the_exact_decode(name):
    from modelfleet.engine.formats import triton_kernels

    def gemv(w: QuantizedWeight, x: torch.Tensor, index: torch.Tensor | None, row_div: int) -> torch.Tensor:
        if isinstance(w, Int8Weight):
            return triton_kernels.int8_gemv(x, w.codes, w.scales, index, row_div)
        if isinstance(w, MXFP4Weight):
            return triton_kernels.nibble_gemv(x, w.blocks.flatten(-2), w.scales, None, index, row_div, mxfp4=True)
        assert isinstance(w, Int4Weight)
        zeros = None if w.symmetric else w.zero_points()
        return triton_kernels.nibble_gemv(x, w.codes, w.scales, zeros, index, row_div, mxfp4=False)

    bank, index = weight_for(name, (3, 80, 96)), torch.tensor([2, 0, 1, 1, 0, 2])
    x = torch.randn(3, 96)
    y = gemv(bank, x, index, 2)
    rows, weights = gathered_reference(bank, x, index, 2)
    for p in range(index.numel()):
        assert_matmul_close(y[p : p + 1], rows[p : p + 1], weights[p], TOLERANCE[torch.float32])
    dense = weight_for(name, (80, 96))
    assert_matmul_close(gemv(dense, x, None, 1), x, dense.dequantize(), TOLERANCE[torch.float32])
