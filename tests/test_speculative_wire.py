"""A draft's q over the wire: a multi-stage fleet's head sends the q of a sampled stream's
proposals with the frame (ids and probabilities of the draft's capped support), the tail
verifies with them, and sampling stays exact."""

from __future__ import annotations

import json

import pytest
import torch
from test_speculative import (
    TARGET,
    distance_to_target,
    first_two_tokens,
    no_residual_verify,
)

from modelfleet.agent import transport as wire
from modelfleet.engine.errors import InputError
from modelfleet.engine.sampling import SamplingParams
from modelfleet.engine.speculative.config import DRAFT_SUPPORT
from modelfleet.engine.speculative.verify import SparseQ, cap_support, verify


def frame_with_q(q: dict[int, torch.Tensor], windows: dict[int, int]) -> wire.FrameMsg:
    """A frame of verify windows (slot -> rows) carrying the q of some, as the head sends it."""
    slots = [slot for slot, rows in windows.items() for _ in range(rows)]
    return wire.FrameMsg(
        microbatch=0, step=1, slots=torch.tensor(slots), positions=torch.arange(len(slots)),
        token_ids=torch.zeros(len(slots), dtype=torch.int64), output_rows=tuple(range(len(slots))),
        **wire.draft_q_fields({slot: SparseQ.of(rows) for slot, rows in q.items()}),
    )  # fmt: skip


def over_the_wire(q: dict[int, torch.Tensor], windows: dict[int, int], vocab: int) -> dict[int, torch.Tensor]:
    msg = wire.decode(wire.encode(frame_with_q(q, windows)))
    assert isinstance(msg, wire.FrameMsg)
    return {slot: sparse.dense(vocab) for slot, sparse in msg.draft_q().items()}


def test_a_capped_q_keeps_the_draft_s_most_likely_tokens_and_crosses_the_wire_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(0)
    q = cap_support(torch.softmax(3 * torch.randn(3, 1000, generator=g), dim=-1))
    assert ((q > 0).sum(dim=-1) == DRAFT_SUPPORT).all() and torch.allclose(q.sum(-1), torch.ones(3))
    few = torch.zeros(1, 1000)  # a support under the cap (top-k 3): the rest of its N entries are zeros
    few[0, [5, 900, 17]] = torch.tensor([0.7, 0.2, 0.1])
    got = over_the_wire({7: q, 2: few}, {2: 2, 5: 3, 7: 4}, 1000)  # q's order need not be the frame's
    assert torch.equal(got[7], q) and torch.equal(got[2], few) and set(got) == {2, 7}
    # a stage that drops a window's rows (a refused stream) forwards the other windows' q alone
    kept = frame_with_q({7: q, 2: few}, {2: 2, 5: 3, 7: 4}).draft_q([2, 5])
    forwarded = wire.FrameMsg(microbatch=0, step=1, slots=torch.tensor([2, 2, 5, 5, 5]), positions=torch.arange(5),
                              token_ids=torch.zeros(5, dtype=torch.int64), **wire.draft_q_fields(kept))  # fmt: skip
    assert forwarded.draft_slots == (2,) and torch.equal(forwarded.draft_q()[2].dense(1000), few)


def test_a_frame_whose_q_does_not_fit_its_windows_is_refused_naming_the_field() -> None:
    q = torch.softmax(torch.randn(2, 10), dim=-1)
    with pytest.raises(wire.MalformedMessage, match=r"draft_ids has shape \[2, 10\]; the draft windows need \[3"):
        frame_with_q({1: q}, {1: 4})
    with pytest.raises(wire.MalformedMessage, match="without a verify window"):
        frame_with_q({1: q}, {1: 1, 2: 3})
    with pytest.raises(wire.MalformedMessage, match="summing to"):
        frame_with_q({1: 2 * q}, {1: 3})
    sparse = SparseQ.of(q)
    with pytest.raises(InputError, match="outside the target's vocabulary of 5"):
        sparse.dense(5)


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4)])
def test_rejection_sampling_with_q_sent_over_the_wire_emits_the_targets_distribution(params) -> None:
    samples = 6000
    q = torch.softmax(3 * TARGET[:2], dim=-1)  # sharper than p: a q that did not arrive intact would show

    def through_the_wire(verifier):  # type: ignore[no-untyped-def]
        def verifying(logits, drafts, params, generator, draft_probs):  # type: ignore[no-untyped-def]
            received = over_the_wire({3: draft_probs}, {3: len(drafts) + 1}, logits.shape[-1])[3]
            return verifier(logits, drafts, params, generator, received)

        return verifying

    exact = distance_to_target(first_two_tokens(through_the_wire(verify), samples, params, q), params)
    biased = distance_to_target(first_two_tokens(through_the_wire(no_residual_verify), samples, params, q), params)
    assert exact < 0.04 and biased > 0.1, (exact, biased)  # sampling noise at 6000 draws is ~0.01-0.02


def test_a_three_stage_fleet_s_sampled_streams_verify_the_draft_s_own_q_as_generate_does(tmp_path) -> None:
    """Seeded sampled streams with a draft model: the fleet's head samples proposals from the
    draft's q and sends q to the tail, so each stream's tokens are those of ``generate`` with the
    same speculative config (where the tail is in the process); proposals verified as one-hot
    argmaxes would give other tokens."""
    from test_pipeline import Fleet, run_concurrently
    from test_speculative import DEMO

    from modelfleet.engine.generate import LocalModel, generate_batch
    from modelfleet.engine.speculative.build import build_proposer
    from modelfleet.engine.speculative.config import SpeculativeConfig
    from modelfleet.engine.speculative.speculator import Speculator
    from modelfleet.engine.tokenizer import TextTokenizer

    spec = {"method": "draft_model", "model": str(DEMO / "draft"), "num_speculative_tokens": 3, "adaptive": False}
    config = SpeculativeConfig.from_json(json.dumps(spec))
    prompts = [TextTokenizer(DEMO).encode(text) for text in ("def fibonacci(n):\n    ", "import os\nimport sys\n")]
    params = [SamplingParams(temperature=0.8, seed=s, max_tokens=16, stop_token_ids=()) for s in (1, 2)]
    lm = LocalModel.load(DEMO, max_slots=1)

    def in_process(sampled_drafts: bool) -> list[list[int]]:
        out = []
        for prompt, p in zip(prompts, params, strict=True):  # one stream at a time, as the fleet gets them
            speculator = Speculator(config, build_proposer(config, DEMO, max_streams=1), sampled_drafts=sampled_drafts)
            out += [r.token_ids for r in generate_batch(lm, [prompt], p, speculator=speculator)]
        return out

    expected, argmax_drafts = in_process(True), in_process(False)
    assert expected != argmax_drafts  # the test tells the two apart
    fleet = Fleet(DEMO, tmp_path, stages=3, speculative=spec)  # the middle stage forwards q
    fleet.start()
    try:
        got = [run_concurrently(fleet, [prompt], [p])[0] for prompt, p in zip(prompts, params, strict=True)]
        head = fleet.status(0)["head"]["speculative"]
    finally:
        fleet.stop()
    assert got == expected
    assert head["drafted"] > head["accepted"] > 0, head  # accepted and rejected proposals, verified with q
