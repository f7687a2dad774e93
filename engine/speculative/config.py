"""The speculative-decoding configuration: one typed, validated object, from vLLM-style JSON.

``--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'`` on the command line;
the same keys everywhere. Unknown keys and out-of-range values are refused naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..errors import InputError

METHODS = ("ngram", "phrase", "hybrid", "draft_model", "mtp")
BUILT = METHODS  # every method runs in generate and in a fleet (mtp at the tail; the CRD's enum)
MAX_SPECULATIVE_TOKENS = 16
# a draft samples from its q kept to this many most likely tokens (renormalised): q then travels
# to a fleet's tail as (ids, probabilities) pairs, bounded whatever the vocabulary (4 proposals of
# 64 pairs: 3 KiB a stream, where dense float32 rows of DeepSeek's 129k vocabulary are 2 MiB)
DRAFT_SUPPORT = 64


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int = 4  # gamma: the widest verify window proposes this many
    prompt_lookup_max: int = 4  # ngram: longest suffix matched
    prompt_lookup_min: int = 1  # ngram: shortest suffix matched
    phrase_table: str | None = None  # phrase: a table file to start from (modelfleet phrases)
    phrase_context: int = 3  # phrase: tokens of context a phrase holds
    model: str | None = None  # draft_model: the draft checkpoint
    adaptive: bool = True  # choose each step's widths by E(k) / (D + V(k)); False: always the widest
    min_verified: int = 32  # fallback: proposals verified before the acceptance rate is judged
    acceptance_threshold: float = 0.6  # fallback: tau
    cooldown_steps: int = 64  # fallback: target-only steps after a trip, then a probe

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InputError(f"speculative method {self.method!r} is unknown; choose one of {', '.join(METHODS)}")
        if self.method == "draft_model" and not self.model:
            raise InputError('speculative method "draft_model" needs "model": the draft checkpoint\'s directory')
        checks = [
            ("num_speculative_tokens", 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
             f"in [1, {MAX_SPECULATIVE_TOKENS}]"),
            ("prompt_lookup_min", 1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
             "in [1, prompt_lookup_max]"),
            ("phrase_context", self.phrase_context >= 1, ">= 1"),
            ("min_verified", self.min_verified >= 1, ">= 1"),
            ("acceptance_threshold", 0 <= self.acceptance_threshold <= 1, "in [0, 1]"),
            ("cooldown_steps", self.cooldown_steps >= 0, ">= 0"),
        ]  # fmt: skip
        for name, ok, limit in checks:
            if not ok:
                raise InputError(f"speculative config {name}={getattr(self, name)!r} is invalid; it must be {limit}")

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        try:
            document = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InputError(f"--speculative-config is not JSON: {exc}") from exc
        if not isinstance(document, dict):
            raise InputError('--speculative-config must be a JSON object, e.g. {"method": "ngram"}')
        return cls.from_mapping(document)

    @classmethod
    def from_mapping(cls, document: dict[str, Any]) -> SpeculativeConfig:
        if unknown := sorted(set(document) - set(_TYPES)):
            raise InputError(
                f"speculative config has unknown field(s) {', '.join(unknown)}; fields are {', '.join(_TYPES)}"
            )
        if "method" not in document:
            raise InputError(f"speculative config needs a method: one of {', '.join(METHODS)}")
        for name, value in document.items():
            expected, optional = _TYPES[name]
            accepted = (int, float) if expected is float else expected  # JSON writes 1.0 as 1
            wrong = not isinstance(value, accepted) or (expected is not bool and isinstance(value, bool))
            if wrong and not (value is None and optional):
                raise InputError(f"speculative config {name}={value!r} must be a {expected.__name__}")
        return cls(**document)


# each field's JSON type, and whether null is allowed
_TYPES: dict[str, tuple[type, bool]] = {
    "method": (str, False), "num_speculative_tokens": (int, False), "prompt_lookup_max": (int, False),
    "prompt_lookup_min": (int, False), "phrase_table": (str, True), "phrase_context": (int, False),
    "model": (str, True), "adaptive": (bool, False), "min_verified": (int, False),
    "acceptance_threshold": (float, False), "cooldown_steps": (int, False),
}  # fmt: skip
