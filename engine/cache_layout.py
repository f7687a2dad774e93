"""What each decoder layer caches per stream: the one answer, given by each model family.

``cache_layout(spec, layer_index)`` asks the layer's family (``engine/models/<family>.py``) for its
:class:`LayerCache`, read from the spec alone (no weights), so that the shard that allocates the
cache (:meth:`engine.shard.Shard.allocate_cache`) and the planners that reserve memory for it
(``modelfleet plan``, the operator's model summary) agree. Torch-free: families are imported
only when asked.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .models import family

if TYPE_CHECKING:
    from .spec import ModelSpec

# Positions a sliding-window layer keeps beyond its window, so that a speculative rewind of up to
# this many positions (+1) stays exact (engine.kvcache's ring).
REWIND_SLACK_POSITIONS = 64


@dataclass(frozen=True)
class LayerCache:
    """What one decoder layer caches for one stream.

    ``shapes``: per position, each cached tensor's shape, e.g. ``{"k": (kv_heads, head_dim),
    "v": (kv_heads, head_dim)}`` or MLA's ``{"latent": (kv_lora_rank + rope_dim,)}``.
    ``window``: a sliding-window layer's window (it keeps ``window + rewind slack`` positions),
    None when every position stays. ``split_heads``: tensor parallelism splits axis 0 (heads)
    of every shape over the ranks; False when every rank caches all of it (MLA's shared latent).
    """

    shapes: Mapping[str, tuple[int, ...]]
    window: int | None = None
    split_heads: bool = True

    @property
    def values_per_position(self) -> int:
        return sum(math.prod(shape) for shape in self.shapes.values())

    @property
    def kept_positions(self) -> int | None:
        """Positions a stream keeps however long its context: window + slack; None for all."""
        return None if self.window is None else self.window + REWIND_SLACK_POSITIONS

    def positions(self, context_length: int, rewind_slack: int = REWIND_SLACK_POSITIONS) -> int:
        """Positions a stream keeps at ``context_length``: all, or the window plus the slack."""
        return context_length if self.window is None else min(context_length, self.window + rewind_slack)

    def nbytes(self, streams: int, context_length: int, itemsize: int) -> int:
        """Bytes ``streams`` streams of ``context_length`` positions take, ``itemsize`` bytes a value."""
        return streams * self.positions(context_length) * self.values_per_position * itemsize

    def for_rank(self, tp_size: int) -> LayerCache:
        """One tensor rank's share (of a group of ``tp_size``); heads were checked to divide."""
        if tp_size == 1 or not self.split_heads:
            return self
        shapes = {name: (shape[0] // tp_size, *shape[1:]) for name, shape in self.shapes.items()}
        return LayerCache(shapes, self.window, self.split_heads)


def cache_layout(spec: ModelSpec, layer_index: int) -> LayerCache:
    """What layer ``layer_index`` of ``spec``'s model caches, as its family answers it."""
    layout: LayerCache = family(spec.family).cache_layout(spec, layer_index)
    return layout


def cache_layouts(spec: ModelSpec) -> list[LayerCache]:
    """:func:`cache_layout` of every layer, in order."""
    return [cache_layout(spec, i) for i in range(spec.num_layers)]
