"""Single-process generation over one or more shards: the reference the pipeline must match.

``LocalModel`` chains shards in one process (residuals pass between them in float32, as they
would between machines); it is a :class:`~modelfleet.engine.backend.StageBackend` of the whole
model. ``generate_batch`` is a short loop of the fleet's own :class:`~.scheduler.Scheduler`
over it: whole prompts prefill in one frame, then every live stream adds one decode row to a
shared frame per step, with its verify window when speculating (a fixed-shape CUDA-graph step
where the model allows).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import torch

from .backend import backend_info, load_backend
from .errors import InputError, ModelfleetError
from .expert_offload import StoreOptions, offload_experts, placement_report, stores_of
from .expert_placement import StagePlacement
from .formats.plan import FormatPlan
from .frame import Frame
from .kvcache import SlotState, SlotTable
from .sampling import SamplingParams, TailSampler, TokenLogprobs
from .scheduler import Event, Finish, Refusal, Rewind, Scheduler, SchedulerConfig, Step, Token
from .shard import Shard
from .spec import ModelSpec, load_spec
from .speculative.speculator import Speculator
from .speculative.verify import tail_step
from .split import even_split
from .static_decode import StaticDecoder, StaticSteps, supports_static_decode
from .structured import Grammars
from .tensor_parallel import TensorGroup


class LocalModel:
    def __init__(self, shards: Sequence[Shard], static_decode: bool | None = None):
        self.shards = list(shards)
        self.spec: ModelSpec = shards[0].spec
        # fixed-shape decode steps (CUDA graphs) by default on GPUs, where launch cost dominates
        on_gpu = shards[0].device.type == "cuda"
        self.static_decode = (on_gpu if static_decode is None else static_decode) and supports_static_decode(shards)
        self._steps = StaticSteps(self.shards)  # every shard in one step: residuals cross in float32
        self.placements: list[StagePlacement] = []  # per shard, when its device memory was capped
        self.grammars: Grammars | None = None  # structured output's compiler (set by load: it needs the tokenizer)

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
        device_memory_bytes: int | None = None,
        store_options: StoreOptions | None = None,
        backend: str = "torch",
    ) -> LocalModel:
        """``formats`` quantizes at load (None: the compute dtype, or a quantized checkpoint's own formats).
        ``device_memory_bytes`` caps the device memory of the whole model (shared evenly by the
        shards): MoE layers that do not fit move to host banks with device cache slots
        (:mod:`.expert_store`), served as ``store_options`` say.
        ``tensor``: this process is one rank of a tensor-parallel group; every rank loads the same
        model with its own group rank and then runs the same frames (and gets the same outputs)."""
        spec = load_spec(model_dir)
        # capped on a GPU: experts wait in host memory until the placement says where they go
        experts_on_host = device_memory_bytes is not None and torch.device(device).type == "cuda"
        parts = [
            load_backend(
                backend,
                model_dir,
                start,
                end,
                device=device,
                dtype=dtype,
                progress=progress,
                formats=formats,
                tensor=tensor,
                static_decode=False,  # the model's steps run every shard at once (self.decode), not shard by shard
                experts_on_host=experts_on_host,
            )  # fmt: skip
            for start, end in even_split(spec.num_layers, shards)
        ]
        context = max_context or min(spec.max_position_embeddings, 4096)
        for shard in parts:
            shard.allocate_cache(max_slots, context)
        loaded = cast(list[Shard], parts)  # both backends are Shards
        model = cls(loaded, static_decode)
        model.grammars = Grammars(model_dir, spec.vocab_size)
        if device_memory_bytes is not None:
            options = store_options or StoreOptions()
            model.placements = [offload_experts(p, device_memory_bytes // shards, None, options) for p in loaded]
            model.static_decode = model.static_decode and supports_static_decode(loaded)  # stores: eager
        return model

    @property
    def expert_placement(self) -> dict[str, object]:
        """The placement report of every shard's expert stores (empty when nothing is offloaded)."""
        stores = [store for shard in self.shards for store in stores_of(shard)]
        placement = self.placements[0] if len(self.placements) == 1 else None
        return placement_report(stores, placement) if self.placements else {}

    @property
    def backend_info(self) -> dict[str, object]:
        """The shards' backend and device; OpenVINO's MoE block and fused counts summed."""
        infos = [backend_info(shard) for shard in self.shards]
        merged = dict(infos[0])
        for key in ("moe_layers", "fused_layers", "compile_seconds"):
            if all(key in info for info in infos):
                merged[key] = sum(info[key] for info in infos)  # type: ignore[misc]
        return merged

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

    @property
    def layer_start(self) -> int:
        return 0

    @property
    def layer_end(self) -> int:
        return self.spec.num_layers

    @property
    def slots(self) -> SlotTable | None:
        return self.shards[0].slots

    @property
    def kv_bytes(self) -> int:
        return sum(s.kv_bytes for s in self.shards)

    def allocate_cache(self, max_slots: int, max_context: int, kv_budget_bytes: int | None = None) -> None:
        for shard in self.shards:
            shard.allocate_cache(max_slots, max_context, kv_budget_bytes)

    def refusals(self, frame: Frame) -> dict[int, ModelfleetError]:
        return self.shards[0].refusals(frame)

    def forward(self, frame: Frame) -> torch.Tensor:
        x: torch.Tensor = self.shards[0](frame)
        for shard in self.shards[1:]:
            # token ids travel with the residual: a family may route by token (DeepSeek-V4's hash layers)
            x = shard(Frame(frame.slots, frame.positions, frame.token_ids, hidden=x, output_rows=frame.output_rows))
        return x

    def keep_hidden(self, kind: str = "normed") -> None:
        """From now on every frame's final hidden rows are kept (:attr:`final_hidden`; ``kind``:
        see Shard.keep_hidden), for an MTP proposer; fixed-shape decode steps (which would not
        keep them) are off."""
        self.shards[-1].keep_hidden, self.static_decode = kind, False

    @property
    def final_hidden(self) -> torch.Tensor | None:
        """The last frame's final hidden rows [R, H], after the final norm, when kept."""
        return self.shards[-1].last_hidden

    def run_step(self, step: Step) -> torch.Tensor:
        """Logits [N, vocab] of a scheduler step's output rows."""
        if step.decode_only:
            return self.decode(step.token_ids, step.slots, step.positions)
        return self.forward(step.frame())

    def export_slot(self, slot: int) -> SlotState:
        states = [shard.export_slot(slot) for shard in self.shards]
        return SlotState(states[0].length, tuple(layer for state in states for layer in state.layers))

    def import_slot(self, slot: int, state: SlotState) -> None:
        start = 0
        for shard in self.shards:
            layers = state.layers[start : start + len(shard.kv)]
            shard.import_slot(slot, SlotState(state.length, layers))
            start += len(shard.kv)

    def decode(self, tokens: Sequence[int], slots: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        """Logits [B, vocab] for decode rows: one per stream, or a verify window of rows at
        consecutive positions (a stream's rows adjacent)."""
        if self.static_decode and (logits := self._steps.decode(tokens, slots, positions)) is not None:
            return logits
        ids = (torch.tensor(list(v), dtype=torch.int64) for v in (slots, positions, tokens))
        return self.forward(Frame(next(ids), next(ids), token_ids=next(ids)))

    @property
    def _decoders(self) -> dict[int, StaticDecoder]:
        """The static steps' decoders by bucket (tests look at their graphs and replays)."""
        return self._steps.decoders

    def acquire(self) -> int:
        """A free slot, claimed on every shard (for callers that drive frames by hand)."""
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
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per token, when asked
    prompt_logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)  # by prompt position, when asked
    finish_reason: str = "length"
    time_to_first_token_s: float = 0.0
    total_s: float = 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        decode_s = self.total_s - self.time_to_first_token_s
        return (len(self.token_ids) - 1) / decode_s if len(self.token_ids) > 1 and decode_s > 0 else 0.0


def batch_decode_tokens_per_s(results: Sequence[GenerationResult]) -> float:
    """The batch's decode rate: every token after each stream's first (the first closes its
    prefill), over the time from the earliest first token to the last token of any stream."""
    tokens = sum(max(len(r.token_ids) - 1, 0) for r in results)
    started = [r.time_to_first_token_s for r in results if r.token_ids]
    decode_s = max((r.total_s for r in results), default=0.0) - min(started, default=0.0)
    return tokens / decode_s if tokens and decode_s > 0 else 0.0


def scheduler_for(model: LocalModel, streams: int, speculator: Speculator | None = None) -> Scheduler:
    """One process's scheduler: every stream seated at once (as the model's slots allow), whole
    prompts in one window, one microbatch, one step at a time."""
    slots = model.slots.max_slots if model.slots is not None else 1
    return Scheduler(SchedulerConfig(
        max_streams=slots, context_length=model.max_context, vocab_size=model.spec.vocab_size,
        eos_token_ids=model.spec.eos_token_ids, window_rows=model.max_context, max_queue=max(streams, 1),
        queue_timeout_seconds=math.inf,
    ), speculator)  # fmt: skip


def generate_batch(
    model: LocalModel,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
    on_token: Callable[[int, int], None] | None = None,
    speculator: Speculator | None = None,
) -> list[GenerationResult]:
    """Generate for every prompt concurrently (more prompts than slots wait for one);
    on_token(stream_index, token_id) as they come. ``speculator``: propose and verify tokens
    (speculative decoding; the output distribution is unchanged)."""
    per_stream = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
    scheduler = scheduler_for(model, len(prompts), speculator)
    for prompt in prompts:
        if (refusal := scheduler.refusal(prompt)) is not None:
            raise InputError(refusal.message)
    results = [GenerationResult(len(prompt)) for prompt in prompts]
    sampler = TailSampler(model.spec.eos_token_ids, model.grammars)
    start = time.perf_counter()
    for index, (prompt, p) in enumerate(zip(prompts, per_stream, strict=True)):
        admitted = scheduler.submit(index, prompt, p, 0.0)
        assert not isinstance(admitted, Refusal)  # checked above; the queue holds every prompt
    seated: set[int] = set()
    try:
        while not scheduler.idle:
            for step in scheduler.schedule(time.perf_counter() - start):
                for stream in step.new_streams:
                    sampler.start(stream.slot, stream.params, len(stream.prompt))
                    seated.add(stream.slot)
                logits = model.run_step(step)
                if speculator is not None and speculator.reads_hidden and model.final_hidden is not None:
                    speculator.observe(step.slots, step.positions, model.final_hidden)
                rows = step.output_rows
                sampler.observe(list(step.slots), list(step.positions), list(step.token_ids))
                tokens, errors, logprobs, scored = tail_step(
                    sampler, [step.slots[r] for r in rows], [step.positions[r] for r in rows],
                    [step.token_ids[r] for r in rows], logits,
                    lambda: list(zip(step.slots, step.positions, step.token_ids, strict=True)),  # noqa: B023  (called at once)
                    step.draft_probs,
                )  # fmt: skip
                if errors:
                    raise next(iter(errors.values()))
                for stream in step.streams:
                    results[cast(int, stream.key)].prompt_logprobs.update(scored.get(stream.slot, ()))
                now = time.perf_counter() - start
                for event in scheduler.complete(step.id, tokens, now, logprobs):
                    _deliver(event, results, now, on_token)
                    if isinstance(event, Rewind):
                        model.rewind(event.stream.slot, event.position)
                    elif isinstance(event, Finish):
                        model.release(event.stream.slot)
                        sampler.release(event.stream.slot)
                        seated.discard(event.stream.slot)
    finally:
        for slot in seated:
            model.release(slot)
    return results


def _deliver(
    event: Event, results: list[GenerationResult], now: float, on_token: Callable[[int, int], None] | None
) -> None:
    if isinstance(event, Rewind):
        return
    index = cast(int, event.stream.key)
    result = results[index]
    if not result.token_ids and result.time_to_first_token_s == 0.0:
        result.time_to_first_token_s = now
    result.total_s = now
    if isinstance(event, Token):
        result.token_ids.append(event.token_id)
        if event.logprobs is not None:
            result.logprobs.append(event.logprobs)
        if on_token is not None:
            on_token(index, event.token_id)
    else:
        result.finish_reason = event.reason.value


def generate(
    model: LocalModel,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    on_token: Callable[[int], None] | None = None,
    speculator: Speculator | None = None,
) -> GenerationResult:
    callback = None if on_token is None else (lambda _i, t: on_token(t))
    return generate_batch(model, [prompt_ids], [params], callback, speculator)[0]
