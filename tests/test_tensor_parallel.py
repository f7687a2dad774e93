"""Tensor parallelism inside a stage: a model split over two ranks gives the logits and greedy
tokens of the same model whole, holds about half the weights and KV per rank, and refuses
splits it cannot make with the field, the value and the size.

Two ranks (processes, gloo on CPU) are spawned once for every case; each case is compared with
the same model loaded whole (tensor size 1, same formats) in this process. The split itself is
also checked in one process, with a group whose reduce is left to the test: the ranks' partial
outputs of every attention and feed-forward block sum to the whole block's output.
"""

from __future__ import annotations

import copy
import multiprocessing
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny import assert_close_to, save_model

from modelfleet.engine.errors import InputError
from modelfleet.engine.formats import FormatError
from modelfleet.engine.formats.plan import FormatPlan
from modelfleet.engine.frame import Frame, segments_of
from modelfleet.engine.generate import LocalModel, generate
from modelfleet.engine.kvcache import LayerKV
from modelfleet.engine.layers import FrameContext
from modelfleet.engine.quantized_checkpoint import save_quantized
from modelfleet.engine.sampling import SamplingParams
from modelfleet.engine.shard import Shard
from modelfleet.engine.static_decode import supports_static_decode
from modelfleet.engine.tensor_parallel import TensorGroup, close_tensor_group, init_tensor_group, split_for_rank

PROMPT = [5, 17, 99, 3, 64, 21, 8, 120, 45, 77, 12, 33, 90, 6, 101, 58, 27, 14, 71, 40]
GREEDY_TOKENS = 16
INT4_EXPERTS = FormatPlan(experts="int4")
# int4 blocks are 32 values along a weight's input: each rank's share of the intermediate width
# (down's input) must be a multiple of 32, so this case's widths are 64
INT4_WIDTHS = dict(moe_intermediate_size=64, intermediate_size=64)


@dataclass(frozen=True)
class Case:
    family: str
    overrides: dict[str, Any]
    formats: FormatPlan | None = None
    shards: int = 1
    halved: tuple[str, ...] = ("experts", "attention")  # roles each rank holds half of
    kv_halved: bool = True


CASES = {
    "qwen3_moe": Case("qwen3_moe", {}),  # q/k norms; layer 1 is a dense MLP (mlp_only_layers)
    "gpt_oss": Case("gpt_oss", {}),  # biases, sinks, a sliding window of 6, clamped SwiGLU
    "mixtral": Case("mixtral", {}, shards=2),  # two pipeline shards in one process, each split
    "qwen3_moe_int4": Case("qwen3_moe", INT4_WIDTHS, INT4_EXPERTS),
    # latent attention: heads split, but the down projections and the latent cache are shared by
    # all heads, so every rank holds them whole; shared experts and a dense first layer split
    "deepseek_v3": Case("deepseek_v3", {}, halved=("experts",), kv_halved=False),
}


@dataclass(frozen=True)
class LocalGroup(TensorGroup):
    """A rank of a group whose sum is taken by the test itself (or, for errors, never)."""

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t


def run(path: Path, case: Case, tensor: TensorGroup | None) -> dict[str, Any]:
    """What a rank (or the whole model) gives: prompt logits, greedy tokens, resident sizes."""
    lm = LocalModel.load(path, case.shards, formats=case.formats, tensor=tensor, max_slots=1, max_context=64)
    logits = lm.forward(Frame.of_streams([(0, 0, PROMPT)]))
    lm.release(0)
    tokens = generate(lm, PROMPT, SamplingParams(max_tokens=GREEDY_TOKENS, stop_token_ids=())).token_ids
    return dict(
        logits=logits,
        tokens=tokens,
        bytes_by_role=lm.bytes_by_role,
        weights_bytes=lm.weights_bytes,
        kv_bytes_per_position=sum(s.kv_bytes_per_position() for s in lm.shards),
    )


def rank_main(rank: int, size: int, port: int, paths: dict[str, Path], out_dir: Path) -> None:
    torch.set_num_threads(1)  # two ranks share two cores
    group = init_tensor_group(rank, size, "127.0.0.1", port, "cpu", timeout_seconds=60)
    try:
        results = {name: run(paths[name], case, group) for name, case in CASES.items()}
    finally:
        close_tensor_group()
    torch.save(results, out_dir / f"rank{rank}.pt")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    paths = {}
    for name, case in CASES.items():
        paths[name] = tmp_path_factory.mktemp(name)
        save_model(case.family, paths[name], **case.overrides)
    return paths


def spawn_ranks(target: Any, args_of: Any, size: int = 2, timeout: float = 240) -> None:
    """Run ``target(*args_of(rank, port))`` in ``size`` spawned processes, ``port`` one free port for
    the group's rendezvous; each rank must exit 0 within ``timeout`` seconds (a hung one is killed)."""
    context = multiprocessing.get_context("spawn")
    port = free_port()
    ranks = [context.Process(target=target, args=args_of(r, port)) for r in range(size)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(timeout=timeout)
        if p.is_alive():
            p.kill()
            p.join()
    assert [p.exitcode for p in ranks] == [0] * size, "a rank failed; its traceback is in the captured stderr"


@pytest.fixture(scope="module")
def two_ranks(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every case's results on ranks 0 and 1 of one spawned group of two."""
    out_dir = tmp_path_factory.mktemp("ranks")
    spawn_ranks(rank_main, lambda rank, port: (rank, 2, port, checkpoints, out_dir), timeout=180)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def whole(checkpoints: dict[str, Path]) -> dict[str, dict[str, Any]]:
    return {name: run(checkpoints[name], case, None) for name, case in CASES.items()}


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_give_the_logits_and_greedy_tokens_of_the_whole_model(two_ranks, whole, name: str) -> None:
    ref = whole[name]
    for rank in two_ranks:
        assert_close_to(rank[name]["logits"], ref["logits"], 1e-4)
        assert rank[name]["tokens"] == ref["tokens"] and len(ref["tokens"]) == GREEDY_TOKENS
    assert torch.equal(two_ranks[0][name]["logits"], two_ranks[1][name]["logits"])  # every rank, the same output


@pytest.mark.parametrize("name", list(CASES))
def test_each_rank_holds_half_the_split_weights_and_half_the_kv_cache(two_ranks, whole, name: str) -> None:
    ref, ranks = whole[name], [rank[name] for rank in two_ranks]
    for role in CASES[name].halved:
        for fmt, nbytes in ref["bytes_by_role"][role].items():
            # biases added after the reduce stay on rank 0 alone: the ranks' shares add up to the
            # whole (in int4 up to padding: a row's packed zero points fill whole bytes)
            held = [r["bytes_by_role"][role][fmt] for r in ranks]
            slack = 0 if fmt == "fp32" else 0.01 * nbytes
            assert abs(sum(held) - nbytes) <= slack, (role, fmt, held, nbytes)
            assert abs(held[0] - nbytes / 2) <= 0.02 * nbytes, (role, fmt, held, nbytes)
    replicated = {role: ref["bytes_by_role"][role] for role in ("embeddings", "head")}
    assert all({role: r["bytes_by_role"][role] for role in replicated} == replicated for r in ranks)
    assert all(r["weights_bytes"] < 0.6 * ref["weights_bytes"] for r in ranks)
    kv_share = ref["kv_bytes_per_position"] // (2 if CASES[name].kv_halved else 1)
    assert all(r["kv_bytes_per_position"] == kv_share for r in ranks)


def attention_output(attention: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """One stream's rows through an attention block with a fresh cache."""
    rows = x.shape[0]
    kv = LayerKV.uniform(1, 32, attention.cache_shapes(), x.dtype, x.device, ring=False)  # type: ignore[operator]
    return attention(x, FrameContext(segments_of([0] * rows, list(range(rows))), torch.arange(rows)), kv)


@pytest.mark.parametrize(
    ("family", "overrides", "formats"),
    [
        ("gpt_oss", {}, None),
        ("deepseek_v3", {}, None),
        ("qwen3_moe", INT4_WIDTHS, FormatPlan(experts="int4", attention="int8")),  # QuantizedWeight.slice
    ],
)
def test_the_ranks_partial_block_outputs_sum_to_the_whole_blocks(tmp_path, family, overrides, formats) -> None:
    save_model(family, tmp_path, **overrides)
    whole = Shard.load(tmp_path, formats=formats, pack=False)
    ranks = [copy.deepcopy(whole) for _ in range(2)]
    for r, shard in enumerate(ranks):
        split_for_rank(shard, LocalGroup(r, 2))  # quantized before the split: the formats' slices cut it
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(0))
    for i, layer in enumerate(whole.layers):
        attention = attention_output(layer.attention, x)
        assert_close_to(sum(attention_output(s.layers[i].attention, x) for s in ranks), attention, 1e-5)
        assert_close_to(sum(s.layers[i].mlp(x) for s in ranks), layer.mlp(x), 1e-5)


def test_a_split_shard_takes_no_static_decode_steps(tiny_checkpoint) -> None:
    path, _ = tiny_checkpoint("qwen3_moe")
    assert supports_static_decode([Shard.load(path)])
    assert not supports_static_decode([Shard.load(path, tensor=LocalGroup(0, 2))])  # reduces are not captured


def test_a_head_count_not_divisible_by_the_tensor_size_is_refused_naming_field_value_and_size(tiny_checkpoint):
    path, _ = tiny_checkpoint("qwen3_moe")
    with pytest.raises(InputError, match=r"num_attention_heads=4, which is not divisible by 3"):
        Shard.load(path, tensor=LocalGroup(0, 3))
    layer = Shard.load(path, 0, 1).layers[0]
    with pytest.raises(InputError, match=r"layers\.0\.attention has num_attention_heads=4, .* not divisible by 3"):
        split_for_rank(layer, LocalGroup(1, 3), "layers.0.")


def test_an_int4_bank_is_not_cut_through_a_block_and_the_error_names_the_weight(tiny_checkpoint):
    path, _ = tiny_checkpoint("qwen3_moe")  # experts' intermediate width 32: one block per row
    shard = Shard.load(path, formats=INT4_EXPERTS, pack=False)
    with pytest.raises(
        FormatError, match=r"cannot split layers\.0\.mlp\.experts\.down \(int4\).*cuts a 32-value block"
    ):
        split_for_rank(shard, LocalGroup(0, 2))


@pytest.mark.parametrize(
    ("family", "overrides", "plan"),
    [
        ("qwen3_moe", INT4_WIDTHS, FormatPlan(experts="int4", attention="int8")),
        ("gpt_oss", dict(intermediate_size=64), FormatPlan(experts="mxfp4")),
    ],
)
def test_a_quantized_checkpoint_is_split_once_filled_and_its_shares_sum_to_the_whole(
    tmp_path, family, overrides, plan
) -> None:
    source, stored = tmp_path / "source", tmp_path / "stored"
    save_model(family, source, **overrides)
    save_quantized(Shard.load(source, formats=plan, pack=False), source, stored, plan, torch.float32)
    whole = Shard.load(stored)
    ranks = [Shard.load(stored, tensor=LocalGroup(r, 2)) for r in range(2)]
    assert all(s.tensor == LocalGroup(r, 2) for r, s in enumerate(ranks))
    experts = whole.bytes_by_role["experts"][plan.experts]
    assert all(abs(s.bytes_by_role["experts"][plan.experts] - experts / 2) <= 0.01 * experts for s in ranks)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(1))
    for i, layer in enumerate(whole.layers):
        assert_close_to(
            sum(attention_output(s.layers[i].attention, x) for s in ranks), attention_output(layer.attention, x), 1e-5
        )
        assert_close_to(sum(s.layers[i].mlp(x) for s in ranks), layer.mlp(x), 1e-5)


def test_a_tensor_group_of_one_changes_nothing(tiny_checkpoint):
    path, _ = tiny_checkpoint("mixtral")
    frame = Frame.of_streams([(0, 0, PROMPT)])
    alone = Shard.load(path, tensor=init_tensor_group(0, 1, "127.0.0.1", 0))
    assert torch.equal(alone(frame), Shard.load(path)(frame))


def test_a_rank_that_cannot_reach_its_group_fails_naming_the_address_and_the_wait() -> None:
    port = free_port()  # nothing listens there
    with pytest.raises(
        InputError, match=rf"tensor rank 1 of 2 could not join the group at tcp://127.0.0.1:{port} within 1s"
    ):
        init_tensor_group(1, 2, "127.0.0.1", port, timeout_seconds=1)
    with pytest.raises(InputError, match="tensor rank 2 is outside a group of size 2"):
        TensorGroup(2, 2)


def test_a_split_shard_in_bfloat16_is_packed_for_onednn_after_the_split(tiny_checkpoint) -> None:
    from modelfleet.engine.kernels import cpu_linear

    if not cpu_linear.available(torch.zeros(1, 1, dtype=torch.bfloat16)):
        pytest.skip("oneDNN bfloat16 is not available on this CPU")
    path, _ = tiny_checkpoint("qwen3_moe")
    whole = Shard.load(path, dtype="bfloat16")
    rank = Shard.load(path, dtype="bfloat16", tensor=LocalGroup(1, 2))
    assert any(getattr(m, "packed", None) is not None for m in rank.modules())
    assert rank.bytes_by_role["experts"]["bf16"] * 2 == whole.bytes_by_role["experts"]["bf16"]
