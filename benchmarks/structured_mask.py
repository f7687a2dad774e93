"""What a grammar costs per token at the tail: xgrammar's mask (fill the bitmask, apply it, accept
the token) beside the tail's own sampling of the same row, measured in the same run.

For each spec (a bounded JSON schema, any JSON object, a forced tool call) streams are sampled
from random logits with the mask until the grammar ends, again and again, for ``--tokens``
tokens; the peer is the same sampler (temperature 1, top-k 50) without a grammar on the same rows.

    python benchmarks/structured_mask.py --tokens 2000 --out out/structured_mask.csv
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from modelfleet.engine.sampling import SamplingParams, StreamSampler
from modelfleet.engine.spec import load_spec
from modelfleet.engine.structured import Grammars, spec_text
from modelfleet.results import write_csv

REPO = Path(__file__).resolve().parents[1]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
}
TOOL = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}}, "required": ["city"]}


def specs() -> dict[str, str]:
    from modelfleet.engine.structured import load_xgrammar

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": TOOL}}]
    tag = load_xgrammar().get_model_structural_tag(
        "qwen_3", tools=tools, tool_choice="required", reasoning="disabled", max_whitespace_cnt=2
    )
    return {
        "json_schema": spec_text({"type": "json_schema", "schema": PERSON, "strict": True}),
        "json_object": spec_text({"type": "json_object"}),
        "tool_call": spec_text(tag.model_dump(mode="json")),
    }


def per_token_us(grammars: Grammars | None, spec: str | None, vocab: int, tokens: int, stop: int) -> float:
    """Microseconds per sampled token, restarting the stream whenever its grammar ends."""
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(256, vocab, generator=generator) * 3
    params = SamplingParams(temperature=1.0, top_k=50, seed=0, stop_token_ids=(stop,), grammar=spec)
    sampler = StreamSampler(
        params, (stop,), grammar=None if spec is None or grammars is None else grammars.state(spec, (stop,))
    )
    start = time.perf_counter()
    for i in range(tokens):
        token = sampler.sample(rows[i % len(rows)])
        if sampler.grammar is not None and (token == stop or sampler.grammar.ended):
            sampler = StreamSampler(params, (stop,), grammar=grammars.state(spec, (stop,)))  # type: ignore[arg-type,union-attr]
    return (time.perf_counter() - start) / tokens * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=REPO / "models" / "demo")
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    spec = load_spec(args.model)
    grammars = Grammars(args.model, spec.vocab_size)
    stop = spec.eos_token_ids[0]
    plain = per_token_us(None, None, spec.vocab_size, args.tokens, stop)
    rows = []
    print(f"vocabulary {spec.vocab_size}; sampling alone (the peer): {plain:.1f} us/token")
    print(f"{'grammar':<12} {'sample+mask us':>15} {'mask us':>9} {'mask / sampling':>16}")
    for name, text in specs().items():
        grammars.compile(text)  # compiled once, as the tail's cache would have it
        masked = per_token_us(grammars, text, spec.vocab_size, args.tokens, stop)
        rows.append({"grammar": name, "vocab": spec.vocab_size, "sample_us": round(plain, 2),
                     "sample_masked_us": round(masked, 2), "mask_us": round(masked - plain, 2),
                     "mask_over_sampling": round((masked - plain) / plain, 3)})  # fmt: skip
        print(f"{name:<12} {masked:>15.1f} {masked - plain:>9.1f} {(masked - plain) / plain:>16.2f}")
    if args.out is not None:
        write_csv(args.out, rows)
        print(json.dumps({"csv": str(args.out)}))


if __name__ == "__main__":
    main()
