"""The OpenVINO stage backend on CPU: float weights against transformers (qwen3_moe, deepseek_v3,
mixtral, Inkling), int4/int8 against the torch backend with the same quantized weights, fusion
asserted (and a static-rows graph refused), Eq. 1 range management and its automatic exponent,
Eq. 2 dense blocks as all-active slices and as three matmuls (the form each device gets), rewind
and release, and a mixed fleet (torch stage 0, OpenVINO stage 1) through the gateway.

Exactness settings: INFERENCE_PRECISION_HINT=f32 and DYNAMIC_QUANTIZATION_GROUP_SIZE=0 (the
backend's ``f32`` precision, its CPU default). No Intel GPU exists here: the GPU path is the same
code with ``device GPU`` and is not exercised (``test_a_gpu_stage_without_an_intel_gpu_is_refused``).
"""

from __future__ import annotations

import json
import os
import random
import signal
import urllib.request
from functools import partial
from pathlib import Path

import pytest
import torch

pytest.importorskip("openvino")

from inkling_tiny import save_text_model  # noqa: E402
from tiny import assert_close_to, reference_logits  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from modelfleet.engine.backend import backend_refusal, load_backend  # noqa: E402
from modelfleet.engine.errors import ConfigError  # noqa: E402
from modelfleet.engine.formats.int4 import quantize_int4  # noqa: E402
from modelfleet.engine.formats.plan import FormatPlan  # noqa: E402
from modelfleet.engine.frame import Frame  # noqa: E402
from modelfleet.engine.layers import Dense, GatedMLP, softmax_top_k  # noqa: E402
from modelfleet.engine.models.inkling import ScaledGatedMLP  # noqa: E402
from modelfleet.engine.openvino import export  # noqa: E402
from modelfleet.engine.openvino.graphs import ExpertBank, dense_graph, moe_graph  # noqa: E402
from modelfleet.engine.openvino.ranges import (  # noqa: E402
    FP16_MAX,
    attenuation_exponent,
    calibration_rows,
    execution_type,
    layer_exponent,
    needs_calibration,
    restore,
    row_factors,
)
from modelfleet.engine.openvino.runtime import (  # noqa: E402
    CompiledBlock,
    CompileOptions,
    DenseMatmuls,
    FusedMoE,
    check_block_fused,
)
from modelfleet.engine.openvino.stage import OpenVINOShard, chainable, dense_form, host_threads  # noqa: E402
from modelfleet.engine.quantize import QuantizedDense  # noqa: E402
from modelfleet.engine.shard import Shard  # noqa: E402

PROMPT = [5, 17, 99, 3, 64, 21, 8, 120, 45, 77, 12, 33, 90, 6, 101, 58]
FAMILIES = ["qwen3_moe", "deepseek_v3", "inkling"]
OPTIONS = CompileOptions()  # CPU, f32


@pytest.fixture(scope="module", autouse=True)
def _torch_threads_restored():  # type: ignore[no-untyped-def]
    """A CPU OpenVINO stage sets torch's threads for its process (host_threads); give the rest of
    the test session its own back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint, tmp_path_factory):  # type: ignore[no-untyped-def]
    """checkpoint(family) -> (directory, transformers model): tests/tiny.py's, Inkling's own."""
    inkling: list[tuple[Path, torch.nn.Module]] = []

    def get(family: str):  # type: ignore[no-untyped-def]
        if family != "inkling":
            return tiny_checkpoint(family)
        if not inkling:
            path = tmp_path_factory.mktemp("inkling")
            inkling.append((path, save_text_model(path)))
        return inkling[0]

    return get


@pytest.fixture(scope="module")
def openvino_stage(checkpoint):  # type: ignore[no-untyped-def]
    """openvino_stage(family, formats=None) -> a whole-model OpenVINOShard, compiled once each."""
    cache: dict[tuple[str, FormatPlan | None], OpenVINOShard] = {}

    def get(family: str, formats: FormatPlan | None = None) -> OpenVINOShard:
        if (family, formats) not in cache:
            path, _ = checkpoint(family)
            shard = load_backend("openvino", path, 0, 4, device="cpu", formats=formats)
            assert isinstance(shard, OpenVINOShard)
            cache[family, formats] = shard
        return cache[family, formats]

    return get


def greedy(shard: Shard, prompt: list[int], tokens: int, slot: int = 0) -> list[int]:
    token = int(shard(Frame.of_streams([(slot, 0, prompt)]))[-1].argmax())
    out = [token]
    for position in range(len(prompt), len(prompt) + tokens - 1):
        token = int(shard(Frame.of_streams([(slot, position, [token])]))[-1].argmax())
        out.append(token)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_float_weights_give_logits_within_1e_3_of_transformers_and_the_same_32_greedy_tokens(
    family: str, checkpoint, openvino_stage
) -> None:
    _, model = checkpoint(family)
    shard = openvino_stage(family)
    shard.allocate_cache(2, 128)
    assert_close_to(shard(Frame.of_streams([(0, 0, PROMPT)])), reference_logits(model, PROMPT), tol=1e-3)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        ref = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, min_new_tokens=32, do_sample=False
        )
    assert greedy(shard, PROMPT, 32, slot=1) == ref[0, len(PROMPT) :].tolist()


def test_inkling_cut_into_two_openvino_stages_gives_the_logits_of_the_whole(checkpoint) -> None:
    """Stage 1 holds no embedding: its convolution histories and relative bias run on its host."""
    from modelfleet.engine.generate import LocalModel

    path, model = checkpoint("inkling")
    local = LocalModel.load(path, shards=2, backend="openvino", max_slots=1, max_context=64)
    assert [type(s).__name__ for s in local.shards] == ["OpenVINOShard", "OpenVINOShard"]
    assert_close_to(local.forward(Frame.of_streams([(0, 0, PROMPT)])), reference_logits(model, PROMPT), tol=1e-3)


def test_mixtral_layers_export_too_and_match_transformers(tiny_checkpoint, openvino_stage) -> None:
    _, model = tiny_checkpoint("mixtral")
    shard = openvino_stage("mixtral")
    shard.allocate_cache(1, 64)
    assert_close_to(shard(Frame.of_streams([(0, 0, PROMPT)])), reference_logits(model, PROMPT), tol=1e-3)
    assert shard.fused_layers == 4


@pytest.mark.parametrize("family", FAMILIES)
def test_every_sparse_block_runs_fused_and_dense_blocks_run_as_three_matmuls_on_cpu(
    family: str, openvino_stage
) -> None:
    info = openvino_stage(family).backend_info
    # qwen3_moe's layer 1, deepseek_v3's and Inkling's layer 0 are dense: three matmuls on a CPU
    assert info["device"] == "CPU" and info["moe_layers"] == info["fused_layers"] == 3, info
    assert info["dense_form"] == "matmuls" and info["dense_layers"] == 1, info
    assert info["attenuation_exponents"] == {}, info  # f32 blocks: Eq. 1 needs no attenuation
    assert info["host_threads"] == 1, info


@pytest.mark.parametrize("family", FAMILIES)
def test_int4_experts_and_int8_attention_match_the_torch_backend_with_the_same_weights(
    family: str, checkpoint, openvino_stage
) -> None:
    path, _ = checkpoint(family)
    formats = FormatPlan.default()
    ours, theirs = openvino_stage(family, formats), Shard.load(path, formats=formats)
    for shard in (ours, theirs):
        shard.allocate_cache(8, 128)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 128) for _ in range(4 + 3 * i)] for i in range(6)]
    streams = [(slot, 0, prompt) for slot, prompt in enumerate(prompts)]
    a, b = ours(Frame.of_streams(streams)), theirs(Frame.of_streams(streams))
    assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min() >= 0.999
    same = [greedy(ours, p, 12, slot) == greedy(theirs, p, 12, slot) for slot, p in enumerate(prompts)]
    print(f"{family}: greedy continuations identical on {sum(same)}/{len(same)} prompts")
    assert sum(same) >= len(same) - 1


@pytest.mark.parametrize("family", ["qwen3_moe", "inkling"])
def test_generate_json_reports_the_backend_device_and_fused_layers(family: str, checkpoint) -> None:
    from modelfleet.cli import app

    path, _ = checkpoint(family)
    args = ["generate", "--model", str(path), "--prompt-ids", "5,17,99", "--max-tokens", "8", "--json"]
    torch_run = CliRunner().invoke(app, args)
    ov_run = CliRunner().invoke(app, [*args, "--backend", "openvino", "--device", "CPU"])
    assert ov_run.exit_code == 0, ov_run.output
    report = json.loads(ov_run.stdout.strip().splitlines()[-1])
    assert report["backend"]["backend"] == "openvino" and report["backend"]["fused_layers"] == 3
    assert report["token_ids"] == json.loads(torch_run.stdout.strip().splitlines()[-1])["token_ids"]


def test_grouped_query_layers_run_chained_one_compiled_call_a_layer_and_latent_ones_do_not(
    tiny_checkpoint, openvino_stage, monkeypatch
) -> None:
    """A step of a CPU stage over grouped-query layers: the first layer's entry, then one call a
    layer (o_proj, residual, post norm, routing, feed-forward block, residual, the next layer's
    entry), then the head: 4 + 2 calls, not 3 x 4 + 1. DeepSeek's latent attention keeps its own."""
    calls: list[int] = []
    run = CompiledBlock.__call__

    def counted(block: CompiledBlock, *inputs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return run(block, *inputs)

    monkeypatch.setattr(CompiledBlock, "__call__", counted)
    for family, chained, per_step in (("qwen3_moe", 4, 4 + 2), ("deepseek_v3", 0, None)):
        shard = openvino_stage(family)
        assert shard.backend_info["chained_layers"] == chained
        shard.allocate_cache(1, 64)
        calls.clear()
        shard(Frame.of_streams([(0, 0, PROMPT)]))
        if per_step is not None:
            assert len(calls) == per_step
    layers = list(Shard.load(tiny_checkpoint("qwen3_moe")[0]).layers)
    assert chainable(layers, OPTIONS)
    assert not chainable(layers, CompileOptions(precision="default"))  # bf16 blocks: the residual stays on the host
    assert not chainable(list(Shard.load(tiny_checkpoint("deepseek_v3")[0]).layers), OPTIONS)


def test_a_graph_with_a_static_row_count_is_refused_naming_the_layer() -> None:
    torch.manual_seed(0)
    bank = ExpertBank(torch.randn(4, 32, 64), torch.randn(4, 32, 64), torch.randn(4, 64, 32))
    check_block_fused(CompiledBlock(moe_graph(bank, 2, "dynamic rows"), OPTIONS), "layer 0")  # fuses
    static = CompiledBlock(moe_graph(bank, 2, "static rows", rows=4), OPTIONS)
    with pytest.raises(ConfigError, match="layer 7: OpenVINO did not fuse the MoE block on CPU .*GatherMatmul"):
        check_block_fused(static, "layer 7")


def test_families_without_an_openvino_export_and_devices_it_cannot_use_are_refused(tiny_checkpoint) -> None:
    path, _ = tiny_checkpoint("gpt_oss")
    with pytest.raises(ConfigError, match="'gpt_oss' .*biases and a clamped SwiGLU.*--backend torch"):
        load_backend("openvino", path, 0, 4)
    assert "no NPU lowering" in (backend_refusal("openvino", "NPU") or "")
    assert "not an OpenVINO device" in (backend_refusal("openvino", "cuda:0") or "")
    assert backend_refusal("openvino", "cpu") is None and backend_refusal("openvino", "GPU.1") is None


def test_a_gpu_stage_without_an_intel_gpu_is_refused(tiny_checkpoint) -> None:
    from modelfleet.engine.openvino.runtime import core

    if any(d.startswith("GPU") for d in core().available_devices):
        pytest.skip("an Intel GPU is present: the refusal does not apply")
    path, _ = tiny_checkpoint("qwen3_moe")
    with pytest.raises(ConfigError, match="OpenVINO device 'GPU' is not available here"):
        load_backend("openvino", path, 0, 4, device="GPU")


def test_rewind_and_release_on_the_openvino_stage_behave_as_on_the_torch_backend(openvino_stage) -> None:
    shard = openvino_stage("qwen3_moe")
    shard.allocate_cache(2, 128)
    first = greedy(shard, PROMPT, 6)
    kept = len(PROMPT) + 2  # keep the prompt and two generated tokens, redo the rest
    shard.rewind(0, kept)
    assert shard.slots is not None and shard.slots.length(0) == kept
    token = first[2]
    redone = []
    for position in range(kept, len(PROMPT) + 5):
        token = int(shard(Frame.of_streams([(0, position, [token])]))[-1].argmax())
        redone.append(token)
    assert redone == first[3:]
    shard.release(0)
    assert shard.slots.in_use() == 0
    assert greedy(shard, PROMPT, 6) == first  # the released slot serves a new stream from scratch


def _dense_mlp(quantized: bool) -> GatedMLP:
    torch.manual_seed(1)
    weights = [torch.randn(96, 64) * 0.1, torch.randn(96, 64) * 0.1, torch.randn(64, 96) * 0.1]
    if quantized:
        return GatedMLP(*(QuantizedDense(quantize_int4(w)) for w in weights))
    return GatedMLP(*(Dense(w) for w in weights))


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "int4"])
def test_eq2_a_dense_block_equals_the_sum_of_its_all_active_expert_slices(quantized: bool) -> None:
    mlp = _dense_mlp(quantized)
    bank = export.slices_of(mlp, 32, "dense")  # 96 = 3 slices of the expert width 32
    assert bank.num_experts == 3
    fused = FusedMoE(CompiledBlock(moe_graph(bank, 3, "dense"), OPTIONS), None, None, 0, 3, 0, "dense")
    check_block_fused(fused.block, "dense")
    x = torch.randn(5, 64)
    assert_close_to(fused(x), mlp(x), tol=1e-5)


def test_eq2_slices_cut_only_at_quantization_group_boundaries() -> None:
    with pytest.raises(ConfigError, match="not a multiple of the expert width 40"):
        export.slices_of(_dense_mlp(True), 40, "dense")


def test_eq1_row_factor_is_the_next_power_of_two_of_the_absolute_weight_sum() -> None:
    weights = torch.tensor([[0.25, 0.5], [0.5, 0.5], [2.5, 1.0], [-3.0, 0.5]])
    assert row_factors(weights).flatten().tolist() == [1.0, 1.0, 4.0, 4.0]
    assert attenuation_exponent(1000.0) == 0 and attenuation_exponent(FP16_MAX) == 3


def _overflowing_bank() -> tuple[ExpertBank, torch.Tensor]:
    """Experts whose outputs reach ~1e5 (over FP16's 65504) on unit-scale rows."""
    torch.manual_seed(2)
    bank = ExpertBank(torch.randn(4, 32, 64), torch.randn(4, 32, 64) * 40.0, torch.randn(4, 64, 32) * 4.0)
    return bank, torch.randn(3, 64)


def _expert_path(bank: ExpertBank, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, dtype) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """The MoE graph's arithmetic in ``dtype``: what an FP16 device computes."""
    g, u, d, x = (t.to(dtype) for t in (bank.gate, bank.up, bank.down, x))  # type: ignore[union-attr]
    out = torch.zeros(x.shape, dtype=dtype)
    for r in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[r, k])
            h = torch.nn.functional.silu(g[e] @ x[r]) * (u[e] @ x[r])
            out[r] += w[r, k].to(dtype) * (d[e] @ h)
    return out


def test_eq1_fp16_expert_outputs_overflow_without_range_management_and_stay_finite_and_correct_with_it() -> None:
    bank, x = _overflowing_bank()
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]])
    w = torch.tensor([[2.0, 0.5], [1.5, 1.0], [0.7, 0.3]])  # sums over 1, as with routed_scaling_factor
    exact = _expert_path(bank, x, ids, w, torch.float32)
    assert not torch.isfinite(_expert_path(bank, x, ids, w, torch.float16)).all()
    peak = max(float(_expert_path(bank, x[r : r + 1], ids[r : r + 1, k : k + 1], torch.ones(1, 1), torch.float32).abs().max())
               for r in range(3) for k in range(2))  # fmt: skip
    n = attenuation_exponent(peak)
    factors = row_factors(w)
    managed = _expert_path(export.attenuate(bank, n), x, ids, w / factors, torch.float16)
    assert torch.isfinite(managed).all() and n > 0
    assert_close_to(restore(managed, factors, n), exact, tol=5e-3)


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "int4"])
def test_eq1_attenuation_and_row_factors_restore_the_output_exactly_on_the_device(quantized: bool) -> None:
    bank, x = _overflowing_bank()
    if quantized:
        bank = ExpertBank(*(quantize_int4(w) for w in (bank.gate, bank.up, bank.down)))  # type: ignore[arg-type]
    router = Dense(torch.randn(4, 64))
    route = partial(softmax_top_k, top_k=2, renormalize=False)

    def block(n: int) -> FusedMoE:
        graph = moe_graph(export.attenuate(bank, n), 2, f"attenuated {n}")
        return FusedMoE(CompiledBlock(graph, OPTIONS), router, route, 4, 0, n, f"attenuated {n}")

    assert_close_to(block(4)(x), block(0)(x), tol=1e-6)


@pytest.mark.parametrize(
    ("device", "precision", "execution"),
    [("CPU", "f32", "f32"), ("CPU", "default", "bf16"), ("GPU", "default", "f16"), ("GPU.1", "default", "f16"),
     ("GPU", "f32", "f32")],
)  # fmt: skip
def test_eq1_the_execution_type_follows_the_device_and_precision(device: str, precision: str, execution: str) -> None:
    assert execution_type(device, precision) == execution
    assert needs_calibration(execution) == (execution == "f16")


@pytest.mark.parametrize(
    ("peak", "execution", "exponent"),
    [(0.0, "f16", 0), (1000.0, "f16", 0), (8188.0, "f16", 0), (8189.0, "f16", 1), (FP16_MAX, "f16", 3),
     (1e5, "f16", 4), (2.4e6, "f16", 9), (1e30, "bf16", 0), (1e30, "f32", 0), (5e37, "f32", 1)],
)  # fmt: skip
def test_eq1_the_layer_exponent_is_the_least_power_of_two_bringing_the_peak_under_an_eighth_of_the_range(
    peak: float, execution: str, exponent: int
) -> None:
    assert layer_exponent(peak, execution) == exponent


def test_eq1_the_layer_exponent_refuses_what_it_cannot_decide() -> None:
    with pytest.raises(ValueError, match="not finite"):
        layer_exponent(float("inf"), "f16")
    with pytest.raises(ValueError, match="'int8' is not one of f16, bf16, f32"):
        layer_exponent(1.0, "int8")


def test_eq1_calibration_rows_are_norm_outputs_random_and_single_channel() -> None:
    gamma = torch.linspace(0.5, 2.0, 64)
    rows = calibration_rows(gamma, 16)
    unit = rows / gamma
    assert rows.shape == (16, 64) and torch.allclose(unit.pow(2).mean(-1), torch.ones(16), atol=1e-4)
    assert (unit[8:] != 0).sum(-1).tolist() == [1] * 8  # the whole norm on one channel ...
    assert set(unit[8:].abs().argmax(-1).tolist()) == set(range(56, 64))  # ... of the largest |gamma|


def test_eq1_the_automatic_exponent_keeps_an_fp16_block_finite_and_correct_and_leaves_f32_blocks_alone() -> None:
    bank, _ = _overflowing_bank()
    rows = calibration_rows(torch.ones(64))
    peak = export.bank_peak(bank, rows)
    n = layer_exponent(peak, "f16")
    assert n > 0 and layer_exponent(peak, "f32") == 0 and layer_exponent(peak, "bf16") == 0
    ids = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0]])
    w = torch.tensor([[2.0, 0.5], [1.5, 1.0], [0.7, 0.3], [1.0, 1.0]])
    x = rows[[0, 3, 9, 12]]  # two random rows, two single-channel ones
    exact = _expert_path(bank, x, ids, w, torch.float32)
    assert not torch.isfinite(_expert_path(bank, x, ids, w, torch.float16)).all()
    factors = row_factors(w)
    managed = restore(_expert_path(export.attenuate(bank, n), x, ids, w / factors, torch.float16), factors, n)
    assert torch.isfinite(managed).all()
    assert_close_to(managed, exact, tol=5e-3)


def test_eq1_a_stage_calibrates_its_gpu_blocks_and_not_its_cpu_ones() -> None:
    """What the stage's export calls per block: a GPU stage (f16) gets the calibrated exponent."""
    from modelfleet.engine.openvino.stage import _exponent

    bank, _ = _overflowing_bank()
    gamma = torch.ones(64)
    expected = layer_exponent(export.bank_peak(bank, calibration_rows(gamma)), "f16")
    assert _exponent(bank, gamma, CompileOptions("GPU", "default")) == expected > 0
    assert _exponent(bank, gamma, CompileOptions("CPU", "default")) == 0
    assert _exponent(bank, gamma, CompileOptions("GPU", "f32")) == 0
    tame = ExpertBank(bank.gate, bank.up / 40.0, bank.down / 4.0)
    assert _exponent(tame, gamma, CompileOptions("GPU", "default")) == 0


@pytest.mark.parametrize(("device", "threads"), [("CPU", 1), ("GPU", None), ("GPU.1", None)])
def test_a_cpu_stage_leaves_the_cores_to_openvinos_thread_pool(device: str, threads: int | None) -> None:
    assert host_threads(device) == threads


@pytest.mark.parametrize(
    ("device", "form"), [("CPU", "matmuls"), ("cpu", "matmuls"), ("GPU", "slices"), ("GPU.0", "slices")]
)
def test_dense_blocks_run_as_three_matmuls_on_cpus_and_as_slices_on_gpus(device: str, form: str) -> None:
    assert dense_form(device) == form


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "int4"])
def test_a_dense_block_gives_the_same_output_as_slices_and_as_three_matmuls(quantized: bool) -> None:
    plain = _dense_mlp(quantized)
    scale = torch.tensor([1.7])
    mlp = ScaledGatedMLP(plain.gate, plain.up, plain.down, scale)  # Inkling's dense block
    x = torch.randn(5, 64)
    whole = export.dense_weights(mlp, "dense")
    matmuls = DenseMatmuls(
        CompiledBlock(dense_graph(whole.gate, whole.up, whole.down, "dense"), OPTIONS), 0, "dense", 1.7
    )
    bank = export.slices_of(mlp, 32, "dense")
    slices = FusedMoE(
        CompiledBlock(moe_graph(bank, 3, "dense"), OPTIONS), None, None, 0, 3, 0, "dense", slice_weight=1.7
    )
    check_block_fused(slices.block, "dense")
    assert_close_to(matmuls(x), mlp(x), tol=1e-5)
    assert_close_to(slices(x), mlp(x), tol=1e-5)
    attenuated = export.attenuate(whole, 3)  # Eq. 1 on the matmul form too: A restored on the host
    graph = dense_graph(attenuated.gate, attenuated.up, attenuated.down, "attenuated")
    assert_close_to(DenseMatmuls(CompiledBlock(graph, OPTIONS), 3, "dense", 1.7)(x), mlp(x), tol=1e-5)


def test_a_fleet_of_a_torch_stage_and_an_openvino_stage_serves_the_engines_greedy_text_through_the_gateway(
    tmp_path: Path,
) -> None:
    """Stage 0 on torch, stage 1 on OpenVINO, speculative decoding on (so every stage rewinds):
    the gateway's greedy completions are the single-process engine's; slots are released."""
    from test_quickstart import ROOT, free_port, start_up

    from modelfleet.engine.generate import LocalModel, generate_batch
    from modelfleet.engine.sampling import SamplingParams
    from modelfleet.engine.tokenizer import TextTokenizer

    model = ROOT / "models" / "demo"
    prompts = ["def fibonacci(n):\n    ", "import os\n\n\ndef ", "class Parser:\n    def __init__(self"]
    tokenizer = TextTokenizer(model)
    lm = LocalModel.load(model, max_slots=len(prompts), max_context=256)
    params = [SamplingParams(max_tokens=24)] * len(prompts)
    expected = [
        tokenizer.decode(r.token_ids) for r in generate_batch(lm, [tokenizer.encode(p) for p in prompts], params)
    ]
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200", "OMP_NUM_THREADS": "1",
           "MF_OPENVINO_CACHE_DIR": str(tmp_path / "cache")}  # fmt: skip
    command = [str(ROOT / ".venv" / "bin" / "modelfleet"), "up", "--model", str(model), "--stages", "2",
               "--backend", "torch,openvino", "--insecure-wire", "--context-length", "256",
               "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "adaptive": false}']  # fmt: skip
    up, lines = start_up(command, port, env)
    try:
        for prompt, text in zip(prompts, expected, strict=True):
            body = json.dumps({"model": "demo", "prompt": prompt, "max_tokens": 24, "temperature": 0}).encode()
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}
            )
            answer = json.loads(urllib.request.urlopen(request, timeout=120).read())
            assert answer["choices"][0]["text"] == text
        status = _stage_status(lines, 1, port)
        assert status["backend"]["backend"] == "openvino" and status["backend"]["fused_layers"] == 3, status
        head = _stage_status(lines, 0, port)["head"]["speculative"]
        assert head["drafted"] > head["accepted"], head  # rejected drafts: every stage rewound
        assert status["slots_in_use"] == 0  # finished streams released on the OpenVINO stage
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(60)


def _stage_status(lines: list[str], stage: int, gateway_port: int) -> dict:  # type: ignore[type-arg]
    """A stage's /status, its port read from the plan table ``up`` printed (the gateway's left out)."""
    import re

    addresses = [m.group(1) for line in lines if (m := re.search(r"127\.0\.0\.1:(\d+)", line))]
    ports = sorted({int(p) for p in addresses} - {gateway_port})
    return json.loads(urllib.request.urlopen(f"http://127.0.0.1:{ports[stage] + 1}/status", timeout=5).read())


def test_the_openvino_image_installs_the_openvino_release_the_package_pins() -> None:
    import re
    import tomllib

    from test_quickstart import ROOT

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["openvino"]
    containerfile = (ROOT / "images" / "agent-openvino" / "Containerfile").read_text()
    build = (ROOT / "images" / "build.sh").read_text()
    pinned = re.findall(r"openvino==[0-9.]+", containerfile + build)
    assert extra == [pinned[0]] and set(pinned) == {pinned[0]}, (extra, pinned)


def _intel_gpu() -> bool:
    from modelfleet.engine.openvino.runtime import core

    return any(d.startswith("GPU") for d in core().available_devices)


@pytest.mark.skipif(not _intel_gpu(), reason="no Intel GPU visible to OpenVINO (the iGPU path is not exercised here)")
def test_on_an_intel_gpu_every_block_fuses_and_the_logits_follow_the_cpu_stage(tiny_checkpoint, openvino_stage) -> None:
    path, _ = tiny_checkpoint("qwen3_moe")
    gpu = load_backend("openvino", path, 0, 4, device="GPU", formats=FormatPlan.default())
    assert isinstance(gpu, OpenVINOShard) and gpu.fused_layers == gpu.moe_layers == 4
    cpu = openvino_stage("qwen3_moe", FormatPlan.default())
    for shard in (gpu, cpu):
        shard.allocate_cache(1, 64)
    a, b = gpu(Frame.of_streams([(0, 0, PROMPT)])), cpu(Frame.of_streams([(0, 0, PROMPT)]))
    assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min() >= 0.99  # f16 on the GPU
