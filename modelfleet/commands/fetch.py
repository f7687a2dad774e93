"""``modelfleet fetch``: a Hub checkpoint's snapshot into a directory, as stage pods' init containers
run it (the agent then reads the directory). The work is :func:`modelfleet.engine.hub.fetch`."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

err = Console(stderr=True, soft_wrap=True)


def fetch(
    uri: str = typer.Argument(
        ..., metavar="URI", help="hf://ORG/NAME or hf://ORG/NAME@REVISION (branch, tag or commit)."
    ),
    out: Path = typer.Option(..., "--out", help="Directory to download into (created if missing)."),
    include: list[str] = typer.Option(
        [], "--include", help="Also download repository paths matching this glob (repeatable)."
    ),
    weights: bool = typer.Option(
        True, "--weights/--no-weights", help="--no-weights: config, tokenizer and chat template only (a gateway)."
    ),
) -> None:
    """Download an hf:// checkpoint into a directory (what a modelfleet load reads).

    Takes config.json, generation_config.json, the tokenizer files, the chat template, *.safetensors
    and their index. HF_TOKEN authenticates, HF_ENDPOINT names a mirror. A complete snapshot of the
    same commit already in --out is not downloaded again."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    from modelfleet.engine.errors import ModelfleetError
    from modelfleet.engine.hub import fetch as fetch_snapshot

    with Progress(
        TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
        console=err, transient=True,
    ) as progress:  # fmt: skip
        task = progress.add_task(f"fetching {uri}", total=None)

        def arrived(name: str, size: int) -> None:
            progress.update(task, advance=size, description=f"{uri}: {name}")

        try:
            result = fetch_snapshot(
                uri, out, include, weights, progress=arrived, on_start=lambda total: progress.update(task, total=total)
            )
        except (ModelfleetError, OSError) as exc:
            err.print(f"[bold red]error:[/] {exc}")
            raise typer.Exit(code=2) from exc
    if result.downloaded:
        err.print(f"{uri} at {result.commit}: {len(result.downloaded)} files into {out}")
    else:
        err.print(f"{uri} at {result.commit}: complete in {out}, nothing to download")
