"""The ``modelfleet`` command line: one entry point for every job.

Each command is a thin shell over the engine, agent or operator packages: it parses and
validates options, calls into them, and prints results (rich tables, progress bars, JSON).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console

from modelfleet import __version__
from modelfleet.commands import fleet
from modelfleet.commands.quantize import quantize as quantize_command
from modelfleet.engine.format_names import WEIGHT_FORMATS

if TYPE_CHECKING:
    from modelfleet.engine.generate import GenerationResult, LocalModel
    from modelfleet.engine.tokenizer import TextTokenizer

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
    'Speculative decoding, as JSON: {"method": "ngram"|"phrase"|"hybrid"|"draft_model"|"mtp", '
    '"num_speculative_tokens": K, "prompt_lookup_max": N, "phrase_table": FILE, "model": DRAFT, "adaptive": true}'
    " (mtp: the checkpoint's own MTP layers). The output is the same as without it "
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
        _fail(f"--prompt-ids must be comma-separated integers (prompts separated by ';'), got {text!r}")
        return []


def _store_options(q: float | None, policy: str, workers: int | None, prefetch: str):  # type: ignore[no-untyped-def]
    from modelfleet.engine.expert_offload import StoreOptions, default_cpu_workers
    from modelfleet.engine.expert_store import EvictionPolicy

    choices = [p.value for p in EvictionPolicy]
    if policy not in choices:
        _fail(f"--expert-cache-policy {policy!r}: choose one of {', '.join(choices)}")
    return StoreOptions(
        EvictionPolicy(policy), q, workers or default_cpu_workers(), prefetch=fleet.expert_prefetch_option(prefetch)
    )


def _prompt_batch(
    prompt: str | None, prompt_ids: str | None, prompts_file: Path | None, tokenizer: TextTokenizer | None
) -> list[list[int]]:
    """The prompts to decode as one batch, as token ids: one --prompt, the ';'-separated
    --prompt-ids, or one prompt per non-blank line of --prompts-file (tokenized)."""
    if sum(option is not None for option in (prompt, prompt_ids, prompts_file)) != 1:
        _fail("give exactly one of --prompt TEXT, --prompt-ids 1,2,3[;4,5] or --prompts-file FILE")
    if prompt_ids is not None:
        batch = [_parse_ids(part) for part in prompt_ids.split(";") if part.strip()]
        if not batch or any(not ids for ids in batch):
            _fail(f"--prompt-ids needs at least one token id per prompt (prompts separated by ';'), got {prompt_ids!r}")
        return batch
    texts = [prompt] if prompt is not None else _prompt_lines(prompts_file)
    if tokenizer is None:
        option = "--prompt" if prompt is not None else "--prompts-file"
        _fail(f"the model has no tokenizer.json, so {option} cannot be tokenized; use --prompt-ids")
        return []
    return [tokenizer.encode(text) for text in texts]


def _prompt_lines(path: Path | None) -> list[str]:
    assert path is not None
    try:
        lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        _fail(f"--prompts-file {path} cannot be read as UTF-8 text: {exc}")
    if not lines:
        _fail(f"--prompts-file {path} holds no prompt (one prompt per non-blank line)")
    return lines


@app.command()
def generate(
    model: Path = typer.Option(..., "--model", help="Hugging Face checkpoint directory (config.json + *.safetensors)."),
    prompt: str | None = typer.Option(None, "--prompt", help="Prompt text (needs tokenizer.json in the checkpoint)."),
    prompt_ids: str | None = typer.Option(
        None,
        "--prompt-ids",
        help="Prompt as comma-separated token ids; several prompts separated by ';' run as one batch.",
    ),
    prompts_file: Path | None = typer.Option(
        None, "--prompts-file", help="A text file with one prompt per line, decoded as one batch (blank lines skipped)."
    ),
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
    gpu_memory_bytes: int | None = typer.Option(
        None,
        "--gpu-memory-bytes",
        min=1,
        help="Device memory to plan for (simulates a smaller GPU; on CPU, the cap "
        "itself): MoE layers that do not fit keep their experts in host banks with device cache slots.",
    ),
    expert_q: float | None = typer.Option(
        None,
        "--expert-q",
        min=0.0,
        max=1.0,
        help="Share of each step's expert-miss bytes fetched to the device (default: q* from bandwidths measured at start).",
    ),
    expert_cache_policy: str = typer.Option("lru", "--expert-cache-policy", help="Cache eviction: lru or frequency."),
    cpu_expert_workers: int | None = typer.Option(
        None,
        "--cpu-expert-workers",
        min=1,
        help="Threads computing offloaded experts on the CPU (default: every CPU this process may use but one).",
    ),
    expert_prefetch: str = typer.Option(
        fleet.DEFAULT_EXPERT_PREFETCH.value, "--expert-prefetch", help=fleet.EXPERT_PREFETCH_HELP
    ),
    as_json: bool = typer.Option(
        False,
        "--json",
        help="Print one JSON object (tokens, text, timings) last; for a batch, token_ids per prompt and the aggregate decode rate.",
    ),
) -> None:
    """Generate continuations with the single-process engine: one prompt streams its text as it comes;
    several prompts decode as one batch and print when done."""
    from modelfleet.engine.errors import ModelfleetError
    from modelfleet.engine.formats.plan import plan_from_options
    from modelfleet.engine.generate import LocalModel, generate_batch
    from modelfleet.engine.sampling import SamplingParams
    from modelfleet.engine.speculative.build import build_proposer
    from modelfleet.engine.speculative.config import SpeculativeConfig
    from modelfleet.engine.speculative.speculator import Speculator
    from modelfleet.engine.tokenizer import IncrementalDecoder, TextTokenizer

    try:
        tokenizer = TextTokenizer(model) if TextTokenizer.exists(model) else None
        batch = _prompt_batch(prompt, prompt_ids, prompts_file, tokenizer)
        params = SamplingParams(
            temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed, max_tokens=max_tokens
        )
        formats = plan_from_options(quantize, experts=experts, attention=attention, head=head, embeddings=embeddings)
        config = SpeculativeConfig.from_json(speculative_config) if speculative_config else None
        started = time.perf_counter()
        store = _store_options(expert_q, expert_cache_policy, cpu_expert_workers, expert_prefetch)
        lm = LocalModel.load(
            model, shards, device=device, dtype=dtype, progress=not as_json, max_slots=len(batch), formats=formats,
            device_memory_bytes=gpu_memory_bytes, store_options=store, backend=backend,
        )  # fmt: skip
        load_s = time.perf_counter() - started
        decoder = IncrementalDecoder(tokenizer) if tokenizer and len(batch) == 1 else None
        stream = sys.stdout if not as_json else sys.stderr

        def on_token(_index: int, token: int) -> None:
            stream.write(decoder.push(token) if decoder else f"{token} ")
            stream.flush()

        speculator = None
        if config is not None:
            proposer = build_proposer(config, model, len(batch), device, lm.max_context)
            speculator = Speculator(config, proposer, clock=time.perf_counter, sampled_drafts=True)
            if speculator.reads_hidden:  # mtp: the target's final hidden rows are its input
                lm.keep_hidden(getattr(proposer, "reads", "normed"))
        results = generate_batch(lm, batch, params, on_token if len(batch) == 1 else None, speculator)
        if decoder:
            stream.write(decoder.flush())
        for result in results if len(batch) > 1 else []:
            stream.write(tokenizer.decode(result.token_ids) if tokenizer else " ".join(map(str, result.token_ids)))
            stream.write("\n---")
        stream.write("\n")
    except ModelfleetError as exc:
        _fail(str(exc))
        return
    if as_json:
        out = _generate_json(results, tokenizer, lm, load_s)
        out["backend"] = lm.backend_info
        if lm.expert_placement:
            out["expert_placement"] = lm.expert_placement
        if speculator is not None:
            out["speculative"] = speculator.stats.as_dict()
        typer.echo(json.dumps(out))


def _generate_json(
    results: list[GenerationResult], tokenizer: TextTokenizer | None, lm: LocalModel, load_s: float
) -> dict[str, object]:
    """``generate --json``'s object: per-prompt fields as lists for a batch (plain values for one
    prompt), and the batch's timings with the aggregate decode rate."""
    from modelfleet.engine.generate import batch_decode_tokens_per_s

    per_prompt: dict[str, list[object]] = {
        "prompt_tokens": [r.prompt_tokens for r in results],
        "token_ids": [r.token_ids for r in results],
        "finish_reason": [r.finish_reason for r in results],
    }
    if tokenizer is not None:
        per_prompt["text"] = [tokenizer.decode(r.token_ids) for r in results]
    out: dict[str, object] = {k: v[0] for k, v in per_prompt.items()} if len(results) == 1 else dict(per_prompt)
    return out | {
        "prompts": len(results),
        "load_seconds": round(load_s, 4),
        "time_to_first_token_seconds": round(min(r.time_to_first_token_s for r in results), 6),
        "total_seconds": round(max(r.total_s for r in results), 6),
        "decode_tokens_per_second": round(batch_decode_tokens_per_s(results), 3),
        "weights_bytes": lm.weights_bytes,
        "bytes_by_role": lm.bytes_by_role,
    }


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
app.command("profile-bandwidth")(__import__("modelfleet.commands.profile", fromlist=["x"]).profile_bandwidth)
app.command()(__import__("modelfleet.commands.export", fromlist=["export"]).export)

if __name__ == "__main__":
    app()
