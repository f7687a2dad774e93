"""Decode throughput of the modelfleet engine beside transformers ``generate()``.

Both run the same random Qwen3-MoE-shaped model (built offline from a config), the same dtype
and device, in one process. Decode tokens/s is measured as B*(N-1) / (t(N) - t(1)): the time of
a generation of N tokens minus one of a single token, so prefill cancels out. The memory-bandwidth
bound is measured bandwidth over the weight bytes one decode step must read (attention, router,
the experts the batch activates in expectation, and the head).

    python benchmarks/engine_decode.py --shape cpu-0.8b --device cpu
    python benchmarks/engine_decode.py --shape cpu-0.8b --device cpu --experts int4 --attention int8

``--experts``/``--attention``/``--head`` quantize the engine's model at load (transformers stays in
``--dtype``); the bound then counts the engine's resident bytes in those formats.
    python benchmarks/engine_decode.py --shape qwen3-30b-a3b-12l --device cuda
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

import torch

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
    # Qwen3-30B-A3B with 12 of its 48 layers: ~8.1B parameters, ~1.0B active per token
    "qwen3-30b-a3b-12l": dict(
        hidden_size=2048,
        num_hidden_layers=12,
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


def measure_bandwidth(device: str) -> float:
    """Read bandwidth in bytes per second: a max-reduction over a large bf16 tensor (reads only,
    as streaming weights does), best of five."""
    n = (1 << 30) if device == "cuda" else (1 << 27)
    data = torch.empty(n, dtype=torch.bfloat16, device=device).uniform_()
    best = float("inf")
    for _ in range(5):
        sync(device)
        start = time.perf_counter()
        data.amax()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return data.numel() * data.element_size() / best


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def build_reference(shape: str, dtype: torch.dtype, device: str):  # type: ignore[no-untyped-def]
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen3_moe", **SHAPES[shape], max_position_embeddings=4096, norm_topk_prob=True, tie_word_embeddings=False
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


def decode_rate(run, batch: int, tokens: int, repeats: int = 3) -> tuple[float, list[list[int]]]:  # type: ignore[no-untyped-def]
    """B*(N-1) / (t(N) - t(1)), each time the best of ``repeats`` runs after a warm-up."""
    run(2)
    t1 = min(run(1)[0] for _ in range(repeats))
    runs = [run(tokens) for _ in range(repeats)]
    tn = min(t for t, _ in runs)
    return batch * (tokens - 1) / max(tn - t1, 1e-9), runs[0][1]


def time_engine(lm, prompts: list[list[int]], tokens: int, repeats: int = 3) -> tuple[float, list[list[int]]]:  # type: ignore[no-untyped-def]
    from modelfleet.engine.generate import generate_batch
    from modelfleet.engine.sampling import SamplingParams

    device = lm.shards[0].device.type

    def run(n: int) -> tuple[float, list[list[int]]]:
        params = SamplingParams(max_tokens=n, stop_token_ids=())
        sync(device)
        start = time.perf_counter()
        results = generate_batch(lm, prompts, params)
        sync(device)
        return time.perf_counter() - start, [r.token_ids for r in results]

    return decode_rate(run, len(prompts), tokens, repeats)


def time_reference(model, prompts: list[list[int]], tokens: int, repeats: int = 3) -> tuple[float, list[list[int]]]:  # type: ignore[no-untyped-def]
    device = next(model.parameters()).device
    ids = torch.tensor(prompts, device=device)

    def run(n: int) -> tuple[float, list[list[int]]]:
        sync(device.type)
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(ids)
            )
        sync(device.type)
        return time.perf_counter() - start, out[:, ids.shape[1] :].tolist()

    return decode_rate(run, len(prompts), tokens, repeats)


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
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--batch", default="1,8", help="comma-separated batch sizes")
    parser.add_argument("--tokens", type=int, default=32, help="tokens generated per stream")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--out", default="out/engine_decode.csv")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per point; the fastest counts")
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
    ref = build_reference(args.shape, dtype, args.device)
    params = sum(p.numel() for p in ref.parameters())
    spec = spec_from_config(ref.config.to_dict())
    plan = FormatPlan(experts=args.experts, attention=args.attention, head=args.head)
    formats = None if plan.is_empty else plan
    shard = Shard.from_checkpoint(spec, TensorDict(ref.state_dict()), device=args.device, dtype=dtype, formats=formats)
    label = ", ".join(f"{role} {name}" for role, name in plan.to_json().items() if name) or "no formats"
    bandwidth = measure_bandwidth(args.device)
    batches = [int(b) for b in args.batch.split(",")]
    shard.allocate_cache(max(batches), args.prompt_len + args.tokens + 8)
    lm = LocalModel([shard])
    plain_lm = None  # with formats, the same engine without them, timed in the same run
    if formats is not None:
        plain = Shard.from_checkpoint(spec, TensorDict(ref.state_dict()), device=args.device, dtype=dtype)
        plain.allocate_cache(max(batches), args.prompt_len + args.tokens + 8)
        plain_lm = LocalModel([plain])

    table = Table(
        title=f"decode tokens/s, {args.shape} ({params / 1e9:.2f}B params), {args.device}, {args.dtype}, "
        f"engine: {label}"
    )
    columns = ["batch", "modelfleet", "transformers", "ratio", "bound", "of bound", "same tokens"]
    if plain_lm is not None:
        columns[2:2] = [f"modelfleet {args.dtype}", "formats speedup"]
    if peer is not None:
        columns.append(f"llama.cpp ({peer.threads} threads)")
    for col in columns:
        table.add_column(col, justify="right")
    rows = []
    gen = torch.Generator().manual_seed(1)
    for batch in batches:
        prompts = torch.randint(0, spec.vocab_size, (batch, args.prompt_len), generator=gen).tolist()
        ours, our_tokens = time_engine(lm, prompts, args.tokens, args.repeats)
        unquantized = time_engine(plain_lm, prompts, args.tokens, args.repeats)[0] if plain_lm is not None else None
        theirs, their_tokens = time_reference(ref, prompts, args.tokens, args.repeats)
        bound = (
            batch
            * bandwidth
            / (step_bytes(ref, batch) if formats is None else engine_step_bytes(shard, ref.config, batch))
        )
        same = sum(a == b for x, y in zip(our_tokens, their_tokens, strict=True) for a, b in zip(x, y, strict=True))
        agree = same / (batch * args.tokens)
        rows.append(
            dict(
                shape=args.shape,
                device=args.device,
                dtype=args.dtype,
                formats=label,
                weights_bytes=shard.weights_bytes,
                batch=batch,
                modelfleet_tok_s=round(ours, 2),
                modelfleet_plain_tok_s=None if unquantized is None else round(unquantized, 2),
                transformers_tok_s=round(theirs, 2),
                ratio=round(ours / theirs, 2),
                bound_tok_s=round(bound, 1),
                fraction_of_bound=round(ours / bound, 3),
                token_agreement=round(agree, 3),
                bandwidth_gb_s=round(bandwidth / 1e9, 1),
                llama_cpp_tok_s=round(peer.tokens_per_second, 2) if peer is not None and batch == 1 else None,
            )
        )
        peer_cells = [] if peer is None else [f"{peer.tokens_per_second:.1f}" if batch == 1 else "-"]
        plain_cells = [] if unquantized is None else [f"{unquantized:.1f}", f"{ours / unquantized:.2f}x"]
        table.add_row(
            str(batch),
            f"{ours:.1f}",
            *plain_cells,
            f"{theirs:.1f}",
            f"{ours / theirs:.2f}x",
            f"{bound:.0f}",
            f"{100 * ours / bound:.1f}%",
            f"{100 * agree:.0f}%",
            *peer_cells,
        )
    console.print(table)
    console.print(
        f"measured read bandwidth {bandwidth / 1e9:.1f} GB/s; bound = batch x bandwidth / weight bytes per step"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    console.print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
