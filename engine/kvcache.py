"""Per-slot state of a shard: each layer's entries (KV, convolution history, ...) and the slot table.

Invariants:
- A slot's state covers positions [0, length) where ``length`` is the slot's entry in
  :class:`SlotTable`; a frame segment for that slot must start exactly at ``length``, or at 0,
  which starts a new stream in the slot (the head of a pipeline owns slot assignment, so a
  stage that missed a release still serves the slot's next stream correctly).
- Entries kept at every position (full attention's k, v: [slots, capacity, kv_heads, head_dim])
  store position p at index p.
- Windowed entries (sliding-window attention, a convolution's history) keep a ring of
  ``window + rewind_slack`` positions (position p at index p % capacity), so a rewind of up to
  ``rewind_slack + 1`` positions stays exact (engine.cache_layout).
- ``rewind(slot, position)`` only moves ``length`` back: entries past it are overwritten by the
  next segment, never read before that.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from .errors import CapacityError


@dataclass(frozen=True)
class SlotState:
    """One stream's state on one stage, to move it elsewhere: the slot's length and each cached
    layer's stored rows ({name: [capacity, *shape]}, CPU tensors; a ring layer as its ring)."""

    length: int
    layers: tuple[dict[str, torch.Tensor], ...]


@dataclass
class SlotTable:
    max_slots: int
    max_context: int
    rewind_limit: int | None = None  # deepest rewind every layer can honour; None = unlimited

    def __post_init__(self) -> None:
        self.lengths: list[int | None] = [None] * self.max_slots  # None: free

    def acquire(self) -> int:
        for slot, length in enumerate(self.lengths):
            if length is None:
                self.lengths[slot] = 0
                return slot
        raise CapacityError(f"all {self.max_slots} KV slots are in use; finish or cancel a stream, or raise max_slots")

    def claim(self, slot: int) -> None:
        """Mark a slot in use by an id chosen elsewhere (a pipeline's head picks slot ids)."""
        self._check_slot(slot)
        if self.lengths[slot] is None:
            self.lengths[slot] = 0

    def release(self, slot: int) -> None:
        self._check_slot(slot)
        self.lengths[slot] = None

    def length(self, slot: int) -> int:
        self._check_slot(slot)
        length = self.lengths[slot]
        return 0 if length is None else length

    def in_use(self) -> int:
        return sum(length is not None for length in self.lengths)

    def rewind(self, slot: int, position: int) -> None:
        length = self.length(slot)
        if not 0 <= position <= length:
            raise CapacityError(f"cannot rewind slot {slot} to position {position}: it holds {length} positions")
        if self.rewind_limit is not None and length - position > self.rewind_limit:
            raise CapacityError(
                f"rewind of slot {slot} by {length - position} positions exceeds the sliding-window "
                f"ring's slack ({self.rewind_limit}); raise rewind_slack"
            )
        self.lengths[slot] = position

    def check_segment(self, slot: int, pos_start: int, rows: int) -> None:
        self._check_slot(slot)
        length = self.lengths[slot] or 0
        if pos_start != length and pos_start != 0:  # position 0 starts a new stream in the slot
            raise CapacityError(f"slot {slot} holds {length} positions; a segment must start there, not at {pos_start}")
        if pos_start + rows > self.max_context:
            raise CapacityError(
                f"slot {slot} would reach position {pos_start + rows}, beyond the context budget of "
                f"{self.max_context} positions per slot; shorten the prompt or raise max_context"
            )

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_slots:
            raise CapacityError(f"slot {slot} is outside this shard's {self.max_slots} KV slots")


class LayerKV:
    """One layer's per-slot state: its :class:`~engine.cache_layout.LayerCache` entries as tensors.

    Each entry is stored as ``[slots, capacity, *shape]`` rows; its row index is the position
    for an entry of stride 1 (K, V, a latent, a convolution's inputs) and ``position // stride``
    for a strided one (a compressor's blocks). An entry whose capacity is less than the context's
    rows is a ring: row r lives at r % capacity. ``capacity`` and ``ring`` describe the layout's
    first entry (attention's, which every family lists first).
    """

    def __init__(
        self,
        max_slots: int,
        capacities: dict[str, int],
        shapes: dict[str, tuple[int, ...]],
        dtype: torch.dtype,
        device: torch.device,
        rings: dict[str, bool] | None = None,
    ):
        self.capacities = dict(capacities)
        self.rings = dict(rings or dict.fromkeys(shapes, False))
        # each entry: [slots, capacity, *shape]
        self.tensors = {
            name: torch.zeros((max_slots, self.capacities[name], *shape), dtype=dtype, device=device)
            for name, shape in shapes.items()
        }
        first = next(iter(shapes))
        self.capacity, self.ring = self.capacities[first], self.rings[first]

    @classmethod
    def uniform(
        cls,
        max_slots: int,
        capacity: int,
        shapes: dict[str, tuple[int, ...]],
        dtype: torch.dtype,
        device: torch.device,
        ring: bool = False,
    ) -> LayerKV:
        """Every entry at one capacity (K and V of one attention layer)."""
        return cls(max_slots, dict.fromkeys(shapes, capacity), shapes, dtype, device, dict.fromkeys(shapes, ring))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def write(self, slot: int, start: int, values: dict[str, torch.Tensor]) -> None:
        """Store each entry's rows [n, *shape] at row indices [start, start + n)."""
        for name, rows in values.items():
            store, capacity = self.tensors[name][slot], self.capacities[name]
            n = rows.shape[0]
            if not self.rings[name]:
                store[start : start + n] = rows
                continue
            keep = min(n, capacity)
            index = torch.arange(start + n - keep, start + n, device=store.device)
            store.index_copy_(0, index % capacity, rows[n - keep :])

    def read(self, slot: int, start: int, end: int, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """Stored rows [start, end) of ``names`` (default: every entry): views where stored in
        order, copies from rings."""
        out = {}
        for name in self.tensors if names is None else names:
            store = self.tensors[name][slot]
            if not self.rings[name]:
                out[name] = store[start:end]
                continue
            index = torch.arange(start, end, device=store.device) % self.capacities[name]
            out[name] = store.index_select(0, index)
        return out
