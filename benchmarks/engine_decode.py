"""Decode throughput of the modelfleet engine beside transformers, decode steps only.

Both run the same random Qwen3-MoE-shaped model (built offline from a config), the same dtype
and device, in one process. Each side prefills its prompts first, untimed; then a loop of
``--tokens`` greedy decode steps (each step's tokens fed to the next, as serving does) is timed
with CUDA events (wall clock on CPU), after a warm-up that captures the engine's CUDA graphs.
transformers runs its own decode loop over its KV cache (``past_key_values``).

The bound (GPU) is the copy bandwidth measured in the same run (a device-to-device copy, bytes
read plus written, the best of five) over the weight bytes one decode step must read: attention,
router, the experts the batch activates in expectation, and the head. A rate above the bound is a
measurement error: the benchmark refuses to print it and exits non-zero. On CPU no such ceiling
is measured (a copy probe is not one there), so the bound column is left out.

    python benchmarks/engine_decode.py --shape cpu-0.8b --device cpu
    python benchmarks/engine_decode.py --shape cpu-0.8b --device cpu --experts int4 --attention int8
    python benchmarks/engine_decode.py --shape qwen3-30b-a3b --layers 48 --batch 1,8,32,64,128,256

``--experts``/``--attention``/``--head`` quantize the engine's model at load (transformers stays in
``--dtype``); the bound then counts the engine's resident bytes in those formats.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from modelfleet.results import write_csv

SHAPES = {
    # ~0.8B parameters, ~0.17B active per token
    "cpu-0.8b": dict(
        hidden_size=1024,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        moe_intermediate_size=512,
        num_experts=64,
        num_experts_per_tok=8,
        intermediate_size=2816,
        vocab_size=32000,
    ),
    # Qwen3-30B-A3B: 48 layers, ~30.5B parameters, ~3.3B active per token (--layers 12 for a quarter)
    "qwen3-30b-a3b": dict(
        hidden_size=2048,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        intermediate_size=6144,
        vocab_size=151936,
    ),
    "tiny": dict(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        moe_intermediate_size=64,
        num_experts=8,
        num_experts_per_tok=2,
        intermediate_size=256,
        vocab_size=1000,
    ),
}


def copy_bandwidth(device: str) -> float | None:
    """Device-to-device copy bandwidth in bytes per second (read plus written), the best of five;
    None on CPU, where a copy is no ceiling for reading weights."""
    if device != "cuda":
        return None
    src = torch.empty(1 << 30, dtype=torch.bfloat16, device=device).uniform_()
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        best = min(best, timed(device, lambda: dst.copy_(src)))
    return 2 * src.numel() * src.element_size() / best


def timed(device: str, fn: Callable[[], object]) -> float:
    """Seconds fn takes: CUDA events around it on GPUs, the wall clock on CPU."""
    if device != "cuda":
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / 1e3


def build_reference(shape: str, layers: int | None, dtype: torch.dtype, device: str):  # type: ignore[no-untyped-def]
    from transformers import AutoConfig, AutoModelForCausalLM

    dims = {**SHAPES[shape], **({} if layers is None else {"num_hidden_layers": layers})}
    config = AutoConfig.for_model(
        "qwen3_moe", **dims, max_position_embeddings=4096, norm_topk_prob=True, tie_word_embeddings=False
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    return model


def step_bytes(model, batch: int) -> float:  # type: ignore[no-untyped-def]
    """Weight bytes one decode step of ``batch`` rows reads, with experts in expectation."""
    cfg = model.config
    item = next(model.parameters()).element_size()
    experts, k = cfg.num_experts, cfg.num_experts_per_tok
    used = experts * (1 - (1 - k / experts) ** batch)
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    total = 0.0
    for name, p in model.named_parameters():
        if "experts" in name or "embed_tokens" in name:
            continue
        total += p.numel()
    total += cfg.num_hidden_layers * used * per_expert + batch * cfg.hidden_size
    return total * item


def engine_step_bytes(shard, config, batch: int) -> float:  # type: ignore[no-untyped-def]
    """The same read count from the engine's resident bytes (so it follows the weight formats):
    everything but the embeddings, with the expert banks in the fraction a batch activates."""
    experts, k = config.num_experts, config.num_experts_per_tok
    used = experts * (1 - (1 - k / experts) ** batch)
    roles = {role: sum(by_format.values()) for role, by_format in shard.bytes_by_role.items()}
    return (
        sum(n for role, n in roles.items() if role not in ("experts", "embeddings")) + roles["experts"] * used / experts
    )


def time_engine(lm, prompts: list[list[int]], tokens: int, device: str) -> tuple[float, list[list[int]]]:  # type: ignore[no-untyped-def]
    """Decode tokens/s of greedy steps after an untimed prefill (and warm-up steps on other slots,
    which capture the step's CUDA graph), and each stream's tokens."""
    from modelfleet.engine.frame import Frame

    batch = len(prompts)
    slots = [lm.acquire() for _ in range(2 * batch)]
    last = torch.tensor([sum(len(p) for p in (prompts + prompts)[: i + 1]) - 1 for i in range(2 * batch)])
    frame = Frame.of_streams([(s, 0, p) for s, p in zip(slots, prompts + prompts, strict=True)])
    frame.output_rows = last
    first = lm.forward(frame).argmax(-1).tolist()
    warm, timed_slots = slots[batch:], slots[:batch]
    positions = [len(p) for p in prompts]
    warm_tokens = first[batch:]
    for step in range(3):  # the warm-up: graph capture, kernel compiles, autotuning
        warm_tokens = lm.decode(warm_tokens, warm, [p + step for p in positions]).argmax(-1).tolist()
    out: list[list[int]] = [[t] for t in first[:batch]]

    def loop() -> None:
        for step in range(tokens - 1):
            nxt = lm.decode([o[-1] for o in out], timed_slots, [p + step for p in positions]).argmax(-1).tolist()
            for o, t in zip(out, nxt, strict=True):
                o.append(t)

    seconds = timed(device, loop)
    for s in slots:
        lm.release(s)
    return batch * (tokens - 1) / seconds, out


def time_reference(model, prompts: list[list[int]], tokens: int, device: str) -> tuple[float, list[list[int]]]:  # type: ignore[no-untyped-def]
    """transformers' decode tokens/s over its own KV cache after an untimed prefill (and one
    untimed step), and each stream's tokens."""
    ids = torch.tensor(prompts, device=next(model.parameters()).device)
    with torch.no_grad():
        out = model(ids, use_cache=True)
        past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        got = [nxt]
        out = model(nxt, past_key_values=past, use_cache=True)  # untimed: first-step allocations
        past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        got.append(nxt)

        def loop() -> None:
            nonlocal past, nxt
            for _ in range(tokens - 2):
                step = model(nxt, past_key_values=past, use_cache=True)
                past, nxt = step.past_key_values, step.logits[:, -1].argmax(-1, keepdim=True)
                got.append(nxt)

        seconds = timed(device, loop)
    return len(prompts) * (tokens - 2) / seconds, torch.cat(got, dim=1).tolist()


def llama_cpp_peer(bench: Path | None, gguf: Path | None, tokens: int):  # type: ignore[no-untyped-def]
    """llama-bench's batch-1 decode rate with as many threads as torch uses, or None without a peer."""
    if (bench is None) != (gguf is None):
        sys.exit("error: --peer-llama-bench and --peer-gguf go together")
    if bench is None or gguf is None:
        return None
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from llama_peer import llama_bench_decode

    return llama_bench_decode(bench, gguf, threads=torch.get_num_threads(), tokens=tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="cpu-0.8b")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--batch", default="1,8,32,64,128,256", help="comma-separated batch sizes")
    parser.add_argument("--tokens", type=int, default=32, help="decode steps timed per stream")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--out", default="out/engine_decode.csv")
    parser.add_argument("--experts", default=None, help="the engine's experts format (int4, int8, mxfp4, ...)")
    parser.add_argument("--attention", default=None, help="the engine's attention format (int8, int4, ...)")
    parser.add_argument("--head", default=None, help="the engine's head format (int8, ...)")
    parser.add_argument("--peer-llama-bench", type=Path, help="llama.cpp's llama-bench: its decode rate joins batch 1")
    parser.add_argument("--peer-gguf", type=Path, help="GGUF of the same shape and formats for llama-bench")
    args = parser.parse_args()
    peer = llama_cpp_peer(args.peer_llama_bench, args.peer_gguf, args.tokens)

    from rich.console import Console
    from rich.table import Table

    from modelfleet.engine.checkpoint import TensorDict
    from modelfleet.engine.formats.plan import FormatPlan
    from modelfleet.engine.generate import LocalModel
    from modelfleet.engine.shard import Shard
    from modelfleet.engine.spec import spec_from_config

    dtype = getattr(torch, args.dtype)
    console = Console()
    console.print(f"building a random {args.shape} model on {args.device} in {args.dtype}...")
    ref = build_reference(args.shape, args.layers, dtype, args.device)
    params = sum(p.numel() for p in ref.parameters())
    spec = spec_from_config(ref.config.to_dict())
    plan = FormatPlan(experts=args.experts, attention=args.attention, head=args.head)
    formats = None if plan.is_empty else plan
    shard = Shard.from_checkpoint(spec, TensorDict(ref.state_dict()), device=args.device, dtype=dtype, formats=formats)
    label = ", ".join(f"{role} {name}" for role, name in plan.to_json().items() if name) or "no formats"
    bandwidth = copy_bandwidth(args.device)
    batches = [int(b) for b in args.batch.split(",")]
    shard.allocate_cache(2 * max(batches), args.prompt_len + args.tokens + 8)
    lm = LocalModel([shard])

    layers = ref.config.num_hidden_layers
    table = Table(
        title=f"decode tokens/s (decode steps only), {args.shape} at {layers} layers ({params / 1e9:.2f}B params), "
        f"{args.device}, {args.dtype}, engine: {label}"
    )
    columns = ["batch", "modelfleet", "transformers", "ratio", "same tokens"]
    if bandwidth is not None:
        columns[4:4] = ["bound", "of bound", "transformers of bound"]
    if peer is not None:
        columns.append(f"llama.cpp ({peer.threads} threads)")
    for col in columns:
        table.add_column(col, justify="right")
    rows, errors = [], []
    gen = torch.Generator().manual_seed(1)
    for batch in batches:
        prompts = torch.randint(0, spec.vocab_size, (batch, args.prompt_len), generator=gen).tolist()
        ours, our_tokens = time_engine(lm, prompts, args.tokens, args.device)
        theirs, their_tokens = time_reference(ref, prompts, args.tokens, args.device)
        same = sum(a == b for x, y in zip(our_tokens, their_tokens, strict=True) for a, b in zip(x, y, strict=True))
        agree = same / (batch * args.tokens)
        bound = None
        if bandwidth is not None:
            weights = step_bytes(ref, batch) if formats is None else engine_step_bytes(shard, ref.config, batch)
            bound = batch * bandwidth / weights
            for who, rate in (("modelfleet", ours), ("transformers", theirs)):
                if rate > bound:
                    errors.append(f"batch {batch}: {who} measured {rate:.0f} tok/s, above the bound {bound:.0f}")
        rows.append(
            dict(
                shape=args.shape, layers=layers, device=args.device, dtype=args.dtype, formats=label,
                weights_bytes=shard.weights_bytes, batch=batch, modelfleet_tok_s=round(ours, 2),
                transformers_tok_s=round(theirs, 2), ratio=round(ours / theirs, 2),
                bound_tok_s=None if bound is None else round(bound, 1),
                fraction_of_bound=None if bound is None else round(ours / bound, 3),
                transformers_fraction_of_bound=None if bound is None else round(theirs / bound, 3),
                token_agreement=round(agree, 3),
                copy_bandwidth_gb_s=None if bandwidth is None else round(bandwidth / 1e9, 1),
                llama_cpp_tok_s=round(peer.tokens_per_second, 2) if peer is not None and batch == 1 else None,
            )
        )  # fmt: skip
        bound_cells = (
            [] if bound is None else [f"{bound:.0f}", f"{100 * ours / bound:.1f}%", f"{100 * theirs / bound:.1f}%"]
        )
        peer_cells = [] if peer is None else [f"{peer.tokens_per_second:.1f}" if batch == 1 else "-"]
        cells = [
            str(batch),
            f"{ours:.1f}",
            f"{theirs:.1f}",
            f"{ours / theirs:.2f}x",
            *bound_cells,
            f"{100 * agree:.0f}%",
            *peer_cells,
        ]
        table.add_row(*cells)
        console.print(f"batch {batch}: modelfleet {ours:.1f} tok/s, transformers {theirs:.1f} tok/s")
    if errors:
        console.print("[red]refusing to report rates above the bandwidth bound (a measurement error):[/red]")
        for line in errors:
            console.print(f"  {line}")
        sys.exit(2)
    console.print(table)
    if bandwidth is not None:
        console.print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s; bound = batch x bandwidth / weight bytes per step")
    out = write_csv(Path(args.out), rows)
    console.print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
