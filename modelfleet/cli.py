"""The ``modelfleet`` command line: one entry point for every job.

Each command is a thin shell over the engine, agent or operator packages: it parses and
validates options, calls into them, and prints results (rich tables, progress bars, JSON).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import typer
from rich.console import Console

from modelfleet import __version__
from modelfleet.commands.quantize import quantize as quantize_command
from modelfleet.engine.format_names import WEIGHT_FORMATS

app = typer.Typer(
    name="modelfleet",
    help="Serve Mixture-of-Experts language models across fleets of small machines.\n\n"
    "Run a checkpoint locally with `modelfleet generate`; see `modelfleet COMMAND --help` for each job.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True, soft_wrap=True)
ROLE_HELP = f"{', '.join(WEIGHT_FORMATS)}, or none to keep it as stored."
SPECULATIVE_HELP = (
    'Speculative decoding, as JSON: {"method": "ngram"|"phrase"|"hybrid", "num_speculative_tokens": K, '
    '"prompt_lookup_max": N, "phrase_table": FILE, "adaptive": true}. The output is the same as without it '
    "(greedy: token for token; sampling: the same distribution)."
)


def _fail(message: str) -> None:
    err.print(f"[bold red]error:[/] {message}")
    raise typer.Exit(code=2)


@app.callback(invoke_without_command=True)
def main(version: bool = typer.Option(False, "--version", help="Print the version and exit.")) -> None:
    if version:
        typer.echo(f"modelfleet {__version__}")
        raise typer.Exit()


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        _fail(f"--prompt-ids must be comma-separated integers, got {text!r}")
        return []


@app.command()
def generate(
    model: Path = typer.Option(..., "--model", help="Hugging Face checkpoint directory (config.json + *.safetensors)."),
    prompt: str | None = typer.Option(None, "--prompt", help="Prompt text (needs tokenizer.json in the checkpoint)."),
    prompt_ids: str | None = typer.Option(None, "--prompt-ids", help="Prompt as comma-separated token ids."),
    max_tokens: int = typer.Option(64, "--max-tokens", min=1, help="Most tokens to generate."),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0, help="0 is greedy."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass, in (0, 1]."),
    top_k: int = typer.Option(0, "--top-k", min=0, help="Keep the k most likely tokens; 0 keeps all."),
    min_p: float = typer.Option(0.0, "--min-p", help="Drop tokens under min_p x the top probability."),
    seed: int | None = typer.Option(None, "--seed", help="Sampling seed: the same seed gives the same output."),
    dtype: str = typer.Option("float32", "--dtype", help="float32, bfloat16 or float16."),
    device: str = typer.Option(
        "cpu", "--device", help="torch: cpu or cuda[:N]; openvino: cpu (CPU) or GPU[.N] (an Intel iGPU)."
    ),
    backend: str = typer.Option(
        "torch", "--backend", help="What executes the layers: torch, or openvino (fused MoE blocks; CPU or Intel GPU)."
    ),
    shards: int = typer.Option(1, "--shards", min=1, help="Cut the model into this many layer ranges in-process."),
    quantize: bool = typer.Option(
        False, "--quantize", help="Quantize at load: experts int4, attention and head int8, embeddings as stored."
    ),
    experts: str | None = typer.Option(None, "--experts", help=f"Experts' format (implies --quantize); {ROLE_HELP}"),
    attention: str | None = typer.Option(None, "--attention", help=f"Attention's format; {ROLE_HELP}"),
    head: str | None = typer.Option(None, "--head", help=f"The output head's format; {ROLE_HELP}"),
    embeddings: str | None = typer.Option(
        None, "--embeddings", help=f"The embedding table's format (a tied head shares a packed one); {ROLE_HELP}"
    ),
    speculative_config: str | None = typer.Option(None, "--speculative-config", help=SPECULATIVE_HELP, metavar="JSON"),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (tokens, text, timings) last."),
) -> None:
    """Generate a continuation with the single-process engine, streaming text as it comes."""
    from modelfleet.engine.errors import ModelfleetError
    from modelfleet.engine.formats.plan import plan_from_options
    from modelfleet.engine.generate import LocalModel
    from modelfleet.engine.generate import generate as run_generate
    from modelfleet.engine.sampling import SamplingParams
    from modelfleet.engine.speculative.build import build_proposer
    from modelfleet.engine.speculative.config import SpeculativeConfig
    from modelfleet.engine.speculative.speculator import Speculator
    from modelfleet.engine.tokenizer import IncrementalDecoder, TextTokenizer

    if (prompt is None) == (prompt_ids is None):
        _fail("give exactly one of --prompt TEXT or --prompt-ids 1,2,3")
    try:
        tokenizer = TextTokenizer(model) if TextTokenizer.exists(model) else None
        if prompt is not None and tokenizer is None:
            _fail(f"{model} has no tokenizer.json, so --prompt cannot be tokenized; use --prompt-ids")
        ids = tokenizer.encode(prompt) if prompt is not None and tokenizer else _parse_ids(prompt_ids or "")
        params = SamplingParams(
            temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed, max_tokens=max_tokens
        )
        formats = plan_from_options(quantize, experts=experts, attention=attention, head=head, embeddings=embeddings)
        config = SpeculativeConfig.from_json(speculative_config) if speculative_config else None
        started = time.perf_counter()
        lm = LocalModel.load(
            model, shards, device=device, dtype=dtype, progress=not as_json, max_slots=1, formats=formats,
            backend=backend,
        )  # fmt: skip
        load_s = time.perf_counter() - started
        decoder = IncrementalDecoder(tokenizer) if tokenizer else None
        stream = sys.stdout if not as_json else sys.stderr

        def on_token(token: int) -> None:
            stream.write(decoder.push(token) if decoder else f"{token} ")
            stream.flush()

        speculator = None
        if config is not None:
            speculator = Speculator(config, build_proposer(config, model, 1, device))
        result = run_generate(lm, ids, params, on_token, speculator)
        if decoder:
            stream.write(decoder.flush())
        stream.write("\n")
    except ModelfleetError as exc:
        _fail(str(exc))
        return
    if as_json:
        out = {
            "prompt_tokens": result.prompt_tokens,
            "token_ids": result.token_ids,
            "finish_reason": result.finish_reason,
            "load_seconds": round(load_s, 4),
            "time_to_first_token_seconds": round(result.time_to_first_token_s, 6),
            "total_seconds": round(result.total_s, 6),
            "decode_tokens_per_second": round(result.decode_tokens_per_s, 3),
            "weights_bytes": lm.weights_bytes,
            "bytes_by_role": lm.bytes_by_role,
            "backend": lm.backend_info,
        }
        if speculator is not None:
            out["speculative"] = speculator.stats.as_dict()
        if tokenizer:
            out["text"] = tokenizer.decode(result.token_ids)
        typer.echo(json.dumps(out))


def _register() -> None:
    from modelfleet.commands import chat, fleet

    for command in (fleet.plan, fleet.up, fleet.agent, fleet.complete, chat.chat, fleet.keys):
        app.command()(command)


_register()
app.command()(__import__("modelfleet.commands.gateway", fromlist=["gateway"]).gateway)
app.add_typer(__import__("modelfleet.commands.render", fromlist=["app"]).app)  # render, inspect, operator
app.command()(__import__("modelfleet.commands.fetch", fromlist=["fetch"]).fetch)
app.add_typer(__import__("modelfleet.commands.phrases", fromlist=["app"]).app, name="phrases")

app.command()(quantize_command)

if __name__ == "__main__":
    app()
