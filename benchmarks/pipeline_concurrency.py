"""Concurrency sweep of a local pipeline fleet, measured as seed 000 (Cascadia) measures it.

For each concurrency level a cohort of requests arrives ~15 ms apart, each generating a fixed
number of tokens greedily. With f_i and l_i the first and last token times of request i, the
cohort's common decode interval is (a, b] = (max_i f_i, min_i l_i], u the tokens all requests
emitted inside it, and (Eq. 4 of the paper)

    Q_decode = sum_j u_j / sum_j (b_j - a_j)        Q_phase = sum_i n_i / (t_end - t_start)

Beside them: TTFT median and p95, each stage's busy share (compute seconds / wall seconds, from
its /metrics), and the single-process engine's throughput at the same concurrency, in the same
run. Writes CSV and a PNG (throughput and busy share against concurrency, like the paper's
Figure 5).

    python benchmarks/pipeline_concurrency.py --stages 4 --levels 1,2,4,8,16,32,64
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from modelfleet.results import write_csv

SHAPE = dict(
    hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
    moe_intermediate_size=256, num_experts=32, num_experts_per_tok=4, intermediate_size=1024, vocab_size=8192,
    max_position_embeddings=4096, norm_topk_prob=True, tie_word_embeddings=False,
)  # fmt: skip


def build_model(path: Path) -> Path:
    """A random Qwen3-MoE of ~0.14B parameters (offline), saved once."""
    if (path / "config.json").is_file():
        return path
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", **SHAPE), dtype=torch.float32)
    model.save_pretrained(path)
    return path


def busy_seconds(plan, stage: int) -> float:  # type: ignore[no-untyped-def]
    s = plan.groups[0].stages[stage]
    text = urllib.request.urlopen(f"http://{s.host}:{s.http_port}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("modelfleet_stage_compute_seconds_total{"))  # fmt: skip


def run_cohort(client, prompts: list[list[int]], tokens: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
    from modelfleet.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=tokens, stop_token_ids=())
    start = time.perf_counter()
    ids = []
    for prompt in prompts:
        ids.append(client.submit(prompt, params))
        time.sleep(0.015)
    results = client.wait(ids)
    end = time.perf_counter()
    firsts = [r.token_times[0] for r in results]
    lasts = [r.token_times[-1] for r in results]
    a, b = max(firsts), min(lasts)
    u = sum(1 for r in results for t in r.token_times if a < t <= b)
    ttft = sorted(r.token_times[0] - r.submitted_at for r in results)
    return {
        "q_decode": u / (b - a) if b > a else float("nan"),
        "q_phase": sum(len(r.token_ids) for r in results) / (end - start),
        "ttft_median_s": statistics.median(ttft),
        "ttft_p95_s": ttft[min(len(ttft) - 1, int(0.95 * len(ttft)))],
        "wall_s": end - start,
    }


def engine_rate(model_dir: Path, prompts: list[list[int]], tokens: int, dtype: str) -> float:
    from modelfleet.engine.generate import LocalModel, generate_batch
    from modelfleet.engine.sampling import SamplingParams

    lm = LocalModel.load(model_dir, max_slots=len(prompts), max_context=len(prompts[0]) + tokens + 8, dtype=dtype)
    start = time.perf_counter()
    results = generate_batch(lm, prompts, SamplingParams(max_tokens=tokens, stop_token_ids=()))
    return sum(len(r.token_ids) for r in results) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="checkpoint (default: a random ~0.14B Qwen3-MoE)")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--levels", default="1,2,4,8,16,32,64")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--base-port", type=int, default=27500)
    parser.add_argument("--no-engine", action="store_true", help="skip the single-process comparison")
    parser.add_argument("--out", default="out/pipeline_concurrency.csv")
    args = parser.parse_args()

    from rich.console import Console
    from rich.table import Table

    from modelfleet.agent.client import FleetClient
    from modelfleet.agent.launcher import LocalFleet, check_ports
    from modelfleet.commands.fleet import make_plan

    console = Console()
    levels = [int(x) for x in args.levels.split(",")]
    model_dir = args.model or build_model(Path("out/bench-qwen3-moe"))
    plan = make_plan(model_dir, args.stages, max_streams=max(levels), context_length=args.prompt_len + args.tokens + 8,
                     dtype=args.dtype, base_port=args.base_port)  # fmt: skip
    check_ports(plan)
    workdir = Path(tempfile.mkdtemp(prefix="mf-bench-"))
    plan_path = workdir / "plan.json"
    plan_path.write_text(plan.to_json())
    log = (workdir / "fleet.log").open("w")
    fleet = LocalFleet(plan, plan_path, out=log)
    threads = max(1, (os.cpu_count() or 2) // args.stages)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    fleet.start()
    rows = []
    try:
        fleet.wait_ready(600)
        rng = random.Random(0)
        vocab = SHAPE["vocab_size"] if args.model is None else 1000
        with FleetClient(plan.groups[0].stages[0].address, timeout_seconds=3600) as client:
            run_cohort(client, [[rng.randrange(vocab) for _ in range(args.prompt_len)]], 8)  # warm-up
            for level in levels:
                prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(level)]
                busy_before = [busy_seconds(plan, s) for s in range(args.stages)]
                stats = run_cohort(client, prompts, args.tokens)
                busy = [(busy_seconds(plan, s) - b) / stats["wall_s"] for s, b in enumerate(busy_before)]
                os.environ["OMP_NUM_THREADS"] = str(os.cpu_count() or 2)
                engine = float("nan") if args.no_engine else engine_rate(model_dir, prompts, args.tokens, args.dtype)
                rows.append({"streams": level, **{k: round(v, 4) for k, v in stats.items()},
                             "engine_tok_s": round(engine, 2),
                             **{f"stage{s}_busy": round(b, 3) for s, b in enumerate(busy)}})  # fmt: skip
                console.print(rows[-1])
    finally:
        fleet.stop()
        log.close()

    table = Table(title=f"pipeline of {args.stages} stages, {args.tokens} tokens per request ({args.dtype})")
    for col in ("streams", "Q_decode", "Q_phase", "engine", "TTFT p50", "TTFT p95", "busy per stage"):
        table.add_column(col, justify="right")
    for r in rows:
        busy = " ".join(f"{r[f'stage{s}_busy']:.0%}" for s in range(args.stages))
        table.add_row(str(r["streams"]), f"{r['q_decode']:.1f}", f"{r['q_phase']:.1f}", f"{r['engine_tok_s']:.1f}",
                      f"{r['ttft_median_s']:.2f}s", f"{r['ttft_p95_s']:.2f}s", busy)  # fmt: skip
    console.print(table)
    console.print("Q_decode, Q_phase: Eq. 4 of seed 000 (tokens/s); engine: one process, same prompts, tokens/s")
    out = write_csv(Path(args.out), rows)
    plot(rows, args.stages, out.with_suffix(".png"))
    console.print(f"wrote {out} and {out.with_suffix('.png')}")


def plot(rows: list[dict], stages: int, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG", file=sys.stderr)
        return
    streams = [r["streams"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(streams, [r["q_decode"] for r in rows], "o-", label="Q_decode (fleet)")
    left.plot(streams, [r["q_phase"] for r in rows], "s-", label="Q_phase (fleet)")
    left.plot(streams, [r["engine_tok_s"] for r in rows], "^--", label="single process")
    left.set(xscale="log", xlabel="concurrent streams", ylabel="tokens/s", title="throughput")
    left.legend()
    for s in range(stages):
        right.plot(streams, [r[f"stage{s}_busy"] for r in rows], "o-", label=f"stage {s}")
    right.axhline(0.8, color="grey", linestyle=":")
    right.set(xscale="log", xlabel="concurrent streams", ylabel="busy share", ylim=(0, 1.05), title="stage busy share")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
