"""Prefetch into the expert stores' device slots: the experts a layer's next step will use, copied
ahead of it, so its device pairs find them in slots (issue 32: "prefetch of the next layer's likely
experts where the router of the current layer allows it").

Two sources, a user's choice (:class:`ExpertPrefetch`), since a wrong guess costs copy bandwidth:

- **exact**: a hash-routed layer (DeepSeek-V4's ``hash_moe``) takes the experts ``tid2eid[token
  id]``, known from the frame's token ids before any layer runs: at the start of each frame the
  shard prefetches every hash layer's experts (:class:`HashPrefetch`, a shard's ``before_step``).
- **predicted**: a learned router's choice is known only at its layer; while layer L's store serves
  its step, the next MoE layer's router (its projection and routing rule) is applied to layer L's
  MoE input and its top-k experts are prefetched into the next layer's slots (Eliseev & Mazur 2023,
  "Fast inference of MoE language models with offloading"; Pre-gated MoE). The predicted ids come to
  the host in the same copy as layer L's routing (:class:`NextLayerGuess`, a store's ``lookahead``).

Which experts, in which order, is :func:`by_demand` (pure); the stores count prefetched experts,
bytes and prefetch hits (a prefetched expert the layer's next step used).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .expert_placement import ExpertPrefetch
from .expert_store import ExpertStore
from .frame import Frame
from .layers import SparseMoE


def by_demand(index: torch.Tensor, limit: int) -> list[int]:
    """The distinct experts of a step's routing ``index`` [T, k] (host), those with the most rows
    first (ties: the lower id), at most ``limit``: what to prefetch into ``limit`` slots."""
    if limit <= 0 or index.numel() == 0:
        return []
    experts, counts = torch.unique(index.reshape(-1), return_counts=True)
    order = sorted(zip(counts.tolist(), experts.tolist(), strict=True), key=lambda ce: (-ce[0], ce[1]))
    return [int(e) for _, e in order[:limit]]


@dataclass
class NextLayerGuess:
    """A store's lookahead: the next MoE layer's router applied to this layer's MoE input."""

    router_proj: nn.Module
    route: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]
    target: ExpertStore

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        return self.route(self.router_proj(x))[0]

    def prefetch(self, index: torch.Tensor, after: torch.cuda.Event | None) -> None:
        self.target.prefetch(by_demand(index, self.target.config.num_slots), after)


@dataclass
class HashPrefetch:
    """At the start of a frame: every hash-routed layer's experts, ``tid2eid[token ids]`` (tables
    on the host, copied once), into its store's slots."""

    layers: list[tuple[torch.Tensor, ExpertStore]]  # (tid2eid [vocab, k] on the host, the layer's store)

    def __call__(self, frame: Frame) -> None:
        if frame.token_ids is None:
            return
        ids = frame.token_ids.to("cpu")
        for table, store in self.layers:
            store.prefetch(by_demand(table[ids], store.config.num_slots))


def hash_table(moe: SparseMoE) -> torch.Tensor | None:
    """A hash-routed layer's token-to-experts table (None: the layer routes by score)."""
    table = getattr(moe.route, "tid2eid", None)
    return table if isinstance(table, torch.Tensor) else None


def install_prefetch(moes: Sequence[SparseMoE], mode: ExpertPrefetch) -> HashPrefetch | None:
    """Wire prefetch into the stores of ``moes`` (a stage's MoE blocks in layer order): with
    PREDICTED, each store whose next MoE block has a store with slots and a learned router gets a
    :class:`NextLayerGuess`; with EXACT or PREDICTED, the hash-routed layers' stores are returned
    as a :class:`HashPrefetch` for the shard to call with each frame (None: none)."""
    if mode is ExpertPrefetch.OFF:
        return None
    hashed = []
    for moe, nxt in zip(moes, [*moes[1:], None], strict=True):
        store, table = moe.experts, hash_table(moe)
        if not isinstance(store, ExpertStore):
            continue
        if table is not None and store.config.num_slots > 0:
            hashed.append((table.to("cpu"), store))
        if mode is ExpertPrefetch.PREDICTED and nxt is not None and (guess := next_layer_guess(nxt)) is not None:
            store.lookahead = guess
    return HashPrefetch(hashed) if hashed else None


def next_layer_guess(moe: SparseMoE) -> NextLayerGuess | None:
    """The lookahead that predicts ``moe``'s experts from the block before it (None: ``moe`` has
    no store with slots, or routes by hash, which is exact)."""
    target = moe.experts
    if not isinstance(target, ExpertStore) or target.config.num_slots == 0 or hash_table(moe) is not None:
        return None
    return NextLayerGuess(moe.router_proj, moe.route, target)
