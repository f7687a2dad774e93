"""``modelfleet quantize``: write a checkpoint whose weights are already in their formats.

The output loads with ``modelfleet generate --model OUT`` (or ``Shard.load``) without quantizing
again and gives exactly the tokens of quantizing the source at load with the same formats and
dtype. Layout: :mod:`modelfleet.engine.quantized_checkpoint`.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

FORMATS_HELP = "a format name, or 'none' to keep the role as stored"
SOURCE_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def source_dtype(model: Path) -> str:
    """The dtype the checkpoint stores (config.json ``dtype``/``torch_dtype``), float32 if unsaid."""
    config = json.loads((model / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    return SOURCE_DTYPES.get(str(name), "float32")


def bytes_table(bytes_by_role: dict[str, dict[str, int]], title: str) -> Table:
    table = Table(title=title)
    for column in ("role", "format", "MiB"):
        table.add_column(column, justify="right")
    for role, by_format in sorted(bytes_by_role.items()):
        for fmt, nbytes in sorted(by_format.items()):
            table.add_row(role, fmt, f"{nbytes / 2**20:.2f}")
    return table


def quantize(
    model: Path = typer.Option(..., "--model", help="Source checkpoint directory (config.json + *.safetensors)."),
    out: Path = typer.Option(..., "--out", help="Directory to write the quantized checkpoint into."),
    experts: str = typer.Option("int4", "--experts", help=f"Feed-forward weights: {FORMATS_HELP}."),
    attention: str = typer.Option("int8", "--attention", help=f"Attention projections: {FORMATS_HELP}."),
    head: str = typer.Option("int8", "--head", help=f"Output head: {FORMATS_HELP}."),
    embeddings: str = typer.Option(
        "none", "--embeddings", help=f"Embedding table (a tied head shares a packed one): {FORMATS_HELP}."
    ),
    dtype: str | None = typer.Option(
        None, "--dtype", help="Dtype weights are read in before quantizing (default: the checkpoint's own)."
    ),
    force: bool = typer.Option(False, "--force", help="Write into OUT even if it already holds a checkpoint."),
) -> None:
    """Quantize a checkpoint once, offline, with a format per role (experts, attention, head, embeddings)."""
    from modelfleet.commands.fleet import fail as _fail
    from modelfleet.engine.errors import ModelfleetError
    from modelfleet.engine.formats.plan import plan_from_options
    from modelfleet.engine.quantized_checkpoint import save_quantized
    from modelfleet.engine.shard import Shard, resolve_dtype

    err = Console(stderr=True, soft_wrap=True)
    if out.resolve() == model.resolve():
        _fail("--out must differ from --model: the source checkpoint is never overwritten")
    if (out / "config.json").exists() and not force:
        _fail(f"{out} already holds a checkpoint; pass --force to overwrite it")
    try:
        plan = plan_from_options(True, experts=experts, attention=attention, head=head, embeddings=embeddings)
        assert plan is not None
        torch_dtype = resolve_dtype(dtype or source_dtype(model))
        shard = Shard.load(model, dtype=torch_dtype, progress=True, pack=False, formats=plan)
        with err.status(f"writing {out}"):
            files = save_quantized(shard, model, out, plan, torch_dtype)
    except (ModelfleetError, OSError) as exc:
        _fail(str(exc))
        return
    err.print(bytes_table(shard.bytes_by_role, f"{out}: resident bytes by role and format"))
    err.print(f"wrote {len(files)} safetensors file(s), {shard.weights_bytes / 2**20:.1f} MiB of weights, to {out}")
