"""Tiny random Inkling checkpoints built offline with transformers (``inkling_text``, and the
multimodal ``inkling_mm_model`` whose text decoder the engine serves).

Every parameter and buffer is randomised: norms and scales around one (``global_scale`` of the
dense MLPs and of the routers), the relative-position banks, the four convolutions of each layer,
the correction bias and the shared experts, so no path hides behind a zero or a one. The tiny
model has both attention kinds (sliding layers with their own head counts and dims, a window of
6 and a bank of 6 distances; full layers with an extent of 10 and log scaling from position 4),
a dense first layer, unpadded vocabulary (120 of 128 rows) and a muP multiplier of 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

TEXT_CONFIG: dict[str, Any] = dict(
    vocab_size=128,
    unpadded_vocab_size=120,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    swa_num_attention_heads=4,
    swa_num_key_value_heads=2,
    swa_head_dim=8,
    sliding_window_size=6,
    d_rel=4,
    rel_extent=10,
    log_scaling_n_floor=4,
    log_scaling_alpha=0.3,
    layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"],
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
    conv_kernel_size=4,
    intermediate_size=96,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=2,
    route_scale=2.5,
    logits_mup_width_multiplier=2.0,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
)


def randomise(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "scale" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "sconv" in name:
                p.copy_(torch.randn_like(p) * 0.3)
            elif "rel_logits_proj" in name:
                p.copy_(torch.randn_like(p) * 0.5)
            else:
                p.copy_(torch.randn_like(p) * 0.08)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(torch.randn_like(b) * 0.5)


def build_text_model(seed: int = 0, **overrides: Any):  # type: ignore[no-untyped-def]
    from transformers import InklingForCausalLM, InklingTextConfig

    torch.manual_seed(seed)
    config = InklingTextConfig(**{**TEXT_CONFIG, **overrides})
    config._attn_implementation = "eager"  # the relative bias reaches only the eager path
    model = InklingForCausalLM(config).to(torch.float32).eval()
    randomise(model)
    return model


def save_text_model(path: Path, seed: int = 0, **overrides: Any):  # type: ignore[no-untyped-def]
    model = build_text_model(seed, **overrides)
    model.save_pretrained(path)
    return model


def save_multimodal_model(path: Path, seed: int = 0, **text_overrides: Any):  # type: ignore[no-untyped-def]
    from transformers import InklingConfig, InklingForConditionalGeneration

    torch.manual_seed(seed)
    config = InklingConfig(
        text_config={**TEXT_CONFIG, **text_overrides},
        vision_config=dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=2, patch_size=4),  # no scipy
        audio_config=dict(n_mel_bins=4, mel_vocab_size=8),
    )
    config._attn_implementation = "eager"
    config.text_config._attn_implementation = "eager"
    model = InklingForConditionalGeneration(config).to(torch.float32).eval()
    randomise(model)
    model.save_pretrained(path)
    return model


def randomise_mtp(mtp: torch.nn.Module) -> None:
    """The MTP layers' own parameters (not the embedding and head they share with the model)."""
    with torch.no_grad():
        for name, p in mtp.named_parameters():
            if name.startswith(("layers.", "shared_post_norm")):
                if "norm" in name or "scale" in name:
                    p.copy_(1.0 + 0.2 * torch.randn_like(p))
                elif "sconv" in name or "rel_logits_proj" in name:
                    p.copy_(torch.randn_like(p) * 0.3)
                else:
                    p.copy_(torch.randn_like(p) * 0.08)


def save_text_model_with_mtp(path: Path, seed: int = 0, **overrides: Any):  # type: ignore[no-untyped-def]
    """A text model with MTP layers (depth 0 sliding, depth 1 full): transformers' ``MtpModel``
    over it, randomised, its tensors added to the checkpoint under Inkling's MTP names (the
    wrapper as the released checkpoints name it, each block by the decoder layer's names).
    -> (main model, MtpModel)."""
    from safetensors.torch import load_file, save_file
    from transformers.modeling_layers import MtpModel

    model = save_text_model(path, seed, num_mtp_layers=2, mtp_local_layer_ids=[0], **overrides)
    mtp = MtpModel(model, 2).to(torch.float32).eval()
    randomise_mtp(mtp)
    renames = {
        ".enorm.": ".embed_norm.",
        ".hnorm.": ".hidden_norm.",
        ".eh_proj.": ".input_proj.",
        ".mtp_block.": ".transformer_block.",
    }
    tensors = load_file(path / "model.safetensors")
    for name, tensor in mtp.state_dict().items():
        if name.startswith("layers."):
            for old, new in renames.items():
                name = name.replace(old, new)
            tensors[f"model.mtp.{name}"] = tensor.clone()
        elif name.startswith("shared_post_norm."):
            tensors[name.replace("shared_post_norm.", "model.mtp.chain_norm.")] = tensor.clone()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return model, mtp


def released_mtp_tensors(mtp: torch.nn.Module) -> dict[str, torch.Tensor]:
    """An ``MtpModel``'s tensors under the released checkpoints' names: the wrapper as
    ``model.mtp.layers.K.{embed_norm,hidden_norm,input_proj}``, each block's tensors by the
    original layer names (``attn.wq_du``, gate and up rows interleaved in ``mlp.w13_dn``)."""
    from modelfleet.engine.models.inkling_layout import LAYERS, ORIGINAL, original_source

    wrapper = {".enorm.": ".embed_norm.", ".hnorm.": ".hidden_norm.", ".eh_proj.": ".input_proj."}
    tensors: dict[str, torch.Tensor] = {}
    halves: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in mtp.state_dict().items():
        if name.startswith("shared_post_norm."):
            tensors[name.replace("shared_post_norm.", "model.mtp.chain_norm.")] = tensor.clone()
        if not name.startswith("layers."):
            continue
        depth, _, rest = name[len("layers.") :].partition(".")
        if not rest.startswith("mtp_block."):
            for old, new in wrapper.items():
                name = name.replace(old, new)
            tensors[f"model.mtp.{name}"] = tensor.clone()
            continue
        where = original_source(f"{LAYERS}0.{rest[len('mtp_block.') :]}")
        assert where is not None
        source, dim, half = where
        target = f"model.mtp.layers.{depth}.transformer_block." + source[len(f"{ORIGINAL}layers.0.") :]
        if half is None:
            tensors[target] = tensor.clone()
        else:  # rows of gate and up alternate along dim
            halves.setdefault(target, {})[half] = tensor
            if len(halves[target]) == 2:
                tensors[target] = torch.stack([halves[target][0], halves[target][1]], dim=dim + 1).flatten(dim, dim + 1)
    return tensors


def save_multimodal_model_with_mtp(path: Path, seed: int = 0):  # type: ignore[no-untyped-def]
    """:func:`save_multimodal_model` with two MTP layers (depth 0 sliding) added in the released
    layout. -> (model, MtpModel)."""
    from safetensors.torch import load_file, save_file
    from transformers.modeling_layers import MtpModel

    model = save_multimodal_model(path, seed, num_mtp_layers=2, mtp_local_layer_ids=[0])
    mtp = MtpModel(model, 2).to(torch.float32).eval()
    randomise_mtp(mtp)
    (file,) = path.glob("*.safetensors")
    tensors = load_file(file)
    tensors.update(released_mtp_tensors(mtp))
    save_file(tensors, file, metadata={"format": "pt"})
    return model, mtp
