"""The engine core against transformers on tiny random checkpoints: logits, greedy tokens,
shards, frames of mixed streams, rewind and slot reuse, and sampling."""

from __future__ import annotations

import pytest
import torch
from tiny import assert_close_to, reference_logits

from modelfleet.engine.errors import CapacityError
from modelfleet.engine.frame import Frame
from modelfleet.engine.generate import LocalModel, generate, generate_batch
from modelfleet.engine.sampling import SamplingParams
from modelfleet.engine.shard import Shard
from modelfleet.engine.split import even_split

FAMILIES = ["qwen3_moe", "mixtral"]
PROMPT = [5, 17, 99, 3, 64, 21, 8, 120, 45, 77, 12, 33, 90, 6, 101, 58, 27, 14, 71, 40]


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_at_every_prompt_position_match_transformers(tiny_checkpoint, family: str) -> None:
    path, model = tiny_checkpoint(family)
    logits = Shard.load(path)(Frame.of_streams([(0, 0, PROMPT)]))
    assert_close_to(logits, reference_logits(model, PROMPT))


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_continuation_of_32_tokens_is_identical_to_transformers(tiny_checkpoint, family: str) -> None:
    path, model = tiny_checkpoint(family)
    ref = model.generate(torch.tensor([PROMPT]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
    ours = generate(LocalModel.load(path), PROMPT, SamplingParams(max_tokens=32, stop_token_ids=()))
    assert ours.token_ids == ref[0, len(PROMPT) :].tolist()


@pytest.mark.parametrize("shards", [1, 2, 3])
def test_model_cut_into_shards_gives_the_logits_of_the_whole(tiny_checkpoint, shards: int) -> None:
    path, model = tiny_checkpoint("qwen3_moe")
    lm = LocalModel.load(path, shards=shards)
    # the planner's even split (engine.split), not one of generate's own: 4 layers over 3 shards are 2, 1, 1
    assert [(s.layer_start, s.layer_end) for s in lm.shards] == even_split(4, shards)
    assert all(s.embed is None for s in lm.shards[1:]) and all(s.head is None for s in lm.shards[:-1])
    assert_close_to(lm.forward(Frame.of_streams([(0, 0, PROMPT)])), reference_logits(model, PROMPT))


def test_residuals_between_shards_are_float32_even_for_bfloat16_compute(tiny_checkpoint) -> None:
    path, _ = tiny_checkpoint("qwen3_moe")
    first = Shard.load(path, 0, 2, dtype="bfloat16")
    hidden = first(Frame.of_streams([(0, 0, PROMPT[:4])]))
    assert hidden.dtype == torch.float32 and hidden.shape == (4, 64)


def test_frame_mixing_three_streams_gives_each_the_logits_it_gets_alone(tiny_checkpoint) -> None:
    path, model = tiny_checkpoint("mixtral")
    a, b, c = PROMPT[:9], PROMPT[3:15], PROMPT[10:13]
    shard = Shard.load(path)
    shard.allocate_cache(max_slots=3, max_context=64)
    shard(Frame.of_streams([(0, 0, a[:8])]))  # stream a: 8 positions, decoding next
    shard(Frame.of_streams([(1, 0, b[:5])]))  # stream b: prefill continues in the mixed frame
    mixed = shard(Frame.of_streams([(0, 8, a[8:]), (1, 5, b[5:11]), (2, 0, c)]))
    assert_close_to(mixed[0:1], reference_logits(model, a)[-1:])
    assert_close_to(mixed[1:7], reference_logits(model, b[:11])[5:11])
    assert_close_to(mixed[7:10], reference_logits(model, c))


def test_rewind_then_redecode_reproduces_the_logits(tiny_checkpoint) -> None:
    path, model = tiny_checkpoint("qwen3_moe")
    shard = Shard.load(path)
    shard.allocate_cache(max_slots=2, max_context=64)
    first = shard(Frame.of_streams([(0, 0, PROMPT)]))
    shard.rewind(0, 12)
    again = shard(Frame.of_streams([(0, 12, PROMPT[12:])]))
    assert_close_to(again, first[12:])
    shard.rewind(0, 12)
    other = shard(Frame.of_streams([(0, 12, [7, 7, 7])]))
    assert_close_to(other, reference_logits(model, PROMPT[:12] + [7, 7, 7])[12:])


def test_a_released_slot_is_reused_cleanly(tiny_checkpoint) -> None:
    path, model = tiny_checkpoint("qwen3_moe")
    shard = Shard.load(path)
    shard.allocate_cache(max_slots=1, max_context=64)
    slot = shard.acquire()
    shard(Frame.of_streams([(slot, 0, PROMPT)]))
    with pytest.raises(CapacityError, match="all 1 KV slots are in use"):
        shard.acquire()
    shard.release(slot)
    slot = shard.acquire()
    assert_close_to(shard(Frame.of_streams([(slot, 0, PROMPT[5:9])])), reference_logits(model, PROMPT[5:9]))


def test_a_segment_must_start_where_its_slot_ends(tiny_checkpoint) -> None:
    path, _ = tiny_checkpoint("qwen3_moe")
    shard = Shard.load(path)
    shard.allocate_cache(max_slots=1, max_context=64)
    shard(Frame.of_streams([(0, 0, PROMPT[:4])]))
    with pytest.raises(CapacityError, match="holds 4 positions"):
        shard(Frame.of_streams([(0, 6, [1])]))


def test_kv_budget_too_small_for_the_slots_is_refused_with_the_numbers(tiny_checkpoint) -> None:
    path, _ = tiny_checkpoint("qwen3_moe")
    shard = Shard.load(path)
    with pytest.raises(CapacityError, match=r"8 slots x 256 positions needs \d+ bytes, over the shard's budget"):
        shard.allocate_cache(max_slots=8, max_context=256, kv_budget_bytes=1024)
    shard.allocate_cache(max_slots=2, max_context=16)
    assert shard.kv_bytes == 2 * 16 * shard.kv_bytes_per_position()


def test_batched_generation_equals_generating_each_stream_alone(tiny_checkpoint) -> None:
    path, _ = tiny_checkpoint("mixtral")
    lm = LocalModel.load(path, shards=2, max_slots=4)
    prompts = [PROMPT[:3], PROMPT[2:12], PROMPT[7:8], PROMPT[:17]]
    params = [SamplingParams(max_tokens=n, stop_token_ids=()) for n in (5, 9, 12, 3)]
    together = generate_batch(lm, prompts, params)
    alone = [generate(lm, p, s) for p, s in zip(prompts, params, strict=True)]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert [len(r.token_ids) for r in together] == [5, 9, 12, 3]
    assert lm.shards[0].slots is not None and lm.shards[0].slots.in_use() == 0


def test_generation_stops_at_the_models_eos_and_reports_stop(tiny_checkpoint) -> None:
    path, _ = tiny_checkpoint("qwen3_moe")
    lm = LocalModel.load(path)
    free = generate(lm, PROMPT, SamplingParams(max_tokens=8, stop_token_ids=()))
    stop_at = free.token_ids[3]
    first = free.token_ids.index(stop_at)
    stopped = generate(lm, PROMPT, SamplingParams(max_tokens=8, stop_token_ids=(stop_at,)))
    assert stopped.finish_reason == "stop" and stopped.token_ids == free.token_ids[:first]


def test_the_same_seed_gives_the_same_sampled_tokens(tiny_checkpoint) -> None:
    path, _ = tiny_checkpoint("qwen3_moe")
    lm = LocalModel.load(path)
    params = SamplingParams(
        temperature=1.5, top_p=0.95, top_k=50, min_p=0.01, seed=1234, max_tokens=24, stop_token_ids=()
    )
    one, two = generate(lm, PROMPT, params), generate(lm, PROMPT, params)
    other = generate(lm, PROMPT, SamplingParams(temperature=1.5, seed=99, max_tokens=24, stop_token_ids=()))
    assert one.token_ids == two.token_ids
    assert one.token_ids != other.token_ids


def test_top_k_of_one_samples_the_greedy_token(tiny_checkpoint) -> None:
    path, _ = tiny_checkpoint("qwen3_moe")
    lm = LocalModel.load(path)
    greedy = generate(lm, PROMPT, SamplingParams(max_tokens=12, stop_token_ids=()))
    sampled = generate(lm, PROMPT, SamplingParams(temperature=2.0, top_k=1, seed=3, max_tokens=12, stop_token_ids=()))
    assert sampled.token_ids == greedy.token_ids


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_logits_match_transformers_in_float32_and_bfloat16(tiny_checkpoint, family: str) -> None:
    path, model = tiny_checkpoint(family)
    ref = reference_logits(model, PROMPT)
    assert_close_to(Shard.load(path, device="cuda")(Frame.of_streams([(0, 0, PROMPT)])).cpu(), ref, 1e-3)
    bf16 = Shard.load(path, device="cuda", dtype="bfloat16")(Frame.of_streams([(0, 0, PROMPT)])).cpu()
    cos = torch.nn.functional.cosine_similarity(bf16, ref, dim=-1)
    # bfloat16 may flip a near-tied expert choice at a position; most positions stay close
    assert cos.median() > 0.995 and cos.min() > 0.9
    assert (bf16.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_static_decode_steps_give_the_logits_of_general_frames(tiny_checkpoint, family: str) -> None:
    path, _ = tiny_checkpoint(family)
    prompts = [PROMPT[:5], PROMPT[4:15], PROMPT[9:10]]
    general = LocalModel.load(path, shards=2, max_slots=3, max_context=32, static_decode=False)
    static = LocalModel.load(path, shards=2, max_slots=3, max_context=32, static_decode=True)
    assert static.static_decode and not general.static_decode
    for lm in (general, static):
        for slot, prompt in enumerate(prompts):
            lm.acquire()
            lm.forward(Frame.of_streams([(slot, 0, prompt)]))
    positions = [len(p) for p in prompts]
    for step in range(12):  # past the sliding window of 6 and around gpt_oss's ring
        tokens = [(7 * step + 3 * slot) % 128 for slot in range(3)]
        ours = static.decode(tokens, [0, 1, 2], positions)
        ref = general.decode(tokens, [0, 1, 2], positions)
        assert_close_to(ours, ref, 1e-5)
        positions = [p + 1 for p in positions]
    assert static.shards[1].slots is not None and static.shards[1].slots.lengths[:3] == positions


def test_batched_generation_with_static_decode_matches_the_general_path(tiny_checkpoint) -> None:
    path, _ = tiny_checkpoint("mixtral")
    prompts = [PROMPT[:3], PROMPT[2:12], PROMPT[7:8]]
    params = [SamplingParams(max_tokens=n, stop_token_ids=()) for n in (5, 9, 12)]
    results = [
        [r.token_ids for r in generate_batch(LocalModel.load(path, max_slots=3, static_decode=s), prompts, params)]
        for s in (False, True)
    ]
    assert results[0] == results[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_replays_give_the_tokens_of_eager_decoding(tiny_checkpoint) -> None:
    path, _ = tiny_checkpoint("qwen3_moe")
    prompts = [PROMPT[:3], PROMPT[2:12], PROMPT[7:8]]
    params = SamplingParams(max_tokens=20, stop_token_ids=())
    eager = LocalModel.load(path, device="cuda", max_slots=3, static_decode=False)
    graphed = LocalModel.load(path, device="cuda", max_slots=3, static_decode=True)
    expected = [r.token_ids for r in generate_batch(eager, prompts, params)]
    assert [r.token_ids for r in generate_batch(graphed, prompts, params)] == expected
    assert graphed._decoders and all(d.graph is not None for d in graphed._decoders.values())


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_bfloat16_on_cpu_packs_weights_without_changing_the_logits(tiny_checkpoint, family: str) -> None:
    from modelfleet.engine.kernels import cpu_linear

    if not cpu_linear.available(torch.zeros(1, 1, dtype=torch.bfloat16)):
        pytest.skip("oneDNN bfloat16 is not available on this CPU")
    path, _ = tiny_checkpoint(family)
    packed = Shard.load(path, dtype="bfloat16")
    plain = Shard.load(path, dtype="bfloat16", pack=False)
    assert any(getattr(m, "packed", None) is not None for m in packed.modules())
    assert not any(getattr(m, "packed", None) is not None for m in plain.modules())
    assert packed.weights_bytes == plain.weights_bytes
    ours = packed(Frame.of_streams([(0, 0, PROMPT)]))
    ref = plain(Frame.of_streams([(0, 0, PROMPT)]))
    assert torch.nn.functional.cosine_similarity(ours, ref, dim=-1).min() > 0.999
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
