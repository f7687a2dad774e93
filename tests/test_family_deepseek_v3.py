"""DeepSeek-V3 against transformers on tiny random checkpoints: MLA over a latent cache with
decoupled (interleaved) YaRN RoPE and its softmax-scale correction, group-limited sigmoid
routing with a correction bias, shared experts, dense first layers, and both config forms."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny import assert_close_to, hf_config, reference_logits, save_model

from modelfleet.engine.errors import ConfigError
from modelfleet.engine.frame import Frame
from modelfleet.engine.models.deepseek_v3 import group_limited_top_k, softmax_scale
from modelfleet.engine.shard import Shard
from modelfleet.engine.spec import load_spec, spec_from_config

PROMPT = [5, 17, 99, 3, 64, 21, 8, 120, 45, 77, 12, 33, 90, 6, 101, 58, 27, 14, 71, 40, 9, 88, 52, 30]


def prefill_logits(path: Path) -> torch.Tensor:
    return Shard.load(path)(Frame.of_streams([(0, 0, PROMPT)]))


def to_legacy_config(path: Path) -> None:
    """Rewrite a transformers-5 config.json the way DeepSeek's own checkpoints spell it."""
    config_path = path / "config.json"
    raw = json.loads(config_path.read_text())
    rope = raw.pop("rope_parameters")
    raw["rope_theta"] = rope.pop("rope_theta")
    rope.pop("rope_type")
    raw["rope_scaling"] = {"type": "yarn", **rope}
    raw.pop("head_dim")
    raw.pop("qk_head_dim")
    config_path.write_text(json.dumps(raw))


def test_logits_at_every_prompt_position_match_transformers(tiny_checkpoint) -> None:
    path, model = tiny_checkpoint("deepseek_v3")
    assert_close_to(prefill_logits(path), reference_logits(model, PROMPT))


def test_greedy_continuation_of_32_tokens_decoded_row_by_row_is_identical_to_transformers(
    tiny_checkpoint,
) -> None:
    path, model = tiny_checkpoint("deepseek_v3")
    ref = model.generate(torch.tensor([PROMPT]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
    shard = Shard.load(path)
    token = int(shard(Frame.of_streams([(0, 0, PROMPT)]))[-1].argmax())
    ours = [token]
    for position in range(len(PROMPT), len(PROMPT) + 31):
        token = int(shard(Frame.of_streams([(0, position, [token])]))[-1].argmax())
        ours.append(token)
    assert ours == ref[0, len(PROMPT) :].tolist()


def test_legacy_rope_theta_and_rope_scaling_config_gives_the_logits_of_transformers(tmp_path: Path) -> None:
    # theta, factor and unequal mscale / mscale_all_dim all move the logits if misread
    rope_scaling = dict(
        type="yarn",
        factor=8.0,
        original_max_position_embeddings=64,
        beta_fast=24.0,
        beta_slow=2.0,
        mscale=0.9,
        mscale_all_dim=0.7,
    )
    model = save_model("deepseek_v3", tmp_path, seed=1, rope_theta=50000.0, rope_scaling=rope_scaling)
    to_legacy_config(tmp_path)
    spec = load_spec(tmp_path)
    assert (spec.rope.rope_type, spec.rope.theta, spec.rope.mscale) == ("yarn", 50000.0, 0.9)
    assert softmax_scale(spec) == pytest.approx(model.model.layers[0].self_attn.scaling)
    assert_close_to(prefill_logits(tmp_path), reference_logits(model, PROMPT))


def test_plain_q_proj_and_rope_without_interleave_match_transformers(tmp_path: Path) -> None:
    model = save_model("deepseek_v3", tmp_path, seed=2, q_lora_rank=None, rope_interleave=False)
    assert_close_to(prefill_logits(tmp_path), reference_logits(model, PROMPT))


def test_kv_cache_holds_one_latent_row_per_position_not_per_head_keys_and_values(tiny_checkpoint) -> None:
    path, _ = tiny_checkpoint("deepseek_v3")
    shard = Shard.load(path)
    assert all(layer.attention.cache_shapes() == {"latent": (24 + 8,)} for layer in shard.layers)
    assert shard.kv_bytes_per_position() == 4 * 32 * 4  # layers x (kv_lora_rank + rope dim) x float32


def test_dense_mlp_below_first_k_dense_replace_and_routed_experts_above(tiny_checkpoint) -> None:
    path, _ = tiny_checkpoint("deepseek_v3")
    shard = Shard.load(path)
    kinds = [type(layer.mlp).__name__ for layer in shard.layers]
    assert kinds == ["GatedMLP", "SparseMoE", "SparseMoE", "SparseMoE"]
    assert all(layer.mlp.shared is not None for layer in shard.layers[1:])


def test_routing_picks_only_from_the_groups_with_the_best_top_two_sums() -> None:
    # 4 groups of 2; expert 0 scores highest alone, but group 0's pair sums lowest
    logits = torch.tensor([[3.0, -6.0, 1.0, 1.0, 0.5, 0.5, 2.0, 0.9]])
    index, _ = group_limited_top_k(
        logits, torch.zeros(8), top_k=2, n_group=4, topk_group=2, renormalize=True, scaling_factor=1.0
    )
    assert sorted(index[0].tolist()) == [2, 6]
    ungrouped, _ = group_limited_top_k(
        logits, torch.zeros(8), top_k=2, n_group=1, topk_group=1, renormalize=True, scaling_factor=1.0
    )
    assert sorted(ungrouped[0].tolist()) == [0, 6]


def test_correction_bias_changes_which_experts_are_chosen_but_not_their_weights() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])
    index, weight = group_limited_top_k(
        logits, bias, top_k=2, n_group=1, topk_group=1, renormalize=False, scaling_factor=2.5
    )
    assert index[0].tolist() == [3, 0]
    assert torch.allclose(weight[0], 2.5 * torch.sigmoid(torch.tensor([-1.0, 2.0])))


def test_tiny_model_routing_depends_on_group_limit_and_correction_bias(tiny_checkpoint) -> None:
    """Guards the logits tests: were either ignored, some token here would route differently."""
    _, model = tiny_checkpoint("deepseek_v3")
    captured: list[torch.Tensor] = []
    gate = model.model.layers[1].mlp.gate
    handle = gate.register_forward_hook(lambda module, args, out: captured.append(out[0]))
    reference_logits(model, PROMPT)
    handle.remove()
    logits, bias = captured[0], gate.e_score_correction_bias

    def chosen(bias: torch.Tensor, n_group: int, topk_group: int) -> set[tuple[int, ...]]:
        index, _ = group_limited_top_k(logits, bias, 2, n_group, topk_group, True, 2.5)
        return {(t, *sorted(row)) for t, row in enumerate(index.tolist())}

    routed = chosen(bias, 4, 2)
    assert routed != chosen(bias, 1, 1)
    assert routed != chosen(torch.zeros_like(bias), 4, 2)


@pytest.mark.parametrize("field", ["n_routed_experts", "kv_lora_rank", "n_group", "qk_rope_head_dim"])
def test_config_without_a_required_field_is_rejected_naming_it(field: str) -> None:
    raw = hf_config("deepseek_v3").to_dict()
    raw.pop(field)
    raw.pop("num_local_experts", None)  # to_dict may spell n_routed_experts this way too
    with pytest.raises(ConfigError, match=field):
        spec_from_config(raw)
