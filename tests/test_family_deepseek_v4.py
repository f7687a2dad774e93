"""DeepSeek-V4 against transformers on a tiny random checkpoint (tests/dsv4_tiny.py): three
hyper-connection streams, an HCA layer (blocks of 8), two CSA layers (blocks of 4, an indexer
keeping 3 blocks) and a sliding layer (window 8), hash-routed MoE layers 0 and 2 (so a stage past
the first needs the rows' token ids), sqrt-softplus routing with a correction bias, clamped experts
and a shared expert.

Prompts of 40 positions cross five HCA blocks, ten CSA blocks (so the indexer chooses) and the
sliding window five times over. Sections: transformers' logits and tokens, cuts and the residual,
per-stream state, tensor parallelism, formats, the published checkpoint layout, MTP, planning and
fleets. docs/deepseek_v4.md maps each architecture feature to its test.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from dsv4_tiny import CONFIG, build, save
from safetensors.torch import load_file, save_file
from test_tensor_parallel import LocalGroup, spawn_ranks
from tiny import assert_close_to, reference_logits, successor_chains, train_on_successors
from typer.testing import CliRunner

from modelfleet.cli import app
from modelfleet.engine.cache_layout import cache_layout
from modelfleet.engine.errors import InputError
from modelfleet.engine.formats import FormatError, MXFP4Weight
from modelfleet.engine.formats import quantize as mxfp4_quantize
from modelfleet.engine.formats.plan import FormatPlan
from modelfleet.engine.frame import Frame
from modelfleet.engine.generate import LocalModel
from modelfleet.engine.models.deepseek_v4_mtp import load_mtp
from modelfleet.engine.quantize import QuantizedExperts
from modelfleet.engine.quantized_checkpoint import save_quantized
from modelfleet.engine.residual import residual_shape
from modelfleet.engine.sampling import SamplingParams
from modelfleet.engine.shard import Shard
from modelfleet.engine.spec import load_spec
from modelfleet.engine.tensor_parallel import check_tensor_split, close_tensor_group, init_tensor_group
from modelfleet.operator.summary import ModelSummary
from modelfleet.planner import kv_bytes_per_layer

SLACK = 8  # rewind slack of the rings in these tests
STEPS = 30  # teacher-forced training steps before the int4 comparison


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("deepseek_v4")
    return path, save(path)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def small_cache(shard: Shard | LocalModel) -> None:
    shards = shard.shards if isinstance(shard, LocalModel) else [shard]
    for s in shards:
        s.allocate_cache(max_slots=4, max_context=128, rewind_slack=SLACK)


def test_prompt_logits_match_transformers_at_every_position_across_blocks_and_windows(tiny):
    path, model = tiny
    ids = tokens(40, seed=0)
    ours = Shard.load(path)(Frame.of_streams([(0, 0, ids)]))
    assert_close_to(ours, reference_logits(model, ids), 1e-4)


def test_32_greedy_tokens_match_transformers_generate(tiny):
    path, model = tiny
    shard = Shard.load(path)
    small_cache(shard)
    prompt = tokens(20, seed=1)
    steps = [shard(Frame.of_streams([(0, 0, prompt)]))[-1]]
    generated = [int(steps[-1].argmax())]
    for position in range(len(prompt), len(prompt) + 31):
        steps.append(shard(Frame.of_streams([(0, position, generated[-1:])]))[0])
        generated.append(int(steps[-1].argmax()))
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False)
    assert generated == out[0, len(prompt) :].tolist() and len(set(generated)) > 4
    assert_close_to(torch.stack(steps), reference_logits(model, prompt + generated[:-1])[len(prompt) - 1 :])


@pytest.mark.parametrize("shards", [1, 2, 3])
def test_one_two_and_three_shards_passing_hyper_connection_streams_give_the_logits_of_the_whole(tiny, shards):
    path, model = tiny
    ids = tokens(40, seed=2)
    lm = LocalModel.load(path, shards=shards, max_slots=1, max_context=64)
    assert_close_to(lm.forward(Frame.of_streams([(0, 0, ids)])), reference_logits(model, ids))
    first = lm.shards[0](Frame.of_streams([(0, 0, ids[:3])]))
    if shards > 1:  # the residual between stages: hc_mult streams in float32
        assert first.dtype == torch.float32 and tuple(first.shape) == (3, CONFIG["hc_mult"], CONFIG["hidden_size"])


def test_the_residual_shape_is_the_familys_and_a_stage_refuses_rows_of_another_or_unknown_tokens(tiny):
    path, _ = tiny
    spec = load_spec(path)
    assert residual_shape(spec) == (CONFIG["hc_mult"], CONFIG["hidden_size"])
    second = Shard.load(path, 2, 4)
    flat = torch.zeros(2, CONFIG["hidden_size"])
    with pytest.raises(InputError, match=r"residual rows are \[3, 64\]"):
        second(Frame(torch.tensor([0, 0]), torch.tensor([0, 1]), torch.tensor([5, 6]), hidden=flat))
    streams = torch.zeros(2, 3, 64)
    with pytest.raises(InputError, match=r"token id 128 is outside the vocabulary \[0, 128\)"):
        second(Frame(torch.tensor([0, 0]), torch.tensor([0, 1]), torch.tensor([5, 128]), hidden=streams))


def test_a_hash_routed_layer_past_the_first_stage_reads_the_token_ids_the_frame_carries(tiny):
    path, model = tiny
    ids = tokens(12, seed=3)
    first, rest = Shard.load(path, 0, 2), Shard.load(path, 2, 4)  # layer 2 routes by token
    hidden = first(Frame.of_streams([(0, 0, ids)]))
    assert_close_to(rest(Frame.of_streams([(0, 0, ids)], hidden=hidden)), reference_logits(model, ids))
    rest.release(0)
    with pytest.raises(InputError, match="token ids"):
        rest(Frame(torch.zeros(12, dtype=torch.int64), torch.arange(12), hidden=hidden))


def test_cache_layout_lists_window_block_and_journal_entries_per_attention_kind(tiny):
    path, _ = tiny
    spec = load_spec(path)
    hca, csa, sliding = (cache_layout(spec, i).entries for i in (0, 1, 2))
    assert list(sliding) == ["kv"] and sliding["kv"].window == 8 and not sliding["kv"].split
    assert list(hca) == ["kv", "compressed", "compressor_inputs"]
    assert hca["compressed"].stride == 8 and hca["compressor_inputs"].window == 8
    assert list(csa) == ["kv", "compressed", "indexer_keys", "compressor_inputs"]
    assert csa["compressed"].stride == 4 and csa["indexer_keys"].shape == (16,)
    assert csa["compressor_inputs"].window == 8 and csa["compressor_inputs"].shape == (4 * 32 + 4 * 16,)


def test_the_shard_allocates_the_state_the_planner_and_the_summary_reserve(tiny):
    path, _ = tiny
    shard = Shard.load(path)
    shard.allocate_cache(max_slots=3, max_context=100)
    spec = load_spec(path)
    planned = kv_bytes_per_layer(spec, 3, 100, "float32")
    assert [kv.nbytes for kv in shard.kv] == planned
    result = CliRunner().invoke(app, ["inspect", "--model", str(path), "--dtype", "float32"])
    assert ModelSummary.from_json(result.stdout).kv_bytes(3, 100) == planned


def test_a_frame_of_three_streams_one_in_prefill_gives_each_the_logits_it_gets_alone(tiny):
    path, _ = tiny
    alone, mixed = Shard.load(path), Shard.load(path)
    small_cache(alone), small_cache(mixed)
    a, b, c = tokens(30, seed=4), tokens(17, seed=5), tokens(9, seed=6)
    mixed(Frame.of_streams([(0, 0, a[:29]), (1, 0, b[:16])]))
    out = mixed(Frame.of_streams([(0, 29, a[29:]), (2, 0, c), (1, 16, b[16:])]))
    expected = [alone(Frame.of_streams([(0, 0, s)])) for s in (a, c, b)]
    for slot in range(3):
        alone.release(slot)
    assert_close_to(out[0], expected[0][-1], 1e-5)
    assert_close_to(out[1:10], expected[1], 1e-5)
    assert_close_to(out[10], expected[2][-1], 1e-5)


@pytest.mark.parametrize("back", range(1, 9))
def test_rewind_then_re_decode_reproduces_every_state_kind_across_block_boundaries(tiny, back):
    """Decode to 40 (a boundary of HCA and CSA blocks), rewind ``back`` positions (into pooled
    blocks: back >= 1 reopens CSA's block 9, >= 8 HCA's block 4), decode other tokens, and match a
    stream that saw only those."""
    path, model = tiny
    shard = Shard.load(path)
    small_cache(shard)
    ids, other = tokens(40, seed=7), tokens(back + 3, seed=8)
    shard(Frame.of_streams([(0, 0, ids[:32])]))
    for position in range(32, 40):
        shard(Frame.of_streams([(0, position, ids[position : position + 1])]))
    shard.rewind(0, 40 - back)
    ours = torch.cat([shard(Frame.of_streams([(0, 40 - back + j, [t])])) for j, t in enumerate(other)])
    assert_close_to(ours, reference_logits(model, ids[: 40 - back] + other)[40 - back :])


def test_a_rejected_draft_frame_rewinds_and_a_verify_frame_of_several_rows_resumes(tiny):
    """Speculative decoding's pattern: 7 draft rows in one frame across CSA block 9's and HCA block
    4's ends, all rejected after the first, then 4 rows verified in one frame."""
    path, model = tiny
    shard = Shard.load(path)
    small_cache(shard)
    ids, draft, accepted = tokens(37, seed=21), tokens(7, seed=22), tokens(4, seed=23)
    shard(Frame.of_streams([(0, 0, ids)]))
    shard(Frame.of_streams([(0, 37, draft)]))
    shard.rewind(0, 38)
    ours = shard(Frame.of_streams([(0, 38, accepted)]))
    assert_close_to(ours, reference_logits(model, ids + draft[:1] + accepted)[38:])


def test_a_released_slot_serves_a_new_stream_as_if_fresh(tiny):
    path, model = tiny
    shard = Shard.load(path)
    small_cache(shard)
    shard(Frame.of_streams([(0, 0, tokens(37, seed=9))]))
    shard.release(0)
    ids = tokens(23, seed=10)
    assert_close_to(shard(Frame.of_streams([(0, 0, ids)])), reference_logits(model, ids))


# ---- tensor parallelism ----------------------------------------------------------------------


# (checkpoint, formats): the tiny model in float32, and one with experts of width 64 in int4 (each
# rank's 32 columns of down are whole int4 groups: the split is block-preserving)
TENSOR_CASES = {"float32": None, "int4_experts": FormatPlan(experts="int4")}


def _tensor_run(path: Path, formats: FormatPlan | None, group: Any) -> dict[str, Any]:
    lm = LocalModel.load(path, 2, formats=formats, tensor=group, max_slots=2, max_context=64)
    logits = lm.forward(Frame.of_streams([(0, 0, tokens(30, seed=11))]))
    decode = lm.forward(Frame.of_streams([(0, 30, [7]), (1, 0, tokens(5, seed=12))]))
    return {"logits": logits, "decode": decode, "heads": lm.shards[0].layers[0].attention.num_heads}


def _rank_main(rank: int, size: int, port: int, paths: dict[str, Path], out: Path) -> None:
    torch.set_num_threads(1)
    group = init_tensor_group(rank, size, "127.0.0.1", port, "cpu", timeout_seconds=60)
    try:
        results = {name: _tensor_run(paths[name], TENSOR_CASES[name], group) for name in TENSOR_CASES}
    finally:
        close_tensor_group()
    torch.save(results, out / f"rank{rank}.pt")


def test_two_tensor_ranks_give_the_logits_of_the_whole_model_in_float32_and_with_int4_experts(tiny, tmp_path):
    paths = {"float32": tiny[0], "int4_experts": tmp_path / "wide"}
    save(paths["int4_experts"], seed=6, moe_intermediate_size=64)
    spawn_ranks(_rank_main, lambda rank, port: (rank, 2, port, paths, tmp_path))
    results: list[dict[str, Any]] = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for name, formats in TENSOR_CASES.items():
        whole = _tensor_run(paths[name], formats, None)
        for rank in results:
            assert rank[name]["heads"] == CONFIG["num_attention_heads"] // 2
            assert_close_to(rank[name]["logits"], whole["logits"])
            assert_close_to(rank[name]["decode"], whole["decode"])


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module, torch.Tensor]:
    """The tiny model teacher-forced for STEPS steps on a successor task (each token has one next
    token), as tests/test_quantized_models.py trains its models: its logits have margins."""
    model = build(seed=1)
    successor = train_on_successors(model, STEPS, rows=8, length=12)
    path = tmp_path_factory.mktemp("deepseek_v4_trained")
    model.save_pretrained(path)
    return path, model, successor


@pytest.mark.parametrize(
    "formats", [FormatPlan(experts="int4"), FormatPlan(experts="int4", attention="int8")], ids=["int4", "int4+int8"]
)
def test_int4_experts_keep_a_teacher_forced_models_logits_and_top1_choices(trained, formats):
    path, model, successor = trained
    ids = successor_chains(successor, 1, 48, torch.Generator().manual_seed(9))[0].tolist()
    reference = reference_logits(model, ids)
    shard = Shard.load(path, formats=formats)
    assert set(shard.bytes_by_role["experts"]) == {"int4"}
    logits = shard(Frame.of_streams([(0, 0, ids)]))
    cosine = torch.nn.functional.cosine_similarity(logits, reference, dim=-1)
    top1 = (logits.argmax(-1) == reference.argmax(-1)).float().mean()
    assert float(cosine.mean()) >= 0.99 and float(cosine.min()) >= 0.9
    assert float(top1) >= 0.9


# ---- the checkpoint as DeepSeek publishes it ----------------------------------------------------

FP8_PROJECTIONS = re.compile(r"\.(wq_a|wq_b|wkv|wo_a|wo_b|shared_experts\.w[123])\.weight$")
EXPERT = re.compile(r"\.experts\.\d+\.w[123]\.weight$")


def published(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(DeepSeek's layout, the float tensors it decodes to under transformers' names): no ``model.``
    prefix, ``embed.weight``/``norm.weight``/``hc_head_*``/``attn.kv_norm``; routed experts as FP4 (int8 [out, in/2],
    two E2M1 codes a byte, low nibble first) with an F8_E8M0 scale per 32; attention and shared-expert
    projections as FP8 E4M3 with an E8M0 scale per 128x128 block."""
    stored, decoded = {}, {}
    for name, t in tensors.items():
        value = t
        if EXPERT.search(name):
            packed = mxfp4_quantize(t, "mxfp4")
            assert isinstance(packed, MXFP4Weight)
            decoded[name] = packed.dequantize()
            stored[name] = packed.blocks.flatten(-2).view(torch.int8)
            stored[name.removesuffix("weight") + "scale"] = packed.scales.view(torch.float8_e8m0fnu)
        elif FP8_PROJECTIONS.search(name):
            exponent = int(torch.ceil(torch.log2(t.abs().max() / 448)).item())
            value = (t / 2.0**exponent).to(torch.float8_e4m3fn)
            decoded[name] = value.to(torch.float32) * 2.0**exponent
            stored[name] = value
            stored[name.removesuffix("weight") + "scale"] = torch.tensor([[exponent + 127]], dtype=torch.uint8).view(
                torch.float8_e8m0fnu
            )
        else:
            decoded[name] = t
            stored[name] = t
    renamed = {}
    for name, t in stored.items():
        new = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight"}.get(name, name)
        new = (
            new.replace("model.hc_head.hc_", "hc_head_").removeprefix("model.").replace(".attn.norm.", ".attn.kv_norm.")
        )
        renamed[new] = t
    return renamed, decoded


@pytest.fixture(scope="module")
def published_checkpoint(tiny, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(DeepSeek's layout, transformers' layout of the same decoded weights)."""
    path, _ = tiny
    stored, decoded = published(load_file(path / "model.safetensors"))
    dirs = tmp_path_factory.mktemp("published"), tmp_path_factory.mktemp("decoded")
    for directory, tensors in zip(dirs, (stored, decoded), strict=True):
        shutil.copy(path / "config.json", directory / "config.json")
        save_file(tensors, directory / "model.safetensors")
    return dirs


def test_the_published_layout_keeps_fp4_experts_packed_and_gives_the_logits_of_its_decoded_weights(
    published_checkpoint,
):
    packed_dir, decoded_dir = published_checkpoint
    packed, decoded = Shard.load(packed_dir), Shard.load(decoded_dir)
    banks = [m for m in packed.modules() if isinstance(m, QuantizedExperts)]
    assert len(banks) == CONFIG["num_hidden_layers"] and {b.format for b in banks} == {"mxfp4"}
    assert set(packed.bytes_by_role["experts"]) >= {"mxfp4"}
    ids = tokens(24, seed=14)
    assert_close_to(packed(Frame.of_streams([(0, 0, ids)])), decoded(Frame.of_streams([(0, 0, ids)])), 1e-5)


# ---- multi-token prediction ---------------------------------------------------------------------
# transformers 5.24 builds no MTP layer (it drops ``mtp.*`` on load), so the reference is DeepSeek's
# MTPBlock wiring (inference/model.py: e = enorm(embed(ids)); x = e_proj(e) + h_proj(hnorm(x));
# x = Block(x); logits = head(hc_head(x) -> norm)) assembled from transformers' own DeepSeek-V4
# modules: its decoder layer (a fifth, sliding layer of a model built for the purpose), RMSNorm and
# hyper head, with the tiny model's embedding and head.


class ReferenceMTP(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, extended: torch.nn.Module, generator: torch.Generator):
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperHead, DeepseekV4RMSNorm

        super().__init__()
        config, hidden = extended.config, CONFIG["hidden_size"]
        self.model, self.block = model, extended.model.layers[-1]
        self.enorm, self.hnorm, self.norm = (DeepseekV4RMSNorm(hidden, config.rms_norm_eps) for _ in range(3))
        self.e_proj, self.h_proj = (torch.nn.Linear(hidden, hidden, bias=False) for _ in range(2))
        self.hyper_head = DeepseekV4HyperHead(config)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if not name.startswith(("model.", "block.")):
                    scale = 0.08 if "proj" in name or name.endswith("fn") else 0.3
                    p.copy_((1.0 if "norm" in name or name.endswith("scale") else 0.0)
                            + scale * torch.randn(p.shape, generator=generator))  # fmt: skip

    def streams(self, ids: list[int]) -> torch.Tensor:
        """The main model's last layer output [S, hc_mult, hidden] (before its hyper head)."""
        captured = {}
        hook = self.model.model.layers[-1].register_forward_hook(lambda m, a, out: captured.update(x=out))
        with torch.no_grad():
            self.model(torch.tensor([ids]))
        hook.remove()
        return captured["x"][0]

    @torch.no_grad()
    def forward(self, streams: torch.Tensor, next_ids: list[int]) -> torch.Tensor:
        ids = torch.tensor([next_ids])
        e = self.enorm(self.model.model.embed_tokens(ids))
        x = self.e_proj(e).unsqueeze(2) + self.h_proj(self.hnorm(streams[None]))
        positions = torch.arange(len(next_ids))[None]
        rotary = self.model.model.rotary_emb
        embeddings = {kind: rotary(e, position_ids=positions, layer_type=kind) for kind in ("main", "compress")}
        q, k = positions[0][:, None], positions[0][None, :]
        visible = (k <= q) & (q - k < CONFIG["sliding_window"])
        mask = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))[None, None]
        x = self.block(x, position_embeddings=embeddings, position_ids=positions, attention_mask=mask, input_ids=ids)
        return self.model.lm_head(self.norm(self.hyper_head(x)))[0]


@pytest.fixture(scope="module")
def with_mtp(tiny, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ReferenceMTP]:
    """The tiny checkpoint plus ``mtp.0.*`` in DeepSeek's names, and its reference."""
    path, model = tiny
    extra = dict(
        num_hidden_layers=5,
        layer_types=[*CONFIG["layer_types"], "sliding_attention"],
        mlp_layer_types=[*CONFIG["mlp_layer_types"], "moe"],
    )
    extended_dir = tmp_path_factory.mktemp("extended")
    extended = save(extended_dir, seed=3, **extra)
    reference = ReferenceMTP(model, extended, torch.Generator().manual_seed(4))
    tensors = load_file(path / "model.safetensors")
    for name, t in load_file(extended_dir / "model.safetensors").items():
        if name.startswith("model.layers.4."):
            tensors["mtp.0." + name.removeprefix("model.layers.4.")] = t
    own = {"e_proj.weight": reference.e_proj.weight, "h_proj.weight": reference.h_proj.weight,
           "enorm.weight": reference.enorm.weight, "hnorm.weight": reference.hnorm.weight,
           "norm.weight": reference.norm.weight, "hc_head_fn": reference.hyper_head.hc_fn,
           "hc_head_base": reference.hyper_head.hc_base, "hc_head_scale": reference.hyper_head.hc_scale}  # fmt: skip
    tensors.update({f"mtp.0.{name}": t.detach().clone() for name, t in own.items()})
    directory = tmp_path_factory.mktemp("with_mtp")
    shutil.copy(path / "config.json", directory / "config.json")
    save_file(tensors, directory / "model.safetensors")
    return directory, reference


def test_the_mtp_layer_predicts_the_logits_of_deepseeks_mtp_block_at_every_position(with_mtp):
    directory, reference = with_mtp
    ids = tokens(21, seed=15)
    streams = reference.streams(ids[:-1])
    mtp = load_mtp(directory)
    mtp.allocate(max_slots=2, max_context=64, rewind_slack=SLACK)
    ours = mtp(Frame.of_streams([(0, 0, ids[1:])], hidden=streams))
    assert_close_to(ours, reference(streams, ids[1:]))
    # the main model's shards give the same streams (the last stage's residual before its hyper head)
    lm = LocalModel.load(directory, shards=2, max_slots=1, max_context=64)
    residual = lm.shards[0](Frame.of_streams([(0, 0, ids[:-1])]))
    last = lm.shards[1]
    assert last.exit is not None
    captured = {}
    hook = last.layers[-1].register_forward_hook(lambda m, a, out: captured.update(x=out))
    last(Frame.of_streams([(0, 0, ids[:-1])], hidden=residual))
    hook.remove()
    torch.testing.assert_close(captured["x"], streams, rtol=1e-4, atol=1e-4)


def test_the_mtp_layer_decodes_row_by_row_from_its_own_state_as_in_one_frame(with_mtp):
    directory, reference = with_mtp
    ids = tokens(21, seed=16)
    streams = reference.streams(ids[:-1])
    mtp = load_mtp(directory)
    mtp.allocate(max_slots=1, max_context=64, rewind_slack=SLACK)
    whole = mtp(Frame.of_streams([(0, 0, ids[1:])], hidden=streams))
    mtp.allocate(max_slots=1, max_context=64, rewind_slack=SLACK)
    rows = [mtp(Frame.of_streams([(0, t, ids[t + 1 : t + 2])], hidden=streams[t : t + 1])) for t in range(20)]
    assert_close_to(torch.cat(rows), whole, 1e-5)


# ---- planning and serving -----------------------------------------------------------------------

EXAMPLES = Path(__file__).parents[1] / "examples"


def test_the_freetoken_summary_is_the_inspection_of_the_released_deepseek_v4_flash_config():
    """The example's summary is what ``inspect`` makes of the released config.json alone: 43 layers,
    FP4 experts (~3.3 GiB a layer), and each kind's state (the sliding window, CSA's blocks of 4 with
    the indexer's keys, HCA's blocks of 128, their raw-projection journals)."""
    result = CliRunner().invoke(app, ["inspect", str(EXAMPLES / "configs" / "deepseek-v4-flash")])
    assert result.exit_code == 0, result.output
    inspected = ModelSummary.from_json(result.stdout)
    assert inspected == ModelSummary.from_json((EXAMPLES / "summaries" / "freetoken-4gpu.json").read_text())
    assert inspected.family == "deepseek_v4" and inspected.num_layers == 43
    assert 3.2 * 2**30 < inspected.layer_bytes[5] < 3.4 * 2**30
    sliding, csa, hca = inspected.kv_entries[0], inspected.kv_entries[2], inspected.kv_entries[3]
    assert [(e.window, e.stride) for e in sliding] == [(128, 1)]
    assert [(e.window, e.stride) for e in csa] == [(128, 1), (None, 4), (None, 4), (8, 1)]
    assert [(e.window, e.stride) for e in hca] == [(128, 1), (None, 128), (128, 1)]


def test_inspect_and_plan_of_the_tiny_checkpoint_split_its_layers_and_count_its_state(tiny, tmp_path):
    path, _ = tiny
    result = CliRunner().invoke(app, ["inspect", "--model", str(path), "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    inspected = ModelSummary.from_json(result.stdout)
    assert inspected.family == "deepseek_v4" and all(n > 0 for n in inspected.layer_bytes)
    assert inspected.layer_role_bytes[1]["experts/plain"] > 0 and inspected.layer_role_bytes[1]["attention/plain"] > 0
    assert inspected.head_matrix_bytes == CONFIG["vocab_size"] * CONFIG["hidden_size"] * 4 and not inspected.tied
    result = CliRunner().invoke(app, ["plan", "--model", str(path), "--stages", "2", "--out", str(tmp_path / "p.json")])
    assert result.exit_code == 0, result.output
    plan = json.loads((tmp_path / "p.json").read_text())
    assert [(s["layer_start"], s["layer_end"]) for s in plan["groups"][0]["stages"]] == [(0, 2), (2, 4)]


def test_a_two_stage_local_fleet_gives_the_engines_tokens_to_its_client_and_the_openai_client(tiny, tmp_path):
    """Stage 1 holds a hash-routed layer, so the frames it gets carry the hyper-connection streams
    and the rows' token ids; the gateway in front serves the OpenAI API."""
    from test_gateway import build_tokenizer, extra, ready_gateway
    from test_pipeline import Fleet, prompts_and_params, reference, run_concurrently

    path = tmp_path / "deepseek-v4-chat"
    shutil.copytree(tiny[0], path)
    build_tokenizer([100, 101]).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}}))
    fleet = Fleet(path, tmp_path, stages=2)
    fleet.start()
    try:
        prompts, params = prompts_and_params(6)
        assert run_concurrently(fleet, prompts, params) == reference(path, prompts, params)
        with ready_gateway(fleet.plan) as served:
            result = served.openai().completions.create(
                model=served.gateway.model_name, prompt=prompts[3], max_tokens=8, temperature=0,
                extra_body={"return_token_ids": True},
            )  # fmt: skip
        expected = reference(path, [prompts[3]], [SamplingParams(max_tokens=8)])[0]
        assert extra(result.choices[0], "token_ids") == expected
    finally:
        fleet.stop()


# ---- state, formats and dtypes ------------------------------------------------------------------


def test_the_compressed_layers_yarn_rope_matches_transformers(tmp_path):
    """The released config scales the compress RoPE with YaRN (cos/sin factor 1) and leaves the
    sliding layers' RoPE plain."""
    yarn = dict(rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=32,
                                  beta_slow=1))  # fmt: skip
    model = save(tmp_path, seed=5, **yarn)
    assert model.config.rope_parameters["compress"]["rope_type"] == "yarn"
    ids = tokens(40, seed=17)
    assert_close_to(Shard.load(tmp_path)(Frame.of_streams([(0, 0, ids)])), reference_logits(model, ids))


def test_a_slot_exported_mid_block_continues_on_another_shard_as_on_its_own(tiny):
    path, _ = tiny
    source, target = Shard.load(path), Shard.load(path)
    small_cache(source), small_cache(target)
    ids = tokens(34, seed=18)  # 30 positions: CSA and HCA blocks open, the sliding ring wrapped
    source(Frame.of_streams([(1, 0, ids[:30])]))
    target.import_slot(2, source.export_slot(1))
    moved = torch.cat([target(Frame.of_streams([(2, 30 + j, [t])])) for j, t in enumerate(ids[30:])])
    stayed = torch.cat([source(Frame.of_streams([(1, 30 + j, [t])])) for j, t in enumerate(ids[30:])])
    assert torch.equal(moved, stayed)


def test_an_offline_quantized_checkpoint_gives_the_logits_of_quantizing_at_load_in_any_cut(tiny, tmp_path):
    path, _ = tiny
    plan = FormatPlan(experts="int4", attention="int8")
    save_quantized(Shard.load(path, formats=plan, pack=False), path, tmp_path, plan, torch.float32)
    frame = Frame.of_streams([(0, 0, tokens(30, seed=19))])
    at_load = LocalModel.load(path, formats=plan, max_slots=1).forward(frame)
    for shards in (1, 2):
        assert torch.equal(LocalModel.load(tmp_path, shards=shards, max_slots=1).forward(frame), at_load)


def test_bfloat16_stays_close_to_float32(tiny):
    path, _ = tiny
    ids = tokens(40, seed=20)
    full = Shard.load(path)(Frame.of_streams([(0, 0, ids)]))
    half = Shard.load(path, dtype="bfloat16")(Frame.of_streams([(0, 0, ids)]))
    cosine = torch.nn.functional.cosine_similarity(half.float(), full, dim=-1)
    # a position whose near-tied experts swap under bf16 rounding moves alone (0.95-0.99 at one or
    # two of 40 positions, seed to seed, whatever the order of the experts' weighted sum): the mean
    # holds the dtype to float32, the minimum catches a position that broke
    assert float(cosine.mean()) >= 0.995 and float(cosine.min()) >= 0.9


def test_tensor_parallelism_refuses_to_cut_a_packed_fp4_block_and_names_it(published_checkpoint):
    packed_dir, _ = published_checkpoint  # moe_intermediate_size 32: two ranks would cut each block
    with pytest.raises(
        FormatError, match=r"cannot split layers\.0\.mlp\.experts\.down \(mxfp4\).*cuts a 32-value block"
    ):
        Shard.load(packed_dir, tensor=LocalGroup(0, 2))


def test_tensor_parallelism_refuses_heads_or_output_groups_that_do_not_divide(tiny):
    path, _ = tiny
    with pytest.raises(InputError, match="o_groups=2, which is not divisible by 4"):
        check_tensor_split(load_spec(path), 4)
    check_tensor_split(load_spec(path), 2)  # one shared K=V head is no obstacle


def test_two_stages_of_two_tensor_ranks_broadcast_streams_and_token_ids_and_give_the_engines_tokens(tiny, tmp_path):
    """Stage 1's leader broadcasts each frame's hyper-connection streams and token ids (its hash
    layer needs them) to its follower rank."""
    from test_pipeline import prompts_and_params, reference
    from test_tensor_fleet import TensorFleet

    path, _ = tiny
    fleet = TensorFleet(path, tmp_path)
    fleet.start()
    try:
        prompts, params = prompts_and_params(4)
        with fleet.client() as client:
            results = client.wait([client.submit(p, s) for p, s in zip(prompts, params, strict=True)])
        assert [r.token_ids for r in results] == reference(path, prompts, params)
    finally:
        fleet.stop()
