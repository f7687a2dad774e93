"""The structured-output mask at the tail, against xgrammar's own matcher built independently
(from transformers' tokenizer of the demo checkpoint): a token outside the grammar is never
sampled, whatever the temperature and top-k; stop tokens only where the grammar may end; a
replayed stream's grammar state is rebuilt from its committed tokens; the spec crosses the wire
as text. Then the gateway's side: tools into the prompt, and streamed text back into tool calls."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from modelfleet.agent import transport as wire
from modelfleet.agent.openai_schema import ChatCompletionRequest
from modelfleet.agent.structured import CALL_CLOSE, CALL_OPEN, ToolCallParser, chat_messages, split_tool_calls
from modelfleet.engine.sampling import LOGPROB_FLOOR, SamplingParams, StreamSampler, TailSampler
from modelfleet.engine.structured import Grammars, StructuredOutputError, check_spec, spec_text

xgr = pytest.importorskip("xgrammar")

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo"
VOCAB = 4096
EOS = 0
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "kind": {"enum": ["a", "bb"]},
        "note": {"type": "string", "maxLength": 6},
    },
    "required": ["id", "kind", "note"],
}
SPEC = spec_text({"type": "json_schema", "schema": SCHEMA, "strict": True})


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    return Grammars(DEMO, VOCAB)


@pytest.fixture(scope="module")
def reference() -> Any:
    """A compiled grammar of SPEC by xgrammar's own route from a transformers tokenizer."""
    from transformers import AutoTokenizer

    info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(DEMO), vocab_size=VOCAB,
                                              stop_token_ids=[EOS])  # fmt: skip
    return xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False, strict_mode=True
    )


def allowed_by(matcher: Any) -> set[int]:
    bitmask = xgr.allocate_token_bitmask(1, VOCAB)
    matcher.fill_next_token_bitmask(bitmask)
    logits = torch.zeros(1, VOCAB)
    xgr.apply_token_bitmask_inplace(logits, bitmask)
    return set(torch.isfinite(logits[0]).nonzero().flatten().tolist())


def adversarial_logits(generator: torch.Generator) -> torch.Tensor:
    """Random logits with the grammar's likely tokens pushed down: a sampler that ignored the mask
    would draw outside it almost every step."""
    logits = torch.randn(VOCAB, generator=generator) * 3
    logits[:300] -= 20  # the byte-level and JSON-punctuation ids
    return logits


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.5, top_k=40, seed=1, max_tokens=64, stop_token_ids=(EOS,), logprobs=5),
    SamplingParams(temperature=0.0, max_tokens=64, stop_token_ids=(EOS,)),
    SamplingParams(temperature=0.8, top_p=0.9, seed=2, max_tokens=64, stop_token_ids=(EOS,), presence_penalty=1.0),
])  # fmt: skip
def test_a_token_outside_the_grammar_is_never_sampled(
    grammars: Grammars, reference: Any, params: SamplingParams
) -> None:
    params = SamplingParams(**{**params.__dict__, "grammar": SPEC})
    sampler = StreamSampler(params, (EOS,), grammar=grammars.state(SPEC, (EOS,)))
    matcher = xgr.GrammarMatcher(reference)
    generator = torch.Generator().manual_seed(0)
    tokens = []
    for _ in range(200):
        allowed = allowed_by(matcher)
        assert set(sampler.grammar.allowed().nonzero().flatten().tolist()) == allowed  # type: ignore[union-attr]
        token, logprobs = sampler.sample_with_logprobs(adversarial_logits(generator))
        assert token in allowed and matcher.accept_token(token)
        if logprobs is not None:  # the alternatives reported are of the masked distribution
            assert all(
                t in allowed or v == LOGPROB_FLOOR for t, v in zip(logprobs.top_ids, logprobs.top_logprobs, strict=True)
            )
        tokens.append(token)
        if token == EOS:
            break
    assert tokens[-1] == EOS and matcher.is_terminated(), tokens
    from tokenizers import Tokenizer

    text = Tokenizer.from_file(str(DEMO / "tokenizer.json")).decode(tokens[:-1])
    assert set(json.loads(text)) == {"id", "kind", "note"}


def test_stop_tokens_are_allowed_only_where_the_grammar_may_end(grammars: Grammars) -> None:
    state = grammars.state(spec_text({"type": "json_object"}), (EOS, 7))
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(DEMO / "tokenizer.json")).encode('{"a": [1, 2]}').ids
    for token in ids:
        assert not state.allowed()[EOS] and not state.allowed()[7]
        state.accept(token)
    assert set(state.allowed().nonzero().flatten().tolist()) == {EOS, 7}  # complete: only the end
    state.accept(EOS)
    assert state.ended


@pytest.mark.parametrize("how", ["replay", "continuation"])
def test_a_restarted_stream_rebuilds_its_grammar_state_from_the_committed_tokens(grammars: Grammars, how: str) -> None:
    """The tail restarts a stream whose prefill carries prompt + the tokens it had committed: a
    head's replay after a lost stage, or the gateway's continuation on another head (both say
    ``drawn`` tokens from ``output_position``); its next mask is an undisturbed run's."""
    params = SamplingParams(temperature=0.0, max_tokens=64, stop_token_ids=(EOS,), grammar=SPEC)
    prompt = [17, 18, 19]
    first = TailSampler((EOS,), grammars)
    first.start(0, params, len(prompt))
    first.observe([0] * 3, [0, 1, 2], prompt)
    generator = torch.Generator().manual_seed(5)
    committed = []
    for _ in range(6):
        tokens, errors, _ = first.sample_with_logprobs([0], adversarial_logits(generator)[None])
        assert not errors
        committed.append(tokens[0])
        first.observe([0], [len(prompt) + len(committed) - 1], [tokens[0]])
    again = TailSampler((EOS,), grammars)
    scored = 0 if how == "replay" else len(prompt)  # a replay does not score its prompt again
    again.start(3, params, scored, drawn=len(committed), output_position=len(prompt))
    rows = [*prompt, *committed]
    again.observe([3] * 4, list(range(4)), rows[:4])  # the prefill, in two windows
    again.observe([3] * (len(rows) - 4), list(range(4, len(rows))), rows[4:])
    logits = adversarial_logits(generator)
    undisturbed, _, _ = first.sample_with_logprobs([0], logits[None])
    replayed, errors, _ = again.sample_with_logprobs([3], logits[None])
    assert not errors and replayed[3] == undisturbed[0]
    assert torch.equal(again.samplers[3].grammar.allowed(), first.samplers[0].grammar.allowed())  # type: ignore[union-attr]


def test_a_stream_with_a_grammar_is_neither_plain_nor_speculated() -> None:
    params = SamplingParams(temperature=0.0, grammar=SPEC)
    assert not params.plain and not params.speculates
    assert SamplingParams(temperature=0.0).plain


def test_a_grammar_that_does_not_compile_fails_its_stream_alone(grammars: Grammars) -> None:
    tail = TailSampler((EOS,), grammars)
    bad = spec_text({"type": "json_schema", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}})
    tail.start(0, SamplingParams(temperature=0.0, grammar=bad, stop_token_ids=(EOS,)))
    tail.start(1, SamplingParams(temperature=0.0))
    tokens, errors, _ = tail.sample_with_logprobs([0, 1], torch.randn(2, VOCAB))
    assert set(tokens) == {1} and isinstance(errors[0], StructuredOutputError) and "nope" in str(errors[0])


def test_check_spec_says_what_is_wrong() -> None:
    with pytest.raises(StructuredOutputError, match="Unsupported type"):
        check_spec(spec_text({"type": "json_schema", "schema": {"type": "nonsense"}}))
    with pytest.raises(StructuredOutputError, match="not one of"):
        check_spec('{"type": "regex"}')
    check_spec(spec_text({"type": "json_object"}))


def test_the_grammar_spec_crosses_the_wire_as_text() -> None:
    params = SamplingParams(temperature=0.5, grammar=SPEC)
    start = wire.StreamStart.of(2, params, prompt_tokens=5)
    decoded = wire.decode(wire.encode(wire.FrameMsg(
        microbatch=0, step=1, slots=torch.tensor([2]), positions=torch.tensor([0]), hidden=torch.zeros(1, 4),
        token_ids=torch.tensor([1]), output_rows=(0,), new_streams=(start,),
    )))  # fmt: skip
    assert isinstance(decoded, wire.FrameMsg)
    assert decoded.new_streams[0].sampling_params() == params
    with pytest.raises(wire.MalformedMessage, match="grammar"):
        wire.StreamStart.of(2, SamplingParams(), 0).__class__(slot=2, grammar=7)  # type: ignore[arg-type]


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def test_tools_go_through_a_template_that_reads_them_and_a_preamble_otherwise() -> None:
    body = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3 C"},
    ], "tools": [WEATHER]})  # fmt: skip
    messages, extra = chat_messages(body, frozenset({"messages", "tools"}))
    assert extra == {"tools": [WEATHER]}
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    messages, extra = chat_messages(body, frozenset({"messages"}))
    assert extra is None and messages[0]["role"] == "system" and "get_weather" in messages[0]["content"]
    call = json.loads(messages[2]["content"].removeprefix(CALL_OPEN).removesuffix(CALL_CLOSE))
    assert call == {"name": "get_weather", "arguments": {"city": "Oslo"}}
    assert messages[3] == {"role": "user", "content": "<tool_response>\n3 C\n</tool_response>"}


def test_streamed_text_splits_into_content_and_tool_calls_however_it_is_cut() -> None:
    text = f'Sure.{CALL_OPEN}\n{{"name": "f", "arguments": {{"x": 1}}}}\n{CALL_CLOSE}<tool_ {CALL_OPEN}not json{CALL_CLOSE}'
    content, calls = split_tool_calls(text)
    assert content == f"Sure.<tool_ {CALL_OPEN}not json{CALL_CLOSE}"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("f", {"x": 1})]
    for size in (1, 3, 7):
        parser = ToolCallParser()
        pieces = [parser.push(text[i : i + size]) for i in range(0, len(text), size)]
        assert "".join(p[0] for p in pieces) + parser.finish() == content
        assert [c["function"] for p in pieces for c in p[1]] == [c["function"] for c in calls]
    assert split_tool_calls(f"{CALL_OPEN}\n{{}}")[0] == f"{CALL_OPEN}\n{{}}"  # cut by max_tokens: text


def test_without_xgrammar_structured_output_is_a_clear_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from modelfleet.agent.prompts import PromptError
    from modelfleet.agent.structured import grammar_spec

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # an import of it fails, as where it is not installed
    for body, param in (
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": [WEATHER]}, "tools"),
    ):
        request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **body})
        with pytest.raises(PromptError, match="needs xgrammar") as caught:
            grammar_spec(request)
        assert caught.value.param == param


def test_auto_tool_choice_allows_text_and_constrains_a_call_once_it_starts(grammars: Grammars) -> None:
    from tokenizers import Tokenizer

    from modelfleet.agent.structured import grammar_spec

    tokenizer = Tokenizer.from_file(str(DEMO / "tokenizer.json"))
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "tools": [tool]})
    spec = grammar_spec(body)
    assert spec is not None

    def fed(text: str) -> Any:
        state = grammars.state(spec, (EOS,))
        for token in tokenizer.encode(text).ids:
            state.accept(token)
        return state

    assert fed("def f(x): return x  # any text").allowed()[EOS]  # text may be the whole answer
    opened = fed(f'Let me look. {CALL_OPEN}\n{{"name": "get_weather", "arguments": ')
    assert not opened.allowed()[EOS]  # a call, once begun, must be finished
    texts = {tokenizer.decode([t]) for t in opened.allowed().nonzero().flatten().tolist()}
    assert texts and all(text.lstrip().startswith("{") or not text.strip() for text in texts), texts
    with pytest.raises(StructuredOutputError):
        fed(f'{CALL_OPEN}\n{{"name": "get_time"')  # not a tool of the request
