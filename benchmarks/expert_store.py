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

With ``--model`` (a shape of benchmarks/engine_decode.py): a whole random model of that shape,
built through the engine's load path (``--format`` experts, the rest as the format plan's
default), decode steps only (prefill and warm-up excluded); see :func:`whole_model`.

    python benchmarks/expert_store.py --model qwen3-30b-a3b --layers 48 --format int4 --cap-share 0.28 --batches 1,8
"""

from __future__ import annotations

import argparse
import gc
import html
import importlib.util
import json
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from modelfleet.engine.expert_offload import StoreOptions, default_cpu_workers, moe_layers, offload_experts, stores_of
from modelfleet.engine.expert_placement import ExpertPrefetch, MoELayer, device_reserve_bytes
from modelfleet.engine.expert_store import (
    Bandwidths,
    EvictionPolicy,
    ExpertStore,
    StoreConfig,
    StoreCounters,
    expert_bytes,
    measure_bandwidths,
)
from modelfleet.engine.formats.plain import PLAIN_DTYPES
from modelfleet.engine.formats.plan import FormatPlan
from modelfleet.engine.frame import Frame
from modelfleet.engine.generate import LocalModel
from modelfleet.engine.kernels import cpu_experts
from modelfleet.engine.kvcache import SlotState
from modelfleet.engine.layers import Experts
from modelfleet.engine.quantize import QuantizedExperts, quantized_module
from modelfleet.engine.shard import Shard
from modelfleet.engine.spec import spec_from_config
from modelfleet.results import write_csv

Step = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # per layer (x, index, weight)


def _shapes() -> dict[str, dict[str, int]]:
    """engine_decode.py's model shapes (loaded by path: benchmarks/ is not a package)."""
    path = Path(__file__).resolve().parent / "engine_decode.py"
    spec = importlib.util.spec_from_file_location("engine_decode", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    shapes: dict[str, dict[str, int]] = module.SHAPES
    return shapes


SHAPES = _shapes()


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


# ---- whole-model mode (--model) -------------------------------------------------------------


def host_copies(fmt: str) -> int:
    """How many copies of an offloaded bank the host keeps: the pinned mirror only, where the
    compiled CPU kernel reads it (4-bit formats) or it is torch's bank itself (plain dtypes); else
    also the bank in torch's CPU layout (engine/expert_store.py, DeviceSlotBank and _cpu_bank)."""
    compiled = fmt in cpu_experts.FORMATS and cpu_experts.available()
    return 1 if compiled or fmt in PLAIN_DTYPES else 2


HOST_HEADROOM = 0.8  # the share of MemAvailable the banks may take (the process, KV copies, the OS)


class RandomTensors:
    """A tensor source (engine.checkpoint.TensorSource) of random weights made on read: the names
    and shapes of a transformers model built on the meta device, each tensor from a generator
    seeded by its name (so a rebuilt model is the same), transformers' init: norm weights ones,
    the rest normal(0, initializer_range). Nothing is held: a layer's tensors exist while it loads."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], std: float, device: str, dtype: torch.dtype, seed: int):
        self.shapes, self.std, self.device, self.dtype, self.seed = shapes, std, device, dtype, seed

    def __contains__(self, name: str) -> bool:
        return name in self.shapes

    def read(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=self.dtype, device=self.device)
        g = torch.Generator(device=self.device).manual_seed(self.seed ^ zlib.crc32(name.encode()))
        return (torch.randn(shape, generator=g, device=self.device, dtype=torch.float32) * self.std).to(self.dtype)


def model_config(shape: str, layers: int) -> dict[str, object]:
    """The transformers config (as a dict) of a Qwen3-MoE-shaped model of ``layers`` layers."""
    from transformers import AutoConfig

    dims = {**SHAPES[shape], "num_hidden_layers": layers}
    config = AutoConfig.for_model(
        "qwen3_moe", **dims, max_position_embeddings=4096, norm_topk_prob=True, tie_word_embeddings=False
    )
    out: dict[str, object] = config.to_dict()
    return out


def random_source(config: dict[str, object], device: str, dtype: torch.dtype, seed: int = 0) -> RandomTensors:
    """The checkpoint names and shapes of ``config``'s transformers model (built on the meta
    device: no memory), as a :class:`RandomTensors`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf, dtype=dtype)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    return RandomTensors(shapes, float(hf.initializer_range), device, dtype, seed)


def one_expert_bytes(hidden: int, inner: int, fmt: str, device: str) -> int:
    """Bytes of one routed expert of this shape in ``fmt``, as a bank holds it (a one-expert bank)."""
    gate_up = torch.randn(1, 2 * inner, hidden, device=device, dtype=torch.bfloat16) * 0.02
    down = torch.randn(1, hidden, inner, device=device, dtype=torch.bfloat16) * 0.02
    return expert_bytes(quantized_module("layers.0.mlp.experts", Experts(gate_up, down), fmt))


def proc_bytes(path: str, key: str) -> int | None:
    """A ``key: N kB`` line of a /proc file in bytes (None where there is none)."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def mem_available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    return proc_bytes("/proc/meminfo", "MemAvailable")


def rss_bytes() -> int | None:
    """This process's resident set (pinned host memory included) from /proc/self/status."""
    return proc_bytes("/proc/self/status", "VmRSS")


def layers_that_fit(layers: int, bank_bytes: int, available: int | None, copies: int) -> int:
    """How many of ``layers`` layers' offloaded banks (``bank_bytes`` each, held ``copies``
    times) fit HOST_HEADROOM of the available host memory (all of them when it is unknown)."""
    if available is None:
        return layers
    return max(0, min(layers, int(available * HOST_HEADROOM) // (copies * bank_bytes)))


def cap_for_slots(layers: Sequence[MoELayer], other_bytes: int, slots: int) -> int:
    """The least device memory (``--gpu-memory-bytes``) for which the placement gives every MoE
    layer ``slots`` cache slots: the non-expert weights and KV, the slots, and the capture reserve
    the planner takes from the cap (which grows with the cap: iterated to its fixed point)."""
    need = other_bytes + slots * sum(m.expert_bytes for m in layers)
    cap = need
    while cap - device_reserve_bytes(cap) < need:
        cap = need + device_reserve_bytes(cap)
    return cap


@dataclass
class Run:
    """One decode run: seconds per timed step, every stream's greedy tokens (warm-up included),
    and each store's counters over the timed steps."""

    seconds: float
    tokens: list[list[int]]
    per_layer: list[dict[str, int]]


COUNTED = ("hits", "misses", "fetch_bytes", "cpu_bytes")


def prefill(lm: LocalModel, prompts: list[list[int]]) -> tuple[list[SlotState], list[int]]:
    """Prefill every prompt once (untimed) and keep each stream's KV: every configuration starts
    its decode from the same state and the same first token."""
    slots = [lm.acquire() for _ in prompts]
    frame = Frame.of_streams([(s, 0, p) for s, p in zip(slots, prompts, strict=True)])
    frame.output_rows = torch.tensor([sum(len(p) for p in prompts[: i + 1]) - 1 for i in range(len(prompts))])
    first = lm.forward(frame).argmax(-1).tolist()
    states = [lm.export_slot(s) for s in slots]
    for s in slots:
        lm.release(s)
    return states, first


def decode_run(
    lm: LocalModel, states: list[SlotState], first: list[int], warmup: int, steps: int, stores: list[ExpertStore]
) -> Run:
    """Greedy decode from the prefilled states: ``warmup`` untimed steps (graph capture, kernel
    compiles, cache fill), then ``steps`` timed ones (each ends with its tokens on the host, as
    serving's do); the stores' counters are read around the timed steps."""
    slots = list(range(len(states)))
    for slot, state in zip(slots, states, strict=True):
        lm.import_slot(slot, state)
    start_pos = [state.length for state in states]
    out = [[t] for t in first]

    def step(i: int) -> None:
        nxt = lm.decode([o[-1] for o in out], slots, [p + i for p in start_pos]).argmax(-1).tolist()
        for o, t in zip(out, nxt, strict=True):
            o.append(t)

    for i in range(warmup):
        step(i)
    before = [store.report() for store in stores]
    sync(lm)
    start = time.perf_counter()
    for i in range(warmup, warmup + steps):
        step(i)
    sync(lm)
    seconds = (time.perf_counter() - start) / steps
    after = [store.report() for store in stores]
    for slot in slots:
        lm.release(slot)
    per_layer = [{k: int(a[k]) - int(b[k]) for k in COUNTED} for a, b in zip(after, before, strict=True)]  # type: ignore[call-overload]
    return Run(seconds, out, per_layer)


def sync(lm: LocalModel) -> None:
    if lm.shards[0].device.type == "cuda":
        torch.cuda.synchronize()


def first_divergence(got: list[list[int]], want: list[list[int]]) -> str:
    """'yes' when every stream's tokens are the reference's, else where the first one differs."""
    diffs = [
        (next(i for i, (a, b) in enumerate(zip(g, w, strict=True)) if a != b), s)
        for s, (g, w) in enumerate(zip(got, want, strict=True))
        if g != w
    ]
    if not diffs:
        return "yes"
    step, stream = min(diffs)
    return f"no: stream {stream} at token {step} ({len(diffs)} of {len(got)} streams differ)"


def store_row(batch: int, config: str, q: float, run: Run, steps: int, resident_eager: float, betas: Bandwidths,
              reference: list[list[int]]) -> dict[str, object]:  # fmt: skip
    """A capped configuration's row: rate, counters per step, and the bound: the resident eager
    step + sum over layers of max(T_g, T_c) (each layer's fetched and CPU bytes per step over the
    betas measured at start), with measured / bound as a ratio of step times."""
    fetch = [layer["fetch_bytes"] / steps for layer in run.per_layer]
    cpu = [layer["cpu_bytes"] / steps for layer in run.per_layer]
    t_g = [b / betas.beta_g for b in fetch]
    t_c = [b / betas.beta_c for b in cpu]
    bound = resident_eager + sum(max(g, c) for g, c in zip(t_g, t_c, strict=True))
    hits = sum(layer["hits"] for layer in run.per_layer)
    looked = hits + sum(layer["misses"] for layer in run.per_layer)
    return {
        "batch": batch, "config": config, "q": round(q, 3), "tok_s": round(batch / run.seconds, 2),
        "step_ms": round(run.seconds * 1e3, 3), "hit_rate": round(hits / max(looked, 1), 3),
        "fetch_mb_per_step": round(sum(fetch) / 1e6, 2), "cpu_mb_per_step": round(sum(cpu) / 1e6, 2),
        "t_g_ms": round(sum(t_g) * 1e3, 3), "t_c_ms": round(sum(t_c) * 1e3, 3), "bound_ms": round(bound * 1e3, 3),
        "bound_tok_s": round(batch / bound, 2), "measured_over_bound": round(run.seconds / bound, 3),
        "tokens_identical": first_divergence(run.tokens, reference),
    }  # fmt: skip


def resident_row(batch: int, config: str, run: Run, reference: list[list[int]]) -> dict[str, object]:
    return {"batch": batch, "config": config, "q": None, "tok_s": round(batch / run.seconds, 2),
            "step_ms": round(run.seconds * 1e3, 3), "hit_rate": 1.0, "fetch_mb_per_step": 0.0, "cpu_mb_per_step": 0.0,
            "tokens_identical": first_divergence(run.tokens, reference)}  # fmt: skip


def sweep_svg(lines: dict[str, list[tuple[float, float]]], q_star: float, title: str) -> str:
    """A small self-contained SVG: tok/s against q, one polyline per label, q* a dashed line."""
    w, h, left, right, top, bottom = 560, 340, 60, 120, 30, 45
    y_max = max((y for pts in lines.values() for _, y in pts), default=1.0) * 1.1 or 1.0
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]

    def px(q: float, y: float) -> tuple[float, float]:
        return left + q * (w - left - right), h - bottom - y / y_max * (h - top - bottom)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="11">',
        f'<rect width="{w}" height="{h}" fill="white"/>',
        f'<text x="{w / 2}" y="16" text-anchor="middle" font-size="12">{html.escape(title)}</text>',
        f'<line x1="{left}" y1="{h - bottom}" x2="{w - right}" y2="{h - bottom}" stroke="black"/>',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{h - bottom}" stroke="black"/>',
        f'<text x="{(left + w - right) / 2}" y="{h - 8}" text-anchor="middle">q (fetched share of miss bytes)</text>',
        f'<text x="14" y="{(top + h - bottom) / 2}" transform="rotate(-90 14 {(top + h - bottom) / 2})" '
        'text-anchor="middle">decode tok/s</text>',
    ]
    for i in range(6):
        x, y0 = px(i / 5, 0)
        _, y = px(0, y_max * i / 5 / 1.1)
        parts.append(f'<text x="{x}" y="{y0 + 15}" text-anchor="middle">{i / 5:.1f}</text>')
        parts.append(f'<text x="{left - 5}" y="{y + 4}" text-anchor="end">{y_max * i / 5 / 1.1:.4g}</text>')
    xq, _ = px(q_star, 0)
    parts.append(f'<line x1="{xq}" y1="{top}" x2="{xq}" y2="{h - bottom}" stroke="gray" stroke-dasharray="4 3"/>')
    parts.append(f'<text x="{xq + 3}" y="{top + 10}" fill="gray">q*={q_star:.2f}</text>')
    for n, (label, pts) in enumerate(lines.items()):
        color = colors[n % len(colors)]
        coords = " ".join(f"{x:.1f},{y:.1f}" for x, y in (px(q, t) for q, t in sorted(pts)))
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{coords}"/>')
        parts += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{color}"/>' for x, y in (px(q, t) for q, t in pts)]
        parts.append(f'<text x="{w - right + 10}" y="{top + 16 * (n + 1)}" fill="{color}">{html.escape(label)}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def markdown(rows: list[dict[str, object]]) -> str:
    cols = ["batch", "config", "q", "tok_s", "step_ms", "hit_rate", "fetch_mb_per_step", "cpu_mb_per_step",
            "t_g_ms", "t_c_ms", "bound_ms", "bound_tok_s", "measured_over_bound", "tokens_identical"]  # fmt: skip
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join("" if row.get(c) is None else str(row[c]) for c in cols) + " |" for row in rows]
    return "\n".join(lines)


def verdicts(rows: list[dict[str, object]], batches: list[int]) -> list[str]:
    """Per batch, the issue's goals read off the rows: hybrid at q* against its bound and against
    the better pure strategy (q = 1 or q = 0 with the hot set), and where the swept optimum is."""
    out = []
    for b in batches:
        by = {str(r["config"]): r for r in rows if r["batch"] == b}
        hybrid, fetch, cpu = by["hybrid at q*"], by["fetch every miss"], by["cpu every miss, static hot set"]
        best_pure = max(float(fetch["tok_s"]), float(cpu["tok_s"]))  # type: ignore[arg-type]
        swept = [r for r in by.values() if r["q"] is not None and "hot set" not in str(r["config"])]
        top = max(swept, key=lambda r: float(r["tok_s"]))  # type: ignore[arg-type]
        out.append(
            f"batch {b}: hybrid at q*={hybrid['q']} is {hybrid['measured_over_bound']}x its bound (goal <= 1.15) and "
            f"{float(hybrid['tok_s']) / best_pure:.2f}x the better pure strategy (goal >= 1.1); "  # type: ignore[arg-type]
            f"the swept optimum is q={top['q']} at {top['tok_s']} tok/s, q* gives "
            f"{float(hybrid['tok_s']) / float(top['tok_s']):.2f} of it (goal: within 5%)"  # type: ignore[arg-type]
        )
    return out


def whole_model(args: argparse.Namespace) -> None:
    """The whole-model mode: a random model of ``args.model``'s shape (weights seeded by name,
    transformers' init) through the engine's load path (``Shard.from_checkpoint`` with the format
    plan's default: ``--format`` experts, int8 attention and head), decode steps only:

    - every batch's prompts (one random prompt per stream, fixed seed) are prefilled once on the
      resident model and every configuration decodes greedily from that KV and first token:
      ``--warmup`` untimed steps (graph capture, slot fill), then ``--tokens`` timed ones;
    - resident: eager (the general path, which a model with stores takes) and graphed (static
      steps, where ``LocalModel`` allows them), their ratio being the cost of the eager fallback;
    - capped: ``offload_experts`` with the ``--gpu-memory-bytes`` that gives each layer
      round(cap-share x experts) slots (:func:`cap_for_slots`), q* measured at start as serving
      does; then q = 1, q = 0 with the slots holding each layer's most routed experts of the q = 1
      run (a static hot set from this very workload: the most favourable one for q = 0), q*, and
      ``--sweep``. A step can use more experts than a layer has free slots (batch 8: ~52 of 128
      used, 36 slots), so q = 1 may still compute the overflow on the CPU (its CPU MB say so);
    - the bound per step: the resident eager step + sum over layers of max(T_g, T_c), each
      layer's fetched and CPU bytes averaged over the timed steps, over the betas measured at
      start (averaging before the max makes it, if anything, lower);
    - routing is the random model's own, not a trained model's.
    """
    device, dtype = args.device, torch.bfloat16
    if args.warmup < 1 or args.tokens < 1:
        sys.exit("error: --warmup and --tokens must be >= 1 (the warm-up captures the graphs and fills the slots)")
    layers = SHAPES[args.model]["num_hidden_layers"] if args.layers is None else args.layers
    shape = SHAPES[args.model]
    hidden, inner, experts = shape["hidden_size"], shape["moe_intermediate_size"], shape["num_experts"]
    per_expert = one_expert_bytes(hidden, inner, args.format, device)
    available = mem_available_bytes()
    fit = layers_that_fit(layers, experts * per_expert, available, host_copies(args.format))
    need = host_copies(args.format) * layers * experts * per_expert
    print(f"host memory: {layers} layers of {experts} x {per_expert / 1e6:.2f} MB {args.format} experts need "
          f"~{need / 1e9:.1f} GB ({host_copies(args.format)} cop(ies)); MemAvailable "
          f"{'unknown' if available is None else f'{available / 1e9:.1f} GB'}", flush=True)  # fmt: skip
    if fit < layers:
        if fit == 0:
            sys.exit(f"error: not one layer's banks fit the host ({available} bytes available)")
        print(f"host memory: {layers} layers do not fit; using {fit}, as many as fit", flush=True)
        layers = fit

    started = time.perf_counter()
    config = model_config(args.model, layers)
    spec = spec_from_config(config)
    plan = FormatPlan.default(experts=args.format)
    shard = Shard.from_checkpoint(spec, random_source(config, device, dtype), device=device, dtype=dtype, formats=plan)
    batches = [int(b) for b in args.batches.split(",")]
    shard.allocate_cache(max(batches), args.prompt_len + args.warmup + args.tokens + 8)
    lm = LocalModel([shard])
    label = ", ".join(f"{role} {name}" for role, name in plan.to_json().items() if name)
    print(f"built {args.model} at {layers} layers ({label}) on {device} in {time.perf_counter() - started:.0f} s; "
          f"graphed decode: {'yes' if lm.static_decode else 'no'}", flush=True)  # fmt: skip

    gen = torch.Generator().manual_seed(1)
    prompts = {b: torch.randint(0, spec.vocab_size, (b, args.prompt_len), generator=gen).tolist() for b in batches}
    prefilled = {b: prefill(lm, prompts[b]) for b in batches}  # the resident model's prefill, once
    rows: list[dict[str, object]] = []
    reference: dict[int, list[list[int]]] = {}
    resident_eager: dict[int, float] = {}
    for b in batches:
        states, first = prefilled[b]
        eager_default = lm.static_decode
        lm.static_decode = False
        # a whole untimed pass first: the kernels' specialisations for every length are compiled
        # (the warm-up steps alone leave some to the timed steps: 84 ms a step instead of ~2)
        decode_run(lm, states, first, args.warmup, args.tokens, [])
        eager = decode_run(lm, states, first, args.warmup, args.tokens, [])
        reference[b], resident_eager[b] = eager.tokens, eager.seconds
        lm.static_decode = eager_default
        if lm.static_decode:
            graphed = decode_run(lm, states, first, args.warmup, args.tokens, [])
            rows.append(resident_row(b, "resident, graphed", graphed, reference[b]))
            ratio = eager.seconds / graphed.seconds
            print(f"batch {b}: resident eager step {eager.seconds * 1e3:.2f} ms vs graphed "
                  f"{graphed.seconds * 1e3:.2f} ms: eager/graphed = {ratio:.2f}x", flush=True)  # fmt: skip
        rows.append(resident_row(b, "resident, eager", eager, reference[b]))
        if lm.static_decode:
            rows[-1]["eager_over_graphed"] = round(ratio, 3)
        print(json.dumps(rows[-1]), flush=True)

    # the cap: ~cap-share of each layer's experts get slots; the stores are the serving path's
    slots = max(1, round(args.cap_share * experts))
    moe = moe_layers(shard, shard.layer_start)
    other = shard.weights_bytes - sum(m.bank_bytes for m in moe) + shard.kv_bytes
    cap = cap_for_slots(moe, other, slots)
    del lm  # its captured graphs: the capped model decodes eagerly
    gc.collect()
    started = time.perf_counter()
    options = StoreOptions(
        EvictionPolicy(args.policy), None, args.cpu_workers, args.measure_seconds, ExpertPrefetch(args.prefetch)
    )
    placement = offload_experts(shard, cap, None, options)
    lm = LocalModel([shard])
    stores = stores_of(shard)
    betas = stores[0].bandwidths
    assert betas is not None, "the stores were given q* from bandwidths measured at start"
    held = sorted({p.slots for p in placement.layers})
    print(f"capped: --gpu-memory-bytes {cap} ({cap / 2**30:.2f} GiB): {len(stores)} stores, slots per layer {held} "
          f"of {experts}, expert bytes on the device {placement.expert_device_bytes / 1e9:.2f} GB, on the host "
          f"{placement.expert_host_bytes / 1e9:.2f} GB (process RSS {(rss_bytes() or 0) / 1e9:.1f} GB); "
          f"graphed decode: {'yes' if lm.static_decode else 'no'}; "
          f"placed in {time.perf_counter() - started:.0f} s", flush=True)  # fmt: skip
    stand_in = " (CPU stand-in device: no real bandwidths)" if betas.device_is_stand_in else ""
    print(f"measured at start, both paths at once{stand_in}: beta_g {betas.beta_g / 1e9:.2f} GB/s, "
          f"beta_c {betas.beta_c / 1e9:.2f} GB/s, q* = {betas.q_star:.3f} "
          f"({args.cpu_workers} CPU worker(s) x {args.cpu_threads} threads)", flush=True)  # fmt: skip

    policy = EvictionPolicy(args.policy)
    sweep = [float(q) for q in args.sweep.split(",") if float(q) != 1.0]
    for b in batches:
        states, first = prefilled[b]

        def run(q: float, hot: list[list[int]] | None = None) -> Run:
            for store in stores:
                store.reset(policy, q)
            for store, experts_hot in zip(stores, hot or [], strict=False):
                store.prefetch(experts_hot)
            return decode_run(lm, states, first, args.warmup, args.tokens, stores)  # noqa: B023

        def add(name: str, q: float, got: Run) -> None:
            row = store_row(b, name, q, got, args.tokens, resident_eager[b], betas, reference[b])  # noqa: B023
            rows.append(row)
            print(json.dumps(row), flush=True)

        add("fetch every miss", 1.0, run(1.0))
        # q = 0: the slots hold each layer's most routed experts of the q = 1 run (a static hot
        # set, as KTransformers keeps; llama.cpp's --n-cpu-moe keeps none), every miss on the CPU
        hot = [
            sorted(s.slot_map.frequency, key=lambda e: -s.slot_map.frequency[e])[: s.config.num_slots] for s in stores
        ]
        add("cpu every miss, static hot set", 0.0, run(0.0, hot))
        add("hybrid at q*", betas.q_star, run(betas.q_star))
        for q in sweep:
            add(f"sweep q={q:g}", q, run(q))

    print()
    print(f"{args.model}, {layers} layers, experts {args.format} ({label}), {device} "
          f"({torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}), cap {cap} bytes: {held} of {experts} "
          f"slots per layer; beta_g {betas.beta_g / 1e9:.2f} GB/s, beta_c {betas.beta_c / 1e9:.2f} GB/s, "
          f"q* {betas.q_star:.3f}; {args.tokens} timed steps after {args.warmup} warm-up, prompts of "
          f"{args.prompt_len} random tokens (one per stream); bound = resident eager step + sum over layers of "
          f"max(T_g, T_c)")  # fmt: skip
    print(markdown(rows))
    for line in verdicts(rows, batches):
        print(line)
    if args.out is not None:
        write_csv(args.out, rows)
        lines = {
            f"batch {b}": [(float(r["q"]), float(r["tok_s"])) for r in rows  # type: ignore[arg-type]
                           if r["batch"] == b and r["q"] is not None and "hot set" not in str(r["config"])]
            for b in batches
        }  # fmt: skip
        title = f"{args.model} {layers} layers, {args.format} experts, {held[0]}/{experts} slots, {args.policy}"
        plot = args.out.with_suffix(".svg")
        plot.write_text(sweep_svg(lines, betas.q_star, title))
        print(f"wrote {args.out} and {plot}")


def main(argv: list[str] | None = None) -> None:
    ask = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ask.add_argument("--model", default=None, help="a whole random model of this shape (engine_decode.py's SHAPES)")
    ask.add_argument("--layers", type=int, default=None, help="MoE layers (default: 8, or the model's)")
    ask.add_argument("--experts", type=int, default=128)
    ask.add_argument("--top-k", type=int, default=8)
    ask.add_argument("--hidden", type=int, default=2048)
    ask.add_argument("--moe-inner", type=int, default=768)
    ask.add_argument("--format", default="int4")
    ask.add_argument("--cap-share", type=float, default=0.28, help="share of each layer's experts given slots")
    ask.add_argument("--skew", type=float, default=0.8, help="Zipf exponent of the synthetic routing")
    ask.add_argument(
        "--cpu-workers",
        type=int,
        default=default_cpu_workers(),
        help="threads of the compiled CPU expert kernel (default: every CPU but one)",
    )
    ask.add_argument("--cpu-threads", type=int, default=torch.get_num_threads(),
                     help="torch's intra-op threads (formats the compiled kernel does not take)")  # fmt: skip
    ask.add_argument("--steps", type=int, default=40)
    ask.add_argument("--warmup", type=int, default=8)
    ask.add_argument("--batches", default="1,8")
    ask.add_argument("--sweep", default="0,0.25,0.5,0.6,0.7,0.8,0.9,1")
    ask.add_argument("--beta-c", default="1,2,4,8,12,15", help="CPU-share thread counts to measure betas at")
    ask.add_argument("--out", type=Path, default=None, help="JSON (synthetic) or CSV (--model); --model: SVG beside it")
    ask.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="--model only")
    ask.add_argument("--tokens", type=int, default=16, help="--model: timed decode steps per configuration")
    ask.add_argument("--prompt-len", type=int, default=16, help="--model: prompt tokens per stream")
    ask.add_argument("--prefetch", default="off", choices=[str(p) for p in ExpertPrefetch],
                     help="--model: slots filled ahead of the step (off: the split alone, as the issue's rows)")  # fmt: skip
    ask.add_argument("--policy", default="lru", choices=[str(p) for p in EvictionPolicy], help="--model only")
    ask.add_argument("--measure-seconds", type=float, default=1.0, help="--model: how long q* is measured at start")
    args = ask.parse_args(argv)
    torch.set_num_threads(args.cpu_threads)
    if args.model is not None:
        whole_model(args)
        return
    args.layers = 8 if args.layers is None else args.layers

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
    kernel = stores[0].cpu_kernel
    for combo in args.beta_c.split(","):  # both paths at once, per thread count of the CPU share
        threads = int(combo)
        if kernel is not None:  # the compiled kernel's threads
            kernel.threads = stores[0].config.cpu_workers = threads
        else:  # torch's intra-op threads inside each expert
            torch.set_num_threads(threads)
        betas[combo] = measure_bandwidths(stores[0], 1.0, torch.bfloat16)
        print(json.dumps({"threads": combo, **betas[combo].as_dict()}), flush=True)
    if kernel is not None:
        kernel.threads = stores[0].config.cpu_workers = args.cpu_workers
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
        "betas_by_threads": {c: [b.beta_g, b.beta_c] for c, b in betas.items()},
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
