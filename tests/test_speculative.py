"""Speculative decoding as a specification: proposers, exact verification (greedy and a
statistical test that catches a biased verifier), the width model and fallback controller as
tables, the scheduler's verify windows and rewinds, and generate's output unchanged by it."""

from __future__ import annotations

import json
from collections import Counter, deque
from pathlib import Path

import pytest
import torch
from test_family_deepseek_v4 import tiny, with_mtp  # noqa: F401  (fixtures: a tiny DeepSeek-V4 with its MTP layer)

from modelfleet.engine.errors import InputError
from modelfleet.engine.frame import Frame
from modelfleet.engine.generate import LocalModel, generate, generate_batch
from modelfleet.engine.sampling import SamplingParams, filter_logits
from modelfleet.engine.scheduler import Finish, FinishReason, Rewind, Scheduler, SchedulerConfig, Token
from modelfleet.engine.speculative.adaptive import Acceptance, Fallback, StepCosts, best_width, joint_widths, monotonic
from modelfleet.engine.speculative.config import SpeculativeConfig
from modelfleet.engine.speculative.proposers import HybridProposer, NgramProposer, PhraseTable
from modelfleet.engine.speculative.speculator import Speculator
from modelfleet.engine.speculative.verify import verify

# ---- proposers --------------------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_latest_earlier_occurrence_of_the_longest_suffix() -> None:
    ngram = NgramProposer(prompt_lookup_max=3)
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert ngram.propose(tokens, 2) == [7, 8]  # "2 3" last seen before at index 6, followed by 7 8
    assert ngram.propose([*tokens, 4], 3) == []  # "3 4", "4": never seen before
    assert ngram.propose(tokens, 0) == []


def test_the_phrase_table_proposes_only_agreed_continuations_and_survives_a_round_trip(tmp_path: Path) -> None:
    table = PhraseTable(context=2, min_count=2, min_agreement=0.9)
    table.learn([5, 6, 7, 5, 6, 7, 5, 6])
    assert table.propose([1, 5, 6], 3) == [7, 5, 6]  # 5 6 -> 7 (2 of 2), 6 7 -> 5 (2 of 2), 7 5 -> 6
    table.learn([5, 6, 8])  # 5 6 -> 7 twice, 8 once: under 90% agreement
    assert table.propose([5, 6], 3) == []
    table.save(tmp_path / "t.json")
    loaded = PhraseTable.load(tmp_path / "t.json")
    assert loaded.counts == table.counts
    other = PhraseTable(context=2)
    other.learn([5, 6, 7] * 20)
    assert table.merge(other).propose([5, 6], 1) == [7]
    (tmp_path / "bad.json").write_text('{"context": 2, "counts": [[[1, 2, 3], {"4": 1}]]}')
    with pytest.raises(InputError, match="not 2 tokens"):
        PhraseTable.load(tmp_path / "bad.json")


def test_hybrid_tries_the_suffix_match_first_then_the_phrase_table() -> None:
    phrases = PhraseTable(context=1, min_count=1)
    phrases.learn([4, 9])
    hybrid = HybridProposer(NgramProposer(2), phrases)
    assert hybrid.propose([1, 2, 1], 1) == [2]
    assert hybrid.propose([3, 4], 1) == [9]


# ---- verification ------------------------------------------------------------------------------


def one_hot_logits(*tokens: int, vocab: int = 8) -> torch.Tensor:
    logits = torch.zeros(len(tokens), vocab)
    for row, token in enumerate(tokens):
        logits[row, token] = 10.0
    return logits


def test_greedy_verification_accepts_while_the_argmax_agrees_then_corrects_or_adds_a_bonus() -> None:
    greedy = SamplingParams()
    assert verify(one_hot_logits(3, 4, 5), [3, 4], greedy).tokens == [3, 4, 5]  # all accepted, bonus 5
    assert verify(one_hot_logits(3, 6, 5), [3, 4], greedy).tokens == [3, 6]  # 4 rejected, corrected to 6
    assert verify(one_hot_logits(1, 6, 5), [3, 4], greedy).tokens == [1]


TARGET = torch.tensor([[0.5, 1.5, 0.2, -1.0, 0.9, 0.0], [1.2, -0.3, 0.4, 0.8, -1.5, 0.1], [0.0] * 6])
DRAFTS = [1, 0]  # each row's argmax: a verifier that compares argmaxes accepts them always (biased)


def first_two_tokens(verifier, samples: int, params: SamplingParams, draft_probs=None):  # type: ignore[no-untyped-def]
    """Counters of the first emitted token, and of the second where the window went on past an
    accepted first proposal. Proposals are DRAFTS (one-hot q) or drawn from ``draft_probs``."""
    generator = torch.Generator().manual_seed(1)
    first: Counter[int] = Counter()
    second: Counter[int] = Counter()
    for _ in range(samples):
        drafts = (
            DRAFTS if draft_probs is None else torch.multinomial(draft_probs, 1, generator=generator)[:, 0].tolist()
        )
        tokens = verifier(TARGET, drafts, params, generator, draft_probs).tokens
        first[tokens[0]] += 1
        if len(tokens) > 1:
            second[tokens[1]] += 1
    return first, second


def distance_to_target(counts, params: SamplingParams) -> float:  # type: ignore[no-untyped-def]
    """The larger total-variation distance: first tokens against p1, second tokens against p2
    (the synthetic target's rows do not depend on the earlier token)."""
    worst = 0.0
    for seen, row in zip(counts, (0, 1), strict=True):
        p, n = filter_logits(TARGET[row], params), sum(seen.values())
        if n:
            worst = max(worst, 0.5 * sum(abs(seen[t] / n - float(p[t])) for t in range(6)))
    return worst


def biased_verify(logits, drafts, params, generator, draft_probs=None):  # type: ignore[no-untyped-def]
    """Accepts a proposal when it is the target's argmax, as a greedy verifier would, at any temperature."""
    targets = logits.argmax(dim=-1).tolist()
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
        accepted += 1
    p = filter_logits(logits[accepted], params)
    token = int(torch.multinomial(p, 1, generator=generator))
    return type("V", (), {"tokens": [*drafts[:accepted], token]})


def no_residual_verify(logits, drafts, params, generator, draft_probs):  # type: ignore[no-untyped-def]
    """Accepts with min(1, p / q) but draws a rejected position's token from p, not from the
    residual max(p - q, 0): the draft's likely tokens come out too often."""
    for i, draft in enumerate(drafts):
        p, q = filter_logits(logits[i], params), draft_probs[i]
        if float(torch.rand((), generator=generator)) < min(1.0, float(p[draft] / q[draft])):
            continue
        return type("V", (), {"tokens": [*drafts[:i], int(torch.multinomial(p, 1, generator=generator))]})
    bonus = filter_logits(logits[len(drafts)], params)
    return type("V", (), {"tokens": [*drafts, int(torch.multinomial(bonus, 1, generator=generator))]})


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4)])
def test_rejection_sampling_emits_the_targets_distribution_and_a_biased_verifier_is_caught(params) -> None:
    samples = 6000
    exact = distance_to_target(first_two_tokens(verify, samples, params), params)
    # a draft's own q, proposals drawn from it: sharper than p (a skipped residual shows most then)
    q = torch.softmax(3 * TARGET[:2], dim=-1)
    with_draft = distance_to_target(first_two_tokens(verify, samples, params, q), params)
    biased = distance_to_target(first_two_tokens(biased_verify, samples, params), params)
    biased_q = distance_to_target(first_two_tokens(no_residual_verify, samples, params, q), params)
    assert exact < 0.04 and with_draft < 0.04, (exact, with_draft)  # sampling noise at 6000 draws is ~0.01-0.02
    assert biased > 0.1 and biased_q > 0.1, (biased, biased_q)


def test_a_seed_reproduces_a_speculative_sample() -> None:
    params = SamplingParams(temperature=1.0)
    runs = [verify(TARGET, DRAFTS, params, torch.Generator().manual_seed(7)).tokens for _ in range(2)]
    assert runs[0] == runs[1]


# ---- widths and the controller ----------------------------------------------------------------


@pytest.mark.parametrize(
    "confidences, costs, width",
    [
        ([0.9, 0.9, 0.9], [1.0, 1.0, 1.0, 1.0], 3),  # flat costs: the widest window
        ([0.9, 0.9, 0.9], [1.0, 4.0, 4.0, 4.0], 0),  # one proposal quadruples the step: none
        ([0.9, 0.1, 0.9], [1.0, 1.1, 1.5, 1.6], 1),  # the second proposal rarely survives
        ([0.5], [1.0, 1.5], 0),  # E(1) / V(1) = 1.5 / 1.5 ties E(0) / V(0): the smaller width
        ([0.3, 0.3], [1.0, 2.0, 1.05], 0),  # V forced monotonic: V(2) counts as 2.0, not 1.05
    ],
)
def test_the_best_width_maximises_expected_tokens_per_second(confidences, costs, width) -> None:
    assert best_width(confidences, 0.0, costs) == width


def test_costs_are_the_fastest_recent_steps_forced_monotonic_and_unmeasured_widths_cost_as_the_nearest() -> None:
    assert monotonic([1.0, 0.8, 1.2, 1.1]) == [1.0, 1.0, 1.2, 1.2]
    costs = StepCosts(window=2)
    assert costs.cost(5) == 1.0  # nothing measured: flat
    costs.record(2, 1.0)
    costs.record(6, 9.0)  # a step slowed by contention...
    costs.record(6, 2.0)
    assert (costs.cost(1), costs.cost(4), costs.cost(9)) == (1.0, 1.5, 2.0)  # ...prices nothing
    costs.record(6, 3.0)
    costs.record(6, 3.0)  # out of the window of 2
    assert costs.cost(6) == 3.0


def test_joint_widths_give_rows_to_the_streams_likeliest_to_keep_them_within_the_budget() -> None:
    flat = StepCosts()
    assert joint_widths([[0.9, 0.9], [0.2, 0.2]], 0.0, flat, row_budget=4) == [2, 0]
    assert joint_widths([[0.9, 0.9], [0.8, 0.8]], 0.0, flat, row_budget=6) == [2, 2]
    steep = StepCosts()
    for rows in range(1, 8):
        steep.record(rows, float(rows))  # every row costs as much as a whole decode row
    assert joint_widths([[0.9, 0.9], [0.8, 0.8]], 0.0, steep, row_budget=6) == [0, 0]


def test_the_fallback_trips_under_tau_after_m_pauses_c_steps_then_probes() -> None:
    fallback = Fallback(min_verified=8, tau=0.6, cooldown=3)
    fallback.record(4, 1)
    assert fallback.drafting  # only 4 verified: not judged yet
    fallback.record(4, 2)  # 3 of 8 < 0.6
    assert not fallback.drafting and fallback.trips == 1
    for _ in range(3):
        fallback.plain_step()
    assert fallback.drafting and fallback.verified == 0  # the probe starts a fresh window
    fallback.record(8, 8)
    assert fallback.drafting and fallback.trips == 1


def test_a_new_request_starts_with_a_fresh_controller() -> None:
    speculator = Speculator(SpeculativeConfig("ngram", min_verified=2, acceptance_threshold=0.9, cooldown_steps=5))
    speculator.record("a", 4, 0)
    assert not speculator.fallbacks["a"].drafting
    speculator.forget("a")
    assert speculator.drafts([("a", [1, 2, 1])]) == [[2, 1]]


@pytest.mark.parametrize(
    "text, why",
    [
        ('{"method": "medusa"}', "unknown"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens=0"),
        ('{"method": "ngram", "k": 3}', "unknown field"),
        ('{"method": "ngram", "adaptive": 1}', "must be a bool"),
        ("[1]", "JSON object"),
        ("{", "not JSON"),
    ],
)
def test_a_bad_speculative_config_is_refused_naming_the_field(text: str, why: str) -> None:
    with pytest.raises(InputError, match=why):
        SpeculativeConfig.from_json(text)


# ---- the scheduler's verify windows -----------------------------------------------------------


class Fixed:
    method = "fixed"

    def __init__(self, *drafts: int):
        self.drafts = list(drafts)

    def propose(self, tokens, k):  # type: ignore[no-untyped-def]
        return self.drafts[:k]


def speculative_scheduler(*drafts: int, max_tokens_context: int = 64) -> Scheduler:
    config = SchedulerConfig(max_streams=2, context_length=max_tokens_context, vocab_size=100, eos_token_ids=(2,),
                             window_rows=8)  # fmt: skip
    speculator = Speculator(SpeculativeConfig("ngram", num_speculative_tokens=3, adaptive=False), Fixed(*drafts))
    return Scheduler(config, speculator)


def decode_step(scheduler: Scheduler, prompt: list[int], first: int, max_tokens: int = 16):  # type: ignore[no-untyped-def]
    stream = scheduler.submit("s", prompt, SamplingParams(max_tokens=max_tokens), 0.0)
    prefill = scheduler.schedule(0.0)[0]
    assert scheduler.complete(prefill.id, {stream.slot: first}) == [Token(stream, first)]
    return stream, scheduler.schedule(1.0)[0]


def test_a_decode_row_carries_the_proposals_and_wants_every_rows_output() -> None:
    scheduler = speculative_scheduler(7, 8, 9)
    stream, step = decode_step(scheduler, [10, 11, 12], first=5)
    assert step.token_ids == (5, 7, 8, 9) and step.positions == (3, 4, 5, 6)
    assert step.output_rows == (0, 1, 2, 3) and step.decode_only  # a verify window: a static (graph) step


def test_a_partly_accepted_window_commits_its_tokens_and_rewinds_the_rest() -> None:
    scheduler = speculative_scheduler(7, 8, 9)
    stream, step = decode_step(scheduler, [10, 11, 12], first=5)
    events = scheduler.complete(step.id, {stream.slot: [7, 4]})  # 7 accepted, 8 rejected, 4 instead
    assert events == [Token(stream, 7), Token(stream, 4), Rewind(stream, 5)]
    assert stream.generated == [5, 7, 4] and stream.confirmed == 6
    assert scheduler.schedule(2.0)[0].positions[0] == 5  # the next window starts at the kept length


def test_a_fully_accepted_window_needs_no_rewind() -> None:
    scheduler = speculative_scheduler(7, 8, 9)
    stream, step = decode_step(scheduler, [10, 11, 12], first=5)
    events = scheduler.complete(step.id, {stream.slot: [7, 8, 9, 6]})
    assert events == [Token(stream, t) for t in (7, 8, 9, 6)]


def test_a_stop_token_inside_an_accepted_block_ends_the_stream_there() -> None:
    scheduler = speculative_scheduler(7, 2, 9)
    stream, step = decode_step(scheduler, [10, 11, 12], first=5)
    events = scheduler.complete(step.id, {stream.slot: [7, 2, 9, 6]})
    assert events == [Token(stream, 7), Finish(stream, FinishReason.STOP)]


def test_max_tokens_inside_an_accepted_block_truncates_it() -> None:
    scheduler = speculative_scheduler(7, 8, 9)
    stream, step = decode_step(scheduler, [10, 11, 12], first=5, max_tokens=3)
    events = scheduler.complete(step.id, {stream.slot: [7, 8, 9, 6]})
    assert events == [Token(stream, 7), Token(stream, 8), Finish(stream, FinishReason.LENGTH)]


def test_proposals_never_run_past_the_context() -> None:
    scheduler = speculative_scheduler(7, 8, 9, max_tokens_context=6)
    _, step = decode_step(scheduler, [10, 11, 12, 13], first=5)
    assert step.positions == (4, 5)  # position 5 is the context's last


class Ticking:
    """A clock that advances ``tick`` seconds each time it is read."""

    def __init__(self, tick: float):
        self.now, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


class Costly(Fixed):
    """A proposer that pays a frame per proposed position, like a draft model; it notes the depth asked."""

    method = "draft_model"

    def __init__(self, *drafts: int):
        super().__init__(*drafts)
        self.asked: list[int] = []

    def propose(self, tokens, k):  # type: ignore[no-untyped-def]
        self.asked.append(k)
        return self.drafts[:k]


def test_prefill_steps_do_not_price_decode_rows_and_the_proposing_time_is_not_verify_time() -> None:
    config = SchedulerConfig(max_streams=1, context_length=64, vocab_size=100, window_rows=8)
    speculator = Speculator(SpeculativeConfig("ngram", num_speculative_tokens=3, adaptive=False), Fixed(7, 8, 9),
                           clock=Ticking(0.25))  # fmt: skip
    scheduler = Scheduler(config, speculator)
    stream = scheduler.submit("s", [10, 11, 12], SamplingParams(max_tokens=16, stop_token_ids=()), 0.0)
    prefill = scheduler.schedule(0.0)[0]
    scheduler.complete(prefill.id, {stream.slot: 5}, now=9.0)  # a prefill window: not a V(k) measurement
    assert speculator.costs.seconds == {}
    step = scheduler.schedule(10.0)[0]
    assert step.proposing_seconds == 0.25  # the clock read twice around proposing
    scheduler.complete(step.id, {stream.slot: [7, 4]}, now=11.0)
    assert dict(speculator.costs.seconds) == {4: deque([0.75])}  # 1 s less the proposing
    assert speculator.stats.proposing_seconds == 0.25


def test_joint_widths_charge_a_draft_frame_per_position_of_the_widest_window() -> None:
    flat = StepCosts()
    flat.record(1, 1.0)
    assert joint_widths([[0.9, 0.9, 0.9]], 0.0, flat, row_budget=4) == [3]
    # each position costs 0.5 s of drafting: E(k) / (0.5 k + 1) = 1, 1.27, 1.36, 1.38
    assert joint_widths([[0.9, 0.9, 0.9]], 0.5, flat, row_budget=4) == [3]
    assert joint_widths([[0.6, 0.6, 0.6]], 0.5, flat, row_budget=4) == [1]  # 1.07 > 1.06 > 1.0
    assert joint_widths([[0.4, 0.4, 0.4]], 0.5, flat, row_budget=4) == [0]  # 1.4 / 1.5 < 1


def test_a_costly_proposer_is_asked_only_for_the_depth_the_width_model_finds_worth_it() -> None:
    speculator = Speculator(SpeculativeConfig("draft_model", num_speculative_tokens=4, model="draft"), Costly(7, 8, 9, 6),
                            clock=Ticking(0.5))  # fmt: skip
    speculator.step_time(1, 1.0)
    for _ in range(40):
        speculator.record("a", 4, 4)  # every proposal survived so far
    assert speculator.drafts([("a", [1, 2, 3])]) == [[7, 8, 9, 6]]  # D unmeasured: the full depth
    assert speculator.draft_cost(1) == 0.5 / 4
    speculator.acceptance = Acceptance(prior=0.05, prior_weight=1000.0)  # proposals now rarely survive
    assert speculator.drafts([("a", [1, 2, 3])]) == [[]]
    assert speculator.proposer.asked == [4]  # not asked at all: drafting would not pay


def test_a_draft_model_s_own_probabilities_are_the_survival_confidences_of_its_proposals() -> None:
    class Confident(Costly):
        def propose(self, tokens, k):  # type: ignore[no-untyped-def]
            self.confidences = {"a": [0.95, 0.9, 0.05, 0.9][:k]}  # the third proposal is a guess
            return super().propose(tokens, k)

    speculator = Speculator(SpeculativeConfig("draft_model", num_speculative_tokens=4, model="draft"),
                            Confident(7, 8, 9, 6))  # fmt: skip
    speculator.step_time(1, 1.0)
    speculator.step_time(5, 1.2)  # a wider window costs a little more
    assert speculator.drafts([("a", [1, 2, 3])]) == [[7, 8]]  # the acceptance prior (0.5 a position) would take 3


# ---- through the engine ----------------------------------------------------------------------

REPETITIVE = [5, 9, 17, 33, 5, 9, 17, 33, 5, 9, 17, 33, 5, 9]


@pytest.mark.parametrize("method", ["ngram", "phrase", "hybrid"])
def test_greedy_output_with_speculation_is_token_for_token_the_plain_output(tiny_checkpoint, method: str) -> None:
    path, _ = tiny_checkpoint("qwen3_moe")
    lm = LocalModel.load(path, shards=2, max_slots=3)
    params = SamplingParams(max_tokens=32, stop_token_ids=())
    prompts = [REPETITIVE, [3, 1, 4, 1, 5, 9, 2, 6], REPETITIVE[3:]]
    plain = [r.token_ids for r in generate_batch(lm, prompts, params)]
    # fixed widths: the adaptive ones follow measured step times, which no test may depend on
    speculator = Speculator(SpeculativeConfig(method, num_speculative_tokens=4, adaptive=False))
    spec = [r.token_ids for r in generate_batch(lm, prompts, params, speculator=speculator)]
    assert spec == plain
    if method != "phrase":  # the phrase table starts empty; the suffix match proposes at once
        assert speculator.stats.drafted > 0


def test_after_rejected_proposals_the_kept_state_equals_a_fresh_prefill(tiny_checkpoint) -> None:
    path, _ = tiny_checkpoint("qwen3_moe")
    lm = LocalModel.load(path, shards=2, max_slots=2)
    prompt = REPETITIVE[:6]
    lm.forward(Frame.of_streams([(0, 0, prompt)]))
    lm.forward(Frame.of_streams([(0, 6, [40, 41, 42, 43])]))  # a window whose proposals are rejected
    lm.rewind(0, 7)  # keep the prompt and the first window row (the committed token 40)
    resumed = lm.forward(Frame.of_streams([(0, 7, [44])]))
    fresh = lm.forward(Frame.of_streams([(1, 0, [*prompt, 40, 44])]))[-1:]
    torch.testing.assert_close(resumed, fresh, atol=1e-5, rtol=1e-5)


def test_seeded_sampling_with_a_suffix_proposer_gives_the_plain_samples_token_for_token(tiny_checkpoint) -> None:
    path, _ = tiny_checkpoint("qwen3_moe")
    lm = LocalModel.load(path, max_slots=1)
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=24, stop_token_ids=())
    plain = generate(lm, REPETITIVE, params).token_ids
    speculator = Speculator(SpeculativeConfig("ngram", adaptive=False))
    assert generate(lm, REPETITIVE, params, speculator=speculator).token_ids == plain
    assert speculator.stats.drafted > 0


def test_generate_prints_speculation_statistics_and_refuses_a_bad_config(tiny_checkpoint) -> None:
    from typer.testing import CliRunner

    from modelfleet.cli import app

    path, _ = tiny_checkpoint("qwen3_moe")
    ids = ",".join(map(str, REPETITIVE))
    base = ["generate", "--model", str(path), "--prompt-ids", ids, "--max-tokens", "16", "--json"]
    runner = CliRunner()
    plain = runner.invoke(app, base)
    config = '{"method": "ngram", "num_speculative_tokens": 3}'
    spec = runner.invoke(app, [*base, "--speculative-config", config])
    assert plain.exit_code == 0 and spec.exit_code == 0, spec.output
    plain_out, spec_out = (json.loads(r.stdout.strip().splitlines()[-1]) for r in (plain, spec))
    assert spec_out["token_ids"] == plain_out["token_ids"]
    stats = spec_out["speculative"]
    assert stats["method"] == "ngram" and stats["drafted"] >= stats["accepted"] >= 0
    bad = runner.invoke(app, [*base, "--speculative-config", '{"method": "medusa"}'])
    assert bad.exit_code == 2 and "'medusa' is unknown" in bad.output


# ---- the draft model ---------------------------------------------------------------------------

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo"


def test_the_demo_draft_proposes_for_the_demo_model_and_greedy_output_is_unchanged() -> None:
    from modelfleet.engine.speculative.build import build_proposer
    from modelfleet.engine.tokenizer import TextTokenizer

    prompts = [TextTokenizer(DEMO).encode(text) for text in ("def fibonacci(n):\n    ", "import os\nimport sys\n\n\n")]
    lm = LocalModel.load(DEMO, max_slots=2)
    params = SamplingParams(max_tokens=24, stop_token_ids=())
    plain = [r.token_ids for r in generate_batch(lm, prompts, params)]
    config = SpeculativeConfig("draft_model", model=str(DEMO / "draft"), num_speculative_tokens=3, adaptive=False)
    speculator = Speculator(config, build_proposer(config, DEMO, max_streams=2))
    assert [r.token_ids for r in generate_batch(lm, prompts, params, speculator=speculator)] == plain
    stats = speculator.stats
    assert stats.drafted > 0 and stats.accepted > 0.2 * stats.drafted, stats  # a trained draft agrees often


def test_a_sampled_stream_s_draft_proposes_from_its_own_q_which_reaches_the_verifier(monkeypatch) -> None:
    from modelfleet.engine.speculative import verify as verify_module
    from modelfleet.engine.speculative.build import build_proposer
    from modelfleet.engine.tokenizer import TextTokenizer

    seen: list[torch.Tensor | None] = []

    def spy(logits, drafts, params, generator=None, draft_probs=None):  # type: ignore[no-untyped-def]
        seen.append(draft_probs)
        if draft_probs is not None:  # q is a distribution over the vocabulary, and each proposal was possible
            assert draft_probs.shape == (len(drafts), logits.shape[-1])
            assert torch.allclose(draft_probs.sum(-1), torch.ones(len(drafts)), atol=1e-4)
            assert all(float(draft_probs[i, d]) > 0 for i, d in enumerate(drafts))
        return verify(logits, drafts, params, generator, draft_probs)

    monkeypatch.setattr(verify_module, "verify", spy)
    prompt = TextTokenizer(DEMO).encode("def fibonacci(n):\n    ")
    lm = LocalModel.load(DEMO, max_slots=2)
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=s, max_tokens=24, stop_token_ids=()) for s in (1, 2)]
    config = SpeculativeConfig("draft_model", model=str(DEMO / "draft"), num_speculative_tokens=3, adaptive=False)

    def run() -> tuple[list[list[int]], Speculator]:
        speculator = Speculator(config, build_proposer(config, DEMO, max_streams=2), sampled_drafts=True)
        return [r.token_ids for r in generate_batch(lm, [prompt, prompt], params, speculator=speculator)], speculator

    first, speculator = run()
    assert any(q is not None for q in seen), "no window was verified with the draft's q"
    assert speculator.stats.drafted > 0 and speculator.stats.accepted > 0, speculator.stats
    assert run()[0] == first and first[0] != first[1]  # a seed reproduces the stream, drafts and all


# ---- mtp: the checkpoint's own next-token-prediction layers ----------------------------------


def mtp_beside_plain(directory: Path, prompts: list[list[int]], k: int, reads: str):  # type: ignore[no-untyped-def]
    """A checkpoint's own MTP layer as the proposer (one depth, reading ``reads``) and, beside it,
    the plain greedy continuations of ``prompts``: (lm, params, plain, config, proposer)."""
    from modelfleet.engine.speculative.build import build_proposer
    from modelfleet.engine.speculative.mtp import MtpProposer

    lm = LocalModel.load(directory, max_slots=2, max_context=128)
    params = SamplingParams(max_tokens=16, stop_token_ids=())
    plain = [r.token_ids for r in generate_batch(lm, prompts, params)]
    config = SpeculativeConfig("mtp", num_speculative_tokens=k, adaptive=False)
    proposer = build_proposer(config, directory, max_streams=2, max_context=128)
    assert isinstance(proposer, MtpProposer) and proposer.depths == 1 and proposer.reads == reads
    return lm, params, plain, config, proposer


def speculated_as_plain(lm, params, plain, config, proposer, prompts):  # type: ignore[no-untyped-def]
    """Decode ``prompts`` again with ``proposer`` drafting; the tokens must be ``plain``'s. Returns the stats."""
    speculator = Speculator(config, proposer)
    lm.keep_hidden(proposer.reads)
    assert [r.token_ids for r in generate_batch(lm, prompts, params, speculator=speculator)] == plain
    return speculator.stats


def check_proposals_against(proposer, fresh) -> list[int]:  # type: ignore[no-untyped-def]
    """Wrap an MtpProposer so that each proposal is checked against what ``fresh`` (an MTP module
    with its own state) drafts over all the stream's rows seen so far: the proposer's kept state
    never holds a row of an abandoned proposal. Returns the checked proposals' context lengths."""
    seen: dict[int, dict[int, torch.Tensor]] = {}
    checked: list[int] = []
    observe, propose = proposer.observe, proposer._propose

    def observing(slots, positions, hidden):  # type: ignore[no-untyped-def]
        for row, (slot, position) in enumerate(zip(slots, positions, strict=True)):
            seen.setdefault(slot, {})[position] = hidden[row].clone()
        observe(slots, positions, hidden)

    def proposing(slot, tokens, k):  # type: ignore[no-untyped-def]
        drafts = propose(slot, tokens, k)
        n = len(tokens) - 1
        rows = torch.stack([seen[slot][p] for p in range(n)])
        assert drafts == fresh.draft(slot, 0, rows, tokens[1:])[0][:k]
        checked.append(n)
        return drafts

    proposer.observe, proposer._propose = observing, proposing
    return checked


def test_mtp_proposals_from_an_inkling_checkpoint_s_mtp_layers_leave_greedy_output_unchanged(tmp_path) -> None:
    from inkling_tiny import save_text_model_with_mtp

    from modelfleet.engine.models.inkling_mtp import InklingMtp
    from modelfleet.engine.speculative.build import build_proposer
    from modelfleet.engine.speculative.mtp import MtpProposer

    save_text_model_with_mtp(tmp_path)
    lm = LocalModel.load(tmp_path, max_slots=3, max_context=128)
    params = SamplingParams(max_tokens=20, stop_token_ids=())
    prompts = [REPETITIVE, [3, 1, 4, 1, 5, 9, 2, 6], REPETITIVE[3:]]
    plain = [r.token_ids for r in generate_batch(lm, prompts, params)]
    config = SpeculativeConfig("mtp", num_speculative_tokens=2, adaptive=False)
    proposer = build_proposer(config, tmp_path, max_streams=3, max_context=128)
    assert isinstance(proposer, MtpProposer) and proposer.depths == 2
    # each proposal is what a fresh chain drafts over all the stream's rows: the kept chain state
    # never holds a row of an abandoned proposal
    fresh = InklingMtp.load(tmp_path)
    fresh.allocate_cache(3, 128)
    checked = check_proposals_against(proposer, fresh)
    speculator = Speculator(config, proposer)
    lm.keep_hidden()
    spec = [r.token_ids for r in generate_batch(lm, prompts, params, speculator=speculator)]
    assert spec == plain
    stats = speculator.stats
    assert stats.drafted > 0 and stats.widths[2] > 0, stats  # both depths proposed, every proposal verified
    assert len(checked) >= 10
    # every stream's chain state went with it; a second run gives the same again (nothing stale)
    assert proposer.hidden == {} and proposer.clean == {}
    again = [r.token_ids for r in generate_batch(lm, prompts, params, speculator=speculator)]
    assert again == plain
    # through the CLI
    from typer.testing import CliRunner

    from modelfleet.cli import app

    base = ["generate", "--model", str(tmp_path), "--prompt-ids", ",".join(map(str, REPETITIVE)), "--max-tokens",
            "20", "--json"]  # fmt: skip
    spec_cli = CliRunner().invoke(
        app, [*base, "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}']
    )
    assert spec_cli.exit_code == 0, spec_cli.output
    out = json.loads(spec_cli.stdout.strip().splitlines()[-1])
    assert out["token_ids"] == plain[0] and out["speculative"]["method"] == "mtp" and out["speculative"]["drafted"] > 0


def test_the_tail_s_mtp_proposes_after_each_window_and_a_released_slot_starts_afresh(tmp_path) -> None:
    from inkling_tiny import save_text_model_with_mtp

    from modelfleet.engine.speculative.mtp import MtpProposer, TailMtp, propose_at_tail

    save_text_model_with_mtp(tmp_path)
    lm = LocalModel.load(tmp_path, max_slots=1, max_context=64)
    lm.keep_hidden()

    def prefill(mtp: TailMtp, prompt: list[int]) -> tuple[int, list[int]]:
        """The prompt through the target in slot 0, its next token sampled (greedy): the tail's proposals."""
        lm.release(0)
        positions = list(range(len(prompt)))
        logits = lm.forward(Frame.of_streams([(0, 0, prompt)]))
        token = int(logits[-1].argmax())
        assert lm.final_hidden is not None
        [(slot, n, drafts)] = propose_at_tail(mtp, ([0] * len(prompt), positions, prompt), lm.final_hidden,
                                              [(0, positions[-1], token)])  # fmt: skip
        assert slot == 0 and n == len(prompt)
        return token, drafts

    def tail() -> TailMtp:
        return TailMtp(MtpProposer.load(tmp_path, max_streams=1, max_context=64), k=2)

    kept = tail()
    first = prefill(kept, REPETITIVE)
    assert len(first[1]) == 2  # both depths proposed
    kept.release(0)  # the stream ended: the slot's state goes with it
    again = prefill(kept, [3, 1, 4, 1, 5, 9, 2, 6])
    assert again == prefill(tail(), [3, 1, 4, 1, 5, 9, 2, 6])  # as from a fresh tail


def test_mtp_proposals_from_a_deepseek_v4_checkpoint_s_mtp_layer_leave_greedy_output_unchanged(
    with_mtp,  # noqa: F811  (the fixture imported above)
) -> None:
    prompts = [REPETITIVE, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]
    setup = mtp_beside_plain(with_mtp[0], prompts, 3, "residual")
    stats = speculated_as_plain(*setup, prompts)
    assert stats.drafted > 0 and set(stats.widths) <= {0, 1}, stats


def test_mtp_is_refused_without_mtp_layers(tiny_checkpoint) -> None:
    from modelfleet.engine.errors import ConfigError
    from modelfleet.engine.speculative.build import build_proposer

    path, _ = tiny_checkpoint("qwen3_moe")
    with pytest.raises(ConfigError, match="has none the engine serves"):
        build_proposer(SpeculativeConfig("mtp"), path)


def test_a_draft_whose_vocabulary_differs_and_cannot_be_bridged_is_refused(tiny_checkpoint) -> None:
    from modelfleet.engine.speculative.build import build_proposer

    path, _ = tiny_checkpoint("qwen3_moe")  # no tokenizer.json: nothing to bridge through
    config = SpeculativeConfig("draft_model", model=str(DEMO / "draft"))
    with pytest.raises(InputError, match="bridged through text, which needs both tokenizer.json"):
        build_proposer(config, path)


def renumbered_draft(folder: Path) -> Path:
    """The demo draft with another tokenizer: every ordinary token's id reversed (the special
    tokens keep theirs), its embedding rows (the tied head too) moved with them, so it predicts
    the same text through different ids."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(DEMO / "draft", folder)
    document = json.loads((folder / "tokenizer.json").read_text())
    vocab: dict[str, int] = document["model"]["vocab"]
    special = len(document["added_tokens"])
    size = len(vocab)
    moved = {old: (old if old < special else size - 1 - (old - special)) for old in vocab.values()}
    document["model"]["vocab"] = {token: moved[old] for token, old in vocab.items()}
    (folder / "tokenizer.json").write_text(json.dumps(document))
    tensors = load_file(folder / "model.safetensors")
    embed = tensors["model.embed_tokens.weight"]
    order = torch.empty(size, dtype=torch.int64)
    for old, new in moved.items():
        order[new] = old
    tensors["model.embed_tokens.weight"] = embed[order].contiguous()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_a_draft_with_another_tokenizer_is_bridged_through_text_and_greedy_output_is_unchanged(tmp_path) -> None:
    from modelfleet.engine.speculative.build import build_proposer
    from modelfleet.engine.speculative.draft import BridgedDraftProposer
    from modelfleet.engine.tokenizer import TextTokenizer

    draft = renumbered_draft(tmp_path / "draft")
    prompts = [TextTokenizer(DEMO).encode(text) for text in ("def fibonacci(n):\n    ", "import os\nimport sys\n\n\n")]
    lm = LocalModel.load(DEMO, max_slots=2)
    params = SamplingParams(max_tokens=24, stop_token_ids=())
    plain = [r.token_ids for r in generate_batch(lm, prompts, params)]
    config = SpeculativeConfig("draft_model", model=str(draft), num_speculative_tokens=3, adaptive=False)
    proposer = build_proposer(config, DEMO, max_streams=2)
    assert isinstance(proposer, BridgedDraftProposer)
    speculator = Speculator(config, proposer)
    assert [r.token_ids for r in generate_batch(lm, prompts, params, speculator=speculator)] == plain
    stats = speculator.stats
    assert stats.drafted > 0 and stats.accepted > 0.2 * stats.drafted, stats  # the same draft, through text


def test_the_draft_model_proposer_needs_a_model() -> None:
    with pytest.raises(InputError, match='needs "model"'):
        SpeculativeConfig.from_json('{"method": "draft_model"}')


def test_phrase_tables_learn_from_text_merge_and_show_through_the_cli(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from modelfleet.cli import app

    runner = CliRunner()
    code = tmp_path / "a.py"
    code.write_text("def f(x):\n    return x\n" * 20)
    for name in ("a", "b"):
        learned = runner.invoke(
            app, ["phrases", "learn", "--model", str(DEMO), str(code), "--out", str(tmp_path / f"{name}.json")]
        )
        assert learned.exit_code == 0, learned.output
    merged = runner.invoke(
        app, ["phrases", "merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out", str(tmp_path / "m.json")]
    )
    assert merged.exit_code == 0, merged.output
    one, both = PhraseTable.load(tmp_path / "a.json"), PhraseTable.load(tmp_path / "m.json")
    phrase = next(iter(one.counts))
    assert both.counts[phrase] == Counter({t: 2 * n for t, n in one.counts[phrase].items()})
    shown = runner.invoke(app, ["phrases", "show", str(tmp_path / "m.json")])
    assert shown.exit_code == 0 and "proposing" in shown.output
    bad = runner.invoke(app, ["phrases", "show", str(code)])
    assert bad.exit_code == 2 and "cannot be" in bad.output  # (rich wraps the line)
