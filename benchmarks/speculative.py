"""Speculative decoding beside plain decoding, in one process, alternating, on the same prompts.

Prompts are the first ``--prompt-len`` tokens of the demo model's held-out standard-library files
(code: proposals are often right) and the same tokens shuffled (little to propose). For each
proposer and batch size, greedy decode tokens/s with and without speculation are timed in
alternating rounds (the median counts); beside them the acceptance, fallback trips, the widths
chosen, the tokens/s the width model E(k) / (D + V(k)) forecast from its own measurements (and
its ratio to the measured rate), the share of decode time spent proposing, and the issue's goal
for the row (2x at batch 1 on code, 0.95x on shuffled prompts, 1.3x at 8 streams on code).

One :class:`Speculator` per proposer and batch lives through the rounds, as it lives through a
server's requests (its step costs and acceptance carry over); the phrase table restarts each
round from what it learned on ``--phrase-files`` training files of the same corpus (never the
held-out ones), so no round proposes what an earlier round emitted. ``draft_model`` runs
``--draft`` (the demo model's draft) on the same device. Outputs must be identical to plain
decoding (greedy): a row whose tokens differ is flagged.

Writes ``speculative.csv`` and ``speculative.md`` (the table and the run's settings) to ``--out``.

    taskset -c 0,1 python benchmarks/speculative.py --threads 2 --out out/spec-cpu
    python benchmarks/speculative.py --device cuda --dtype bfloat16 --out out/spec-cuda
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import random
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch

from modelfleet.results import write_csv

DEMO = Path(__file__).resolve().parent.parent / "models" / "demo"
METHODS = ("ngram", "phrase", "hybrid", "draft_model")
GOALS = {("code", 1): 2.0, ("code", 8): 1.3}  # the goals; shuffled prompts: never below 0.95x
LOW_ACCEPTANCE_FLOOR = 0.95


def stdlib_files(names: list[str]) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return [root / name for name in names if (root / name).is_file()]


def code_prompts(tokenizer, count: int, length: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
    names = (DEMO / "heldout_files.txt").read_text().split()
    prompts = []
    for path in stdlib_files(names):
        ids = tokenizer.encode(path.read_text(errors="replace"))
        if len(ids) >= length:
            prompts.append(ids[:length])
        if len(prompts) == count:
            break
    return prompts


def shuffled(prompts: list[list[int]]) -> list[list[int]]:
    rng = random.Random(0)
    return [rng.sample(p, len(p)) for p in prompts]


def phrase_table(tokenizer, files: int):  # type: ignore[no-untyped-def]
    """A phrase table learned from ``files`` training files spread over the corpus (the held-out
    ones excluded), as ``modelfleet phrases learn`` would build it."""
    from modelfleet.engine.speculative.proposers import PhraseTable

    heldout = set((DEMO / "heldout_files.txt").read_text().split())
    root = Path(sysconfig.get_paths()["stdlib"])
    training = [p for p in sorted(root.rglob("*.py")) if str(p.relative_to(root)) not in heldout]
    table = PhraseTable()
    for path in training[:: max(1, len(training) // max(files, 1))][:files]:
        table.learn(tokenizer.encode(path.read_text(errors="replace")))
    return table


def timed(lm, prompts, tokens: int, speculator=None):  # type: ignore[no-untyped-def]
    """Aggregate decode tokens/s (each stream's first token excluded) and the token ids."""
    from modelfleet.engine.generate import generate_batch
    from modelfleet.engine.sampling import SamplingParams

    if lm.shards[0].device.type == "cuda":
        torch.cuda.synchronize()
    results = generate_batch(lm, prompts, SamplingParams(max_tokens=tokens, stop_token_ids=()), speculator=speculator)
    decode_s = max(r.total_s for r in results) - max(r.time_to_first_token_s for r in results)
    decoded = sum(len(r.token_ids) - 1 for r in results)
    return decoded / decode_s, decode_s, [r.token_ids for r in results]


def measure(lm, prompts, method: str, table, args) -> dict[str, object]:  # type: ignore[no-untyped-def]
    from modelfleet.engine.speculative.build import build_proposer
    from modelfleet.engine.speculative.config import SpeculativeConfig
    from modelfleet.engine.speculative.proposers import HybridProposer, PhraseTable
    from modelfleet.engine.speculative.speculator import SpeculationStats, Speculator

    draft = str(args.draft) if method == "draft_model" else None
    config = SpeculativeConfig(method, num_speculative_tokens=args.k, model=draft)
    speculator = Speculator(config, build_proposer(config, args.model, len(prompts), args.device),
                            clock=time.perf_counter)  # fmt: skip

    def restart_phrases() -> None:
        """Each round starts from the trained table (it must not learn the earlier rounds' output)."""
        if isinstance(speculator.proposer, PhraseTable):
            speculator.proposer = copy.deepcopy(table)
        elif isinstance(speculator.proposer, HybridProposer):
            speculator.proposer.phrases = copy.deepcopy(table)

    plain_rates, spec_rates, same, proposing_share = [], [], True, []
    timed(lm, prompts, 8)  # warm-up: plain, then a speculative run (its shapes, its draft)
    restart_phrases()
    timed(lm, prompts, 8, speculator)
    for _ in range(args.rounds):
        rate, _, plain = timed(lm, prompts, args.tokens)
        plain_rates.append(rate)
        restart_phrases()
        speculator.fallbacks.clear()
        speculator.stats = SpeculationStats(method)
        rate, decode_s, spec = timed(lm, prompts, args.tokens, speculator)
        spec_rates.append(rate)
        proposing_share.append(speculator.stats.proposing_seconds / decode_s)
        same = same and spec == plain
    stats = speculator.stats  # the last round's
    plain_rate, spec_rate = statistics.median(plain_rates), statistics.median(spec_rates)
    predicted = stats.predicted_tokens_per_second
    return {
        "method": method, "plain_tok_s": round(plain_rate, 1), "speculative_tok_s": round(spec_rate, 1),
        "speedup": round(spec_rate / plain_rate, 3), "acceptance": round(stats.acceptance_rate, 3),
        "drafted": stats.drafted, "fallback_trips": stats.fallback_trips,
        "widths": " ".join(f"{k}:{v}" for k, v in sorted(stats.widths.items())),
        "predicted_tok_s": round(predicted, 1), "predicted/measured": round(predicted / spec_rates[-1], 2),
        "proposing_share": round(statistics.median(proposing_share), 3), "same_tokens": same,
    }  # fmt: skip


def goal(kind: str, batch: int) -> float | None:
    return LOW_ACCEPTANCE_FLOOR if kind == "shuffled" else GOALS.get((kind, batch))


def markdown(rows: list[dict[str, object]], title: str, settings: str) -> str:
    names = list(rows[0])
    lines = [f"# {title}", "", settings, "", "| " + " | ".join(names) + " |", "|" + "---|" * len(names)]
    lines += ["| " + " | ".join(str(row[n]) for n in names) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEMO)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--batch", default="1,8", help="comma-separated concurrent streams")
    parser.add_argument("--tokens", type=int, default=128, help="tokens generated per stream")
    parser.add_argument("--prompt-len", type=int, default=192)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--rounds", type=int, default=3, help="alternating timed rounds; the median counts")
    parser.add_argument("--phrase-files", type=int, default=300, help="training files the phrase table learns")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--draft", type=Path, default=DEMO / "draft", help="draft_model's checkpoint")
    parser.add_argument("--out", type=Path, default=Path("out/speculative"), help="folder for the CSV and markdown")
    args = parser.parse_args()

    from modelfleet.engine.generate import LocalModel
    from modelfleet.engine.tokenizer import TextTokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    started = time.perf_counter()
    batches = [int(b) for b in args.batch.split(",")]
    tokenizer = TextTokenizer(args.model)
    code = code_prompts(tokenizer, max(batches), args.prompt_len)
    table = phrase_table(tokenizer, args.phrase_files)
    lm = LocalModel.load(args.model, device=args.device, dtype=args.dtype, max_slots=max(batches))
    rows: list[dict[str, object]] = []
    for batch in batches:
        for kind, prompts in (("code", code[:batch]), ("shuffled", shuffled(code[:batch]))):
            for method in args.methods.split(","):
                row = {"batch": batch, "prompts": kind, **measure(lm, prompts, method, table, args)}
                target = goal(kind, batch)
                row["goal"] = "" if target is None else f">= {target}x"
                row["met"] = "" if target is None else str(float(str(row["speedup"])) >= target)
                rows.append(row)
                print(row, file=sys.stderr, flush=True)
                text = write(rows, args, table, started)  # after every row: a run cut short keeps its rows
    print(text)
    print(f"wrote {args.out}/speculative.csv and speculative.md", file=sys.stderr)


def write(rows: list[dict[str, object]], args: argparse.Namespace, table, started: float) -> str:  # type: ignore[no-untyped-def]
    title = f"speculative decoding, {args.model.name}, {args.device} {args.dtype}, k={args.k}"
    settings = (
        f"`{' '.join(sys.argv)}`; torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{platform.processor() or platform.machine()}, affinity {sorted(os.sched_getaffinity(0))}, "
        f"{len(table.counts)} phrases from {args.phrase_files} training files; "
        f"{args.tokens} tokens per stream, {args.rounds} rounds, {time.perf_counter() - started:.0f} s so far"
    )
    if args.device.startswith("cuda"):
        settings += f"; {torch.cuda.get_device_name()}"
    write_csv(args.out / "speculative.csv", rows)
    text = markdown(rows, title, settings)
    (args.out / "speculative.md").write_text(text)
    return text


if __name__ == "__main__":
    main()
