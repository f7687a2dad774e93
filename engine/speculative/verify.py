"""Exact verification of proposed tokens: the output distribution is the target model's, always.

A stream's verify window is its last committed token followed by k proposals d_1..d_k; the
target's logits at those k + 1 rows give p_1..p_{k+1} (row i predicts the token after d_{i-1}).

- Greedy streams accept d_i while it is p_i's argmax; the first mismatch emits the argmax
  instead; all accepted emits the bonus argmax of p_{k+1}.
- Sampled streams with a proposal distribution q_i (a draft model's) use rejection sampling
  (Leviathan et al., 2023): accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first
  rejection draw from the residual max(p_i - q_i, 0), normalised; all accepted draws the bonus
  token from p_{k+1}.
- A deterministic proposer's q is one-hot, and rejection sampling then reduces to: draw x_i from
  p_i, accept while x_i = d_i, emit x_i at the first difference. That is how they are verified:
  the stream's generator is consumed exactly as plain sampling consumes it, so a seed gives the
  same tokens with or without speculation.

p is filtered exactly as plain sampling filters it (temperature, top-k, top-p, min-p), so every
emitted token has the distribution plain sampling would give it.

A draft's q is kept to its ``DRAFT_SUPPORT`` most likely tokens (:func:`cap_support`) before the
draft samples from it: any q is exact so long as the proposal was drawn from the q the verifier
gets, and a capped q reaches a fleet's tail as :class:`SparseQ` (ids and probabilities), which
:meth:`SparseQ.dense` rebuilds bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from ..errors import InputError, ModelfleetError
from ..sampling import SamplingParams, TailSampler, TokenLogprobs, filter_logits
from .config import DRAFT_SUPPORT


@dataclass(frozen=True)
class Verdict:
    """The tokens a verify window emits (accepted proposals, then one from the target) and how
    many proposals were accepted."""

    tokens: list[int]
    accepted: int


def verify(
    logits: torch.Tensor,
    drafts: Sequence[int],
    params: SamplingParams,
    generator: torch.Generator | None = None,
    draft_probs: torch.Tensor | None = None,
) -> Verdict:
    """logits: [k + 1, V] at the window's rows; drafts: the k proposals; draft_probs: [k, V] the
    proposal distributions, None for a deterministic proposer (one-hot q)."""
    assert logits.shape[0] == len(drafts) + 1, (logits.shape, len(drafts))
    if params.greedy:
        return _verify_greedy(logits, drafts)
    return _verify_sampled(logits.to("cpu", torch.float32), drafts, params, generator, draft_probs)


def _verify_greedy(logits: torch.Tensor, drafts: Sequence[int]) -> Verdict:
    targets = logits.argmax(dim=-1).tolist()
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
        accepted += 1
    return Verdict([*drafts[:accepted], targets[accepted]], accepted)


def _verify_sampled(
    logits: torch.Tensor,
    drafts: Sequence[int],
    params: SamplingParams,
    generator: torch.Generator | None,
    draft_probs: torch.Tensor | None,
) -> Verdict:
    if draft_probs is None:
        return _verify_by_sampling(logits, drafts, params, generator)
    for i, draft in enumerate(drafts):
        p = filter_logits(logits[i], params).double()
        q = draft_probs[i].to("cpu", torch.float64)
        u = float(torch.rand((), generator=generator, dtype=torch.float64))
        if q[draft] > 0 and u < min(1.0, float(p[draft] / q[draft])):
            continue
        residual = (p - q).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:  # p == q: nothing to correct (unreachable after a rejection)
            residual = p
        return Verdict([*drafts[:i], _draw(residual, generator)], i)
    bonus = filter_logits(logits[len(drafts)], params).double()
    return Verdict([*drafts, _draw(bonus, generator)], len(drafts))


def _verify_by_sampling(
    logits: torch.Tensor, drafts: Sequence[int], params: SamplingParams, generator: torch.Generator | None
) -> Verdict:
    """A one-hot q: draw x_i from p_i as plain sampling would and accept while x_i = d_i. The
    emitted token at each position has exactly p_i's distribution (d_i with probability p_i(d_i),
    as rejection sampling accepts it), and the generator is consumed once per emitted token, in
    order, as plain sampling consumes it: a seed gives the same tokens with or without proposals."""
    tokens: list[int] = []
    for i in range(len(drafts) + 1):
        x = int(torch.multinomial(filter_logits(logits[i], params), 1, generator=generator))
        tokens.append(x)
        if i == len(drafts) or x != drafts[i]:
            return Verdict(tokens, i)
    raise AssertionError("unreachable")


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(weights / weights.sum(), 1, generator=generator))


def cap_support(q: torch.Tensor, support: int = DRAFT_SUPPORT) -> torch.Tensor:
    """q [..., V] kept to its ``support`` largest entries, renormalised (ties: torch.topk's pick)."""
    if q.shape[-1] <= support:
        return q
    top = q.topk(support, dim=-1)
    kept = torch.zeros_like(q).scatter_(-1, top.indices, top.values)
    return kept / kept.sum(dim=-1, keepdim=True)


@dataclass(frozen=True)
class SparseQ:
    """A window's q rows over at most ``DRAFT_SUPPORT`` tokens each: ids [k, N] int64 and their
    probabilities [k, N] float32 (the rest of each row is 0), as they travel to a fleet's tail."""

    ids: torch.Tensor
    probs: torch.Tensor

    @classmethod
    def of(cls, q: torch.Tensor) -> SparseQ:
        """q [k, V] with at most DRAFT_SUPPORT nonzero entries a row (:func:`cap_support`'s)."""
        top = q.to(torch.float32).topk(min(DRAFT_SUPPORT, q.shape[-1]), dim=-1)
        return cls(top.indices.to(torch.int64), top.values)

    def dense(self, vocab: int) -> torch.Tensor:
        """[k, vocab] float32: the q it was made from (zeros added to zeros where a row had fewer
        than N tokens); InputError for an id outside the vocabulary."""
        if self.ids.numel() and int(self.ids.max()) >= vocab:
            raise InputError(f"a proposal distribution names token {int(self.ids.max())}, outside the target's "
                             f"vocabulary of {vocab} (a draft of another vocabulary)")  # fmt: skip
        q = torch.zeros(self.ids.shape[0], vocab, dtype=torch.float32)
        return q.scatter_add_(1, self.ids, self.probs.to(torch.float32))


PromptLogprobs = dict[int, list[tuple[int, TokenLogprobs]]]  # slot -> (prompt position, its log-probabilities)


def tail_step(
    sampler: TailSampler,
    slots: Sequence[int],
    positions: Sequence[int],
    token_ids: Sequence[int] | None,
    logits: torch.Tensor,
    frame_rows: Callable[[], list[tuple[int, int, int]]],
    draft_probs: Mapping[int, torch.Tensor | SparseQ] | None = None,
) -> tuple[dict[int, int | list[int]], dict[int, ModelfleetError], dict[int, TokenLogprobs], PromptLogprobs]:
    """The tail's work on a step's output rows (``slots``, ``positions``, input ``token_ids``,
    ``logits`` [R, V]): prompt rows of streams that asked for prompt log-probabilities are scored
    (``frame_rows``: (slot, position, input token) of every row of the frame, asked for only
    then), the others sampled (:func:`sample_step`; ``draft_probs``: q of sampled proposals, by slot)."""
    prompt = sampler.prompt_rows(list(slots), list(positions))
    if not any(prompt) and not sampler.scorers:
        return (*sample_step(sampler, slots, token_ids, logits, draft_probs), {})
    score = [i for i, is_prompt in enumerate(prompt) if is_prompt]
    keep = [i for i, is_prompt in enumerate(prompt) if not is_prompt]
    scored = sampler.score_prompts([(slots[i], positions[i]) for i in score], logits[score], frame_rows())
    kept_ids = None if token_ids is None else [token_ids[i] for i in keep]
    return (*sample_step(sampler, [slots[i] for i in keep], kept_ids, logits[keep], draft_probs), scored)


def sample_step(
    sampler: TailSampler,
    slots: Sequence[int],
    token_ids: Sequence[int] | None,
    logits: torch.Tensor,
    draft_probs: Mapping[int, torch.Tensor | SparseQ] | None = None,
) -> tuple[dict[int, int | list[int]], dict[int, ModelfleetError], dict[int, TokenLogprobs]]:
    """The tail's tokens for a step's output rows: ``slots[r]`` and ``token_ids[r]`` are output
        row r's stream slot and input token, ``logits`` [R, V]. A slot's lone row is sampled; a run of
        rows of one slot is a verify window (its input tokens after the first are the proposals) and
        emits its accepted proposals and one token (``token_ids`` None: a frame without them, whose
    windows cannot be verified; ``draft_probs``: by slot, q [proposals, V] (or as it came over the
    wire, :class:`SparseQ`) of a window whose proposals a draft sampled, else q is one-hot). A row
    that cannot be sampled fails its slot alone."""
    windows: dict[int, list[int]] = {}
    for row, slot in enumerate(slots):
        windows.setdefault(slot, []).append(row)
    lone = [rows[0] for rows in windows.values() if len(rows) == 1]
    tokens: dict[int, int | list[int]] = {}
    picked, errors, logprobs = sampler.sample_with_logprobs([slots[r] for r in lone], logits[lone])
    tokens.update(picked)
    for slot, rows in windows.items():
        if len(rows) == 1:
            continue
        stream = sampler.samplers.get(slot)
        if stream is None:
            errors[slot] = InputError(f"slot {slot} has no sampler: its stream's first rows never reached the tail")
            continue
        if token_ids is None:
            errors[slot] = InputError(f"slot {slot} has a verify window but the frame carries no token ids")
            continue
        drafts = [token_ids[r] for r in rows[1:]]
        if stream.skip:  # a stream prefilled again after a lost stage: its generator catches up first
            stream.catch_up(logits.shape[-1])
        q_in = None if draft_probs is None else draft_probs.get(slot)
        try:
            q = q_in.dense(logits.shape[-1]) if isinstance(q_in, SparseQ) else q_in
        except InputError as exc:
            errors[slot] = exc
            continue
        if q is not None and tuple(q.shape) != (len(drafts), logits.shape[-1]):
            errors[slot] = InputError(
                f"slot {slot}'s proposal distributions have shape {list(q.shape)}; its window needs "
                f"[{len(drafts)}, {logits.shape[-1]}] (a draft of the target's vocabulary)"
            )
            continue
        try:
            tokens[slot] = verify(logits[rows], drafts, stream.params, stream.generator, q).tokens
        except RuntimeError as exc:  # a distribution that is not one (torch.multinomial)
            errors[slot] = InputError(f"sampling failed for these sampling parameters: {exc}")
    return tokens, errors, logprobs
