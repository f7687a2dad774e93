"""Structured output through the official openai client (and LangChain) against a live two-stage
fleet of the bundled demo model: ``response_format`` (json_object, json_schema) and chat
``tools``/``tool_choice``. The demo model is tiny and writes Python, not JSON: every output that
parses and validates does so because the tail's grammar mask allowed nothing else."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import jsonschema
import openai
import pytest
from test_gateway import Served, free_port, served_fleet, up_serving
from test_pipeline import Fleet, free_base_port, reference, through_a_killed_stage

from modelfleet.engine.sampling import SamplingParams
from modelfleet.engine.structured import spec_text
from modelfleet.engine.tokenizer import TextTokenizer

pytest.importorskip("xgrammar")

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "language": {"enum": ["python", "rust", "go"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
    },
    "required": ["name", "age", "language", "tags"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]},
    },
}
WORDS = ("sort", "count", "parse", "load", "save", "merge", "split", "join", "read", "write", "send", "find", "zip",
         "map", "fold", "scan", "push", "pop", "peek", "drop")  # fmt: skip
PROMPTS = [f"def task_{i}(items):\n    # {word}\n" for i, word in enumerate(WORDS)]


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Iterator[Served]:  # type: ignore[no-untyped-def]
    with served_fleet(DEMO, tmp_path_factory.mktemp("structured-fleet")) as served:
        yield served


def person_format(strict: bool = True) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": strict}}


def test_json_schema_output_parses_and_validates_for_twenty_prompts(demo: Served) -> None:
    """One request of 20 prompts, sampled at temperature 1: each output is JSON valid against the schema."""
    out = demo.openai().completions.create(
        model=demo.gateway.model_name, prompt=PROMPTS, max_tokens=96, temperature=1.0, seed=7,
        extra_body={"response_format": person_format()},
    )  # fmt: skip
    assert len(out.choices) == 20
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice.text
        jsonschema.validate(json.loads(choice.text), PERSON)
    free = demo.openai().completions.create(model=demo.gateway.model_name, prompt=PROMPTS[:4], max_tokens=24,
                                            temperature=1.0, seed=7)  # fmt: skip
    assert not any(_parses(choice.text) for choice in free.choices)  # without the grammar: Python, not JSON


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def test_json_object_output_is_one_json_object(demo: Served) -> None:
    out = demo.openai().chat.completions.create(
        model=demo.gateway.model_name, messages=[{"role": "user", "content": "def main():"}], max_tokens=160,
        temperature=0.0, response_format={"type": "json_object"},
    )  # fmt: skip
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(json.loads(choice.message.content or ""), dict)


def test_streamed_json_schema_output_validates(demo: Served) -> None:
    stream = demo.openai().chat.completions.create(
        model=demo.gateway.model_name, messages=[{"role": "user", "content": "import os\n"}], max_tokens=96,
        temperature=0.7, seed=3, response_format=person_format(), stream=True,  # type: ignore[arg-type]
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), PERSON)


def test_a_forced_tool_call_round_trip(demo: Served) -> None:
    """A named tool_choice -> tool_calls with arguments valid against the function's parameters;
    the call and its result sent back -> an answer."""
    client = demo.openai()
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(
        model=demo.gateway.model_name, messages=messages, tools=[WEATHER, CLOCK], max_tokens=64, temperature=0.0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},  # type: ignore[list-item]
    )  # fmt: skip
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather" and call.id  # type: ignore[union-attr]
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])  # type: ignore[index,union-attr]
    messages += [
        choice.message.model_dump(),  # as it came back, nulls included
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    answer = client.chat.completions.create(
        model=demo.gateway.model_name, messages=messages, tools=[WEATHER, CLOCK], tool_choice="none", max_tokens=8,
        temperature=0.0,
    )  # fmt: skip
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


def test_required_tool_calls_stream_as_openai_tool_call_deltas(demo: Served) -> None:
    stream = demo.openai().chat.completions.create(
        model=demo.gateway.model_name, messages=[{"role": "user", "content": "Time in Berlin?"}], max_tokens=48,
        tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False, temperature=0.0, stream=True,  # type: ignore[list-item]
    )  # fmt: skip
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        for delta_call in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            entry = calls.setdefault(delta_call.index, {"name": "", "arguments": ""})
            entry["name"] += (delta_call.function.name or "") if delta_call.function else ""
            entry["arguments"] += (delta_call.function.arguments or "") if delta_call.function else ""
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    assert finish == "tool_calls" and len(calls) == 1, calls
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}  # type: ignore[index]
    jsonschema.validate(json.loads(calls[0]["arguments"]), tools[calls[0]["name"]])


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
            "a": {"$ref": "#/$defs/missing"}}}}}]}, "tools"),
    ],
)  # fmt: skip
def test_bad_schemas_and_tool_choices_are_400s_naming_the_field(demo: Served, body: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        demo.openai().chat.completions.create(
            model=demo.gateway.model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            extra_body=body,
        )  # fmt: skip
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == param, error


def test_langchain_with_structured_output_returns_the_pydantic_model(demo: Served) -> None:
    pytest.importorskip("langchain_openai")
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=12)
        age: int = Field(ge=0, le=120)
        language: Literal["python", "rust", "go"]

    llm = ChatOpenAI(model=demo.gateway.model_name, base_url=demo.url + "/v1", api_key="none", temperature=0.0,
                     max_tokens=64, max_retries=0)  # type: ignore[arg-type]  # fmt: skip
    person = llm.with_structured_output(Person).invoke("Describe a programmer.")
    assert isinstance(person, Person)


def test_modelfleet_up_with_one_stage_serves_json_schema_output_from_its_head(tmp_path: Path) -> None:
    """A one-stage fleet's head is its tail: it masks too. Through `modelfleet up`, as a user runs it."""
    port, base = free_port(), free_base_port(1)
    args = ["--model", str(DEMO), "--stages", "1", "--port", str(port), "--base-port", str(base),
            "--context-length", "256", "--ready-timeout", "60"]  # fmt: skip
    with up_serving(*args):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        out = client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "x = 1"}], max_tokens=96, temperature=0.9, seed=1,
            response_format=person_format(),  # type: ignore[arg-type]
        )  # fmt: skip
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content or ""), PERSON)


def test_grammar_streams_replayed_after_their_tail_was_killed_go_on_with_the_engines_tokens(tmp_path: Path) -> None:
    """The head replays each stream (prompt + committed tokens) into the restarted tail, whose
    grammar state is rebuilt from those tokens: greedy and seeded sampled streams end with the
    tokens of an undisturbed single-process run, valid JSON."""
    note = {"type": "object", "properties": {"note": {"type": "string", "minLength": 40, "maxLength": 48}},
            "required": ["note"], "additionalProperties": False}  # fmt: skip
    grammar = spec_text({"type": "json_schema", "schema": note, "strict": True})
    stop = (0,)  # the demo's end of text
    params = [
        SamplingParams(max_tokens=120, stop_token_ids=stop, grammar=grammar),
        SamplingParams(temperature=0.9, top_k=40, seed=5, max_tokens=120, stop_token_ids=stop, grammar=grammar),
    ]
    tokenizer = TextTokenizer(DEMO)
    prompts = [tokenizer.encode("def load(path):\n"), tokenizer.encode("class Cache:\n")]
    expected = reference(DEMO, prompts, params)
    fleet = Fleet(DEMO, tmp_path, stages=2)
    fleet.start()
    try:
        with fleet.client() as client:
            results = through_a_killed_stage(fleet, client, prompts, params)
        assert fleet.metric(0, "modelfleet_head_replayed_tokens_total") > 0
    finally:
        fleet.stop()
    assert [r.token_ids for r in results] == expected, [r.error for r in results]
    for result in results:
        assert result.finish_reason == "stop"
        jsonschema.validate(json.loads(tokenizer.decode(result.token_ids)), note)
