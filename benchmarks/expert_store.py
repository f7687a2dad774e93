"""The expert store on a GPU: Qwen3-30B-A3B-shaped MoE layers (128 experts, top 8, H=2048,
I=768) with int4 experts, the device capped so that a share of each layer's experts fits in
slots. Per configuration, the expert part of a decode step (every layer's routed experts, the
routing given) at batch 1 and 8:

- resident: the whole bank on the GPU (the uncapped rate);
- fetch: every miss copied into a slot (q = 1), LRU and frequency eviction;
- cpu: every miss computed on the CPU, the slots holding the hottest experts (q = 0, what
  llama.cpp's --n-cpu-moe / KTransformers do with a static hot set);
- hybrid at q* (beta_g, beta_c measured at start, both paths at once) and a sweep of q.

Beside each: the bound per step, resident time + max(T_g, T_c) with T_g = fetched bytes /
beta_g and T_c = CPU bytes / beta_c from the measured betas, and measured / bound. Routing is
synthetic (stated in the output): per layer a Zipf popularity over experts (exponent --skew),
top k drawn without replacement per token, fixed seed, the same routes for every configuration.

    python benchmarks/expert_store.py --layers 8 --cap-share 0.28 --cpu-workers 1 --cpu-threads 14 --out out/expert_store.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from modelfleet.engine.expert_store import (
    Bandwidths,
    EvictionPolicy,
    ExpertStore,
    StoreConfig,
    StoreCounters,
    measure_bandwidths,
)
from modelfleet.engine.layers import Experts
from modelfleet.engine.quantize import QuantizedExperts, quantized_module

Step = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # per layer (x, index, weight)


def build_bank(hidden: int, inner: int, experts: int, fmt: str, seed: int) -> QuantizedExperts:
    g = torch.Generator(device="cuda").manual_seed(seed)
    gate_up = torch.randn(experts, 2 * inner, hidden, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    down = torch.randn(experts, hidden, inner, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    bank = quantized_module("layers.0.mlp.experts", Experts(gate_up, down), fmt)
    assert isinstance(bank, QuantizedExperts)
    return bank


def popularity(experts: int, skew: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ranks = torch.randperm(experts, generator=g).float() + 1
    return ranks.pow(-skew)


def routes(
    layers: int, steps: int, batch: int, experts: int, top_k: int, hidden: int, skew: float
) -> tuple[list[Step], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    pops = [popularity(experts, skew, 100 + layer) for layer in range(layers)]
    out = []
    for _ in range(steps):
        step = []
        for layer in range(layers):
            index = torch.multinomial(pops[layer].expand(batch, -1), top_k, generator=g)
            weight = torch.softmax(torch.randn(batch, top_k, generator=g), -1)
            x = torch.randn(batch, hidden, generator=g) * 0.5
            step.append((x.to("cuda", torch.bfloat16), index.to("cuda"), weight.to("cuda", torch.bfloat16)))
        out.append(step)
    return out, pops


def time_steps(
    banks: list[torch.nn.Module], steps: list[Step], warmup: int, after_warmup: Callable[[], None] | None = None
) -> float:
    """Seconds per step over ``steps`` after ``warmup`` of them (then ``after_warmup()``)."""
    for step in steps[:warmup]:
        for bank, (x, index, weight) in zip(banks, step, strict=True):
            bank(x, index, weight)
    torch.cuda.synchronize()
    if after_warmup is not None:
        after_warmup()
    start = time.perf_counter()
    for step in steps[warmup:]:
        for bank, (x, index, weight) in zip(banks, step, strict=True):
            bank(x, index, weight)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / (len(steps) - warmup)


def run_store(
    stores: list[ExpertStore],
    steps: list[Step],
    warmup: int,
    policy: EvictionPolicy,
    q: float,
    hot: list[list[int]] | None,
) -> dict[str, float]:
    for store in stores:
        store.reset(policy, q)
    if hot is not None:  # a static hot set: the slots hold each layer's most popular experts
        for store, experts in zip(stores, hot, strict=True):
            store.prefetch(experts)

    def zero_counters() -> None:  # the warmup filled the slots; count the steady state
        for store in stores:
            store.slot_map.hits = store.slot_map.misses = 0
            store.counters = StoreCounters()

    seconds = time_steps(list(stores), steps, warmup, zero_counters)
    measured_steps = len(steps) - warmup
    fetch = sum(s.counters.fetch_bytes for s in stores) / measured_steps
    cpu = sum(s.counters.cpu_bytes for s in stores) / measured_steps
    hits = sum(s.slot_map.hits for s in stores)
    misses = sum(s.slot_map.misses for s in stores)
    return {"seconds": seconds, "fetch_bytes": fetch, "cpu_bytes": cpu, "hit_rate": hits / max(hits + misses, 1)}


def main() -> None:
    ask = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ask.add_argument("--layers", type=int, default=8)
    ask.add_argument("--experts", type=int, default=128)
    ask.add_argument("--top-k", type=int, default=8)
    ask.add_argument("--hidden", type=int, default=2048)
    ask.add_argument("--moe-inner", type=int, default=768)
    ask.add_argument("--format", default="int4")
    ask.add_argument("--cap-share", type=float, default=0.28, help="share of each layer's experts given slots")
    ask.add_argument("--skew", type=float, default=0.8, help="Zipf exponent of the synthetic routing")
    ask.add_argument("--cpu-workers", type=int, default=1, help="threads computing CPU experts")
    ask.add_argument("--cpu-threads", type=int, default=14, help="torch intra-op threads inside each CPU expert")
    ask.add_argument("--steps", type=int, default=40)
    ask.add_argument("--warmup", type=int, default=8)
    ask.add_argument("--batches", default="1,8")
    ask.add_argument("--sweep", default="0,0.25,0.5,0.6,0.7,0.8,0.9,1")
    ask.add_argument("--beta-c", default="1x1,1x4,1x8,1x14,2x7,14x1", help="workers x threads to measure betas at")
    ask.add_argument("--out", type=Path, default=None)
    args = ask.parse_args()
    torch.set_num_threads(args.cpu_threads)

    slots = max(1, round(args.cap_share * args.experts))
    pool = ThreadPoolExecutor(args.cpu_workers, thread_name_prefix="cpu-experts")
    resident, stores = [], []
    for layer in range(args.layers):
        bank = build_bank(args.hidden, args.moe_inner, args.experts, args.format, layer)
        config = StoreConfig(slots, EvictionPolicy.LRU, 1.0, args.cpu_workers)
        stores.append(ExpertStore(bank, torch.device("cuda"), config, pool, torch.bfloat16))
        x = torch.zeros(1, args.hidden, device="cuda", dtype=torch.bfloat16)
        bank.gate_up.prepare_for(x)
        bank.down.prepare_for(torch.zeros(1, args.moe_inner, device="cuda", dtype=torch.bfloat16))
        resident.append(bank)
    nbytes = stores[0].expert_nbytes

    betas: dict[str, Bandwidths] = {}
    serving = stores[0]._pool, stores[0].config.cpu_workers
    for combo in args.beta_c.split(","):  # both paths at once, per CPU workers x threads
        workers, threads = (int(n) for n in combo.split("x"))
        torch.set_num_threads(threads)
        stores[0]._pool, stores[0].config.cpu_workers = ThreadPoolExecutor(workers), workers
        betas[combo] = measure_bandwidths(stores[0], 1.0, torch.bfloat16)
        stores[0]._pool.shutdown()
        print(json.dumps({"workers_x_threads": combo, **betas[combo].as_dict()}), flush=True)
    stores[0]._pool, stores[0].config.cpu_workers = serving
    torch.set_num_threads(args.cpu_threads)
    measured = measure_bandwidths(stores[0], 1.0, torch.bfloat16)
    beta_g, beta_c, q_star = measured.beta_g, measured.beta_c, measured.q_star

    report: dict[str, object] = {
        "shape": {"layers": args.layers, "experts": args.experts, "top_k": args.top_k, "hidden": args.hidden,
                  "moe_inner": args.moe_inner, "format": args.format, "expert_bytes": nbytes},
        "slots_per_layer": slots, "cap_share": slots / args.experts, "cpu_workers": args.cpu_workers,
        "cpu_threads": args.cpu_threads,
        "routing": f"synthetic: Zipf popularity per layer, exponent {args.skew}, top {args.top_k} without replacement",
        "beta_g": beta_g, "beta_c": beta_c, "q_star": q_star,
        "betas_by_workers_x_threads": {c: [b.beta_g, b.beta_c] for c, b in betas.items()},
        "device": torch.cuda.get_device_name(),
        "rows": [],
    }  # fmt: skip
    rows: list[dict[str, object]] = report["rows"]  # type: ignore[assignment]
    for batch in (int(b) for b in args.batches.split(",")):
        steps, pops = routes(
            args.layers, args.steps + args.warmup, batch, args.experts, args.top_k, args.hidden, args.skew
        )
        hot = [torch.argsort(p, descending=True)[:slots].tolist() for p in pops]
        t_resident = time_steps(list(resident), steps, args.warmup)
        rows.append({"batch": batch, "config": "resident", "q": None, "tok_s": batch / t_resident,
                     "step_ms": t_resident * 1e3, "hit_rate": 1.0, "bound_tok_s": batch / t_resident, "vs_bound": 1.0})  # fmt: skip
        configs = [
            ("fetch, lru", EvictionPolicy.LRU, 1.0, None),
            ("fetch, frequency", EvictionPolicy.FREQUENCY, 1.0, None),
            ("cpu, static hot set", EvictionPolicy.LRU, 0.0, hot),
            ("hybrid at q*, lru", EvictionPolicy.LRU, q_star, None),
            ("hybrid at q*, frequency", EvictionPolicy.FREQUENCY, q_star, None),
        ]
        configs += [(f"sweep q={q}", EvictionPolicy.LRU, float(q), None) for q in args.sweep.split(",")]
        for name, policy, q, hot_set in configs:
            got = run_store(stores, steps, args.warmup, policy, q, hot_set)
            t_g, t_c = got["fetch_bytes"] / beta_g, got["cpu_bytes"] / beta_c
            bound = t_resident + max(t_g, t_c)
            row = {"batch": batch, "config": name, "q": round(q, 3), "tok_s": batch / got["seconds"],
                   "step_ms": got["seconds"] * 1e3, "hit_rate": got["hit_rate"],
                   "fetch_mb_per_step": got["fetch_bytes"] / 1e6, "cpu_mb_per_step": got["cpu_bytes"] / 1e6,
                   "t_g_ms": t_g * 1e3, "t_c_ms": t_c * 1e3, "bound_tok_s": batch / bound,
                   "vs_bound": bound / got["seconds"]}  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(json.dumps({k: v for k, v in report.items() if k != "rows"}))
    print(f"{'batch':>5} {'config':<24} {'q':>5} {'tok/s':>8} {'hit':>5} {'bound':>8} {'meas/bound':>10}")
    for row in rows:
        q = "" if row["q"] is None else f"{row['q']:.2f}"
        print(f"{row['batch']:>5} {row['config']:<24} {q:>5} {row['tok_s']:8.1f} {row['hit_rate']:5.2f} "
              f"{row['bound_tok_s']:8.1f} {row['vs_bound']:10.2f}")  # fmt: skip
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
