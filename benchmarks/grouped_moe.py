"""One MoE layer's experts on CUDA by row count: the one-row gathered kernels, the grouped
kernel (engine.kernels.grouped_moe) and, for bf16, torch._grouped_mm; each step replayed from a
CUDA graph and timed with CUDA events. The crossovers ``layers.GATHER_MAX_PAIRS`` come from here.

    python benchmarks/grouped_moe.py --rows 1,2,4,8,16,32,64,128,256 --out out/grouped_moe.csv
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from modelfleet.engine import layers
from modelfleet.engine.formats import quantize
from modelfleet.engine.layers import Experts
from modelfleet.engine.quantize import QuantizedExperts
from modelfleet.results import write_csv


def graph_ms(fn: Callable[[], object], replays: int = 20) -> float:
    """Milliseconds per call of fn, ten calls captured in one CUDA graph and replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            fn()
    graph.replay()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / (10 * replays)


def grouped_mm(bank: Experts, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm over experts (rows sorted by expert, offsets on the device)."""
    top_k = index.shape[1]
    flat = index.reshape(-1)
    order = torch.argsort(flat)
    counts = torch.zeros(bank.num_experts, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat.int(), torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    xs = x[order // top_k]
    h = torch._grouped_mm(xs, bank.gate_up.transpose(1, 2), offs=offs)
    gate, up = h.chunk(2, dim=-1)
    y = torch._grouped_mm((F.silu(gate) * up).contiguous(), bank.down.transpose(1, 2), offs=offs)
    pairs = torch.empty_like(y)
    pairs[order] = y
    return layers.weighted_sum_of_pairs(pairs, weight)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,128,256")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=768)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--formats", default="bf16,int4,int8,mxfp4")
    parser.add_argument("--out", default="out/grouped_moe.csv")
    args = parser.parse_args()
    torch.manual_seed(0)
    e, h, i = args.experts, args.hidden, args.inter
    gate_up = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16) * 0.02
    down = torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16) * 0.02
    banks: dict[str, torch.nn.Module] = {}
    for name in args.formats.split(","):
        if name == "bf16":
            banks[name] = Experts(gate_up, down)
        else:
            banks[name] = QuantizedExperts(quantize(gate_up.float(), name), quantize(down.float(), name))
    rows_out = []
    print(f"{'format':>6} {'rows':>5} {'gathered ms':>12} {'grouped ms':>11} {'_grouped_mm ms':>15}")
    for name, bank in banks.items():
        for rows in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16)
            index = torch.rand(rows, e, device="cuda").topk(args.top_k, dim=-1).indices
            weight = torch.softmax(torch.randn(rows, args.top_k, device="cuda"), -1)
            times = {}
            measured = dict(layers.GATHER_MAX_PAIRS)
            for path, limit in (("gathered", 1 << 30), ("grouped", 0)):
                layers.GATHER_MAX_PAIRS[name] = limit  # the path of this timing
                times[path] = graph_ms(lambda bank=bank, x=x, index=index, weight=weight: bank(x, index, weight))
            layers.GATHER_MAX_PAIRS.clear()
            layers.GATHER_MAX_PAIRS.update(measured)
            times["grouped_mm"] = float("nan")
            if name == "bf16":
                try:
                    times["grouped_mm"] = graph_ms(
                        lambda bank=bank, x=x, index=index, weight=weight: grouped_mm(bank, x, index, weight)
                    )
                except (RuntimeError, TypeError) as error:  # not on this device or torch build
                    print(f"torch._grouped_mm unavailable: {str(error)[:120]}")
            print(f"{name:>6} {rows:>5} {times['gathered']:12.4f} {times['grouped']:11.4f} {times['grouped_mm']:15.4f}")
            rows_out.append(
                dict(
                    format=name,
                    rows=rows,
                    pairs=rows * args.top_k,
                    **{f"{k}_ms": round(v, 4) for k, v in times.items()},
                )
            )
    out = write_csv(Path(args.out), rows_out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
