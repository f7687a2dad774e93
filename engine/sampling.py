"""Per-stream sampling: greedy, temperature, top-k, top-p, min-p, seeded generators, stops."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import InputError, ModelfleetError

# Temperatures below this sample as it does: float32 holds it (a smaller one would be 0 there),
# and it already leaves only the largest logits (those within ~1e-30 of the top) any mass.
MIN_TEMPERATURE = 1e-30


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
    """logits: [V] float32 -> probabilities [V] after temperature, top-k, top-p and min-p.

    Safe for every accepted value: the largest logit is moved to 0 before the temperature divides
    (so a tiny temperature sends the others to -inf, never the top one to +inf; below
    ``MIN_TEMPERATURE``, which float32 still holds, every temperature draws alike), and the most
    likely token always survives top-p (a top_p below float32's smallest value is 0 there). Only
    logits that are not finite (a NaN hidden state) give a distribution that cannot be sampled."""
    logits = (logits - logits.max()) / max(params.temperature, MIN_TEMPERATURE)
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop = before >= params.top_p  # keep the smallest prefix whose mass reaches top_p
        drop[0] = False  # and never less than the most likely token
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs / probs.sum()


class StreamSampler:
    """Samples one stream's tokens; the same seed gives the same tokens.

    ``drawn``: tokens the stream sampled before this sampler (a stream prefilled again after a
    lost stage): the generator first skips that many draws, so a seeded stream goes on with the
    tokens an undisturbed run would draw. A draw consumes the generator alike whatever the
    probabilities (``torch.multinomial`` of one sample draws one exponential per vocabulary
    entry), so skipping is drawing from a uniform distribution of the same size."""

    def __init__(self, params: SamplingParams, eos_token_ids: tuple[int, ...] = (), drawn: int = 0):
        self.params = params
        self.stop_ids = set(params.stop_token_ids if params.stop_token_ids is not None else eos_token_ids)
        self.generator: torch.Generator | None = None
        self.skip = 0 if params.greedy else drawn  # draws still to skip, once the vocabulary's size is known
        if not params.greedy:
            self.generator = torch.Generator(device="cpu")
            self.generator.manual_seed(params.seed if params.seed is not None else torch.seed())

    def catch_up(self, vocab_size: int) -> None:
        """Skip the draws made before this sampler started (see the class)."""
        uniform = torch.ones(vocab_size)
        for _ in range(self.skip):
            torch.multinomial(uniform, 1, generator=self.generator)
        self.skip = 0

    def sample(self, logits: torch.Tensor) -> int:
        """logits: [V] for this stream's last position."""
        if self.params.greedy:
            return int(torch.argmax(logits))
        if self.skip:
            self.catch_up(logits.shape[-1])
        probs = filter_logits(logits.to("cpu", torch.float32), self.params)
        return int(torch.multinomial(probs, 1, generator=self.generator))


class TailSampler:
    """The samplers of the last stage, one per slot: the one implementation of tail sampling.

    A stream's sampler starts when its first rows pass (``start``) and ends with its slot
    (``release``). ``sample`` draws one token per output row; a row that cannot be sampled fails
    alone, so one stream's values never fail another stream of the same frame.
    """

    def __init__(self, eos_token_ids: tuple[int, ...] = ()):
        self.eos_token_ids = eos_token_ids
        self.samplers: dict[int, StreamSampler] = {}

    def start(self, slot: int, params: SamplingParams, drawn: int = 0) -> None:
        """``drawn``: tokens the stream sampled before (a replay; see :class:`StreamSampler`)."""
        self.samplers[slot] = StreamSampler(params, self.eos_token_ids, drawn)

    def release(self, slot: int) -> None:
        self.samplers.pop(slot, None)

    def sample(self, slots: list[int], logits: torch.Tensor) -> tuple[dict[int, int], dict[int, ModelfleetError]]:
        """logits [N, V] of the output rows, whose streams are in ``slots`` -> ({slot: token}, {slot: error})."""
        tokens: dict[int, int] = {}
        errors: dict[int, ModelfleetError] = {}
        samplers = [self.samplers.get(slot) for slot in slots]
        if all(s is not None and s.params.greedy for s in samplers):  # the common case: one argmax, one read
            return dict(zip(slots, logits.argmax(dim=-1).tolist(), strict=True)), errors
        known = [(row, slot) for row, slot in enumerate(slots) if samplers[row] is not None]
        for slot, sampler in zip(slots, samplers, strict=True):
            if sampler is None:
                errors[slot] = InputError(f"slot {slot} has no sampler: its stream's first rows never reached the tail")
        greedy = [row for row, slot in known if self.samplers[slot].params.greedy]
        if greedy:
            picked = logits[greedy].argmax(dim=-1).tolist()
            tokens.update((slots[row], token) for row, token in zip(greedy, picked, strict=True))
        for row, slot in known:
            if not self.samplers[slot].params.greedy:
                try:
                    tokens[slot] = self.samplers[slot].sample(logits[row])
                except RuntimeError as exc:  # torch.multinomial on a distribution that is not one
                    errors[slot] = InputError(f"sampling failed for these sampling parameters: {exc}")
        return tokens, errors
