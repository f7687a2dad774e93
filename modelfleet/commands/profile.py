"""``modelfleet profile-bandwidth``: measure beta_g and beta_c on this machine, print q* and the
predicted miss-service time per step (seed 001, "Where the 28% split comes from").

Both paths run at once, as they do while serving: expert copies from host memory into a device
slot (beta_g) and experts computed in place on the CPU at one row each (beta_c). Without a CUDA
device the "device" path copies within host memory and the output says so: beta_c is still real,
beta_g and q* are not this machine's PCIe.
"""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.table import Table

FORMAT_HELP = "Experts' format: int4, int4_sym, mxfp4, int8, or a plain dtype (bf16, fp16, fp32)."


def profile_bandwidth(
    hidden: int = typer.Option(2048, "--hidden", min=32, help="Model width H (Qwen3-30B-A3B: 2048)."),
    moe_inner: int = typer.Option(768, "--moe-inner", min=16, help="Expert width I (Qwen3-30B-A3B: 768)."),
    experts: int = typer.Option(32, "--experts", min=1, help="Experts in the profiled bank."),
    fmt: str = typer.Option("int4", "--format", help=FORMAT_HELP),
    cpu_workers: int | None = typer.Option(
        None,
        "--cpu-workers",
        min=1,
        help="Threads of the compiled CPU expert kernel (int4, int4_sym, mxfp4; default: every CPU but one).",
    ),
    cpu_threads: int | None = typer.Option(
        None,
        "--cpu-threads",
        min=1,
        help="torch's intra-op threads, for formats the compiled kernel does not take (default: torch's).",
    ),
    seconds: float = typer.Option(1.0, "--seconds", min=0.01, help="How long both paths run."),
    misses: int = typer.Option(8, "--misses", min=1, help="Expert misses per MoE layer per step, for the prediction."),
    layers: int = typer.Option(48, "--layers", min=1, help="MoE layers per step, for the prediction."),
    device: str = typer.Option("auto", "--device", help="cuda[:N], or auto (cuda when present, else a CPU stand-in)."),
    activations: str = typer.Option("bfloat16", "--dtype", help="Activations' dtype: bfloat16 or float32."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of the table."),
) -> None:
    """Measure beta_g (expert copies to the device) and beta_c (CPU experts) together; print q* and step times.

    Both paths run at once, as while serving; q* = beta_g / (beta_g + beta_c) splits each step's miss bytes."""
    import torch

    from modelfleet.engine.errors import ModelfleetError
    from modelfleet.engine.expert_offload import default_cpu_workers
    from modelfleet.engine.expert_store import (
        EvictionPolicy,
        ExpertStore,
        StoreConfig,
        expert_bytes,
        measure_bandwidths,
        predicted_step_seconds,
    )
    from modelfleet.engine.formats.plain import PLAIN_DTYPES
    from modelfleet.engine.layers import Experts
    from modelfleet.engine.quantize import quantized_module
    from modelfleet.engine.shard import resolve_dtype

    if cpu_threads is not None:
        torch.set_num_threads(cpu_threads)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        g = torch.Generator().manual_seed(0)
        plain = Experts(
            torch.randn(experts, 2 * moe_inner, hidden, generator=g) * 0.02,
            torch.randn(experts, hidden, moe_inner, generator=g) * 0.02,
        )
        dtype = PLAIN_DTYPES.get(fmt)
        if dtype is not None:
            bank: torch.nn.Module = Experts(plain.gate_up.data.to(dtype), plain.down.data.to(dtype))
        else:
            bank = quantized_module("layers.0.mlp.experts", plain, fmt)
        del plain
        workers = cpu_workers or default_cpu_workers()
        store = ExpertStore(bank, torch.device(device), StoreConfig(1, EvictionPolicy.LRU, None, workers))  # type: ignore[arg-type]
        row_dtype = dtype if dtype is not None else resolve_dtype(activations)
        measured = measure_bandwidths(store, seconds, row_dtype)
    except (ModelfleetError, RuntimeError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    miss_bytes = misses * layers * expert_bytes(bank)  # type: ignore[arg-type]
    q = measured.q_star
    times = {name: predicted_step_seconds(miss_bytes, value, measured.beta_g, measured.beta_c)
             for name, value in (("q_star", q), ("fetch_all", 1.0), ("cpu_all", 0.0))}  # fmt: skip
    report = {**measured.as_dict(), "cpu_threads": torch.get_num_threads(), "expert_bytes": expert_bytes(bank), "miss_bytes_per_step": miss_bytes,  # type: ignore[arg-type]
              "predicted_step_seconds": {k: round(v, 6) for k, v in times.items()}}  # fmt: skip
    if as_json:
        typer.echo(json.dumps(report))
        return
    _print(report, measured.device_is_stand_in)


def _print(report: dict[str, object], stand_in: bool) -> None:
    table = Table(title="expert bandwidths (both paths at once)")
    for column in ("quantity", "value"):
        table.add_column(column, justify="right")
    beta_g, beta_c = report["beta_g_bytes_per_second"], report["beta_c_bytes_per_second"]
    table.add_row("beta_g (host -> device copies)", f"{float(beta_g) / 1e9:.2f} GB/s")  # type: ignore[arg-type]
    table.add_row("beta_c (CPU experts, one row)", f"{float(beta_c) / 1e9:.2f} GB/s")  # type: ignore[arg-type]
    table.add_row("q* = beta_g / (beta_g + beta_c)", f"{report['q_star']}")
    table.add_row(
        "format / CPU kernel",
        f"{report['format']} / {report['cpu_kernel']}, {report['cpu_workers']} threads"
        if report["cpu_kernel"] != "torch"
        else f"{report['format']} / torch, {report['cpu_threads']} threads",
    )
    for name, seconds in report["predicted_step_seconds"].items():  # type: ignore[attr-defined]
        table.add_row(f"miss service per step, {name}", f"{seconds * 1e3:.2f} ms")
    console = Console()
    console.print(table)
    if stand_in:
        console.print(
            "device absent: the device path was a copy within host memory (a stand-in), so beta_g and q* "
            "describe this CPU, not a PCIe link; beta_c is this machine's."
        )
