"""Decode steps with fixed shapes, replayed from a CUDA graph on GPUs.

A decode step of B rows (one per stream, or a speculative verify window of 1 + k rows of a
stream at consecutive positions) has the same shapes every time: token ids, slots and
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

Verify windows: a step whose slots have several rows writes every row's cache entries before
any row attends, and each row sees its slot up to its own position, as a general frame's causal
mask does; such steps replay their own graph per bucket (the fused attention runs as two
launches there, :mod:`.kernels.decode_attention`). Buckets count rows, not streams. The
verify's rejected rows are rewound as in general frames (the slot's length is reset; the
entries past it are masked until a later step overwrites them).

One implementation serves a whole model in one process (:class:`~.generate.LocalModel` decodes
through :class:`StaticSteps` over all its shards, residuals crossing shard boundaries in float32)
and each pipeline stage of a fleet (a stage's :class:`~.shard.Shard` runs a frame flagged
``Frame.decode_only`` through its own :class:`StaticSteps`, set by
:func:`~.backend.load_backend`). A stage's step takes token ids when it holds the embedding, else
the previous stage's residual rows (copied into a device input buffer each step, with the rows'
token ids, which a family may route by); it gives the rows' logits from the last stage, else its
residual rows in float32 to send on.

Invariants: every shard is on the same device; the slot tables are checked before a step and
advanced after it, exactly as a general frame would.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Sequence

import torch

from .errors import InputError
from .expert_store import ExpertStore
from .frame import Frame, segments_of
from .kvcache import LayerKV
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
    are not captured in graphs yet), no expert store (its host banks' work is not a device step)
    and, on CUDA, every quantized expert bank in a format with a gathered kernel (the grouped path
    synchronises with the host, which a graph cannot hold). Quantized projections run their
    formats' kernels, which capture as they are."""
    devices = {shard.device for shard in shards}
    attentions = [layer.attention for shard in shards for layer in shard.layers]
    modules = [m for shard in shards for m in shard.modules()]
    banks = [m for m in modules if isinstance(m, QuantizedExperts)]
    eager = all(device.type == "cpu" for device in devices)
    split = any(is_split(shard) for shard in shards)
    return (
        len(devices) == 1
        and all(getattr(a, "static_decode", False) for a in attentions)
        and not split
        and not any(isinstance(m, ExpertStore) for m in modules)
        and (eager or all(bank.gathered_on(bank.gate_up.device) for bank in banks))
    )


def rows_per_stream_limit(shards: Sequence[Shard]) -> int:
    """The most rows of one stream a static step takes. All of a step's rows are written before any
    attends, so in a ring (a sliding-window cache of ``capacity`` entries) a window's later row must
    not replace an entry its earlier rows still see: at most ``capacity - window + 1`` rows. A
    padded row's write-back entry, one past its slot's rows, must not be one of them: fewer rows
    than the capacity. A longer window runs as a general frame."""
    limit = MAX_GRAPH_BATCH
    for shard in shards:
        for layer, kv in zip(shard.layers, shard.kv, strict=True):
            limit = min(limit, kv.capacity - 1)
            window = getattr(layer.attention, "window", None)
            if kv.ring and window is not None:
                limit = min(limit, kv.capacity - window + 1)
    return limit


class StaticDecoder:
    def __init__(self, shards: Sequence[Shard], batch: int, use_graph: bool | None = None):
        if not supports_static_decode(shards):
            raise InputError("static decode needs every shard on one device and grouped-query or latent attention")
        self.shards = list(shards)
        self.batch = batch
        self.rows_per_stream = rows_per_stream_limit(self.shards)
        device = self.shards[0].device
        self.use_graph = device.type == "cuda" if use_graph is None else use_graph
        # rows: token ids, slots, positions, 1 for a real row, the position a padded row writes back;
        # one host-to-device copy per step from pinned memory
        self.host = torch.zeros((5, batch), dtype=torch.int64, pin_memory=device.type == "cuda")
        self.inputs = torch.zeros((5, batch), dtype=torch.int64, device=device)
        self.tokens, self.slots, self.positions = self.inputs[0], self.inputs[1], self.inputs[2]
        # a later stage's input, the previous stage's residual rows: [batch, *residual_shape]
        first = self.shards[0]
        shape = (batch, *first.residual_shape)
        self.hidden = None if first.is_first else torch.zeros(shape, dtype=first.dtype, device=device)
        # by whether the step has verify windows: their graph, its output (logits from the last
        # shard, else float32 residual rows), and how often it replayed
        self.graphs: dict[bool, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[bool, torch.Tensor] = {}
        self.replays = {False: 0, True: 0}

    @property
    def graph(self) -> torch.cuda.CUDAGraph | None:
        """The graph of steps of one row per stream (None until captured)."""
        return self.graphs.get(False)

    @torch.inference_mode()
    def _compute(self, windows: bool) -> torch.Tensor:
        valid = self.inputs[3] != 0 if bucket_pads(self.batch) else None
        spare = self.inputs[4] if valid is not None else None
        ctx = FrameContext(
            None, self.positions, self.slots, token_ids=self.tokens, valid=valid, spare_positions=spare, windows=windows
        )
        x = self.shards[0].residual_of(self.tokens) if self.hidden is None else self.hidden
        for i, shard in enumerate(self.shards):
            if i > 0:  # the residual crosses a shard boundary in float32, as between machines
                x = x.to(torch.float32).to(shard.dtype)
            x = shard.run_layers(x, ctx)
        return self.shards[-1].output(x)

    def step(
        self, tokens: Sequence[int], slots: Sequence[int], positions: Sequence[int], hidden: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits [n, vocab] float32 (from the last shard; else residual rows [n, *residual_shape]
        float32) for n <= the decoder's batch rows: one decode row per stream, or a verify window
        of rows at consecutive positions (a stream's rows adjacent). ``hidden``: the rows' input
        residuals [n, *residual_shape] when the first shard does not embed (a later stage)."""
        n = len(tokens)
        if not len(slots) == len(positions) == n or not 2 * n > self.batch >= n:
            raise InputError(f"a static decode step of {self.batch} rows takes {self.batch // 2 + 1} to {self.batch}")
        vocab = self.shards[0].spec.vocab_size
        if any(not 0 <= t < vocab for t in tokens):
            raise InputError(f"a token id is outside the vocabulary [0, {vocab})")
        segments = segments_of(list(slots), list(positions))
        longest = max(seg.rows for seg in segments)
        if longest > self.rows_per_stream:
            raise InputError(
                f"a static decode step takes at most {self.rows_per_stream} rows of one stream "
                f"(this model's caches), got {longest}; send the window as a general frame"
            )
        for shard in self.shards:
            shard.check_segments(segments)
        self._fill_hidden(hidden, n)
        ends = [seg.pos_end for seg in segments for _ in range(seg.rows)]  # one past each row's slot's rows
        host, pads = self.host.numpy(), self.batch - n  # padded row i repeats real row i (pads < n)
        host[0, :n], host[1, :n], host[2, :n], host[3, :n], host[4, :n] = tokens, slots, positions, 1, ends
        host[0, n:], host[1, n:], host[2, n:], host[3, n:] = tokens[:pads], slots[:pads], positions[:pads], 0
        host[4, n:] = ends[:pads]
        self.inputs.copy_(self.host, non_blocking=True)
        out = self._run(longest > 1)[:n]
        for shard in self.shards:
            shard.commit_segments(segments)
        return out

    def _fill_hidden(self, hidden: torch.Tensor | None, n: int) -> None:
        """Copy a later stage's input rows into the device buffer (padded rows repeat real ones)."""
        if self.hidden is None:
            if hidden is not None:
                raise InputError("a static decode step of the first shard takes token ids only, got hidden rows")
            return
        if hidden is None or tuple(hidden.shape) != (n, *self.hidden.shape[1:]):
            got = None if hidden is None else list(hidden.shape)
            raise InputError(
                f"a static decode step of shard [{self.shards[0].layer_start}, {self.shards[0].layer_end}) takes "
                f"hidden rows of shape {[n, *self.hidden.shape[1:]]} (engine.residual.residual_shape), got {got}"
            )
        self.hidden[:n].copy_(hidden)
        self.hidden[n:].copy_(hidden[: self.batch - n])

    def _run(self, windows: bool) -> torch.Tensor:
        if not self.use_graph:
            return self._compute(windows)
        graph = self.graphs.get(windows)
        if graph is not None:
            graph.replay()
            self.replays[windows] += 1
            return self.outputs[windows]
        # warm up on a side stream (this computes the real step), then capture for replays
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = self._compute(windows).clone()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.outputs[windows] = self._compute(windows)
        self.graphs[windows] = graph
        return out


class StaticSteps:
    """Decode steps of a chain of shards (a whole model in one process, or one pipeline stage) as
    fixed-shape steps: one :class:`StaticDecoder` per bucket, made when a step first needs it.

    :meth:`decode` takes rows as lists (LocalModel's steps); :meth:`run` takes a stage's frame,
    when ``Frame.decode_only`` says every row is sampled and no stream starts. Either returns None
    for a step left to the general path: more rows than the largest bucket, a stream's window
    longer than the caches allow (:func:`rows_per_stream_limit`), or (``run``) static steps not
    asked for (``static_decode``: None, on CUDA), not supported (:func:`supports_static_decode`:
    a tensor-parallel rank or an expert store keeps the general path), or the final hidden rows
    kept for a proposer (``Shard.keep_hidden``: general frames keep them). Decoders and the
    decisions are made again when the caches are (``allocate_cache`` replaces ``Shard.kv``): a
    stage places its expert stores and allocates its caches after it loads, before any frame.
    """

    def __init__(self, shards: Sequence[Shard], static_decode: bool | None = None, use_graph: bool | None = None):
        self.shards = list(shards)
        self.static_decode = static_decode
        self.use_graph = use_graph  # capture CUDA graphs (None: on CUDA); False runs the same steps eagerly
        self.decoders: dict[int, StaticDecoder] = {}
        self._caches: list[weakref.ref[LayerKV]] = []  # the layer caches the decoders were made for
        self._rows_per_stream = 0
        self._supported = False

    def run(self, frame: Frame) -> torch.Tensor | None:
        """The frame's output (see :meth:`StaticDecoder.step`) as a static step, or None."""
        first, last = self.shards[0], self.shards[-1]
        asked = first.device.type == "cuda" if self.static_decode is None else self.static_decode
        every_row = frame.output_rows is None or len(frame.output_rows) == frame.rows
        if not (asked and frame.decode_only and every_row and frame.token_ids is not None) or last.keep_hidden:
            return None
        self._renew()
        if not self._supported:
            return None
        slots, positions, tokens = frame.slots.tolist(), frame.positions.tolist(), frame.token_ids.tolist()
        hidden = None if first.is_first else frame.hidden
        out = self.decode(tokens, slots, positions, hidden)
        return None if out is None else out.clone()  # a graph's output buffer is overwritten by its next replay

    def decode(
        self, tokens: Sequence[int], slots: Sequence[int], positions: Sequence[int], hidden: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """The rows' output (see :meth:`StaticDecoder.step`), or None when the step does not fit."""
        self._renew()
        if not 1 <= len(tokens) <= MAX_GRAPH_BATCH or max(Counter(slots).values()) > self._rows_per_stream:
            return None
        bucket = graph_bucket(len(tokens))
        if bucket not in self.decoders:
            self.decoders[bucket] = StaticDecoder(self.shards, bucket, self.use_graph)
        return self.decoders[bucket].step(tokens, slots, positions, hidden)

    def _renew(self) -> None:
        """Decoders, the rows-per-stream limit and support made for the shards' current caches."""
        caches = [kv for shard in self.shards for kv in shard.kv]
        same = len(caches) == len(self._caches) and all(r() is kv for r, kv in zip(self._caches, caches, strict=True))
        if not same:
            self.decoders.clear()
            self._caches = [weakref.ref(kv) for kv in caches]
            self._rows_per_stream = rows_per_stream_limit(self.shards)
            self._supported = supports_static_decode(self.shards)
