"""What each decoder layer keeps per stream: the one answer, given by each model family.

``cache_layout(spec, layer_index)`` asks the layer's family (``engine/models/<family>.py``) for its
:class:`LayerCache`, read from the spec alone (no weights), so that the shard that allocates the
state (:meth:`engine.shard.Shard.allocate_cache`) and the planners that reserve memory for it
(``modelfleet plan``, the operator's model summary) agree. Torch-free: families are imported
only when asked.

A layer's state is a set of named :class:`CacheEntry` tensors, each stored as rows indexed by
position (one row per ``stride`` positions):
- attention's K and V (or MLA's latent): a row per position, every position or a window of them;
- a short convolution's history: a row per position of its input, over a window of ``kernel``;
- a compressor's entries: one row per block of ``stride`` positions, and the raw inputs of the
  blocks still open as a windowed entry of their own.
An entry over a window keeps ``window + REWIND_SLACK_POSITIONS`` positions as a ring, so a rewind of
up to the slack (+1) finds every input it needs still stored: the ring is the journal that makes
state which cannot be truncated (a convolution carry, a compressor's open block) rewindable.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from .kvcache import LayerKV
from .models import family

if TYPE_CHECKING:
    import torch

    from .spec import ModelSpec

# Positions a windowed entry keeps beyond its window, so that a speculative rewind of up to this
# many positions (+1) stays exact (engine.kvcache's ring).
REWIND_SLACK_POSITIONS = 64


def rows_kept(
    context_length: int, window: int | None, stride: int = 1, rewind_slack: int = REWIND_SLACK_POSITIONS
) -> int:
    """Rows a stream keeps at ``context_length``: one per ``stride`` positions, of all positions or
    of the window plus the slack. The one formula the shard, the planner and the operator use."""
    positions = context_length if window is None else min(context_length, window + rewind_slack)
    return -(-positions // stride)


@dataclass(frozen=True)
class CacheEntry:
    """One tensor a layer keeps per stream, as rows of ``shape``.

    ``window``: positions one step reads, the newest included (a sliding window W; a
    convolution's kernel K, which reads the K - 1 before the newest), so that keeping ``window +
    slack`` positions leaves a rewind of up to ``slack + 1`` exact; None when every position
    stays. ``stride``: positions per row (a compressor's block). ``split``: tensor parallelism
    splits axis 0 (heads, channels) over the ranks; False when every rank keeps all of it (MLA's
    shared latent)."""

    shape: tuple[int, ...]
    window: int | None = None
    stride: int = 1
    split: bool = True

    @property
    def values_per_row(self) -> int:
        return math.prod(self.shape)

    def rows(self, context_length: int, rewind_slack: int = REWIND_SLACK_POSITIONS) -> int:
        return rows_kept(context_length, self.window, self.stride, rewind_slack)

    def is_ring(self, context_length: int, rewind_slack: int = REWIND_SLACK_POSITIONS) -> bool:
        """Whether the entry keeps fewer rows than the context has (a ring: row r at r % rows)."""
        return self.rows(context_length, rewind_slack) < rows_kept(context_length, None, self.stride)

    def rewind_limit(self, context_length: int, rewind_slack: int = REWIND_SLACK_POSITIONS) -> int | None:
        """Deepest rewind (in positions) that leaves every input the layer reads stored; None: any."""
        if self.window is None or not self.is_ring(context_length, rewind_slack):
            return None
        return self.rows(context_length, rewind_slack) * self.stride - self.window + 1


@dataclass(frozen=True)
class LayerCache:
    """What one decoder layer keeps for one stream: its named entries."""

    entries: Mapping[str, CacheEntry]

    @classmethod
    def attention(
        cls, shapes: Mapping[str, tuple[int, ...]], window: int | None = None, split_heads: bool = True
    ) -> LayerCache:
        """Entries of a row per position, all over one ``window``: K and V, or a latent."""
        return cls({name: CacheEntry(shape, window, 1, split_heads) for name, shape in shapes.items()})

    def nbytes(self, streams: int, context_length: int, itemsize: int) -> int:
        """Bytes ``streams`` streams of ``context_length`` positions take, ``itemsize`` bytes a value."""
        return streams * itemsize * sum(e.rows(context_length) * e.values_per_row for e in self.entries.values())

    def rewind_limit(self, context_length: int, rewind_slack: int = REWIND_SLACK_POSITIONS) -> int | None:
        limits = [e.rewind_limit(context_length, rewind_slack) for e in self.entries.values()]
        return min((n for n in limits if n is not None), default=None)

    def state(
        self, max_slots: int, max_context: int, dtype: torch.dtype, device: torch.device,
        rewind_slack: int = REWIND_SLACK_POSITIONS,
    ) -> LayerKV:  # fmt: skip
        """The per-slot state of this layout for ``max_slots`` streams of ``max_context`` positions."""
        entries = self.entries
        return LayerKV(
            max_slots,
            {name: e.rows(max_context, rewind_slack) for name, e in entries.items()},
            {name: e.shape for name, e in entries.items()},
            dtype,
            device,
            {name: e.is_ring(max_context, rewind_slack) for name, e in entries.items()},
        )

    def for_rank(self, tp_size: int) -> LayerCache:
        """One tensor rank's share (of a group of ``tp_size``); heads were checked to divide."""
        if tp_size == 1:
            return self
        return LayerCache(
            {
                name: replace(e, shape=(e.shape[0] // tp_size, *e.shape[1:])) if e.split else e
                for name, e in self.entries.items()
            }
        )


def cache_layout(spec: ModelSpec, layer_index: int) -> LayerCache:
    """What layer ``layer_index`` of ``spec``'s model keeps, as its family answers it."""
    layout: LayerCache = family(spec.family).cache_layout(spec, layer_index)
    return layout


def cache_layouts(spec: ModelSpec) -> list[LayerCache]:
    """:func:`cache_layout` of every layer, in order."""
    return [cache_layout(spec, i) for i in range(spec.num_layers)]
