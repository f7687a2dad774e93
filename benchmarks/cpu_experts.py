"""beta_c: the CPU share of an expert store's step, per format and thread count, against the peer
and the bound measured in the same run.

A step's CPU share at batch 1: --experts-per-call experts of a Qwen3-30B-A3B-shaped bank (H=2048,
I=768), one row each, weighted and summed. Rows:

- compiled: the kernel the store runs (engine/kernels/cpu_experts.c), one call per step, reading
  the bank packed in the CUDA kernels' layout (int4, int4_sym, mxfp4);
- torch int4: the peer, torch's packed int4 CPU kernel (``_weight_int4pack_mm_for_cpu``), one
  expert at a time with torch's intra-op threads (what the store ran before);
- torch mxfp4: the format's decode-in-tiles CPU path (torch has no MXFP4 CPU kernel).

GB/s counts the experts' packed bytes per second. The bound: host memory read bandwidth measured
here (a sum over a buffer larger than the caches, with the same threads), so ratio = rate / bound.

    python benchmarks/cpu_experts.py --threads 1,2,4,8,15 --out docs/results/cpu_experts.csv
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from modelfleet.engine.expert_store import _bank_tensors, compiled_cpu_share
from modelfleet.engine.formats import quantize
from modelfleet.engine.kernels import cpu_experts
from modelfleet.engine.layers import silu_glu
from modelfleet.engine.quantize import QuantizedExperts
from modelfleet.results import write_csv


def bank(fmt: str, experts: int, hidden: int, inner: int) -> QuantizedExperts:
    g = torch.Generator().manual_seed(0)
    gate_up = quantize(torch.randn(experts, 2 * inner, hidden, generator=g) * 0.02, fmt)
    down = quantize(torch.randn(experts, hidden, inner, generator=g) * 0.02, fmt)
    return QuantizedExperts(gate_up, down, None, None, silu_glu)


def rate(step: object, seconds: float) -> float:
    """Steps per second of ``step()`` over about ``seconds`` (after two untimed calls)."""
    for _ in range(2):
        step()  # type: ignore[operator]
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        step()  # type: ignore[operator]
        count += 1
    return count / (time.perf_counter() - start)


def read_bandwidth(threads: int, seconds: float) -> float:
    """Bytes per second torch reads summing a 1 GiB buffer with ``threads`` intra-op threads."""
    torch.set_num_threads(threads)
    buffer = torch.ones(1 << 28, dtype=torch.float32)
    return rate(lambda: buffer.sum(), seconds) * buffer.numel() * 4


def measure(fmt: str, threads: int, args: argparse.Namespace) -> list[tuple[str, float]]:
    """(kernel, bytes per second) of the compiled kernel and, where torch has one, torch's path."""
    per_call = args.experts_per_call
    experts = bank(fmt, args.experts, args.hidden, args.inner)
    tensors = {name: t.contiguous() for name, t in _bank_tensors(experts).items()}
    kernel = compiled_cpu_share(tensors, experts, threads)
    assert kernel is not None
    x = torch.randn(1, args.hidden, dtype=torch.bfloat16)
    weight = torch.full((1, per_call), 1.0 / per_call)
    calls = [torch.arange(i * per_call, (i + 1) * per_call)[None] % args.experts for i in range(64)]
    turn = iter(range(1 << 62))

    def compiled() -> None:
        index = calls[next(turn) % len(calls)]
        kernel(x, index, weight, set(index[0].tolist()))

    nbytes = per_call * kernel.expert_nbytes
    measured = [("compiled", rate(compiled, args.seconds) * nbytes)]
    if fmt == "int4_sym":  # torch's int4 kernel is the same for both
        return measured
    torch.set_num_threads(threads)
    experts.gate_up.prepare_for(x)
    experts.down.prepare_for(x.new_zeros(1, args.inner))

    def torch_path() -> None:
        for e in calls[next(turn) % len(calls)][0].tolist():
            experts.expert(e, x)

    peer_seconds = args.seconds if fmt != "mxfp4" else min(args.seconds, 0.5)
    measured.append((f"torch {fmt}", rate(torch_path, peer_seconds) * nbytes))
    return measured


def main() -> None:
    ask = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ask.add_argument("--formats", default="int4,int4_sym,mxfp4")
    ask.add_argument("--threads", default="1,2")
    ask.add_argument("--experts", type=int, default=64, help="experts in the bank (more than the caches hold)")
    ask.add_argument("--experts-per-call", type=int, default=8, help="a step's CPU experts (one row each)")
    ask.add_argument("--hidden", type=int, default=2048)
    ask.add_argument("--inner", type=int, default=768)
    ask.add_argument("--seconds", type=float, default=1.0)
    ask.add_argument("--out", type=Path, default=None, help="CSV of the rows")
    args = ask.parse_args()
    if not cpu_experts.available():
        raise SystemExit(f"error: {cpu_experts.unavailable_reason()}")
    rows = []
    print(f"compiled kernel: {cpu_experts.instruction_set()}; {args.experts_per_call} experts x 1 row per step, "
          f"H={args.hidden}, I={args.inner}, {args.experts}-expert banks")  # fmt: skip
    print("| format | kernel | threads | GB/s | read bound GB/s | ratio |\n|---|---|---|---|---|---|")
    for threads in (int(t) for t in args.threads.split(",")):
        bound = read_bandwidth(threads, args.seconds)
        for fmt in args.formats.split(","):
            for name, value in measure(fmt, threads, args):
                rows.append({"format": fmt, "kernel": name, "threads": threads, "gb_per_s": round(value / 1e9, 3),
                             "read_bound_gb_per_s": round(bound / 1e9, 3), "ratio": round(value / bound, 3)})  # fmt: skip
                print(f"| {fmt} | {name} | {threads} | {value / 1e9:.2f} | {bound / 1e9:.1f} | {value / bound:.2f} |",
                      flush=True)  # fmt: skip
    if args.out is not None:
        write_csv(args.out, rows)


if __name__ == "__main__":
    main()
