"""``modelfleet export``: write any checkpoint modelfleet loads (plain or quantized) as a plain
Hugging Face checkpoint, so other engines run exactly the weights we serve. The mechanism and its
exactness check are in :mod:`modelfleet.engine.export`."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console


def export(
    model: Path = typer.Option(..., "--model", help="Checkpoint directory modelfleet loads (plain or quantized)."),
    out: Path = typer.Option(..., "--out", help="Directory to write the plain Hugging Face checkpoint into."),
    dtype: str = typer.Option(
        "float32",
        "--dtype",
        help="float32 (a quantized weight's exact decode) or bfloat16 (half the bytes; rounds decoded weights).",
    ),
    force: bool = typer.Option(False, "--force", help="Write into OUT even if it already holds a checkpoint."),
) -> None:
    """Write a plain Hugging Face checkpoint (the source's tensor names, experts per-expert or fused as the
    family stores them) whose weights are what modelfleet computes with: for transformers, or llama.cpp's
    convert_hf_to_gguf.py."""
    from modelfleet.commands.fleet import fail as _fail
    from modelfleet.engine.errors import ModelfleetError
    from modelfleet.engine.export import EXPORT_DTYPES, export_checkpoint

    err = Console(stderr=True, soft_wrap=True)
    if dtype not in EXPORT_DTYPES:
        _fail(f"--dtype must be one of {', '.join(EXPORT_DTYPES)}, got {dtype!r}")
    if out.resolve() == model.resolve():
        _fail("--out must differ from --model: the source checkpoint is never overwritten")
    if (out / "config.json").exists() and not force:
        _fail(f"{out} already holds a checkpoint; pass --force to overwrite it")
    try:
        with err.status(f"exporting {model} to {out}"):
            files = export_checkpoint(model, out, EXPORT_DTYPES[dtype])
    except (ModelfleetError, OSError) as exc:
        _fail(str(exc))
        return
    size = sum(f.stat().st_size for f in files)
    err.print(f"wrote {len(files)} safetensors file(s), {size / 2**20:.1f} MiB ({dtype}), to {out}")
