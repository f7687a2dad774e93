"""The head's scheduler: admission, stream groups, frames out, tokens in.

Streams are admitted into the least-populated of G stream groups (default: one per stage). A
group has at most one frame in the pipeline: when its tokens come back from the tail, the head
builds the group's next frame (each stream adds a prefill window of at most W rows, or one
decode row). With G >= stages, some group's frame is at every stage, so no stage idles while
tokens travel. The head is ready only while full-chain probes come back; when the chain falls
silent, frames in flight fail with a clear error and new requests are refused until it heals.

Requests arrive from clients (the gateway, or :class:`FleetClient`) on a ROUTER socket at the
head's port + 2 as ``submit``/``cancel``; tokens go back as ``output`` messages.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import zmq

from ..engine.errors import ModelfleetError
from ..engine.frame import Frame
from ..engine.sampling import SamplingParams, StreamSampler
from . import transport as wire

if TYPE_CHECKING:
    from .stage import StageAgent

log = logging.getLogger("modelfleet.head")


@dataclass(eq=False)
class Stream:
    request_id: int
    client: bytes
    prompt: list[int]
    params: SamplingParams
    stop_ids: set[int]
    queued_at: float
    slot: int = -1
    group: int = -1
    prefilled: int = 0
    generated: list[int] = field(default_factory=list)
    done: bool = False


@dataclass
class InFlight:
    step: int
    sent_at: float
    samples: list[Stream]  # the stream of each sampled row, in row order


@dataclass
class Group:
    index: int
    streams: list[Stream] = field(default_factory=list)
    in_flight: InFlight | None = None


class HeadScheduler:
    def __init__(self, agent: StageAgent):
        self.agent = agent
        assert agent.shard is not None
        self.shard = agent.shard
        self.spec = agent.shard.spec
        serving = agent.plan.serving
        self.max_streams, self.context = agent.plan.streams_per_group, serving.context_length
        self.window_rows, self.max_queue = serving.window_rows, serving.max_queue
        self.queue_timeout = serving.queue_timeout_seconds
        count = serving.stream_groups or len(agent.stages)
        self.groups = [Group(g) for g in range(count)]
        self.per_group = -(-self.max_streams // count)
        self.free_slots = list(range(self.max_streams))
        self.queue: deque[Stream] = deque()
        self.streams: dict[tuple[bytes, int], Stream] = {}
        self.steps = itertools.count()
        self.nonces = itertools.count(1)
        self.last_probe = 0.0
        self.last_ack = time.monotonic() if agent.is_tail else 0.0
        self.local_samplers: dict[int, StreamSampler] = {}  # a one-stage fleet samples here
        self.plan_hash = agent.plan.plan_hash()
        self.clients = agent.context.socket(zmq.ROUTER)
        wire.limit_message_bytes(self.clients)
        if agent.config.keys is not None:
            wire.curve_server(self.clients, agent.config.keys)
        self.clients.setsockopt(zmq.LINGER, 0)
        self.clients.bind(f"tcp://{agent.stage.host}:{agent.stage.port + 2}")
        self._publish()

    # ---- readiness ------------------------------------------------------------------------

    @property
    def chain_ready(self) -> bool:
        if self.agent.is_tail:
            return True
        return time.monotonic() - self.last_ack < self.agent.config.unready_after_seconds

    def poll_timeout_ms(self) -> int:
        return 20

    def tick(self) -> None:
        now = time.monotonic()
        if not self.agent.is_tail and now - self.last_probe >= self.agent.config.probe_interval_seconds:
            self.last_probe = now
            self.agent.send(
                wire.ProbeMsg(nonce=next(self.nonces), sent_ns=time.monotonic_ns(), plan_hash=self.plan_hash)
            )
        if not self.chain_ready:
            self._fail_stalled(now)
        self._expire_queue(now)
        self.pump()
        self._publish()

    def _fail_stalled(self, now: float) -> None:
        silent_for = self.agent.config.unready_after_seconds
        for group in self.groups:
            if group.in_flight is not None and now - group.in_flight.sent_at > silent_for:
                group.in_flight = None
                for stream in list(group.streams):
                    self.finish(stream, "error", f"a pipeline stage stopped answering for over {silent_for:.0f} s")

    def _expire_queue(self, now: float) -> None:
        while self.queue and now - self.queue[0].queued_at > self.queue_timeout:
            stream = self.queue.popleft()
            self._reply(stream, wire.OutputMsg(
                request_id=stream.request_id, finish_reason="error",
                error=f"waited over {self.queue_timeout:.0f} s for a free slot (queue_timeout_seconds)",
            ))  # fmt: skip
            self.streams.pop((stream.client, stream.request_id), None)

    def _publish(self) -> None:
        active = sum(len(g.streams) for g in self.groups)
        self.agent.status.head = {
            "chain_ready": self.chain_ready, "streams_active": active, "queue_depth": len(self.queue),
            "stream_groups": len(self.groups), "free_slots": len(self.free_slots),
        }  # fmt: skip
        metrics = self.agent.metrics
        metrics.streams_active.set(active)
        metrics.queue_depth.set(len(self.queue))
        metrics.chain_ready.set(1 if self.chain_ready else 0)

    # ---- clients --------------------------------------------------------------------------

    def drain_clients(self) -> None:
        while True:
            try:
                identity, *parts = self.clients.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except ValueError:
                continue
            try:
                msg = wire.decode(parts)
            except wire.MalformedMessage as exc:
                self.agent.metrics.malformed.inc()
                log.warning("dropped a malformed client message: %s", exc.reason)
                continue
            if isinstance(msg, wire.SubmitMsg):
                self.submit(identity, msg)
            elif isinstance(msg, wire.CancelMsg):
                stream = self.streams.get((identity, msg.request_id))
                if stream is not None:
                    self.cancel(stream)
            else:
                self.agent.metrics.malformed.inc()

    def submit(self, client: bytes, msg: wire.SubmitMsg) -> None:
        prompt = msg.prompt_ids.tolist()
        refusal = self._refusal(prompt)
        if refusal is not None:
            self._send(client, wire.OutputMsg(request_id=msg.request_id, finish_reason="error", error=refusal))
            return
        params = msg.sampling_params()
        stop = params.stop_token_ids if params.stop_token_ids is not None else self.spec.eos_token_ids
        stream = Stream(msg.request_id, client, prompt, params, set(stop), time.monotonic())
        self.streams[(client, msg.request_id)] = stream
        self.queue.append(stream)
        self.pump()

    def _refusal(self, prompt: list[int]) -> str | None:
        if not self.chain_ready:
            return "the fleet is not ready: a pipeline stage is not answering; retry shortly"
        if len(self.queue) >= self.max_queue and not self.free_slots:
            return f"all {self.max_streams} streams are busy and the queue holds {self.max_queue}; retry later"
        if len(prompt) >= self.context:
            return f"the prompt has {len(prompt)} tokens; the context length is {self.context}"
        if bad := [t for t in prompt if t >= self.spec.vocab_size]:
            return f"token id {bad[0]} is outside the vocabulary [0, {self.spec.vocab_size})"
        return None

    def cancel(self, stream: Stream) -> None:
        if stream in self.queue:
            self.queue.remove(stream)
            self.streams.pop((stream.client, stream.request_id), None)
            self._reply(stream, wire.OutputMsg(request_id=stream.request_id, finish_reason="cancelled"))
        elif not stream.done:
            self.finish(stream, "cancelled")

    def _reply(self, stream: Stream, msg: wire.OutputMsg) -> None:
        self._send(stream.client, msg)

    def _send(self, client: bytes, msg: wire.OutputMsg) -> None:
        try:
            self.clients.send_multipart([client, *wire.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("could not answer client request %d: %s", msg.request_id, exc)

    # ---- scheduling -----------------------------------------------------------------------

    def pump(self) -> None:
        while self.queue and self.free_slots and self.chain_ready:
            group = min(self.groups, key=lambda g: len(g.streams))
            if len(group.streams) >= self.per_group:
                break
            stream = self.queue.popleft()
            stream.slot, stream.group = self.free_slots.pop(0), group.index
            group.streams.append(stream)
        for group in self.groups:
            if group.in_flight is None and group.streams:
                self.dispatch(group)

    def dispatch(self, group: Group) -> None:
        slots: list[int] = []
        positions: list[int] = []
        tokens: list[int] = []
        sample_rows: list[int] = []
        samples: list[Stream] = []
        starts: list[wire.StreamStart] = []
        for stream in group.streams:
            if stream.prefilled < len(stream.prompt):
                if stream.prefilled == 0:
                    starts.append(wire.StreamStart.of(stream.slot, stream.params))
                window = stream.prompt[stream.prefilled : stream.prefilled + self.window_rows]
                first = stream.prefilled
                stream.prefilled += len(window)
                finishing = stream.prefilled == len(stream.prompt)
            else:
                window, first, finishing = [stream.generated[-1]], len(stream.prompt) + len(stream.generated) - 1, True
            slots += [stream.slot] * len(window)
            positions += range(first, first + len(window))
            tokens += window
            if finishing:
                sample_rows.append(len(slots) - 1)
                samples.append(stream)
        step = next(self.steps)
        frame = Frame(torch.tensor(slots), torch.tensor(positions), token_ids=torch.tensor(tokens))
        try:
            out = self.agent.compute(frame, time.perf_counter())
        except ModelfleetError as exc:
            for stream in list(group.streams):
                self.finish(stream, "error", str(exc))
            return
        group.in_flight = InFlight(step, time.monotonic(), samples)
        if self.agent.is_tail:
            self._sample_here(group, starts, out, sample_rows)
            return
        self.agent.send(wire.FrameMsg(
            group=group.index, step=step, slots=frame.slots, positions=frame.positions, hidden=out,
            sample_rows=tuple(sample_rows), new_streams=tuple(starts),
        ))  # fmt: skip

    def _sample_here(self, group: Group, starts: list[wire.StreamStart], logits: torch.Tensor, rows: list[int]) -> None:
        for start in starts:
            self.local_samplers[start.slot] = StreamSampler(start.sampling_params(), self.spec.eos_token_ids)
        assert group.in_flight is not None
        tokens = [
            self.local_samplers[s.slot].sample(logits[r]) for s, r in zip(group.in_flight.samples, rows, strict=True)
        ]
        self.on_tokens(group.index, group.in_flight.step, tokens)

    # ---- results --------------------------------------------------------------------------

    def on_chain_message(self, msg: wire.Message, arrived: float) -> None:
        if isinstance(msg, wire.TokensMsg):
            self.on_tokens(msg.group, msg.step, msg.token_ids.tolist())
        elif isinstance(msg, wire.ProbeAckMsg):
            if msg.plan_hash == self.plan_hash and msg.ready:
                self.last_ack = time.monotonic()
            elif msg.plan_hash != self.plan_hash:
                log.warning("stage %d runs a different plan (hash %s)", msg.stage_index, msg.plan_hash[:12])
        elif isinstance(msg, wire.ErrorMsg) and msg.group is not None and msg.group < len(self.groups):
            group = self.groups[msg.group]
            if group.in_flight is not None and group.in_flight.step == msg.step:
                group.in_flight = None
                for stream in list(group.streams):
                    self.finish(stream, "error", f"a stage refused the frame: {msg.message}")
        else:
            self.agent.metrics.malformed.inc()

    def on_tokens(self, group_index: int, step: int, tokens: list[int]) -> None:
        if group_index >= len(self.groups):
            return
        group = self.groups[group_index]
        flight = group.in_flight
        if flight is None or flight.step != step or len(tokens) != len(flight.samples):
            return  # a frame that was failed or superseded
        group.in_flight = None
        for stream, token in zip(flight.samples, tokens, strict=True):
            if not stream.done:
                self.accept(stream, token)
        self.pump()

    def accept(self, stream: Stream, token: int) -> None:
        if token in stream.stop_ids:
            self.finish(stream, "stop")
            return
        stream.generated.append(token)
        self._reply(stream, wire.OutputMsg(request_id=stream.request_id, token_ids=(token,)))
        next_position = len(stream.prompt) + len(stream.generated)
        if len(stream.generated) >= stream.params.max_tokens or next_position >= self.context:
            self.finish(stream, "length")

    def finish(self, stream: Stream, reason: str, error: str = "") -> None:
        stream.done = True
        self.groups[stream.group].streams.remove(stream)
        self.streams.pop((stream.client, stream.request_id), None)
        self._reply(stream, wire.OutputMsg(request_id=stream.request_id, finish_reason=reason, error=error[:4000]))
        self.shard.release(stream.slot)
        self.local_samplers.pop(stream.slot, None)
        self.agent.send(wire.ReleaseMsg(slots=(stream.slot,)))
        self.free_slots.append(stream.slot)
        self.free_slots.sort()
