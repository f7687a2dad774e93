"""The gateway's streamed chunks built from per-stream byte templates are, byte for byte, the
json.dumps of the chunk dicts they replace (tricky text included), parse as OpenAI chunks, and a
request's inbox hands over its outputs in order, several arrived together going out as one, and a
streamed client that leaves is noticed even while its head sends nothing."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_gateway import Served, SilentHead, plan_with_head_at
from test_pipeline import wait_until

from modelfleet.agent import transport as wire
from modelfleet.agent.gateway import Gateway, GatewayConfig, Job, Text
from modelfleet.agent.headlink import Inbox
from modelfleet.agent.openai_schema import ChatCompletionRequest, CompletionRequest
from modelfleet.agent.sse import IDS_MARK, TEXT_MARK, TokenChunks, data_frame
from modelfleet.commands.fleet import make_plan
from modelfleet.engine.sampling import SamplingParams

TRICKY = [
    " the", 'say "hi"', "back\\slash\\", "\\u0041 is not A", "tab\tnew\nline\rcr", "\x00\x01\x1f\x7f",
    "\u2028\u2029", "é€中", "🙂 non-BMP 𝄞", "</script>", "'single'", "\"\\\"", "a\ufffdb", "\ud7ff\ue000",
]  # fmt: skip


def make_job(chat: bool, with_ids: bool, include_usage: bool) -> Job:
    body: dict[str, Any] = {"model": "m", "stream": True, "return_token_ids": with_ids}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    if chat:
        request: Any = ChatCompletionRequest.model_validate({**body, "messages": [{"role": "user", "content": "x"}]})
    else:
        request = CompletionRequest.model_validate({**body, "prompt": "x"})
    return Job(request, [5, 6, 7], SamplingParams(max_tokens=8), "m", 0.0, chat)


def chunk_maker() -> Gateway:
    """A Gateway without heads or a model: only its chunk builders (which use no state) are called."""
    return object.__new__(Gateway)


SHAPES = [(chat, ids, usage) for chat in (False, True) for ids in (False, True) for usage in (False, True)]


@pytest.mark.parametrize("chat,with_ids,include_usage", SHAPES)
@pytest.mark.parametrize("text", TRICKY)
def test_a_templated_token_chunk_equals_json_dumps_of_the_same_chunk(chat, with_ids, include_usage, text) -> None:
    gateway, job = chunk_maker(), make_job(chat, with_ids, include_usage)
    ids = [3, 141, 59265]
    expected = gateway._chunk(job, Text(text, ids), first=False)
    assert expected is not None
    assert gateway._token_chunks(job).frame(text, ids) == data_frame(expected)


@settings(max_examples=300, deadline=None)
@given(text=st.text(), ids=st.lists(st.integers(0, 2**31 - 1), max_size=6), chat=st.booleans())
def test_any_text_and_ids_template_to_the_bytes_json_dumps_gives(text: str, ids: list[int], chat: bool) -> None:
    gateway, job = chunk_maker(), make_job(chat, with_ids=True, include_usage=False)
    expected = gateway._chunk(job, Text(text, ids), first=False)
    if expected is None:  # nothing to say: the stream sends no chunk (and makes no frame)
        assert not text and not ids
        return
    frame = gateway._token_chunks(job).frame(text, ids)
    assert frame == data_frame(expected)
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    choice = json.loads(frame[len(b"data: ") :])["choices"][0]
    assert (choice["delta"]["content"] if chat else choice["text"]) == text
    assert choice["token_ids"] == ids


def test_a_template_needs_each_marker_exactly_once() -> None:
    with pytest.raises(ValueError, match="exactly once"):
        TokenChunks.of({"text": "no marker"})
    with pytest.raises(ValueError, match="exactly once"):
        TokenChunks.of({"a": TEXT_MARK, "b": TEXT_MARK})
    plain = TokenChunks.of({"text": TEXT_MARK})
    assert plain.after_ids is None and plain.frame('"', [1]) == data_frame({"text": '"'})
    both = TokenChunks.of({"text": TEXT_MARK, "token_ids": IDS_MARK})
    assert both.frame("x", []) == data_frame({"text": "x", "token_ids": []})


def output(request_id: int, *token_ids: int, finish: str | None = None) -> wire.OutputMsg:
    return wire.OutputMsg(request_id=request_id, token_ids=token_ids, finish_reason=finish)


def test_an_inbox_returns_at_once_when_outputs_wait_and_hands_them_over_in_order() -> None:
    async def scenario() -> tuple[bool, list[tuple[int, ...]]]:
        inbox = Inbox()
        for k in range(3):
            inbox.put(output(1, 10 + k))
        woken_empty = await inbox.wait()
        return woken_empty, [inbox.items.popleft().token_ids for _ in range(len(inbox.items))]

    assert asyncio.run(scenario()) == (False, [(10,), (11,), (12,)])


def test_an_inbox_wait_ends_on_an_output_or_a_wake_and_says_which() -> None:
    async def scenario() -> tuple[bool, bool, bool]:
        inbox = Inbox()
        loop = asyncio.get_running_loop()
        loop.call_soon(inbox.wake)
        woken_by_wake = await inbox.wait()
        loop.call_soon(inbox.put, output(1, 5))
        woken_by_output = await inbox.wait()
        inbox.wake()  # with no reader waiting, a wake is a no-op (not remembered)
        return woken_by_wake, woken_by_output, inbox.waiter is None

    assert asyncio.run(scenario()) == (True, False, True)


def test_outputs_that_arrived_together_go_out_as_one_chunk_with_the_same_text() -> None:
    """The reader takes every output waiting (up to a finish) and the stream's text and ids are
    those of the outputs one by one."""

    class FakeHead:
        address = "h:1"
        ready = True  # its pipeline is whole (a paused one is waited for: agent.head's replay)

        @staticmethod
        def silent_for() -> float:
            return 0.0

    class Client:
        @staticmethod
        async def is_disconnected() -> bool:
            return False

    async def scenario() -> tuple[list[int], str | None, list[int]]:
        gateway, job, inbox = chunk_maker(), make_job(False, True, False), Inbox()
        for token in (1, 2, 3):
            inbox.put(output(9, token))
        inbox.put(output(9, 4, finish="length"))
        inbox.put(output(9, 5))  # after the finish: not merged into it
        merged = await gateway._next(Client(), job, inbox, FakeHead())  # type: ignore[arg-type]
        return merged.token_ids, merged.finish_reason, [t for m in inbox.items for t in m.token_ids]

    assert asyncio.run(scenario()) == ([1, 2, 3, 4], "length", [5])


DEMO_MODEL = Path(__file__).resolve().parents[1] / "models" / "demo"


class OneTokenHead(SilentHead):
    """A stand-in head that answers each submission with one token, then sends nothing more."""

    def on_submit(self, client: bytes, msg: wire.SubmitMsg) -> None:
        self.send(client, wire.OutputMsg(request_id=msg.request_id, token_ids=(300,)))


def test_a_streamed_client_that_leaves_while_its_head_sends_nothing_is_cancelled_at_the_head() -> None:
    """No write fails and no token comes after the client goes: the gateway still notices and
    cancels the request at the head, and frees its stream."""
    head = OneTokenHead()
    plan = plan_with_head_at(make_plan(DEMO_MODEL, 1, max_streams=2, context_length=64), head.port)
    body = {"model": plan.model.served_name, "prompt": [10, 11], "max_tokens": 32, "stream": True}

    async def scenario(served: Served) -> None:
        async with httpx.AsyncClient(base_url=served.url, timeout=30) as client:
            request = client.build_request("POST", "/v1/completions", json=body)
            response = await client.send(request, stream=True)
            lines = response.aiter_lines()
            assert (await anext(lines)).startswith("data: {")
            await response.aclose()
            left_at = time.monotonic()
            while head.cancelled != head.submitted or served.gateway.admission.active:
                assert time.monotonic() - left_at < 2.0, "the head was not told to cancel within 2 s"
                await asyncio.sleep(0.02)

    try:
        with Served(GatewayConfig.of(plan)) as served:
            wait_until(lambda: served.gateway.ready, 10, "ready")
            asyncio.run(scenario(served))
    finally:
        head.close()
    assert len(head.submitted) == 1
