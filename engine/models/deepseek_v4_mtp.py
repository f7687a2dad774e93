"""DeepSeek-V4's multi-token-prediction layers (``mtp.{k}.``, ``num_nextn_predict_layers``)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import CheckpointError, ConfigError
from ..layers import RMSNorm
from ..spec import ModelSpec
from ..weights import LayerWeights
from .deepseek_v4 import HyperHead, build_layer
from .deepseek_v4_checkpoint import PublishedNames, dense
from .deepseek_v4_config import cache_layout
from .mtp_layer import MtpLayer


class MTPHead(MtpLayer):
    """DeepSeek-V4's next-token-prediction layer (``mtp.{k}.``, ``num_nextn_predict_layers``): from
    the last layer's streams at position t and the embedding of token t + 1, the logits of token t + 2:

        x = e_proj(enorm(embed(next))) + h_proj(hnorm(streams))   (the embedding added to every stream)
        logits = head(norm(hyper_head(block(x))))

    ``block`` is a full decoder layer (layer index ``num_hidden_layers + k``); the embedding and the
    head are the model's. It keeps its own per-stream state (:meth:`allocate`), as a shard does.
    """

    def __init__(self, spec: ModelSpec, index: int, w: LayerWeights, embed: torch.Tensor, head: torch.Tensor):
        f32 = torch.float32
        layer_index = spec.num_layers + index
        super().__init__(spec, layer_index, build_layer(spec, layer_index, w), cache_layout(spec, layer_index), embed,
                         head)  # fmt: skip
        self.e_proj, self.h_proj = dense(w, "e_proj"), dense(w, "h_proj")
        self.enorm, self.hnorm, self.norm = (RMSNorm(w.get(f"{n}.weight", f32), spec.rms_norm_eps) for n in
                                             ("enorm", "hnorm", "norm"))  # fmt: skip
        eps = float(spec.get("hc_eps", 1e-6))
        self.hyper_head = HyperHead(w.get("hc_head_fn", f32), w.get("hc_head_base", f32), w.get("hc_head_scale", f32),
                                    eps, spec.rms_norm_eps)  # fmt: skip

    def combine(self, embedded: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden``: the last layer's streams [R, hc_mult, hidden]; the embedding joins every stream."""
        out: torch.Tensor = self.e_proj(self.enorm(embedded))[:, None, :] + self.h_proj(self.hnorm(hidden))
        return out

    def read_out(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(self.norm(self.hyper_head(x)))
        return logits


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
