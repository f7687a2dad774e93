"""Per-slot attention state of a shard: KV tensors per layer and the slot table.

Invariants:
- A slot's state covers positions [0, length) where ``length`` is the slot's entry in
  :class:`SlotTable`; a frame segment for that slot must start exactly at ``length``, or at 0,
  which starts a new stream in the slot (the head of a pipeline owns slot assignment, so a
  stage that missed a release still serves the slot's next stream correctly).
- Full-attention layers store every position: k, v: [slots, kv_heads, capacity, head_dim].
- Sliding-window layers keep a ring of ``window + rewind_slack`` positions (position p lives at
  index p % capacity), so a rewind of up to ``rewind_slack + 1`` positions stays exact.
- ``rewind(slot, position)`` only moves ``length`` back: entries past it are overwritten by the
  next segment, never read before that.
"""

from __future__ import annotations

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
    """One attention layer's cache of per-position tensors (k and v, or MLA's latents)."""

    def __init__(
        self,
        max_slots: int,
        capacity: int,
        shapes: dict[str, tuple[int, ...]],
        dtype: torch.dtype,
        device: torch.device,
        ring: bool = False,
    ):
        self.capacity = capacity
        self.ring = ring
        # each entry: [slots, capacity, *shape]
        self.tensors = {
            name: torch.zeros((max_slots, capacity, *shape), dtype=dtype, device=device)
            for name, shape in shapes.items()
        }

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def write(self, slot: int, pos_start: int, values: dict[str, torch.Tensor]) -> None:
        """Store rows [n, *shape] at positions [pos_start, pos_start + n)."""
        for name, rows in values.items():
            store = self.tensors[name][slot]
            n = rows.shape[0]
            if not self.ring:
                store[pos_start : pos_start + n] = rows
                continue
            keep = min(n, self.capacity)
            positions = torch.arange(pos_start + n - keep, pos_start + n, device=store.device)
            store.index_copy_(0, positions % self.capacity, rows[n - keep :])

    def read(self, slot: int, pos_start: int, pos_end: int) -> dict[str, torch.Tensor]:
        """Stored rows for positions [pos_start, pos_end): views for full layers, copies for rings."""
        if not self.ring:
            return {name: t[slot, pos_start:pos_end] for name, t in self.tensors.items()}
        index = torch.arange(pos_start, pos_end, device=next(iter(self.tensors.values())).device) % self.capacity
        return {name: t[slot].index_select(0, index) for name, t in self.tensors.items()}
