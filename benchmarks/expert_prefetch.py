"""Prefetch into the expert stores' slots (engine.expert_prefetch), per prefetch mode beside no
prefetch in the same run: tiny models of three families, teacher-forced on a successor task so
their routers mean something (tests/tiny.py, tests/dsv4_tiny.py), served capped so that about
--share of each layer's experts fit in slots, greedy decode of --tokens tokens after a 6-token
prompt. Per mode:

- the steps' slot hits and misses (misses are what the step fetches or computes on the CPU);
- prefetched experts, and how many of them the layer's next step used (precision);
- bytes copied: at step time (the step waits for them) and ahead (overlapping other work);
- the decode rate, and its ratio to no prefetch (meaningful on a GPU only: on a CPU the
  "device" slots are a stand-in and the copies are memory-to-memory).

The counts do not depend on timing: they are reproducible on a busy machine.

    python benchmarks/expert_prefetch.py --share 0.5 --out docs/results/expert_prefetch_cpu.csv
    python benchmarks/expert_prefetch.py --device cuda --dtype bfloat16 --q 1
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from modelfleet.results import write_csv

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tiny models' builders

FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v4")
PROMPT = [5, 17, 3, 99, 42, 7]


def trained(family: str, steps: int, where: Path) -> Path:
    from tiny import build_model, train_on_successors

    if family == "deepseek_v4":
        from dsv4_tiny import build

        model = build(seed=1)
        train_on_successors(model, steps, rows=8, length=12)
    else:
        model = build_model(family)
        train_on_successors(model, steps)
    path = where / family
    model.save_pretrained(path)
    return path


def device_cap(path: Path, device: str, dtype: str, share: float) -> int:
    """Device bytes that leave room for about ``share`` of the experts beside the plan's reserve."""
    from modelfleet.engine.expert_offload import moe_layers
    from modelfleet.engine.generate import LocalModel

    shard = LocalModel.load(path, device=device, dtype=dtype, max_slots=1).shards[0]
    banks = sum(m.bank_bytes for m in moe_layers(shard))
    return int((shard.weights_bytes - banks + shard.kv_bytes + share * banks) / 0.9) + 1


def run(path: Path, args: argparse.Namespace, cap: int, mode: str) -> dict[str, object]:
    from modelfleet.engine.expert_offload import StoreOptions
    from modelfleet.engine.expert_placement import ExpertPrefetch
    from modelfleet.engine.generate import LocalModel, generate
    from modelfleet.engine.sampling import SamplingParams

    options = StoreOptions(q=args.q, prefetch=ExpertPrefetch(mode), cpu_workers=args.cpu_workers)
    lm = LocalModel.load(path, device=args.device, dtype=args.dtype, max_slots=1, device_memory_bytes=cap,
                         store_options=options)  # fmt: skip
    result = generate(lm, PROMPT, SamplingParams(max_tokens=args.tokens, stop_token_ids=()))
    r = lm.expert_placement
    prefetched = int(r["prefetched"])  # type: ignore[call-overload]
    return {
        "mode": mode, "hits": r["hits"], "misses": r["misses"], "prefetched": prefetched,
        "prefetch_hits": r["prefetch_hits"],
        "precision": round(int(r["prefetch_hits"]) / prefetched, 3) if prefetched else "",  # type: ignore[call-overload]
        "fetch_bytes": r["fetch_bytes"], "prefetch_bytes": r["prefetch_bytes"], "cpu_bytes": r["cpu_bytes"],
        "q": r["q"], "decode_tok_s": round(result.decode_tokens_per_s, 2), "tokens": result.token_ids,
    }  # fmt: skip


def main() -> None:
    ask = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ask.add_argument("--families", default=",".join(FAMILIES))
    ask.add_argument("--train-steps", type=int, default=60)
    ask.add_argument("--share", type=float, default=0.5, help="share of each layer's experts that fits in slots")
    ask.add_argument("--tokens", type=int, default=32)
    ask.add_argument("--q", type=float, default=1.0, help="fetched share of step misses (default 1: all fetched)")
    ask.add_argument("--device", default="cpu")
    ask.add_argument("--dtype", default="float32")
    ask.add_argument("--cpu-workers", type=int, default=1)
    ask.add_argument("--out", type=Path, help="CSV of the table")
    args = ask.parse_args()
    torch.manual_seed(0)
    rows = []
    stand_in = torch.device(args.device).type == "cpu"
    with tempfile.TemporaryDirectory() as where:
        for family in args.families.split(","):
            path = trained(family, args.train_steps, Path(where))
            cap = device_cap(path, args.device, args.dtype, args.share)
            runs = [run(path, args, cap, mode) for mode in ("off", "exact", "predicted")]
            base, off_tokens = runs[0], runs[0]["tokens"]
            for r in runs:
                same = r.pop("tokens") == off_tokens
                rate = float(r["decode_tok_s"]) / max(float(base["decode_tok_s"]), 1e-9)  # type: ignore[arg-type]
                rows.append({"family": family, **r, "vs_off": round(rate, 3), "same_tokens": same})
    head = list(rows[0])
    print(f"# device {args.device}{' (stand-in: rates are not bandwidths)' if stand_in else ''}, dtype {args.dtype}, "
          f"share {args.share}, q {args.q}, {args.tokens} tokens")  # fmt: skip
    print(" | ".join(head))
    for row in rows:
        print(" | ".join(str(row[k]) for k in head))
    if args.out is not None:
        write_csv(args.out, rows, head)


if __name__ == "__main__":
    main()
