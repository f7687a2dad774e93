"""Structured output at the gateway: ``response_format`` and chat ``tools`` into a grammar spec
(:mod:`..engine.structured`, enforced at the tail), tools into the prompt, and the model's output
back into OpenAI's ``tool_calls``.

Tool calls are written as Qwen's and Hermes' chat formats write them, one block per call::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A checkpoint whose chat template renders ``tools`` itself gets them (and earlier calls and their
results) as transformers passes them; any other template gets :data:`TOOLS_PREAMBLE`, a system
message listing the tools and this format, with earlier calls written as blocks in the
assistant's text and results as ``<tool_response>`` blocks in a user message.

``tool_choice`` ``"auto"`` (the default with tools) lets the model write text or calls; the
grammar constrains a call once one starts. ``"required"`` needs at least one call, a named
function exactly one call of it; ``"none"`` renders the tools but neither constrains nor parses.
A call's arguments follow its function's ``parameters`` schema. The grammars are xgrammar's
structural tags for this format (``get_model_structural_tag("qwen_3", ...)``).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..engine.structured import StructuredOutputError, check_spec, load_xgrammar, spec_text
from .openai_schema import ChatCompletionRequest, ChatMessage, CompletionRequest, NamedToolChoice
from .prompts import PromptError

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
MAX_WHITESPACE = 2  # in a call's arguments: where a weak model wanders, and no parser needs more
TOOLS_PREAMBLE = (
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n'
    "</tool_call>"
)


def grammar_spec(body: CompletionRequest | ChatCompletionRequest) -> str | None:
    """The request's grammar spec (checked: a schema xgrammar cannot read, or no xgrammar here, is
    a PromptError naming the field), or None when its output is free text."""
    spec: dict[str, Any] | None = None
    param = "response_format"
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        spec = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema" and fmt.json_schema is not None:
        schema = fmt.json_schema.schema_
        spec = {
            "type": "json_schema",
            "schema": {} if schema is None else schema,
            "strict": bool(fmt.json_schema.strict),
        }
        param = "response_format.json_schema.schema"
    elif isinstance(body, ChatCompletionRequest) and body.calls_tools:
        param = "tools"
    else:
        return None
    try:
        text = spec_text(spec if spec is not None else _tools_spec(body))  # type: ignore[arg-type]
        check_spec(text)
    except StructuredOutputError as exc:
        raise PromptError(f"{param}: {exc}", param) from None
    return text


def _tools_spec(body: ChatCompletionRequest) -> dict[str, Any]:
    xgr = load_xgrammar()
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []]
    for tool in tools:
        tool["function"].setdefault("parameters", {"type": "object"})
    choice: Any = body.tool_choice or "auto"
    if isinstance(choice, NamedToolChoice):
        choice = choice.model_dump()
    try:
        tag = xgr.get_model_structural_tag("qwen_3", tools=tools, tool_choice=choice, reasoning="disabled",
                                           max_whitespace_cnt=MAX_WHITESPACE,
                                           parallel_tool_calls=body.parallel_tool_calls)  # fmt: skip
    except (ValueError, TypeError, RuntimeError) as exc:
        raise PromptError(f"tools: {exc}", "tools") from None
    return dict(tag.model_dump(mode="json"))


def chat_messages(
    body: ChatCompletionRequest, template_variables: frozenset[str]
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """The messages and extra template variables to render ``body`` with: tools through the
    template when it reads ``tools``, else through :data:`TOOLS_PREAMBLE` and text blocks."""
    extra = dict(body.chat_template_kwargs or {})
    if "tools" in template_variables:
        messages = [_templated(m) for m in body.messages]
        if body.tools:
            extra["tools"] = [tool.model_dump(exclude_none=True) for tool in body.tools]
        return messages, extra or None
    messages = [_plain(m) for m in body.messages]
    if body.tools:
        listed = "\n".join(json.dumps(tool.model_dump(exclude_none=True), ensure_ascii=False) for tool in body.tools)
        preamble = TOOLS_PREAMBLE.format(tools=listed)
        if messages and messages[0]["role"] == "system":
            messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{preamble}"}
        else:
            messages.insert(0, {"role": "system", "content": preamble})
    return messages, extra or None


def _templated(message: ChatMessage) -> dict[str, Any]:
    """A message as transformers' templates read it: a call's arguments as a mapping."""
    out: dict[str, Any] = {**message.model_dump(exclude_none=True), "content": message.text()}
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                          "arguments": _arguments(c.function.arguments)}}
            for c in message.tool_calls
        ]  # fmt: skip
    return out


def _plain(message: ChatMessage) -> dict[str, Any]:
    """A message for a template that knows no tools: calls as blocks, a result as a user's block."""
    text = message.text()
    if message.role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"}
    blocks = [
        f"{CALL_OPEN}\n{json.dumps({'name': c.function.name, 'arguments': _arguments(c.function.arguments)})}\n"
        f"{CALL_CLOSE}"
        for c in message.tool_calls or []
    ]
    content = "\n".join([text, *blocks] if text else blocks)
    return {"role": message.role, "content": content}


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text  # as sent: a template shows it, the model reads it


@dataclass
class ToolCallParser:
    """Splits a stream of text into content and tool calls: :meth:`push` returns the content
    that is surely not part of a call (text that may begin ``<tool_call>`` is held back) and
    the calls completed; a block that does not parse as a call stays content."""

    held: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)

    def push(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self.held += text
        content, done = "", list[dict[str, Any]]()
        while True:
            start = self.held.find(CALL_OPEN)
            if start < 0:
                keep = _partial_suffix(self.held, CALL_OPEN)
                content += self.held[: len(self.held) - keep]
                self.held = self.held[len(self.held) - keep :]
                return content, done
            content += self.held[:start]
            end = self.held.find(CALL_CLOSE, start)
            if end < 0:
                self.held = self.held[start:]
                return content, done
            block = self.held[start : end + len(CALL_CLOSE)]
            self.held = self.held[end + len(CALL_CLOSE) :]
            call = _call(block[len(CALL_OPEN) : -len(CALL_CLOSE)])
            if call is None:
                content += block
            else:
                self.calls.append(call)
                done.append(call)

    def finish(self) -> str:
        """What is still held: an unfinished call (cut by max_tokens) stays text."""
        rest, self.held = self.held, ""
        return rest


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker``."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def _call(body: str) -> dict[str, Any] | None:
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        return None
    arguments = parsed.get("arguments", {})
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": parsed["name"], "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def split_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole output -> (its content, None when only calls were written; its tool calls)."""
    parser = ToolCallParser()
    content, calls = parser.push(text)
    content += parser.finish()
    return (None if calls and not content.strip() else content), calls
