"""Structured output: a grammar over a stream's tokens, applied as a token mask where it samples.

A stream's grammar is a *spec*, plain JSON text that travels with its sampling parameters (never
pickled); :func:`spec_text` writes one:

- ``{"type": "json_object"}``: any JSON object;
- ``{"type": "json_schema", "schema": {...}, "strict": bool}``: JSON valid against the schema
  (``strict``: no properties or items the schema does not name);
- ``{"type": "structural_tag", "format": {...}}``: xgrammar's structural tag (tool calls: text,
  tagged calls whose arguments follow each function's parameters schema).

JSON is generated compact, on one line (separators ``", "`` and ``": "``): whitespace the grammar
leaves free is where a weak model wanders, and a parser reads either alike.

Grammars are compiled by xgrammar (chosen by measurement, docs/results/structured_output.md) for
the checkpoint's vocabulary, read from its ``tokenizer.json``; its compiler caches compiled
grammars by spec, so streams of one schema compile it once per process. A stream's
:class:`GrammarState` masks every token the grammar does not allow next (the mask comes before
temperature, top-k and top-p, so reported log-probabilities are of the distribution sampled),
allows the stream's stop tokens only where the grammar may end, and advances with each token
the stream commits. A stream prefilled again (a replay, a continuation) first advances over the
tokens it had already committed (:meth:`GrammarState.catch_up`).

xgrammar is imported only when a grammar is compiled: a process that serves none never loads it,
and one without it installed refuses grammars with :class:`StructuredOutputError`.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from pathlib import Path
from typing import Any

import torch

from .errors import InputError

log = logging.getLogger("modelfleet.structured")
MAX_SPEC_CHARS = 1 << 17  # a spec's JSON text: a schema of a few thousand properties
GRAMMAR_TYPES = ("json_object", "json_schema", "structural_tag")
GRAMMAR_CACHE_BYTES = 256 << 20  # compiled grammars kept per process (xgrammar's cache, by spec)


class StructuredOutputError(InputError):
    """A grammar that cannot be compiled, or structured output that this process cannot serve."""


def spec_text(spec: dict[str, Any]) -> str:
    """A spec as its wire text (no spaces; keys in their given order, which a schema's properties
    are generated in), checked: see :func:`parse_spec`."""
    text = json.dumps(spec, separators=(",", ":"), ensure_ascii=False)
    parse_spec(text)
    return text


def parse_spec(text: str) -> dict[str, Any]:
    """The spec in ``text``, its shape checked (not yet compiled: :func:`check_spec` does that)."""
    if len(text) > MAX_SPEC_CHARS:
        raise StructuredOutputError(f"the grammar spec has {len(text)} characters, over the limit of {MAX_SPEC_CHARS}")
    try:
        spec = json.loads(text)
    except ValueError as exc:
        raise StructuredOutputError(f"the grammar spec is not JSON: {exc}") from None
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind not in GRAMMAR_TYPES:
        raise StructuredOutputError(f"the grammar spec's type {kind!r} is not one of {', '.join(GRAMMAR_TYPES)}")
    if kind == "json_schema" and not isinstance(spec.get("schema"), dict | bool):
        raise StructuredOutputError("a json_schema grammar spec needs a schema (a JSON object)")
    if kind == "structural_tag" and not isinstance(spec.get("format"), dict):
        raise StructuredOutputError("a structural_tag grammar spec needs a format (a JSON object)")
    return dict(spec)


def load_xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as exc:
        raise StructuredOutputError(
            f"structured output (response_format, tools) needs xgrammar, which is not installed here ({exc}); "
            "bash scripts/setup.sh installs it (xgrammar with --no-deps, then modelfleet's structured extra)"
        ) from None
    return xgrammar


def _reason(exc: Exception) -> str:
    """xgrammar's message without its C++ log prefix (``[12:00:00] /project/cpp/x.cc:42: ``)."""
    return re.sub(r"^\[[0-9:]+\] [^ ]+:[0-9]+: ", "", str(exc).strip()).strip()


def _build(maker: Any, spec: dict[str, Any]) -> Any:
    """The spec built by ``maker``: xgrammar's ``Grammar`` (no vocabulary needed, to check it) or a
    ``GrammarCompiler`` (compiled for the vocabulary); both name their methods alike."""
    if spec["type"] == "structural_tag":
        method = maker.from_structural_tag if hasattr(maker, "from_structural_tag") else maker.compile_structural_tag
        return method(json.dumps(spec))
    schema = {"type": "object"} if spec["type"] == "json_object" else spec["schema"]
    strict = spec["type"] == "json_schema" and bool(spec.get("strict", False))
    method = maker.from_json_schema if hasattr(maker, "from_json_schema") else maker.compile_json_schema
    return method(json.dumps(schema), any_whitespace=False, strict_mode=strict)


def check_spec(text: str) -> None:
    """Raise :class:`StructuredOutputError` saying what is wrong unless the spec compiles; the
    gateway asks this before a request is admitted, so a bad schema is a 400, not a failed stream."""
    spec = parse_spec(text)
    xgr = load_xgrammar()
    try:
        _build(xgr.Grammar, spec)
    except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar raises plain RuntimeErrors from C++
        raise StructuredOutputError(_reason(exc)) from None


class Grammars:
    """The grammar compiler of one checkpoint's vocabulary (the model's ``vocab_size``, which may
    exceed the tokenizer's: ids beyond it are never allowed), built on first use."""

    def __init__(self, model_dir: str | Path, vocab_size: int):
        self.model_dir, self.vocab_size = Path(model_dir), vocab_size
        self._compiler: Any = None
        self._lock = threading.Lock()

    def prepare(self) -> threading.Thread | None:
        """Build the compiler in a thread of its own: importing xgrammar and reading the vocabulary
        take a second or more, which on a tail's serving loop would hold the step of every stream
        beside the first grammar stream. A checkpoint without a tokenizer serves no grammars."""
        if not (self.model_dir / "tokenizer.json").is_file():
            return None
        thread = threading.Thread(target=self._prepare, name="grammars", daemon=True)
        thread.start()
        return thread

    def _prepare(self) -> None:
        try:
            self.compiler()
        except StructuredOutputError as exc:  # each grammar stream fails with it, as an InputError
            log.info("structured output is not available here: %s", exc)

    def compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                xgr = load_xgrammar()
                self._compiler = xgr.GrammarCompiler(
                    tokenizer_info(self.model_dir, self.vocab_size), max_threads=1,
                    cache_limit_bytes=GRAMMAR_CACHE_BYTES,
                )  # fmt: skip
            return self._compiler

    def compile(self, text: str) -> Any:
        spec = parse_spec(text)
        compiler = self.compiler()
        try:
            return _build(compiler, spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise StructuredOutputError(f"the grammar does not compile: {_reason(exc)}") from None

    def state(self, text: str, stop_token_ids: tuple[int, ...] | list[int] | set[int]) -> GrammarState:
        return GrammarState(self.compile(text), sorted(stop_token_ids), self.vocab_size)


def tokenizer_info(model_dir: Path, vocab_size: int) -> Any:
    """xgrammar's view of the checkpoint's ``tokenizer.json``: each id's token text and how the
    vocabulary encodes bytes (detected from the file by xgrammar), without loading transformers'
    tokenizer. Stop tokens are set per stream (:class:`GrammarState`)."""
    from tokenizers import Tokenizer

    xgr = load_xgrammar()
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise StructuredOutputError(f"{path} is missing: structured output needs the checkpoint's tokenizer")
    text = path.read_text()
    metadata = xgr.TokenizerInfo._detect_metadata_from_hf(text)
    encoded = [""] * vocab_size
    for token, index in Tokenizer.from_str(text).get_vocab(with_added_tokens=True).items():
        if index < vocab_size:
            encoded[index] = token
    return xgr.TokenizerInfo(
        encoded, vocab_type=metadata["vocab_type"], vocab_size=vocab_size, stop_token_ids=[],
        add_prefix_space=metadata["add_prefix_space"],
    )  # fmt: skip


class GrammarState:
    """One stream's place in its grammar. ``pending``: committed tokens the matcher has not seen
    yet (a stream prefilled again), fed by :meth:`catch_up` before the next mask."""

    def __init__(self, compiled: Any, stop_token_ids: list[int], vocab_size: int):
        xgr = load_xgrammar()
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids or None)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # [1, ceil(V / 32)] int32
        self.vocab_size = vocab_size
        self.pending = 0

    @property
    def ended(self) -> bool:
        """A stop token was accepted where the grammar may end: nothing more may follow."""
        return bool(self.matcher.is_terminated())

    def catch_up(self, committed: list[int]) -> None:
        """Advance over ``committed``, tokens the stream emitted before this state existed."""
        for token in committed:
            self.accept(token)
        self.pending = 0

    def allowed(self) -> torch.Tensor:
        """[V] bool: the tokens the grammar allows next."""
        self.matcher.fill_next_token_bitmask(self.bitmask)
        bits = self.bitmask[0].to(torch.int64) & 0xFFFFFFFF  # 32 tokens a word, least significant bit first
        shifts = torch.arange(32, dtype=torch.int64)
        allowed: torch.Tensor = ((bits.unsqueeze(-1) >> shifts) & 1).flatten()[: self.vocab_size].bool()
        return allowed

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] float32 on the CPU -> a copy with every token the grammar forbids at -inf."""
        self.matcher.fill_next_token_bitmask(self.bitmask)
        masked = logits.clone().unsqueeze(0)
        load_xgrammar().apply_token_bitmask_inplace(
            masked, self.bitmask, vocab_size=min(self.vocab_size, logits.shape[-1])
        )
        if logits.shape[-1] > self.vocab_size:  # a padded head: ids past the vocabulary are never text
            masked[0, self.vocab_size :] = float("-inf")
        return masked[0]

    def accept(self, token: int) -> None:
        if not self.matcher.accept_token(token):
            raise StructuredOutputError(f"token {token} does not continue the stream's grammar")
