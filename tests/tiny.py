"""Tiny random checkpoints of every supported family, built offline with transformers.

Every parameter and buffer is randomised (norm weights, DeepSeek's correction bias, GPT-OSS
sinks and biases included) so no code path hides behind a zero or a one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

COMMON: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)

CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(
        head_dim=16,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        rope_theta=10000.0,
    ),
    "mixtral": dict(intermediate_size=48, num_local_experts=6, num_experts_per_tok=2, rope_theta=10000.0),
    "deepseek_v3": dict(
        intermediate_size=96,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        q_lora_rank=32,
        kv_lora_rank=24,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        num_key_value_heads=4,
        rope_scaling=dict(
            rope_type="yarn",
            factor=4.0,
            original_max_position_embeddings=128,
            beta_fast=32,
            beta_slow=1,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
    ),
    "gpt_oss": dict(
        head_dim=16,
        intermediate_size=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention"] * 2,
        rope_scaling=dict(
            rope_type="yarn",
            factor=8.0,
            original_max_position_embeddings=64,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
        ),
    ),
}


def hf_config(family: str, **overrides: Any):  # type: ignore[no-untyped-def]
    from transformers import AutoConfig

    kwargs = {**COMMON, **CONFIGS[family], **overrides}
    return AutoConfig.for_model(family, **kwargs)


def build_model(family: str, seed: int = 0, **overrides: Any):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = hf_config(family, **overrides)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.5 if "bias" in name or "sinks" in name else 0.08))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(torch.randn_like(b) * 0.5)
    return model


def save_model(family: str, path: Path, seed: int = 0, max_shard_size: str | None = None, **overrides: Any):  # type: ignore[no-untyped-def]
    model = build_model(family, seed, **overrides)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return model


def reference_logits(model, ids: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """transformers' logits at every position of ``ids``: [len(ids), vocab]."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def assert_close_to(ours: torch.Tensor, ref: torch.Tensor, tol: float = 1e-4) -> None:
    """max |ours - ref| within ``tol`` of the reference's logit scale (at least 1)."""
    scale = ref.abs().max().item()
    diff = (ours - ref).abs().max().item()
    assert diff <= tol * max(scale, 1.0), f"max |diff| {diff:.3e} over logit scale {scale:.3f}"


def successor_chains(successor: torch.Tensor, rows: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """[rows, length] token ids, each the successor of the one before (ids 3..127)."""
    chain = [torch.randint(3, 128, (rows,), generator=generator)]
    for _ in range(length - 1):
        chain.append(successor[chain[-1] - 3])
    return torch.stack(chain, dim=1)


def train_on_successors(model: torch.nn.Module, steps: int, rows: int = 16, length: int = 16) -> torch.Tensor:
    """Teacher-force ``model`` for ``steps`` steps on a successor task (each token has one next
    token), so its predictions have margins as a real model's do (a random model's nearly flat
    logits flip under any 4-bit error); returns the successor table. Leaves the model in eval mode."""
    successor = torch.randperm(125, generator=torch.Generator().manual_seed(5)) + 3
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny steps: thread barriers cost more than they save on a busy CPU
    model.train()
    for _ in range(steps):
        batch = successor_chains(successor, rows, length, generator)
        loss = model(batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    torch.set_num_threads(threads)
    return successor
