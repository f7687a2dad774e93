"""Weight formats: resident bytes, matmul time and effective bandwidth against a measured copy.

Workloads (bf16 activations, the serving dtype on both CPU and GPU):
- ``moe``: one Qwen3-30B-A3B-shaped MoE layer (hidden 2048, expert width 768, 128 experts, top-8):
  fused gate_up [E, 1536, 2048] and down [E, 2048, 768] banks run by the engine's own expert module
  (``Experts`` for bf16, ``QuantizedExperts`` otherwise) for rows routed to 8 random experts each:
  on CUDA, few pairs run through the gathered kernels (the decode path), on CPU each used expert
  runs once over its rows.
- ``expert-kernels`` (CUDA): the kernels of an MoE step alone, without routing: for int4 /
  int4_sym / mxfp4 the two fused kernels the layer runs (gate_up with its activation, down with
  the weighted sum over each token's experts, ``engine.formats.triton_moe``); for int8 the two
  gathered matmuls; for bf16 the two gathered GEMVs.
- ``dense-7168x2048`` / ``dense-2048x7168``: DeepSeek-V3-like projections (out x in).

Modes: ``eager`` launches every kernel from Python per step (wall time includes launch cost);
``graph`` (CUDA only) replays one CUDA graph holding all the steps of a pass, as the engine
replays one graph per decode step of the whole model (so no host launch gap between steps).
Effective GB/s = format bytes of the weights the step uses (codes, scales, zero points: not the
kernels' private layouts) / step time; the bound beside it is the same run's copy bandwidth
(bytes read + written by a large tensor copy). ``expert-kernels`` in graph mode also gets the
read bound of its routing (``read_bound.py``): the time to read the slabs the kernels read, with
no arithmetic, in two launches made as the fused pair's are (``read_ms``) and in one
(``read_one_ms``);
``share_of_read`` = read_ms / time_ms, how close the kernels come to their own launch structure's
floor. A bank is built by
quantizing a few distinct experts and replicating their storage (every expert still owns its
memory, so caches see the full bank); values do not change kernel speed.

    python benchmarks/formats.py                      # CPU (+ CUDA when present), 128 experts
    python benchmarks/formats.py --experts 32 --device cpu --out out/formats.csv
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch

from modelfleet.engine.formats import (
    Int4Weight,
    Int8Weight,
    MXFP4Weight,
    PlainWeight,
    QuantizedWeight,
    quantize,
)
from modelfleet.engine.kernels.expert_gemv import expert_gemv
from modelfleet.engine.layers import Experts
from modelfleet.engine.quantize import QuantizedExperts, prepare_kernels
from modelfleet.results import write_csv

HIDDEN, EXPERT_WIDTH, TOP_K = 2048, 768, 8
DENSE_SHAPES = ((7168, 2048), (2048, 7168))
FORMATS = ("bf16", "int8", "int4", "mxfp4")
DISTINCT_EXPERTS = 4  # quantized for real; the rest of a bank replicates their storage
WORKLOADS = ("moe", "expert-kernels", "dense")
ROUTINGS = 16  # distinct routings cycled through, so consecutive steps use different experts
DENSE_RING_BYTES = 128 << 20  # copies of a dense matrix cycled through: 4x the last-level cache


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_ms(fn: Callable[[], object], device: str, budget_s: float = 0.3) -> float:
    """Best wall time of ``fn`` in ms over about ``budget_s`` seconds (at least 3 runs) after a
    warm-up: the least disturbed run, since CI and dev machines share their cores."""
    fn()
    samples: list[float] = []
    while len(samples) < 3 or (sum(samples) < budget_s and len(samples) < 200):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        samples.append(time.perf_counter() - start)
    return min(samples) * 1e3


def copy_bandwidth(device: str) -> float:
    """GB/s of a large tensor copy, counting bytes read plus bytes written."""
    count = (1 << 28) if device == "cuda" else (1 << 26)
    src = torch.empty(count, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    seconds = time_ms(lambda: dst.copy_(src), device, budget_s=1.0) / 1e3
    return 2 * src.numel() * 4 / seconds / 1e9


def replicate(weight: QuantizedWeight, experts: int) -> QuantizedWeight:
    """A bank of ``experts`` whose storage repeats ``weight``'s distinct experts (owned copies)."""

    def rep(t: torch.Tensor) -> torch.Tensor:
        reps = -(-experts // t.shape[0])
        return t.repeat(reps, *([1] * (t.dim() - 1)))[:experts].contiguous()

    if isinstance(weight, Int4Weight):
        zeros = None if weight.zeros is None else rep(weight.zeros)
        return type(weight)(rep(weight.codes), rep(weight.scales), zeros)
    if isinstance(weight, Int8Weight):
        return Int8Weight(rep(weight.codes), rep(weight.scales))
    if isinstance(weight, MXFP4Weight):
        return MXFP4Weight(rep(weight.blocks), rep(weight.scales))
    assert isinstance(weight, PlainWeight)
    return PlainWeight(rep(weight.weight))


def build_bank(fmt: str, out_features: int, in_features: int, experts: int, device: str) -> QuantizedWeight:
    distinct = torch.randn(min(experts, DISTINCT_EXPERTS), out_features, in_features) * 0.02
    return replicate(quantize(distinct, fmt), experts).to(device)


def route(rows: int, experts: int, generator: torch.Generator, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row to TOP_K distinct random experts with softmax weights: index, weight [rows, TOP_K]."""
    index = torch.stack([torch.randperm(experts, generator=generator)[:TOP_K] for _ in range(rows)])
    weight = torch.softmax(torch.randn(rows, TOP_K, generator=generator), dim=-1)
    return index.to(device), weight.to(device).to(torch.bfloat16)


def expert_layer(fmt: str, experts: int, device: str) -> tuple[torch.nn.Module, int]:
    """The engine's expert module for ``fmt`` (as a loader builds it) and one expert's format bytes."""
    gate_up = build_bank(fmt, 2 * EXPERT_WIDTH, HIDDEN, experts, device)
    down = build_bank(fmt, HIDDEN, EXPERT_WIDTH, experts, device)
    per_expert = gate_up.expert(0).nbytes + down.expert(0).nbytes  # before any kernel layout
    layer: torch.nn.Module
    if isinstance(gate_up, PlainWeight) and isinstance(down, PlainWeight):
        layer = Experts(gate_up.weight, down.weight)
        layer.pack_for_cpu()  # the engine's CPU layout (a no-op on CUDA)
    else:
        layer = QuantizedExperts(gate_up, down)
        prepare_kernels(layer, torch.bfloat16)
    return layer, per_expert


@dataclass
class Result:
    device: str
    workload: str
    format: str
    rows: int
    mode: str  # eager: launched from Python each step; graph: replayed from a CUDA graph
    bytes_per_param: float  # format bytes of the whole bank or matrix / its parameters
    weights_mb: float  # format bytes of the weights one step uses
    time_ms: float
    gb_per_s: float = 0.0
    copy_gb_per_s: float = 0.0
    share_of_copy_bw: float = 0.0
    speedup_vs_bf16: float = 0.0
    read_ms: float = float("nan")  # expert-kernels, graph: the routed slabs read in two launches
    read_one_ms: float = float("nan")  # ... and in one launch
    share_of_read: float = float("nan")  # read_ms / time_ms

    def __post_init__(self) -> None:
        self.gb_per_s = self.weights_mb / self.time_ms
        self.share_of_read = self.read_ms / self.time_ms


def timings(steps: list[Callable[[], object]], device: str, capturable: bool = True) -> dict[str, float]:
    """ms per step: the steps run back to back (each touching weights the previous one did not, so
    a last-level cache cannot hold them) and one synchronisation ends the pass, so the host's sync
    cost is shared by all of them. ``eager`` launches every kernel from Python; on CUDA, when the
    steps never sync with the host, ``graph`` replays one CUDA graph per step, captured after a
    warm-up that lets the autotuners choose."""
    for step in steps:
        step()

    def run_steps() -> None:
        for step in steps:
            step()

    times = {"eager": time_ms(run_steps, device) / len(steps)}
    if device == "cuda" and capturable:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run_steps()
        times["graph"] = time_ms(graph.replay, device) / len(steps)
    return times


def bench_moe(fmt: str, experts: int, rows_list: list[int], device: str) -> list[Result]:
    layer, per_expert = expert_layer(fmt, experts, device)
    params = (2 * EXPERT_WIDTH * HIDDEN + HIDDEN * EXPERT_WIDTH) * experts
    results = []
    for rows in rows_list:
        generator = torch.Generator().manual_seed(rows)
        routings = [route(rows, experts, generator, device) for _ in range(ROUTINGS)]
        x = torch.randn(rows, HIDDEN, device=device).to(torch.bfloat16)
        used = statistics.mean(index.unique().numel() * per_expert for index, _ in routings)
        steps = [partial(layer, x, index, weight) for index, weight in routings]
        with torch.inference_mode():
            capturable = not isinstance(layer, QuantizedExperts) or layer.gathered_on(torch.device(device))
            for mode, ms in timings(steps, device, capturable).items():
                per_param = per_expert * experts / params
                results.append(Result(device, f"moe-{experts}x{TOP_K}", fmt, rows, mode, per_param, used / 1e6, ms))
    return results


def expert_kernels(
    layer: torch.nn.Module, x: torch.Tensor, a: torch.Tensor, index: torch.Tensor, weight: torch.Tensor
) -> object:
    """The expert kernels of one step for the routing ``index``/``weight``: the fused pair where
    the layer runs it, else the gathered gate_up and down matmuls (``a`` stands in for the
    activation between them)."""
    flat = index.reshape(-1)
    if isinstance(layer, QuantizedExperts):
        fused = layer.fused_kernels(x)
        if fused is not None:
            from modelfleet.engine.formats import triton_moe

            gate_up, down, act = fused
            return triton_moe.moe_pair(x, index, weight, gate_up, down, None, None, triton_moe.Activation(*act))
        return layer.gate_up.gathered_matmul(x, flat, TOP_K), layer.down.gathered_matmul(a, flat, 1)
    return expert_gemv(x, layer.gate_up, flat, TOP_K), expert_gemv(a, layer.down, flat, 1)


def bank_slabs(layer: torch.nn.Module, x: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
    """The [E, ...] tensors the expert kernels read for each routed expert, gate_up's and down's:
    the fused kernels' banks (codes, scales, zero points) or the plain weights; None for the
    gathered quantized matmuls (int8), whose layouts this benchmark does not read."""
    if isinstance(layer, QuantizedExperts):
        fused = layer.fused_kernels(x)
        if fused is None:
            return None
        banks = fused[:2]
        return tuple([t for t in (b.codes, b.scales, b.zeros) if t is not None] for b in banks)  # type: ignore[return-value]
    assert isinstance(layer, Experts)
    return [layer.gate_up], [layer.down]


def _read_bound():  # type: ignore[no-untyped-def]
    """benchmarks/read_bound.py, loaded by path (it needs triton: CUDA runs only)."""
    path = Path(__file__).with_name("read_bound.py")
    spec = importlib.util.spec_from_file_location("read_bound", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_times(slabs: tuple[list[torch.Tensor], list[torch.Tensor]], routings: list) -> tuple[float, float]:
    """Graph ms per step of reading the routed slabs: two launches (gate_up's, then down's, which
    issues its loads before waiting for gate_up's), and one."""
    reader = _read_bound().SlabReader
    up, down, both = reader(slabs[0]), reader(slabs[1], wait_late=True), reader(slabs[0] + slabs[1])
    split = [partial(lambda i: (up(i), down(i)), index) for index, _ in routings]
    one = [partial(both, index) for index, _ in routings]
    return timings(split, "cuda")["graph"], timings(one, "cuda")["graph"]


def bench_expert_kernels(fmt: str, experts: int, rows_list: list[int]) -> list[Result]:
    """CUDA only: the expert kernels of an MoE step alone (see ``expert_kernels``), without
    routing: what the kernels themselves reach against the bandwidth bound."""
    layer, per_expert = expert_layer(fmt, experts, "cuda")
    params = (2 * EXPERT_WIDTH * HIDDEN + HIDDEN * EXPERT_WIDTH) * experts
    results = []
    for rows in rows_list:
        generator = torch.Generator().manual_seed(rows)
        routings = [route(rows, experts, generator, "cuda") for _ in range(ROUTINGS)]
        x = torch.randn(rows, HIDDEN, device="cuda").to(torch.bfloat16)
        a = torch.randn(rows * TOP_K, EXPERT_WIDTH, device="cuda").to(torch.bfloat16)
        if isinstance(layer, QuantizedExperts) and not layer.gathered_on(torch.device("cuda")):
            continue
        steps = [partial(expert_kernels, layer, x, a, index, weight) for index, weight in routings]
        used = statistics.mean(index.unique().numel() * per_expert for index, _ in routings)
        with torch.inference_mode():
            slabs = bank_slabs(layer, x)
            read = read_times(slabs, routings) if slabs is not None else (float("nan"),) * 2
            for mode, ms in timings(steps, "cuda").items():
                per_param = per_expert * experts / params
                workload = f"expert-kernels-{experts}x{TOP_K}"
                split, one = read if mode == "graph" else (float("nan"),) * 2
                result = Result(
                    "cuda", workload, fmt, rows, mode, per_param, used / 1e6, ms, read_ms=split, read_one_ms=one
                )
                results.append(result)
    return results


def bench_dense(fmt: str, shape: tuple[int, int], rows_list: list[int], device: str) -> list[Result]:
    one = quantize(torch.randn(1, *shape) * 0.02, fmt)
    copies = max(2, -(-DENSE_RING_BYTES // one.nbytes))
    ring = replicate(one, copies).to(device)
    matrices = [ring.expert(i) for i in range(copies)]
    w = matrices[0]
    results = []
    for rows in rows_list:
        x = torch.randn(rows, shape[1], device=device).to(torch.bfloat16)
        for m in matrices:
            m.prepare_for(x)
        with torch.inference_mode():
            for mode, ms in timings([partial(m.matmul, x) for m in matrices], device).items():
                per_param = w.nbytes / (shape[0] * shape[1])
                workload = f"dense-{shape[0]}x{shape[1]}"
                results.append(Result(device, workload, fmt, rows, mode, per_param, w.nbytes / 1e6, ms))
    return results


def annotate(results: list[Result], bandwidth: float) -> None:
    """The share of copy bandwidth, and the speedup over bf16 at the same workload and rows."""
    bf16 = {(r.workload, r.rows, r.mode): r.time_ms for r in results if r.format == "bf16"}
    for r in results:
        r.copy_gb_per_s = bandwidth
        r.share_of_copy_bw = r.gb_per_s / bandwidth
        base = bf16.get((r.workload, r.rows, r.mode))
        r.speedup_vs_bf16 = base / r.time_ms if base else float("nan")


def rounded(r: Result) -> dict[str, object]:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(r).items()}


def print_table(results: list[Result]) -> None:
    rows = [rounded(r) for r in results]
    columns = list(rows[0])
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(str(r[c]).ljust(widths[c]) for c in columns))


def order(r: Result) -> tuple[str, str, int, str, int]:
    fmt = FORMATS.index(r.format) if r.format in FORMATS else len(FORMATS)
    return (r.device, r.workload, r.rows, r.mode, fmt)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda", "all"], default="all", help="all: cpu, and cuda if present")
    parser.add_argument("--experts", type=int, default=128, help="experts per MoE bank (Qwen3-30B-A3B: 128)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--formats", nargs="+", default=list(FORMATS))
    parser.add_argument("--out", type=Path, default=Path("out/formats.csv"))
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    parser.add_argument(
        "--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS), help="which workloads to time"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.experts < TOP_K:
        parser.error(f"--experts must be at least top-k = {TOP_K}")
    devices = ["cpu", "cuda"] if args.device == "all" else [args.device]
    devices = [d for d in devices if d == "cpu" or torch.cuda.is_available()]
    results: list[Result] = []
    for device in devices:
        bandwidth = copy_bandwidth(device)
        print(f"{device}: copy bandwidth {bandwidth:.1f} GB/s (read + write), {torch.get_num_threads()} threads")
        device_results: list[Result] = []
        for fmt in args.formats:
            if "moe" in args.workloads:
                device_results += bench_moe(fmt, args.experts, args.rows, device)
            if device == "cuda" and "expert-kernels" in args.workloads:
                device_results += bench_expert_kernels(fmt, args.experts, args.rows)
            for shape in DENSE_SHAPES if "dense" in args.workloads else ():
                device_results += bench_dense(fmt, shape, args.rows, device)
        annotate(device_results, bandwidth)
        results += sorted(device_results, key=order)
    print_table(results)
    write_csv(args.out, [rounded(r) for r in results])
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
