"""Proposers: given a stream's tokens so far, up to ``k`` tokens the model will probably emit next.

A proposer is deterministic here (``ngram``, ``phrase``, ``hybrid``): its proposal distribution q
is one-hot, so exact verification needs only the proposed ids (engine.speculative.verify). Each
proposer also says how far its proposals have been right so far (``confidence``), which the width
model (engine.speculative.adaptive) uses as the survival probability of each proposed position.

- :class:`NgramProposer`: request-local suffix match. The longest suffix of the stream (length
  ``prompt_lookup_min`` .. ``prompt_lookup_max``) seen earlier in prompt + output proposes what
  followed its most recent earlier occurrence.
- :class:`PhraseTable`: shared by the streams of a process (seed 000 §4.3): a context of
  ``context`` tokens seen at least ``min_count`` times whose next token agreed at least
  ``min_agreement`` of those times proposes that token, then continues from the extended context.
  It learns from emitted tokens, saves to and loads from a JSON file, and two tables merge.
- :class:`HybridProposer`: suffix match first, then the phrase table, then a draft model when
  one is configured (seed 000's order; the draft model is engine.speculative.draft).
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ..errors import InputError
from .config import SpeculativeConfig

if TYPE_CHECKING:
    import torch

    from ..sampling import SamplingParams


class Proposer(Protocol):
    method: str

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` proposed next tokens after ``tokens`` (prompt + output); [] when none."""
        ...


class NgramProposer:
    """Prompt lookup: continue the most recent earlier occurrence of the stream's longest suffix."""

    method = "ngram"

    def __init__(self, prompt_lookup_max: int = 4, prompt_lookup_min: int = 1):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise InputError(
                f"prompt_lookup_min={prompt_lookup_min} and prompt_lookup_max={prompt_lookup_max} must "
                "satisfy 1 <= prompt_lookup_min <= prompt_lookup_max"
            )
        self.max_n, self.min_n = prompt_lookup_max, prompt_lookup_min

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        if k < 1 or len(tokens) < 2:
            return []
        # where the last token occurred before, latest first: every match of a longer suffix ends
        # at one of them (one pass over the stream, then only those places are compared)
        last = tokens[-1]
        ends = [i for i in range(len(tokens) - 2, -1, -1) if tokens[i] == last]
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            suffix = list(tokens[-n:])
            for end in ends:
                if end >= n - 1 and list(tokens[end - n + 1 : end + 1]) == suffix:
                    return list(tokens[end + 1 : end + 1 + k])
        return []


class PhraseTable:
    """Next-token statistics of ``context``-token phrases, learned from emitted text.

    Invariant: ``counts[ctx][t]`` is how often token t followed the phrase ``ctx`` in what was
    learned; a phrase proposes only when seen ``min_count`` times with one successor holding at
    least ``min_agreement`` of them.
    """

    method = "phrase"

    def __init__(self, context: int = 3, min_count: int = 2, min_agreement: float = 0.9):
        if context < 1 or min_count < 1 or not 0 < min_agreement <= 1:
            raise InputError(
                f"phrase table context={context}, min_count={min_count}, min_agreement={min_agreement}: "
                "context and min_count must be >= 1 and min_agreement in (0, 1]"
            )
        self.context, self.min_count, self.min_agreement = context, min_count, min_agreement
        self.counts: defaultdict[tuple[int, ...], Counter[int]] = defaultdict(Counter)

    def learn(self, tokens: Sequence[int]) -> None:
        """Count every (phrase, next token) pair of ``tokens``."""
        c = self.context
        for i in range(len(tokens) - c):
            self.counts[tuple(tokens[i : i + c])][tokens[i + c]] += 1

    def learn_step(self, tokens: Sequence[int], new: int) -> None:
        """Count the pair that emitting ``new`` after ``tokens`` adds (incremental learning)."""
        if len(tokens) >= self.context:
            self.counts[tuple(tokens[-self.context :])][new] += 1

    def next_token(self, phrase: tuple[int, ...]) -> int | None:
        successors = self.counts.get(phrase)
        if not successors:
            return None
        total = sum(successors.values())
        token, count = successors.most_common(1)[0]
        return token if total >= self.min_count and count >= self.min_agreement * total else None

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        out: list[int] = []
        window = list(tokens[-self.context :])
        while len(out) < k and len(window) == self.context:
            token = self.next_token(tuple(window))
            if token is None:
                break
            out.append(token)
            window = [*window[1:], token]
        return out

    def merge(self, other: PhraseTable) -> PhraseTable:
        """A table holding both tables' counts (``other`` must use the same context length)."""
        if other.context != self.context:
            raise InputError(f"cannot merge phrase tables of context {self.context} and {other.context}")
        merged = PhraseTable(self.context, self.min_count, self.min_agreement)
        for table in (self, other):
            for phrase, successors in table.counts.items():
                merged.counts[phrase].update(successors)
        return merged

    def save(self, path: str | Path) -> None:
        rows = [[list(phrase), dict(successors)] for phrase, successors in self.counts.items()]
        document = {"version": 1, "context": self.context, "counts": rows}
        Path(path).write_text(json.dumps(document, separators=(",", ":")))

    @classmethod
    def load(cls, path: str | Path, min_count: int = 2, min_agreement: float = 0.9) -> PhraseTable:
        """A table saved by :meth:`save`; plain JSON, checked field by field (never evaluated)."""
        try:
            document = json.loads(Path(path).read_text())
            table = cls(int(document["context"]), min_count, min_agreement)
            for phrase, successors in document["counts"]:
                key = tuple(int(t) for t in phrase)
                if len(key) != table.context:
                    raise ValueError(f"phrase {phrase} is not {table.context} tokens")
                table.counts[key].update({int(t): int(n) for t, n in successors.items()})
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise InputError(f"phrase table {path} cannot be read: {exc}") from exc
        return table


@runtime_checkable
class BatchProposer(Protocol):
    """A proposer that proposes for a step's streams together (a draft model: one frame per token)."""

    def propose_many(self, streams: Sequence[tuple[Hashable, Sequence[int]]], k: int) -> list[list[int]]: ...

    def forget(self, key: Hashable) -> None: ...


@runtime_checkable
class SampledProposer(Protocol):
    """A proposer that can draw its proposals from its own distribution q and return q with them
    (a draft model, engine.speculative.draft): ``sampling[i]`` is stream i's (parameters,
    generator), None for its argmax; q [k, V] per stream, None where the proposals are argmaxes."""

    def propose_sampled(
        self,
        streams: Sequence[tuple[Hashable, Sequence[int]]],
        k: int,
        sampling: Sequence[tuple[SamplingParams, torch.Generator] | None],
    ) -> tuple[list[list[int]], list[torch.Tensor | None]]: ...


class HybridProposer:
    """Suffix match first; where it finds nothing, the phrase table; then the draft model, if any
    (seed 000's order)."""

    method = "hybrid"

    def __init__(self, ngram: NgramProposer, phrases: PhraseTable, draft: BatchProposer | None = None):
        self.ngram, self.phrases, self.draft = ngram, phrases, draft

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        return self.ngram.propose(tokens, k) or self.phrases.propose(tokens, k)

    def propose_many(self, streams: Sequence[tuple[Hashable, Sequence[int]]], k: int) -> list[list[int]]:
        out = [self.propose(tokens, k) for _, tokens in streams]
        rest = [i for i, proposal in enumerate(out) if not proposal]
        if self.draft is not None and rest:
            for i, proposal in zip(rest, self.draft.propose_many([streams[i] for i in rest], k), strict=True):
                out[i] = proposal
        return out

    def forget(self, key: Hashable) -> None:
        if self.draft is not None:
            self.draft.forget(key)


def simple_proposer(config: SpeculativeConfig, draft: BatchProposer | None = None) -> Proposer:
    """The proposer ``config.method`` names, from the ones that need no model (a draft model is
    loaded by engine.speculative.build and passed in as ``draft`` for hybrid)."""
    if config.method == "draft_model":
        raise InputError(
            "the draft_model proposer loads a model: build it with engine.speculative.build.build_proposer"
        )
    ngram = NgramProposer(config.prompt_lookup_max, config.prompt_lookup_min)
    if config.method == "ngram":
        return ngram
    phrases = PhraseTable.load(config.phrase_table) if config.phrase_table else PhraseTable(config.phrase_context)
    return phrases if config.method == "phrase" else HybridProposer(ngram, phrases, draft)
