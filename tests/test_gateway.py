"""The OpenAI-compatible gateway in front of a local two-stage fleet of a tiny checkpoint with a
byte-fallback BPE tokenizer and a chat template: the official openai client streams the
single-process engine's greedy tokens, stop strings and multi-byte characters survive token
boundaries, bad input gets OpenAI-shaped errors, and limits, auth, readiness, disconnects and
metrics behave as specified."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
import zmq
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from test_pipeline import free_base_port, wait_until

from modelfleet.agent import gateway as gateway_module
from modelfleet.agent import transport as wire
from modelfleet.agent.admission import Admission, Busy
from modelfleet.agent.client import FleetClient, FleetError
from modelfleet.agent.gateway import Gateway, GatewayConfig
from modelfleet.agent.headlink import HeadLink
from modelfleet.agent.launcher import LocalFleet, fetch_json
from modelfleet.agent.openai_schema import ChatCompletionRequest, CompletionRequest
from modelfleet.agent.textstream import StopMatcher, TextStream
from modelfleet.commands.fleet import make_plan
from modelfleet.engine.generate import LocalModel, generate
from modelfleet.engine.sampling import SamplingParams
from modelfleet.engine.tokenizer import TextTokenizer
from modelfleet.plan import FleetPlan, PlanError

STAGES = 2
CONTEXT = 512
MULTIBYTE = "é€🙂中"
SPLIT_CHAR, SPLIT_CANDIDATES, SPLIT_TOKENS = "é", ([77, 88], [64], [5, 17, 42, 99, 3], [1, 2, 3]), 16
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


def build_tokenizer(split_char_ids: list[int]):  # type: ignore[no-untyped-def]
    """A 128-entry byte-fallback BPE (specials, the bytes of a few multi-byte characters, ASCII,
    merges) whose ids ``split_char_ids`` are the bytes of SPLIT_CHAR, in order."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    specials = ["<unk>", "<s>", "</s>"]
    byte_tokens = sorted({f"<0x{b:02X}>" for ch in MULTIBYTE for b in ch.encode()})
    merges = [("t", "h"), ("h", "e"), ("i", "n"), ("e", "r"), ("a", "n"), (" ", "t"), ("o", "n"), ("r", "e"),
              ("e", "d"), ("s", "t"), (" ", "a"), ("e", "n"), ("a", "t"), ("o", "r"), ("th", "e"), (" ", "s"),
              ("i", "s"), ("o", "u"), ("l", "e")]  # fmt: skip
    tokens = specials + byte_tokens + [chr(c) for c in range(32, 127)] + [a + b for a, b in merges]
    assert len(tokens) == 128 and len(set(tokens)) == 128
    for target, byte in zip(split_char_ids, SPLIT_CHAR.encode(), strict=True):
        at = tokens.index(f"<0x{byte:02X}>")
        tokens[at], tokens[target] = tokens[target], tokens[at]
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, unk_token="<unk>",
                                     byte_fallback=True))  # fmt: skip
    tokenizer.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.add_special_tokens([AddedToken(s, special=True) for s in specials])
    return tokenizer


def write_tokenizer_with_a_split_character(directory: Path, reference) -> list[int]:  # type: ignore[no-untyped-def]
    """Find a prompt and two ids the model then writes greedily that, made the two bytes of
    SPLIT_CHAR, decode to it; write that tokenizer (and a chat template) and return the prompt."""
    for prompt in SPLIT_CANDIDATES:
        ids = reference(prompt, max_tokens=SPLIT_TOKENS, stop_token_ids=())
        for first, second in zip(ids, ids[1:], strict=False):
            if first != second and min(first, second) >= 3:
                tokenizer = build_tokenizer([first, second])
                if SPLIT_CHAR in tokenizer.decode(ids, skip_special_tokens=True):
                    tokenizer.save(str(directory / "tokenizer.json"))
                    config = {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": CHAT_TEMPLATE}
                    (directory / "tokenizer_config.json").write_text(json.dumps(config))
                    return prompt
    raise AssertionError(f"the tiny model never wrote a pair of ids that could spell {SPLIT_CHAR!r}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Served:
    """A gateway running under uvicorn in a thread of this process."""

    def __init__(self, config: GatewayConfig):
        self.gateway = Gateway(config)
        self.url = f"http://127.0.0.1:{free_port()}"
        port = int(self.url.rsplit(":", 1)[1])
        self.server = uvicorn.Server(uvicorn.Config(self.gateway.app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Served:
        self.thread.start()
        wait_until(lambda: self.server.started, 10, "the gateway listens")
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def openai(self, api_key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=30)

    def post(self, path: str, body: object, **kwargs: object) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=30, **kwargs)  # type: ignore[arg-type]


class TestFleet:
    __test__ = False

    def __init__(self, model_dir: Path, workdir: Path):
        self.plan = make_plan(model_dir, STAGES, max_streams=8, context_length=CONTEXT, window_rows=8,
                              base_port=free_base_port(STAGES))  # fmt: skip
        self.plan_path = workdir / "plan.json"
        self.plan_path.write_text(self.plan.to_json())
        self.log = (workdir / "fleet.log").open("w")
        self.local = LocalFleet(self.plan, self.plan_path, out=self.log)
        self.stages = self.plan.groups[0].stages

    def start(self) -> None:
        env = {**os.environ, "PYTHONSAFEPATH": "1", "OMP_NUM_THREADS": "1"}
        for s in self.stages:
            status_url = f"http://{s.host}:{s.port + 1}/status"
            self.local.spawn(f"stage {s.stage_index}", self.local.stage_command(s.stage_index), env, status_url)
        self.local.wait_ready(120)

    def slots_in_use(self) -> list[int]:
        return [(fetch_json(f"http://{s.host}:{s.port + 1}/status") or {}).get("slots_in_use", -1) for s in self.stages]

    def stop(self) -> None:
        self.local.stop()
        self.log.close()


@contextlib.contextmanager
def ready_gateway(plan: FleetPlan) -> Iterator[Served]:
    """A gateway for ``plan``'s running fleet, once it sees the head ready."""
    with Served(GatewayConfig.of(plan)) as served:
        wait_until(lambda: served.gateway.ready, 10, "the gateway sees the head ready")
        yield served


@contextlib.contextmanager
def served_fleet(model_dir: Path, workdir: Path) -> Iterator[Served]:
    """A TestFleet of ``model_dir`` behind a ready gateway; the fleet stops on exit."""
    fleet = TestFleet(model_dir, workdir)
    fleet.start()
    try:
        with ready_gateway(fleet.plan) as served:
            yield served
    finally:
        fleet.stop()


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):  # type: ignore[no-untyped-def]
    lm = LocalModel.load(tiny_checkpoint("qwen3_moe")[0], max_slots=1, max_context=CONTEXT)
    return lambda ids, **params: generate(lm, ids, SamplingParams(**params)).token_ids


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint, tmp_path_factory, reference) -> Path:  # type: ignore[no-untyped-def]
    source, _ = tiny_checkpoint("qwen3_moe")
    path = tmp_path_factory.mktemp("tokenized") / "tiny-chat"
    shutil.copytree(source, path)
    prompt = write_tokenizer_with_a_split_character(path, reference)
    (path / "split_prompt.json").write_text(json.dumps(prompt))
    return path


@pytest.fixture(scope="module")
def fleet(checkpoint, tmp_path_factory) -> Iterator[TestFleet]:  # type: ignore[no-untyped-def]
    fleet = TestFleet(checkpoint, tmp_path_factory.mktemp("gateway-fleet"))
    fleet.start()
    yield fleet
    fleet.stop()


@pytest.fixture(scope="module")
def served(fleet) -> Iterator[Served]:  # type: ignore[no-untyped-def]
    with ready_gateway(fleet.plan) as served:
        yield served


@pytest.fixture(scope="module")
def tokenizer(checkpoint) -> TextTokenizer:  # type: ignore[no-untyped-def]
    return TextTokenizer(checkpoint)


def extra(obj: object, name: str) -> object:
    return (getattr(obj, "model_extra", None) or {}).get(name)


# ---- generation -------------------------------------------------------------------------------


def test_completions_through_the_openai_client_give_the_single_process_engines_greedy_tokens(
    served, reference, tokenizer
) -> None:
    client, model = served.openai(), served.gateway.model_name
    for prompt in ([5, 17, 42, 99, 3], "the rain in spain"):
        ids = prompt if isinstance(prompt, list) else tokenizer.encode(prompt)
        expected = reference(ids, max_tokens=8)
        result = client.completions.create(
            model=model, prompt=prompt, max_tokens=8, temperature=0, extra_body={"return_token_ids": True}
        )
        choice = result.choices[0]
        assert extra(choice, "token_ids") == expected and extra(choice, "prompt_token_ids") == ids
        assert choice.text == tokenizer.decode(expected)
        assert choice.finish_reason == ("length" if len(expected) == 8 else "stop")
        assert result.usage is not None and result.usage.prompt_tokens == len(ids)
        assert result.usage.completion_tokens == len(expected)
        stream = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, stream=True,
                                           stream_options={"include_usage": True})  # fmt: skip
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
        assert not chunks[-1].choices and chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == len(expected)


def test_chat_completions_render_the_checkpoints_template_and_stream_the_same_answer(
    served, reference, tokenizer
) -> None:
    client, model = served.openai(), served.gateway.model_name
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    ids = tokenizer.encode("<s>system: be brief\n<s>user: hi there\n<s>assistant:")
    expected = reference(ids, max_tokens=10)
    result = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=10,  # type: ignore[arg-type]
                                            temperature=0, extra_body={"return_token_ids": True})  # fmt: skip
    choice = result.choices[0]
    assert extra(choice, "prompt_token_ids") == ids and extra(choice, "token_ids") == expected
    assert choice.message.role == "assistant" and choice.message.content == tokenizer.decode(expected)
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0,  # type: ignore[arg-type]
                                            stream=True, stream_options={"include_usage": True})  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == len(ids)


def test_chat_is_refused_clearly_when_the_checkpoint_has_no_chat_template(fleet, tiny_checkpoint) -> None:
    bare, _ = tiny_checkpoint("qwen3_moe")  # no tokenizer at all
    with Served(GatewayConfig.of(fleet.plan, model_dir=bare)) as served:
        response = served.post("/v1/chat/completions", {"model": fleet.plan.model.served_name,
                                                        "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
    assert response.status_code == 400 and "no chat template" in response.json()["error"]["message"]


def boundary_stop(tokenizer: TextTokenizer, ids: list[int]) -> tuple[str, int]:
    """A stop string spanning two tokens of ``ids``' text, and where it first starts in that text."""
    pieces = [tokenizer.decode(ids[: i + 1]) for i in range(len(ids))]
    full = pieces[-1]
    for i in range(3, len(ids) - 1):
        end, after = len(pieces[i]), len(pieces[i + 1])
        if 0 < end < after and "\ufffd" not in full[: after + 1]:
            stop = full[end - 1 : end + 1]
            if full.find(stop) == end - 1:
                return stop, end - 1
    raise AssertionError(f"no token boundary to test in {full!r}")


def test_stop_strings_spanning_token_boundaries_are_cut_from_the_output_and_free_the_slot(
    served, fleet, reference, tokenizer
) -> None:
    client, model = served.openai(), served.gateway.model_name
    prompt = tokenizer.encode("once upon a time")
    ids = reference(prompt, max_tokens=16, stop_token_ids=())
    stop, at = boundary_stop(tokenizer, ids)
    expected = tokenizer.decode(ids)[:at]
    body = dict(model=model, prompt=prompt, max_tokens=16, temperature=0, stop=["\x00never", stop],
                extra_body={"ignore_eos": True})  # fmt: skip
    result = client.completions.create(**body)  # type: ignore[call-overload]
    assert result.choices[0].text == expected and result.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(**body, stream=True))  # type: ignore[call-overload]
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    wait_until(lambda: fleet.slots_in_use() == [0] * STAGES, 1.0, "the stopped streams' slots are free")


def test_text_stream_never_splits_a_multibyte_character_and_holds_back_stop_prefixes(tokenizer) -> None:
    euro = [tokenizer.token_id(f"<0x{b:02X}>") for b in "€".encode()]
    stream = TextStream(tokenizer, ["€x"])
    assert [stream.push([t]).text for t in euro] == ["", "", ""]  # held: "€" may start "€x"
    piece = stream.push([tokenizer.token_id("y")])  # type: ignore[list-item]
    assert piece.text == "€y" and not piece.stopped
    assert StopMatcher(["abc"]).push("xxab") == ("xx", False)


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(ids=st.lists(st.integers(0, 127), max_size=40))
def test_text_stream_pieces_of_any_valid_ids_equal_their_full_decode(tokenizer, ids) -> None:  # type: ignore[no-untyped-def]
    assume("\ufffd" not in tokenizer.decode(ids))  # invalid UTF-8: see the test below
    stream = TextStream(tokenizer, [])
    pieces = [stream.push([t]).text for t in ids]
    assert "".join(pieces) + stream.finish() == tokenizer.decode(ids)


def test_a_character_streamed_before_a_stray_byte_stays_though_the_full_decode_replaces_the_run(tokenizer) -> None:
    # byte-fallback decoding replaces every byte of a run that is not valid UTF-8, so a stray
    # continuation byte turns an already complete "é" (C3 A9) into U+FFFD in the full decode;
    # a stream cannot take back what it sent, so it keeps "é" and replaces the stray byte alone
    ids = [tokenizer.token_id(f"<0x{b:02X}>") for b in (0xC3, 0xA9, 0xA9)]
    assert tokenizer.decode(ids) == "\ufffd" * 3
    stream = TextStream(tokenizer, [])
    streamed = "".join(stream.push([t]).text for t in ids) + stream.finish()  # type: ignore[list-item]
    assert streamed.startswith("é") and set(streamed[1:]) == {"\ufffd"}


def test_a_multibyte_character_written_as_two_tokens_streams_whole_and_the_stream_equals_the_decode(
    served, reference, tokenizer, checkpoint
) -> None:
    prompt = json.loads((checkpoint / "split_prompt.json").read_text())
    ids = reference(prompt, max_tokens=SPLIT_TOKENS, stop_token_ids=())
    text = tokenizer.decode(ids)
    assert SPLIT_CHAR in text
    chunks = served.openai().completions.create(
        model=served.gateway.model_name,
        prompt=prompt,
        max_tokens=SPLIT_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    pieces = [(c.choices[0].text, extra(c.choices[0], "token_ids")) for c in chunks]
    assert "".join(p for p, _ in pieces) == text
    assert [t for _, ts in pieces for t in ts or []] == ids  # type: ignore[attr-defined]
    assert any(SPLIT_CHAR in p for p, _ in pieces) and not any(p.endswith("\ufffd") for p, _ in pieces)


# ---- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, status, says",
    [
        ({"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
        ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
        ({"prompt": "hi", "stream": "yes"}, 400, "stream"),
        ({"prompt": "hi", "n": 17}, 400, "n"),
        ({"prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty"),
        ({"prompt": "hi", "bogus_field": 1}, 400, "bogus_field"),
        ({"prompt": ["a"] * 65}, 400, "prompt"),
        ({"prompt": [1, 2, 128]}, 400, "token id 128 is outside the vocabulary [0, 128)"),
        ({"prompt": [1, -2]}, 400, "prompt"),
        ({"prompt": [], "max_tokens": 1}, 400, "empty"),
        ({"prompt": [5] * CONTEXT}, 400, f"the prompt has {CONTEXT} tokens; the context length is {CONTEXT}"),
        ({"prompt": [5] * 10, "max_tokens": CONTEXT}, 400, "max_tokens"),
        ({"prompt": "hi", "model": "gpt-4"}, 404, "gpt-4"),
        ({"prompt": "hi", "user": "someone", "logprobs": None, "frequency_penalty": 0}, 200, ""),
    ],
)
def test_bad_requests_get_openai_shaped_errors_naming_the_field(served, body, status, says) -> None:
    response = served.post("/v1/completions", {"model": served.gateway.model_name, "max_tokens": 2, **body})
    assert response.status_code == status, response.text
    if status != 200:
        error = response.json()["error"]
        assert says in error["message"] and set(error) == {"message", "type", "param", "code"}


def test_malformed_and_oversized_bodies_are_refused_and_the_gateway_keeps_serving(served) -> None:
    url = served.url + "/v1/completions"
    assert httpx.post(url, content=b"{not json", timeout=10).status_code == 400
    assert httpx.post(url, content=b"[1, 2]", timeout=10).status_code == 400
    assert httpx.post(url, content=b"[" * 100_000 + b"]" * 100_000, timeout=10).status_code in (400, 413)
    huge = {"model": served.gateway.model_name, "prompt": "x" * (5 << 20)}
    response = served.post("/v1/completions", huge)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    assert httpx.get(served.url + "/v1/nowhere", timeout=10).json()["error"]["type"] == "not_found_error"
    assert served.post(
        "/v1/completions", {"model": served.gateway.model_name, "prompt": "ok", "max_tokens": 2}
    ).is_success


def test_a_wrong_method_on_a_route_is_a_405_typed_as_a_client_error(served) -> None:
    """Issue 30, item 9: a 405 was typed server_error, which clients read as the server's fault."""
    response = httpx.get(served.url + "/v1/completions", timeout=10)
    error = response.json()["error"]
    assert response.status_code == 405 and error["type"] == "invalid_request_error", response.text
    assert "GET /v1/completions" in error["message"] and set(error) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
])  # fmt: skip
def test_stop_token_ids_outside_the_vocabulary_get_a_400_naming_the_entry_and_the_limit(served, path, body) -> None:
    """Issue 30, item 9: an id the model cannot generate was accepted and could never stop anything."""
    request = {"model": served.gateway.model_name, "max_tokens": 2, "stop_token_ids": [1, 2, 99999], **body}
    response = served.post(path, request)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "stop_token_ids[2]", response.text
    assert "stop_token_ids[2]=99999 is outside the vocabulary [0, 128)" in error["message"]
    assert served.post(path, {**request, "stop_token_ids": [1, 127]}).status_code == 200


@pytest.mark.parametrize("max_tokens", [{"max_tokens": None}, {}])
def test_completions_without_max_tokens_generate_openais_default_of_16_and_chat_fills_the_context(
    served, max_tokens
) -> None:
    """Issue 30, item 9: `max_tokens: null` on /v1/completions once generated up to the whole context."""
    model, prompt = served.gateway.model_name, [5] * 10
    common = {"model": model, "temperature": 0, "ignore_eos": True, **max_tokens}
    completion = served.post("/v1/completions", {**common, "prompt": prompt})
    assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 16, completion.text
    chat = served.post("/v1/chat/completions", {**common, "messages": [{"role": "user", "content": "hi"}]})
    usage = chat.json()["usage"]
    assert chat.status_code == 200 and usage["prompt_tokens"] + usage["completion_tokens"] == CONTEXT, chat.text


def test_the_gateway_serves_its_openapi_schema_with_both_generating_routes_and_their_request_bodies(served) -> None:
    """Issue 30, item 9: no /openapi.json, so schemathesis and client generators had nothing to read."""
    response = httpx.get(served.url + "/openapi.json", timeout=10)
    assert response.status_code == 200, response.text
    schema = response.json()
    assert {"/v1/completions", "/v1/chat/completions"} <= set(schema["paths"])
    body = schema["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    completion = schema["components"]["schemas"][body["$ref"].rsplit("/", 1)[1]]
    assert {"prompt", "max_tokens"} <= set(completion["properties"]) and "prompt" in completion["required"]
    chat = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert "messages" in schema["components"]["schemas"][chat["$ref"].rsplit("/", 1)[1]]["properties"]


SURROGATE_BODIES = [
    ("/v1/completions", {"prompt": "hi \ud800 there"}, "prompt"),
    ("/v1/completions", {"prompt": ["\udfff"]}, "prompt[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud83d"}]}, "messages[0].content"),
    ("/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "text", "text": "ok"}, {"type": "text", "text": "\ud800"}]}]},
     "messages[0].content[1].text"),
    ("/v1/completions", {"prompt": "hi", "stop": ["\udc00"]}, "stop[0]"),
]  # fmt: skip


def test_a_lone_surrogate_anywhere_in_a_request_gets_a_400_naming_the_field_on_a_connection_that_stays_healthy(
    served,
) -> None:
    """Issue 30, item 2: "\\ud800" parses into a string that is not text; it once reached the
    tokenizer (500 internal error: TypeError) and the next request on the connection was reset."""
    model = served.gateway.model_name
    good = {"model": model, "prompt": "hi", "max_tokens": 2}
    streams = set()
    with httpx.Client(base_url=served.url, timeout=30) as client:
        for path, body, param in SURROGATE_BODIES:
            # json.dumps writes each lone surrogate as its \\uXXXX escape, as a hostile client would
            response = client.post(path, content=json.dumps({"model": model, "max_tokens": 2, **body}),
                                   headers={"Content-Type": "application/json"})  # fmt: skip
            error = response.json()["error"]
            assert response.status_code == 400 and error["param"] == param, response.text
            assert "lone UTF-16 surrogate" in error["message"] and error["type"] == "invalid_request_error"
            after = client.post("/v1/completions", json=good)
            assert after.status_code == 200, after.text
            streams |= {id(response.extensions["network_stream"]), id(after.extensions["network_stream"])}
    assert len(streams) == 1  # one keep-alive connection served every request


# ---- auth, readiness, admission, disconnects, metrics ------------------------------------------


def test_api_keys_guard_the_api_but_not_health_and_metrics_can_be_keyed_too(fleet, monkeypatch) -> None:
    model = fleet.plan.model.served_name
    body = {"model": model, "prompt": "hi", "max_tokens": 2}
    with Served(GatewayConfig.of(fleet.plan, api_keys=frozenset({"sk-one", "sk-two"}))) as served:
        wait_until(lambda: served.gateway.ready, 10, "ready")
        assert served.post("/v1/completions", body).status_code == 401
        wrong = served.post("/v1/completions", body, headers={"Authorization": "Bearer sk-three"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        assert wrong.headers["WWW-Authenticate"] == 'Bearer realm="modelfleet"'  # issue 30, item 5
        assert served.post("/v1/completions", body, headers={"Authorization": "Bearer sk-two"}).status_code == 200
        with pytest.raises(openai.AuthenticationError):
            served.openai("sk-nope").models.list()
        assert [m.id for m in served.openai("sk-one").models.list()] == [model]
        for path in ("/healthz", "/readyz", "/metrics"):
            assert httpx.get(served.url + path, timeout=5).status_code == 200
    with Served(GatewayConfig.of(fleet.plan, api_keys=frozenset({"k"}), metrics_auth=True)) as served:
        assert httpx.get(served.url + "/metrics", timeout=5).status_code == 401
        assert httpx.get(served.url + "/metrics", headers={"Authorization": "Bearer k"}, timeout=5).status_code == 200


def post_while_stopped(served: Served, stage: subprocess.Popen[Any], paused: Callable[[], bool],
                       body: dict[str, Any]) -> httpx.Response:  # fmt: skip
    """POST ``body`` to /v1/completions while ``stage`` is SIGSTOPped: once ``paused()`` says the
    gateway sees its pipeline healing, the request must wait in the admission line; the stage is
    continued and the answer returned."""
    answers: list[httpx.Response] = []
    stage.send_signal(signal.SIGSTOP)
    try:
        wait_until(paused, 20, "the gateway sees the pipeline paused")
        asking = threading.Thread(target=lambda: answers.append(served.post("/v1/completions", body)))
        asking.start()
        wait_until(lambda: len(served.gateway.admission.waiting) == 1, 10, "the request waits in line")
    finally:
        stage.send_signal(signal.SIGCONT)
    asking.join(60)
    assert answers, "no answer"
    return answers[0]


def plan_with_head_at(plan: FleetPlan, port: int) -> FleetPlan:
    stage = plan.groups[0].stages[0].model_copy(update={"address": f"127.0.0.1:{port}"})
    group = plan.groups[0].model_copy(update={"stages": (stage, *plan.groups[0].stages[1:])})
    return plan.model_copy(update={"groups": (group,)})


def test_a_request_arriving_while_the_only_pipeline_heals_waits_for_it_and_gets_the_engines_tokens(
    fleet, served, reference
) -> None:
    """Issue 34: a stopped stage pauses the pipeline (the head stays alive and says so); a request
    arriving then waits in line for the heal instead of a 503, and completes once the stage is back."""
    stage = fleet.local.children[1].process
    gateway = served.gateway
    prompt = [5, 17, 42, 99, 3]
    body = {"model": gateway.model_name, "prompt": prompt, "max_tokens": 6, "temperature": 0, "return_token_ids": True}

    def paused() -> bool:
        if not (gateway.heads[0].paused and gateway.heads[0].healing):
            return False
        assert not gateway.ready and httpx.get(served.url + "/readyz", timeout=5).status_code == 503
        return True

    answer = post_while_stopped(served, stage, paused, body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["token_ids"] == reference(prompt, max_tokens=6)
    wait_until(lambda: gateway.ready, 20, "the head is ready again")


def test_a_gateway_whose_fleet_is_not_ready_answers_503_but_stays_alive(fleet) -> None:
    with Served(GatewayConfig.of(plan_with_head_at(fleet.plan, free_base_port(1)))) as served:
        response = served.post("/v1/completions", {"model": fleet.plan.model.served_name, "prompt": "hi"})
        assert response.status_code == 503 and response.headers["Retry-After"]
        assert httpx.get(served.url + "/readyz", timeout=5).status_code == 503
        assert httpx.get(served.url + "/healthz", timeout=5).status_code == 200


def test_a_bug_while_serving_a_request_is_a_500_and_the_keep_alive_connection_serves_the_next(fleet) -> None:
    """A handler's bug once went to Starlette's last-resort handler, which answers and re-raises,
    so the server closed the connection under the client (issue 30, item 2: the next request on
    it was reset). Bugs are answered inside the app now."""
    model = fleet.plan.model.served_name
    with Served(GatewayConfig.of(plan_with_head_at(fleet.plan, free_base_port(1)))) as served:

        def bug(prompt: object) -> list[int]:
            raise TypeError("a bug")

        served.gateway.prompts.completion = bug  # type: ignore[method-assign]
        streams = set()
        with httpx.Client(base_url=served.url, timeout=30) as client:
            for _ in range(3):
                failed = client.post("/v1/completions", json={"model": model, "prompt": "hi"})
                assert failed.status_code == 500 and failed.json()["error"]["message"] == "internal error: TypeError"
                after = client.get("/v1/models")
                assert after.status_code == 200
                streams |= {id(failed.extensions["network_stream"]), id(after.extensions["network_stream"])}
        assert len(streams) == 1


class BlockingTokenizer:
    """A tokenizer whose encode waits until the test lets it go: a prompt that takes long to tokenize."""

    def __init__(self, real: TextTokenizer):
        self.real, self.entered, self.release = real, threading.Event(), threading.Event()

    def encode(self, text: str) -> list[int]:
        self.entered.set()
        assert self.release.wait(60), "the test never let the tokenizer go"
        return self.real.encode(text[:16])

    def __getattr__(self, name: str) -> object:
        return getattr(self.real, name)


def test_a_prompt_being_tokenized_stalls_neither_healthz_nor_other_requests(fleet) -> None:
    """Issue 30, item 3: a 3.9 MiB prompt was tokenized in the event loop for 6-11 s, and /healthz
    waited as long. Tokenizing runs in a thread pool now: while one prompt's tokenizer is held,
    the gateway answers /healthz and another request (the head is absent, so: 503)."""
    model = fleet.plan.model.served_name
    with Served(GatewayConfig.of(plan_with_head_at(fleet.plan, free_base_port(1)))) as served:
        slow = BlockingTokenizer(served.gateway.prompts.tokenizer)
        served.gateway.prompts.tokenizer = slow  # type: ignore[assignment]
        answers: list[httpx.Response] = []
        waiting = threading.Thread(target=lambda: answers.append(served.post("/v1/completions", {"model": model,
                                   "prompt": "a long prompt", "max_tokens": 2})))  # fmt: skip
        waiting.start()
        try:
            assert slow.entered.wait(30), "the request never reached the tokenizer"
            assert httpx.get(served.url + "/healthz", timeout=10).status_code == 200
            assert served.post("/v1/completions", {"model": model, "prompt": [1, 2, 3]}).status_code == 503
            assert waiting.is_alive()  # still tokenizing: the answers above came while it was
        finally:
            slow.release.set()
            waiting.join(30)
        assert [a.status_code for a in answers] == [503]


class SilentHead:
    """A head that reports ready and takes requests but never answers: streams stay busy for as
    long as a test needs. It records the request ids it was asked to submit and cancel; a
    subclass answers a submission in ``on_submit``."""

    def __init__(self) -> None:
        self.port = free_base_port(1)
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.bind(f"tcp://127.0.0.1:{self.port + 2}")
        self.submitted: list[int] = []
        self.cancelled: list[int] = []
        self.stop = threading.Event()
        self.ready = True
        head = self

        class Status(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                body = json.dumps({"ready": head.ready}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                return

        self.http = ThreadingHTTPServer(("127.0.0.1", self.port + 1), Status)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while not self.stop.is_set():
            if self.socket.poll(50):
                client, *parts = self.socket.recv_multipart()
                msg = wire.decode(parts)
                if isinstance(msg, wire.SubmitMsg):
                    self.submitted.append(msg.request_id)
                    self.on_submit(client, msg)
                elif isinstance(msg, wire.CancelMsg):
                    self.cancelled.append(msg.request_id)

    def on_submit(self, client: bytes, msg: wire.SubmitMsg) -> None:
        return

    def send(self, client: bytes, msg: wire.OutputMsg) -> None:
        self.socket.send_multipart([client, *wire.encode(msg)])

    def close(self) -> None:
        self.stop.set()
        self.reader.join(5)
        self.http.shutdown()
        self.http.server_close()
        self.socket.close(linger=0)
        self.context.term()


def test_full_streams_and_queue_get_429_with_retry_after_and_waiting_clients_that_leave_are_let_go(fleet) -> None:
    head = SilentHead()
    config = GatewayConfig.of(plan_with_head_at(fleet.plan, head.port), max_streams=1, max_queue=1,
                              queue_timeout_seconds=1.0)  # fmt: skip
    short = {"model": fleet.plan.model.served_name, "prompt": "hi", "max_tokens": 2}

    async def until(condition, what: str, timeout: float = 1.0) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
            await asyncio.sleep(0.02)

    async def scenario(served: Served) -> None:
        admission = served.gateway.admission
        async with httpx.AsyncClient(base_url=served.url, timeout=30) as client:
            holder = asyncio.create_task(client.post("/v1/completions", json={**short, "stream": True}))
            await until(lambda: len(head.submitted) == 1, "the head got the first request")
            leaver = asyncio.create_task(client.post("/v1/completions", json=short))
            await until(lambda: len(admission.waiting) == 1, "the second request waits")
            leaver.cancel()  # its client goes away while it waits: its place in line is freed
            await until(lambda: not admission.waiting, "the departed waiter leaves the queue", 0.6)
            queued = asyncio.create_task(client.post("/v1/completions", json=short))
            await until(lambda: len(admission.waiting) == 1, "a third request waits")
            refused = await client.post("/v1/completions", json=short)
            assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
            assert refused.json()["error"]["type"] == "rate_limit_error"
            timed_out = await queued
            assert timed_out.status_code == 429 and "queue_timeout_seconds" in timed_out.json()["error"]["message"]
            assert head.submitted == head.submitted[:1] and not head.cancelled
            holder.cancel()  # the streaming client goes away before its first token
            await until(lambda: head.cancelled == head.submitted, "the head is told to cancel")
            await until(lambda: admission.active == 0, "the stream is free")

    try:
        with Served(config) as served:
            wait_until(lambda: served.gateway.ready, 10, "ready")
            asyncio.run(scenario(served))
    finally:
        head.close()


def test_a_client_that_leaves_mid_stream_frees_its_slot_on_every_stage_within_a_second(served, fleet) -> None:
    body = {"model": served.gateway.model_name, "prompt": [4, 5, 6], "max_tokens": CONTEXT - 8, "ignore_eos": True,
            "stream": True}  # fmt: skip

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=served.url, timeout=30) as client:
            holder, _lines = await _stream_first_chunk(client, body)
            assert fleet.slots_in_use() == [1] * STAGES
            await holder.aclose()
            left_at = time.monotonic()
            while fleet.slots_in_use() != [0] * STAGES:
                assert time.monotonic() - left_at < 1.0, "the slots were not freed within 1 s"
                await asyncio.sleep(0.02)
            assert served.gateway.admission.active == 0

    asyncio.run(scenario())


async def _stream_first_chunk(client: httpx.AsyncClient, body: dict) -> tuple[httpx.Response, AsyncIterator[str]]:
    """The open response and its lines, after the first data line (keep both: dropping the
    iterator would close the stream)."""
    response = await client.send(client.build_request("POST", "/v1/completions", json=body), stream=True)
    assert response.status_code == 200
    lines = response.aiter_lines()
    async for line in lines:
        if line.startswith("data: {"):
            break
    return response, lines


def test_a_client_that_gives_up_on_a_non_streaming_request_frees_its_slot_on_every_stage(served, fleet) -> None:
    body = {"model": served.gateway.model_name, "prompt": [7, 8, 9], "max_tokens": CONTEXT - 8, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(served.url + "/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.5))
    gave_up_at = time.monotonic()
    wait_until(lambda: fleet.slots_in_use() == [0] * STAGES, 1.0, "the slots are free")
    assert time.monotonic() - gave_up_at < 1.0 and served.gateway.admission.active == 0


def test_metrics_carry_the_gateway_series(served) -> None:
    served.post("/v1/completions", {"model": served.gateway.model_name, "prompt": "hi", "max_tokens": 3})
    text = httpx.get(served.url + "/metrics", timeout=5).text
    for name in ("modelfleet_gateway_requests_total{", "modelfleet_gateway_time_to_first_token_seconds_bucket",
                 "modelfleet_gateway_inter_token_latency_seconds_bucket", "modelfleet_gateway_e2e_request_seconds_count",
                 "modelfleet_gateway_prompt_tokens_total", "modelfleet_gateway_generation_tokens_total",
                 "modelfleet_gateway_queue_depth", "modelfleet_gateway_active_streams", "modelfleet_gateway_ready 1.0"):  # fmt: skip
        assert name in text, name
    assert 'endpoint="/v1/completions",status="200"' in text


# ---- failures and retries --------------------------------------------------------------------

BROKEN_CHAIN = "a pipeline stage stopped answering for over 3 s"


class FailingHead(SilentHead):
    """A stand-in head whose chain breaks under every request: it sends ``tokens``, then fails
    the request as a real head does when a stage stops answering."""

    def __init__(self, tokens: tuple[int, ...] = ()) -> None:
        self.tokens = tokens
        super().__init__()

    def on_submit(self, client: bytes, msg: wire.SubmitMsg) -> None:
        for token in self.tokens:
            self.send(client, wire.OutputMsg(request_id=msg.request_id, token_ids=(token,)))
        self.send(client, wire.OutputMsg(request_id=msg.request_id, finish_reason="error", code="stage_lost",
                                          error=BROKEN_CHAIN))  # fmt: skip


class VanishingHead(SilentHead):
    """A stand-in head that takes a request, then stops reporting ready and never answers."""

    def on_submit(self, client: bytes, msg: wire.SubmitMsg) -> None:
        self.ready = False


def retries(served: Served) -> dict[str, float]:
    """modelfleet_gateway_retries_total by reason."""
    text = httpx.get(served.url + "/metrics", timeout=5).text
    prefix = 'modelfleet_gateway_retries_total{reason="'
    return {line[len(prefix) :].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith(prefix)}  # fmt: skip


@contextlib.contextmanager
def gateway_before_fleet(fleet: TestFleet, *stand_ins: SilentHead, **overrides: object) -> Iterator[Served]:
    """A gateway whose heads are the stand-ins, then the fleet's real head: the stand-ins come
    first, so ties of load send a request to a stand-in first."""
    plans = [plan_with_head_at(fleet.plan, head.port) for head in stand_ins]
    config = GatewayConfig.of(plans[0], more_plans=(*plans[1:], fleet.plan), **overrides)
    with Served(config) as served:
        wait_until(lambda: all(h.ready for h in served.gateway.heads), 10, "the gateway sees every head ready")
        yield served


def test_a_request_its_head_fails_before_any_token_is_retried_on_another_head_with_the_same_tokens(
    served, fleet, reference, tokenizer
) -> None:
    failing = FailingHead()
    prompt = [5, 17, 42, 99, 3]
    expected = reference(prompt, max_tokens=8)
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    seeded = {"prompt": prompt, "max_tokens": 8, "temperature": 1.0, "seed": 1234, "return_token_ids": True}
    try:
        with gateway_before_fleet(fleet, failing) as retrying:
            model = retrying.gateway.model_name
            result = retrying.post("/v1/completions", {"model": model, **body})
            assert result.status_code == 200, result.text
            choice = result.json()["choices"][0]
            assert choice["token_ids"] == expected and choice["text"] == tokenizer.decode(expected)
            assert result.json()["usage"]["completion_tokens"] == len(expected)  # the successful try's
            stream = retrying.openai().completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                                          stream=True)  # fmt: skip
            assert "".join(c.choices[0].text for c in stream) == tokenizer.decode(expected)
            sampled = retrying.post("/v1/completions", {"model": model, **seeded}).json()["choices"][0]
            assert len(failing.submitted) == 3 and retries(retrying) == {"stream_failed": 3.0}
            assert retrying.gateway.admission.active_by_head == [0, 0]
        direct = served.post("/v1/completions", {"model": model, **seeded}).json()["choices"][0]
        assert sampled["token_ids"] == direct["token_ids"]  # the seed gives the retry the same tokens
        wait_until(lambda: fleet.slots_in_use() == [0] * STAGES, 1.0, "the fleet's slots are free")
    finally:
        failing.close()


def by_reason(served: Served, metric: str) -> dict[str, float]:
    text = httpx.get(served.url + "/metrics", timeout=5).text
    prefix = metric + '{reason="'
    return {line[len(prefix) :].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith(prefix)}  # fmt: skip


def sse_events(response: httpx.Response) -> list[str]:
    return [line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")]


def test_a_streamed_request_that_fails_after_its_first_token_continues_on_another_head_from_where_it_was(
    fleet, reference, tokenizer
) -> None:
    """Issue 34: the gateway resubmits prompt + the tokens already sent as a continuation to
    another ready head; the client sees one stream with the tokens an undisturbed run gives."""
    token = tokenizer.token_id("x")
    assert token is not None
    failing = FailingHead(tokens=(token,))
    prompt = [5, 17, 42, 99, 3]
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    try:
        with gateway_before_fleet(fleet, failing) as retrying:
            model = retrying.gateway.model_name
            response = retrying.post("/v1/completions", {"model": model, **body, "stream": True})
            events = sse_events(response)
            chunks = [json.loads(e) for e in events[:-1]]
            assert events[-1] == "[DONE]" and all("error" not in c for c in chunks)
            streamed = [t for c in chunks for t in c["choices"][0].get("token_ids") or []]
            assert streamed == [token, *reference([*prompt, token], max_tokens=7)]
            assert len(failing.submitted) == 1 and retries(retrying) == {}
            assert by_reason(retrying, "modelfleet_gateway_failovers_total") == {"stream_failed": 1.0}
            # not streamed, nothing of it was sent when it failed: the same failure is retried
            result = retrying.post("/v1/completions", {"model": model, **body})
            assert result.status_code == 200 and result.json()["choices"][0]["token_ids"] == reference(
                prompt, max_tokens=8
            )
            assert len(failing.submitted) == 2 and retries(retrying) == {"stream_failed": 1.0}
        with Served(GatewayConfig.of(plan_with_head_at(fleet.plan, failing.port))) as alone:  # no other head
            wait_until(lambda: alone.gateway.ready, 10, "ready")
            events = sse_events(alone.post("/v1/completions", {"model": model, **body, "stream": True}))
            first, error = json.loads(events[0]), json.loads(events[1])
            assert first["choices"][0]["token_ids"] == [token] and BROKEN_CHAIN in error["error"]["message"]
            assert events[2:] == ["[DONE]"]
    finally:
        failing.close()


def test_a_seeded_sampled_stream_with_penalties_continued_on_another_head_gives_the_undisturbed_runs_tokens(
    fleet, reference
) -> None:
    """Issue 34: the continuation carries the stream's position: the other head counts the tokens
    sent as the stream's output, so its sampler skips their draws and its penalties count them."""
    sampling = {"temperature": 1.0, "seed": 1234, "frequency_penalty": 1.5, "presence_penalty": 0.5}
    prompt = [5, 17, 42, 99, 3]
    undisturbed = reference(prompt, max_tokens=16, stop_token_ids=(), **sampling)
    failing = FailingHead(tokens=tuple(undisturbed[:5]))
    try:
        with gateway_before_fleet(fleet, failing) as retrying:
            body = {"model": retrying.gateway.model_name, "prompt": prompt, "max_tokens": 16, "ignore_eos": True,
                    "return_token_ids": True, "stream": True, **sampling}  # fmt: skip
            chunks = [json.loads(e) for e in sse_events(retrying.post("/v1/completions", body))[:-1]]
            assert all("error" not in c for c in chunks), chunks[-1]
            assert [t for c in chunks for t in c["choices"][0].get("token_ids") or []] == undisturbed
            assert by_reason(retrying, "modelfleet_gateway_failovers_total") == {"stream_failed": 1.0}
    finally:
        failing.close()


def test_a_stream_failing_over_while_the_other_pipeline_heals_waits_for_it_and_goes_on(fleet, reference) -> None:
    """Issue 34: the only other head is healing (a stopped stage paused its pipeline), so the
    continuation waits in line for it rather than ending the stream, and goes on once it heals."""
    prompt = [5, 17, 42, 99, 3]
    undisturbed = reference(prompt, max_tokens=10, stop_token_ids=())
    failing = FailingHead(tokens=tuple(undisturbed[:3]))
    stage = fleet.local.children[1].process
    try:
        with gateway_before_fleet(fleet, failing) as served:
            gateway = served.gateway
            body = {"model": gateway.model_name, "prompt": prompt, "max_tokens": 10, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True, "stream": True}  # fmt: skip
            answer = post_while_stopped(
                served, stage, lambda: gateway.heads[1].healing and gateway.heads[1].paused, body
            )
            chunks = [json.loads(e) for e in sse_events(answer)[:-1]]
            assert all("error" not in c for c in chunks), chunks[-1]
            assert [t for c in chunks for t in c["choices"][0].get("token_ids") or []] == undisturbed
            assert by_reason(served, "modelfleet_gateway_failovers_total") == {"stream_failed": 1.0}
            wait_until(lambda: gateway.heads[1].ready, 20, "the head is ready again")
    finally:
        failing.close()


def test_a_stream_whose_head_dies_after_its_last_token_but_before_its_finish_ends_at_its_length(
    fleet, reference
) -> None:
    """Nothing is left to continue: the stream ends with its tokens and finish_reason length."""
    prompt = [5, 17, 42, 99, 3]
    undisturbed = reference(prompt, max_tokens=4, stop_token_ids=())
    failing = FailingHead(tokens=tuple(undisturbed))
    try:
        with gateway_before_fleet(fleet, failing) as served:
            body = {"model": served.gateway.model_name, "prompt": prompt, "max_tokens": 4, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True, "stream": True}  # fmt: skip
            chunks = [json.loads(e) for e in sse_events(served.post("/v1/completions", body))[:-1]]
            assert all("error" not in c for c in chunks), chunks[-1]
            assert [t for c in chunks for t in c["choices"][0].get("token_ids") or []] == undisturbed
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    finally:
        failing.close()


def test_without_another_ready_head_the_request_gets_the_heads_error_and_retries_are_bounded(fleet) -> None:
    heads = [FailingHead(), FailingHead()]
    body = {"model": fleet.plan.model.served_name, "prompt": [5, 17, 42], "max_tokens": 4}
    try:
        with Served(GatewayConfig.of(plan_with_head_at(fleet.plan, heads[0].port))) as alone:
            wait_until(lambda: alone.gateway.ready, 10, "ready")
            response = alone.post("/v1/completions", body)
            assert response.status_code == 503 and BROKEN_CHAIN in response.json()["error"]["message"]
            assert len(heads[0].submitted) == 1 and retries(alone) == {}
        with gateway_before_fleet(fleet, *heads) as retrying:  # one retry (the default): two failing heads
            response = retrying.post("/v1/completions", body)
            assert response.status_code == 503 and BROKEN_CHAIN in response.json()["error"]["message"]
            assert [len(h.submitted) for h in heads] == [2, 1] and retries(retrying) == {"stream_failed": 1.0}
        with gateway_before_fleet(fleet, *heads, retries=2) as retrying:
            assert retrying.post("/v1/completions", body).status_code == 200
            assert [len(h.submitted) for h in heads] == [3, 2] and retries(retrying) == {"stream_failed": 2.0}
    finally:
        for head in heads:
            head.close()


def test_a_request_whose_head_falls_silent_is_retried_on_another_head(fleet, reference, monkeypatch) -> None:
    monkeypatch.setattr(gateway_module, "HEAD_SILENCE_SECONDS", 0.5)
    vanishing = VanishingHead()
    prompt = [5, 17, 42, 99, 3]
    try:
        with gateway_before_fleet(fleet, vanishing, ready_poll_seconds=0.1) as retrying:
            body = {"model": retrying.gateway.model_name, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                    "return_token_ids": True, "stream": True}  # fmt: skip
            response = retrying.post("/v1/completions", body)
            chunks = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
            assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == reference(prompt, max_tokens=8)
            assert retries(retrying) == {"head_silent": 1.0}
            wait_until(lambda: vanishing.cancelled == vanishing.submitted, 1.0, "the silent head is told to cancel")
    finally:
        vanishing.close()


# ---- several heads: pipeline groups (replicas) behind one gateway ------------------------------


class ReplicatedFleet:
    """A plan of two groups of two stages (4 streams each); every stage its own process (``agent --group G``)."""

    def __init__(self, model_dir: Path, workdir: Path, groups: int = 2):
        self.plan = make_plan(model_dir, STAGES, groups=groups, max_streams=8, context_length=CONTEXT,
                              window_rows=8, base_port=free_base_port(STAGES * groups))  # fmt: skip
        self.plan_path = workdir / "plan.json"
        self.plan_path.write_text(self.plan.to_json())
        self.log = (workdir / "fleet.log").open("w")
        self.local = LocalFleet(self.plan, self.plan_path, out=self.log)
        self.children: dict[tuple[int, int], subprocess.Popen[str]] = {}

    def start(self) -> None:
        env = {**os.environ, "PYTHONSAFEPATH": "1", "OMP_NUM_THREADS": "1"}
        for group in self.plan.groups:
            for s in group.stages:
                command = self.local.stage_command(s.stage_index, group.group_index)
                child = self.local.spawn(f"group {group.group_index} stage {s.stage_index}", command, env)
                self.children[group.group_index, s.stage_index] = child.process
        wait_until(self.ready, 120, "every group's head reports ready")

    def ready(self) -> bool:
        for (g, s), process in self.children.items():
            assert process.poll() is None, f"group {g} stage {s} exited; see {self.log.name}"
        return all(self.head_status(g).get("ready") for g in range(len(self.plan.groups)))

    def head_status(self, group: int) -> dict:
        head = self.plan.groups[group].stages[0]
        return fetch_json(f"http://{head.host}:{head.port + 1}/status") or {}

    def frames(self, group: int) -> float:
        """Frames the group's head has computed (its counter only grows)."""
        head = self.plan.groups[group].stages[0]
        text = httpx.get(f"http://{head.host}:{head.port + 1}/metrics", timeout=5).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("modelfleet_stage_frames_total{"))  # fmt: skip

    def stop(self) -> None:
        self.local.stop()
        self.log.close()


def _complete_concurrently(served: Served, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    async def one(client: httpx.AsyncClient, prompt: list[int]) -> list[int]:
        body = {"model": served.gateway.model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "return_token_ids": True}  # fmt: skip
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["token_ids"]

    async def every() -> list[list[int]]:
        async with httpx.AsyncClient(base_url=served.url, timeout=60) as client:
            return list(await asyncio.gather(*(one(client, p) for p in prompts)))

    return asyncio.run(every())


def test_requests_spread_over_every_groups_head_and_the_other_group_serves_when_one_fails(
    checkpoint, reference, tmp_path, monkeypatch
) -> None:
    """Requests already on group 1 when its tail dies wait there (its head pauses for the lost
    stage) until they are moved to group 0, ready; later ones go to group 0 alone."""
    monkeypatch.setattr(gateway_module, "FAILOVER_SECONDS", 1.0)
    fleet = ReplicatedFleet(checkpoint, tmp_path)
    prompts = [[3 + i, 17, 42 + i, 99 - i] for i in range(8)]
    expected = [reference(p, max_tokens=6) for p in prompts]
    try:
        fleet.start()
        with Served(GatewayConfig.of(fleet.plan)) as served:
            gateway = served.gateway
            wait_until(lambda: all(h.ready for h in gateway.heads), 10, "the gateway sees both heads ready")
            assert [h.address for h in gateway.heads] == [g.stages[0].address for g in fleet.plan.groups]
            before = [fleet.frames(g) for g in (0, 1)]
            assert _complete_concurrently(served, prompts, 6) == expected
            after = [fleet.frames(g) for g in (0, 1)]
            assert after[0] > before[0] and after[1] > before[1], (before, after)
            assert gateway.admission.active_by_head == [0, 0]

            fleet.children[1, 1].kill()  # group 1 loses its tail: its head turns unready after 3 s
            fleet.children[1, 1].wait()
            assert all(h.ready for h in gateway.heads)  # so some of these go to group 1 and wait there
            assert _complete_concurrently(served, prompts[4:], 6) == expected[4:]
            retried = retries(served)  # about half: each went to the then least loaded head
            assert set(retried) <= {"head_paused", "head_refused"} and 1 <= sum(retried.values()) <= 4, retried
            wait_until(lambda: not gateway.heads[1].ready, 10, "the gateway sees group 1's head unready")
            assert httpx.get(served.url + "/readyz", timeout=5).status_code == 200
            assert "modelfleet_gateway_heads_ready 1.0" in httpx.get(served.url + "/metrics", timeout=5).text
            alone = [fleet.frames(0), fleet.frames(1)]
            assert _complete_concurrently(served, prompts[:4], 6) == expected[:4]
            assert fleet.frames(0) > alone[0] and fleet.frames(1) == alone[1]
            wait_until(lambda: fleet.head_status(0).get("slots_in_use") == 0, 1.0, "group 0's slots are free")
    finally:
        fleet.stop()


def _stream_concurrently(served: Served, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Streamed requests at once; each one's token ids as its chunks carried them (an error chunk fails)."""

    async def one(client: httpx.AsyncClient, prompt: list[int]) -> list[int]:
        body = {"model": served.gateway.model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "return_token_ids": True, "stream": True}  # fmt: skip
        response = await client.post("/v1/completions", json=body)
        chunks = [json.loads(e) for e in sse_events(response)[:-1]]
        assert all("error" not in c for c in chunks), chunks[-1]
        return [t for c in chunks for t in c["choices"][0].get("token_ids") or []]

    async def every() -> list[list[int]]:
        async with httpx.AsyncClient(base_url=served.url, timeout=120) as client:
            return list(await asyncio.gather(*(one(client, p) for p in prompts)))

    return asyncio.run(every())


def generated_tokens(served: Served) -> float:
    text = httpx.get(served.url + "/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("modelfleet_gateway_generation_tokens_total "))  # fmt: skip


def test_streams_whose_head_dies_mid_stream_continue_on_the_other_group_with_the_engines_tokens(
    checkpoint, reference, tmp_path
) -> None:
    """Issue 34: the head's scheduler state is gone with it; the gateway's continuation (prompt +
    tokens sent) on the other group's head is the recovery, and the client sees one stream."""
    fleet = ReplicatedFleet(checkpoint, tmp_path)
    prompts = [[3 + i, 17, 42 + i, 99 - i] for i in range(6)]
    expected = [reference(p, max_tokens=40) for p in prompts]
    try:
        fleet.start()
        with Served(GatewayConfig.of(fleet.plan)) as served:
            gateway = served.gateway
            wait_until(lambda: all(h.ready for h in gateway.heads), 10, "the gateway sees both heads ready")
            results: list[list[list[int]]] = []
            streams = threading.Thread(target=lambda: results.append(_stream_concurrently(served, prompts, 40)))
            streams.start()
            streaming = lambda: (fleet.head_status(0).get("head") or {}).get("streams_active", 0) >= 2  # noqa: E731
            wait_until(lambda: streaming() and generated_tokens(served) >= 12, 30, "streams under way")
            fleet.children[0, 0].kill()
            streams.join(120)
            assert results == [expected]
            failovers = by_reason(served, "modelfleet_gateway_failovers_total")
            assert set(failovers) == {"head_silent"} and failovers["head_silent"] >= 1, failovers
    finally:
        fleet.stop()


def test_admission_goes_to_the_least_loaded_ready_head_and_queues_when_all_are_full() -> None:
    ready = [True, True, False]
    admission = Admission([2, 4, 8], max_queue=1, queue_timeout_seconds=5.0, ready=lambda h: ready[h])

    async def scenario() -> None:
        heads = [await admission.acquire() for _ in range(6)]
        assert heads == [0, 1, 1, 0, 1, 1]  # by active/limit: 0/2, 0/4, 1/4, 1/2, 2/4, 3/4; head 2 is not ready
        waiter = asyncio.create_task(admission.acquire())
        await asyncio.sleep(0)
        assert len(admission.waiting) == 1
        with pytest.raises(Busy):
            await admission.acquire()
        ready[2] = True  # a head turning ready takes the queue within CHECK_SECONDS
        assert await asyncio.wait_for(waiter, 1.0) == 2
        admission.release(0)
        assert await admission.acquire() == 2  # 1/8 free beats 1/2 free
        assert admission.active_by_head == [1, 4, 2]

    asyncio.run(scenario())


def test_a_retried_request_avoids_the_heads_that_failed_it_and_its_wait_counts_from_its_arrival() -> None:
    admission = Admission([1, 1], max_queue=2, queue_timeout_seconds=5.0)

    async def scenario() -> None:
        assert await admission.acquire(avoid=frozenset({0})) == 1
        assert await admission.acquire() == 0
        retry = asyncio.create_task(admission.acquire(avoid=frozenset({1})))
        later = asyncio.create_task(admission.acquire())
        await asyncio.sleep(0)
        assert len(admission.waiting) == 2
        admission.release(1)  # the oldest waiter may not take head 1, so the next one does
        assert await asyncio.wait_for(later, 1.0) == 1 and not retry.done()
        admission.release(0)
        assert await asyncio.wait_for(retry, 1.0) == 0
        with pytest.raises(Busy, match="waited over 5 s"):  # every stream busy, and its time already spent
            await asyncio.wait_for(admission.acquire(waited_seconds=5.0), 0.5)
        assert admission.active_by_head == [1, 1] and not admission.waiting

    asyncio.run(scenario())


def test_a_request_finding_every_head_healing_waits_past_the_queue_timeout_up_to_the_replay_deadline() -> None:
    """Issue 34: while the only pipelines replay (their heads alive, paused), a request waits for
    one rather than failing at the queue timeout; the replay deadline bounds the wait (503)."""
    ready, healing = [False, False], [True, False]
    admission = Admission([1, 1], max_queue=4, queue_timeout_seconds=0.3, ready=lambda h: ready[h],
                          healing=lambda h: healing[h], heal_timeout_seconds=1.0)  # fmt: skip

    async def scenario() -> None:
        waiter = asyncio.create_task(admission.acquire())
        await asyncio.sleep(0.6)  # past the queue timeout: still waiting, head 0 heals
        assert not waiter.done()
        ready[0] = True
        assert await asyncio.wait_for(waiter, 1.0) == 0
        healing[1] = True  # a request that may not take head 0 waits for head 1 to heal, until its deadline
        with pytest.raises(Busy, match="no pipeline healed within 1 s") as healed_not:
            await asyncio.wait_for(admission.acquire(avoid=frozenset({0}), waited_seconds=0.5), 2.0)
        assert healed_not.value.status == 503
        ready[1] = True  # head 1 ready but busy, head 0 busy too: the queue timeout, 429
        admission.active_by_head[1] = 1
        with pytest.raises(Busy, match="waited over 0.3 s") as busy:
            await asyncio.wait_for(admission.acquire(), 2.0)
        assert busy.value.status == 429

    asyncio.run(scenario())


def test_a_heads_status_deadlines_are_measured_from_its_answers() -> None:
    """Issue 34: a head whose /status answers come late (a starved machine) is healing, not gone,
    for 3x its longest recent gap between answers (5-30 s); its polls wait 4x its slowest answer."""
    link = HeadLink("127.0.0.1:1", poll_seconds=0.5)
    assert link.gone and not link.healing  # never answered
    for t in range(5):
        link._answered({"ready": True}, t * 4.0 - 1.5, t * 4.0)  # every 4 s, each taking 1.5 s
    assert link.ready and link.silence_deadline() == 12.0 and link.poll_timeout() == 6.0
    link._answered(None, 16.0, 22.0)
    assert not link.ready and link.unanswered == 1 and not link.answering
    link.answered_at = time.monotonic() - 11.0
    assert link.healing and not link.gone
    link.answered_at = time.monotonic() - 13.0
    assert link.gone and not link.healing
    link._answered({"ready": False, "head": {"paused": True, "replay_timeout_seconds": 60}}, 0.0, time.monotonic())
    assert link.paused and link.healing and link.replay_timeout_seconds == 60.0 and link.answer_gaps[-1] == 4.0


def test_plans_behind_one_gateway_must_serve_one_model_and_not_share_a_head(fleet) -> None:
    other = fleet.plan.model_copy(update={"model": fleet.plan.model.model_copy(update={"served_name": "other"})})
    with pytest.raises(PlanError, match="plan 2 serves 'other'"):
        GatewayConfig.of(fleet.plan, more_plans=(other,)).heads()
    with pytest.raises(PlanError, match="appears in more than one"):
        GatewayConfig.of(fleet.plan, more_plans=(fleet.plan,)).heads()
    moved = plan_with_head_at(fleet.plan, free_base_port(1))
    heads = GatewayConfig.of(fleet.plan, more_plans=(moved,), max_streams=3).heads()
    assert heads == [(fleet.plan.groups[0].stages[0].address, 3), (moved.groups[0].stages[0].address, 3)]


# ---- hostile requests (property-based) ---------------------------------------------------------

KNOWN_FIELDS = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)


def _junk() -> st.SearchStrategy[object]:
    """JSON values of every shape, nested a few levels."""
    leaves = st.one_of(st.text(max_size=12), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
                       st.booleans(), st.none())  # fmt: skip
    return st.recursive(leaves, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6),
                        inner, max_size=3), max_leaves=8)  # fmt: skip


def _not_an_int() -> st.SearchStrategy[object]:
    return _junk().filter(lambda v: type(v) is not int and v is not None)


def _not_a_number() -> st.SearchStrategy[object]:
    return _junk().filter(lambda v: type(v) not in (int, float) and v is not None)


def _bad_float(lo: float, hi: float) -> st.SearchStrategy[object]:
    outside = st.floats(max_value=lo - 1e-9) | st.floats(min_value=hi, exclude_min=True)  # never -0.0
    return outside | st.sampled_from([float("nan"), float("inf"), -float("inf")]) | _not_a_number()


def _bad_int(lo: int, hi: int) -> st.SearchStrategy[object]:
    return st.integers(max_value=lo - 1) | st.integers(min_value=hi + 1) | _not_an_int()


VOCAB = 128
TOKENS = st.lists(st.integers(0, VOCAB - 1), max_size=4)
BAD_ID = st.integers(VOCAB, 2**40) | st.integers(max_value=-1)
BAD_PROMPTS = st.one_of(
    st.just(""), st.just([]), st.just([[]]), st.lists(st.text(max_size=3), min_size=65, max_size=66),
    st.lists(TOKENS, min_size=65, max_size=66), st.builds(lambda a, b, c: [*a, b, *c], TOKENS, BAD_ID, TOKENS),
    st.integers(CONTEXT, CONTEXT + 64).map(lambda n: [5] * n), st.just("the rain " * CONTEXT),
    _junk().filter(lambda v: not isinstance(v, str | list)),
)  # fmt: skip
BAD_MESSAGES = st.one_of(
    st.just([]), st.text(max_size=8), st.lists(st.integers(), min_size=1, max_size=3),
    st.just([{"role": "robot", "content": "hi"}]), st.just([{"content": "hi"}]),
    _not_a_number().map(lambda v: [{"role": "user", "content": v}]).filter(
        lambda m: not isinstance(m[0]["content"], str | list)),
    st.just([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]),
    st.just([{"role": "user", "content": "hi", "extra": 1}]), st.just([{"role": "user", "content": "hi"}] * 4097),
)  # fmt: skip
# each (field, value) makes any request invalid, whichever endpoint it goes to
MUTATIONS = st.one_of(
    st.tuples(st.just("max_tokens"), st.integers(max_value=0) | st.integers(min_value=CONTEXT) | _not_an_int()),
    st.tuples(st.just("max_completion_tokens"), st.integers(max_value=0) | _not_an_int()),
    st.tuples(st.just("temperature"), _bad_float(0.0, 100.0)),
    st.tuples(st.just("top_p"), _bad_float(0.0, 1.0)),
    st.tuples(st.just("min_p"), _bad_float(0.0, 1.0)),
    st.tuples(st.just("top_k"), _bad_int(-1, 2**31 - 1)),
    st.tuples(st.just("seed"), _bad_int(0, 2**64 - 1)),
    st.tuples(st.just("n"), _bad_int(1, 16)),
    st.tuples(st.sampled_from(["stream", "ignore_eos", "return_token_ids"]),
              _junk().filter(lambda v: type(v) is not bool and v is not None)),
    st.tuples(st.just("stop"), st.one_of(st.just(""), st.just("x" * 257), st.lists(st.just("s"), min_size=17),
                                         st.lists(st.integers(), min_size=1, max_size=3))),
    # ids outside the vocabulary are harmless as stop ids (never generated); the wire's bounds are not
    st.tuples(st.just("stop_token_ids"), st.lists(st.integers(2**31) | st.integers(max_value=-1), min_size=1,
                                                  max_size=2) | st.just([1] * 129) | _not_a_number().filter(lambda v: not isinstance(v, list))),
    st.tuples(st.just("stream_options"), st.just({"include_usage": True}) | st.just({"bogus": 1})),
    st.tuples(st.sampled_from(["logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "best_of"]),
              st.sampled_from([21, -3, 2.5, "5", [1]])),
    st.tuples(st.sampled_from(["tools", "logit_bias", "echo", "min_tokens"]),
              st.sampled_from([[{"type": "function"}], {"x": 1}, {"1": 101}, "yes", -1])),
    st.tuples(st.just("model"), st.text(max_size=20) | _not_an_int().filter(lambda v: not isinstance(v, str))),
    st.tuples(st.text(min_size=1, max_size=20).filter(lambda k: k not in KNOWN_FIELDS), _junk()),
    st.tuples(st.just("prompt"), BAD_PROMPTS),
    st.tuples(st.just("messages"), BAD_MESSAGES),
)  # fmt: skip


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(endpoint=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
       mutations=st.lists(MUTATIONS, min_size=1, max_size=3), replace=st.integers(0, 9),
       not_an_object=_junk().filter(lambda v: not isinstance(v, dict)))  # fmt: skip
def test_hostile_requests_get_openai_shaped_4xx_and_never_5xx(  # type: ignore[no-untyped-def]
    hostile_client, endpoint, mutations, replace, not_an_object
) -> None:
    served, client = hostile_client
    model = served.gateway.model_name
    body: object = {"model": model, "max_tokens": 2, "prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}
    body = {k: v for k, v in body.items() if k != ("messages" if endpoint == "/v1/completions" else "prompt")}
    for name, value in mutations:
        if name == "model" and value == model:
            value = model + "-not"
        body[name] = value
    if replace == 0:
        body = not_an_object  # one body in ten is JSON but not an object
    response = client.post(endpoint, content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert 400 <= response.status_code < 500, (body, response.status_code, response.text[:300])
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str), error


@pytest.fixture(scope="module")
def hostile_client(served) -> Iterator[tuple[Served, httpx.Client]]:  # type: ignore[no-untyped-def]
    with httpx.Client(base_url=served.url, timeout=30) as client:
        yield served, client


def test_after_hostile_requests_the_gateway_serves_correctly_and_no_slot_leaked(served, fleet, reference) -> None:
    # runs after the property test above (tests run in file order)
    prompt = [5, 17, 42, 99, 3]
    body = {"model": served.gateway.model_name, "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "return_token_ids": True}  # fmt: skip
    response = served.post("/v1/completions", body)
    assert response.status_code == 200 and response.json()["choices"][0]["token_ids"] == reference(prompt, max_tokens=8)
    wait_until(lambda: fleet.slots_in_use() == [0] * STAGES, 1.0, "every stage's slots are free")
    assert served.gateway.admission.active == 0 and not served.gateway.admission.waiting


# ---- commands ---------------------------------------------------------------------------------


def _modelfleet(*args: str) -> list[str]:
    return [sys.executable, "-P", "-m", "modelfleet.cli", *args]


@contextlib.contextmanager
def up_serving(*args: str) -> Iterator[list[str]]:
    """`modelfleet up ARGS` until it prints its request to try (the lines it printed so far);
    stopped with SIGTERM on exit, as Ctrl-C would."""
    env = {**os.environ, "PYTHONSAFEPATH": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    up = subprocess.Popen(_modelfleet("up", *args), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)  # fmt: skip
    try:
        assert up.stdout is not None
        lines = []
        for line in up.stdout:
            lines.append(line)
            if line.startswith("try: curl"):
                break
        assert lines and lines[-1].startswith("try: curl"), "".join(lines)
        yield lines
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(30)


def test_up_starts_the_fleet_and_the_gateway_and_prints_a_request_that_works(checkpoint, tmp_path) -> None:
    port, base = free_port(), free_base_port(1)
    args = ["--model", str(checkpoint), "--stages", "1", "--port", str(port), "--base-port", str(base),
            "--context-length", "64", "--ready-timeout", "60"]  # fmt: skip
    with up_serving(*args) as lines:
        body = json.loads(lines[-1].split(" -d ", 1)[1].strip().strip("'"))
        response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30)
        # the printed request samples (temperature 1): a first token of EOS is a valid, empty answer
        assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] in ("stop", "length")
        # issue 30, item 6: the wire is CURVE by default; a local process without the run's keys gets nothing
        keys_dir = next(line for line in lines if "wire is CURVE" in line).split("keys in ", 1)[1].split(" ")[0]
        params = SamplingParams(max_tokens=2, stop_token_ids=())
        with FleetClient(f"127.0.0.1:{base}", keys=wire.load_keypair(keys_dir, "fleet")) as keyed:
            assert keyed.generate([1, 2, 3], params).finish_reason == "length"
        with (
            FleetClient(f"127.0.0.1:{base}", timeout_seconds=3) as stranger,
            pytest.raises(FleetError, match="no answer"),
        ):
            stranger.generate([1, 2, 3], params)


def test_the_gateway_command_names_a_missing_plan_and_up_a_busy_gateway_port(checkpoint, tmp_path) -> None:
    from typer.testing import CliRunner

    from modelfleet.cli import app

    result = CliRunner().invoke(app, ["gateway", "--plan", str(tmp_path / "nope.json")])
    assert result.exit_code == 2 and "nope.json" in result.output
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        args = ["up", "--model", str(checkpoint), "--port", str(port), "--base-port", str(free_base_port(2))]
        result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and f"port {port} is in use" in result.output
