"""Single-process generation over one or more shards: the reference the pipeline must match.

``LocalModel`` chains shards in one process (residuals pass between them in float32, as they
would between machines). ``generate_batch`` runs several streams at once: each stream's
prompt is prefilled in its own frame, then every live stream contributes one decode row to a
shared frame per step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .errors import InputError
from .formats.plan import FormatPlan
from .frame import Frame
from .sampling import SamplingParams, StreamSampler, sample_rows
from .shard import Shard
from .spec import ModelSpec, load_spec
from .static_decode import MAX_GRAPH_BATCH, StaticDecoder, supports_static_decode
from .tensor_parallel import TensorGroup


def even_ranges(num_layers: int, parts: int) -> list[tuple[int, int]]:
    if not 1 <= parts <= num_layers:
        raise InputError(f"cannot cut {num_layers} layers into {parts} shards; need 1 <= shards <= {num_layers}")
    bounds = [round(i * num_layers / parts) for i in range(parts + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


class LocalModel:
    def __init__(self, shards: Sequence[Shard], static_decode: bool | None = None):
        self.shards = list(shards)
        self.spec: ModelSpec = shards[0].spec
        # fixed-shape decode steps (CUDA graphs) by default on GPUs, where launch cost dominates
        on_gpu = shards[0].device.type == "cuda"
        self.static_decode = (on_gpu if static_decode is None else static_decode) and supports_static_decode(shards)
        self._decoders: dict[int, StaticDecoder] = {}

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        shards: int = 1,
        *,
        device: str = "cpu",
        dtype: str | torch.dtype = "float32",
        progress: bool = False,
        max_slots: int = 8,
        max_context: int | None = None,
        static_decode: bool | None = None,
        formats: FormatPlan | None = None,
        tensor: TensorGroup | None = None,
    ) -> LocalModel:
        """``formats`` quantizes at load (None: the compute dtype, or a quantized checkpoint's own formats).
        ``tensor``: this process is one rank of a tensor-parallel group; every rank loads the same
        model with its own group rank and then runs the same frames (and gets the same outputs)."""
        spec = load_spec(model_dir)
        parts = [
            Shard.load(
                model_dir, start, end, device=device, dtype=dtype, progress=progress, formats=formats, tensor=tensor
            )
            for start, end in even_ranges(spec.num_layers, shards)
        ]
        context = max_context or min(spec.max_position_embeddings, 4096)
        for shard in parts:
            shard.allocate_cache(max_slots, context)
        return cls(parts, static_decode)

    @property
    def max_context(self) -> int:
        slots = self.shards[0].slots
        return slots.max_context if slots is not None else self.spec.max_position_embeddings

    @property
    def weights_bytes(self) -> int:
        return sum(s.weights_bytes for s in self.shards)

    @property
    def bytes_by_role(self) -> dict[str, dict[str, int]]:
        """{role: {format: resident bytes}} summed over the shards."""
        total: dict[str, dict[str, int]] = {}
        for shard in self.shards:
            for role, by_format in shard.bytes_by_role.items():
                for fmt, nbytes in by_format.items():
                    total.setdefault(role, {})[fmt] = total.get(role, {}).get(fmt, 0) + nbytes
        return total

    def forward(self, frame: Frame) -> torch.Tensor:
        x = self.shards[0](frame)
        for shard in self.shards[1:]:
            x = shard(Frame(frame.slots, frame.positions, hidden=x))
        return x

    def decode(self, tokens: Sequence[int], slots: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        """Logits [B, vocab] for one decode row per stream."""
        batch = len(tokens)
        if not self.static_decode or batch > MAX_GRAPH_BATCH:
            streams = [(s, p, [t]) for t, s, p in zip(tokens, slots, positions, strict=True)]
            return self.forward(Frame.of_streams(streams))
        if batch not in self._decoders:
            self._decoders[batch] = StaticDecoder(self.shards, batch)
        return self._decoders[batch].step(tokens, slots, positions)

    def acquire(self) -> int:
        slot = self.shards[0].acquire()
        for shard in self.shards[1:]:
            shard._slots().claim(slot)
        return slot

    def release(self, slot: int) -> None:
        for shard in self.shards:
            shard.release(slot)

    def rewind(self, slot: int, position: int) -> None:
        for shard in self.shards:
            shard.rewind(slot, position)


@dataclass
class GenerationResult:
    prompt_tokens: int
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    time_to_first_token_s: float = 0.0
    total_s: float = 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        decode_s = self.total_s - self.time_to_first_token_s
        return (len(self.token_ids) - 1) / decode_s if len(self.token_ids) > 1 and decode_s > 0 else 0.0


@dataclass
class _Stream:
    slot: int
    sampler: StreamSampler
    result: GenerationResult
    position: int
    last_token: int = -1
    done: bool = False


def validate_prompt(model: LocalModel, prompt_ids: Sequence[int]) -> None:
    if not prompt_ids:
        raise InputError("the prompt is empty; give at least one token")
    vocab = model.spec.vocab_size
    bad = [t for t in prompt_ids if not 0 <= t < vocab]
    if bad:
        raise InputError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
    if len(prompt_ids) >= model.max_context:
        raise InputError(
            f"the prompt has {len(prompt_ids)} tokens; the context budget is {model.max_context} per stream "
            f"(the prompt must be shorter to leave room for generated tokens)"
        )


def generate_batch(
    model: LocalModel,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
    on_token: Callable[[int, int], None] | None = None,
) -> list[GenerationResult]:
    """Generate for every prompt concurrently; on_token(stream_index, token_id) as they come."""
    per_stream = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
    for prompt in prompts:
        validate_prompt(model, prompt)
    start = time.perf_counter()
    streams: list[_Stream] = []
    try:
        for prompt, p in zip(prompts, per_stream, strict=True):
            slot = model.acquire()
            stream = _Stream(slot, StreamSampler(p, model.spec.eos_token_ids), GenerationResult(len(prompt)), 0)
            streams.append(stream)
            logits = model.forward(Frame.of_streams([(slot, 0, list(prompt))]))
            stream.position = len(prompt)
            _accept(stream, stream.sampler.sample(logits[-1]), model, start, on_token, len(streams) - 1)
        while live := [s for s in streams if not s.done]:
            logits = model.decode([s.last_token for s in live], [s.slot for s in live], [s.position for s in live])
            tokens = sample_rows(logits, [s.sampler for s in live])
            for s, token in zip(live, tokens, strict=True):
                s.position += 1
                _accept(s, token, model, start, on_token, streams.index(s))
    finally:
        for s in streams:
            model.release(s.slot)
    return [s.result for s in streams]


def _accept(
    s: _Stream,
    token: int,
    model: LocalModel,
    start: float,
    on_token: Callable[[int, int], None] | None,
    index: int,
) -> None:
    now = time.perf_counter() - start
    if not s.result.token_ids and s.result.time_to_first_token_s == 0.0:
        s.result.time_to_first_token_s = now
    s.result.total_s = now
    if token in s.sampler.stop_ids:
        s.result.finish_reason, s.done = "stop", True
        return
    s.result.token_ids.append(token)
    s.last_token = token
    if on_token is not None:
        on_token(index, token)
    if len(s.result.token_ids) >= s.sampler.params.max_tokens or s.position + 1 >= model.max_context:
        s.result.finish_reason, s.done = "length", True


def generate(
    model: LocalModel,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    on_token: Callable[[int], None] | None = None,
) -> GenerationResult:
    callback = None if on_token is None else (lambda _i, t: on_token(t))
    return generate_batch(model, [prompt_ids], [params], callback)[0]
