"""The API that real clients need, through the official openai client and plain HTTP against a
local two-stage fleet (the fixtures of test_gateway): log-probabilities equal to transformers'
log-softmax of the distribution sampled from, streamed and not; n > 1, best_of and batches of
prompts; penalties, logit bias and min_tokens; /health, /version, /v1/models/{id}, /tokenize and
/detokenize; optional fields that cost nothing."""

# ruff: noqa: F811  (test functions take the module fixtures imported from test_gateway by name)
from __future__ import annotations

import math

import httpx
import openai
import pytest
import torch
from test_gateway import checkpoint, fleet, reference, served, tokenizer  # noqa: F401  (module fixtures)

from modelfleet.engine.sampling import SamplingParams, filter_logits

PROMPT = [5, 17, 42, 99, 3]


@pytest.fixture(scope="module")
def hf_logits(tiny_checkpoint):  # type: ignore[no-untyped-def]
    """ids -> transformers' logits [len(ids), V] at every position (the independent reference)."""
    model = tiny_checkpoint("qwen3_moe")[1]

    def logits(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].float()

    return logits


def sampled_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The log of the distribution a stream with ``params`` draws from (greedy: the log-softmax)."""
    if params.greedy:
        return torch.log_softmax(logits, -1)
    return torch.log(filter_logits(logits, params))


def check_logprobs(hf_logits, prompt: list[int], tokens: list[int], token_logprobs: list[float],  # type: ignore[no-untyped-def]
                   top: list[dict[int, float]], params: SamplingParams) -> None:  # fmt: skip
    logits = hf_logits(prompt + tokens)
    for i, token in enumerate(tokens):
        expected = sampled_logprobs(logits[len(prompt) - 1 + i], params)
        assert token_logprobs[i] == pytest.approx(float(expected[token]), abs=2e-3)
        best = torch.topk(expected, len(top[i])).indices.tolist()
        assert set(top[i]) == set(best) or len(top[i]) == 0
        for alt, value in top[i].items():
            assert value == pytest.approx(max(float(expected[alt]), -9999.0), abs=2e-3)


# ---- endpoints ------------------------------------------------------------------------------


def test_health_version_model_card_and_openapi_answer_as_vllm_and_openai_clients_expect(served) -> None:
    assert httpx.get(served.url + "/health").status_code == 200
    assert httpx.get(served.url + "/version").json()["version"]
    client, name = served.openai(), served.gateway.model_name
    card = client.models.retrieve(name)
    assert card.id == name and card.created > 1_700_000_000
    assert client.models.list().data[0].created == card.created
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    schema = httpx.get(served.url + "/openapi.json").json()
    assert {"/tokenize", "/detokenize", "/v1/models/{model_id}", "/health", "/version"} <= set(schema["paths"])
    fields = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"logprobs", "echo", "n", "best_of", "logit_bias", "min_tokens", "repetition_penalty"} <= set(fields)
    chat = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert {"top_logprobs", "continue_final_message", "chat_template_kwargs"} <= set(chat)


def test_tokenize_and_detokenize_round_trip_with_the_ids_generation_sees(served, tokenizer) -> None:
    text = "the rain in spain"
    answer = served.post("/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert answer["tokens"] == tokenizer.encode(text) and answer["count"] == len(answer["tokens"])
    assert answer["max_model_len"] == served.gateway.context_length and len(answer["token_strs"]) == answer["count"]
    assert served.post("/detokenize", {"tokens": answer["tokens"]}).json() == {"prompt": text}
    chat = served.post("/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == tokenizer.encode("<s>user: hi\n<s>assistant:")
    bad = served.post("/detokenize", {"tokens": [10**9]})
    assert bad.status_code == 400 and "tokens[0]" in bad.json()["error"]["message"]
    assert served.post("/tokenize", {"prompt": "x", "messages": []}).status_code == 400


# ---- log-probabilities ----------------------------------------------------------------------


@pytest.mark.parametrize("params", [dict(temperature=0.0), dict(temperature=0.8, top_k=20, seed=7)])
def test_completion_logprobs_streamed_or_not_equal_the_log_of_the_distribution_sampled_from(
    served, hf_logits, params
) -> None:
    client, model = served.openai(), served.gateway.model_name
    extra = {"return_token_ids": True, **({"top_k": params["top_k"]} if "top_k" in params else {})}
    kwargs = dict(model=model, prompt=PROMPT, max_tokens=6, logprobs=3, temperature=params["temperature"],
                  seed=params.get("seed"), extra_body=extra)  # fmt: skip
    result = client.completions.create(**kwargs)  # type: ignore[call-overload]
    choice = result.choices[0]
    tokens = choice.model_extra["token_ids"]
    lp = choice.logprobs
    assert len(lp.tokens) == len(tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    engine = SamplingParams(temperature=params["temperature"], top_k=params.get("top_k", 0))
    check_logprobs(hf_logits, PROMPT, tokens, lp.token_logprobs, [{}] * len(tokens), engine)
    logits = hf_logits(PROMPT + tokens)
    for i, entry in enumerate(lp.top_logprobs):  # the 3 best and the token itself (vLLM's shape)
        best = torch.topk(sampled_logprobs(logits[len(PROMPT) - 1 + i], engine).clamp(min=-9999.0), 3).values
        assert entry[lp.tokens[i]] == pytest.approx(lp.token_logprobs[i], abs=1e-6)
        for value in best.tolist():
            assert any(math.isclose(value, v, abs_tol=2e-3) for v in entry.values())
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(tokens))]
    stream = client.completions.create(**kwargs, stream=True)  # type: ignore[call-overload]
    streamed = [c.choices[0] for c in stream if c.choices]
    assert [x for c in streamed if c.logprobs for x in c.logprobs.token_logprobs] == pytest.approx(lp.token_logprobs)
    assert [x for c in streamed if c.logprobs for x in c.logprobs.text_offset] == lp.text_offset


def test_chat_logprobs_and_top_logprobs_come_in_openais_shape_and_match_transformers(
    served, hf_logits, tokenizer
) -> None:
    client, model = served.openai(), served.gateway.model_name
    messages = [{"role": "user", "content": "hi"}]
    result = client.chat.completions.create(model=model, messages=messages, max_tokens=5, temperature=0,  # type: ignore[arg-type]
                                            logprobs=True, top_logprobs=4, extra_body={"return_token_ids": True})  # fmt: skip
    choice = result.choices[0]
    tokens = choice.model_extra["token_ids"]
    content = choice.logprobs.content
    assert [c.token for c in content] == [tokenizer.decode([t]) for t in tokens]
    assert all(len(c.top_logprobs) == 4 and c.bytes == list(c.token.encode()) for c in content)
    prompt = tokenizer.encode("<s>user: hi\n<s>assistant:")
    check_logprobs(hf_logits, prompt, tokens, [c.logprob for c in content], [{}] * len(tokens), SamplingParams())
    for c in content:  # greedy: the token is its own best alternative
        assert c.top_logprobs[0].logprob == pytest.approx(c.logprob)
        assert [t.logprob for t in c.top_logprobs] == sorted((t.logprob for t in c.top_logprobs), reverse=True)
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=5, temperature=0,  # type: ignore[arg-type]
                                            logprobs=True, top_logprobs=4, stream=True)  # fmt: skip
    streamed = [e.logprob for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed == pytest.approx([c.logprob for c in content])


# ---- several choices ------------------------------------------------------------------------


def test_a_batch_of_prompts_and_n_choices_answer_each_with_its_index(served, reference, tokenizer) -> None:
    client, model = served.openai(), served.gateway.model_name
    prompts = [[5, 17, 42], [7, 8, 9, 10], [3, 1]]
    result = client.completions.create(model=model, prompt=prompts, max_tokens=5, temperature=0,
                                       extra_body={"return_token_ids": True})  # fmt: skip
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert [c.model_extra["token_ids"] for c in result.choices] == [reference(p, max_tokens=5) for p in prompts]
    texts = ["the rain", "in spain"]
    batch = client.completions.create(model=model, prompt=texts, max_tokens=4, temperature=0)
    single = [client.completions.create(model=model, prompt=t, max_tokens=4, temperature=0).choices[0].text
              for t in texts]  # fmt: skip
    assert [c.text for c in batch.choices] == single
    assert batch.usage is not None and batch.usage.prompt_tokens == sum(len(tokenizer.encode(t)) for t in texts)
    sampled = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=1.0, n=3, seed=1)
    assert [c.index for c in sampled.choices] == [0, 1, 2]
    again = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=1.0, n=3, seed=1)
    assert [c.text for c in again.choices] == [c.text for c in sampled.choices]  # seeded choices repeat
    stream = client.completions.create(model=model, prompt=prompts, max_tokens=5, temperature=0, n=2, stream=True)
    joined: dict[int, str] = {}
    for chunk in stream:
        for c in chunk.choices:
            joined[c.index] = joined.get(c.index, "") + c.text
    assert sorted(joined) == list(range(6))
    assert [joined[2 * p] for p in range(3)] == [c.text for c in result.choices]


def test_best_of_returns_the_n_most_likely_of_its_candidates(served) -> None:
    body = {"model": served.gateway.model_name, "prompt": PROMPT, "max_tokens": 6, "temperature": 1.0, "seed": 3}
    candidates = served.post("/v1/completions", {**body, "n": 4, "logprobs": 0}).json()["choices"]
    best = served.post("/v1/completions", {**body, "n": 1, "best_of": 4}).json()
    assert len(best["choices"]) == 1 and best["choices"][0]["logprobs"] is None
    scores = {c["text"]: sum(c["logprobs"]["token_logprobs"]) for c in candidates}
    assert best["choices"][0]["text"] == max(scores, key=scores.__getitem__)
    refused = served.post("/v1/completions", {**body, "n": 2, "best_of": 1})
    assert refused.status_code == 400 and "best_of" in refused.json()["error"]["message"]


# ---- sampling extras ------------------------------------------------------------------------


def test_logit_bias_min_tokens_and_penalties_change_what_is_sampled(served, reference) -> None:
    model = served.gateway.model_name
    base = {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    forced = served.post("/v1/completions", {**base, "logit_bias": {"11": 100}}).json()["choices"][0]
    assert forced["token_ids"] == [11] * 6
    plain = reference(PROMPT, max_tokens=6)
    penalised = served.post("/v1/completions", {**base, "frequency_penalty": 2.0, "presence_penalty": 2.0,
                                                "repetition_penalty": 1.5}).json()["choices"][0]  # fmt: skip
    engine = reference(PROMPT, max_tokens=6, frequency_penalty=2.0, presence_penalty=2.0, repetition_penalty=1.5)
    assert penalised["token_ids"] == engine
    first = plain[0]  # min_tokens keeps a stop token from ending the stream early
    ended = served.post("/v1/completions", {**base, "stop_token_ids": [first]}).json()["choices"][0]
    assert ended["token_ids"] == [] and ended["finish_reason"] == "stop"
    kept = served.post("/v1/completions", {**base, "stop_token_ids": [first], "min_tokens": 3}).json()["choices"][0]
    assert len(kept["token_ids"]) >= 3 and first not in kept["token_ids"][:3]
    bad = served.post("/v1/completions", {**base, "logit_bias": {"99999999": 1}})
    assert bad.status_code == 400 and "logit_bias" in bad.json()["error"]["message"]


def test_optional_fields_clients_send_are_accepted_and_model_may_be_left_out(served, tokenizer) -> None:
    answer = served.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "user": "u1"})
    assert answer.status_code == 200 and answer.json()["model"] == served.gateway.model_name
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "def f"}]
    body = {"messages": messages, "max_tokens": 2, "temperature": 0, "return_token_ids": True,
            "add_generation_prompt": False, "continue_final_message": True, "chat_template_kwargs": {"x": 1}}  # fmt: skip
    continued = served.post("/v1/chat/completions", body)
    assert continued.status_code == 200, continued.text
    prompt = tokenizer.encode("<s>user: hi\n<s>assistant: def f")  # the last message left open
    assert continued.json()["choices"][0]["prompt_token_ids"] == prompt
    refused = served.post("/v1/chat/completions", {**body, "add_generation_prompt": True})
    assert refused.status_code == 400 and "continue_final_message" in refused.json()["error"]["message"]
    clash = served.post("/v1/chat/completions", {**body, "chat_template_kwargs": {"messages": []}})
    assert clash.status_code == 400 and "chat_template_kwargs" in clash.json()["error"]["message"]


def test_echo_with_max_tokens_0_scores_the_prompt_as_transformers_does_streamed_or_not(served, hf_logits) -> None:
    client, model = served.openai(), served.gateway.model_name
    prompt = list(range(3, 23))  # over two prefill windows of 8 rows: scores cross frames
    result = client.completions.create(model=model, prompt=prompt, max_tokens=0, echo=True, logprobs=2, temperature=0)
    lp = result.choices[0].logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and len(lp.token_logprobs) == len(prompt)
    expected = torch.log_softmax(hf_logits(prompt), -1)
    for q in range(1, len(prompt)):
        assert lp.token_logprobs[q] == pytest.approx(float(expected[q - 1, prompt[q]]), abs=2e-3)
        assert len(lp.top_logprobs[q]) in (2, 3)
    assert result.usage is not None and result.usage.completion_tokens == 0
    assert result.choices[0].text == served.gateway.prompts.text(prompt)
    both = client.completions.create(model=model, prompt=prompt, max_tokens=3, echo=True, logprobs=1, temperature=0,
                                     stream=True)  # fmt: skip
    streamed = [x for c in both if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert len(streamed) == len(prompt) + 3 and streamed[: len(prompt)] == pytest.approx(lp.token_logprobs)
    refused = served.post("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 0})
    assert refused.status_code == 400 and "echo" in refused.json()["error"]["message"]
