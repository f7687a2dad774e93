"""The tail's sampling extras as pure pieces: penalties, logit bias and min_tokens change the
logits as vLLM defines them; prompt rows are scored across frames; log-probabilities and the
new sampling fields survive the wire."""

from __future__ import annotations

import pytest
import torch

from modelfleet.agent import transport as wire
from modelfleet.engine.errors import InputError
from modelfleet.engine.sampling import LOGPROB_FLOOR, SamplingParams, StreamSampler, TailSampler, TokenLogprobs


def test_penalties_bias_and_min_tokens_change_the_logits_as_vllm_defines_them() -> None:
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=2.0, min_tokens=4,
                            logit_bias_ids=(4,), logit_bias_values=(3.0,), stop_token_ids=(5,))  # fmt: skip
    sampler = StreamSampler(params)
    sampler.observe([0], [1])  # a prompt token: only the repetition penalty reads it
    sampler.generated = [2, 2, 3]
    logits = torch.tensor([1.0, 4.0, 2.0, -2.0, 0.0, 9.0])
    out = sampler.process(logits)
    assert out[0] == 1.0 and out[1] == 2.0  # untouched; a prompt token's positive logit halves
    assert out[2] == pytest.approx(2.0 / 2 - 2 * 0.5 - 0.25)  # output token twice: repetition, frequency, presence
    assert out[3] == pytest.approx(-2.0 * 2 - 0.5 - 0.25)  # a negative logit doubles
    assert out[4] == 3.0 and out[5] == float("-inf")  # bias; a stop token before min_tokens


def test_greedy_logprobs_are_the_log_softmax_and_sampled_ones_the_log_of_the_filtered_distribution() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    token, reported = StreamSampler(SamplingParams(logprobs=2)).sample_with_logprobs(logits)
    assert token == 0 and reported is not None
    assert reported.logprob == pytest.approx(float(torch.log_softmax(logits, -1)[0]))
    assert reported.top_ids == (0, 1)
    token, reported = StreamSampler(SamplingParams(temperature=1.0, top_k=1, seed=1, logprobs=2)).sample_with_logprobs(
        logits
    )
    assert token == 0 and reported is not None and reported.logprob == pytest.approx(0.0)
    assert reported.top_logprobs == (pytest.approx(0.0), LOGPROB_FLOOR)  # top-k removed the rest


def test_prompt_rows_are_scored_across_frames_by_the_next_rows_token() -> None:
    tail = TailSampler()
    tail.start(3, SamplingParams(prompt_logprobs=1), prompt_tokens=5)
    prompt = [7, 8, 9, 10, 11]
    logits = torch.randn(5, 16)
    assert tail.prompt_rows([3] * 5, [0, 1, 2, 3, 4]) == [True, True, True, True, False]
    first = tail.score_prompts([(3, 0), (3, 1), (3, 2)], logits[:3], [(3, p, prompt[p]) for p in range(3)])
    second = tail.score_prompts([(3, 3)], logits[3:4], [(3, p, prompt[p]) for p in (3, 4)])
    scored = dict(first[3] + second[3])
    expected = torch.log_softmax(logits, -1)
    assert sorted(scored) == [1, 2, 3, 4]  # row 2 waited for row 3's token, from the next frame
    assert 3 not in tail.scorers  # all scored: the stream is sampled from now on
    for q, value in scored.items():
        assert value.logprob == pytest.approx(float(expected[q - 1, prompt[q]]))


def test_logprobs_and_the_new_sampling_fields_survive_the_wire() -> None:
    params = SamplingParams(temperature=0.5, logprobs=3, prompt_logprobs=1, frequency_penalty=-1.5, min_tokens=2,
                            repetition_penalty=1.2, logit_bias_ids=(3, 9), logit_bias_values=(-100.0, 2.5))  # fmt: skip
    start = wire.decode(wire.encode(wire.FrameMsg(
        microbatch=0, step=1, slots=torch.tensor([2]), positions=torch.tensor([0]), token_ids=torch.tensor([5]),
        new_streams=(wire.StreamStart.of(2, params, prompt_tokens=7),),
    ))).new_streams[0]  # type: ignore[attr-defined]  # fmt: skip
    assert start.sampling_params() == params and start.prompt_tokens == 7
    record = wire.LogprobsRecord.of(0, TokenLogprobs(-0.5, (4, 1), (-0.25, -3.0)))
    tokens = wire.TokensMsg(microbatch=0, step=1, slots=torch.tensor([2]), positions=torch.tensor([7]),
                            token_ids=torch.tensor([4]), logprobs=(record,), prompt_slots=(2,),
                            prompt_logprobs=(wire.LogprobsRecord.of(6, TokenLogprobs(-1.0)),))  # fmt: skip
    back = wire.decode(wire.encode(tokens))
    assert back.logprobs[0].value() == record.value() and back.prompt_logprobs[0].row == 6  # type: ignore[attr-defined]
    with pytest.raises(wire.MalformedMessage, match="logprobs"):
        wire.TokensMsg(microbatch=0, step=1, slots=torch.tensor([2]), positions=torch.tensor([7]),
                       token_ids=torch.tensor([4]), logprobs=(wire.LogprobsRecord.of(1, record.value()),))  # fmt: skip
    with pytest.raises(InputError, match="logit_bias"):
        SamplingParams(logit_bias_ids=(1,), logit_bias_values=())


def _toy_logits(history: list[int], vocab: int = 12) -> torch.Tensor:
    """A deterministic stand-in model: the next logits depend on every earlier token."""
    generator = torch.Generator().manual_seed(sum((i + 1) * t for i, t in enumerate(history)) % 100_003)
    return torch.randn(vocab, generator=generator) * 3


def _tail_run(prompt: list[int], params: SamplingParams, steps: int, restart_after: int | None) -> list[int]:
    """``steps`` tokens sampled at a tail; with ``restart_after``, the tail's sampler is released
    after that many and a new one starts the way a replay or a continuation starts it (draws
    made before, where the output begins), with the prompt and output so far as its prefill rows."""
    tail, slot, output = TailSampler(eos_token_ids=(0,)), 5, []
    tail.start(slot, params, len(prompt))
    tail.observe([slot] * len(prompt), list(range(len(prompt))), prompt)
    for _ in range(steps):
        if len(output) == restart_after:
            tail.release(slot)
            tail.start(slot, params, 0, drawn=len(output), output_position=len(prompt))
            rows = [*prompt, *output]
            tail.observe([slot] * len(rows), list(range(len(rows))), rows)  # the replayed prefill
        elif output:
            tail.observe([slot], [len(prompt) + len(output) - 1], [output[-1]])  # the fed-back decode row
        tokens, errors = tail.sample([slot], _toy_logits([*prompt, *output])[None])
        assert not errors
        output.append(tokens[slot])
    return output


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, seed=7, max_tokens=64),  # the draws
        SamplingParams(frequency_penalty=1.5, presence_penalty=0.5, max_tokens=64),  # greedy, the output's counts
        SamplingParams(
            temperature=1.0, seed=3, frequency_penalty=2.0, repetition_penalty=1.5, min_tokens=20, max_tokens=64
        ),  # fmt: skip
    ],
    ids=["seeded", "greedy-penalties", "seeded-penalties-min-tokens"],
)
def test_a_sampler_restarted_after_a_replay_or_a_failover_goes_on_as_an_undisturbed_run(params) -> None:
    """Issue 34: the restarted tail skips the draws made before and takes the output back from
    the replayed rows, so frequency and presence penalties and min_tokens count it."""
    prompt = [4, 9, 4, 1]
    undisturbed = _tail_run(prompt, params, 24, None)
    assert len(set(undisturbed)) < len(undisturbed)  # tokens repeat: the penalties have something to count
    for restart_after in (1, 5, 13):
        assert _tail_run(prompt, params, 24, restart_after) == undisturbed


def test_a_continuation_and_the_output_position_survive_the_wire() -> None:
    submit = wire.decode(wire.encode(wire.SubmitMsg.of(9, [1, 2, 3, 40, 41], SamplingParams(seed=5), continued=2)))
    assert submit.continued == 2 and submit.prompt_ids.tolist() == [1, 2, 3, 40, 41]  # type: ignore[attr-defined]
    with pytest.raises(wire.MalformedMessage, match="submit.continued=5 must be below the 5 prompt ids"):
        wire.SubmitMsg.of(9, [1, 2, 3, 40, 41], SamplingParams(), continued=5)
    start = wire.StreamStart.of(2, SamplingParams(), prompt_tokens=0, drawn=4, output_position=3)
    frame = wire.FrameMsg(microbatch=0, step=1, slots=torch.tensor([2]), positions=torch.tensor([0]),
                          token_ids=torch.tensor([5]), new_streams=(start,))  # fmt: skip
    assert wire.decode(wire.encode(frame)).new_streams == (start,)  # type: ignore[attr-defined]
