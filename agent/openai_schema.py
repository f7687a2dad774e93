"""OpenAI-compatible request bodies, checked strictly at the gateway's edge.

Every field is type- and range-checked (strict: ``"5"`` is not 5, ``true`` is not 1) and unknown
fields are refused, so a typo never silently changes a request. Fields that ask for something
this server does not do yet (``suffix``, the legacy ``functions``, ...) are accepted only with
values that mean "off"; any other value is refused with a message saying so. Structured output
(``response_format``, chat ``tools`` and ``tool_choice``) is typed here and served by
:mod:`.structured`.
vLLM's extensions (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``return_token_ids``, ``chat_template_kwargs``, ``continue_final_message``)
are accepted as vLLM defines them. docs/gateway.md lists every field with its status.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

SEED_MAX = (1 << 64) - 1
TOKEN_ID_MAX = (1 << 31) - 1
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 128  # with the EOS ids, within the wire's 256
COMPLETION_MAX_TOKENS_DEFAULT = 16  # OpenAI's for /v1/completions; chat's default is the context's room
MAX_MESSAGES = 4096
MAX_CHOICES = 16  # n and best_of
MAX_PROMPTS = 64  # prompts in one /v1/completions request
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit (the engine's SamplingParams checks the same)

Float = Annotated[float, Field(strict=True, allow_inf_nan=False)]
TokenId = Annotated[StrictInt, Field(ge=0, le=TOKEN_ID_MAX)]
StopString = Annotated[StrictStr, Field(min_length=1, max_length=MAX_STOP_CHARS)]

# Fields clients send that ask for something this server does not do: each accepted only with the
# values listed (all meaning "off"), refused otherwise with a message naming the field.
_OFF_VALUES: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
}
# Fields with no effect on generation: accepted and ignored.
_IGNORED = ("user", "metadata", "store", "service_tier")
MAX_TOOLS = 128
Name = Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]  # OpenAI's rule for function and schema names
Schema = Annotated[dict[StrictStr, Any], Field(max_length=1024)]  # a JSON schema: xgrammar checks it
Penalty = Annotated[Float, Field(ge=-2.0, le=2.0)]
Bias = Annotated[Float, Field(ge=-100.0, le=100.0)]


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Name
    description: StrictStr | None = None
    schema_: Schema | None = Field(None, alias="schema")  # None: any JSON (OpenAI allows leaving it out)
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    """``{"type": "text"}`` (the default), ``{"type": "json_object"}``, or
    ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('response_format.json_schema is given exactly when response_format.type is "json_schema"')
        return self


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Name
    description: StrictStr | None = None
    parameters: Schema | None = None  # None: any arguments
    strict: StrictBool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Name


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionName


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Name
    arguments: StrictStr  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    """A tool call of an earlier assistant message, sent back with the conversation."""

    model_config = ConfigDict(extra="forbid")
    id: Annotated[StrictStr, Field(max_length=256)]
    type: Literal["function"]
    function: FunctionCall


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class _Request(BaseModel):
    """Sampling fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="forbid")

    model: Annotated[StrictStr, Field(min_length=1, max_length=256)] | None = None  # None: the one model served
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[Float, Field(ge=0.0, le=100.0)] = 1.0
    top_p: Annotated[Float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[StrictInt, Field(ge=-1, le=TOKEN_ID_MAX)] = 0  # vLLM: -1 and 0 both mean "no limit"
    min_p: Annotated[Float, Field(ge=0.0, le=1.0)] = 0.0
    seed: Annotated[StrictInt, Field(ge=0, le=SEED_MAX)] | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    ignore_eos: StrictBool = False
    n: Annotated[StrictInt, Field(ge=1, le=MAX_CHOICES)] = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    return_token_ids: StrictBool = False
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[Float, Field(gt=0.0, le=100.0)] | None = None
    min_tokens: Annotated[StrictInt, Field(ge=0)] = 0
    # token id (as a string, OpenAI's JSON) -> bias added to its logit
    logit_bias: Annotated[dict[Annotated[str, Field(pattern=r"^[0-9]{1,10}$")], Bias], Field(max_length=300)] | None = (
        None
    )
    response_format: ResponseFormat | None = None  # json_object, json_schema: constrained by a grammar
    # accepted only when "off" (see _OFF_VALUES) or ignored (see _IGNORED)
    suffix: Any = None
    functions: Any = None
    function_call: Any = None
    user: Any = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> _Request:
        for name, allowed in _OFF_VALUES.items():
            value = getattr(self, name, None)
            if not any(value == off and type(value) is type(off) for off in allowed) and value is not None:
                shown = ", ".join("null" if v is None else repr(v) for v in allowed)
                raise ValueError(
                    f"{name}={value!r} is not supported by this server; leave it out or use one of: {shown}"
                )
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.ignore_eos and self.response_format is not None and self.response_format.type != "text":
            raise ValueError("ignore_eos cannot be combined with a JSON response_format: the output ends where "
                             "its grammar does")  # fmt: skip
        return self

    @property
    def logit_bias_pairs(self) -> list[tuple[int, float]]:
        return [(int(token), bias) for token, bias in (self.logit_bias or {}).items()]

    @property
    def top_logprobs_asked(self) -> int | None:
        """Alternatives to report per token, or None when no log-probabilities were asked."""
        return None

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Request):
    # a string, a list of token ids, or a batch: a list of strings or of token-id lists
    prompt: (
        StrictStr
        | list[TokenId]
        | Annotated[list[StrictStr], Field(min_length=1, max_length=MAX_PROMPTS)]
        | Annotated[list[list[TokenId]], Field(min_length=1, max_length=MAX_PROMPTS)]
    )
    max_tokens: Annotated[StrictInt, Field(ge=0)] | None = COMPLETION_MAX_TOKENS_DEFAULT  # 0: score the prompt only
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: StrictBool = False
    best_of: Annotated[StrictInt, Field(ge=1, le=MAX_CHOICES)] | None = None

    @field_validator("max_tokens")
    @classmethod
    def _null_is_the_default(cls, value: int | None) -> int:
        return COMPLETION_MAX_TOKENS_DEFAULT if value is None else value  # null means "not given", as OpenAI reads it

    @model_validator(mode="after")
    def _choices(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens=0 generates nothing; it is allowed only with echo: true (to score the prompt)")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of={self.best_of} must be at least n={self.n}")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise ValueError("best_of greater than n cannot be streamed (the best are known only at the end)")
        if self.n * len(self.prompt_values) > MAX_PROMPTS:
            raise ValueError(f"n={self.n} times {len(self.prompt_values)} prompts is over the limit of {MAX_PROMPTS} "
                             "streams per request; send fewer prompts or a smaller n")  # fmt: skip
        return self

    @property
    def prompt_values(self) -> list[str | list[int]]:
        """Each prompt of the request: one, or the batch's."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            return list(prompt)  # type: ignore[arg-type]
        return [prompt]  # type: ignore[list-item]

    @property
    def top_logprobs_asked(self) -> int | None:
        return self.logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: Annotated[StrictStr, Field(max_length=256)] | None = None
    tool_call_id: StrictStr | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOLS)] | None = None  # an assistant's earlier calls
    # what a message returned by OpenAI's API carries, sent back as it came (null or empty: nothing to render)
    refusal: StrictStr | None = None
    annotations: Annotated[list[Any], Field(max_length=0)] | None = None
    audio: None = None
    function_call: None = None

    @model_validator(mode="after")
    def _tool_calls_of_the_assistant(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls are allowed only in messages from the assistant")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Request):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False  # vLLM: render the last (assistant) message open, to be continued
    chat_template_kwargs: Annotated[dict[StrictStr, Any], Field(max_length=64)] | None = (
        None  # extra template variables
    )
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: auto with tools
    parallel_tool_calls: StrictBool = True

    @model_validator(mode="after")
    def _one_max(self) -> ChatCompletionRequest:
        both = self.max_tokens is not None and self.max_completion_tokens is not None
        if both and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens and max_completion_tokens disagree; give one of them")
        self.max_tokens = self.max_tokens or self.max_completion_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.continue_final_message and (self.add_generation_prompt or self.messages[-1].role != "assistant"):
            raise ValueError("continue_final_message needs add_generation_prompt: false and a last message "
                             "from the assistant")  # fmt: skip
        self._check_tools()
        return self

    def _check_tools(self) -> None:
        names = [tool.function.name for tool in self.tools or []]
        if len(set(names)) < len(names):
            raise ValueError("tools: each function needs a name of its own")
        choice = self.tool_choice
        if (choice == "required" or isinstance(choice, NamedToolChoice)) and not names:
            raise ValueError("tool_choice: required or a named function needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names the function {choice.function.name!r}, which is not among the tools "
                             f"({', '.join(names)})")  # fmt: skip
        json_format = self.response_format is not None and self.response_format.type != "text"
        if json_format and self.calls_tools:
            raise ValueError("response_format cannot be combined with tools unless tool_choice is \"none\": "
                             "the output is either the given JSON or tool calls")  # fmt: skip
        if self.calls_tools and self.ignore_eos:
            raise ValueError("ignore_eos cannot be combined with tools: the output ends where its grammar does")

    @property
    def calls_tools(self) -> bool:
        """Tools are given and tool_choice lets the model call them."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize body: a ``prompt``, or chat ``messages`` rendered with the model's template."""

    model_config = ConfigDict(extra="forbid")
    model: Annotated[StrictStr, Field(min_length=1, max_length=256)] | None = None
    prompt: StrictStr | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    add_generation_prompt: StrictBool = True
    add_special_tokens: StrictBool = True  # the tokenizer's own rules decide; accepted for vLLM's clients
    return_token_strs: StrictBool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt or messages: give exactly one of them")
        return self


class DetokenizeRequest(BaseModel):
    """vLLM's /detokenize body."""

    model_config = ConfigDict(extra="forbid")
    model: Annotated[StrictStr, Field(min_length=1, max_length=256)] | None = None
    tokens: Annotated[list[TokenId], Field(max_length=1 << 20)]


# Fields that accept several shapes: one message for any mismatch, rather than one per shape.
_SHAPES = {
    "prompt": f"prompt must be a string, a list of token ids in [0, 2**31), or a list of up to {MAX_PROMPTS} of either",
    "stop": f"stop must be a string or a list of at most {MAX_STOP_STRINGS} strings, each of 1 to {MAX_STOP_CHARS} "
    "characters",
    "content": 'content must be a string, null, or a list of {"type": "text", "text": ...} parts '
    "(this server reads text only)",
}


def lone_surrogate(data: object) -> str | None:
    """The path (``messages[0].content[1].text``, as :func:`describe` names fields) of the first
    string or key in parsed JSON that holds a lone UTF-16 surrogate, or None. JSON's ``\\ud800``
    escape (or its raw bytes) parses into a Python string that is not text: it cannot be encoded,
    so the tokenizer, a log line or a response that echoed it would fail."""
    stack: list[tuple[str, object]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not value.isascii() and not _encodes(value):
                return path.lstrip(".") or "body"
        elif isinstance(value, dict):
            for key in value:
                if not _encodes(key):
                    return f"{path}.{ascii(key)}".lstrip(".")
            stack += [(f"{path}.{key}", item) for key, item in reversed(value.items())]
        elif isinstance(value, list):
            stack += [
                (f"{path}[{i}]", item)
                for i, item in reversed(list(enumerate(value)))
                if isinstance(item, str | dict | list)
            ]
    return None


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def describe(exc: ValidationError) -> tuple[str, str | None]:
    """The first error as (a message naming the field and the limit, the field's path)."""
    error = exc.errors()[0]
    raw = error["loc"]
    loc = [p for p in raw if isinstance(p, int) or not _is_shape_tag(p)]
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or None
    message = error["msg"].removeprefix("Value error, ")
    field = next((p for p in reversed(loc) if isinstance(p, str)), None)
    if len(loc) < len(raw) and field in _SHAPES:
        prefix = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc[: loc.index(field) + 1])
        return f"{_SHAPES[field]} (got {_short(error.get('input'))})", prefix.lstrip(".")
    if error["type"] == "extra_forbidden":
        return f"unknown field {param!r}: this server does not support it", param
    if error["type"] == "missing":
        return f"{param} is required", param
    if param is None:  # a check across fields: its message starts with the field's name
        name = re.match(r"[a-z_]+", message)
        return message, name.group(0) if name else None
    return f"{param}: {message} (got {_short(error.get('input'))})", param


def _is_shape_tag(part: str) -> bool:
    """pydantic names a union's alternatives in the location: 'str', 'list[int]', 'constrained-str', ..."""
    return part in ("str", "int", "float", "bool", "list", "dict", "none") or "[" in part or "-" in part


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
