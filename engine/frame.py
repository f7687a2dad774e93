"""Frames: rows of independent streams travelling through a shard together.

A frame holds R rows. Row r belongs to the stream in KV slot ``slots[r]`` at absolute position
``positions[r]``. Rows of one stream are consecutive in the frame and in position (a prefill
window, or a single decode row); rows of different streams are independent. The first shard
takes ``token_ids`` [R]; every later shard takes ``hidden`` [R, *residual_shape] in float32
(``engine.residual.residual_shape``: [R, hidden_size] for most families), and may also be given the
rows' ``token_ids`` (a family routing by token, DeepSeek-V4's hash layers, reads them).
``output_rows`` names the rows whose output is wanted at the end of the model (the rows a token is
sampled from): the last shard computes the head for those rows only. None: every row.
``decode_only`` says every row's output is wanted (each stream's decode row, or its verify window)
and no stream starts here: a stage may run such a frame as a fixed-shape step (engine.static_decode).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import InputError


@dataclass(frozen=True)
class Segment:
    """Rows [row_start, row_end) of the frame: one stream's positions [pos_start, pos_start + n)."""

    slot: int
    row_start: int
    row_end: int
    pos_start: int

    @property
    def rows(self) -> int:
        return self.row_end - self.row_start

    @property
    def pos_end(self) -> int:
        return self.pos_start + self.rows


@dataclass
class Frame:
    slots: torch.Tensor  # [R] int64
    positions: torch.Tensor  # [R] int64
    token_ids: torch.Tensor | None = None  # [R] int64: embedded by the first shard, read by hash routing
    hidden: torch.Tensor | None = None  # [R, *residual_shape] float32, later shards
    output_rows: torch.Tensor | None = None  # [N] int64, increasing row indices; None: all R rows
    decode_only: bool = False  # every row an output row, no stream starting (a fixed-shape step may run it)

    @property
    def rows(self) -> int:
        return int(self.slots.shape[0])

    def keep_rows(self, rows: list[int]) -> Frame:
        """The frame of only ``rows`` (increasing), with its output rows renumbered."""
        index = torch.tensor(rows, dtype=torch.int64)
        output = None
        if self.output_rows is not None:
            kept = {r: i for i, r in enumerate(rows)}
            output = torch.tensor([kept[r] for r in self.output_rows.tolist() if r in kept], dtype=torch.int64)
        return Frame(
            self.slots[index], self.positions[index],
            token_ids=None if self.token_ids is None else self.token_ids[index],
            hidden=None if self.hidden is None else self.hidden[index],
            output_rows=output, decode_only=self.decode_only,
        )  # fmt: skip

    @staticmethod
    def of_streams(streams: list[tuple[int, int, list[int]]], hidden: torch.Tensor | None = None) -> Frame:
        """Build a frame from (slot, first position, token ids) per stream (the ids go with ``hidden`` too)."""
        slots: list[int] = []
        positions: list[int] = []
        tokens: list[int] = []
        for slot, pos, ids in streams:
            slots += [slot] * len(ids)
            positions += list(range(pos, pos + len(ids)))
            tokens += ids
        return Frame(
            slots=torch.tensor(slots, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            token_ids=torch.tensor(tokens, dtype=torch.int64),
            hidden=hidden,
        )


def segments_of(slots: list[int], positions: list[int]) -> list[Segment]:
    """Split rows into per-stream segments; a stream's rows must be adjacent and consecutive."""
    segments: list[Segment] = []
    start = 0
    seen: set[int] = set()
    for r in range(1, len(slots) + 1):
        if r < len(slots) and slots[r] == slots[start]:
            if positions[r] != positions[r - 1] + 1:
                raise InputError(
                    f"frame rows {r - 1},{r} of slot {slots[r]} have positions {positions[r - 1]},{positions[r]}; "
                    "a stream's rows must have consecutive positions"
                )
            continue
        if slots[start] in seen:
            raise InputError(f"slot {slots[start]} appears in two separate runs of the frame; keep its rows adjacent")
        seen.add(slots[start])
        segments.append(Segment(slots[start], start, r, positions[start]))
        start = r
    return segments
