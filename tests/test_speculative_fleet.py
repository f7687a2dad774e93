"""Speculative decoding through a fleet: the head proposes, the tail verifies, every stage rewinds
what was rejected, and the streams' greedy tokens are those of the single-process engine."""

from __future__ import annotations

import random

from test_pipeline import Fleet, reference, run_concurrently

from modelfleet.engine.sampling import SamplingParams


def repetitive_prompts(count: int) -> list[list[int]]:
    """Prompts that repeat a short phrase (the suffix match proposes from the first step) and ones that don't."""
    rng = random.Random(3)
    phrases = [[rng.randrange(3, 128) for _ in range(3 + i % 3)] for i in range(count)]
    return [
        (p * 6)[: 10 + i] if i % 2 == 0 else [rng.randrange(3, 128) for _ in range(5 + i)]
        for i, p in enumerate(phrases)
    ]


def test_a_three_stage_fleet_with_speculation_gives_the_greedy_tokens_of_plain_decoding(
    tiny_checkpoint, tmp_path
) -> None:
    path, _ = tiny_checkpoint("qwen3_moe")
    fleet = Fleet(path, tmp_path, speculative={"method": "ngram", "num_speculative_tokens": 3})
    fleet.start()
    try:
        prompts = repetitive_prompts(8)
        params = [SamplingParams(max_tokens=6 + (5 * i) % 17, stop_token_ids=()) for i in range(len(prompts))]
        assert run_concurrently(fleet, prompts, params) == reference(path, prompts, params)
        head = fleet.status(0)["head"]["speculative"]
        assert head["method"] == "ngram" and head["drafted"] > head["accepted"], head  # rejections: rewinds ran
        assert [fleet.status(s)["slots_in_use"] for s in range(3)] == [0, 0, 0]
        assert fleet.metric(0, "modelfleet_speculative_drafted_tokens_total") == head["drafted"]
    finally:
        fleet.stop()
