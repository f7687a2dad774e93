"""What the families' next-token-prediction (MTP) layers share: a full decoder block with its own
per-stream state, fed the embedding of token t + 1 and the target's hidden rows at t, read out as
the logits of token t + 2. A family says how the two inputs enter the block (:meth:`MtpLayer.combine`)
and how the block's output becomes logits (:meth:`MtpLayer.read_out`)."""

from __future__ import annotations

import torch
from torch import nn

from ..cache_layout import REWIND_SLACK_POSITIONS, LayerCache
from ..frame import Frame, segments_of
from ..kvcache import LayerKV
from ..layers import Dense, FrameContext
from ..spec import ModelSpec


class MtpLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_index: int, block: nn.Module, layout: LayerCache, embed: torch.Tensor,
                 head: torch.Tensor):  # fmt: skip
        super().__init__()
        self.spec, self.layer_index, self.layout = spec, layer_index, layout
        self.block = block
        self.embed = nn.Parameter(embed, requires_grad=False)
        self.head = Dense(head)
        self.kv: LayerKV | None = None

    def combine(self, embedded: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The block's input from the embeddings of the tokens at t + 1 and the hidden rows at t."""
        raise NotImplementedError

    def read_out(self, x: torch.Tensor) -> torch.Tensor:
        """Logits from the block's output."""
        raise NotImplementedError

    def allocate(self, max_slots: int, max_context: int, rewind_slack: int = REWIND_SLACK_POSITIONS) -> None:
        self.kv = self.layout.state(max_slots, max_context, self.embed.dtype, self.embed.device, rewind_slack)

    @torch.inference_mode()
    def forward(self, frame: Frame) -> torch.Tensor:
        """frame.hidden: the target's hidden rows at positions t (as the family reads them);
        frame.token_ids: the tokens at t + 1; segments as a shard's (each slot's state advances with
        its rows). -> float32 logits [R, vocab] for the tokens at t + 2."""
        if self.kv is None:
            self.allocate(1, min(self.spec.max_position_embeddings, 4096))
        assert self.kv is not None and frame.hidden is not None and frame.token_ids is not None
        ids = frame.token_ids.to(self.embed.device)
        x = self.combine(self.embed[ids], frame.hidden.to(self.embed.device, self.embed.dtype))
        segments = segments_of(frame.slots.tolist(), frame.positions.tolist())
        x = self.block(x, FrameContext(segments, frame.positions.to(ids.device), token_ids=ids), self.kv)
        return self.read_out(x).to(torch.float32)
