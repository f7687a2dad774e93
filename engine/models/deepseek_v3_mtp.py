"""DeepSeek-V3's multi-token-prediction layer (``num_nextn_predict_layers``; the checkpoint holds it
as layer ``num_hidden_layers``: ``model.layers.{L}.{enorm,hnorm,eh_proj,shared_head.norm,
shared_head.head}`` beside a full decoder block's tensors, MLA and MoE, under the same prefix).

From the target's final hidden row h_t (after the model's final norm, as vLLM and SGLang hand it
to this layer) and the token x_{t+1}, the logits of x_{t+2} (DeepSeek-V3 technical report, §2.2):

    x = eh_proj(concat(enorm(embed(x_{t+1})), hnorm(h_t)))     (the embedding first, as eh_proj's
    logits = shared_head.head(shared_head.norm(block(x)))       columns are laid out)

The embedding is the model's (the checkpoint's copy under the layer's prefix is the same tensor);
the head is the layer's own ``shared_head.head`` where present, else the model's ``lm_head``. The
block attends over its own per-stream latent cache (:meth:`DeepseekV3Mtp.allocate`), as a shard's
layer does; transformers' save_pretrained drops these tensors, so only DeepSeek's released
checkpoints (or ones written like them) carry it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import CheckpointError, ConfigError
from ..layers import RMSNorm
from ..spec import ModelSpec
from ..weights import LayerWeights
from .common import dense
from .deepseek_v3 import build_layer, cache_layout
from .mtp_layer import MtpLayer


class DeepseekV3Mtp(MtpLayer):
    """One next-token-prediction layer; see the module docstring for what it computes."""

    reads = "normed"  # the target's hidden rows after its final norm (Shard.keep_hidden)

    def __init__(self, spec: ModelSpec, index: int, w: LayerWeights, embed: torch.Tensor, head: torch.Tensor):
        layer_index = spec.num_layers + index
        super().__init__(spec, layer_index, build_layer(spec, layer_index, w), cache_layout(spec, layer_index), embed,
                         head)  # fmt: skip
        self.enorm = RMSNorm(w.get("enorm.weight"), spec.rms_norm_eps)
        self.hnorm = RMSNorm(w.get("hnorm.weight"), spec.rms_norm_eps)
        self.eh_proj = dense(w, "eh_proj")  # [hidden, 2 * hidden]: embedding columns, then hidden's
        self.norm = RMSNorm(w.get("shared_head.norm.weight"), spec.rms_norm_eps)

    def combine(self, embedded: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        return out

    def read_out(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(self.norm(x))
        return logits


def load_mtp(model_dir: str | Path, index: int = 0, *, dtype: torch.dtype = torch.float32,
             device: str | torch.device = "cpu") -> DeepseekV3Mtp:  # fmt: skip
    """MTP layer ``index`` of a DeepSeek-V3 checkpoint (``model.layers.{num_hidden_layers + index}.``)."""
    from ..checkpoint import Checkpoint
    from ..spec import load_spec

    spec = load_spec(model_dir)
    count = int(spec.get("num_nextn_predict_layers", 0) or 0)
    if not 0 <= index < count:
        raise ConfigError(f"config.json's num_nextn_predict_layers={count} has no MTP layer {index}")
    root = LayerWeights(Checkpoint(model_dir), "", dtype, torch.device(device))
    prefix = f"model.layers.{spec.num_layers + index}."
    if prefix + "eh_proj.weight" not in root:
        raise CheckpointError(
            f"{model_dir} holds no '{prefix}eh_proj.weight': its MTP layer was not saved (transformers' "
            "save_pretrained drops it); use DeepSeek's released checkpoint, or another speculative method"
        )
    w = root.sub(prefix)
    head = w.get("shared_head.head.weight") if "shared_head.head.weight" in w else root.get("lm_head.weight")
    return DeepseekV3Mtp(spec, index, w, root.get("model.embed_tokens.weight"), head)
