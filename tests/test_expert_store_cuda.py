"""The expert store's CUDA path (engine.expert_store.DeviceSlotBank): pinned host banks, a
stacked device slot bank filled by side-stream copies, expert ids remapped to slots in front of
the resident bank's kernels, the CPU share on worker threads. Against the all-resident bank on the
same GPU: bit-identical where every pair runs on the device (hits and fetches, after evictions),
within the kernels' tolerance where the CPU computes some; a capped model serves the uncapped
model's greedy tokens through `modelfleet generate`. Skipped without CUDA (CI)."""

from __future__ import annotations

import json

import pytest
import torch
from gpu_cases import cuda_only
from tiny import build_model, train_on_successors
from typer.testing import CliRunner

from modelfleet.cli import app
from modelfleet.engine.expert_offload import moe_layers
from modelfleet.engine.expert_placement import MAX_DEVICE_RESERVE_BYTES, ExpertPrefetch
from modelfleet.engine.expert_prefetch import install_prefetch
from modelfleet.engine.expert_store import EvictionPolicy, ExpertStore, StoreConfig, measure_bandwidths
from modelfleet.engine.generate import LocalModel
from modelfleet.engine.kernels import cpu_experts
from modelfleet.engine.layers import Dense, Experts, SparseMoE, softmax_top_k
from modelfleet.engine.quantize import quantized_module

pytestmark = [pytest.mark.gpu, cuda_only]

H, I, E = 256, 128, 16
CUDA = torch.device("cuda")


def bank_on_cuda(fmt: str, hidden: int = H, inner: int = I) -> Experts:
    g = torch.Generator().manual_seed(3)
    plain = Experts(
        torch.randn(E, 2 * inner, hidden, generator=g) * 0.05, torch.randn(E, hidden, inner, generator=g) * 0.05
    )
    if fmt == "bf16":
        return Experts(plain.gate_up.data.to(CUDA, torch.bfloat16), plain.down.data.to(CUDA, torch.bfloat16))
    bank = quantized_module("layers.0.mlp.experts", plain, fmt)
    bank.gate_up, bank.down = bank.gate_up.to(CUDA), bank.down.to(CUDA)
    return bank  # type: ignore[no-any-return]


def steps(count: int, seed: int = 4, k: int = 4) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(x, index, weight) on the GPU: 1 or 8 tokens, routed to a few hot experts and some cold ones."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        tokens = 8 if i % 3 == 2 else 1
        hot = torch.multinomial(torch.linspace(3.0, 0.2, E), E, generator=g)  # skewed: evictions and reuse
        index = torch.stack([hot[torch.randperm(min(E, 3 * k), generator=g)[:k]] for _ in range(tokens)])
        weight = torch.softmax(torch.randn(tokens, k, generator=g), -1)
        x = torch.randn(tokens, H, generator=g)
        out.append((x.to(CUDA, torch.bfloat16), index.to(CUDA), weight.to(CUDA, torch.bfloat16)))
    return out


@pytest.mark.parametrize("fmt", ["bf16", "int4", "mxfp4"])
@pytest.mark.parametrize("policy", [EvictionPolicy.LRU, EvictionPolicy.FREQUENCY])
def test_fetched_slots_give_the_resident_banks_outputs_bit_for_bit_after_evictions(fmt, policy):
    resident = bank_on_cuda(fmt)
    # 12 slots: room for every expert a step routes to (12 candidates), fewer than the 16 experts
    store = ExpertStore(bank_on_cuda(fmt), CUDA, StoreConfig(12, policy, 1.0, cpu_workers=2), dtype=torch.bfloat16)
    assert store.device_bank is not None
    # the host side: one copy of each expert (the pinned mirror, which the compiled kernel reads),
    # or for bf16 the mirror as torch's bank
    assert (store.cpu_kernel is not None) == (fmt != "bf16" and cpu_experts.available())
    host_bytes = sum(t.numel() * t.element_size() for t in store.host.buffers()) or sum(
        t.numel() * t.element_size() for t in store.host.parameters()
    )
    assert host_bytes == store.device_bank.host_nbytes
    used = 0
    for x, index, weight in steps(12):
        assert torch.equal(store(x, index, weight), resident(x, index, weight))
        used += len(set(index.flatten().tolist()))
    evictions = store.counters.fetched - 12
    assert evictions > 0  # slots were refilled: the id -> slot map moved under the kernels
    assert store.slot_map.hits + store.slot_map.misses == used and store.slot_map.hits > 0
    assert store.counters.cpu_bytes == 0 and store.counters.fetch_bytes == store.counters.fetched * store.expert_nbytes


@pytest.mark.parametrize("fmt", ["bf16", "int4", "mxfp4"])
@pytest.mark.parametrize(("slots", "q"), [(0, 0.0), (5, 0.0), (5, 0.5)])
def test_misses_computed_on_the_cpu_keep_the_resident_outputs_within_the_kernels_tolerance(fmt, slots, q):
    resident = bank_on_cuda(fmt)
    store = ExpertStore(bank_on_cuda(fmt), CUDA, StoreConfig(slots, EvictionPolicy.LRU, q, 4), dtype=torch.bfloat16)
    for x, index, weight in steps(9):
        ours, ref = store(x, index, weight).float(), resident(x, index, weight).float()
        assert (ours - ref).abs().max().item() <= 0.02 * ref.abs().max().item() + 1e-3
    assert store.counters.cpu_bytes > 0
    assert (store.counters.fetch_bytes > 0) == (slots > 0 and q > 0)


@pytest.fixture
def few_cpu_threads():
    """Fewer intra-op threads than cores: the thread issuing copies keeps a core of its own."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, min(4, threads - 2)))
    yield
    torch.set_num_threads(threads)


def test_q_star_comes_from_pinned_copies_to_the_gpu_measured_with_the_cpu_busy(few_cpu_threads):
    # Qwen3-30B-A3B's expert shape: copies of a few MB each, not latency-bound ones
    big = bank_on_cuda("int4", 2048, 768)
    store = ExpertStore(big, CUDA, StoreConfig(4, EvictionPolicy.LRU, None, 1), dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(1, 2048, generator=g).to(CUDA, torch.bfloat16)
    index, weight = torch.tensor([[3, 9, 12, 1]], device=CUDA), torch.full((1, 4), 0.25, device=CUDA).bfloat16()
    store.q = 1.0  # the step's four experts fill the four slots
    store(x, index, weight)  # slot 0 holds an expert the measurement borrows and gives back
    held = store.slot_map.slots[0].expert
    assert held is not None
    measured = measure_bandwidths(store, 0.2, torch.bfloat16)
    assert not measured.device_is_stand_in and measured.beta_g > 1e9 and measured.beta_c > 0
    assert 0 < measured.q_star < 1
    resident = bank_on_cuda("int4", 2048, 768)
    assert store.slot_map.slots[0].expert == held
    assert torch.equal(store(x, index, weight), resident(x, index, weight))  # every expert a hit, slot 0 refilled
    assert store.slot_map.hits == 4


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory):
    """trained(family) -> directory of a tiny model taught a successor task (margins like a real model's)."""
    cache = {}

    def get(family: str):  # type: ignore[no-untyped-def]
        if family not in cache:
            model = build_model(family, **({"intermediate_size": 64} if family == "mixtral" else {}))
            train_on_successors(model, 60)
            path = tmp_path_factory.mktemp(f"trained_{family}")
            model.save_pretrained(path)
            cache[family] = path
        return cache[family]

    return get


def cap_for(path, dtype: str, experts: tuple[str, ...], share: float) -> int:  # type: ignore[no-untyped-def]
    """A device cap that leaves room for about ``share`` of the model's experts (the plan's reserve included)."""
    formats = None
    if experts:
        from modelfleet.engine.formats.plan import plan_from_options

        formats = plan_from_options(False, experts=experts[1])
    lm = LocalModel.load(path, device="cuda", dtype=dtype, max_slots=1, formats=formats)
    shard = lm.shards[0]
    banks = sum(m.bank_bytes for m in moe_layers(shard))
    other = shard.weights_bytes - banks + shard.kv_bytes
    cap = int((other + share * banks) / 0.9) + 1
    assert cap // 10 < MAX_DEVICE_RESERVE_BYTES
    return cap


def generate_json(*args: str) -> dict:  # type: ignore[type-arg]
    ask = ["generate", "--prompt-ids", "5,17,3,99", "--max-tokens", "12", "--json", "--device", "cuda", *args]
    result = CliRunner().invoke(app, ask)
    assert result.exit_code == 0, result.output
    return json.loads(next(line for line in reversed(result.stdout.splitlines()) if line.startswith("{")))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("formats", [(), ("--experts", "int4")], ids=["bf16", "int4"])
def test_a_model_over_the_capped_gpu_serves_the_uncapped_greedy_tokens(trained, family, formats):
    path = trained(family)
    common = ("--model", str(path), "--dtype", "bfloat16", *formats)
    cap = cap_for(path, "bfloat16", formats, 0.4)
    uncapped = generate_json(*common)
    fetched = generate_json(*common, "--gpu-memory-bytes", str(cap), "--expert-q", "1")
    hybrid = generate_json(*common, "--gpu-memory-bytes", str(cap))
    assert fetched["token_ids"] == uncapped["token_ids"]  # every pair on the GPU: the same kernels
    assert hybrid["token_ids"] == uncapped["token_ids"]  # q* measured: some pairs on the CPU
    for run in (fetched, hybrid):
        report = run["expert_placement"]
        assert "cached" in {layer["placement"] for layer in report["layers"]}
        assert report["misses"] > 0 and report["expert_host_bytes"] > 0
    # (a prefill routing to more experts than there are slots computes some on the CPU even at q = 1)
    assert fetched["expert_placement"]["fetch_bytes"] > 0
    measured = hybrid["expert_placement"]["bandwidths"]
    assert measured["device_is_stand_in"] is False and 0 < measured["q_star"] < 1


def test_a_capped_load_keeps_the_offloaded_experts_off_the_gpu_while_loading(trained):
    probe = torch.empty(1 << 20, device="cuda")
    if torch.cuda.memory_allocated() < probe.numel() * 4:
        pytest.skip("this CUDA allocator keeps no statistics (PYTORCH_NO_CUDA_MEMORY_CACHING is set?)")
    del probe
    path = trained("qwen3_moe")
    cap = cap_for(path, "bfloat16", (), 0.4)
    LocalModel.load(path, device="cuda", dtype="bfloat16", max_slots=1)  # workspaces a first load keeps
    peaks = []
    for device_memory_bytes in (None, cap):
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        lm = LocalModel.load(
            path, device="cuda", dtype="bfloat16", max_slots=1, device_memory_bytes=device_memory_bytes
        )
        peaks.append(torch.cuda.max_memory_allocated() - before)
        del lm
    banks = sum(m.bank_bytes for m in moe_layers(LocalModel.load(path, dtype="bfloat16").shards[0]))
    # the uncapped load holds every bank; the capped one at most one layer's while it is built,
    # then 40% of them as slots (plus one layer's while its slot bank is laid out)
    assert peaks[1] < peaks[0] - 0.1 * banks


# ---- prefetch (engine.expert_prefetch) ------------------------------------------------------


def routed_block(slots: int | None, seed: int, hidden: int = 2048, inner: int = 768) -> SparseMoE:
    """A bf16 MoE block of E experts, top 4, on the GPU: big experts (copies of ~9 MB each, long
    enough that a kernel not waiting for them would read stale slots); ``slots``: in a store."""
    g = torch.Generator().manual_seed(seed)
    bank = Experts(
        (torch.randn(E, 2 * inner, hidden, generator=g) * 0.05).to(CUDA, torch.bfloat16),
        (torch.randn(E, hidden, inner, generator=g) * 0.05).to(CUDA, torch.bfloat16),
    )
    experts = bank if slots is None else ExpertStore(bank, CUDA, StoreConfig(slots, EvictionPolicy.LRU, 1.0, 2))
    router = Dense((torch.randn(E, hidden, generator=g) * 0.05).to(CUDA, torch.bfloat16))
    return SparseMoE(router, lambda logits: softmax_top_k(logits, 4, True), experts)


def test_a_lookahead_prefetch_is_waited_for_by_the_next_layer_and_changes_no_bit():
    first, second = routed_block(4, 1), routed_block(8, 2)
    resident = [routed_block(None, 1), routed_block(None, 2)]
    install_prefetch([first, second], ExpertPrefetch.PREDICTED)
    ahead = second.experts
    assert isinstance(ahead, ExpertStore) and ahead.device_bank is not None
    g = torch.Generator().manual_seed(8)
    for _ in range(8):
        x = torch.randn(1, 2048, generator=g).to(CUDA, torch.bfloat16)
        # the second block sees the first one's input: its routing is exactly the prediction
        assert torch.equal(first(x), resident[0](x))
        assert torch.equal(second(x), resident[1](x))  # read from slots the copies had to fill first
    c, slot_map = ahead.counters, ahead.slot_map
    assert c.prefetched > 0 and slot_map.prefetch_hits == c.prefetched and c.fetched == 0
    assert slot_map.misses == 0 and c.prefetch_bytes == c.prefetched * ahead.expert_nbytes


def syncs_of(step) -> int:  # type: ignore[no-untyped-def]
    """How many synchronising CUDA calls ``step()`` makes (torch's sync debug mode, counted)."""
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in seen)


def test_the_prediction_rides_in_the_same_host_copy_as_the_layers_own_routing():
    counts = []
    for mode in (ExpertPrefetch.OFF, ExpertPrefetch.PREDICTED):
        first, second = routed_block(4, 1), routed_block(8, 2)
        install_prefetch([first, second], mode)
        x = torch.randn(1, 2048, generator=torch.Generator().manual_seed(8)).to(CUDA, torch.bfloat16)
        first(x)  # warm: kernels chosen, slots filled
        counts.append(syncs_of(lambda: first(x)))  # noqa: B023  (called at once)
    assert 0 < counts[1] <= counts[0]  # the prediction adds no wait for the GPU (H200: 1 with it, 2 without)


@pytest.mark.parametrize("q", ["1", None], ids=["fetch", "hybrid"])
def test_prefetch_on_or_off_serves_the_same_greedy_tokens_on_the_gpu(trained, q):
    path = trained("qwen3_moe")
    cap = cap_for(path, "bfloat16", (), 0.4)
    common = ("--model", str(path), "--dtype", "bfloat16", "--gpu-memory-bytes", str(cap))
    common += ("--expert-q", q) if q is not None else ()
    runs = {mode: generate_json(*common, "--expert-prefetch", mode) for mode in ("off", "predicted")}
    uncapped = generate_json("--model", str(path), "--dtype", "bfloat16")
    assert runs["predicted"]["token_ids"] == runs["off"]["token_ids"] == uncapped["token_ids"]
    report = runs["predicted"]["expert_placement"]
    assert report["prefetched"] > 0 and report["prefetch_hits"] > 0
    assert runs["off"]["expert_placement"]["prefetched"] == 0


def test_deepseek_v4_hash_layers_find_their_experts_prefetched_on_the_gpu(tmp_path):
    from dsv4_tiny import save
    from test_expert_prefetch import hash_layer_counts

    save(tmp_path, seed=1)
    cap = cap_for(tmp_path, "float32", (), 0.5)
    off_tokens, off = hash_layer_counts(tmp_path, cap, ExpertPrefetch.OFF, "cuda")
    exact_tokens, exact = hash_layer_counts(tmp_path, cap, ExpertPrefetch.EXACT, "cuda")
    assert exact_tokens == off_tokens
    assert all(row["misses"] > 0 for row in off)
    assert all(row["misses"] == 0 and row["prefetched"] == row["prefetch_hits"] > 0 for row in exact)
