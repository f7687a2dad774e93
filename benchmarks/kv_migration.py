"""KV migration against recompute (issue 34, item 4): what a replacement stage costs to fill.

A stage drained on purpose (a rollout, a scale-down) can hand each slot's state to its
replacement (the backend's per-slot ``export_slot``/``import_slot``), or the replacement can
recompute it: the head replays prompt + output through the stage (:mod:`modelfleet.engine.scheduler`,
``resume``). This program measures both for one stage of a Qwen3-MoE model, per context length:

- **recompute**: the stage's forward over the stream's rows in prefill windows of ``--window``
  rows (the fleet's ``serving.windowRows``), the rows a replay sends;
- **migrate**: ``export_slot`` + the state as ``slot_state`` messages (one per layer: encoded,
  through a ZeroMQ socket over loopback, decoded with the wire's checks) + ``import_slot``; and
  the same with the wire time at least the bytes at a link's line rate (``--links``, Gbit/s).

It prints recompute / migrate (a ratio over 1: migration wins) and writes CSV. The stage is built
from a random checkpoint of the shape given (default: one layer shaped as Qwen3-30B-A3B's: hidden
2048, 4 KV heads of 128, 128 experts of 768, top 8), so the figures are a layer's, on this
machine's device. The cache is sized to the context measured, so the exported state is the
stream's own rows (``export_slot`` copies a slot's whole capacity).

    python benchmarks/kv_migration.py --contexts 512 2048 8192 --device cpu
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import zmq

from modelfleet.agent import transport as wire
from modelfleet.engine.frame import Frame
from modelfleet.engine.kvcache import SlotState
from modelfleet.engine.shard import Shard
from modelfleet.results import write_csv


def build_checkpoint(path: Path, args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=4096, hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=args.head_dim, intermediate_size=4 * args.hidden,
        moe_intermediate_size=args.moe_intermediate, num_experts=args.experts, num_experts_per_tok=args.top_k,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=max(args.contexts),
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)


def recompute_seconds(shard: Shard, tokens: list[int], window: int, sync: object) -> float:
    """The stage's forward over ``tokens`` in windows of ``window`` rows, as a replay sends them."""
    shard.release(0)
    started = time.perf_counter()
    for start in range(0, len(tokens), window):
        shard(Frame.of_streams([(0, start, tokens[start : start + window])]))
    sync()  # type: ignore[operator]
    return time.perf_counter() - started


def state_bytes(state: SlotState) -> int:
    return sum(t.numel() * t.element_size() for layer in state.layers for t in layer.values())


def migrate_seconds(shard: Shard, sync: object) -> tuple[float, float, float, int]:
    """(export, wire, import) seconds and the bytes moved, from slot 0 to slot 1 (as from one
    stage to its replacement): export_slot, then the slot_state messages (one per layer) encoded,
    through a ZeroMQ socket over loopback and decoded, then import_slot."""
    started = time.perf_counter()
    state = shard.export_slot(0)
    exported = time.perf_counter()
    context = zmq.Context()
    push, pull = context.socket(zmq.PUSH), context.socket(zmq.PULL)
    wire.limit_message_bytes(pull)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push.connect(f"tcp://127.0.0.1:{port}")
    wire.send(push, wire.ReleaseMsg(slots=(0,)))  # the connection is made before the clock starts
    wire.recv(pull)
    sent = time.perf_counter()
    messages = wire.slot_state_messages(0, state)
    for message in messages:
        wire.send(push, message)
    received = [wire.recv(pull) for _ in messages]
    arrived = wire.slot_state_of(received)  # type: ignore[arg-type]
    moved = time.perf_counter()
    shard.import_slot(1, arrived)
    sync()  # type: ignore[operator]
    imported = time.perf_counter()
    push.close(0)
    pull.close(0)
    context.term()
    return exported - started, moved - sent, imported - moved, state_bytes(state)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--window", type=int, default=8, help="prefill rows per frame (serving.windowRows)")
    parser.add_argument("--links", type=float, nargs="+", default=[1.0, 10.0, 100.0], help="Gbit/s")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--moe-intermediate", type=int, default=768)
    parser.add_argument("--model", type=Path, default=None, help="a checkpoint instead of the random one")
    parser.add_argument("--csv", type=Path, default=Path("docs/results/kv_migration.csv"))
    args = parser.parse_args()

    path = args.model
    if path is None:
        path = Path(tempfile.mkdtemp(prefix="kv-migration-")) / "model"
        build_checkpoint(path, args)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    rows = []
    shard = Shard.load(path, device=args.device, dtype=dtype)
    for context in args.contexts:
        shard.allocate_cache(max_slots=2, max_context=context)
        tokens = torch.randint(3, shard.spec.vocab_size, (context,), generator=torch.Generator().manual_seed(1))
        ids = tokens.tolist()
        with torch.inference_mode():
            recompute_seconds(shard, ids[: 4 * args.window], args.window, sync)  # warm up
            recompute = statistics.median(recompute_seconds(shard, ids, args.window, sync) for _ in range(args.repeats))
            moves = [migrate_seconds(shard, sync) for _ in range(args.repeats)]
        export, loopback, imported = (statistics.median(m[i] for m in moves) for i in range(3))
        moved = moves[0][3]
        row: dict[str, object] = {
            "device": args.device, "layers": shard.layer_end - shard.layer_start, "context": context,
            "window": args.window, "state_mib": round(moved / 2**20, 2), "recompute_s": round(recompute, 4),
            "export_s": round(export, 4), "wire_loopback_s": round(loopback, 4), "import_s": round(imported, 4),
            "migrate_loopback_s": round(export + loopback + imported, 4),
            "recompute_over_migrate_loopback": round(recompute / (export + loopback + imported), 2),
        }  # fmt: skip
        for gbit in args.links:
            wire_seconds = max(loopback, moved * 8 / (gbit * 1e9))  # the line rate, or the codec when slower
            row[f"recompute_over_migrate_{gbit:g}gbit"] = round(recompute / (export + wire_seconds + imported), 2)
        rows.append(row)
        print("  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    write_csv(args.csv, rows)
    print(f"ratios over 1: migration wins; written to {args.csv}")


if __name__ == "__main__":
    main()
