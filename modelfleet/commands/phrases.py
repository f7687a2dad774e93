"""``modelfleet phrases``: build, merge and inspect phrase tables for the ``phrase`` proposer.

A phrase table (engine.speculative.proposers.PhraseTable) counts which token follows each
``context``-token phrase; the ``phrase`` and ``hybrid`` proposers propose the agreed continuations.
Tables learn from what a fleet emits; these commands build one offline from text and merge tables
from several heads (``serving.speculative.phraseTable`` then names the result).
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.progress import track
from rich.table import Table

app = typer.Typer(help="Phrase tables for speculative decoding: learn from text, merge, show.", no_args_is_help=True)
out = Console()


def _fail(message: str) -> None:
    Console(stderr=True).print(f"[red]error:[/] {message}")
    raise typer.Exit(2)


@app.command()
def learn(
    model: Path = typer.Option(..., "--model", help="Checkpoint directory whose tokenizer.json tokenizes the text."),
    files: list[Path] = typer.Argument(..., help="Text files to learn from (UTF-8; undecodable bytes replaced)."),
    out_path: Path = typer.Option(Path("phrases.json"), "--out", help="Where to write the table."),
    context: int = typer.Option(3, "--context", min=1, help="Tokens of context a phrase holds."),
) -> None:
    """Count every phrase's next token over the files' text and write the table."""
    from modelfleet.engine.errors import ModelfleetError
    from modelfleet.engine.speculative.proposers import PhraseTable
    from modelfleet.engine.tokenizer import TextTokenizer

    if not TextTokenizer.exists(model):
        _fail(f"{model} has no tokenizer.json to tokenize the text with; pass --model with one")
    try:
        tokenizer, table = TextTokenizer(model), PhraseTable(context)
        for path in track(files, description="learning", console=Console(stderr=True)):
            table.learn(tokenizer.encode(path.read_text(errors="replace")))
        table.save(out_path)
    except (ModelfleetError, OSError) as exc:
        _fail(str(exc))
    out.print(f"wrote {out_path}: {len(table.counts)} phrases of {context} tokens from {len(files)} file(s)")


@app.command()
def merge(
    tables: list[Path] = typer.Argument(..., help="Phrase tables to merge (the same context length)."),
    out_path: Path = typer.Option(..., "--out", help="Where to write the merged table."),
) -> None:
    """Merge tables: the counts add up, so agreement is judged over everything they saw."""
    from modelfleet.engine.errors import ModelfleetError
    from modelfleet.engine.speculative.proposers import PhraseTable

    try:
        merged = PhraseTable.load(tables[0])
        for path in tables[1:]:
            merged = merged.merge(PhraseTable.load(path))
        merged.save(out_path)
    except (ModelfleetError, OSError) as exc:
        _fail(str(exc))
    out.print(f"wrote {out_path}: {len(merged.counts)} phrases from {len(tables)} tables")


@app.command()
def show(
    table_path: Path = typer.Argument(..., help="A phrase table."),
    min_count: int = typer.Option(2, "--min-count", min=1, help="Times a phrase must be seen to propose."),
    min_agreement: float = typer.Option(0.9, "--min-agreement", min=0.0, max=1.0, help="Share its successor needs."),
) -> None:
    """How many phrases the table holds and how many would propose under the thresholds."""
    from modelfleet.engine.errors import ModelfleetError
    from modelfleet.engine.speculative.proposers import PhraseTable

    try:
        table = PhraseTable.load(table_path, min_count, min_agreement)
    except ModelfleetError as exc:
        _fail(str(exc))
        return
    proposing = sum(table.next_token(phrase) is not None for phrase in table.counts)
    view = Table(title=str(table_path))
    for column in ("context", "phrases", "proposing", "pairs counted"):
        view.add_column(column)
    pairs = sum(sum(c.values()) for c in table.counts.values())
    view.add_row(str(table.context), str(len(table.counts)), str(proposing), str(pairs))
    out.print(view)
