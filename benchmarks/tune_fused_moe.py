"""Sweep the fused MoE kernels' launch configurations as the engine runs them: the pair (moe_up,
moe_down) of one decode step of a Qwen3-30B-A3B-shaped layer (hidden 2048, expert width 768,
128 experts, top-8), 16 steps with different routings in one CUDA graph, so launch gaps and the
kernels' overlap (programmatic dependent launch) count as they do in decode. Prints every pair's
time and share of the same run's copy bandwidth, and the best pair per format as the entry for
``engine.formats.triton_moe.MEASURED``. MXFP4 steps of up to ``mma_moe.CONFIG.max_tokens`` tokens run on
the tensor-core kernels on Hopper (:mod:`engine.formats.mma_moe`, no launch configuration): the
sweep turns them off to time the Triton pairs, and prints the tensor-core pair beside them.

Triton's autotuner cannot do this: it times each kernel alone, between eager launches, with the
same weights every time (in L2 after the first), where at a few microseconds per kernel launch
noise picks the configuration.

    python benchmarks/tune_fused_moe.py                       # int4 and mxfp4, one row
    python benchmarks/tune_fused_moe.py --formats mxfp4 --rows 1 8
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import itertools
import statistics
import sys
from functools import partial
from pathlib import Path

import torch


def _formats_benchmark():  # type: ignore[no-untyped-def]
    """benchmarks/formats.py (its layer, routings, timer and copy bandwidth), loaded by path."""
    path = Path(__file__).with_name("formats.py")
    spec = importlib.util.spec_from_file_location("formats_benchmark", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


UP = [
    (1, False, 1),
    (2, False, 1),
    (4, False, 1),
    (8, False, 1),
    (8, True, 2),
    (8, True, 4),
    (16, True, 4),
    (16, True, 8),
]
# moe_down: (ROWS, warps, CHUNK: groups per load, 0 for the bank's own; see triton_moe._down_meta)
DOWN = [(2, 4, 0), (4, 2, 0), (4, 4, 0), (4, 8, 0), (8, 4, 0), (8, 8, 0), (4, 2, 8), (4, 4, 8), (8, 4, 8)]


def pair_step(triton_moe, x, index, weight, gate_up, down, activation):  # type: ignore[no-untyped-def]
    """One decode step of the layer's experts: the two fused kernels, as the engine runs them."""
    return triton_moe.moe_pair(x, index, weight, gate_up, down, None, None, activation)


def graph_us(steps: list, fb) -> float:  # type: ignore[no-untyped-def]
    """Microseconds per step of one CUDA graph holding all the steps."""
    for step in steps:
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for step in steps:
            step()
    return fb.time_ms(graph.replay, "cuda", budget_s=0.2) / len(steps) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", nargs="+", default=["int4", "mxfp4"], choices=["int4", "int4_sym", "mxfp4"])
    parser.add_argument("--rows", nargs="+", type=int, default=[1], help="tokens per step")
    parser.add_argument("--experts", type=int, default=128)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("tune_fused_moe needs a CUDA GPU: the fused kernels are Triton kernels for CUDA")
    from modelfleet.engine.formats import mma_moe, triton_moe

    if not triton_moe.TUNED:
        raise SystemExit("unset MODELFLEET_TRITON_TUNE=0: it pins one configuration, so there is nothing to sweep")
    fb = _formats_benchmark()
    major = torch.cuda.get_device_capability()[0]
    bandwidth = fb.copy_bandwidth("cuda")
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth:.0f} GB/s (bytes read + written)")
    for fmt in args.formats:
        layer, per_expert = fb.expert_layer(fmt, args.experts, "cuda")
        x0 = torch.randn(1, fb.HIDDEN, device="cuda").to(torch.bfloat16)
        fused = layer.fused_kernels(x0)
        if fused is None:
            raise SystemExit(f"{fmt}: the layer has no fused kernels on this device")
        gate_up, down, act = fused
        activation = triton_moe.Activation(*act)
        key = (major, gate_up.mxfp4)
        kept = triton_moe.MEASURED.get(key)
        for rows in args.rows:
            generator = torch.Generator().manual_seed(rows)
            routings = [fb.route(rows, args.experts, generator, "cuda") for _ in range(fb.ROUTINGS)]
            x = torch.randn(rows, fb.HIDDEN, device="cuda").to(torch.bfloat16)
            used = statistics.mean(i.unique().numel() * per_expert for i, _ in routings)
            results = []
            kept_config = mma_moe.CONFIG
            mma_moe.CONFIG = dataclasses.replace(kept_config, max_tokens=0)  # the Triton kernels for every step
            try:
                for (u_rows, wide, u_warps), (d_rows, d_warps, chunk) in itertools.product(UP, DOWN):
                    up = {"ROWS": u_rows, "WIDE": wide, "num_warps": u_warps}
                    dn = {"ROWS": d_rows, "num_warps": d_warps} | ({"CHUNK": chunk} if chunk else {})
                    triton_moe.MEASURED[key] = [(rows, up, dn)]
                    steps = [partial(pair_step, triton_moe, x, i, w, gate_up, down, activation) for i, w in routings]
                    with torch.inference_mode():
                        us = graph_us(steps, fb)
                    results.append((us, up, dn))
            finally:
                mma_moe.CONFIG = kept_config
            if kept is None:
                triton_moe.MEASURED.pop(key)
            else:
                triton_moe.MEASURED[key] = kept
            steps = [partial(pair_step, triton_moe, x, i, w, gate_up, down, activation) for i, w in routings]
            if mma_moe.up_applies(x, routings[0][0], gate_up) or mma_moe.down_applies(x, routings[0][0], down):
                with torch.inference_mode():
                    tensor_core_us = graph_us(steps, fb)
                share = 100 * used / (tensor_core_us * 1e-6) / 1e9 / bandwidth
                print(
                    f"\n{fmt}, {rows} row(s): the tensor-core pair (mma_moe, what runs) {tensor_core_us:.1f} us, {share:.1f}%"
                )
            results.sort(key=lambda r: r[0])
            print(f"\n{fmt}, {rows} row(s): {len(results)} pairs, fastest first")
            print(f"  {'us':>6} {'% copy':>7}  moe_up (ROWS, WIDE, warps)   moe_down (ROWS, warps, CHUNK)")
            for us, up, dn in results:
                share = 100 * used / (us * 1e-6) / 1e9 / bandwidth
                print(
                    f"  {us:6.1f} {share:6.1f}%  ({up['ROWS']:2d}, {up['WIDE']!s:5}, {up['num_warps']})"
                    f"{'':16}({dn['ROWS']}, {dn['num_warps']}, {dn.get('CHUNK', '-')})"
                )
            best_us, up, dn = results[0]
            current = "none" if kept is None else f"{kept}"
            print(f"  best for MEASURED[{key}] up to {rows} token(s): ({rows}, {up}, {dn}); the entries now: {current}")


if __name__ == "__main__":
    main()
