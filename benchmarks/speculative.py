"""Speculative decoding beside plain decoding, in one process, alternating, on the same prompts.

Prompts are the first ``--prompt-len`` tokens of the demo model's held-out standard-library files
(code: proposals are often right) and the same tokens shuffled (little to propose). For each
proposer and batch size, greedy decode tokens/s with and without speculation are timed in
alternating rounds (the median counts); beside them the acceptance, fallback trips, the widths
chosen and the tokens/s the width model E(k) / (D + V(k)) forecast from its own measurements.
The phrase table starts from what it learns on ``--phrase-files`` training files of the same
corpus (never the held-out ones); ``draft_model`` runs ``--draft`` (the demo model's draft). Outputs must be identical to plain decoding (greedy): a row
whose tokens differ is flagged.

    python benchmarks/speculative.py --batch 1,8
    python benchmarks/speculative.py --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import copy
import csv
import random
import statistics
import sys
import sysconfig
from pathlib import Path

import torch

DEMO = Path(__file__).resolve().parent.parent / "models" / "demo"
METHODS = ("ngram", "phrase", "hybrid", "draft_model")


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
    """A phrase table learned from training files (the held-out ones excluded)."""
    from modelfleet.engine.speculative.proposers import PhraseTable

    heldout = set((DEMO / "heldout_files.txt").read_text().split())
    root = Path(sysconfig.get_paths()["stdlib"])
    table = PhraseTable()
    for path in sorted(root.glob("*.py"))[: files * 2]:
        if str(path.relative_to(root)) not in heldout:
            table.learn(tokenizer.encode(path.read_text(errors="replace")))
    return table


def timed(lm, prompts, tokens: int, speculator=None):  # type: ignore[no-untyped-def]
    """Aggregate decode tokens/s (first token excluded) and the token ids."""
    from modelfleet.engine.generate import generate_batch
    from modelfleet.engine.sampling import SamplingParams

    results = generate_batch(lm, prompts, SamplingParams(max_tokens=tokens, stop_token_ids=()), speculator=speculator)
    decode_s = max(r.total_s for r in results) - max(r.time_to_first_token_s for r in results)
    decoded = sum(len(r.token_ids) - 1 for r in results)
    return decoded / decode_s, [r.token_ids for r in results]


def measure(lm, prompts, method: str, table, args) -> dict[str, object]:  # type: ignore[no-untyped-def]
    from modelfleet.engine.speculative.build import build_proposer
    from modelfleet.engine.speculative.config import SpeculativeConfig
    from modelfleet.engine.speculative.proposers import HybridProposer
    from modelfleet.engine.speculative.speculator import Speculator

    draft = str(args.draft) if method == "draft_model" else None
    config = SpeculativeConfig(method, num_speculative_tokens=args.k, model=draft)

    def fresh_proposer():  # type: ignore[no-untyped-def]
        """Each round starts from the trained table (it must not learn the earlier rounds' output)."""
        proposer = build_proposer(config, args.model, len(prompts), args.device)
        if method == "phrase":
            return copy.deepcopy(table)
        if isinstance(proposer, HybridProposer):
            proposer.phrases = copy.deepcopy(table)
        return proposer

    plain_rates, spec_rates, speculator, same = [], [], None, True
    timed(lm, prompts, 8)  # warm-up
    for _ in range(args.rounds):
        rate, plain = timed(lm, prompts, args.tokens)
        plain_rates.append(rate)
        speculator = Speculator(config, fresh_proposer())
        rate, spec = timed(lm, prompts, args.tokens, speculator)
        spec_rates.append(rate)
        same = same and spec == plain
    assert speculator is not None
    stats = speculator.stats
    plain_rate, spec_rate = statistics.median(plain_rates), statistics.median(spec_rates)
    return {
        "method": method, "plain_tok_s": round(plain_rate, 1), "speculative_tok_s": round(spec_rate, 1),
        "speedup": round(spec_rate / plain_rate, 3), "acceptance": round(stats.acceptance_rate, 3),
        "drafted": stats.drafted, "fallback_trips": stats.fallback_trips,
        "widths": " ".join(f"{k}:{v}" for k, v in sorted(stats.widths.items())),
        "predicted_tok_s": round(stats.predicted_tokens_per_second, 1), "same_tokens": same,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEMO)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", default="1,8", help="comma-separated concurrent streams")
    parser.add_argument("--tokens", type=int, default=128, help="tokens generated per stream")
    parser.add_argument("--prompt-len", type=int, default=192)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--rounds", type=int, default=3, help="alternating timed rounds; the median counts")
    parser.add_argument("--phrase-files", type=int, default=40)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--draft", type=Path, default=DEMO / "draft", help="draft_model's checkpoint")
    parser.add_argument("--out", default="out/speculative.csv")
    args = parser.parse_args()

    from rich.console import Console
    from rich.table import Table

    from modelfleet.engine.generate import LocalModel
    from modelfleet.engine.tokenizer import TextTokenizer

    torch.manual_seed(0)
    batches = [int(b) for b in args.batch.split(",")]
    tokenizer = TextTokenizer(args.model)
    code = code_prompts(tokenizer, max(batches), args.prompt_len)
    table = phrase_table(tokenizer, args.phrase_files)
    lm = LocalModel.load(args.model, device=args.device, dtype=args.dtype, max_slots=max(batches))
    rows = []
    for batch in batches:
        for kind, prompts in (("code", code[:batch]), ("shuffled", shuffled(code[:batch]))):
            for method in args.methods.split(","):
                rows.append({"batch": batch, "prompts": kind, **measure(lm, prompts, method, table, args)})
    view = Table(title=f"speculative decoding, {args.model.name}, {args.device} {args.dtype}, k={args.k}")
    for name in rows[0]:
        view.add_column(name)
    for row in rows:
        view.add_row(*(str(v) for v in row.values()))
    Console().print(view)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
