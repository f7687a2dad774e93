"""Where a decode step's GPU time goes: the top kernels of one fixed-shape step, by CUDA time.

python benchmarks/profile_decode.py --shape qwen3-30b-a3b --layers 12 --batch 1
"""

from __future__ import annotations

import argparse

import torch
from engine_decode import SHAPES, build_reference
from torch.profiler import ProfilerActivity, profile

from modelfleet.engine.checkpoint import TensorDict
from modelfleet.engine.frame import Frame
from modelfleet.engine.shard import Shard
from modelfleet.engine.spec import spec_from_config
from modelfleet.engine.static_decode import StaticDecoder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=12, help="decoder layers")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rows", type=int, default=30)
    args = parser.parse_args()
    ref = build_reference(args.shape, args.layers, torch.bfloat16, "cuda")
    spec = spec_from_config(ref.config.to_dict())
    shard = Shard.from_checkpoint(spec, TensorDict(ref.state_dict()), device="cuda", dtype=torch.bfloat16)
    del ref
    shard.allocate_cache(args.batch, 256)
    for slot in range(args.batch):
        shard(Frame.of_streams([(slot, 0, list(range(16)))]))
    eager = StaticDecoder([shard], args.batch, use_graph=False)
    slots = list(range(args.batch))
    pos = 16
    for _ in range(3):
        eager.step([5] * args.batch, slots, [pos] * args.batch)
        pos += 1
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            eager.step([5] * args.batch, slots, [pos] * args.batch)
            pos += 1
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows))
    graphed = StaticDecoder([shard], args.batch, use_graph=True)
    graphed.step([5] * args.batch, slots, [pos] * args.batch)
    pos += 1
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(20):
        graphed.step([5] * args.batch, slots, [pos] * args.batch)
        pos += 1
    end.record()
    torch.cuda.synchronize()
    print(f"graphed step: {start.elapsed_time(end) / 20:.3f} ms")


if __name__ == "__main__":
    main()
