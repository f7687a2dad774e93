"""Prompts for the gateway: text -> token ids, and chat messages through the checkpoint's template.

The chat template is the checkpoint's own (``chat_template`` in tokenizer_config.json, or a
``chat_template.jinja`` file beside it), rendered in Jinja's immutable sandbox: a template cannot
reach Python objects' internals or mutate what it is given.
"""

from __future__ import annotations

import contextlib
import json
from datetime import datetime
from pathlib import Path
from typing import Any

from ..engine.errors import CheckpointError
from ..engine.tokenizer import TextTokenizer


class PromptError(ValueError):
    """The request cannot become a prompt; the message says why (an HTTP 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _token_text(value: object) -> str:
    """tokenizer_config's bos/eos are a string or an AddedToken dict {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content", "")
    return value if isinstance(value, str) else ""


class ChatTemplate:
    def __init__(self, source: str, config: dict[str, Any]):
        from jinja2 import TemplateError, meta
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        # as transformers renders templates: loop controls, raise_exception, strftime_now, plain tojson
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = _tojson
        try:
            self.template = env.from_string(source)
            # the variables it reads (whether it renders tools, say)
            self.variables = frozenset(meta.find_undeclared_variables(env.parse(source)))
        except TemplateError as exc:
            raise CheckpointError(f"the checkpoint's chat template does not parse: {exc}") from exc
        self.specials = {
            "bos_token": _token_text(config.get("bos_token")),
            "eos_token": _token_text(config.get("eos_token")),
        }

    @classmethod
    def of(cls, model_dir: Path, config: dict[str, Any]) -> ChatTemplate | None:
        source: object = config.get("chat_template")
        if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        jinja_file = model_dir / "chat_template.jinja"
        if not isinstance(source, str) and jinja_file.is_file():
            source = jinja_file.read_text()
        return cls(source, config) if isinstance(source, str) and source else None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
               extra: dict[str, Any] | None = None) -> str:  # fmt: skip
        """``extra``: further template variables (vLLM's chat_template_kwargs); they cannot replace
        the messages, the generation prompt flag or the special tokens."""
        from jinja2 import TemplateError

        fixed = {"messages": messages, "add_generation_prompt": add_generation_prompt, **self.specials}
        if clash := sorted(set(extra or {}) & set(fixed)):
            raise PromptError(f"chat_template_kwargs cannot set {', '.join(clash)}; use the request's own fields",
                              "chat_template_kwargs")  # fmt: skip
        try:
            return self.template.render(**{**(extra or {}), **fixed})
        except TemplateError as exc:
            raise PromptError(f"the chat template refused these messages: {exc}", "messages") from exc


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:  # fmt: skip
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _end_ids(model_dir: Path, tokenizer: TextTokenizer | None, eos_token_ids: tuple[int, ...]) -> tuple[int, ...]:
    """Where generation ends by default: config.json's EOS, generation_config.json's (chat models
    often list their end-of-turn token only there), and the tokenizer's eos_token."""
    ids = list(eos_token_ids)
    generation_config = model_dir / "generation_config.json"
    if generation_config.is_file():
        with contextlib.suppress(ValueError, OSError):
            eos = json.loads(generation_config.read_text()).get("eos_token_id")
            ids += [t for t in (eos if isinstance(eos, list) else [eos]) if isinstance(t, int) and t >= 0]
    if tokenizer is not None:
        token = tokenizer.token_id(_token_text(tokenizer.config.get("eos_token")))
        ids += [token] if token is not None else []
    return tuple(dict.fromkeys(ids))


def _raise_exception(message: str) -> None:
    from jinja2 import TemplateError

    raise TemplateError(message)


class Prompts:
    """Text and chat prompts of one checkpoint, checked against its vocabulary and context."""

    def __init__(self, model_dir: Path, vocab_size: int, context_length: int, eos_token_ids: tuple[int, ...] = ()):
        self.vocab_size, self.context_length = vocab_size, context_length
        self.tokenizer = TextTokenizer(model_dir) if TextTokenizer.exists(model_dir) else None
        config = self.tokenizer.config if self.tokenizer is not None else {}
        self.chat_template = ChatTemplate.of(model_dir, config) if self.tokenizer is not None else None
        self.eos_token_ids = _end_ids(model_dir, self.tokenizer, eos_token_ids)

    def completion(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise PromptError("this checkpoint has no tokenizer.json; send the prompt as token ids", "prompt")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        return self.check(ids, "prompt")

    def chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool, continue_final_message: bool = False,
             template_kwargs: dict[str, Any] | None = None) -> list[int]:  # fmt: skip
        """``continue_final_message``: the last (assistant) message is left open, its rendering cut
        right after its content, so generation continues it (vLLM's and transformers' rule)."""
        if self.tokenizer is None or self.chat_template is None:
            raise PromptError(
                "this checkpoint has no chat template (chat_template in tokenizer_config.json), so "
                "/v1/chat/completions cannot render messages; use /v1/completions with a prompt",
                "messages",
            )
        text = self.chat_template.render(messages, add_generation_prompt, template_kwargs)
        if continue_final_message:
            final = str(messages[-1].get("content") or "")
            end = text.rfind(final) if final else -1
            if end < 0:
                raise PromptError("continue_final_message: the chat template does not render the last message's "
                                  "content verbatim, so it cannot be left open", "messages")  # fmt: skip
            text = text[: end + len(final)]
        return self.check(self.tokenizer.encode(text), "messages")

    def check(self, ids: list[int], param: str) -> list[int]:
        if not ids:
            raise PromptError("the prompt is empty; give at least one token", param)
        if max(ids) >= self.vocab_size:  # one pass in C: a long prompt's ids are millions
            bad = next(t for t in ids if t >= self.vocab_size)
            raise PromptError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", param)
        if len(ids) >= self.context_length:
            raise PromptError(
                f"the prompt has {len(ids)} tokens; the context length is {self.context_length} "
                "(the prompt must be shorter to leave room for generated tokens)",
                param,
            )
        return ids

    def token_strings(self, ids: list[int]) -> list[str]:
        """Each token's own text (a token that is part of a character decodes alone to U+FFFD)."""
        tokenizer = self._tokenizer("tokens")
        return [tokenizer.decode([token]) for token in ids]

    def text(self, ids: list[int]) -> str:
        tokenizer = self._tokenizer("tokens")
        if ids and max(ids) >= self.vocab_size:
            bad = next(i for i, t in enumerate(ids) if t >= self.vocab_size)
            raise PromptError(f"tokens[{bad}]={ids[bad]} is outside the vocabulary [0, {self.vocab_size})",
                              f"tokens[{bad}]")  # fmt: skip
        return tokenizer.decode(ids)

    def _tokenizer(self, param: str) -> TextTokenizer:
        if self.tokenizer is None:
            raise PromptError("this checkpoint has no tokenizer.json, so it has no text for token ids", param)
        return self.tokenizer

    def check_stop_ids(self, ids: list[int]) -> list[int]:
        for index, token in enumerate(ids):
            if token >= self.vocab_size:
                raise PromptError(
                    f"stop_token_ids[{index}]={token} is outside the vocabulary [0, {self.vocab_size}); "
                    "give ids the model can generate",
                    f"stop_token_ids[{index}]",
                )
        return ids

    def max_tokens(self, prompt_tokens: int, requested: int | None) -> int:
        room = self.context_length - prompt_tokens
        if requested is None:
            return room
        if requested > room:
            raise PromptError(
                f"max_tokens={requested} does not fit: the prompt has {prompt_tokens} tokens and the context "
                f"length is {self.context_length}, so at most {room} tokens can be generated",
                "max_tokens",
            )
        return requested
