"""Tensor-parallel stages: rank 0 of a stage drives the other ranks of its tensor group.

A stage with ``tp_size`` > 1 runs one process per tensor rank. Rank 0 (the leader) is the stage
as the pipeline sees it: frame socket, HTTP, the head's scheduler at stage 0, sampling at the
tail. Ranks r > 0 (followers) serve no sockets but their own HTTP; they hold their share of the
stage's layers (:func:`modelfleet.engine.tensor_parallel.split_for_rank`) and run every engine
call the leader runs, in the same order, because each layer's all-reduce is a collective.

Before each engine call that computes or changes state (forward a frame, release or rewind a
slot, allocate the KV cache) the leader broadcasts a :class:`Command` over torch.distributed,
as int64 tensors only (no pickle): a header of HEADER_WORDS words, then, for a frame, its slots,
positions and token ids or hidden states (and the rows' token ids with them, for a family that
routes by token), whose sizes, residual streams and dtype the header gave. Every rank's
output is identical after the reduces, so the leader uses its own. An idle leader broadcasts a
heartbeat every ``heartbeat_seconds`` so that a follower's wait never reaches the collective
timeout while its leader lives.

Failures: a refusal by the engine (a :class:`ModelfleetError` raised before any collective,
from state every rank shares) happens on every rank alike and leaves the group in step. Any
other failure of a broadcast or a reduce means a rank is gone or stuck: the leader marks the
group lost (:class:`TensorGroupLost`, a ModelfleetError the stage already turns into failed
streams), and a follower exits with the error, so that the ranks are replaced together.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import torch
import torch.distributed as dist

from ..engine.backend import StageBackend
from ..engine.errors import ErrorCode, ModelfleetError
from ..engine.frame import Frame
from ..engine.kvcache import SlotState, SlotTable
from ..engine.spec import ModelSpec
from ..engine.tensor_parallel import TensorGroup, close_tensor_group

log = logging.getLogger("modelfleet.agent.tensor")
T = TypeVar("T")

HEADER_WORDS = 8  # op, rows, payload, hidden width, dtype code, arg0, arg1, arg2
MAX_ROWS = 1 << 20
MAX_WIDTH = 1 << 16
MAX_STREAMS = 64  # residual streams per row (DeepSeek-V4's hc_mult): hidden [R, streams, width]
# hidden states travel in their own dtype; token ids, slots and positions are int64
DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


def rendezvous_namespace(secret_key: bytes | None, plan_hash: str, group_index: int, stage_index: int) -> str:
    """The prefix of every key a stage's tensor group writes to its rendezvous store (torch's
    TCPStore, which has no authentication of its own): an HMAC of the fleet's CURVE secret key, so
    only the ranks holding the fleet's keys know it; "" without keys (a fleet on plain TCP)."""
    if secret_key is None:
        return ""
    message = f"modelfleet tensor rendezvous {plan_hash} {group_index} {stage_index}".encode()
    return hmac.new(secret_key, message, hashlib.sha256).hexdigest() + "/"


class TensorGroupLost(ModelfleetError):
    """A rank of a stage's tensor group stopped answering; the stage cannot compute until restarted."""

    code = ErrorCode.UNAVAILABLE


class CommandError(ModelfleetError):
    """A command header that no leader sends (a bug or a mismatched version of modelfleet)."""


class Op(enum.IntEnum):
    HEARTBEAT = 0  # nothing to run; keeps the followers' wait under the collective timeout
    # frame: slots, positions, token ids or hidden states (then, if arg1 is 1, the rows' token ids too);
    # arg0: output rows (+1), then them; arg2: hidden streams per row (0: hidden is [R, width])
    FORWARD = 1
    RELEASE = 2  # arg0: slot
    REWIND = 3  # arg0: slot, arg1: position
    ALLOCATE = 4  # arg0: max_slots, arg1: max_context, arg2: KV budget bytes (0: none)
    STOP = 5  # the leader is shutting down; followers exit cleanly


class Payload(enum.IntEnum):
    NONE = 0
    TOKEN_IDS = 1
    HIDDEN = 2


@dataclass(frozen=True)
class Command:
    op: Op
    frame: Frame | None = None  # FORWARD only
    args: tuple[int, int, int] = (0, 0, 0)


class Channel(Protocol):
    """Broadcast from rank 0: the leader sends ``t``; every other rank receives into ``t``
    (same dtype and shape, which the protocol fixes before each tensor)."""

    def broadcast(self, t: torch.Tensor) -> None: ...


@dataclass(frozen=True)
class DistChannel:
    """Broadcasts over the group's torch.distributed group. Commands are CPU tensors; NCCL (a
    group on CUDA) carries only device tensors, so there each one travels through a device copy."""

    group: TensorGroup
    device: torch.device = torch.device("cpu")

    def broadcast(self, t: torch.Tensor) -> None:
        if self.device.type != "cuda":
            dist.broadcast(t, src=0, group=self.group.process_group)
            return
        staged = t.to(self.device)
        dist.broadcast(staged, src=0, group=self.group.process_group)
        t.copy_(staged)


# ---- the wire format ------------------------------------------------------------------------


def encode_header(command: Command) -> torch.Tensor:
    """int64 [HEADER_WORDS]: op, rows, payload, hidden width, dtype code, arg0, arg1, arg2."""
    rows = payload = width = dtype_code = 0
    frame = command.frame
    if frame is not None:
        rows = int(frame.slots.shape[0])
        if frame.hidden is not None:
            payload, width = Payload.HIDDEN, int(frame.hidden.shape[-1])
            if frame.hidden.dtype not in DTYPE_CODES:
                raise CommandError(f"hidden states of dtype {frame.hidden.dtype} cannot be sent to tensor ranks")
            dtype_code = DTYPE_CODES[frame.hidden.dtype]
        elif frame.token_ids is not None:
            payload = Payload.TOKEN_IDS
    args = command.args
    if frame is not None:  # 0: every row is an output row; n + 1: the n rows that follow the payload
        ids_too = int(frame.hidden is not None and frame.token_ids is not None)
        streams = int(frame.hidden.shape[1]) if frame.hidden is not None and frame.hidden.dim() == 3 else 0
        args = (0 if frame.output_rows is None else int(frame.output_rows.shape[0]) + 1, ids_too, streams)
    return torch.tensor([int(command.op), rows, int(payload), width, dtype_code, *args], dtype=torch.int64)


def payload_tensors(command: Command) -> list[torch.Tensor]:
    """What follows the header, in order: slots [R], positions [R], token ids [R] or hidden [R, H]
    (or [R, streams, H]) and then, when sent with hidden states, the token ids [R]; then the
    output rows [N] when the frame names N > 0 of them."""
    frame = command.frame
    if frame is None:
        return []
    out = [frame.slots.to(torch.int64), frame.positions.to(torch.int64)]
    if frame.hidden is not None:
        out.append(frame.hidden)
    if frame.token_ids is not None:
        out.append(frame.token_ids.to(torch.int64))
    if frame.output_rows is not None and frame.output_rows.numel():
        out.append(frame.output_rows.to(torch.int64))
    return [t.contiguous().cpu() for t in out]


def send_command(channel: Channel, command: Command) -> None:
    channel.broadcast(encode_header(command))
    for t in payload_tensors(command):
        channel.broadcast(t)


def receive_command(channel: Channel) -> Command:
    header = torch.zeros(HEADER_WORDS, dtype=torch.int64)
    channel.broadcast(header)
    op, rows, payload, width, dtype_code, *args = (int(w) for w in header.tolist())
    command = _check_header(op, rows, payload, width, dtype_code, args[0])
    if command.op == Op.FORWARD and (args[1] not in (0, 1) or not 0 <= args[2] <= MAX_STREAMS):
        raise CommandError(f"tensor command's token-id flag {args[1]} or stream count {args[2]} is invalid")
    if command.op != Op.FORWARD:
        return Command(command.op, args=(args[0], args[1], args[2]))
    slots, positions = torch.empty(rows, dtype=torch.int64), torch.empty(rows, dtype=torch.int64)
    channel.broadcast(slots)
    channel.broadcast(positions)
    token_ids = hidden = None
    if payload == Payload.HIDDEN:
        streams = (args[2],) if args[2] else ()
        hidden = torch.empty(rows, *streams, width, dtype=DTYPES[dtype_code])
        channel.broadcast(hidden)
    if payload == Payload.TOKEN_IDS or args[1]:
        token_ids = torch.empty(rows, dtype=torch.int64)
        channel.broadcast(token_ids)
    output_rows = None
    if args[0] > 0:
        output_rows = torch.empty(args[0] - 1, dtype=torch.int64)
        if output_rows.numel():
            channel.broadcast(output_rows)
    return Command(Op.FORWARD, Frame(slots, positions, token_ids=token_ids, hidden=hidden, output_rows=output_rows))


def _check_header(op: int, rows: int, payload: int, width: int, dtype_code: int, output_rows: int) -> Command:
    """The header's sizes, validated before anything is allocated from them."""
    if op not in Op.__members__.values():
        raise CommandError(f"tensor command op {op} is unknown; ops are {[int(o) for o in Op]}")
    if Op(op) != Op.FORWARD:
        return Command(Op(op))
    if not 1 <= rows <= MAX_ROWS:
        raise CommandError(f"tensor command has {rows} rows, outside [1, {MAX_ROWS}]")
    if payload == Payload.HIDDEN and (not 1 <= width <= MAX_WIDTH or dtype_code not in DTYPES):
        raise CommandError(f"tensor command's hidden states [{rows}, {width}] of dtype code {dtype_code} are invalid")
    if payload not in (Payload.TOKEN_IDS, Payload.HIDDEN):
        raise CommandError(f"tensor command's frame payload {payload} is neither token ids nor hidden states")
    if not 0 <= output_rows <= rows + 1:
        raise CommandError(f"tensor command names {output_rows - 1} output rows of a {rows}-row frame")
    return Command(Op.FORWARD)


# ---- rank 0 ---------------------------------------------------------------------------------


@dataclass
class TensorStage:
    """Rank 0's backend: the stage's own backend (this rank's share) behind the calls the stage
    makes, each sent to the other ranks first. Reads (spec, slots, sizes, refusals) are local:
    every rank holds the same slot table, so they would all answer alike."""

    backend: StageBackend
    channel: Channel
    name: str  # "stage 1" in messages
    heartbeat_seconds: float = 1.0
    lost: str | None = None  # why the group is lost, once it is
    lost_at: float = 0.0
    last_sent: float = field(default_factory=time.monotonic)

    @property
    def spec(self) -> ModelSpec:
        return self.backend.spec

    @property
    def layer_start(self) -> int:
        return self.backend.layer_start

    @property
    def layer_end(self) -> int:
        return self.backend.layer_end

    @property
    def slots(self) -> SlotTable | None:
        return self.backend.slots

    @property
    def weights_bytes(self) -> int:
        return self.backend.weights_bytes

    @property
    def kv_bytes(self) -> int:
        return self.backend.kv_bytes

    @property
    def bytes_by_role(self) -> dict[str, dict[str, int]]:
        return self.backend.bytes_by_role

    def refusals(self, frame: Frame) -> dict[int, ModelfleetError]:
        return self.backend.refusals(frame)

    def forward(self, frame: Frame) -> torch.Tensor:
        if self.lost is not None:
            raise TensorGroupLost(self.lost)
        out = self._run(Command(Op.FORWARD, frame), lambda: self.backend.forward(frame))
        assert out is not None  # a lost group raised
        return out

    __call__ = forward

    def allocate_cache(self, max_slots: int, max_context: int, kv_budget_bytes: int | None = None) -> None:
        args = (max_slots, max_context, kv_budget_bytes or 0)
        self._run(
            Command(Op.ALLOCATE, args=args),
            lambda: self.backend.allocate_cache(max_slots, max_context, kv_budget_bytes),
        )

    def release(self, slot: int) -> None:
        """Kept locally even once the group is lost, so the head's slot bookkeeping stays whole."""
        self._state(Command(Op.RELEASE, args=(slot, 0, 0)), lambda: self.backend.release(slot))

    def rewind(self, slot: int, position: int) -> None:
        self._state(Command(Op.REWIND, args=(slot, position, 0)), lambda: self.backend.rewind(slot, position))

    def export_slot(self, slot: int) -> SlotState:
        raise CommandError(
            f"{self.name} is a tensor group: each rank holds a share of slot {slot}'s state, and moving a "
            "stream's state between tensor groups is not supported yet"
        )

    def import_slot(self, slot: int, state: SlotState) -> None:
        self.export_slot(slot)

    def heartbeat(self) -> None:
        """Called from the stage's loop: a heartbeat when nothing was sent for ``heartbeat_seconds``."""
        if self.lost is None and time.monotonic() - self.last_sent >= self.heartbeat_seconds:
            self._run(Command(Op.HEARTBEAT), lambda: None, raise_lost=False)

    def close(self) -> None:
        """Tell the followers to exit (best effort), then leave the group."""
        if self.lost is None:
            self._run(Command(Op.STOP), lambda: None, raise_lost=False)
        close_tensor_group()

    def _state(self, command: Command, call: Callable[[], None]) -> None:
        if self.lost is not None:
            call()
            return
        self._run(command, call, raise_lost=False)
        if self.lost is not None:
            call()

    def _run(self, command: Command, call: Callable[[], T], raise_lost: bool = True) -> T | None:
        try:
            send_command(self.channel, command)
            self.last_sent = time.monotonic()
            return call()
        except ModelfleetError:
            raise  # refused alike by every rank, before any collective: the group is in step
        except RuntimeError as exc:  # torch.distributed's errors (DistBackendError, timeouts)
            self.lost = f"a tensor rank of {self.name} stopped answering ({type(exc).__name__}: {exc})"[:2000]
            self.lost_at = time.monotonic()
            log.error("%s; the stage stops serving until its ranks are restarted", self.lost)
            if raise_lost:
                raise TensorGroupLost(self.lost) from exc
            return None


# ---- ranks r > 0 ----------------------------------------------------------------------------


class LeaderGone(ModelfleetError):
    """Rank 0 of the stage stopped sending commands; this rank exits so that it is restarted."""


@dataclass
class RankFollower:
    """A rank r > 0: receives each command from rank 0 and runs it on its own share."""

    backend: StageBackend
    channel: Channel
    rank: int
    on_command: Callable[[Command], None] = lambda _command: None  # after each command ran: status, metrics

    def serve(self, stopping: Callable[[], bool] = lambda: False) -> None:
        """Until the leader says STOP (or ``stopping()`` after a command); raises LeaderGone."""
        while not stopping():
            try:
                command = receive_command(self.channel)
            except RuntimeError as exc:
                raise LeaderGone(
                    f"tensor rank {self.rank} lost rank 0 of its stage ({type(exc).__name__}: {exc})"
                ) from exc
            if command.op == Op.STOP:
                log.info("rank 0 stopped; tensor rank %d exits", self.rank)
                return
            try:
                self.apply(command)
            except ModelfleetError as exc:  # rank 0 meets the same refusal and reports it
                log.warning("refused a %s command: %s", command.op.name, exc)
                continue
            self.on_command(command)

    def apply(self, command: Command) -> None:
        a0, a1, a2 = command.args
        if command.op == Op.FORWARD:
            assert command.frame is not None
            self.backend.forward(command.frame)
        elif command.op == Op.RELEASE:
            if self.backend.slots is not None and a0 < self.backend.slots.max_slots:
                self.backend.release(a0)
        elif command.op == Op.REWIND:
            self.backend.rewind(a0, a1)
        elif command.op == Op.ALLOCATE:
            self.backend.allocate_cache(a0, a1, a2 or None)
