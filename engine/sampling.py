"""Per-stream sampling: greedy, temperature, top-k, top-p, min-p, seeded generators, stops."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import InputError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no limit
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] | None = None  # None: the model's EOS tokens

    def __post_init__(self) -> None:
        checks = [
            ("temperature", self.temperature >= 0, ">= 0"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", self.top_k >= 0, ">= 0"),
            ("min_p", 0 <= self.min_p <= 1, "in [0, 1]"),
            ("max_tokens", self.max_tokens >= 1, ">= 1"),
        ]
        for name, ok, limit in checks:
            if not ok:
                raise InputError(f"{name}={getattr(self, name)!r} is invalid; it must be {limit}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [V] float32 -> probabilities [V] after temperature, top-k, top-p and min-p."""
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop = before >= params.top_p  # keep the smallest prefix whose mass reaches top_p
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs / probs.sum()


class StreamSampler:
    """Samples one stream's tokens; the same seed gives the same tokens."""

    def __init__(self, params: SamplingParams, eos_token_ids: tuple[int, ...] = ()):
        self.params = params
        self.stop_ids = set(params.stop_token_ids if params.stop_token_ids is not None else eos_token_ids)
        self.generator: torch.Generator | None = None
        if not params.greedy:
            self.generator = torch.Generator(device="cpu")
            self.generator.manual_seed(params.seed if params.seed is not None else torch.seed())

    def sample(self, logits: torch.Tensor) -> int:
        """logits: [V] for this stream's last position."""
        if self.params.greedy:
            return int(torch.argmax(logits))
        probs = filter_logits(logits.to("cpu", torch.float32), self.params)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def sample_rows(logits: torch.Tensor, samplers: list[StreamSampler]) -> list[int]:
    """One token per row of logits [B, V]; greedy rows share one argmax and one device read."""
    greedy = logits.argmax(dim=-1).tolist() if any(s.params.greedy for s in samplers) else []
    return [greedy[row] if s.params.greedy else s.sample(logits[row]) for row, s in enumerate(samplers)]
