"""The ``mtp`` proposer: a checkpoint's own multi-token-prediction layers propose the next tokens.

An MTP chain (Inkling's, engine.models.inkling_mtp) reads the target's final hidden state g_r of
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

Where it runs: in the process that computes the target's last layers and has the hidden rows
(``modelfleet generate``); the fleet's head does not see the tail's hidden states (see
engine.speculative.config).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Protocol

import torch

from ..errors import ConfigError
from ..spec import load_spec


class MtpChain(Protocol):
    """What the proposer needs of an MTP module (engine.models.inkling_mtp.InklingMtp)."""

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

    @classmethod
    def load(cls, target: str | Path, max_streams: int, max_context: int, device: str = "cpu") -> MtpProposer:
        spec = load_spec(target)
        if spec.family != "inkling":
            raise ConfigError(
                f'speculative method "mtp" reads Inkling MTP layers (num_mtp_layers); {target} is {spec.family}. '
                "DeepSeek-V3/V4 MTP layers are not wired to the proposer yet: use ngram, phrase or draft_model"
            )
        if not spec.get("num_mtp_layers"):
            raise ConfigError(f'{target} has no MTP layers (config.json num_mtp_layers is 0): "mtp" cannot propose')
        from ..models.inkling_mtp import InklingMtp

        chain = InklingMtp.load(target, device=device)
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
        n = len(tokens) - 1  # rows 0..n-1 have hidden states the chain can read; x_n was just sampled
        rows = self.hidden.get(slot, {})
        start = max(0, min(self.clean.get(slot, 0), n) - self.depths)
        if k < 1 or n < 1 or any(p not in rows for p in range(start, n)):
            return []  # the target has not computed those rows (nothing to read yet)
        self.chain.rewind(slot, start)
        hidden = torch.stack([rows[p] for p in range(start, n)])
        drafts, _ = self.chain.draft(slot, start, hidden, tokens[start + 1 : n + 1])
        self.clean[slot] = n
        for position in [p for p in rows if p < n - self.depths]:
            del rows[position]  # never read again: the next proposal starts at n - depths or later
        return drafts[:k]

    def forget(self, key: Hashable) -> None:
        slot = getattr(key, "slot", None)
        if isinstance(slot, int) and slot >= 0:
            self.hidden.pop(slot, None)
            self.clean.pop(slot, None)
            self.chain.release(slot)
