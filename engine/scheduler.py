"""The one scheduler of the request path: admission, prefill windows, decode rows, stop and length.

Pure: no sockets, threads or clock reads (time is passed in), so every decision is a table test.
``modelfleet generate`` (:func:`modelfleet.engine.generate.generate_batch`) and the fleet's head
(:mod:`modelfleet.agent.head`) drive the same :class:`Scheduler`; each owns only the doing: a
local backend, or frames over sockets.

The cycle: :meth:`Scheduler.submit` admits a stream or returns a :class:`Refusal`;
:meth:`Scheduler.schedule` seats queued streams in free slots and returns the :class:`Step` each
microbatch can send now; the caller computes a step (or sends it down the pipeline) and hands the
sampled tokens to :meth:`Scheduler.complete`, which returns the :class:`Token` and
:class:`Finish` events to deliver. A finished stream's slot is free at once: the caller releases
it on its backends before it sends the next step (a pipeline's control messages travel in order
with its frames, so no stage sees the slot's next stream before the release).

Speculation (a :class:`~engine.speculative.Speculator`): a decode row may carry the stream's
proposals after it (a verify window, every row's output wanted). The tail verifies them exactly
and returns the accepted ones plus one token; :meth:`Scheduler.complete` commits them under the
same stop and length rules and returns a :class:`Rewind` when the backends hold rejected rows.

Invariants:
- A stream's rows are scheduled in position order and each position once; at most one row whose
  token is due (its *sample row*) is in flight per stream: a decode row needs the last token.
- A microbatch (the streams that share frames) sends a frame when nothing of it is in flight, or,
  while fewer than ``frames_in_flight`` of its frames are, when one of its ready streams still has
  prompt rows and the pipeline holds fewer than max(microbatches, frames_in_flight) frames:
  an idle microbatch's share of the pipeline streams another's prefill windows back to back
  (a long prompt alone does not wait a round trip per window), a busy pipeline is not queued
  deeper, and decode rows re-join one frame.
- Tokens are matched to streams through the step that carried their rows, never through slots
  alone, so a token computed for a stream that has since finished (and whose slot was reused)
  is dropped. A step is in flight until its tokens come back, it fails, or all its streams end.

Replay (a pipeline stage lost): :meth:`Scheduler.pause` drops every step in flight and keeps
every stream with its committed tokens; nothing is scheduled while paused. :meth:`Scheduler.resume`
(the chain is whole again) names every slot to release on every stage, and each seated stream
prefills again its prompt plus its committed output (:attr:`StreamState.prefill`), the last
row's token due, then decodes on: the next token is the one an undisturbed run would sample
next. A stream's ``replays`` and ``generated`` say where its sampler stands (a seeded sampler
skips the draws already made). :meth:`Scheduler.expire_paused` fails the streams of a pause that
outlived its deadline; their slots are released everywhere when the chain heals.
"""

from __future__ import annotations

import enum
import itertools
from collections import deque
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from .errors import ErrorCode, InputError
from .frame import Frame
from .sampling import SamplingParams, TokenLogprobs
from .speculative.speculator import Speculator

LEARN_CONTEXT = 8  # tokens before an emitted one that a learning proposer is shown


class FinishReason(enum.StrEnum):
    STOP = "stop"  # a stop token was sampled (it is not part of the output)
    LENGTH = "length"  # max_tokens reached, or the context is full
    CANCELLED = "cancelled"  # the client gave up
    ERROR = "error"  # the stream failed; its Finish carries a code and a message


@dataclass(frozen=True)
class SchedulerConfig:
    max_streams: int  # KV slots: streams seated at once
    context_length: int  # positions per stream, prompt and output together
    vocab_size: int
    eos_token_ids: tuple[int, ...] = ()  # stop tokens of a stream that names none
    window_rows: int = 8  # prompt rows of one stream per frame
    microbatches: int = 1  # sets of streams whose frames travel separately
    frames_in_flight: int = 1  # per microbatch, while prompt rows remain (see the module's invariants)
    max_queue: int = 64  # streams waiting for a slot
    queue_timeout_seconds: float = 30.0

    def __post_init__(self) -> None:
        for name in ("max_streams", "context_length", "vocab_size", "window_rows", "microbatches", "frames_in_flight"):
            if getattr(self, name) < 1:
                raise InputError(f"scheduler {name}={getattr(self, name)} must be >= 1")

    @property
    def streams_per_microbatch(self) -> int:
        return -(-self.max_streams // self.microbatches)


@dataclass(eq=False)
class StreamState:
    """One stream's bookkeeping; ``key`` is the caller's name for it (a request id, an index)."""

    key: Hashable
    prompt: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    arrived_at: float
    slot: int = -1  # -1 while queued
    microbatch: int = -1
    scheduled: int = 0  # positions sent to the backend: prompt windows, then decode rows
    generated: list[int] = field(default_factory=list)  # committed output tokens
    awaiting: bool = False  # a sample row of this stream is in flight
    finish: FinishReason | None = None
    prefill: list[int] = field(default_factory=list)  # rows to prefill: the prompt, or after a replay
    # the prompt and the output committed before it (the last row's token is due)
    replays: int = 0  # times the stream was prefilled again after a lost stage

    def __post_init__(self) -> None:
        if not self.prefill:
            self.prefill = list(self.prompt)

    @property
    def done(self) -> bool:
        return self.finish is not None

    @property
    def confirmed(self) -> int:
        """Positions every stage holds for good: the prompt and the committed output."""
        return len(self.prompt) + len(self.generated)

    @property
    def prefilling(self) -> bool:
        return self.scheduled < len(self.prefill)


@dataclass(frozen=True)
class Refusal:
    code: ErrorCode
    message: str


@dataclass(frozen=True)
class Token:
    stream: StreamState
    token_id: int
    logprobs: TokenLogprobs | None = None  # when the stream asked for them (SamplingParams.logprobs)


@dataclass(frozen=True)
class Finish:
    stream: StreamState
    reason: FinishReason
    code: ErrorCode | None = None  # set when reason is ERROR
    message: str = ""


@dataclass(frozen=True)
class Rewind:
    """The backends hold proposals of ``stream`` that verification rejected: keep positions
    [0, position) of its slot on every stage before its next step."""

    stream: StreamState
    position: int


Event = Token | Finish | Rewind


@dataclass(frozen=True)
class Replay:
    """What :meth:`Scheduler.resume` decided: release ``slots`` on every stage before the next
    step; ``streams`` prefill again ``tokens`` rows in all after ``paused_seconds`` paused."""

    slots: tuple[int, ...]
    streams: int
    tokens: int
    paused_seconds: float


@dataclass(frozen=True)
class Step:
    """One frame's worth of rows: stream rows in order, the rows whose token is due, new streams."""

    id: int
    microbatch: int
    slots: tuple[int, ...]
    positions: tuple[int, ...]
    token_ids: tuple[int, ...]
    output_rows: tuple[int, ...]  # rows whose output is wanted (a token, or a prompt row's scores), increasing
    sampled: tuple[StreamState, ...]  # the stream of each row whose token is due, in row order
    streams: tuple[StreamState, ...]  # every stream with rows here, in row order
    new_streams: tuple[StreamState, ...]  # streams whose first rows are here: the tail starts their samplers
    sent_at: float
    proposing_seconds: float = 0.0  # what proposing this step's tokens took (the speculator's D)
    draft_probs: Mapping[int, torch.Tensor] = field(default_factory=dict)  # by slot: q [window's proposals, V]
    # of proposals a draft sampled (the verifier needs them; absent: one-hot q)

    @property
    def rows(self) -> int:
        return len(self.slots)

    @property
    def decode_only(self) -> bool:
        """Only decode rows (each stream's last token, and the proposals after it when speculating:
        a verify window), each sampled, none starting: a step a fixed-shape (graph) decode can run."""
        return len(self.sampled) == self.rows and not self.new_streams

    def frame(self) -> Frame:
        return Frame(
            torch.tensor(self.slots, dtype=torch.int64),
            torch.tensor(self.positions, dtype=torch.int64),
            token_ids=torch.tensor(self.token_ids, dtype=torch.int64),
            output_rows=torch.tensor(self.output_rows, dtype=torch.int64),
            decode_only=self.decode_only,
        )


class Scheduler:
    def __init__(self, config: SchedulerConfig, speculator: Speculator | None = None):
        """``speculator``: propose tokens on decode rows (speculative decoding), or None."""
        self.config = config
        self.speculator = speculator
        self.queue: deque[StreamState] = deque()
        self.free_slots = list(range(config.max_streams))
        self.microbatches: list[list[StreamState]] = [[] for _ in range(config.microbatches)]
        self.in_flight: dict[int, Step] = {}
        self._ids = itertools.count()
        self.paused_since: float | None = None  # a stage was lost: nothing is scheduled until resume()

    # ---- admission -------------------------------------------------------------------------

    def submit(
        self, key: Hashable, prompt: Sequence[int], params: SamplingParams, now: float, output: Sequence[int] = ()
    ) -> StreamState | Refusal:
        """``output``: a continuation's output so far (the stream ran on another pipeline, which
        failed it): it is committed already, prefilled after the prompt like a replay's, and the
        stream goes on under the same length rules and sampler position as an undisturbed run."""
        refusal = self.refusal([*prompt, *output])
        if refusal is None and output and len(output) >= params.max_tokens:
            message = f"the continuation has {len(output)} output tokens, not fewer than max_tokens={params.max_tokens}"
            refusal = Refusal(ErrorCode.INPUT, message)
        if refusal is not None:
            return refusal
        stop = params.stop_token_ids if params.stop_token_ids is not None else self.config.eos_token_ids
        stream = StreamState(key, list(prompt), params, frozenset(stop), now, generated=list(output))
        stream.prefill = [*prompt, *output]
        self.queue.append(stream)
        return stream

    def refusal(self, prompt: Sequence[int]) -> Refusal | None:
        config = self.config
        if len(self.queue) >= config.max_queue and not self.free_slots:
            return Refusal(
                ErrorCode.BUSY,
                f"all {config.max_streams} streams are busy and the queue holds {config.max_queue}; retry later",
            )
        if not prompt:
            return Refusal(ErrorCode.INPUT, "the prompt is empty; give at least one token")
        if len(prompt) >= config.context_length:
            return Refusal(
                ErrorCode.CONTEXT_LENGTH,
                f"the prompt has {len(prompt)} tokens; the context length is {config.context_length} "
                "(the prompt must be shorter to leave room for generated tokens)",
            )
        if bad := [t for t in prompt if not 0 <= t < config.vocab_size]:
            return Refusal(ErrorCode.INPUT, f"token id {bad[0]} is outside the vocabulary [0, {config.vocab_size})")
        return None

    def expire(self, now: float) -> list[Finish]:
        """Queued streams that waited over ``queue_timeout_seconds`` for a slot (time paused for a
        lost stage does not count: the replay deadline bounds it, :meth:`expire_paused`)."""
        if self.paused:
            return []
        limit, expired = self.config.queue_timeout_seconds, []
        while self.queue and now - self.queue[0].arrived_at > limit:
            stream = self.queue.popleft()
            message = f"waited over {limit:.0f} s for a free slot (queue_timeout_seconds)"
            expired.append(self._finish(stream, FinishReason.ERROR, ErrorCode.QUEUE_TIMEOUT, message))
        return expired

    # ---- stepping --------------------------------------------------------------------------

    def schedule(self, now: float) -> list[Step]:
        """Seat queued streams, then the next step of every microbatch that may send one."""
        if self.paused:
            return []
        self._seat()
        steps = []
        flying = {step.microbatch for step in self.in_flight.values()}
        order = sorted(range(len(self.microbatches)), key=lambda m: m in flying)  # idle microbatches first
        for index in order:
            streams = self.microbatches[index]
            if self._may_send(index, streams):
                steps.append(self._step(index, [s for s in streams if not s.awaiting], now))
        return steps

    def _seat(self) -> None:
        per = self.config.streams_per_microbatch
        while self.queue and self.free_slots:
            index = min(range(len(self.microbatches)), key=lambda m: len(self.microbatches[m]))
            if len(self.microbatches[index]) >= per:
                return
            stream = self.queue.popleft()
            stream.slot, stream.microbatch = self.free_slots.pop(0), index
            self.microbatches[index].append(stream)

    def _may_send(self, index: int, streams: list[StreamState]) -> bool:
        ready = [s for s in streams if not s.awaiting]
        if not ready:
            return False
        flying = sum(1 for step in self.in_flight.values() if step.microbatch == index)
        if flying == 0:
            return True
        room = len(self.in_flight) < max(self.config.microbatches, self.config.frames_in_flight)
        return room and flying < self.config.frames_in_flight and any(s.prefilling for s in ready)

    def _step(self, index: int, streams: list[StreamState], now: float) -> Step:
        slots: list[int] = []
        positions: list[int] = []
        tokens: list[int] = []
        output_rows: list[int] = []
        sampled: list[StreamState] = []
        new: list[StreamState] = []
        drafts = self._drafts([s for s in streams if not s.prefilling])
        proposing = self.speculator.last_proposing_seconds if drafts and self.speculator is not None else 0.0
        probs = self.speculator.proposal_probs if drafts and self.speculator is not None else {}
        draft_probs = {s.slot: probs[s][: len(d)] for s, d in drafts.items() if d and s in probs}
        for stream in streams:
            if stream.scheduled == 0:
                new.append(stream)
            if stream.prefilling:
                rows = stream.prefill[stream.scheduled : stream.scheduled + self.config.window_rows]
                due = 1  # the window that ends the prompt: its last row's token is due
            else:  # a decode row, and the proposals after it (a verify window): every row's token is due
                rows = [stream.generated[-1], *drafts.get(stream, ())]
                due = len(rows)
            first = stream.scheduled if stream.prefilling else stream.confirmed - 1
            slots += [stream.slot] * len(rows)
            positions += range(first, first + len(rows))
            tokens += rows
            stream.scheduled = first + len(rows)
            if stream.params.prompt_logprobs is not None and not stream.replays and first < len(stream.prompt) - 1:
                scored = min(
                    len(rows), len(stream.prompt) - 1 - first
                )  # prompt rows but its last: the tail scores them
                output_rows += range(len(slots) - len(rows), len(slots) - len(rows) + scored)
            if not stream.prefilling:
                stream.awaiting = True
                output_rows += range(len(slots) - due, len(slots))
                sampled += [stream] * due
        step = Step(
            next(self._ids), index, tuple(slots), tuple(positions), tuple(tokens), tuple(output_rows),
            tuple(sampled), tuple(streams), tuple(new), now, proposing, draft_probs,
        )  # fmt: skip
        self.in_flight[step.id] = step
        return step

    def _drafts(self, decoding: list[StreamState]) -> dict[StreamState, list[int]]:
        """Each decoding stream's proposals, at the widths the speculator chose together."""
        decoding = [s for s in decoding if s.params.speculates]
        if self.speculator is None or not decoding:
            return {}
        room = [self.config.context_length - s.confirmed for s in decoding]  # proposals must fit the context
        chosen = self.speculator.drafts(
            [(s, [*s.prompt, *s.generated]) for s in decoding], [s.params for s in decoding]
        )
        return {s: d[: max(0, r)] for s, d, r in zip(decoding, chosen, room, strict=True)}

    def complete(
        self,
        step_id: int,
        tokens: Mapping[int, int | Sequence[int]],
        now: float | None = None,
        logprobs: Mapping[int, TokenLogprobs] | None = None,
    ) -> list[Event]:
        """The tokens a step emitted, by slot: one token, or a verify window's accepted proposals
        and its one token from the target. A sampled stream missing from ``tokens`` was failed on
        its own (:meth:`fail`); a step no longer in flight was failed whole. ``now``: when the
        result arrived (the speculator measures step costs from it). ``logprobs``: by slot, of a
        lone token (streams that ask for them are not speculated)."""
        step = self.in_flight.pop(step_id, None)
        if step is None:
            return []
        if now is not None and self.speculator is not None and len(step.sampled) == step.rows:
            # V(k) from steps of decode rows and verify windows only, the proposing (D) taken out
            self.speculator.step_time(step.rows, now - step.sent_at - step.proposing_seconds)
        events: list[Event] = []
        for stream in dict.fromkeys(step.sampled):  # each stream once, in row order
            if stream.done:
                continue
            stream.awaiting = False
            got = tokens.get(stream.slot)
            if got is not None:
                emitted = [got] if isinstance(got, int) else list(got)
                reported = None if logprobs is None else logprobs.get(stream.slot)
                events += self._accept_window(stream, step.sampled.count(stream) - 1, emitted, reported)
        return events

    def _accept_window(
        self, stream: StreamState, proposed: int, emitted: list[int], logprobs: TokenLogprobs | None = None
    ) -> list[Event]:
        """A verify window of ``proposed`` proposals emitted ``emitted``: commit them in order
        under the stop and length rules, then rewind what the backends hold beyond the new
        confirmed prefix (all but the newest token, which the next step feeds)."""
        held = stream.confirmed + proposed  # positions the backends hold for the stream now
        if self.speculator is not None:
            self.speculator.record(stream, proposed, len(emitted) - 1)
        events: list[Event] = []
        for token in emitted:
            events += self.accept(stream, token, logprobs)
            if stream.done:
                return events
        if held > stream.confirmed - 1:
            events.append(Rewind(stream, stream.confirmed - 1))
        return events

    def accept(self, stream: StreamState, token: int, logprobs: TokenLogprobs | None = None) -> list[Event]:
        """The stop and length rules, written once."""
        if token in stream.stop_ids:
            return [self._finish(stream, FinishReason.STOP)]
        if self.speculator is not None:
            self.speculator.learn(
                (stream.prompt[-LEARN_CONTEXT:] + stream.generated[-LEARN_CONTEXT:])[-LEARN_CONTEXT:], token
            )
        stream.generated.append(token)
        events: list[Event] = [Token(stream, token, logprobs)]
        if len(stream.generated) >= stream.params.max_tokens or stream.confirmed >= self.config.context_length:
            events.append(self._finish(stream, FinishReason.LENGTH))
        return events

    # ---- failures --------------------------------------------------------------------------

    def fail(self, stream: StreamState, code: ErrorCode, message: str) -> Finish | None:
        """One stream fails; the others of its steps go on. None: it had finished already."""
        return None if stream.done else self._finish(stream, FinishReason.ERROR, code, message)

    def cancel(self, stream: StreamState) -> Finish | None:
        return None if stream.done else self._finish(stream, FinishReason.CANCELLED)

    def fail_step(self, step_id: int, code: ErrorCode, message: str) -> list[Finish]:
        """A step's result will not come (its frame was refused whole): its streams fail."""
        step = self.in_flight.pop(step_id, None)
        if step is None:
            return []
        return [f for s in step.streams if (f := self.fail(s, code, message)) is not None]

    def fail_stalled(self, now: float, silent_seconds: float, code: ErrorCode, message: str) -> list[Finish]:
        """Every step in flight for longer than ``silent_seconds`` fails with its streams."""
        stalled = [step.id for step in self.in_flight.values() if now - step.sent_at > silent_seconds]
        return [finish for step_id in stalled for finish in self.fail_step(step_id, code, message)]

    # ---- replay after a lost stage ---------------------------------------------------------

    @property
    def paused(self) -> bool:
        return self.paused_since is not None

    def pause(self, now: float) -> None:
        """A stage was lost: its frames (and so every step in flight) are gone; streams stay."""
        if self.paused_since is None:
            self.paused_since = now
        self.in_flight.clear()
        for streams in self.microbatches:
            for stream in streams:
                stream.awaiting = False

    def resume(self, now: float) -> Replay:
        """The chain is whole again: every slot is to be released on every stage (the surviving
        stages still hold the old state, a replacement holds none), and every seated stream
        prefills its prompt and committed output again."""
        assert self.paused_since is not None, "resume() without pause()"
        seated = [s for streams in self.microbatches for s in streams]
        for stream in seated:
            stream.prefill = [*stream.prompt, *stream.generated]
            stream.scheduled, stream.awaiting = 0, False
            stream.replays += 1
        paused, self.paused_since = now - self.paused_since, None
        for stream in self.queue:  # time queued while paused does not count toward the queue timeout
            stream.arrived_at += now - max(stream.arrived_at, now - paused)
        tokens = sum(len(s.prefill) for s in seated)
        return Replay(tuple(range(self.config.max_streams)), len(seated), tokens, paused)

    def expire_paused(self, now: float, replay_timeout_seconds: float) -> list[Finish]:
        """Seated streams of a pause longer than ``replay_timeout_seconds`` fail (the pause goes
        on: the slots are released everywhere when the chain heals)."""
        if self.paused_since is None or now - self.paused_since <= replay_timeout_seconds:
            return []
        message = (f"a pipeline stage was lost and the pipeline did not heal within {replay_timeout_seconds:g} s "
                   "(serving.replay_timeout_seconds); retry the request")  # fmt: skip
        waiting = [*(s for streams in self.microbatches for s in streams), *self.queue]
        return [f for s in waiting if (f := self.fail(s, ErrorCode.REPLAY_TIMEOUT, message)) is not None]

    @property
    def waiting_for_replay(self) -> int:
        """Streams that hold a slot while the pipeline is paused."""
        return self.active if self.paused else 0

    def _finish(
        self, stream: StreamState, reason: FinishReason, code: ErrorCode | None = None, message: str = ""
    ) -> Finish:
        stream.finish = reason
        if self.speculator is not None:
            self.speculator.forget(stream)
        if stream.slot < 0:
            if stream in self.queue:
                self.queue.remove(stream)
        else:
            self.microbatches[stream.microbatch].remove(stream)
            self.free_slots.append(stream.slot)
            self.free_slots.sort()
        for step_id in [i for i, step in self.in_flight.items() if all(s.done for s in step.streams)]:
            del self.in_flight[step_id]  # nothing of it is awaited any more
        return Finish(stream, reason, code, message)

    # ---- what the caller reports -----------------------------------------------------------

    @property
    def active(self) -> int:
        return sum(len(streams) for streams in self.microbatches)

    @property
    def idle(self) -> bool:
        return not self.queue and not self.active
