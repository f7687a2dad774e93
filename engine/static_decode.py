"""Decode steps with fixed shapes, replayed from a CUDA graph on GPUs.

A decode step of B streams (one row each) has the same shapes every time: token ids, slots and
positions live in device buffers, attention reads each row's slot in place (on CUDA one fused
kernel per layer, :mod:`.kernels.decode_attention`; elsewhere the slot's whole KV capacity under a
visibility mask), and experts are gathered rather than grouped, so the step has no host
synchronisation: experts run pair by pair (few pairs) or grouped by expert on the device
(:mod:`.kernels.grouped_moe`). On CUDA the step is captured once per bucket of batch sizes
(:data:`GRAPH_BUCKETS`) and replayed, which removes the per-kernel launch cost that dominates
small-batch decode. On CPU the same code runs eagerly, which is how its equivalence with the
general frame path is tested.

A batch smaller than its bucket is padded: padded row i repeats real row i's token, slot and
position and is marked invalid (``FrameContext.valid``), so its cache write changes nothing
(:func:`~.layers.write_static_decode`) and its logits are dropped. Rows never mix (every layer
is row-wise but attention, which reads only the row's own slot), so real rows are unchanged.

Invariants: every shard is on the same device; the slot tables are checked before a step and
advanced after it, exactly as a general frame would.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .errors import InputError
from .frame import Segment
from .layers import FrameContext
from .quantize import QuantizedExperts
from .shard import Shard
from .tensor_parallel import is_split

GRAPH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # batch sizes captured; a batch pads to the next one
MAX_GRAPH_BATCH = GRAPH_BUCKETS[-1]


def bucket_pads(bucket: int) -> bool:
    """Whether some batch pads to ``bucket`` (1 and 2 hold only their own size: no masking needed)."""
    smaller = [b for b in GRAPH_BUCKETS if b < bucket]
    return bool(smaller) and bucket - smaller[-1] > 1


def graph_bucket(batch: int) -> int:
    """The captured batch size a decode step of ``batch`` rows pads to."""
    if not 1 <= batch <= MAX_GRAPH_BATCH:
        raise InputError(f"a static decode step takes 1 to {MAX_GRAPH_BATCH} rows, got {batch}")
    return next(b for b in GRAPH_BUCKETS if b >= batch)


def supports_static_decode(shards: Sequence[Shard]) -> bool:
    """One device, attention that runs static frames (grouped-query or latent), no tensor-parallel split (a split layer's all-reduces
    are not captured in graphs yet) and, on CUDA, every quantized expert bank in a format with a
    gathered kernel (the grouped path synchronises with the host, which a graph cannot hold).
    Quantized projections run their formats' kernels, which capture as they are."""
    devices = {shard.device for shard in shards}
    attentions = [layer.attention for shard in shards for layer in shard.layers]
    banks = [m for shard in shards for m in shard.modules() if isinstance(m, QuantizedExperts)]
    eager = all(device.type == "cpu" for device in devices)
    split = any(is_split(shard) for shard in shards)
    return (
        len(devices) == 1
        and all(getattr(a, "static_decode", False) for a in attentions)
        and not split
        and (eager or all(bank.gathered_on(bank.gate_up.device) for bank in banks))
    )


class StaticDecoder:
    def __init__(self, shards: Sequence[Shard], batch: int, use_graph: bool | None = None):
        if not supports_static_decode(shards):
            raise InputError("static decode needs every shard on one device and grouped-query or latent attention")
        self.shards = list(shards)
        self.batch = batch
        device = self.shards[0].device
        self.use_graph = device.type == "cuda" if use_graph is None else use_graph
        # rows: token ids, slots, positions, 1 for a real row; one host-to-device copy per step from pinned memory
        self.host = torch.zeros((4, batch), dtype=torch.int64, pin_memory=device.type == "cuda")
        self.inputs = torch.zeros((4, batch), dtype=torch.int64, device=device)
        self.tokens, self.slots, self.positions = self.inputs[0], self.inputs[1], self.inputs[2]
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None

    @torch.inference_mode()
    def _compute(self) -> torch.Tensor:
        valid = self.inputs[3] != 0 if bucket_pads(self.batch) else None
        ctx = FrameContext(None, self.positions, self.slots, token_ids=self.tokens, valid=valid)
        x = self.shards[0].residual_of(self.tokens)
        for i, shard in enumerate(self.shards):
            if i > 0:  # the residual crosses a shard boundary in float32, as between machines
                x = x.to(torch.float32).to(shard.dtype)
            x = shard.run_layers(x, ctx)
        return self.shards[-1].output(x)

    def step(self, tokens: Sequence[int], slots: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        """Logits [n, vocab] float32 for one decode row per stream, n <= the decoder's batch."""
        n = len(tokens)
        if not len(slots) == len(positions) == n or not 2 * n > self.batch >= n:
            raise InputError(f"a static decode step of {self.batch} rows takes {self.batch // 2 + 1} to {self.batch}")
        vocab = self.shards[0].spec.vocab_size
        if any(not 0 <= t < vocab for t in tokens):
            raise InputError(f"a token id is outside the vocabulary [0, {vocab})")
        segments = [Segment(s, r, r + 1, p) for r, (s, p) in enumerate(zip(slots, positions, strict=True))]
        for shard in self.shards:
            shard.check_segments(segments)
        host, pads = self.host.numpy(), self.batch - n  # padded row i repeats real row i (pads < n)
        host[0, :n], host[1, :n], host[2, :n], host[3, :n] = tokens, slots, positions, 1
        host[0, n:], host[1, n:], host[2, n:], host[3, n:] = tokens[:pads], slots[:pads], positions[:pads], 0
        self.inputs.copy_(self.host, non_blocking=True)
        logits = self._run()[:n]
        for shard in self.shards:
            shard.commit_segments(segments)
        return logits

    def _run(self) -> torch.Tensor:
        if not self.use_graph:
            return self._compute()
        if self.graph is not None:
            self.graph.replay()
            assert self.logits is not None
            return self.logits
        # warm up on a side stream (this computes the real step), then capture for replays
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            logits = self._compute().clone()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.logits = self._compute()
        self.graph = graph
        return logits
