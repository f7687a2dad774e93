"""Weight formats applied to whole models: quantizing at load, quantized checkpoints written
offline, GPT-OSS MXFP4 checkpoints kept packed, and the errors each path declares.

Accuracy is judged on tiny models *trained* for a second on a deterministic successor task
(each token has one next token): a random network's logits are nearly flat, so any 4-bit error
flips its top-1 choice, while a trained model's predictions have margins, as real ones do.

The GPT-OSS MXFP4 model clamps its experts at swiglu_limit 1.0, which transformers' GPT-OSS honours
only from 5.19.0 on; the comparison with it is skipped on an older one (tests/test_family_gpt_oss.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_family_gpt_oss import needs_transformers_with_swiglu_limit
from tiny import build_model, save_model, successor_chains, train_on_successors
from typer.testing import CliRunner

from modelfleet.cli import app
from modelfleet.engine import quantize as quantize_module
from modelfleet.engine.checkpoint import TensorDict
from modelfleet.engine.errors import CheckpointError, InputError
from modelfleet.engine.formats import FormatError, Int4Weight, Int8Weight, MXFP4Weight, quantize
from modelfleet.engine.formats.plan import FormatPlan, plan_from_options, role_of
from modelfleet.engine.frame import Frame
from modelfleet.engine.generate import LocalModel, generate, generate_batch
from modelfleet.engine.kernels import cpu_linear
from modelfleet.engine.layers import Dense
from modelfleet.engine.quantize import QuantizedDense, QuantizedEmbedding, QuantizedExperts
from modelfleet.engine.quantized_checkpoint import save_quantized
from modelfleet.engine.sampling import SamplingParams
from modelfleet.engine.shard import Shard
from modelfleet.engine.spec import load_spec
from modelfleet.planner import layer_bytes

INT4_EXPERTS_INT8_ATTENTION = FormatPlan(experts="int4", attention="int8")
PROMPT = [5, 17, 3, 99, 42, 8]
PROMPT_IDS = [5, 17, 99, 3, 64, 21, 8, 120, 45, 77, 12, 33, 90, 6, 101, 58]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory):
    """trained(family) -> (directory, transformers model, successor table), trained once."""
    cache: dict[str, tuple[Path, torch.nn.Module, torch.Tensor]] = {}

    def get(family: str):  # type: ignore[no-untyped-def]
        if family not in cache:
            # mixtral's tiny intermediate size (48) is no multiple of int4's group of 32
            model = build_model(family, **({"intermediate_size": 64} if family == "mixtral" else {}))
            successor = train_on_successors(model, 60)
            path = tmp_path_factory.mktemp(f"trained_{family}")
            model.save_pretrained(path)
            cache[family] = (path, model, successor)
        return cache[family]

    return get


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_int4_experts_and_int8_attention_keep_a_trained_models_logits_and_top1_choices(trained, family):
    path, model, successor = trained(family)
    ids = successor_chains(successor, 1, 64, torch.Generator().manual_seed(9))[0].tolist()
    with torch.no_grad():
        reference = model(torch.tensor([ids])).logits[0]
    shard = Shard.load(path, formats=INT4_EXPERTS_INT8_ATTENTION)
    assert set(shard.bytes_by_role["experts"]) == {"int4"} and set(shard.bytes_by_role["attention"]) == {"int8"}
    logits = shard(Frame.of_streams([(0, 0, ids)]))
    cosine = torch.nn.functional.cosine_similarity(logits, reference, dim=-1)
    top1 = (logits.argmax(-1) == reference.argmax(-1)).float().mean()
    # a position whose top-k routing flips under quantization moves further; the mean holds
    assert float(cosine.mean()) >= 0.99 and float(cosine.min()) >= 0.9
    assert float(top1) >= 0.9


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_offline_quantized_checkpoint_gives_exactly_the_logits_and_tokens_of_quantizing_at_load(
    tiny_checkpoint, tmp_path, monkeypatch, family
):
    source, _ = tiny_checkpoint(family)
    plan = FormatPlan.default()
    shard = Shard.load(source, formats=plan, pack=False)
    save_quantized(shard, source, tmp_path, plan, torch.float32)
    at_load = LocalModel.load(source, formats=plan, max_slots=1)

    def no_quantizing(*args: object) -> None:
        raise AssertionError("a quantized checkpoint must load without quantizing again")

    monkeypatch.setattr(quantize_module, "quantize", no_quantizing)
    offline = LocalModel.load(tmp_path, max_slots=1)
    frame = Frame.of_streams([(0, 0, PROMPT)])
    assert torch.equal(offline.forward(frame), at_load.forward(frame))
    offline.release(0)
    at_load.release(0)
    params = SamplingParams(max_tokens=12)
    assert generate(offline, PROMPT, params).token_ids == generate(at_load, PROMPT, params).token_ids
    assert offline.bytes_by_role == at_load.bytes_by_role


def json_line(output: str) -> dict:  # type: ignore[type-arg]
    return json.loads(next(line for line in reversed(output.splitlines()) if line.startswith("{")))


def test_quantize_command_then_generate_matches_generate_quantizing_at_load(tiny_checkpoint, tmp_path):
    source, _ = tiny_checkpoint("qwen3_moe")
    runner = CliRunner()
    out = tmp_path / "int4"
    written = runner.invoke(app, ["quantize", "--model", str(source), "--out", str(out)])
    assert written.exit_code == 0, written.output
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["formats"] == {"experts": "int4", "attention": "int8", "head": "int8", "embeddings": None}
    ask = ["generate", "--prompt-ids", "5,17,3,99", "--max-tokens", "10", "--json"]
    offline = runner.invoke(app, [*ask, "--model", str(out)])
    at_load = runner.invoke(app, [*ask, "--model", str(source), "--quantize"])
    assert offline.exit_code == 0 and at_load.exit_code == 0, offline.output + at_load.output
    assert json_line(offline.stdout)["token_ids"] == json_line(at_load.stdout)["token_ids"]


def test_generate_json_reports_resident_bytes_by_role_and_format(tiny_checkpoint):
    source, _ = tiny_checkpoint("qwen3_moe")
    ask = ["generate", "--model", str(source), "--prompt-ids", "5,6", "--max-tokens", "2", "--json"]
    result = CliRunner().invoke(app, [*ask, "--experts", "int4", "--attention", "none", "--head", "int8"])
    assert result.exit_code == 0, result.output
    report = json_line(result.stdout)
    by_role = report["bytes_by_role"]
    assert set(by_role["experts"]) == {"int4"} and set(by_role["head"]) == {"int8"}
    assert set(by_role["attention"]) == {"fp32"} and set(by_role["embeddings"]) == {"fp32"}
    assert report["weights_bytes"] == sum(n for formats in by_role.values() for n in formats.values())
    spec = load_spec(source)
    experts = spec.num_layers - 1  # one of the tiny qwen3_moe layers is dense (mlp_only_layers)
    params = experts * 8 * 3 * 64 * 32 + 3 * 64 * 96
    assert 0.5 < by_role["experts"]["int4"] / params < 1.0  # codes, fp16 scales, zeros, the kernel's scales


# ---- GPT-OSS MXFP4 ------------------------------------------------------------------------------


def pack_gpt_oss_mxfp4(model: torch.nn.Module, path: Path) -> dict[str, torch.Tensor]:
    """Save ``model`` as the released gpt-oss checkpoints store it (experts as *_blocks/*_scales,
    rows (out) first, gate/up interleaved); return the float state dict of its exact decode."""
    model.save_pretrained(path)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    packed = dict(state)
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        weight = quantize(state[name].transpose(1, 2), "mxfp4")  # [E, H, out] -> [E, out, H]
        assert isinstance(weight, MXFP4Weight)
        del packed[name]
        packed[f"{name}_blocks"], packed[f"{name}_scales"] = weight.blocks, weight.scales
        state[name] = weight.dequantize().transpose(1, 2).contiguous()
    for old in path.glob("*.safetensors*"):
        old.unlink()
    save_file({k: v.contiguous() for k, v in packed.items()}, path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["self_attn", "router"]}
    (path / "config.json").write_text(json.dumps(config))
    return state


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    model = build_model("gpt_oss", seed=2, swiglu_limit=1.0)
    state = pack_gpt_oss_mxfp4(model, path)
    model.load_state_dict(state)
    return path, model, state


def test_gpt_oss_mxfp4_checkpoint_loads_packed_at_half_a_byte_per_parameter(gpt_oss_mxfp4):
    path, _, _ = gpt_oss_mxfp4
    shard = Shard.load(path)
    banks = [layer.mlp.experts for layer in shard.layers]
    assert all(isinstance(b, QuantizedExperts) and isinstance(b.gate_up, MXFP4Weight) for b in banks)
    assert all(isinstance(b.down, MXFP4Weight) for b in banks)
    params = sum(b.gate_up.dequantize().numel() + b.down.dequantize().numel() for b in banks)
    assert shard.bytes_by_role["experts"]["mxfp4"] / params == pytest.approx(17 / 32, rel=1e-3)


MXFP4_IDS = torch.randint(3, 128, (24,), generator=torch.Generator().manual_seed(0)).tolist()


def test_gpt_oss_mxfp4_checkpoint_kept_packed_gives_the_logits_of_its_decoded_weights(gpt_oss_mxfp4):
    path, _, state = gpt_oss_mxfp4
    frame = Frame.of_streams([(0, 0, MXFP4_IDS)])
    packed = Shard.load(path)(frame)
    decoded = Shard.from_checkpoint(load_spec(path), TensorDict(state))(frame)
    assert float((packed - decoded).abs().max() / decoded.abs().max()) <= 1e-5


@needs_transformers_with_swiglu_limit
def test_gpt_oss_mxfp4_checkpoint_matches_a_float_model_of_its_decoded_weights(gpt_oss_mxfp4):
    """The float model is transformers' GPT-OSS, which clamps the experts at the fixture's
    swiglu_limit of 1.0 only from transformers 5.19.0 on (see tests/test_family_gpt_oss.py):
    5.17 clamps at 7.0 and lands 0.33 (relative) away, so the test is skipped there."""
    path, model, _ = gpt_oss_mxfp4
    packed = Shard.load(path)(Frame.of_streams([(0, 0, MXFP4_IDS)]))
    with torch.no_grad():
        reference = model(torch.tensor([MXFP4_IDS])).logits[0]
    assert float((packed - reference).abs().max() / reference.abs().max()) <= 1e-4


def test_gpt_oss_mxfp4_scales_holding_nan_are_rejected_naming_the_tensor(gpt_oss_mxfp4, tmp_path):
    path, _, _ = gpt_oss_mxfp4
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.1.mlp.experts.down_proj_scales"][0, 3, 0] = 0xFF
    for config in path.glob("*.json"):
        (tmp_path / config.name).write_text(config.read_text())
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"layers\.1\.mlp\.experts\.down_proj.*0xFF"):
        Shard.load(tmp_path)


# ---- how formats sit in the engine --------------------------------------------------------------


def test_deepseek_kv_b_proj_stays_plain_while_the_rest_of_attention_is_int8(tiny_checkpoint):
    source, _ = tiny_checkpoint("deepseek_v3")
    shard = Shard.load(source, formats=FormatPlan.default())
    attention = shard.layers[0].attention
    assert isinstance(attention.kv_up, Dense) and attention.kv_up.weight.dtype == torch.float32
    assert isinstance(attention.q_up, QuantizedDense) and isinstance(attention.q_up.weight, Int8Weight)
    assert isinstance(shard.layers[0].mlp.gate, QuantizedDense)  # the dense first layer is a feed-forward
    assert isinstance(shard.layers[1].mlp.experts.gate_up, Int4Weight)
    assert isinstance(shard.layers[1].mlp.router_proj, Dense)  # routers stay in float32


def test_quantized_modules_are_never_packed_for_onednn(tiny_checkpoint):
    source, _ = tiny_checkpoint("qwen3_moe")
    shard = Shard.load(source, dtype="bfloat16", formats=FormatPlan(experts="int4"))
    assert isinstance(shard.layers[0].mlp.experts, QuantizedExperts)
    assert set(shard.bytes_by_role["experts"]) == {"int4"}  # the dense layer's MLP too
    if cpu_linear.available(torch.empty(1, 1, dtype=torch.bfloat16)):  # plain bf16 projections still pack
        assert shard.layers[0].attention.qkv.packed is not None


QUANTIZED_PLANS = {
    "qwen3_moe": FormatPlan(experts="int4", attention="int8", head="int8"),
    "gpt_oss": FormatPlan(experts="mxfp4", attention="int8"),
}


@pytest.mark.parametrize("family", sorted(QUANTIZED_PLANS))
def test_static_decode_over_quantized_weights_gives_the_logits_of_general_frames(tiny_checkpoint, family):
    path, _ = tiny_checkpoint(family)
    prompts = [PROMPT_IDS[:5], PROMPT_IDS[4:15], PROMPT_IDS[9:10]]
    plan = QUANTIZED_PLANS[family]
    general = LocalModel.load(path, max_slots=3, max_context=32, static_decode=False, formats=plan)
    static = LocalModel.load(path, max_slots=3, max_context=32, static_decode=True, formats=plan)
    assert static.static_decode  # on CPU steps run eagerly, experts grouped
    for lm in (general, static):
        for slot, prompt in enumerate(prompts):
            lm.acquire()
            lm.forward(Frame.of_streams([(slot, 0, prompt)]))
    positions = [len(p) for p in prompts]
    for step in range(8):
        tokens = [(5 * step + 3 * slot) % 100 for slot in range(3)]
        ours, ref = static.decode(tokens, [0, 1, 2], positions), general.decode(tokens, [0, 1, 2], positions)
        assert float((ours - ref).abs().max()) <= 1e-5 * float(ref.abs().max())
        positions = [p + 1 for p in positions]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("family", sorted(QUANTIZED_PLANS))
def test_cuda_graphs_over_packed_experts_give_the_tokens_of_eager_decoding(tiny_checkpoint, family):
    path, _ = tiny_checkpoint(family)
    prompts = [PROMPT_IDS[:3], PROMPT_IDS[2:12], PROMPT_IDS[7:8]]
    params = SamplingParams(max_tokens=16, stop_token_ids=())
    plan = QUANTIZED_PLANS[family]
    eager = LocalModel.load(path, device="cuda", dtype="bfloat16", max_slots=3, static_decode=False, formats=plan)
    graphed = LocalModel.load(path, device="cuda", dtype="bfloat16", max_slots=3, static_decode=True, formats=plan)
    assert graphed.static_decode
    bank = graphed.shards[0].layers[-1].mlp.experts
    assert isinstance(bank, QuantizedExperts) and bank.gathered_on(torch.device("cuda"))
    expected = [r.token_ids for r in generate_batch(eager, prompts, params)]
    assert [r.token_ids for r in generate_batch(graphed, prompts, params)] == expected
    assert graphed._decoders and all(d.graph is not None for d in graphed._decoders.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("embeddings", ["int8", "int4_sym", "mxfp4"])
def test_cuda_graphs_over_packed_embeddings_give_the_tokens_of_eager_decoding(tiny_checkpoint, embeddings):
    path, _ = tiny_checkpoint("qwen3_moe")
    prompts = [PROMPT_IDS[:3], PROMPT_IDS[2:12], PROMPT_IDS[7:8]]
    params = SamplingParams(max_tokens=16, stop_token_ids=())
    plan = FormatPlan.default(embeddings=embeddings)
    eager = LocalModel.load(path, device="cuda", dtype="bfloat16", max_slots=3, static_decode=False, formats=plan)
    graphed = LocalModel.load(path, device="cuda", dtype="bfloat16", max_slots=3, static_decode=True, formats=plan)
    assert graphed.static_decode and isinstance(graphed.shards[0].embed, QuantizedEmbedding)
    expected = [r.token_ids for r in generate_batch(eager, prompts, params)]
    assert [r.token_ids for r in generate_batch(graphed, prompts, params)] == expected
    assert graphed._decoders and all(d.graph is not None for d in graphed._decoders.values())


def test_every_expert_format_has_a_gathered_kernel_on_cuda_so_graphs_can_hold_it(tiny_checkpoint):
    path, _ = tiny_checkpoint("qwen3_moe")
    for name in ("int4", "int4_sym", "int8", "mxfp4"):
        bank = Shard.load(path, formats=FormatPlan(experts=name)).layers[-1].mlp.experts
        assert isinstance(bank, QuantizedExperts) and not bank.gathered_on(torch.device("cpu"))
        assert bank.gathered_on(torch.device("cuda")) == torch.cuda.is_available()


def test_embeddings_in_bf16_feed_the_layers_in_the_compute_dtype(tiny_checkpoint):
    source, _ = tiny_checkpoint("qwen3_moe")
    shard = Shard.load(source, formats=FormatPlan(embeddings="bf16"))
    assert shard.embed is not None and shard.embed.dtype == torch.bfloat16
    assert shard.bytes_by_role["embeddings"] == {"bf16": 128 * 64 * 2}
    plain = Shard.load(source)(Frame.of_streams([(0, 0, PROMPT)]))
    ours = shard(Frame.of_streams([(0, 0, PROMPT)]))
    assert ours.dtype == torch.float32 and float((ours - plain).abs().max() / plain.abs().max()) < 1e-2


# ---- packed embeddings ---------------------------------------------------------------------------


def embedding_bytes(source: Path, embeddings: str) -> dict[str, int]:
    ask = ["generate", "--model", str(source), "--prompt-ids", "5,6", "--max-tokens", "1", "--json"]
    result = CliRunner().invoke(app, [*ask, "--embeddings", embeddings])
    assert result.exit_code == 0, result.output
    return json_line(result.stdout)["bytes_by_role"]["embeddings"]


def test_int8_embeddings_keep_a_trained_models_logits_and_load_offline_to_the_same_tokens(
    trained, tmp_path, monkeypatch
):
    path, _, successor = trained("qwen3_moe")
    plan = FormatPlan(embeddings="int8")
    ids = successor_chains(successor, 1, 64, torch.Generator().manual_seed(9))[0].tolist()
    frame = Frame.of_streams([(0, 0, ids)])
    reference, at_load = Shard.load(path)(frame), Shard.load(path, formats=plan, pack=False)
    assert isinstance(at_load.embed, QuantizedEmbedding) and isinstance(at_load.embed.weight, Int8Weight)
    logits = at_load(frame)
    # int8 rows sit within half a step (absmax / 254) of the float table; a position whose top-k
    # routing flips moves further, so the typical position and the mean are what hold tightly
    error = (logits - reference).abs().amax(-1) / reference.abs().amax(-1)
    cosine = torch.nn.functional.cosine_similarity(logits, reference, dim=-1)
    assert float(error.median()) <= 1e-2 and float(cosine.mean()) >= 0.99 and float(cosine.min()) >= 0.9
    assert float((logits.argmax(-1) == reference.argmax(-1)).float().mean()) >= 0.95
    save_quantized(at_load, path, tmp_path, plan, torch.float32)
    assert {"embed.weight.codes", "embed.weight.scales"} <= set(load_file(next(tmp_path.glob("model-*.safetensors"))))
    quantizing_at_load = LocalModel.load(path, formats=plan, max_slots=1)

    def no_quantizing(*args: object) -> None:
        raise AssertionError("a quantized checkpoint must load without quantizing again")

    monkeypatch.setattr(quantize_module, "quantize", no_quantizing)
    offline = LocalModel.load(tmp_path, max_slots=1)
    prompt, params = ids[:6], SamplingParams(max_tokens=16)
    tokens = generate(offline, prompt, params).token_ids
    assert tokens == generate(quantizing_at_load, prompt, params).token_ids
    assert tokens == generate(LocalModel.load(path, max_slots=1), prompt, params).token_ids  # float's, too
    assert offline.bytes_by_role["embeddings"] == {"int8": 128 * 64 + 128 * 4}
    sizes = layer_bytes(tmp_path)  # the planner counts the packed table as stored, the plain head apart
    assert (sizes.embed_bytes, sizes.head_matrix_bytes, sizes.tied) == (128 * 64 + 128 * 4, 128 * 64 * 4, False)


@pytest.mark.parametrize("embeddings", ["int8", "int4"])
def test_a_head_tied_to_packed_embeddings_is_their_weight_held_once_in_every_cut_and_on_disk(tmp_path, embeddings):
    save_model("qwen3_moe", tmp_path / "src", tie_word_embeddings=True)
    plan = FormatPlan.default(embeddings=embeddings)  # the head's own int8 is unused: it is the table
    shard = Shard.load(tmp_path / "src", formats=plan, pack=False)
    assert isinstance(shard.embed, QuantizedEmbedding) and shard.head is not None
    assert shard.head.weight is shard.embed.weight and shard.embed.weight.format == embeddings
    assert "head" not in shard.bytes_by_role
    assert shard.bytes_by_role["embeddings"] == {embeddings: shard.embed.weight.nbytes}
    frame = Frame.of_streams([(0, 0, PROMPT)])
    whole = shard(frame)
    cut = LocalModel.load(tmp_path / "src", 2, formats=plan, max_slots=1)  # the last shard quantizes its copy
    assert torch.equal(cut.forward(frame), whole)
    save_quantized(shard, tmp_path / "src", tmp_path / "q", plan, torch.float32)
    names = set(json.loads((tmp_path / "q" / "model.safetensors.index.json").read_text())["weight_map"])
    assert not any(name.startswith("head.") for name in names) and "embed.weight.codes" in names
    loaded = Shard.load(tmp_path / "q")
    assert isinstance(loaded.embed, QuantizedEmbedding) and loaded.head is not None
    assert loaded.head.weight is loaded.embed.weight and loaded.bytes_by_role == shard.bytes_by_role
    sizes = layer_bytes(tmp_path / "q")  # the planner counts the stored table once (kernel layouts aside)
    stored = {"int8": 128 * 64 + 128 * 4, "int4": 128 * 64 // 2 + 128 * 2 * 2 + 128}[embeddings]
    assert sizes.tied and sizes.embed_bytes == sizes.head_matrix_bytes == stored
    assert torch.equal(loaded(frame), whole)
    assert torch.equal(LocalModel.load(tmp_path / "q", 2, max_slots=1).forward(frame), whole)


def test_generate_json_reports_packed_embeddings_at_half_or_under_a_third_of_bf16(tiny_checkpoint):
    source, _ = tiny_checkpoint("qwen3_moe")  # a 128 x 64 table
    bf16 = embedding_bytes(source, "bf16")["bf16"]
    assert bf16 == 128 * 64 * 2
    assert embedding_bytes(source, "int8") == {"int8": 128 * 64 + 128 * 4}  # codes, float32 row scales
    int4 = embedding_bytes(source, "int4")["int4"]  # codes, fp16 scales, packed zeros: 4.625 bits a value
    assert int4 == 128 * 64 // 2 + 128 * 2 * 2 + 128
    assert 0.5 <= (128 * 64 + 128 * 4) / bf16 <= 0.55 and 0.25 <= int4 / bf16 <= 0.3


def test_quantize_command_with_int8_embeddings_matches_generate_quantizing_at_load(tiny_checkpoint, tmp_path):
    source, _ = tiny_checkpoint("qwen3_moe")
    runner = CliRunner()
    written = runner.invoke(app, ["quantize", "--model", str(source), "--out", str(tmp_path), "--embeddings", "int8"])
    assert written.exit_code == 0, written.output
    config = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert config["formats"]["embeddings"] == "int8"
    ask = ["generate", "--prompt-ids", "5,17,3,99", "--max-tokens", "10", "--json"]
    offline = runner.invoke(app, [*ask, "--model", str(tmp_path)])
    at_load = runner.invoke(app, [*ask, "--model", str(source), "--quantize", "--embeddings", "int8"])
    assert offline.exit_code == 0 and at_load.exit_code == 0, offline.output + at_load.output
    assert json_line(offline.stdout)["token_ids"] == json_line(at_load.stdout)["token_ids"]
    assert json_line(offline.stdout)["bytes_by_role"] == json_line(at_load.stdout)["bytes_by_role"]


@pytest.mark.parametrize(
    ("path", "role"),
    [
        ("layers.3.attention.qkv", "attention"),
        ("layers.3.attention.qk_norm_weight", "other"),
        ("layers.3.attention.kv_norm.weight", "other"),
        ("layers.3.mlp.experts.gate_up", "experts"),
        ("layers.3.mlp.shared.down.weight", "experts"),
        ("layers.3.mlp.router_proj.weight", "other"),
        ("layers.3.input_norm.weight", "other"),
        ("head.weight", "head"),
        ("embed", "embeddings"),
        ("norm.weight", "other"),
    ],
)
def test_every_weight_has_a_role_by_where_it_sits(path, role):
    assert role_of(path) == role


# ---- errors -------------------------------------------------------------------------------------


def test_an_unknown_format_name_lists_the_known_formats():
    with pytest.raises(FormatError, match=r"unknown weight format 'int3'; known formats: int4, int4_sym, int8, mxfp4"):
        FormatPlan(experts="int3")


def test_a_role_that_cannot_hold_a_format_says_what_it_supports():
    with pytest.raises(
        FormatError, match=r"'mxfp4' is not supported for head; head supports int4, int4_sym, int8, bf16"
    ):
        FormatPlan(head="mxfp4")
    with pytest.raises(FormatError, match=r"'mxfp4' is not supported for attention"):
        plan_from_options(False, attention="mxfp4")


def test_a_weight_whose_shape_a_format_cannot_hold_is_named_with_its_role(tiny_checkpoint):
    source, _ = tiny_checkpoint("mixtral")  # intermediate size 48: no multiple of 32
    with pytest.raises(FormatError, match=r"layers\.0\.mlp\.experts\.down \(experts\) in int4: .*group size 32"):
        Shard.load(source, formats=FormatPlan(experts="int4"))


def test_generate_rejects_an_unknown_format_with_a_clear_message(tiny_checkpoint):
    source, _ = tiny_checkpoint("qwen3_moe")
    ask = ["generate", "--model", str(source), "--prompt-ids", "5", "--max-tokens", "1", "--experts", "int3"]
    result = CliRunner().invoke(app, ask)
    assert result.exit_code == 2 and "unknown weight format 'int3'" in result.output


@pytest.mark.parametrize("command", ["generate", "quantize"])
def test_an_unknown_embeddings_format_is_refused_by_generate_and_quantize(tiny_checkpoint, tmp_path, command):
    source, _ = tiny_checkpoint("qwen3_moe")
    ask = {
        "generate": ["generate", "--model", str(source), "--prompt-ids", "5", "--max-tokens", "1"],
        "quantize": ["quantize", "--model", str(source), "--out", str(tmp_path / "q")],
    }[command]
    result = CliRunner().invoke(app, [*ask, "--embeddings", "int3"])
    assert result.exit_code == 2 and "unknown weight format 'int3'" in result.output
    assert not (tmp_path / "q").exists()


def test_int4_embeddings_with_a_hidden_size_off_the_group_of_32_name_the_table_and_its_shape(tmp_path):
    save_model("qwen3_moe", tmp_path, hidden_size=48)
    with pytest.raises(FormatError, match=r"embed \(embeddings\) in int4: .*\(128, 48\).*group size 32"):
        Shard.load(tmp_path, formats=FormatPlan(embeddings="int4"))


def test_a_corrupt_scales_tensor_in_a_quantized_checkpoint_is_named_at_load(tiny_checkpoint, tmp_path):
    source, _ = tiny_checkpoint("qwen3_moe")
    plan = FormatPlan.default()
    save_quantized(Shard.load(source, formats=plan, pack=False), source, tmp_path, plan, torch.float32)
    file = next(tmp_path.glob("model-*.safetensors"))
    tensors = load_file(file)
    tensors["layers.2.mlp.experts.down.scales"][1, 0, 0] = float("nan")
    save_file(tensors, file)
    with pytest.raises(CheckpointError, match=r"layers\.2\.mlp\.experts\.down' \(int4\) is corrupt: .*nan"):
        Shard.load(tmp_path)


def test_a_quantized_checkpoint_refuses_other_formats_rather_than_quantizing_twice(tiny_checkpoint, tmp_path):
    source, _ = tiny_checkpoint("qwen3_moe")
    plan = FormatPlan.default()
    save_quantized(Shard.load(source, formats=plan, pack=False), source, tmp_path, plan, torch.float32)
    with pytest.raises(InputError, match="already quantized"):
        Shard.load(tmp_path, formats=FormatPlan(experts="int8"))


def test_quantize_command_refuses_to_overwrite_a_checkpoint(tiny_checkpoint, tmp_path):
    source, _ = tiny_checkpoint("qwen3_moe")
    (tmp_path / "config.json").write_text("{}")
    result = CliRunner().invoke(app, ["quantize", "--model", str(source), "--out", str(tmp_path)])
    assert result.exit_code == 2 and "--force" in result.output


def test_a_tied_head_left_plain_is_written_once_and_tied_again_at_load(tmp_path):
    save_model("qwen3_moe", tmp_path / "src", tie_word_embeddings=True)
    plan = FormatPlan(experts="int4", attention="int8")
    shard = Shard.load(tmp_path / "src", formats=plan, pack=False)
    save_quantized(shard, tmp_path / "src", tmp_path / "q", plan, torch.float32)
    loaded = Shard.load(tmp_path / "q")
    assert loaded.head is not None and loaded.embed is not None
    assert loaded.head.weight.data_ptr() == loaded.embed.data_ptr()
    frame = Frame.of_streams([(0, 0, PROMPT)])
    assert torch.equal(loaded(frame), shard(frame))


@pytest.mark.parametrize(("experts", "bank"), [("none", MXFP4Weight), ("int4", Int4Weight)])
def test_an_mxfp4_gpt_oss_checkpoint_quantized_offline_keeps_or_converts_its_experts_as_asked(
    gpt_oss_mxfp4, tmp_path, experts, bank
):
    path, _, _ = gpt_oss_mxfp4
    result = CliRunner().invoke(app, ["quantize", "--model", str(path), "--out", str(tmp_path), "--experts", experts])
    assert result.exit_code == 0, result.output
    offline = Shard.load(tmp_path)
    assert isinstance(offline.layers[0].mlp.experts.gate_up, bank)
    at_load = Shard.load(path, formats=FormatPlan.default(experts=None if experts == "none" else experts))
    frame = Frame.of_streams([(0, 0, PROMPT)])
    assert torch.equal(offline(frame), at_load(frame))
