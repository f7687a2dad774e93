"""Inkling against transformers on tiny random checkpoints (tests/inkling_tiny.py): attention
without RoPE over normed q/k with the hidden-state-conditioned relative bias, sliding layers with
their own shapes, log scaling on full layers, four float32 convolutions per layer with
per-stream histories, sink routing with shared experts, dense first layers, the normed embedding,
the muP multiplier and the unpadded vocabulary; through shards, mixed frames, rewind and slots."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from inkling_tiny import (
    build_text_model,
    save_multimodal_model,
    save_multimodal_model_with_mtp,
    save_text_model,
    save_text_model_with_mtp,
)
from pydantic import ValidationError
from test_tensor_parallel import spawn_ranks
from tiny import assert_close_to, successor_chains, train_on_successors

from modelfleet import planner
from modelfleet.agent.openai_schema import ChatCompletionRequest, describe
from modelfleet.engine.checkpoint import Checkpoint
from modelfleet.engine.errors import InputError
from modelfleet.engine.formats.plan import FormatPlan
from modelfleet.engine.frame import Frame, segments_of
from modelfleet.engine.generate import LocalModel, generate
from modelfleet.engine.layers import FrameContext
from modelfleet.engine.models import inkling
from modelfleet.engine.models.inkling import tensor_shapes
from modelfleet.engine.models.inkling_mtp import InklingMtp
from modelfleet.engine.quantized_checkpoint import save_quantized
from modelfleet.engine.sampling import SamplingParams
from modelfleet.engine.shard import Shard
from modelfleet.engine.spec import load_spec, spec_from_config
from modelfleet.engine.tensor_parallel import (
    TensorGroup,
    check_tensor_split,
    close_tensor_group,
    init_tensor_group,
    split_for_rank,
)
from modelfleet.operator.summary import inspect_checkpoint
from modelfleet.plan import Formats, ServingLimits

INT4_INT8 = FormatPlan(experts="int4", attention="int8")
PROMPT = [5, 17, 99, 3, 64, 21, 8, 120, 45, 77, 12, 33, 90, 6, 101, 58, 27, 14, 71, 40, 9, 88, 52, 30]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("inkling")
    return path, save_text_model(path)


class RecordingCheckpoint(Checkpoint):
    """A checkpoint that lists every tensor name read."""

    def __init__(self, model_dir: Path, read: list[str]):
        super().__init__(model_dir)
        self.read_names = read

    def read(self, name: str) -> torch.Tensor:
        self.read_names.append(name)
        return super().read(name)


def reference_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def test_logits_at_every_prompt_position_match_transformers(tiny) -> None:
    path, model = tiny
    ours = Shard.load(path)(Frame.of_streams([(0, 0, PROMPT)]))
    ref = reference_logits(model, PROMPT)
    assert ours.shape == ref.shape == (len(PROMPT), 120)
    assert_close_to(ours, ref)


def decode_greedy(shard: Shard, prompt: list[int], steps: int, slot: int = 0) -> tuple[list[int], torch.Tensor]:
    """Prefill then decode row by row: the greedy tokens and the logits of every step."""
    logits = [shard(Frame.of_streams([(slot, 0, prompt)]))[-1]]
    tokens = [int(logits[-1].argmax())]
    for position in range(len(prompt), len(prompt) + steps - 1):
        logits.append(shard(Frame.of_streams([(slot, position, tokens[-1:])]))[0])
        tokens.append(int(logits[-1].argmax()))
    return tokens, torch.stack(logits)


def test_greedy_continuation_of_32_tokens_is_identical_to_transformers_generate(tiny) -> None:
    path, model = tiny
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        ref = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, min_new_tokens=32, do_sample=False
        )
    ours, logits = decode_greedy(Shard.load(path), PROMPT, 32)
    assert ours == ref[0, len(PROMPT) :].tolist()
    assert len(set(ours)) > 2
    assert_close_to(logits, reference_logits(model, PROMPT + ours[:-1])[len(PROMPT) - 1 :])


@pytest.mark.parametrize("shards", [1, 2, 3])
def test_a_model_cut_into_shards_gives_the_logits_of_the_whole(tiny, shards: int) -> None:
    path, model = tiny
    local = LocalModel.load(path, shards=shards)
    assert len(local.shards) == shards
    assert_close_to(local.forward(Frame.of_streams([(0, 0, PROMPT)])), reference_logits(model, PROMPT))


def test_multimodal_checkpoint_serves_its_text_decoder_without_reading_the_towers(tmp_path: Path) -> None:
    model = save_multimodal_model(tmp_path)
    read: list[str] = []
    shard = Shard.load(tmp_path, checkpoint=RecordingCheckpoint(tmp_path, read))
    ours = shard(Frame.of_streams([(0, 0, PROMPT)]))
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([PROMPT])).logits[0]
    assert_close_to(ours, ref)
    assert read and all(name.startswith("model.llm.") for name in read)  # no tower, no MTP


def _without_correction_bias(route):  # type: ignore[no-untyped-def]
    return lambda logits, bias, top_k, shared, scale: route(logits, bias * 0, top_k, shared, scale)


def _without_shared_experts(route):  # type: ignore[no-untyped-def]
    def routed_only(*args):  # type: ignore[no-untyped-def]
        index, weight, gammas = route(*args)
        return index, weight, gammas * 0

    return routed_only


CONTROLS = {
    "relative_bias": lambda states, bank, distance: torch.zeros(states.shape[1], *distance.shape),
    "log_scale": lambda positions, n_floor, alpha: torch.ones(positions.shape[0]),
    "causal_conv": lambda history, x, weight: torch.zeros_like(x),
    "sink_routing": _without_correction_bias(inkling.sink_routing),
    "sink_routing ": _without_shared_experts(inkling.sink_routing),
}


@pytest.mark.parametrize("name", list(CONTROLS))
def test_each_feature_left_out_moves_the_logits_far_beyond_the_tolerance(tiny, monkeypatch, name: str) -> None:
    # the tiny model's random parameters make every path count, so the comparisons above can fail
    path, model = tiny
    monkeypatch.setattr(inkling, name.strip(), CONTROLS[name])
    ours, ref = Shard.load(path)(Frame.of_streams([(0, 0, PROMPT)])), reference_logits(model, PROMPT)
    assert (ours - ref).abs().max() > 0.05 * ref.abs().max()


# Windowed entries keep window + SLACK positions: the convolutions' 4 + 8 = 12 and the sliding
# layers' 6 + 8 = 14, so streams of 30+ positions wrap every ring; a rewind of up to 9 is exact.
SLACK = 8


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def ring_shard(path: Path, slots: int = 3) -> Shard:
    shard = Shard.load(path)
    shard.allocate_cache(max_slots=slots, max_context=256, rewind_slack=SLACK)
    rings = {name: kv.rings[name] for kv in shard.kv for name in kv.tensors}
    assert all(rings[name] for name in ("k_conv", "v_conv", "attn_conv", "mlp_conv"))
    assert any(kv.rings["k"] and kv.capacities["k"] == 6 + SLACK for kv in shard.kv)
    return shard


def test_cache_layout_lists_attention_first_then_each_convolution_history() -> None:
    from inkling_tiny import TEXT_CONFIG

    from modelfleet.engine.cache_layout import cache_layout
    from modelfleet.engine.spec import spec_from_config

    spec = spec_from_config({"model_type": "inkling_text", **TEXT_CONFIG})
    sliding, full = cache_layout(spec, 0), cache_layout(spec, 1)
    assert list(sliding.entries) == ["k", "v", "k_conv", "v_conv", "attn_conv", "mlp_conv"]
    assert (sliding.entries["k"].shape, sliding.entries["k"].window) == ((2, 8), 6)
    assert (full.entries["k"].shape, full.entries["k"].window) == ((2, 16), None)
    # a convolution's window counts the newest position, as attention's does (inkling.conv_window)
    assert full.entries["v_conv"].window == 4 and full.entries["attn_conv"].shape == (64,)
    half = full.for_rank(2)
    assert half.entries["k_conv"].shape == (1, 16) and half.entries["mlp_conv"].shape == (64,)


def test_a_frame_mixing_three_streams_gives_each_the_logits_it_gets_alone(tiny) -> None:
    path, model = tiny
    shard = ring_shard(path)
    a, b, c = tokens(12, seed=1), tokens(31, seed=2), tokens(11, seed=3)
    shard(Frame.of_streams([(1, 0, b[:30])]))
    shard(Frame.of_streams([(2, 0, c[:9])]))
    mixed = shard(Frame.of_streams([(0, 0, a), (1, 30, b[30:]), (2, 9, c[9:])]))
    assert_close_to(mixed[:12], reference_logits(model, a))
    assert_close_to(mixed[12:13], reference_logits(model, b)[30:])
    assert_close_to(mixed[13:], reference_logits(model, c)[9:])


def test_rewind_by_one_to_eight_positions_then_new_tokens_matches_transformers(tiny) -> None:
    path, model = tiny
    shard = ring_shard(path, slots=1)
    history = tokens(30, seed=4)
    shard(Frame.of_streams([(0, 0, history)]))
    for depth in range(1, 9):
        grown = tokens(8, seed=10 + depth)
        for token in grown:
            shard(Frame.of_streams([(0, len(history), [token])]))
            history.append(token)
        shard.rewind(0, len(history) - depth)
        del history[len(history) - depth :]
        alternative = tokens(2, seed=30 + depth)
        ours = torch.cat([shard(Frame.of_streams([(0, len(history) + j, [t])])) for j, t in enumerate(alternative)])
        history += alternative
        assert_close_to(ours, reference_logits(model, history)[-2:])


def test_rewind_by_the_deepest_rewind_the_slot_table_allows_is_exact_for_the_convolutions(tiny) -> None:
    path, model = tiny
    shard = ring_shard(path, slots=1)
    assert shard.slots is not None and shard.slots.rewind_limit == SLACK + 1
    history = tokens(40, seed=9)
    shard(Frame.of_streams([(0, 0, history)]))
    shard.rewind(0, 40 - (SLACK + 1))
    alternative = tokens(3, seed=10)
    ours = torch.cat([shard(Frame.of_streams([(0, 31 + j, [t])])) for j, t in enumerate(alternative)])
    assert_close_to(ours, reference_logits(model, history[:31] + alternative)[31:])


def test_a_released_slot_serves_its_next_stream_as_if_new(tiny) -> None:
    path, model = tiny
    shard = ring_shard(path, slots=1)
    shard(Frame.of_streams([(0, 0, tokens(40, seed=5))]))
    shard.release(0)
    fresh = tokens(10, seed=6)
    assert_close_to(shard(Frame.of_streams([(0, 0, fresh)])), reference_logits(model, fresh))
    again = tokens(7, seed=7)  # position 0 starts a new stream even without a release
    assert_close_to(shard(Frame.of_streams([(0, 0, again)])), reference_logits(model, again))


def test_an_exported_slot_continues_on_another_shard(tiny) -> None:
    path, model = tiny
    first, second = ring_shard(path, slots=1), ring_shard(path, slots=2)
    ids = tokens(33, seed=8)
    first(Frame.of_streams([(0, 0, ids[:32])]))
    second.import_slot(1, first.export_slot(0))
    assert_close_to(second(Frame.of_streams([(1, 32, ids[32:])])), reference_logits(model, ids)[32:])


# ---- tensor parallelism: two ranks (gloo on CPU) against the whole model ------------------------

# int4 blocks are 32 values along a weight's input: each rank's share of the experts' and the dense
# MLP's width (down's input) must be a multiple of 32
# (int8 keeps a scale per output row: a rank quantizing its columns of o_proj alone gets other
# scales, so int8 attention is checked split after quantizing, below)
TP_CASES: dict[str, FormatPlan | None] = {"float": None, "int4_experts": FormatPlan(experts="int4")}
TP_WIDTHS = dict(moe_intermediate_size=64, intermediate_size=64)


def tp_run(path: Path, formats: FormatPlan | None, tensor: TensorGroup | None) -> dict[str, object]:
    lm = LocalModel.load(path, 1, formats=formats, tensor=tensor, max_slots=1, max_context=64)
    logits = lm.forward(Frame.of_streams([(0, 0, PROMPT)]))
    lm.release(0)
    tokens = generate(lm, PROMPT, SamplingParams(max_tokens=12, stop_token_ids=())).token_ids
    return dict(logits=logits, tokens=tokens, kv=sum(s.kv_bytes_per_position() for s in lm.shards))


def tp_rank_main(rank: int, port: int, path: Path, out_dir: Path) -> None:
    torch.set_num_threads(1)  # two ranks share two cores
    group = init_tensor_group(rank, 2, "127.0.0.1", port, "cpu", timeout_seconds=60)
    try:
        results = {name: tp_run(path, formats, group) for name, formats in TP_CASES.items()}
    finally:
        close_tensor_group()
    torch.save(results, out_dir / f"rank{rank}.pt")


def test_two_tensor_ranks_give_the_logits_and_greedy_tokens_of_the_whole_model(tmp_path: Path) -> None:
    path = tmp_path / "model"
    save_text_model(path, **TP_WIDTHS)
    spawn_ranks(tp_rank_main, lambda rank, port: (rank, port, path, tmp_path))
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for name, formats in TP_CASES.items():
        whole = tp_run(path, formats, None)
        for rank in results:
            assert_close_to(rank[name]["logits"], whole["logits"]), name
            assert rank[name]["tokens"] == whole["tokens"]
            assert rank[name]["kv"] < whole["kv"]  # k, v and their convolutions' histories are halved


@dataclass(frozen=True)
class LocalGroup(TensorGroup):
    """A rank whose reduce is left to the test: its blocks return their partial sums."""

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t


def test_int4_experts_and_int8_attention_split_after_quantizing_give_partial_sums_of_the_whole(tmp_path) -> None:
    save_text_model(tmp_path, **TP_WIDTHS)
    whole = Shard.load(tmp_path, formats=INT4_INT8, pack=False)
    ranks = [copy.deepcopy(whole) for _ in range(2)]
    for r, shard in enumerate(ranks):
        shard.tensor = LocalGroup(r, 2)  # its cache holds this rank's share of k, v and their convolutions
        split_for_rank(shard, shard.tensor)  # QuantizedWeight.slice cuts only at block boundaries
    for shard in (whole, *ranks):
        shard.allocate_cache(max_slots=1, max_context=32)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(0))
    ctx = FrameContext(segments_of([0] * 9, list(range(9))), torch.arange(9))
    for i, layer in enumerate(whole.layers):
        partial = [s.layers[i].attention(x, ctx, s.kv[i]) for s in ranks]
        assert_close_to(sum(partial), layer.attention(x, ctx, whole.kv[i]), 1e-5)
        assert_close_to(sum(s.layers[i].mlp(x) for s in ranks), layer.mlp(x), 1e-5)


@pytest.mark.parametrize("field", ["swa_num_attention_heads", "swa_num_key_value_heads"])
def test_sliding_layers_head_counts_not_divisible_by_the_tensor_size_are_refused_before_loading(field) -> None:
    from inkling_tiny import TEXT_CONFIG

    spec = spec_from_config({"model_type": "inkling_text", **TEXT_CONFIG, field: 3})
    with pytest.raises(InputError, match=f"{field}=3, which is not divisible by 2"):
        check_tensor_split(spec, 2)


# ---- weight formats ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module, torch.Tensor]:
    """A tiny model trained a little on a successor task (each token has one next token), so that
    its predictions have margins, as a real model's do (a random one's nearly flat logits flip under
    any 4-bit error). -> (directory, model, successor table)."""
    model = build_text_model(unpadded_vocab_size=None, **TP_WIDTHS)
    successor = train_on_successors(model, 60)
    path = tmp_path_factory.mktemp("inkling_trained")
    model.save_pretrained(path)
    return path, model, successor


@pytest.mark.parametrize("experts", ["int4", "mxfp4"])
def test_4bit_experts_and_int8_attention_keep_a_trained_models_logits_and_top1_choices(trained, experts: str) -> None:
    path, model, successor = trained
    ids = successor_chains(successor, 1, 64, torch.Generator().manual_seed(9))[0].tolist()
    reference = reference_logits(model, ids)
    shard = Shard.load(path, formats=FormatPlan(experts=experts, attention="int8"))
    # every matrix in its format; what stays float32 is the dense MLPs' scalar scales (experts) and
    # the relative banks and k/v convolution taps (attention), never quantized
    held_experts, attention = shard.bytes_by_role["experts"], shard.bytes_by_role["attention"]
    assert set(held_experts) == {experts, "fp32"} and held_experts["fp32"] < 0.01 * held_experts[experts]
    assert set(attention) == {"int8", "fp32"} and attention["fp32"] < 0.1 * attention["int8"]
    logits = shard(Frame.of_streams([(0, 0, ids)]))
    cosine = torch.nn.functional.cosine_similarity(logits, reference, dim=-1)
    top1 = (logits.argmax(-1) == reference.argmax(-1)).float().mean()
    assert float(cosine.mean()) >= 0.99 and float(cosine.min()) >= 0.9
    assert float(top1) >= 0.9


# ---- multi-token prediction ------------------------------------------------------------------------


def final_hidden(shard: Shard, ids: list[int]) -> torch.Tensor:
    """The main model's final hidden states after its final norm (what transformers' MTP reads)."""
    positions = list(range(len(ids)))
    ctx = FrameContext(segments_of([0] * len(ids), positions), torch.tensor(positions))
    assert shard.norm is not None
    shard.allocate_cache(max_slots=1, max_context=64)
    return shard.norm(shard.run_layers(shard.embed_tokens(torch.tensor(ids)), ctx))


@pytest.fixture
def windowed_mtp_masks(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers 5.24's ``MtpModel`` masks a ``hybrid_sliding`` MTP layer with a plain causal
    mask (``masking_utils.LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING``), while its main model's
    ``hybrid_sliding`` layers see only the window. The engine gives an MTP layer of that kind the
    window too (its relative bank is as long as the window, and Inkling's other implementations
    treat ``mtp_local_layer_ids`` as local attention); the reference here is patched to agree."""
    from transformers import masking_utils

    windowed = {
        "sliding_attention": masking_utils.create_sliding_window_causal_mask,
        "linear_attention": masking_utils.create_recurrent_attention_mask,
    }
    monkeypatch.setitem(masking_utils.LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING, "hybrid_sliding", windowed)


@pytest.mark.parametrize("chain_norm", [False, True])
def test_mtp_chain_drafts_the_tokens_and_logits_of_transformers_mtp_model(
    tmp_path: Path, chain_norm: bool, windowed_mtp_masks: None
) -> None:
    from transformers.cache_utils import MtpCache

    model, mtp_ref = save_text_model_with_mtp(tmp_path, chain_hidden_post_norm=chain_norm)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        hidden, sampled = out.hidden_states[-1], out.logits[0, -1].argmax()
        mtp_ids, positions = torch.cat([ids[:, 1:], sampled.view(1, 1)], dim=1), torch.arange(1, len(PROMPT) + 1)[None]
        cache = MtpCache(config=model.config.get_mtp_config())
        ref_tokens, ref_logits, _ = mtp_ref(mtp_ids, hidden, None, positions, cache)
        rows = mtp_ref._project_to_logits(
            mtp_ref.forward_layer(
                0, hidden, positions, MtpCache(config=model.config.get_mtp_config()), input_ids=mtp_ids
            )
        )
    ours_hidden = final_hidden(Shard.load(tmp_path), PROMPT)
    assert_close_to(ours_hidden, hidden[0], 1e-5)
    mtp = InklingMtp.load(tmp_path)
    tokens, logits = mtp.draft(0, 0, ours_hidden, mtp_ids[0].tolist())
    assert tokens == ref_tokens[0].tolist()
    assert_close_to(logits, ref_logits[0])
    # depth 0 over every row, in two chunks: its per-stream state carries the first into the second
    fresh = InklingMtp.load(tmp_path)
    chunks = [
        fresh.step(0, 0, start, ours_hidden[start:end], mtp_ids[0, start:end]) for start, end in ((0, 10), (10, 24))
    ]
    assert_close_to(fresh.logits(torch.cat(chunks)), rows[0])
    # a rejected draft: every depth back by 5 rows, then those rows again give the same outputs
    fresh.rewind(0, 19)
    again = fresh.step(0, 0, 19, ours_hidden[19:], mtp_ids[0, 19:])
    assert_close_to(fresh.logits(again), rows[0, 19:])


# ---- sizes: plan, inspect, a config-only directory -------------------------------------------------


def test_the_family_lists_every_tensor_of_the_checkpoint_with_its_shape(tiny) -> None:
    path, _ = tiny
    spec, checkpoint = load_spec(path), Checkpoint(path)
    assert tensor_shapes(spec) == {name: checkpoint.info(name).shape for name in checkpoint.names()}


def test_inspect_of_a_config_only_directory_gives_the_summary_of_the_checkpoint(tiny, tmp_path: Path) -> None:
    path, _ = tiny
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    whole, config_only = inspect_checkpoint(path), inspect_checkpoint(tmp_path)
    assert config_only == whole
    assert [len(entries) for entries in whole.kv_entries] == [6] * 4  # k, v and four convolution histories
    assert whole.layer_bytes[1] > whole.layer_bytes[0]  # a sparse layer outweighs the dense first one


def test_a_multimodal_checkpoint_is_sized_as_its_text_decoder_without_the_towers(tiny, tmp_path: Path) -> None:
    path, _ = tiny
    save_multimodal_model(tmp_path)
    text, multimodal = planner.layer_bytes(path, "bfloat16"), planner.layer_bytes(tmp_path, "bfloat16")
    assert multimodal.per_layer == text.per_layer
    assert (multimodal.embed_bytes, multimodal.head_matrix_bytes) == (text.embed_bytes, text.head_matrix_bytes)


def test_a_plan_in_two_stages_holds_the_bytes_the_shards_hold_in_their_formats(tiny) -> None:
    path, _ = tiny
    formats = Formats(experts="int4", attention="int8", head="int8")
    plan = planner.build_plan(
        path, 2, dtype="bfloat16", formats=formats, serving=ServingLimits(max_streams=2, context_length=64)
    )
    stages = plan.groups[0].stages
    assert [(s.layer_start, s.layer_end) for s in stages] == [(0, 2), (2, 4)]
    plain = planner.layer_bytes(path, "bfloat16")
    engine_formats = FormatPlan(experts="int4", attention="int8", head="int8")
    held = [Shard.load(path, s.layer_start, s.layer_end, dtype="bfloat16", formats=engine_formats) for s in stages]
    for stage, shard in zip(stages, held, strict=True):
        # the relative banks, convolution taps and routers stay float32 beside the planned formats
        assert abs(shard.weights_bytes - stage.weights_bytes) <= 0.05 * stage.weights_bytes
    assert sum(s.weights_bytes for s in stages) < 0.6 * (sum(plain.per_layer) + plain.embed_bytes + plain.head_bytes)


# ---- requests carrying images or audio ------------------------------------------------------------

MEDIA_PARTS = [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
]


@pytest.mark.parametrize("part", MEDIA_PARTS, ids=["image", "audio"])
def test_a_chat_request_carrying_an_image_or_audio_is_refused_naming_the_content_field(part) -> None:
    # the towers are not served: the gateway's schema reads text parts only (a 400, as for any
    # request the schema refuses), so a multimodal Inkling checkpoint is served as a text model
    body = {"model": "inkling", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}]}
    with pytest.raises(ValidationError) as refused:
        ChatCompletionRequest.model_validate(body)
    message, param = describe(refused.value)
    assert param == "messages[0].content" and "this server reads text only" in message


def test_a_request_asking_for_audio_output_is_refused_naming_the_field() -> None:
    body = {"model": "inkling", "messages": [{"role": "user", "content": "hi"}], "modalities": ["text", "audio"]}
    with pytest.raises(ValidationError) as refused:
        ChatCompletionRequest.model_validate(body)
    assert describe(refused.value) == ("unknown field 'modalities': this server does not support it", "modalities")


def test_an_offline_quantized_checkpoint_gives_exactly_the_logits_of_quantizing_at_load(tiny, tmp_path: Path) -> None:
    path, _ = tiny
    plan = FormatPlan.default()
    save_quantized(Shard.load(path, formats=plan, pack=False), path, tmp_path, plan, torch.float32)
    frame = Frame.of_streams([(0, 0, PROMPT)])
    offline, at_load = LocalModel.load(tmp_path, 2), LocalModel.load(path, 2, formats=plan)
    assert torch.equal(offline.forward(frame), at_load.forward(frame))
    assert offline.bytes_by_role == at_load.bytes_by_role


# ---- a local fleet ------------------------------------------------------------------------------------


def test_a_two_stage_local_fleet_gives_the_greedy_tokens_of_the_single_process_engine(tiny, tmp_path: Path) -> None:
    # concurrent streams in prefill windows of 4 rows and decode rows, framed together, through
    # two stage processes: every stage's k/v and convolution histories per slot
    from test_pipeline import Fleet, prompts_and_params, reference, run_concurrently, wait_until

    path, _ = tiny
    fleet = Fleet(path, tmp_path, stages=2)
    fleet.start()
    try:
        prompts, params = prompts_and_params(8)
        assert run_concurrently(fleet, prompts, params) == reference(path, prompts, params)
        wait_until(lambda: [fleet.status(s)["slots_in_use"] for s in range(2)] == [0, 0], 5, "slots freed")
    finally:
        fleet.stop()


def test_mtp_layers_of_a_multimodal_checkpoint_in_the_released_layout_draft_as_transformers(
    tmp_path: Path, windowed_mtp_masks: None
) -> None:
    from transformers.cache_utils import MtpCache

    model, mtp_ref = save_multimodal_model_with_mtp(tmp_path)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
        hidden, sampled = out.hidden_states[-1], out.logits[0, -1].argmax()
        mtp_ids, positions = torch.cat([ids[:, 1:], sampled.view(1, 1)], dim=1), torch.arange(1, len(PROMPT) + 1)[None]
        ref_tokens, ref_logits, _ = mtp_ref(
            mtp_ids, hidden, None, positions, MtpCache(config=model.config.get_mtp_config())
        )
    tokens, logits = InklingMtp.load(tmp_path).draft(
        0, 0, final_hidden(Shard.load(tmp_path), PROMPT), mtp_ids[0].tolist()
    )
    assert tokens == ref_tokens[0].tolist()
    assert_close_to(logits, ref_logits[0])
