"""The ``mtp`` proposer: a checkpoint's own multi-token-prediction layers propose the next tokens.

An MTP chain (Inkling's, engine.models.inkling_mtp; DeepSeek-V3's or DeepSeek-V4's one layer, :class:`SingleMtp`)
reads the target's final hidden state g_r of
each row r with the token one place after it, and its depth k predicts the token k + 2 places
after r. So it proposes from what the target computed: the caller hands it every step's final
hidden rows (:meth:`MtpProposer.observe`, all rows of a step, prefill windows included), and to
propose after a stream's committed tokens x_0..x_n it runs the chain over the rows it has not
seen with a clean input: depth 0 over (g_r, x_{r+1}) for every r < n, depth k over depth k - 1's
outputs and the tokens shifted by k, the drafts appended; each depth's last row gives one draft.

State: a depth's rows whose tokens included a draft are dirty (a draft may be rejected). Each
proposal first rewinds every depth to ``n_old - depths`` (n_old: the previous proposal's n), where
every depth's rows are clean, and recomputes from there; so no depth's state ever keeps a row of
an abandoned proposal, and the only hidden rows kept are the last ``depths`` ones and the new.
The drafts are argmaxes (a one-hot q: exact at any temperature). Rows of a target step beyond the
committed tokens (rejected proposals) are never read: only positions below n are.

Where it runs: in the process that computes the target's last layers and has the hidden rows.
In ``modelfleet generate`` that is the scheduler's own process. In a fleet it is the tail
(:class:`TailMtp`): it proposes right after it samples, from the hidden rows it just computed,
and returns the proposals with the sampled tokens; the head's :class:`TailProposals` hands them
to the scheduler for the stream's next verify window. Sending the proposals (a few token ids)
rather than the hidden rows (a row of the hidden size each) back to the head is the simpler
design: the MTP layers, their state and their inputs all live where the hidden rows are made, and
the head needs nothing but ids, whose verification is exact whatever they are.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from ..errors import ConfigError
from ..spec import load_spec

if TYPE_CHECKING:
    from ..frame import Frame


class MtpChain(Protocol):
    """What the proposer needs of an MTP module (engine.models.inkling_mtp.InklingMtp, or
    :class:`SingleMtp` over DeepSeek-V3's or DeepSeek-V4's layer)."""

    depths: torch.nn.ModuleList

    def allocate_cache(self, max_slots: int, max_context: int) -> None: ...

    def release(self, slot: int) -> None: ...

    def rewind(self, slot: int, position: int) -> None: ...

    def draft(
        self, slot: int, pos_start: int, hidden: torch.Tensor, tokens: list[int]
    ) -> tuple[list[int], torch.Tensor]: ...


class MtpProposer:
    """Drafts from a target's MTP chain; stream keys are the scheduler's streams (their ``slot``
    is the target's slot, which the observed hidden rows are keyed by)."""

    method = "mtp"

    def __init__(self, chain: MtpChain):
        self.chain = chain
        self.depths = len(chain.depths)
        self.hidden: dict[int, dict[int, torch.Tensor]] = {}  # slot -> position -> g (final hidden row)
        self.clean: dict[int, int] = {}  # slot -> rows every depth holds with clean inputs

    @property
    def reads(self) -> str:
        """The hidden rows the chain takes (Shard.keep_hidden): Inkling's after the final norm."""
        return str(getattr(self.chain, "reads", "normed"))

    @classmethod
    def load(cls, target: str | Path, max_streams: int, max_context: int, device: str = "cpu") -> MtpProposer:
        """The MTP layers of an Inkling (``num_mtp_layers``) or DeepSeek-V3/V4 (``num_nextn_predict_layers``)
        checkpoint, with state for ``max_streams`` streams of ``max_context`` positions."""
        spec = load_spec(target)
        chain: MtpChain
        if spec.family == "inkling" and spec.get("num_mtp_layers"):
            from ..models.inkling_mtp import InklingMtp

            chain = InklingMtp.load(target, device=device)
        elif spec.family == "deepseek_v4" and spec.get("num_nextn_predict_layers"):
            from ..models.deepseek_v4_mtp import load_mtp

            chain = SingleMtp(load_mtp(target, device=device), reads="residual")
        elif spec.family == "deepseek_v3" and spec.get("num_nextn_predict_layers"):
            from ..models.deepseek_v3_mtp import load_mtp as load_v3_mtp

            chain = SingleMtp(load_v3_mtp(target, device=device), reads="normed")
        else:
            raise ConfigError(
                f"speculative method \"mtp\" reads a checkpoint's MTP layers (Inkling's num_mtp_layers, DeepSeek-V3's "
                f"and DeepSeek-V4's num_nextn_predict_layers); {target} ({spec.family}) has none the engine serves: use ngram, phrase, "
                "hybrid or draft_model"
            )
        chain.allocate_cache(max_streams, max_context)
        return cls(chain)

    def observe(self, slots: Sequence[int], positions: Sequence[int], hidden: torch.Tensor) -> None:
        """A target step's final hidden rows [R, H] at (slot, position) for every row."""
        for row, (slot, position) in enumerate(zip(slots, positions, strict=True)):
            self.hidden.setdefault(slot, {})[position] = hidden[row]

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        raise TypeError("the mtp proposer proposes for scheduler streams (propose_many): it needs their slots")

    @torch.inference_mode()
    def propose_many(self, streams: Sequence[tuple[Hashable, Sequence[int]]], k: int) -> list[list[int]]:
        """Up to min(k, depths) drafts per (stream, tokens so far)."""
        return [self._propose(getattr(key, "slot"), list(tokens), k) for key, tokens in streams]  # noqa: B009

    def _propose(self, slot: int, tokens: list[int], k: int) -> list[int]:
        return self.propose_at(slot, len(tokens) - 1, tokens.__getitem__, k)

    def propose_at(self, slot: int, n: int, token_at: Callable[[int], int], k: int) -> list[int]:
        """Drafts after the token at position ``n`` of the stream in ``slot`` (x_n, just sampled);
        ``token_at(p)``: the stream's committed token at position p <= n."""
        rows = self.hidden.get(slot, {})
        start = max(0, min(self.clean.get(slot, 0), n) - self.depths)
        if k < 1 or n < 1 or any(p not in rows for p in range(start, n)):
            return []  # the target has not computed those rows (nothing to read yet)
        ids = [token_at(p) for p in range(start + 1, n + 1)]  # before any state changes (KeyError: unknown)
        self.chain.rewind(slot, start)
        hidden = torch.stack([rows[p] for p in range(start, n)])
        drafts, _ = self.chain.draft(slot, start, hidden, ids)
        self.clean[slot] = n
        for position in [p for p in rows if p < n - self.depths]:
            del rows[position]  # never read again: the next proposal starts at n - depths or later
        return drafts[:k]

    def release(self, slot: int) -> None:
        self.hidden.pop(slot, None)
        self.clean.pop(slot, None)
        self.chain.release(slot)

    def forget(self, key: Hashable) -> None:
        slot = getattr(key, "slot", None)
        if isinstance(slot, int) and slot >= 0:
            self.release(slot)


class MtpLayer(Protocol):
    """One MTP layer with its own per-stream state: DeepSeek-V4's (engine.models.deepseek_v4_mtp.MTPHead)
    or DeepSeek-V3's (engine.models.deepseek_v3_mtp.DeepseekV3Mtp)."""

    def allocate(self, max_slots: int, max_context: int) -> None: ...

    def __call__(self, frame: Frame) -> torch.Tensor: ...


class SingleMtp(torch.nn.Module):
    """One MTP layer (one depth) as a chain; ``reads``: the target's hidden rows it takes
    (Shard.keep_hidden): DeepSeek-V4's the last layer's hyper-connection streams as they are
    ("residual"), DeepSeek-V3's those after the final norm ("normed"). Its state is rewound by
    moving each slot's length back (its caches keep a rewind slack, as a shard's do)."""

    def __init__(self, head: MtpLayer, reads: str):
        super().__init__()
        self.head, self.reads = head, reads
        self.depths = torch.nn.ModuleList([head])  # type: ignore[list-item]  # both layers are modules
        self.lengths: dict[int, int] = {}

    def allocate_cache(self, max_slots: int, max_context: int) -> None:
        self.head.allocate(max_slots, max_context)

    def release(self, slot: int) -> None:
        self.lengths.pop(slot, None)

    def rewind(self, slot: int, position: int) -> None:
        self.lengths[slot] = min(position, self.lengths.get(slot, 0))

    def draft(
        self, slot: int, pos_start: int, hidden: torch.Tensor, tokens: list[int]
    ) -> tuple[list[int], torch.Tensor]:
        from ..frame import Frame

        if pos_start != self.lengths.get(slot, 0) and pos_start != 0:
            raise ValueError(f"MTP slot {slot} holds {self.lengths.get(slot, 0)} rows; a draft must start there")
        logits = self.head(Frame.of_streams([(slot, pos_start, tokens)], hidden=hidden))
        self.lengths[slot] = pos_start + len(tokens)
        return [int(logits[-1].argmax())], logits[-1:]


class TailMtp:
    """The mtp proposer at a fleet's tail: it sees every frame's rows (their input tokens and
    final hidden rows), learns each window's emitted tokens, and proposes after a stream's newest."""

    def __init__(self, proposer: MtpProposer, k: int):
        self.proposer, self.k = proposer, k
        self.tokens: dict[int, dict[int, int]] = {}  # slot -> position -> token (inputs, then emitted)

    def observe(
        self, slots: Sequence[int], positions: Sequence[int], token_ids: Sequence[int], hidden: torch.Tensor
    ) -> None:
        """A frame's rows at the tail: each row's input token and final hidden row."""
        for slot, position, token in zip(slots, positions, token_ids, strict=True):
            self.tokens.setdefault(slot, {})[position] = token
        self.proposer.observe(slots, positions, hidden)

    def propose(self, slot: int, first: int, emitted: Sequence[int]) -> tuple[int, list[int]]:
        """A window of ``slot`` whose first sampled row sits at position ``first`` emitted
        ``emitted`` (the tokens at first + 1, first + 2, ...): -> (n, drafts after position n)."""
        known = self.tokens.setdefault(slot, {})
        for i, token in enumerate(emitted):
            known[first + 1 + i] = token  # what was committed there, over any rejected proposal
        n = first + len(emitted)
        try:
            drafts = self.proposer.propose_at(slot, n, known.__getitem__, self.k)
        except KeyError:  # a token the tail never saw (a stream it joined late): nothing to propose
            return n, []
        for position in [p for p in known if p < n - self.proposer.depths or p > n]:
            del known[position]  # before the next proposal's start, or a rejected proposal's
        return n, drafts

    def release(self, slot: int) -> None:
        self.tokens.pop(slot, None)
        self.proposer.release(slot)


class TailProposals:
    """The head's side of the fleet's mtp: the proposals the tail returned with each stream's
    newest token, used when the stream's next window is built (none for a stream whose newest
    token is not the one they follow)."""

    method = "mtp"

    def __init__(self) -> None:
        self.latest: dict[int, tuple[int, list[int]]] = {}  # slot -> (position they follow, drafts)

    def receive(self, slot: int, position: int, drafts: Sequence[int]) -> None:
        self.latest[slot] = (position, list(drafts))

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        raise TypeError("the tail's proposals are for scheduler streams (propose_many): they are keyed by slot")

    def propose_many(self, streams: Sequence[tuple[Hashable, Sequence[int]]], k: int) -> list[list[int]]:
        out = []
        for key, tokens in streams:
            position, drafts = self.latest.get(getattr(key, "slot", -1), (-1, []))
            out.append(drafts[:k] if position == len(tokens) - 1 else [])
        return out

    def forget(self, key: Hashable) -> None:
        self.latest.pop(getattr(key, "slot", -1), None)


def propose_at_tail(
    mtp: TailMtp,
    frame: tuple[Sequence[int], Sequence[int], Sequence[int]],
    hidden: torch.Tensor,
    emitted: Sequence[tuple[int, int, int]],
) -> list[tuple[int, int, list[int]]]:
    """The tail's proposals for a frame it just computed and sampled: ``frame`` its rows' (slots,
    positions, input tokens), ``hidden`` their final hidden rows, ``emitted`` (slot, position of
    the row that gave it, token) of every emitted token, in order -> (slot, position of the
    stream's newest token, drafts) for each stream that has some."""
    mtp.observe(*frame, hidden)
    windows: dict[int, tuple[int, list[int]]] = {}
    for slot, position, token in emitted:
        windows.setdefault(slot, (position, []))[1].append(token)
    out = []
    for slot, (first, tokens) in windows.items():
        n, drafts = mtp.propose(slot, first, tokens)
        if drafts:
            out.append((slot, n, drafts))
    return out
