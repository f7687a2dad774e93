"""The expert store (engine.expert_store, engine.expert_placement): eviction, the miss split, q*,
placement planning as tables; the hybrid store against the all-resident bank it replaces; and a
tiny qwen3_moe served through `modelfleet generate` with a device cap that forces host/cached
placement, token for token as the uncapped run. On a CPU-only machine the "device" path is the
same CPU (a stand-in): these check the mechanics, not the bandwidths."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from typer.testing import CliRunner

from modelfleet.cli import app
from modelfleet.engine.errors import InputError
from modelfleet.engine.expert_offload import moe_layers
from modelfleet.engine.expert_placement import (
    ExpertPrefetch,
    MoELayer,
    Placement,
    device_reserve_bytes,
    plan_expert_placement,
)
from modelfleet.engine.expert_store import (
    EvictionPolicy,
    ExpertStore,
    SlotMap,
    SlotState,
    StoreConfig,
    choose_victim,
    expert_bytes,
    measure_bandwidths,
    predicted_step_seconds,
    q_star,
    split_misses,
)
from modelfleet.engine.layers import Experts
from modelfleet.engine.quantize import quantized_module

LRU, FREQ = EvictionPolicy.LRU, EvictionPolicy.FREQUENCY


def slots(*pairs: tuple[int | None, int]) -> list[SlotState]:
    return [SlotState(expert, last) for expert, last in pairs]


@pytest.mark.parametrize(
    ("policy", "state", "frequency", "pinned", "victim"),
    [
        (LRU, slots((3, 5), (None, -1), (4, 1)), {}, set(), 1),  # an empty slot first
        (LRU, slots((3, 5), (7, 2), (4, 9)), {}, set(), 1),  # least recently used
        (LRU, slots((3, 5), (7, 2), (4, 9)), {}, {7}, 0),  # never one the step uses
        (FREQ, slots((3, 5), (7, 2), (4, 9)), {3: 1, 7: 9, 4: 4}, set(), 0),  # least routed to
        (FREQ, slots((3, 5), (7, 2), (4, 9)), {3: 2, 7: 2, 4: 4}, set(), 1),  # ties: least recently used
        (FREQ, slots((3, 5), (7, 2)), {3: 1, 7: 9}, {3}, 1),
        (LRU, slots((3, 5), (7, 2)), {}, {3, 7}, None),  # every slot pinned
    ],
)
def test_eviction_picks_empty_then_by_policy_and_never_a_pinned_expert(policy, state, frequency, pinned, victim):
    assert choose_victim(policy, state, frequency, pinned) == victim


@pytest.mark.parametrize(
    ("misses", "q", "capacity", "fetched", "on_cpu"),
    [
        ([(1, 10), (2, 10), (3, 10), (4, 10)], 0.0, 4, [], [1, 2, 3, 4]),
        ([(1, 10), (2, 10), (3, 10), (4, 10)], 1.0, 4, [1, 2, 3, 4], []),
        ([(1, 10), (2, 10), (3, 10), (4, 10)], 0.5, 4, [1, 2], [3, 4]),
        ([(1, 10), (2, 10), (3, 10), (4, 10)], 0.28, 4, [1], [2, 3, 4]),  # nearest: 10 of 40 bytes
        ([(1, 10), (2, 10), (3, 10), (4, 10)], 1.0, 1, [1], [2, 3, 4]),  # no more than the free slots
        ([(1, 30), (2, 10)], 0.25, 4, [2], [1]),  # by bytes: 10 of 40 is nearer 25% than 30 of 40
        ([], 0.5, 4, [], []),
    ],
)
def test_misses_split_by_bytes_nearest_q_within_the_free_slots(misses, q, capacity, fetched, on_cpu):
    assert split_misses(misses, q, capacity) == (fetched, on_cpu)


def test_a_split_outside_zero_to_one_is_refused_naming_q():
    with pytest.raises(InputError, match=r"q must be in \[0, 1\]"):
        split_misses([(1, 10)], 1.5, 4)


def test_q_star_is_seed_001s_28_percent_from_its_measured_bandwidths_and_balances_both_paths():
    q = q_star(9.85e9, 25.37e9)
    assert round(q, 2) == 0.28
    miss = 10**9
    assert q * miss / 9.85e9 == pytest.approx((1 - q) * miss / 25.37e9)
    at_q = predicted_step_seconds(miss, q, 9.85e9, 25.37e9)
    assert at_q < min(
        predicted_step_seconds(miss, 1.0, 9.85e9, 25.37e9), predicted_step_seconds(miss, 0.0, 9.85e9, 25.37e9)
    )
    assert predicted_step_seconds(miss, 0.0, 0.0, 1e9) == 1.0  # an absent path costs nothing when given nothing
    with pytest.raises(InputError, match="beta_g=0"):
        q_star(0, 0)


def test_the_slot_map_counts_hits_and_misses_and_evicts_the_least_recently_used():
    slot_map = SlotMap(2, LRU)
    assert slot_map.lookup([1, 2]) == ([], [1, 2])
    for e in (1, 2):
        slot_map.admit(e, {1, 2})
    assert slot_map.lookup([2]) == ([2], [])
    assert slot_map.lookup([3]) == ([], [3])
    slot_map.admit(3, {3})  # 1 was used longest ago
    assert slot_map.held() == [2, 3]
    assert (slot_map.hits, slot_map.misses) == (1, 3)


def random_bank(experts: int = 8, hidden: int = 64, inner: int = 32, seed: int = 0) -> Experts:
    g = torch.Generator().manual_seed(seed)
    return Experts(
        torch.randn(experts, 2 * inner, hidden, generator=g) * 0.1,
        torch.randn(experts, hidden, inner, generator=g) * 0.1,
    )


def bank_in(fmt: str) -> torch.nn.Module:
    bank = random_bank()
    if fmt == "bf16-packed":
        bank = Experts(bank.gate_up.data.bfloat16(), bank.down.data.bfloat16())
        bank.pack_for_cpu()
        return bank
    return bank if fmt == "fp32" else quantized_module("layers.0.mlp.experts", bank, fmt)


def routes(
    steps: int, tokens: int, experts: int = 8, k: int = 2, seed: int = 1
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        index = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
        out.append((index, torch.softmax(torch.randn(tokens, k, generator=g), -1)))
    return out


@pytest.mark.parametrize("fmt", ["fp32", "bf16-packed", "int4", "mxfp4"])
@pytest.mark.parametrize(("num_slots", "q"), [(0, 0.0), (2, 0.5), (3, 1.0), (8, 0.3), (8, 1.0)])
def test_the_hybrid_store_is_bit_identical_to_the_all_resident_bank_step_after_step(fmt, num_slots, q):
    bank = bank_in(fmt)
    store = ExpertStore(bank, torch.device("cpu"), StoreConfig(num_slots, LRU, q, cpu_workers=2))
    dtype = torch.bfloat16 if fmt == "bf16-packed" else torch.float32
    g = torch.Generator().manual_seed(2)
    for tokens, (index, weight) in zip((1, 3, 1, 5, 2, 1), routes(6, 5), strict=True):
        x = torch.randn(tokens, 64, generator=g).to(dtype)
        index, weight = index[:tokens], weight[:tokens].to(dtype)
        assert torch.equal(store(x, index, weight), bank(x, index, weight))
    c = store.counters
    assert (c.fetch_bytes > 0) == (num_slots > 0 and q > 0)
    assert (c.cpu_bytes == 0) == (q == 1.0 and num_slots == 8)  # a fetch-everything store with room for all


def test_misses_run_on_cpu_worker_threads_concurrently_with_the_device_path():
    seen: set[str] = set()

    class Recording(Experts):
        def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
            seen.add(threading.current_thread().name)
            return super().expert(e, x)

    plain = random_bank()
    bank = Recording(plain.gate_up.data, plain.down.data)
    store = ExpertStore(bank, torch.device("cpu"), StoreConfig(0, LRU, 0.0, cpu_workers=2))
    (index, weight), x = routes(1, 4)[0], torch.randn(4, 64)
    store(x, index, weight)
    assert seen and all(name.startswith("cpu-experts") for name in seen)


def test_prefetched_experts_are_hits_on_the_next_step():
    store = ExpertStore(random_bank(), torch.device("cpu"), StoreConfig(4, FREQ, 0.0))
    store.prefetch([1, 5])
    store(torch.randn(1, 64), torch.tensor([[5, 1]]), torch.tensor([[0.5, 0.5]]))
    assert (store.slot_map.hits, store.slot_map.misses) == (2, 0)
    assert store.counters.prefetch_bytes == 2 * expert_bytes(store.host) and store.counters.fetch_bytes == 0
    assert store.slot_map.prefetch_hits == 2


def test_bandwidths_are_measured_with_both_paths_running_and_say_the_device_is_a_stand_in():
    store = ExpertStore(bank_in("int4"), torch.device("cpu"), StoreConfig(1, LRU, None, cpu_workers=1))
    measured = measure_bandwidths(store, seconds=0.05)
    assert measured.beta_g > 0 and measured.beta_c > 0 and measured.device_is_stand_in
    assert 0 < measured.q_star < 1 and measured.format == "int4"


def test_int4_banks_stay_packed_in_host_and_in_slots():
    bank = bank_in("int4")
    store = ExpertStore(bank, torch.device("cpu"), StoreConfig(2, LRU, 1.0))
    store(torch.randn(1, 64), torch.tensor([[0, 1]]), torch.tensor([[0.5, 0.5]]))
    plain_expert = (2 * 32 * 64 + 64 * 32) * 4  # fp32
    assert expert_bytes(bank) < plain_expert / 4
    # slots hold the codes in the CPU kernel's layout with float32 scale/bias: still packed
    assert 2 * expert_bytes(bank) <= store.slots.nbytes < 2 * plain_expert / 4


# ---- placement planning -------------------------------------------------------------------


MB = 10**6
FOUR = [MoELayer(layer, 8, MB) for layer in range(4)]  # 32 MB of experts over four layers


@pytest.mark.parametrize(
    ("device_bytes", "kinds", "slots"),
    [
        (None, ["device"] * 4, [8] * 4),  # not capped
        (100 * MB, ["device"] * 4, [8] * 4),  # fits with its reserve
        (30 * MB, ["cached"] * 4, [3, 3, 3, 2]),  # 30 - 3 reserve - 16 other = 11 MB of slots, shared in turn
        (20 * MB, ["cached", "cached", "host", "host"], [1, 1, 0, 0]),  # 2 MB of slots
        (19_500_000, ["cached", "host", "host", "host"], [1, 0, 0, 0]),
    ],
)
def test_placement_keeps_what_fits_and_shares_the_rest_of_the_device_as_slots(device_bytes, kinds, slots):
    plan = plan_expert_placement(FOUR, 16 * MB, device_bytes)
    assert [str(p.placement) for p in plan.layers] == kinds
    assert [p.slots for p in plan.layers] == slots
    if device_bytes is not None:
        assert 16 * MB + plan.reserve_bytes + plan.expert_device_bytes <= device_bytes
    assert plan.offloaded == (kinds != ["device"] * 4)


def test_offloaded_layers_keep_their_whole_bank_in_host_memory():
    plan = plan_expert_placement(FOUR, 16 * MB, 30 * MB, host_bytes=64 * MB)
    assert plan.expert_host_bytes == 32 * MB and plan.layers[0].placement is Placement.CACHED


def test_a_device_too_small_for_the_non_expert_part_names_both_sizes():
    with pytest.raises(InputError, match=r"device memory 10000000 bytes cannot hold .* \(16000000 bytes\)"):
        plan_expert_placement(FOUR, 16 * MB, 10 * MB)


def test_a_host_too_small_for_the_banks_names_host_and_device_sizes():
    with pytest.raises(
        InputError, match=r"need 32000000 bytes of host memory but the host has 20000000 bytes.*device \(30000000"
    ):
        plan_expert_placement(FOUR, 16 * MB, 30 * MB, host_bytes=20 * MB)


def test_the_reserve_is_a_tenth_of_the_device_up_to_512_mib():
    assert device_reserve_bytes(10 * MB) == MB and device_reserve_bytes(80 << 30) == 512 << 20


# ---- end to end through generate ------------------------------------------------------------


def generate_json(*args: str) -> dict:  # type: ignore[type-arg]
    result = CliRunner().invoke(app, ["generate", "--prompt-ids", "5,17,3,99", "--max-tokens", "10", "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(next(line for line in reversed(result.stdout.splitlines()) if line.startswith("{")))


@pytest.mark.parametrize(
    ("formats", "cap"),
    [((), 1_000_000), (("--experts", "int4"), 760_000), (("--dtype", "bfloat16"), 650_000)],
)
def test_a_capped_device_serves_the_same_greedy_tokens_with_experts_in_host_banks(tiny_checkpoint, formats, cap):
    source, _ = tiny_checkpoint("qwen3_moe")
    uncapped = generate_json("--model", str(source), *formats)
    capped = generate_json("--model", str(source), *formats, "--gpu-memory-bytes", str(cap), "--expert-q", "0.5")
    assert capped["token_ids"] == uncapped["token_ids"]
    report = capped["expert_placement"]
    assert {layer["placement"] for layer in report["layers"]} & {"cached", "host"}
    assert report["misses"] > 0 and report["cpu_bytes"] > 0 and report["q"] == 0.5
    assert report["expert_host_bytes"] > 0
    assert "expert_placement" not in uncapped


def test_without_a_given_q_generate_measures_q_star_at_start(tiny_checkpoint):
    source, _ = tiny_checkpoint("qwen3_moe")
    report = generate_json("--model", str(source), "--gpu-memory-bytes", "1000000")["expert_placement"]
    assert report["bandwidths"]["device_is_stand_in"] is True
    assert report["q"] == pytest.approx(report["bandwidths"]["q_star"], abs=1e-4)


def test_a_cap_too_small_for_the_rest_of_the_shard_fails_with_both_sizes(tiny_checkpoint):
    source, _ = tiny_checkpoint("qwen3_moe")
    result = CliRunner().invoke(
        app, ["generate", "--model", str(source), "--prompt-ids", "5", "--gpu-memory-bytes", "1000"]
    )
    assert result.exit_code != 0 and "device memory 1000 bytes cannot hold" in result.output


# ---- a local fleet whose plan caps device memory --------------------------------------------


def test_a_fleet_with_capped_device_memory_serves_the_same_tokens_and_reports_its_placement(tiny_checkpoint, tmp_path):
    from test_pipeline import Fleet, prompts_and_params, reference, run_concurrently, wait_until

    from modelfleet.engine.shard import Shard

    source, _ = tiny_checkpoint("qwen3_moe")
    fleet = Fleet(source, tmp_path, stages=2)
    stage = fleet.stages[0]
    shard = Shard.load(source, stage.layer_start, stage.layer_end, dtype=fleet.plan.model.dtype)
    banks = sum(m.bank_bytes for m in moe_layers(shard))
    other = shard.weights_bytes - banks + stage.kv_budget_bytes
    cap = int((other + banks // 2) / 0.9) + 1  # about half the experts fit beside the reserve
    serving = fleet.plan.serving.model_copy(
        update={"gpu_memory_bytes": cap, "expert_split_q": 0.5, "expert_prefetch": ExpertPrefetch.PREDICTED}
    )
    fleet.plan = fleet.plan.model_copy(update={"serving": serving})
    fleet.plan_path.write_text(fleet.plan.to_json())
    fleet.local.plan = fleet.plan
    fleet.start()
    try:
        prompts, params = prompts_and_params(3)
        assert run_concurrently(fleet, prompts, params) == reference(source, prompts, params)
        status = fleet.status(0)
        report = status["expert_placement"]
        assert {layer["placement"] for layer in report["layers"]} & {"cached", "host"}
        assert report["q"] == 0.5 and status["numa"]["cpu_workers"] >= 0
        (node,) = report["by_numa_node"]
        assert node["ranks"] == [0] and node["host_expert_bytes"] == report["expert_host_bytes"] > 0
        misses = "modelfleet_stage_expert_cache_misses_total"
        wait_until(lambda: fleet.metric(0, misses) > 0, 10, "expert misses counted in /metrics")
        assert fleet.metric(0, "modelfleet_stage_expert_cpu_bytes_total") > 0
        assert fleet.metric(0, "modelfleet_stage_expert_split_q") == 0.5
        # the second stage holds two cached MoE layers in a row: the first predicts the second's experts
        prefetch = ("modelfleet_stage_expert_prefetch_bytes_total", "modelfleet_stage_expert_prefetch_hits_total")
        wait_until(lambda: all(fleet.metric(1, name) > 0 for name in prefetch), 10, "prefetch counted in /metrics")
    finally:
        fleet.stop()


def test_profile_bandwidth_prints_both_betas_q_star_and_the_predicted_step_and_says_the_device_is_absent():
    ask = ["profile-bandwidth", "--hidden", "64", "--moe-inner", "32", "--experts", "4", "--seconds", "0.05"]
    result = CliRunner().invoke(app, [*ask, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["beta_g_bytes_per_second"] > 0 and report["beta_c_bytes_per_second"] > 0
    assert report["q_star"] == pytest.approx(
        q_star(report["beta_g_bytes_per_second"], report["beta_c_bytes_per_second"]), abs=1e-3
    )
    assert set(report["predicted_step_seconds"]) == {"q_star", "fetch_all", "cpu_all"}
    if not torch.cuda.is_available():
        table = CliRunner().invoke(app, ask)
        assert table.exit_code == 0 and "device absent" in table.stdout


# ---- at plan time ---------------------------------------------------------------------------


def test_plan_time_expert_sizes_match_what_the_engine_loads(tiny_checkpoint):
    from modelfleet.engine.checkpoint import Checkpoint
    from modelfleet.engine.shard import Shard
    from modelfleet.planner import routed_experts

    source, _ = tiny_checkpoint("qwen3_moe")
    assert routed_experts(Checkpoint(source), 4, "float32", None) == moe_layers(Shard.load(source))


def test_modelfleet_plan_with_a_device_cap_prints_each_layers_placement_and_writes_the_cap(tiny_checkpoint, tmp_path):
    source, _ = tiny_checkpoint("qwen3_moe")
    out = tmp_path / "plan.json"
    ask = ["plan", "--model", str(source), "--stages", "2", "--context-length", "256", "--out", str(out)]
    result = CliRunner().invoke(app, [*ask, "--gpu-memory-bytes", "2700000"])
    assert result.exit_code == 0, result.output
    assert "expert placement" in result.stdout and "cached" in result.stdout
    assert json.loads(out.read_text())["serving"]["gpu_memory_bytes"] == 2700000
    small = CliRunner().invoke(app, [*ask, "--gpu-memory-bytes", "90000"])
    assert (
        small.exit_code != 0 and "group 0 stage 0 (serving.gpu_memory_bytes): device memory 90000 bytes" in small.output
    )


# ---- under tensor parallelism ---------------------------------------------------------------

TP_PROMPT = [5, 17, 3, 99, 42]


def tp_tokens(source: str, tensor: object, cap: int | None) -> tuple[list[int], dict]:  # type: ignore[type-arg]
    from modelfleet.engine.expert_offload import StoreOptions
    from modelfleet.engine.generate import LocalModel, generate
    from modelfleet.engine.sampling import SamplingParams

    lm = LocalModel.load(source, tensor=tensor, max_slots=1, max_context=64, device_memory_bytes=cap,  # type: ignore[arg-type]
                         store_options=StoreOptions(q=0.5))  # fmt: skip
    tokens = generate(lm, TP_PROMPT, SamplingParams(max_tokens=8, stop_token_ids=())).token_ids
    return tokens, lm.expert_placement


def tp_rank_main(rank: int, port: int, source: str, cap: int, out: str) -> None:
    from modelfleet.engine.tensor_parallel import close_tensor_group, init_tensor_group

    torch.set_num_threads(1)  # two ranks share two cores
    group = init_tensor_group(rank, 2, "127.0.0.1", port, "cpu", timeout_seconds=60)
    try:
        tokens, report = tp_tokens(source, group, cap)
        torch.save({"tokens": tokens, "report": report}, f"{out}/rank{rank}.pt")
    finally:
        close_tensor_group()


def test_each_tensor_rank_stores_its_slice_of_the_experts_and_the_group_keeps_the_whole_models_tokens(
    tiny_checkpoint, tmp_path
):
    from test_tensor_parallel import spawn_ranks

    source, _ = tiny_checkpoint("qwen3_moe")
    whole, _ = tp_tokens(str(source), None, None)
    spawn_ranks(tp_rank_main, lambda rank, port: (rank, port, str(source), 500_000, str(tmp_path)), timeout=180)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert [r["tokens"] for r in ranks] == [whole, whole]
    for r in ranks:
        assert {layer["placement"] for layer in r["report"]["layers"]} & {"cached", "host"}
        assert r["report"]["cpu_bytes"] > 0
