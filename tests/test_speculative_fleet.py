"""Speculative decoding through a fleet: the head proposes, the tail verifies, every stage rewinds
what was rejected, and the streams' greedy tokens are those of the single-process engine."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from test_pipeline import Fleet, reference, run_concurrently, wait_until

from modelfleet.engine.sampling import SamplingParams


def repetitive_prompts(count: int) -> list[list[int]]:
    """Prompts that repeat a short phrase (the suffix match proposes from the first step) and ones that don't."""
    rng = random.Random(3)
    phrases = [[rng.randrange(3, 128) for _ in range(3 + i % 3)] for i in range(count)]
    return [
        (p * 6)[: 10 + i] if i % 2 == 0 else [rng.randrange(3, 128) for _ in range(5 + i)]
        for i, p in enumerate(phrases)
    ]


class OverriddenHead(Fleet):
    """The head's agent is started with ``--speculative-config``, which replaces the plan's."""

    def __init__(self, *args, head_config: str, **kwargs):  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.head_config = head_config

    def command(self, stage: int) -> list[str]:
        extra = ["--speculative-config", self.head_config] if stage == 0 else []
        return [*super().command(stage), *extra]


def test_a_three_stage_fleet_with_speculation_gives_the_greedy_tokens_of_plain_decoding(
    tiny_checkpoint, tmp_path
) -> None:
    path, _ = tiny_checkpoint("qwen3_moe")
    # the plan asks for the phrase table; the head's agent overrides it with the suffix match
    fleet = OverriddenHead(path, tmp_path, speculative={"method": "phrase"},
                           head_config='{"method": "ngram", "num_speculative_tokens": 3, "adaptive": false}')  # fmt: skip
    fleet.start()
    try:
        prompts = repetitive_prompts(8)
        params = [SamplingParams(max_tokens=6 + (5 * i) % 17, stop_token_ids=()) for i in range(len(prompts))]
        assert run_concurrently(fleet, prompts, params) == reference(path, prompts, params)
        head = fleet.status(0)["head"]["speculative"]
        assert head["method"] == "ngram" and head["drafted"] > head["accepted"], head  # rejections: rewinds ran
        wait_until(lambda: [fleet.status(s)["slots_in_use"] for s in range(3)] == [0, 0, 0], 5, "slots freed")
        assert fleet.metric(0, "modelfleet_speculative_drafted_tokens_total") == head["drafted"]
    finally:
        fleet.stop()


def test_the_crd_offers_the_proposers_the_engine_has_built() -> None:
    import yaml

    from modelfleet.engine.speculative.config import BUILT, MAX_SPECULATIVE_TOKENS

    crd = yaml.safe_load((Path(__file__).parents[1] / "crds" / "modelfleets.modelfleet.io.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    speculative = spec["properties"]["serving"]["properties"]["speculative"]["properties"]
    assert tuple(speculative["method"]["enum"]) == BUILT
    assert speculative["numSpeculativeTokens"]["maximum"] == MAX_SPECULATIVE_TOKENS


def test_a_modelfleets_serving_speculative_reaches_the_plan_the_head_reads() -> None:
    from fleet_fixtures import node, summary

    from modelfleet.operator.placement import place
    from modelfleet.operator.spec import parse_spec

    spec = parse_spec({
        "model": {"uri": "pvc://models/qwen", "servedName": "qwen"},
        "serving": {"speculative": {"method": "ngram", "numSpeculativeTokens": 3}},
    })  # fmt: skip
    placement = place(spec, summary(4), [node("a")], "qwen", "ai")
    config = placement.plan.serving.speculative_config()
    assert config is not None and (config.method, config.num_speculative_tokens) == ("ngram", 3)


@pytest.mark.parametrize("stages", [1, 2])  # one stage: the head is the tail and proposes itself
def test_a_fleet_speculates_with_the_checkpoint_s_mtp_layers_at_the_tail(tmp_path, stages: int) -> None:
    from inkling_tiny import save_text_model_with_mtp

    model = tmp_path / "inkling"
    save_text_model_with_mtp(model)
    fleet = Fleet(
        model, tmp_path, stages=stages, speculative={"method": "mtp", "num_speculative_tokens": 2, "adaptive": False}
    )
    fleet.start()
    try:
        prompts = repetitive_prompts(4)
        params = [SamplingParams(max_tokens=8 + 3 * i, stop_token_ids=()) for i in range(len(prompts))]
        assert run_concurrently(fleet, prompts, params) == reference(model, prompts, params)
        head = fleet.status(0)["head"]["speculative"]
        assert head["method"] == "mtp" and head["drafted"] > 0, head  # the tail's proposals were verified
        wait_until(lambda: [fleet.status(s)["slots_in_use"] for s in range(stages)] == [0] * stages, 5, "slots freed")
    finally:
        fleet.stop()
