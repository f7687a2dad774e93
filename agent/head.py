"""The head: sockets, probes and readiness around the scheduler and the stage-0 backend.

Every decision (admission, which rows of which streams go in the next frame, stop and length
rules, failing one stream) is the engine's pure :class:`~modelfleet.engine.scheduler.Scheduler`,
the same one ``modelfleet generate`` runs. This module does what it decides: it runs the head's
own layers on each step, pushes the result down the chain (or samples it, when the head is also
the tail), takes tokens and errors back, answers clients and probes the chain.

Clients (the gateway, or :class:`FleetClient`) send ``submit``/``cancel`` on a ROUTER socket at
the stage's client port and get ``output`` messages back; a request that fails ends with an
error code from :class:`~modelfleet.engine.errors.ErrorCode`. The head is ready only while every
stage's heartbeats arrive and full-chain probes come back within a step's deadline (the decisions
and their deadlines: :mod:`.liveness`), and new requests are refused (``not_ready``) until the
chain heals.

A lost stage does not fail the streams: a stage whose heartbeats stop, a step over its deadline
(its frames were lost on the way), or a stage that beats with a new incarnation (restarted, so
empty) pauses the pipeline (:meth:`Scheduler.pause`): the streams keep their committed tokens.
Once every stage beats again and a chain probe sent after the loss came back, the head releases
every slot on every stage and prefills each stream's prompt plus committed output again
(:meth:`Scheduler.resume`), then decodes on; the client sees one uninterrupted stream. A pause
longer than ``replay_timeout_seconds`` fails its streams with ``replay_timeout``.
The head knows its stage only through what it is given (a backend, a ``send`` toward the next
stage, metrics and status), never the stage agent itself.
"""

from __future__ import annotations

import copy
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
import zmq

from ..engine.backend import StageBackend
from ..engine.errors import ErrorCode, ModelfleetError
from ..engine.frame import Frame
from ..engine.sampling import TailSampler, TokenLogprobs
from ..engine.scheduler import Event, Finish, Refusal, Rewind, Scheduler, SchedulerConfig, Step, StreamState, Token
from ..engine.speculative.mtp import TailMtp, TailProposals, propose_at_tail
from ..engine.speculative.speculator import SpeculationStats
from ..engine.speculative.verify import SparseQ, tail_step
from ..engine.structured import Grammars
from ..plan import FleetPlan
from . import transport as wire
from .health import AgentStatus, StageMetrics
from .liveness import LivenessPolicy, chain_ready, lost_stages, step_deadline_seconds

log = logging.getLogger("modelfleet.head")

Compute = Callable[[Frame, float], torch.Tensor]  # a frame and when it arrived -> the backend's output
Send = Callable[[wire.Message], None]  # toward the next stage


@dataclass(frozen=True)
class HeadConfig:
    client_address: str  # host:port of the client socket
    probe_interval_seconds: float = 1.0
    unready_after_seconds: float = 3.0  # a stage's heartbeats silent this long: lost (see .liveness)
    keys: wire.KeyPair | None = None
    stages: int = 1  # of the head's pipeline group, the head included
    round_trips_kept: int = 32  # recent step round trips a step's deadline is derived from
    replay_timeout_seconds: float = 120.0  # a paused pipeline's streams fail after this long (the plan's)


def scheduler_config(plan: FleetPlan, backend: StageBackend, stages: int) -> SchedulerConfig:
    """The fleet's limits as the scheduler's: every stage gets up to ``stages`` frames of one
    microbatch's prefill windows in flight, so a long prompt streams through the pipeline."""
    serving = plan.serving
    return SchedulerConfig(
        max_streams=plan.streams_per_group, context_length=serving.context_length,
        vocab_size=backend.spec.vocab_size, eos_token_ids=backend.spec.eos_token_ids,
        window_rows=serving.window_rows, microbatches=serving.microbatches or stages, frames_in_flight=stages,
        max_queue=serving.max_queue, queue_timeout_seconds=serving.queue_timeout_seconds,
    )  # fmt: skip


class Head:
    def __init__(
        self,
        scheduler: Scheduler,
        backend: StageBackend,
        config: HeadConfig,
        *,
        compute: Compute,
        send: Send | None,  # None: the head is also the tail, and samples here
        context: zmq.Context[Any],
        plan_hash: str,
        metrics: StageMetrics,
        status: AgentStatus,
        grammars: Grammars | None = None,  # the tail's grammar compiler, when the head is the tail
    ):
        self.scheduler, self.backend, self.config = scheduler, backend, config
        self.compute, self.send_next = compute, send
        self.plan_hash, self.metrics, self.status = plan_hash, metrics, status
        self.sampler = TailSampler(backend.spec.eos_token_ids, grammars) if send is None else None
        self.tail_mtp: TailMtp | None = None  # a one-stage fleet's MTP layers (the stage sets them)
        self.streams: dict[tuple[bytes, int], StreamState] = {}
        self.nonce = 0
        self.last_probe = 0.0
        self.liveness = LivenessPolicy(heartbeat_seconds=config.unready_after_seconds)
        self.started_at = time.monotonic()
        self.replays = 0
        self.heartbeats: dict[int, float] = {}  # stage index -> when its last ready heartbeat arrived
        self.heartbeat_gaps: dict[int, deque[float]] = {}  # stage index -> recent gaps between its heartbeats
        self.probes: dict[int, float] = {}  # nonce -> sent (monotonic), of probes not answered yet
        self.last_answered: float | None = None  # when a chain probe last came back
        self.round_trips: deque[float] = deque(maxlen=config.round_trips_kept)
        self.lost: list[int] = []
        self.incarnations: dict[int, int] = {}  # stage index -> the incarnation its heartbeats carry
        self.pause_reason = ""
        self.clients = context.socket(zmq.ROUTER)
        wire.limit_message_bytes(self.clients)
        if config.keys is not None:
            wire.curve_server(self.clients, config.keys)
        self.clients.setsockopt(zmq.LINGER, 0)
        self.clients.bind(f"tcp://{config.client_address}")
        self._speculation_seen = SpeculationStats("")
        self._publish()

    # ---- readiness ------------------------------------------------------------------------

    @property
    def chain_ready(self) -> bool:
        if self.send_next is None:
            return True
        now = time.monotonic()
        outstanding = next(iter(self.probes.values()), None)
        return chain_ready(self.liveness, now, self._lost(now), self.last_answered, outstanding, self.step_deadline())

    def step_deadline(self) -> float:
        return step_deadline_seconds(self.liveness, self.round_trips, len(self.scheduler.in_flight))

    def _lost(self, now: float) -> list[int]:
        stages = range(1, self.config.stages)
        return lost_stages(self.liveness, now, self.heartbeats, stages, self.started_at, self.heartbeat_gaps)

    def poll_timeout_ms(self) -> int:
        """A head that is also the tail computes its next step on the loop's next turn; a
        pipeline's head waits for tokens (or clients) to arrive."""
        return 0 if self.send_next is None and self.scheduler.active else 20

    def tick(self) -> None:
        now = time.monotonic()
        if self.send_next is not None:
            self._probe(now, self.send_next)
            self._check_liveness(now)
        self.deliver(self.scheduler.expire(now))
        self.pump()
        self._publish()

    def _probe(self, now: float, send: Send) -> None:
        if now - self.last_probe < self.config.probe_interval_seconds or len(self.probes) >= 1024:
            return  # (a thousand unanswered probes: the chain is long broken, and the oldest still counts)
        self.last_probe, self.nonce = now, self.nonce + 1
        self.probes[self.nonce] = now
        send(wire.ProbeMsg(nonce=self.nonce, sent_ns=time.monotonic_ns(), plan_hash=self.plan_hash))

    def _check_liveness(self, now: float) -> None:
        """A stage whose heartbeats stopped, or a step over its deadline, pauses the pipeline; a
        paused one replays once healed, or fails its streams past the replay deadline."""
        lost = self._lost(now)
        if lost and lost != self.lost:
            log.warning("stage(s) %s: no heartbeat for over %g s (not started yet, stopped or gone)", lost,
                        self.liveness.heartbeat_seconds)  # fmt: skip
        self.lost = lost
        if lost:
            self._pause(now, f"stage {lost[0]} stopped answering (no heartbeat)")
        deadline = self.step_deadline()
        if any(now - step.sent_at > deadline for step in self.scheduler.in_flight.values()):
            self._pause(now, f"a step was in flight over {deadline:.1f} s (its deadline), so its frames were lost")
        if self.scheduler.paused:
            self.deliver(self.scheduler.expire_paused(now, self.config.replay_timeout_seconds))
            if self._healed():
                self._replay(now)

    def _pause(self, now: float, why: str) -> None:
        if not self.scheduler.paused:
            log.warning("pipeline paused: %s; %d stream(s) wait for replay", why, self.scheduler.active)
            self.pause_reason = why
        self.scheduler.pause(now)

    def _healed(self) -> bool:
        """Every stage beats and a chain probe sent after the pause began came back."""
        since = self.scheduler.paused_since
        answered = self.last_answered is not None and since is not None and self.last_answered > since
        return answered and self.chain_ready

    def _replay(self, now: float) -> None:
        """Release every slot everywhere (in order ahead of the replayed frames), then prefill again."""
        replay = self.scheduler.resume(now)
        for slot in replay.slots:
            self.backend.release(slot)
            if self.sampler is not None:
                self.sampler.release(slot)
        if self.send_next is not None:
            self.send_next(wire.ReleaseMsg(slots=replay.slots))
        log.warning("pipeline healed after %.1f s paused (%s): replaying %d stream(s), %d tokens",
                    replay.paused_seconds, self.pause_reason, replay.streams, replay.tokens)  # fmt: skip
        self.metrics.replays.inc()
        self.metrics.replayed_tokens.inc(replay.tokens)
        self.metrics.paused_seconds.inc(replay.paused_seconds)
        self.replays += 1
        self.pause_reason = ""

    def _publish(self) -> None:
        scheduler = self.scheduler
        self.status.head = {
            "chain_ready": self.chain_ready, "streams_active": scheduler.active, "queue_depth": len(scheduler.queue),
            "microbatches": len(scheduler.microbatches), "free_slots": len(scheduler.free_slots),
            "steps_in_flight": len(scheduler.in_flight), "step_deadline_seconds": round(self.step_deadline(), 3),
            "stages_lost": self.lost, "paused": scheduler.paused, "pause_reason": self.pause_reason,
            "streams_waiting_for_replay": scheduler.waiting_for_replay, "replays": self.replays,
            "replay_timeout_seconds": self.config.replay_timeout_seconds,
        }  # fmt: skip
        self.metrics.waiting_for_replay.set(scheduler.waiting_for_replay)
        self.metrics.streams_active.set(scheduler.active)
        self.metrics.queue_depth.set(len(scheduler.queue))
        self.metrics.chain_ready.set(1 if self.chain_ready else 0)
        if scheduler.speculator is not None:
            self._publish_speculation(scheduler.speculator.stats)

    def _publish_speculation(self, stats: SpeculationStats) -> None:
        """The speculator's totals into /status, and what changed since the last look into metrics."""
        last = self._speculation_seen
        self.metrics.speculation(stats.method, stats.drafted - last.drafted, stats.accepted - last.accepted)
        self.metrics.fallback_trips.inc(stats.fallback_trips - last.fallback_trips)
        for width, count in (stats.widths - last.widths).items():
            for _ in range(count):
                self.metrics.verify_width.observe(width)
        self._speculation_seen = copy.deepcopy(stats)
        self.status.head["speculative"] = stats.as_dict()

    def shutdown(self, why: str) -> None:
        """The process is stopping: every stream, seated or queued, ends with ``unavailable``."""
        streams = [*self.scheduler.queue, *(s for m in self.scheduler.microbatches for s in m)]
        message = f"the fleet stopped: {why}; retry the request when it serves again"
        self.deliver([self.scheduler.fail(s, ErrorCode.UNAVAILABLE, message) for s in streams])

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
                self.metrics.malformed.inc()
                log.warning("dropped a malformed client message: %s", exc.reason)
                continue
            if isinstance(msg, wire.SubmitMsg):
                self.submit(identity, msg)
            elif isinstance(msg, wire.CancelMsg):
                stream = self.streams.get((identity, msg.request_id))
                if stream is not None:
                    self.deliver([self.scheduler.cancel(stream)])
            else:
                self.metrics.malformed.inc()

    def submit(self, client: bytes, msg: wire.SubmitMsg) -> None:
        """A stream arriving while the pipeline is paused for a lost stage waits in the queue (for
        the heal, bounded by the replay deadline); one arriving before the chain was ever whole,
        or once the pause outlived its deadline, is refused."""
        since = self.scheduler.paused_since
        healing = since is not None and time.monotonic() - since <= self.config.replay_timeout_seconds
        if not self.chain_ready and not healing:
            refusal = Refusal(
                ErrorCode.NOT_READY, "the fleet is not ready: a pipeline stage is not answering; retry shortly"
            )
        else:
            ids = msg.prompt_ids.tolist()
            cut = len(ids) - msg.continued  # a continuation's output so far follows its prompt
            admitted = self.scheduler.submit((client, msg.request_id), ids[:cut], msg.sampling_params(),
                                             time.monotonic(), ids[cut:])  # fmt: skip
            if isinstance(admitted, StreamState):
                self.streams[(client, msg.request_id)] = admitted
                self.pump()
                return
            refusal = admitted
        self._send(client, wire.OutputMsg(request_id=msg.request_id, finish_reason="error", code=refusal.code.value,
                                          error=refusal.message))  # fmt: skip

    def _send(self, client: bytes, msg: wire.OutputMsg) -> None:
        try:
            self.clients.send_multipart([client, *wire.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("could not answer client request %d: %s", msg.request_id, exc)

    # ---- steps ----------------------------------------------------------------------------

    def pump(self) -> None:
        if not self.chain_ready:
            return
        for step in self.scheduler.schedule(time.monotonic()):
            self.dispatch(step)

    def dispatch(self, step: Step) -> None:
        """Run the head's layers on a step, then send it on (or sample it here)."""
        frame = step.frame()
        refused = self.backend.refusals(frame)
        if refused:  # those streams fail alone; the rest of the frame goes on
            self.deliver([self._fail_slot(step, slot, exc.code, str(exc)) for slot, exc in refused.items()])
            kept = [r for r, slot in enumerate(step.slots) if slot not in refused]
            if not kept:
                self.deliver(self.scheduler.complete(step.id, {}))
                return
            frame = frame.keep_rows(kept)
        try:
            out = self.compute(frame, time.perf_counter())
        except ModelfleetError as exc:
            self.deliver(self.scheduler.fail_step(step.id, exc.code, str(exc)))
            return
        slots = frame.slots.tolist()
        output_rows = [] if frame.output_rows is None else frame.output_rows.tolist()
        assert frame.token_ids is not None
        if self.send_next is None:
            self._sample_here(step, frame, out)
            return
        # a replayed stream (prefilled again after a lost stage) or a continuation skips its
        # earlier draws, takes its earlier output back from its rows, and does not score its
        # prompt again (its client has those log-probabilities)
        starts = tuple(wire.StreamStart.of(s.slot, s.params, *self._start(s))
                       for s in step.new_streams if s.slot in set(slots))  # fmt: skip
        in_frame = set(slots)  # a refused stream's window (and q) is not in the frame
        draft_q = {slot: SparseQ.of(q) for slot, q in step.draft_probs.items() if slot in in_frame}  # the tail's q
        self.send_next(wire.FrameMsg(
            microbatch=step.microbatch, step=step.id, slots=frame.slots, positions=frame.positions, hidden=out,
            token_ids=frame.token_ids, output_rows=tuple(output_rows), new_streams=starts,
            **wire.draft_q_fields(draft_q),
        ))  # fmt: skip

    def _sample_here(self, step: Step, frame: Frame, logits: torch.Tensor) -> None:
        """A one-stage fleet's head is its tail too: sample (and score prompt rows) here."""
        assert self.sampler is not None and frame.token_ids is not None
        for stream in step.new_streams:
            self.sampler.start(stream.slot, stream.params, *self._start(stream))
        slots, positions, ids = frame.slots.tolist(), frame.positions.tolist(), frame.token_ids.tolist()
        rows = [] if frame.output_rows is None else frame.output_rows.tolist()
        self.sampler.observe(slots, positions, ids)
        tokens, errors, logprobs, prompt = tail_step(
            self.sampler, [slots[r] for r in rows], [positions[r] for r in rows], [ids[r] for r in rows], logits,
            lambda: list(zip(slots, positions, ids, strict=True)), step.draft_probs,
        )  # fmt: skip
        self._send_prompt_logprobs(step, prompt)
        self.deliver([self._fail_slot(step, slot, exc.code, str(exc)) for slot, exc in errors.items()])
        hidden = getattr(self.backend, "last_hidden", None)
        if self.tail_mtp is not None and hidden is not None:
            first: dict[int, int] = {}  # each slot's first output row's position: its tokens follow it
            for r in rows:
                first.setdefault(slots[r], positions[r])
            emitted = [(s, first[s] + i, t) for s, got in tokens.items() for i, t in enumerate(_tokens_of(got))]
            self._receive_proposals(propose_at_tail(self.tail_mtp, (slots, positions, ids), hidden, emitted))
        self.deliver(self.scheduler.complete(step.id, tokens, time.monotonic(), logprobs))

    @staticmethod
    def _start(stream: StreamState) -> tuple[int, int, int]:
        """A starting stream's prompt rows to score, draws made before, and where its output begins."""
        return 0 if stream.replays else len(stream.prompt), len(stream.generated), len(stream.prompt)

    def _receive_proposals(self, proposals: list[tuple[int, int, list[int]]]) -> None:
        """The tail's mtp proposals (slot, position of the stream's newest token, drafts), for the
        streams' next windows."""
        speculator = self.scheduler.speculator
        if proposals and speculator is not None and isinstance(speculator.proposer, TailProposals):
            for slot, position, drafts in proposals:
                speculator.proposer.receive(slot, position, drafts)

    def _send_prompt_logprobs(self, step: Step | None, scored: Mapping[int, list[tuple[int, TokenLogprobs]]]) -> None:
        """Prompt tokens' log-probabilities to their clients, before the stream's first token."""
        for slot, entries in scored.items():
            stream = None if step is None else next((s for s in step.streams if s.slot == slot and not s.done), None)
            if stream is None or not entries:
                continue
            client, request_id = cast(tuple[bytes, int], stream.key)
            records = tuple(wire.LogprobsRecord.of(position, value) for position, value in entries)
            self._send(client, wire.OutputMsg(request_id=request_id, prompt_logprobs=records))

    def _fail_slot(self, step: Step, slot: int, code: ErrorCode, message: str) -> Finish | None:
        stream = next((s for s in step.streams if s.slot == slot), None)
        return None if stream is None else self.scheduler.fail(stream, code, message)

    # ---- results --------------------------------------------------------------------------

    def on_chain_message(self, msg: wire.Message, arrived: float) -> None:
        if isinstance(msg, wire.TokensMsg):
            if (step := self.scheduler.in_flight.get(msg.step)) is not None:
                self.round_trips.append(time.monotonic() - step.sent_at)
            tokens: dict[int, list[int]] = {}  # a verify window's tokens arrive in order under one slot
            for slot, token in zip(msg.slots.tolist(), msg.token_ids.tolist(), strict=True):
                tokens.setdefault(slot, []).append(token)
            self.release_strays(tokens)
            slots = msg.slots.tolist()
            logprobs = {slots[record.row]: record.value() for record in msg.logprobs}
            prompt: dict[int, list[tuple[int, TokenLogprobs]]] = {}
            for slot, record in zip(msg.prompt_slots, msg.prompt_logprobs, strict=True):
                prompt.setdefault(slot, []).append((record.row, record.value()))
            self._send_prompt_logprobs(self.scheduler.in_flight.get(msg.step), prompt)
            self._receive_proposals([(r.slot, r.position, list(r.token_ids)) for r in msg.proposals])
            self.deliver(self.scheduler.complete(msg.step, tokens, time.monotonic(), logprobs))
            self.pump()
        elif isinstance(msg, wire.HeartbeatMsg):
            if msg.plan_hash == self.plan_hash and msg.ready:
                self._heard(msg.stage_index, time.monotonic(), msg.incarnation)
        elif isinstance(msg, wire.ProbeAckMsg):
            if msg.plan_hash == self.plan_hash and msg.ready and msg.nonce in self.probes:
                now = time.monotonic()
                self.round_trips.append(now - self.probes[msg.nonce])
                self.probes = {n: sent for n, sent in self.probes.items() if n > msg.nonce}  # acks come in order
                self.last_answered = now
            elif msg.plan_hash != self.plan_hash:
                log.warning("stage %d runs a different plan (hash %s)", msg.stage_index, msg.plan_hash[:12])
        elif isinstance(msg, wire.ErrorMsg) and msg.step is not None:
            self.on_error(msg.step, msg.slot, ErrorCode(msg.code), msg.message)
        else:
            self.metrics.malformed.inc()

    def _heard(self, stage: int, now: float, incarnation: int) -> None:
        """A heartbeat; the gap since the last one counts toward the stage's deadline unless the
        stage was lost meanwhile (a stop is not a measure of how late a living stage beats). A
        new incarnation is a restarted stage, empty however soon it came back: replay."""
        known = self.incarnations.setdefault(stage, incarnation)
        if known != incarnation:
            self.incarnations[stage] = incarnation
            self._pause(now, f"stage {stage} restarted (a new incarnation)")
        last = self.heartbeats.get(stage)
        gaps = self.heartbeat_gaps.setdefault(stage, deque(maxlen=self.config.round_trips_kept))
        if last is not None and stage not in self.lost:
            gaps.append(now - last)
        self.heartbeats[stage] = now

    def release_strays(self, slots: Iterable[int]) -> None:
        """Slots a stage reports on (a token, an error) that no stream of the scheduler holds: a
        frame the head never sent for them (a forged one, a bug) left state on the stages it
        passed, so free them everywhere. A slot a stream holds is never touched here. (A stream
        that finished while its step was in flight gets here too: its slot is freed twice, which
        is harmless, and before any later stream's frame, which travels after the release.)"""
        for slot in sorted(set(slots) & set(self.scheduler.free_slots)):
            log.debug("a stage reported on slot %d, which no stream holds; freeing it on every stage", slot)
            self._release(slot)

    def on_error(self, step_id: int, slot: int | None, code: ErrorCode, message: str) -> None:
        if slot is not None:
            self.release_strays([slot])
        step = self.scheduler.in_flight.get(step_id)
        if step is None:
            return  # a step failed or completed already
        text = f"a stage refused the frame: {message}"
        if slot is None:
            self.deliver(self.scheduler.fail_step(step_id, code, text))
        else:
            self.deliver([self._fail_slot(step, slot, code, text)])
        self.pump()

    def deliver(self, events: Iterable[Event | None]) -> None:
        """Tokens and finishes to their clients; a finished stream's slot is released everywhere."""
        for event in events:
            if event is None:
                continue
            if isinstance(event, Rewind):
                self._rewind(event.stream.slot, event.position)
                continue
            client, request_id = cast(tuple[bytes, int], event.stream.key)
            if isinstance(event, Token):
                logprobs = () if event.logprobs is None else (wire.LogprobsRecord.of(0, event.logprobs),)
                self._send(
                    client, wire.OutputMsg(request_id=request_id, token_ids=(event.token_id,), logprobs=logprobs)
                )
                continue
            self.streams.pop((client, request_id), None)
            code = None if event.code is None else event.code.value
            self._send(client, wire.OutputMsg(request_id=request_id, finish_reason=event.reason.value, code=code,
                                              error=event.message[:4000]))  # fmt: skip
            if event.stream.slot >= 0:
                self._release(event.stream.slot)

    def _rewind(self, slot: int, position: int) -> None:
        """Rejected proposals: every stage keeps positions [0, position) of the slot (the message
        travels the chain in order with the frames, ahead of the stream's next one)."""
        self.backend.rewind(slot, position)
        if self.send_next is not None:
            self.send_next(wire.RewindMsg(slot=slot, position=position))

    def _release(self, slot: int) -> None:
        self.backend.release(slot)
        if self.sampler is not None:
            self.sampler.release(slot)
        if self.tail_mtp is not None:
            self.tail_mtp.release(slot)
        if self.send_next is not None:
            self.send_next(wire.ReleaseMsg(slots=(slot,)))


def _tokens_of(got: int | list[int]) -> list[int]:
    return [got] if isinstance(got, int) else list(got)
