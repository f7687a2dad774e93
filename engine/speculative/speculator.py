"""The :class:`Speculator`: what the pure scheduler (engine.scheduler) consults when it builds a step.

For the step's decode streams it asks the proposer for up to gamma tokens each, chooses the
widths together (engine.speculative.adaptive), and later records what verification accepted and
how long the step took. It reads no clock of its own: the caller passes step times in, and a
``clock`` to time the proposer with (D, apart from the step's V); verification runs where the
logits are (engine.speculative.verify, at the tail).

A proposer that costs a model frame per proposed position (a draft model) is asked only for as
many positions as the width model, given D per position, finds worth their cost; free proposers
(suffix match, phrase table) propose gamma and the widths are cut from what they found.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..sampling import SamplingParams
from .adaptive import Acceptance, Fallback, StepCosts, joint_widths, survival
from .config import SpeculativeConfig
from .proposers import BatchProposer, HybridProposer, PhraseTable, Proposer, SampledProposer, simple_proposer

DRAFT_SEED_OFFSET = 0x5EED  # a seeded stream's draft generator: seed + this (its own, apart from the target's)


@dataclass
class SpeculationStats:
    """What speculation did, for ``generate --json`` and metrics."""

    method: str
    drafted: int = 0
    accepted: int = 0
    fallback_trips: int = 0
    widths: Counter[int] = field(default_factory=Counter)  # chosen width -> decode rows
    expected_tokens: float = 0.0  # what the width model expected the chosen windows to emit...
    expected_seconds: float = 0.0  # ...and to cost, summed over steps
    proposing_seconds: float = 0.0  # the proposer's measured time (D), summed over steps

    @property
    def predicted_tokens_per_second(self) -> float:
        """The width model's own forecast: E over the chosen windows / V of their steps."""
        return self.expected_tokens / self.expected_seconds if self.expected_seconds else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "method": self.method, "drafted": self.drafted, "accepted": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4), "fallback_trips": self.fallback_trips,
            "widths": {str(k): v for k, v in sorted(self.widths.items())},
            "predicted_tokens_per_second": round(self.predicted_tokens_per_second, 3),
            "proposing_seconds": round(self.proposing_seconds, 4),
        }  # fmt: skip


class Speculator:
    """Proposals and widths for the decode streams of a step; acceptance and step costs recorded.

    ``row_budget``: most rows one step may carry (None: every stream at the widest window).
    ``clock``: seconds, monotonic (time.perf_counter), to measure the proposer's cost D with;
    None: D counts as 0 and no time is measured (pure table tests).
    ``sampled_drafts``: the verifier receives :attr:`proposal_probs` (in this process, or sent
    with the frame to a fleet's tail), so a draft model samples its proposals for sampled streams
    from its own q; False: its proposals are its argmax (a one-hot q, which needs nothing sent)."""

    def __init__(
        self,
        config: SpeculativeConfig,
        proposer: Proposer | None = None,
        row_budget: int | None = None,
        clock: Callable[[], float] | None = None,
        sampled_drafts: bool = False,
    ):
        self.config = config
        self.proposer = proposer or simple_proposer(config)
        self.row_budget = row_budget
        self.clock = clock
        self.sampled_drafts = sampled_drafts
        self.generators: dict[Hashable, torch.Generator] = {}  # a sampled stream's draft generator
        self.proposal_probs: dict[Hashable, torch.Tensor] = {}  # q [width, V] of the latest drafts(), by stream
        self.acceptance = Acceptance()  # per proposer and position, shared by its streams
        self.costs = StepCosts()  # V: step seconds by rows, decode and verify steps only
        self.draft_costs = StepCosts()  # D per proposed position, by streams drafting together
        self.last_proposing_seconds = 0.0  # D of the latest drafts(): the caller takes it out of the step's time
        self.fallbacks: dict[Hashable, Fallback] = {}
        self.stats = SpeculationStats(config.method)

    def drafts(
        self, streams: Sequence[tuple[Hashable, Sequence[int]]], params: Sequence[SamplingParams] | None = None
    ) -> list[list[int]]:
        """Proposals for each (stream key, tokens so far) of one step, at the chosen widths;
        ``params``: each stream's sampling (a sampled stream's draft samples, see the class)."""
        gamma = self.config.num_speculative_tokens
        budget = self.row_budget or len(streams) * (1 + gamma)
        drafting = [(key, tokens) for key, tokens in streams if self._fallback(key).drafting]
        started = self.clock() if self.clock is not None else 0.0
        depth = gamma
        if self.config.adaptive and drafting and self.costly:  # decide the depth before paying for it
            confidences = [self.acceptance.confidences(gamma)] * len(drafting)
            planned = joint_widths(confidences, self.draft_cost(len(drafting)), self.costs, budget)
            drafting = [d for d, w in zip(drafting, planned, strict=True) if w > 0]
            depth = max(planned)
        probs: dict[Hashable, torch.Tensor] = {}
        by_key = dict(zip([key for key, _ in streams], params or [SamplingParams()] * len(streams), strict=True))
        if self.sampled_drafts and isinstance(self.proposer, SampledProposer) and drafting:
            sampling = [None if by_key[key].greedy else (by_key[key], self._generator(key, by_key[key]))
                        for key, _ in drafting]  # fmt: skip
            many, qs = self.proposer.propose_sampled(drafting, depth, sampling)
            proposed = dict(zip([key for key, _ in drafting], many, strict=True))
            probs = {key: q for (key, _), q in zip(drafting, qs, strict=True) if q is not None}
        elif isinstance(self.proposer, BatchProposer):
            many = self.proposer.propose_many(drafting, depth) if drafting else []
            proposed = dict(zip([key for key, _ in drafting], many, strict=True))
        else:
            proposed = {key: self.proposer.propose(tokens, depth) for key, tokens in drafting}
        spent = (self.clock() - started) if self.clock is not None else 0.0
        if self.costly and drafting and depth:
            self.draft_costs.record(len(drafting), spent / depth)
        self.last_proposing_seconds = spent
        proposals = [proposed.get(key, []) for key, _ in streams]
        # survival confidences: a draft model's own probabilities of its proposals, else the
        # acceptance measured so far at each position
        own: dict[Hashable, list[float]] = getattr(self.proposer, "confidences", {}) if drafting else {}
        confidences = [own[key][: len(p)] if key in own else self.acceptance.confidences(len(p))
                       for (key, _), p in zip(streams, proposals, strict=True)]  # fmt: skip
        if self.config.adaptive:  # what was proposed is paid for: only V decides now
            widths = joint_widths(confidences, 0.0, self.costs, budget)
        else:
            widths = [len(p) for p in proposals]
        chosen = [p[:w] for p, w in zip(proposals, widths, strict=True)]
        self.proposal_probs = {
            key: probs[key][: len(d)] for (key, _), d in zip(streams, chosen, strict=True) if d and key in probs
        }
        self._forecast([c[: len(d)] for c, d in zip(confidences, chosen, strict=True)], spent)
        for (key, _), drafts in zip(streams, chosen, strict=True):
            self.stats.widths[len(drafts)] += 1
            if not drafts:
                self._fallback(key).plain_step()
        return chosen

    @property
    def costly(self) -> bool:
        """The proposer runs a model frame per proposed position (a draft model)."""
        return self.proposer.method in ("draft_model", "mtp")

    def draft_cost(self, streams: int) -> float:
        """D per proposed position for ``streams`` drafting together, as measured (0 before any)."""
        return self.draft_costs.cost(streams) if self.draft_costs.seconds else 0.0

    def _forecast(self, confidences: list[list[float]], proposing_seconds: float) -> None:
        self.stats.proposing_seconds += proposing_seconds
        if not self.costs.seconds:  # nothing measured yet: no forecast
            return
        rows = sum(1 + len(c) for c in confidences)
        self.stats.expected_tokens += sum(1 + sum(survival(c)) for c in confidences)
        self.stats.expected_seconds += proposing_seconds + self.costs.cost(rows)

    def record(self, key: Hashable, proposed: int, accepted: int) -> None:
        """Verification of ``proposed`` tokens of stream ``key`` accepted ``accepted`` of them."""
        if proposed == 0:
            return
        fallback = self._fallback(key)
        trips = fallback.trips
        fallback.record(proposed, accepted)
        self.acceptance.record(proposed, accepted)
        self.stats.drafted += proposed
        self.stats.accepted += accepted
        self.stats.fallback_trips += fallback.trips - trips

    def learn(self, tokens: Sequence[int], new: int) -> None:
        """An emitted token, for proposers that learn (the phrase table)."""
        table = self._phrase_table()
        if table is not None:
            table.learn_step(tokens, new)

    @property
    def reads_hidden(self) -> bool:
        """The proposer reads the target's final hidden rows (mtp): the caller hands them to :meth:`observe`."""
        return callable(getattr(self.proposer, "observe", None))

    def observe(self, slots: Sequence[int], positions: Sequence[int], hidden: torch.Tensor) -> None:
        """A target step's final hidden rows [R, H] at (slot, position) of each row."""
        observe = getattr(self.proposer, "observe", None)
        if observe is not None:
            observe(slots, positions, hidden)

    def step_time(self, rows: int, seconds: float) -> None:
        self.costs.record(rows, seconds)

    def forget(self, key: Hashable) -> None:
        """A stream ended: its controller goes (a new request starts fresh), and its draft state."""
        self.fallbacks.pop(key, None)
        self.generators.pop(key, None)
        if isinstance(self.proposer, BatchProposer):
            self.proposer.forget(key)

    def save_phrases(self, path: str | Path) -> None:
        table = self._phrase_table()
        if table is not None:
            table.save(path)

    def _generator(self, key: Hashable, params: SamplingParams) -> torch.Generator:
        if key not in self.generators:
            seed = params.seed + DRAFT_SEED_OFFSET if params.seed is not None else torch.seed()
            self.generators[key] = torch.Generator().manual_seed(seed % 2**63)
        return self.generators[key]

    def _fallback(self, key: Hashable) -> Fallback:
        if key not in self.fallbacks:
            c = self.config
            self.fallbacks[key] = Fallback(c.min_verified, c.acceptance_threshold, c.cooldown_steps)
        return self.fallbacks[key]

    def _phrase_table(self) -> PhraseTable | None:
        proposer = self.proposer
        if isinstance(proposer, HybridProposer):
            return proposer.phrases
        return proposer if isinstance(proposer, PhraseTable) else None
