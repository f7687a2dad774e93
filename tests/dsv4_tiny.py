"""A tiny random DeepSeek-V4 built with transformers, every parameter and buffer randomised:
hyper-connection matrices, compressor and indexer weights and position biases, sinks, the
router's correction bias and the hash layer's token-to-expert table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tiny import COMMON

CONFIG: dict[str, Any] = dict(
    COMMON,  # tests/tiny.py: the vocabulary, widths, depth and token ids every tiny model shares
    num_key_value_heads=1,
    head_dim=32,
    q_lora_rank=32,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    routed_scaling_factor=1.5,
    swiglu_limit=0.6,
    sliding_window=8,
    o_groups=2,
    o_lora_rank=16,
    index_n_heads=8,
    index_head_dim=16,
    index_topk=3,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    layer_types=[
        "heavily_compressed_attention",
        "compressed_sparse_attention",
        "sliding_attention",
        "compressed_sparse_attention",
    ],
    mlp_layer_types=["hash_moe", "moe", "hash_moe", "moe"],  # a hash layer past the first stage too
    hc_mult=3,
    hc_sinkhorn_iters=5,
    partial_rotary_factor=0.25,
    rope_theta=10000.0,
    compress_rope_theta=40000.0,
    num_nextn_predict_layers=1,
)


def build(seed: int = 0, **overrides: Any):  # type: ignore[no-untyped-def]
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model("deepseek_v4", **{**CONFIG, **overrides})
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("scale"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "sinks" in name or "position_bias" in name or name.endswith("base"):
                p.copy_(torch.randn_like(p) * 0.5)
            else:
                p.copy_(torch.randn_like(p) * 0.08)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(torch.randn_like(b) * 0.1)
            elif "tid2eid" in name:
                experts = config.n_routed_experts
                b.copy_(torch.stack([torch.randperm(experts)[: b.shape[1]] for _ in range(b.shape[0])]))
    return model


def save(path: Path, seed: int = 0, **overrides: Any):  # type: ignore[no-untyped-def]
    model = build(seed, **overrides)
    model.save_pretrained(path)
    return model
