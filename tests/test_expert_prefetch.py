"""Prefetch into the expert stores' slots (engine.expert_prefetch): what to prefetch (pure), the slot
map's admission ahead of a step and its prefetch-hit count, a store predicting the next layer's
experts with that layer's router, and tiny models served capped through `modelfleet generate`
(prefetch never changes the tokens): DeepSeek-V4's hash layers find every expert prefetched, and a
trained qwen3_moe's predicted prefetch is mostly used. On a CPU-only machine the "device" slots are
a stand-in: these check the mechanics (the CUDA copies: tests/test_expert_store_cuda.py)."""

from __future__ import annotations

import json

import pytest
import torch
from prometheus_client import generate_latest
from tiny import build_model, train_on_successors
from typer.testing import CliRunner

from modelfleet.agent.health import StageMetrics
from modelfleet.cli import app
from modelfleet.engine.expert_offload import StoreOptions, moe_banks, moe_layers
from modelfleet.engine.expert_placement import ExpertPrefetch
from modelfleet.engine.expert_prefetch import by_demand, hash_table, install_prefetch
from modelfleet.engine.expert_store import EvictionPolicy, ExpertStore, SlotMap, StoreConfig
from modelfleet.engine.generate import LocalModel, generate
from modelfleet.engine.layers import Dense, Experts, SparseMoE, softmax_top_k
from modelfleet.engine.sampling import SamplingParams

LRU = EvictionPolicy.LRU


@pytest.mark.parametrize(
    ("index", "limit", "experts"),
    [
        ([[3, 1], [1, 5], [1, 3]], 8, [1, 3, 5]),  # most rows first, ties by id
        ([[3, 1], [1, 5], [1, 3]], 2, [1, 3]),  # no more than the slots
        ([[7, 2]], 0, []),  # no slot: nothing to prefetch
        ([[6, 4], [4, 6], [0, 6]], 3, [6, 4, 0]),
    ],
)
def test_the_experts_to_prefetch_are_the_most_routed_first_up_to_the_slots(index, limit, experts):
    assert by_demand(torch.tensor(index), limit) == experts


def test_admission_ahead_never_evicts_one_of_its_own_and_stops_when_the_slots_hold_them():
    slot_map = SlotMap(3, LRU)
    slot_map.lookup([0, 1, 2])
    for e in (0, 1, 2):
        slot_map.admit(e, {0, 1, 2})
    loads = slot_map.admit_ahead([1, 4, 5, 6])  # 1 held; 4 and 5 evict 0 and 2; no room for 6
    assert sorted(e for _, e in loads) == [4, 5] and slot_map.held() == [1, 4, 5]
    slot_map.lookup([4, 1, 7])  # 4 was prefetched and used; 5 was not used; 1 was held before
    assert slot_map.prefetch_hits == 1 and not slot_map.prefetched
    slot_map.lookup([5])  # a prefetch counts for the next step only
    assert slot_map.prefetch_hits == 1


def random_bank(experts: int = 8, hidden: int = 64, inner: int = 32, seed: int = 0) -> Experts:
    g = torch.Generator().manual_seed(seed)
    return Experts(
        torch.randn(experts, 2 * inner, hidden, generator=g) * 0.1,
        torch.randn(experts, hidden, inner, generator=g) * 0.1,
    )


def moe_block(seed: int, slots: int | None) -> SparseMoE:
    """A learned-router MoE block of 8 experts, top 2; ``slots``: its experts in a store (None: resident)."""
    g = torch.Generator().manual_seed(100 + seed)
    bank = random_bank(seed=seed)
    experts = bank if slots is None else ExpertStore(bank, torch.device("cpu"), StoreConfig(slots, LRU, 1.0))
    return SparseMoE(Dense(torch.randn(8, 64, generator=g)), lambda logits: softmax_top_k(logits, 2, True), experts)


def test_a_store_prefetches_what_the_next_layers_router_predicts_from_its_input_and_outputs_stay_exact():
    first, second = moe_block(0, 2), moe_block(1, 3)
    reference = [moe_block(0, None), moe_block(1, None)]
    assert install_prefetch([first, second], ExpertPrefetch.PREDICTED) is None  # no hash layer
    store, ahead = first.experts, second.experts
    assert isinstance(store, ExpertStore) and isinstance(ahead, ExpertStore) and store.lookahead is not None
    assert ahead.lookahead is None  # the last block has no next one
    g = torch.Generator().manual_seed(7)
    asked = 0
    for tokens in (3, 1, 1, 2, 1, 1):
        x = torch.randn(tokens, 64, generator=g)
        predicted = by_demand(second.route(second.router_proj(x))[0], 3)
        held = set(ahead.slot_map.held())
        before = ahead.counters.prefetched
        h = first(x)
        assert ahead.counters.prefetched - before == len(set(predicted) - held)
        assert set(predicted) <= set(ahead.slot_map.held())
        asked += len(set(predicted) - held)
        assert torch.equal(h, reference[0](x))
        assert torch.equal(second(h), reference[1](h))
    report = ahead.report()
    assert report["prefetched"] == asked > 0 and report["prefetch_bytes"] == asked * ahead.expert_nbytes
    assert 0 < int(report["prefetch_hits"]) <= asked  # type: ignore[call-overload]
    assert store.report()["prefetched"] == 0  # nothing predicts the first block


def test_prefetch_off_or_exact_wires_no_prediction_for_learned_routers():
    for mode in (ExpertPrefetch.OFF, ExpertPrefetch.EXACT):
        first, second = moe_block(0, 2), moe_block(1, 3)
        assert install_prefetch([first, second], mode) is None
        assert isinstance(first.experts, ExpertStore) and first.experts.lookahead is None


# ---- through generate -----------------------------------------------------------------------

PROMPT = [5, 17, 3, 99, 42, 7]


def capped(path: object, share: float) -> int:
    """A device cap that leaves room for about ``share`` of the model's experts (the plan's reserve included)."""
    shard = LocalModel.load(path, max_slots=1).shards[0]  # type: ignore[arg-type]
    banks = sum(m.bank_bytes for m in moe_layers(shard))
    return int((shard.weights_bytes - banks + shard.kv_bytes + share * banks) / 0.9) + 1


def generate_json(*args: str) -> dict:  # type: ignore[type-arg]
    ids = ",".join(map(str, PROMPT))
    result = CliRunner().invoke(app, ["generate", "--prompt-ids", ids, "--max-tokens", "16", "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(next(line for line in reversed(result.stdout.splitlines()) if line.startswith("{")))


@pytest.fixture(scope="module")
def trained_qwen3(tmp_path_factory: pytest.TempPathFactory):
    """A tiny qwen3_moe teacher-forced on a successor task: routers that mean something."""
    model = build_model("qwen3_moe")
    train_on_successors(model, 60)
    path = tmp_path_factory.mktemp("trained_qwen3_moe")
    model.save_pretrained(path)
    return path


def test_predicted_prefetch_keeps_the_tokens_and_most_of_what_it_copies_is_used(trained_qwen3):
    """What predicted prefetch is for: on a trained model most prefetched experts
    are used by the next step, and the steps miss less than without prefetch."""
    common = ("--model", str(trained_qwen3), "--gpu-memory-bytes", str(capped(trained_qwen3, 0.4)), "--expert-q", "1")
    runs = {mode: generate_json(*common, "--expert-prefetch", mode) for mode in ("off", "exact", "predicted")}
    assert runs["off"]["token_ids"] == runs["exact"]["token_ids"] == runs["predicted"]["token_ids"]
    off, exact, predicted = (runs[m]["expert_placement"] for m in ("off", "exact", "predicted"))
    assert off["prefetched"] == exact["prefetched"] == 0  # qwen3_moe has no hash layer
    assert predicted["prefetched"] > 0 and predicted["prefetch_bytes"] > 0
    assert predicted["prefetch_hits"] >= 0.6 * predicted["prefetched"]
    assert predicted["misses"] < off["misses"]
    assert predicted["hits"] + predicted["misses"] == off["hits"] + off["misses"]  # the same routing


def test_an_unknown_prefetch_mode_is_refused_naming_the_choices(tiny_checkpoint):
    source, _ = tiny_checkpoint("qwen3_moe")
    result = CliRunner().invoke(
        app, ["generate", "--model", str(source), "--prompt-ids", "5", "--expert-prefetch", "always"]
    )
    assert result.exit_code != 0 and "--expert-prefetch 'always': choose one of off, exact, predicted" in result.output


@pytest.fixture(scope="module")
def deepseek_v4(tmp_path_factory: pytest.TempPathFactory):
    from dsv4_tiny import save

    path = tmp_path_factory.mktemp("deepseek_v4_prefetch")
    save(path, seed=1)
    return path


def hash_layer_counts(
    path: object, cap: int, mode: ExpertPrefetch, device: str = "cpu"
) -> tuple[list[int], list[dict[str, int]]]:
    """(greedy tokens, the hash layers' store counters) of a capped run with ``mode``."""
    options = StoreOptions(q=1.0, prefetch=mode)
    lm = LocalModel.load(path, device=device, max_slots=1, device_memory_bytes=cap, store_options=options)  # type: ignore[arg-type]
    tokens = generate(lm, PROMPT[:2], SamplingParams(max_tokens=12, stop_token_ids=())).token_ids
    hashed = [moe.experts for moe in moe_banks(lm.shards[0]).values() if hash_table(moe) is not None]
    assert hashed and all(isinstance(store, ExpertStore) for store in hashed)
    return tokens, [store.report() for store in hashed]  # type: ignore[union-attr, misc]


def test_hash_routed_layers_find_every_expert_prefetched_from_the_token_ids(deepseek_v4):
    cap = capped(deepseek_v4, 0.5)  # 4 slots of 8 per layer: a step of two tokens routes to at most 4
    off_tokens, off = hash_layer_counts(deepseek_v4, cap, ExpertPrefetch.OFF)
    exact_tokens, exact = hash_layer_counts(deepseek_v4, cap, ExpertPrefetch.EXACT)
    assert exact_tokens == off_tokens
    assert all(row["slots"] >= 4 for row in exact)
    assert all(row["misses"] > 0 and row["prefetched"] == 0 for row in off)
    for row in exact:  # every expert a hash layer used was in its slots, prefetched, each one used
        assert row["misses"] == 0 and row["fetch_bytes"] == 0
        assert row["prefetched"] == row["prefetch_hits"] > 0


def test_the_stage_metrics_count_prefetched_bytes_and_hits():
    metrics = StageMetrics(0, 0)
    for prefetch_bytes, hits in ((4096, 1), (12288, 3)):
        metrics.expert_store({"prefetched": hits + 1, "prefetch_bytes": prefetch_bytes, "prefetch_hits": hits})
    text = generate_latest(metrics.registry).decode()
    assert 'modelfleet_stage_expert_prefetch_bytes_total{group="0",stage="0"} 12288.0' in text
    assert 'modelfleet_stage_expert_prefetch_hits_total{group="0",stage="0"} 3.0' in text
    assert 'modelfleet_stage_expert_prefetched_total{group="0",stage="0"} 4.0' in text


def test_modelfleet_plan_writes_the_prefetch_choice_into_the_serving_limits(tiny_checkpoint, tmp_path):
    source, _ = tiny_checkpoint("qwen3_moe")
    out = tmp_path / "plan.json"
    ask = ["plan", "--model", str(source), "--stages", "2", "--context-length", "256", "--out", str(out)]
    assert CliRunner().invoke(app, [*ask, "--expert-prefetch", "predicted"]).exit_code == 0
    assert json.loads(out.read_text())["serving"]["expert_prefetch"] == "predicted"
    assert CliRunner().invoke(app, ask).exit_code == 0
    assert json.loads(out.read_text())["serving"]["expert_prefetch"] == "exact"  # the default
