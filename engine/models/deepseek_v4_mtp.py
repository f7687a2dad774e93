"""DeepSeek-V4's multi-token-prediction layers (``mtp.{k}.``, ``num_nextn_predict_layers``)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..cache_layout import REWIND_SLACK_POSITIONS
from ..errors import CheckpointError, ConfigError
from ..frame import Frame, segments_of
from ..kvcache import LayerKV
from ..layers import Dense, FrameContext, RMSNorm
from ..spec import ModelSpec
from ..weights import LayerWeights
from .deepseek_v4 import HyperHead, build_layer
from .deepseek_v4_checkpoint import PublishedNames, dense
from .deepseek_v4_config import cache_layout


class MTPHead(nn.Module):
    """DeepSeek-V4's next-token-prediction layer (``mtp.{k}.``, ``num_nextn_predict_layers``): from
    the last layer's streams at position t and the embedding of token t + 1, the logits of token t + 2:

        x = e_proj(enorm(embed(next))) + h_proj(hnorm(streams))   (the embedding added to every stream)
        logits = head(norm(hyper_head(block(x))))

    ``block`` is a full decoder layer (layer index ``num_hidden_layers + k``); the embedding and the
    head are the model's. It keeps its own per-stream state (:meth:`allocate`), as a shard does.
    """

    def __init__(self, spec: ModelSpec, index: int, w: LayerWeights, embed: torch.Tensor, head: torch.Tensor):
        super().__init__()
        f32 = torch.float32
        self.spec, self.layer_index = spec, spec.num_layers + index
        self.block = build_layer(spec, self.layer_index, w)
        self.e_proj, self.h_proj = dense(w, "e_proj"), dense(w, "h_proj")
        self.enorm, self.hnorm, self.norm = (RMSNorm(w.get(f"{n}.weight", f32), spec.rms_norm_eps) for n in
                                             ("enorm", "hnorm", "norm"))  # fmt: skip
        eps = float(spec.get("hc_eps", 1e-6))
        self.hyper_head = HyperHead(w.get("hc_head_fn", f32), w.get("hc_head_base", f32), w.get("hc_head_scale", f32),
                                    eps, spec.rms_norm_eps)  # fmt: skip
        self.embed = nn.Parameter(embed, requires_grad=False)
        self.head = Dense(head)
        self.kv: LayerKV | None = None

    def allocate(self, max_slots: int, max_context: int, rewind_slack: int = REWIND_SLACK_POSITIONS) -> None:
        layout = cache_layout(self.spec, self.layer_index)
        self.kv = layout.state(max_slots, max_context, self.embed.dtype, self.embed.device, rewind_slack)

    @torch.inference_mode()
    def forward(self, frame: Frame) -> torch.Tensor:
        """frame.hidden: the last layer's streams [R, hc_mult, hidden] at positions t; frame.token_ids:
        the tokens at t + 1; segments as a shard's (each slot's state advances with its rows).
        -> float32 logits [R, vocab] for the tokens at t + 2."""
        if self.kv is None:
            self.allocate(1, min(self.spec.max_position_embeddings, 4096))
        assert self.kv is not None and frame.hidden is not None and frame.token_ids is not None
        ids = frame.token_ids.to(self.embed.device)
        streams = frame.hidden.to(self.embed.device, self.embed.dtype)
        x = self.e_proj(self.enorm(self.embed[ids]))[:, None, :] + self.h_proj(self.hnorm(streams))
        segments = segments_of(frame.slots.tolist(), frame.positions.tolist())
        ctx = FrameContext(segments, frame.positions.to(ids.device), token_ids=ids)
        x = self.block(x, ctx, self.kv)
        logits: torch.Tensor = self.head(self.norm(self.hyper_head(x)))
        return logits.to(torch.float32)


def load_mtp(model_dir: str | Path, index: int = 0, *, dtype: torch.dtype = torch.float32,
             device: str | torch.device = "cpu") -> MTPHead:  # fmt: skip
    """MTP layer ``index`` of a checkpoint (``mtp.{index}.``), with the model's embedding and head."""
    from ..checkpoint import Checkpoint
    from ..spec import load_spec

    spec = load_spec(model_dir)
    count = int(spec.get("num_nextn_predict_layers", 0))
    if not 0 <= index < count:
        raise ConfigError(f"config.json's num_nextn_predict_layers={count} has no MTP layer {index}")
    root = LayerWeights(PublishedNames(Checkpoint(model_dir)), "", dtype, torch.device(device))
    if f"mtp.{index}.e_proj.weight" not in root:
        raise CheckpointError(f"{model_dir} holds no 'mtp.{index}.' tensors (transformers does not save them)")
    head_name = "head.weight" if "head.weight" in root else "lm_head.weight"
    return MTPHead(spec, index, root.sub(f"mtp.{index}."), root.get("model.embed_tokens.weight"), root.get(head_name))
