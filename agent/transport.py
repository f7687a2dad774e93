"""The wire between modelfleet processes: typed, versioned messages over ZeroMQ multipart.

A message is one msgpack header frame, then one raw frame per tensor::

    [header, payload_0, payload_1, ...]
    header = {"v": PROTOCOL_VERSION, "type": "frame" | "tokens" | ..., <the type's fields>,
              "tensors": [{"name": str, "dtype": str, "shape": [int, ...]}, ...]}  # one per payload

Every message type is a frozen dataclass whose fields declare their wire schema (``wire(...)``);
the same schema checks a message built in Python and one decoded from bytes, so a sender cannot
put on the wire what a receiver would refuse. ``decode`` trusts nothing: the total and header
sizes, the protocol version, the type (a closed set), every field's type and range, the tensor
dtypes (an allow-list), ranks and shapes, and that each payload's byte count equals
``prod(shape) * itemsize`` exactly; anything else raises ``MalformedMessage(reason)``. Nothing
is unpickled, evaluated or imported: msgpack is read with ``raw=False``, ``strict_map_key=True``,
an ext hook that refuses extensions, and a walk that admits only None, bool, int, float, str,
list and dict. Decoded tensors own their storage (a copy of the frame).

Sockets between agents are authenticated and encrypted with ZeroMQ CURVE when keys are
configured: a server runs a ZAP authenticator that admits only the listed client public keys.

One module because the schema, the codec and socket security together are the wire contract,
and a reader checking what may arrive should find all of it in one place.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

import msgpack
import torch
import zmq
from zmq.auth.thread import ThreadAuthenticator

from ..engine.errors import ErrorCode, ModelfleetError
from ..engine.kvcache import SlotState
from ..engine.sampling import LOGPROB_FLOOR, MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams, TokenLogprobs
from ..engine.scheduler import FinishReason
from ..engine.speculative.config import DRAFT_SUPPORT, MAX_SPECULATIVE_TOKENS
from ..engine.speculative.verify import SparseQ
from ..engine.structured import MAX_SPEC_CHARS

# 3: frames carry token ids to every stage (hash routing, verify windows), several tokens a slot, heartbeats
# 4: log-probabilities (tokens, output), penalties, logit bias and min_tokens (stream_start, submit)
# 5: continuations (submit.continued), a replayed stream's output history (stream_start.output_position),
#    a slot's state from a drained stage to its replacement (slot_state)
# 6: a structured-output grammar spec, JSON text (stream_start, submit)
# 7: the tail's mtp proposals beside its tokens (tokens.proposals)
# 8: a draft's q of sampled proposals, to the tail (frame.draft_slots, draft_ids, draft_probs)
PROTOCOL_VERSION = 8
MAX_MESSAGE_BYTES = 64 << 20  # header + payloads; a prefill frame of 8 rows x 64 streams x 7168 fp32 is 14 MiB
ZMQ_DROP_FACTOR = 2  # libzmq's own limit (MAXMSGSIZE, per frame) is this many times MAX_MESSAGE_BYTES
MAX_HEADER_BYTES = 1 << 20
MAX_ROWS = 1 << 16  # rows in one frame
MAX_SLOTS = 1 << 16  # KV slots per stage
MAX_POSITION = (1 << 31) - 1
MAX_TOKEN_ID = (1 << 31) - 1
MAX_HIDDEN = 1 << 20
MAX_STOP_IDS = 256
MAX_NESTING = 8
INT64_MAX, UINT64_MAX = (1 << 63) - 1, (1 << 64) - 1
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8, "bool": torch.bool,
}  # fmt: skip
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
RESERVED_KEYS = frozenset({"v", "type", "tensors"})


class MalformedMessage(ModelfleetError, ValueError):
    """A message that does not match its schema; ``reason`` says which field and why."""

    code = ErrorCode.MALFORMED

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class TransportConfigError(ModelfleetError):
    """Keys or socket settings are missing or invalid."""


# ---- schema kinds: each checks (and normalises) one value, from Python or from the wire ------


def _type_name(value: object) -> str:
    return type(value).__name__


class _Scalar:
    """A kind whose checked value goes on the wire as it is."""

    def dump(self, value: Any) -> Any:
        return value


@dataclass(frozen=True)
class Int(_Scalar):
    lo: int = 0
    hi: int = INT64_MAX

    def check(self, value: object, where: str) -> int:
        if type(value) is not int:
            raise MalformedMessage(f"{where} must be an integer, got {_type_name(value)}")
        if not self.lo <= value <= self.hi:
            raise MalformedMessage(f"{where}={value} is outside [{self.lo}, {self.hi}]")
        return value


@dataclass(frozen=True)
class Float(_Scalar):
    lo: float
    hi: float
    lo_open: bool = False  # (lo, hi] instead of [lo, hi]

    def check(self, value: object, where: str) -> float:
        if type(value) not in (int, float) or not math.isfinite(value):  # type: ignore[arg-type]
            raise MalformedMessage(f"{where} must be a finite number, got {value!r}")
        number = float(value)  # type: ignore[arg-type]
        if not (self.lo < number if self.lo_open else self.lo <= number) or number > self.hi:
            bracket = "(" if self.lo_open else "["
            raise MalformedMessage(f"{where}={number} is outside {bracket}{self.lo}, {self.hi}]")
        return number


@dataclass(frozen=True)
class Bool(_Scalar):
    def check(self, value: object, where: str) -> bool:
        if type(value) is not bool:
            raise MalformedMessage(f"{where} must be true or false, got {_type_name(value)}")
        return value


@dataclass(frozen=True)
class Str(_Scalar):
    max_len: int
    pattern: str | None = None
    choices: frozenset[str] | None = None

    def check(self, value: object, where: str) -> str:
        if type(value) is not str:
            raise MalformedMessage(f"{where} must be a string, got {_type_name(value)}")
        if len(value) > self.max_len:
            raise MalformedMessage(f"{where} has {len(value)} characters, over the limit of {self.max_len}")
        if self.choices is not None and value not in self.choices:
            raise MalformedMessage(f"{where}={value!r} is not one of {', '.join(sorted(self.choices))}")
        if self.pattern is not None and re.fullmatch(self.pattern, value) is None:
            raise MalformedMessage(f"{where}={value!r} does not match {self.pattern}")
        return value


@dataclass(frozen=True)
class Optional:
    inner: Int | Float | Str | Bool | IntList

    def check(self, value: object, where: str) -> Any:
        return None if value is None else self.inner.check(value, where)

    def dump(self, value: Any) -> Any:
        return None if value is None else self.inner.dump(value)


@dataclass(frozen=True)
class IntList:
    max_len: int
    item: Int | Float = Int()
    unique: bool = False

    def check(self, value: object, where: str) -> tuple[Any, ...]:
        if type(value) not in (list, tuple):
            raise MalformedMessage(f"{where} must be a list, got {_type_name(value)}")
        items: Sequence[object] = value  # type: ignore[assignment]
        if len(items) > self.max_len:
            raise MalformedMessage(f"{where} has {len(items)} items, over the limit of {self.max_len}")
        checked = tuple(self.item.check(v, f"{where}[{i}]") for i, v in enumerate(items))
        if self.unique and len(set(checked)) != len(checked):
            raise MalformedMessage(f"{where} repeats a value: {list(checked)}")
        return checked

    def dump(self, value: Any) -> Any:
        return list(value)


@dataclass(frozen=True)
class FloatList(IntList):
    """A list of floats: ``item`` is a :class:`Float`."""


@dataclass(frozen=True)
class Records:
    """A list of records (a dataclass with wire fields), maps on the wire."""

    record: type
    max_len: int

    def check(self, value: object, where: str) -> tuple[Any, ...]:
        if type(value) not in (list, tuple):
            raise MalformedMessage(f"{where} must be a list, got {_type_name(value)}")
        items: Sequence[object] = value  # type: ignore[assignment]
        if len(items) > self.max_len:
            raise MalformedMessage(f"{where} has {len(items)} items, over the limit of {self.max_len}")
        return tuple(self._one(item, f"{where}[{i}]") for i, item in enumerate(items))

    def _one(self, item: object, where: str) -> Any:
        if isinstance(item, self.record):
            return item
        if type(item) is not dict:
            raise MalformedMessage(f"{where} must be a map, got {_type_name(item)}")
        return self.record(**_load_fields(self.record, item, where))

    def dump(self, value: Any) -> Any:
        return [_dump_fields(item) for item in value]


@dataclass(frozen=True)
class Tensor:
    """A payload frame: one of ``dtypes``, of rank ``ndim``."""

    dtypes: tuple[str, ...]
    ndim: int
    optional: bool = False
    max_ndim: int | None = None  # ranks ndim..max_ndim are accepted (None: exactly ndim)

    def check(self, value: object, where: str) -> torch.Tensor | None:
        if value is None:
            if not self.optional:
                raise MalformedMessage(f"{where} is required")
            return None
        if not isinstance(value, torch.Tensor):
            raise MalformedMessage(f"{where} must be a tensor, got {_type_name(value)}")
        if DTYPE_NAMES.get(value.dtype) not in self.dtypes:
            raise MalformedMessage(f"{where} has dtype {value.dtype}; allowed: {', '.join(self.dtypes)}")
        if not self.ndim <= value.dim() <= (self.max_ndim or self.ndim):
            ranks = self.ndim if self.max_ndim is None else f"{self.ndim} to {self.max_ndim}"
            raise MalformedMessage(f"{where} has rank {value.dim()} (shape {list(value.shape)}), needs {ranks}")
        return value


HeaderKind = Int | Float | Bool | Str | Optional | IntList | Records
Kind = HeaderKind | Tensor


def wire(kind: Kind, default: Any = MISSING) -> Any:
    """A dataclass field carrying its wire schema."""
    if default is MISSING:
        return field(metadata={"wire": kind})
    return field(default=default, metadata={"wire": kind})


def _kind(f: Any) -> Kind:
    return f.metadata["wire"]  # type: ignore[no-any-return]


@dataclass(frozen=True)
class _Schema:
    """A class's fields by kind, built once per class: decoding a token's message should not
    walk ``dataclasses.fields`` again."""

    all: tuple[tuple[str, Kind], ...]
    header: tuple[tuple[str, HeaderKind], ...]
    header_names: frozenset[str]
    tensors: dict[str, Tensor]


_SCHEMAS: dict[type, _Schema] = {}


def _schema(cls: type) -> _Schema:
    schema = _SCHEMAS.get(cls)
    if schema is None:
        every = tuple((f.name, _kind(f)) for f in fields(cls))
        header = tuple((name, kind) for name, kind in every if not isinstance(kind, Tensor))
        tensors = {name: kind for name, kind in every if isinstance(kind, Tensor)}
        schema = _SCHEMAS[cls] = _Schema(every, header, frozenset(name for name, _ in header), tensors)
    return schema


def _header_fields(cls: type) -> tuple[tuple[str, HeaderKind], ...]:
    return _schema(cls).header


def _load_fields(cls: type, data: dict[str, Any], where: str) -> dict[str, Any]:
    """Header values for ``cls``'s non-tensor fields: exactly its keys, each checked."""
    expected = _schema(cls).header_names
    if data.keys() == expected:
        return {name: kind.check(data[name], f"{where}.{name}") for name, kind in _header_fields(cls)}
    if unknown := sorted(set(data) - expected):
        raise MalformedMessage(f"{where} has unknown field(s) {unknown}")
    if missing := sorted(expected - set(data)):
        raise MalformedMessage(f"{where} lacks field(s) {missing}")
    return {name: kind.check(data[name], f"{where}.{name}") for name, kind in _header_fields(cls)}


def _dump_fields(obj: Any) -> dict[str, Any]:
    return {name: kind.dump(getattr(obj, name)) for name, kind in _header_fields(type(obj))}


class Checked:
    """Base of messages and records: every field is checked and normalised when built."""

    TYPE: ClassVar[str] = "record"

    def __post_init__(self) -> None:
        for name, kind in _schema(type(self)).all:
            object.__setattr__(self, name, kind.check(getattr(self, name), f"{self.TYPE}.{name}"))
        self.check()

    def check(self) -> None:
        """Relations between fields (shapes that must agree, values that must be unique)."""


# ---- messages -------------------------------------------------------------------------------

SLOT = Int(0, MAX_SLOTS - 1)
POSITION = Int(0, MAX_POSITION)
COUNTER = Int(0, INT64_MAX)
INT_IDS = Tensor(("int64",), 1)
PLAN_HASH = Str(64, pattern=r"[0-9a-f]{64}|")  # empty when the sender has no plan
ERROR_CODES = frozenset(code.value for code in ErrorCode)
ERROR_CODE = Str(32, choices=ERROR_CODES)
MICROBATCH = Int(0, MAX_SLOTS)


LOGPROB = Float(LOGPROB_FLOOR, 0.0)


@dataclass(frozen=True)
class LogprobsRecord(Checked):
    """The log-probabilities of the token in ``row`` (a message's row, or index in token_ids; a
    prompt position in ``prompt_logprobs``): its own and its most likely alternatives', most likely first."""

    TYPE: ClassVar[str] = "logprobs"
    row: int = wire(POSITION)
    logprob: float = wire(LOGPROB)
    top_ids: tuple[int, ...] = wire(IntList(MAX_LOGPROBS, Int(0, MAX_TOKEN_ID)), ())
    top_logprobs: tuple[float, ...] = wire(FloatList(MAX_LOGPROBS, LOGPROB), ())

    def check(self) -> None:
        if len(self.top_ids) != len(self.top_logprobs):
            raise MalformedMessage("logprobs.top_ids and logprobs.top_logprobs must have one entry each")

    @classmethod
    def of(cls, row: int, value: TokenLogprobs) -> LogprobsRecord:
        return cls(row=row, logprob=value.logprob, top_ids=value.top_ids, top_logprobs=value.top_logprobs)

    def value(self) -> TokenLogprobs:
        return TokenLogprobs(self.logprob, self.top_ids, self.top_logprobs)


@dataclass(frozen=True)
class ProposalRecord(Checked):
    """Tokens the tail's MTP layers propose for the stream in ``slot`` after its token at
    ``position`` (its newest): the head's next verify window of that stream carries them."""

    TYPE: ClassVar[str] = "proposal"
    slot: int = wire(SLOT)
    position: int = wire(POSITION)
    token_ids: tuple[int, ...] = wire(IntList(MAX_SPECULATIVE_TOKENS, Int(0, MAX_TOKEN_ID)), ())


@dataclass(frozen=True, eq=False, kw_only=True)
class SamplingFields(Checked):
    """The sampling parameters a stream travels with, one definition for stream_start (head ->
    tail) and submit (client -> head); the names are SamplingParams' own."""

    temperature: float = wire(Float(0.0, 100.0), 0.0)
    top_p: float = wire(Float(0.0, 1.0, lo_open=True), 1.0)
    top_k: int = wire(Int(0, MAX_TOKEN_ID), 0)
    min_p: float = wire(Float(0.0, 1.0), 0.0)
    seed: int | None = wire(Optional(Int(0, UINT64_MAX)), None)
    max_tokens: int = wire(Int(1, MAX_POSITION), 16)
    stop_token_ids: tuple[int, ...] | None = wire(Optional(IntList(MAX_STOP_IDS, Int(0, MAX_TOKEN_ID))), None)
    logprobs: int | None = wire(Optional(Int(0, MAX_LOGPROBS)), None)
    prompt_logprobs: int | None = wire(Optional(Int(0, MAX_LOGPROBS)), None)
    frequency_penalty: float = wire(Float(-2.0, 2.0), 0.0)
    presence_penalty: float = wire(Float(-2.0, 2.0), 0.0)
    repetition_penalty: float = wire(Float(0.0, 100.0, lo_open=True), 1.0)
    min_tokens: int = wire(Int(0, MAX_POSITION), 0)
    logit_bias_ids: tuple[int, ...] = wire(IntList(MAX_LOGIT_BIAS, Int(0, MAX_TOKEN_ID)), ())
    logit_bias_values: tuple[float, ...] = wire(FloatList(MAX_LOGIT_BIAS, Float(-100.0, 100.0)), ())
    grammar: str | None = wire(Optional(Str(MAX_SPEC_CHARS)), None)  # JSON text, parsed only by the tail's compiler

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(**{name: getattr(self, name) for name in _SAMPLING_FIELDS})


_SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingFields))


@dataclass(frozen=True, eq=True)
class StreamStart(SamplingFields):
    """Sampling parameters of a stream whose first rows are in this frame; the tail keeps them per slot."""

    TYPE: ClassVar[str] = "stream_start"
    slot: int = wire(SLOT)
    prompt_tokens: int = wire(Int(0, MAX_POSITION), 0)  # the tail scores rows before the prompt's last
    drawn: int = wire(Int(0, MAX_POSITION), 0)  # tokens sampled before: a replayed stream's sampler skips them
    # where the stream's output begins: the ``drawn`` tokens are the rows from here on, which the
    # tail takes back into the history its penalties read
    output_position: int = wire(Int(0, MAX_POSITION), 0)

    @classmethod
    def of(cls, slot: int, params: SamplingParams, prompt_tokens: int = 0, drawn: int = 0,
           output_position: int = 0) -> StreamStart:  # fmt: skip
        return cls(
            slot=slot,
            prompt_tokens=prompt_tokens,
            drawn=drawn,
            output_position=output_position,
            **{name: getattr(params, name) for name in _SAMPLING_FIELDS},
        )


class Message(Checked):
    TYPE: ClassVar[str]


@dataclass(frozen=True, eq=False)
class FrameMsg(Message):
    """Rows of independent streams for the next stage (see engine.frame.Frame), one step of one
    microbatch (the head's set of streams that share frames).

    Stage 0 sends ``token_ids`` [R] alone when the receiver embeds; later stages send ``hidden``
    float32 [R, *residual_shape] ([R, hidden_size], or DeepSeek-V4's [R, hc_mult, hidden_size]; the
    receiving stage checks the shape against its model, ``engine.residual``) with the rows' token ids
    (a family may route by token). ``output_rows`` are the rows whose output the tail samples (the
    last row of a finished prefill, every decode row, every speculative row); the tail computes
    the head for those rows only.
    """

    TYPE: ClassVar[str] = "frame"
    microbatch: int = wire(MICROBATCH)
    step: int = wire(COUNTER)
    slots: torch.Tensor = wire(INT_IDS)  # [R] int64
    positions: torch.Tensor = wire(INT_IDS)  # [R] int64
    token_ids: torch.Tensor | None = wire(Tensor(("int64",), 1, optional=True), None)  # [R]
    hidden: torch.Tensor | None = wire(Tensor(("float32",), 2, optional=True, max_ndim=3), None)  # [R, (S,) H]
    output_rows: tuple[int, ...] = wire(IntList(MAX_ROWS, Int(0, MAX_ROWS - 1)), ())
    new_streams: tuple[StreamStart, ...] = wire(Records(StreamStart, MAX_SLOTS), ())
    draft_slots: tuple[int, ...] = wire(IntList(MAX_SLOTS, SLOT, unique=True), ())
    draft_ids: torch.Tensor | None = wire(Tensor(("int64",), 2, optional=True), None)  # [P, N]
    draft_probs: torch.Tensor | None = wire(Tensor(("float32",), 2, optional=True), None)  # [P, N]

    def check(self) -> None:
        rows = _rows(self.TYPE, self.slots, MAX_ROWS)
        _same_rows(self.TYPE, rows, positions=self.positions, token_ids=self.token_ids, hidden=self.hidden)
        if self.token_ids is None and self.hidden is None:
            raise MalformedMessage("frame must carry token_ids, hidden, or both")
        if self.hidden is not None and not 1 <= math.prod(self.hidden.shape[1:]) <= MAX_HIDDEN:
            raise MalformedMessage(
                f"frame.hidden has rows of shape {list(self.hidden.shape[1:])}, outside [1, {MAX_HIDDEN}] values"
            )
        _values_in("frame.slots", self.slots, 0, MAX_SLOTS - 1)
        _values_in("frame.positions", self.positions, 0, MAX_POSITION)
        if self.token_ids is not None:
            _values_in("frame.token_ids", self.token_ids, 0, MAX_TOKEN_ID)
        if any(b <= a for a, b in zip(self.output_rows, self.output_rows[1:], strict=False)):
            raise MalformedMessage(f"frame.output_rows must increase strictly, got {list(self.output_rows)}")
        if self.output_rows and self.output_rows[-1] >= rows:
            raise MalformedMessage(f"frame.output_rows names row {self.output_rows[-1]} of a {rows}-row frame")
        _new_streams_in_frame(self.new_streams, self.slots)
        _draft_q_in_frame(self)

    def draft_q(self, slots: Iterable[int] | None = None) -> dict[int, SparseQ]:
        """Each draft window's q by slot (only ``slots``' where given)."""
        counts = _draft_rows(self)
        wanted = None if slots is None else set(slots)
        out, start = {}, 0
        for slot in self.draft_slots:
            if self.draft_ids is not None and self.draft_probs is not None and (wanted is None or slot in wanted):
                rows = slice(start, start + counts[slot])
                out[slot] = SparseQ(self.draft_ids[rows], self.draft_probs[rows])
            start += counts[slot]
        return out


def draft_q_fields(draft_q: dict[int, SparseQ]) -> dict[str, Any]:
    """A frame's draft fields for windows' q by slot (each window's rows in ``draft_slots``' order)."""
    if not draft_q:
        return {}
    qs = list(draft_q.values())  # of one vocabulary: rows of one N (SparseQ.of)
    return {"draft_slots": tuple(draft_q), "draft_ids": torch.cat([q.ids for q in qs]),
            "draft_probs": torch.cat([q.probs for q in qs])}  # fmt: skip


@dataclass(frozen=True, eq=False)
class TokensMsg(Message):
    """Sampled tokens, tail -> head: stream in ``slots[i]`` got ``token_ids[i]`` for ``positions[i]``.
    A verify window emits several tokens for its slot, in order (its accepted proposals and one
    token from the target). Sent for every frame the tail computes, with no rows when the frame
    sampled none; a stream refused on the way (an ``error`` message with its slot) has no row here."""

    TYPE: ClassVar[str] = "tokens"
    microbatch: int = wire(MICROBATCH)
    step: int = wire(COUNTER)
    slots: torch.Tensor = wire(INT_IDS)  # [N] int64
    positions: torch.Tensor = wire(INT_IDS)  # [N] int64
    token_ids: torch.Tensor = wire(INT_IDS)  # [N] int64
    logprobs: tuple[LogprobsRecord, ...] = wire(Records(LogprobsRecord, MAX_ROWS), ())  # rows that asked
    # prompt tokens' log-probabilities (record.row: the prompt position), of the streams in prompt_slots
    prompt_slots: tuple[int, ...] = wire(IntList(MAX_ROWS, SLOT), ())
    prompt_logprobs: tuple[LogprobsRecord, ...] = wire(Records(LogprobsRecord, MAX_ROWS), ())
    proposals: tuple[ProposalRecord, ...] = wire(Records(ProposalRecord, MAX_SLOTS), ())  # the tail's mtp

    def check(self) -> None:
        _records_name_rows(self.TYPE, self.logprobs, int(self.slots.shape[0]))
        if len(self.prompt_slots) != len(self.prompt_logprobs):
            raise MalformedMessage("tokens.prompt_slots and tokens.prompt_logprobs must have one entry each")
        # zero rows is valid: a frame of prefill windows that sampled nothing still completes
        rows = int(self.slots.shape[0])
        if rows > MAX_ROWS:
            raise MalformedMessage(f"tokens.slots has {rows} rows, over the limit of {MAX_ROWS}")
        _same_rows(self.TYPE, rows, positions=self.positions, token_ids=self.token_ids)
        _values_in("tokens.slots", self.slots, 0, MAX_SLOTS - 1)
        _values_in("tokens.positions", self.positions, 0, MAX_POSITION)
        _values_in("tokens.token_ids", self.token_ids, 0, MAX_TOKEN_ID)


@dataclass(frozen=True)
class ReleaseMsg(Message):
    """These streams are finished: free their slots on every stage."""

    TYPE: ClassVar[str] = "release"
    slots: tuple[int, ...] = wire(IntList(MAX_SLOTS, SLOT, unique=True))

    def check(self) -> None:
        if not self.slots:
            raise MalformedMessage("release.slots must name at least one slot")


@dataclass(frozen=True)
class RewindMsg(Message):
    """Keep positions [0, position) of the stream in ``slot``; drop the rest (a rejected draft)."""

    TYPE: ClassVar[str] = "rewind"
    slot: int = wire(SLOT)
    position: int = wire(POSITION)


@dataclass(frozen=True, eq=False)
class ProbeMsg(Message):
    """Liveness and latency; ``padding`` (uint8 [n]) makes it a bandwidth probe."""

    TYPE: ClassVar[str] = "probe"
    nonce: int = wire(Int(0, UINT64_MAX))
    sent_ns: int = wire(COUNTER)
    plan_hash: str = wire(PLAN_HASH, "")
    padding: torch.Tensor | None = wire(Tensor(("uint8",), 1, optional=True), None)


@dataclass(frozen=True)
class ProbeAckMsg(Message):
    """The answer to a probe, echoing its nonce and send time, with the answering stage's plan hash."""

    TYPE: ClassVar[str] = "probe_ack"
    nonce: int = wire(Int(0, UINT64_MAX))
    sent_ns: int = wire(COUNTER)
    group_index: int = wire(Int(0, MAX_SLOTS))
    stage_index: int = wire(Int(0, MAX_SLOTS))
    ready: bool = wire(Bool())
    plan_hash: str = wire(PLAN_HASH, "")


@dataclass(frozen=True)
class HeartbeatMsg(Message):
    """A stage is alive, stage -> head directly, every half second from a thread of its own, so
    it says nothing about the stage's frames: a busy stage beats, a stopped one does not."""

    TYPE: ClassVar[str] = "heartbeat"
    sent_ns: int = wire(COUNTER)
    group_index: int = wire(Int(0, MAX_SLOTS))
    stage_index: int = wire(Int(0, MAX_SLOTS))
    ready: bool = wire(Bool())
    plan_hash: str = wire(PLAN_HASH, "")
    # drawn at random when the process starts: a new one is a restarted stage, empty of the
    # streams it held (the head replays them), told apart from a slow one that kept them
    incarnation: int = wire(Int(0, UINT64_MAX), 0)


@dataclass(frozen=True)
class ErrorMsg(Message):
    """A failure to report to the head: of one stream of a frame (``slot`` set: only that stream
    fails, the frame's other rows go on), or of a whole frame (``slot`` None)."""

    TYPE: ClassVar[str] = "error"
    code: str = wire(ERROR_CODE)
    message: str = wire(Str(4096))
    slot: int | None = wire(Optional(SLOT), None)
    microbatch: int | None = wire(Optional(MICROBATCH), None)  # the frame that failed, when one did
    step: int | None = wire(Optional(COUNTER), None)


# ---- the head's client protocol (gateway or FleetClient <-> head, DEALER/ROUTER) ------------

REQUEST_ID = Int(0, INT64_MAX)
FINISH_REASONS = frozenset(reason.value for reason in FinishReason)


@dataclass(frozen=True, eq=False)
class SubmitMsg(Message, SamplingFields):
    """A new stream: prompt token ids and sampling parameters, named by the client's request id.
    A continuation (a stream that another pipeline failed after it sent tokens) has its output so
    far as the last ``continued`` prompt ids: the head counts them as the stream's output (length
    and stop rules, the sampler's draws and penalties), so it goes on as an undisturbed run would."""

    TYPE: ClassVar[str] = "submit"
    request_id: int = wire(REQUEST_ID)
    prompt_ids: torch.Tensor = wire(INT_IDS)  # [N] int64
    continued: int = wire(Int(0, MAX_POSITION), 0)

    def check(self) -> None:
        _rows(self.TYPE + ".prompt_ids", self.prompt_ids, MAX_POSITION)
        _values_in("submit.prompt_ids", self.prompt_ids, 0, MAX_TOKEN_ID)
        if self.continued >= self.prompt_ids.shape[0]:
            raise MalformedMessage(f"submit.continued={self.continued} must be below the {self.prompt_ids.shape[0]} "
                                   "prompt ids (the prompt itself comes first)")  # fmt: skip

    @classmethod
    def of(cls, request_id: int, prompt_ids: Sequence[int], params: SamplingParams, continued: int = 0) -> SubmitMsg:
        ids = torch.tensor(list(prompt_ids), dtype=torch.int64)
        fields = {n: getattr(params, n) for n in _SAMPLING_FIELDS}
        return cls(request_id=request_id, prompt_ids=ids, continued=continued, **fields)


@dataclass(frozen=True)
class OutputMsg(Message):
    """New tokens of a request, head -> client; ``finish_reason`` set on its last message. A
    request that ends in ``error`` carries a ``code`` (what a program acts on) and an ``error``
    message (what a person reads)."""

    TYPE: ClassVar[str] = "output"
    request_id: int = wire(REQUEST_ID)
    token_ids: tuple[int, ...] = wire(IntList(MAX_ROWS, Int(0, MAX_TOKEN_ID)), ())
    finish_reason: str | None = wire(Optional(Str(16, choices=FINISH_REASONS)), None)
    code: str | None = wire(Optional(ERROR_CODE), None)
    error: str = wire(Str(4096), "")
    logprobs: tuple[LogprobsRecord, ...] = wire(Records(LogprobsRecord, MAX_ROWS), ())  # by index in token_ids
    prompt_logprobs: tuple[LogprobsRecord, ...] = wire(Records(LogprobsRecord, MAX_ROWS), ())  # by prompt position

    def check(self) -> None:
        _records_name_rows(self.TYPE, self.logprobs, len(self.token_ids))
        if (self.finish_reason == "error") != (self.code is not None):
            raise MalformedMessage("output.code is set exactly when output.finish_reason is 'error'")


@dataclass(frozen=True)
class CancelMsg(Message):
    """The client gave up on a request: finish it and free its slot on every stage."""

    TYPE: ClassVar[str] = "cancel"
    request_id: int = wire(REQUEST_ID)


# ---- a slot's state, from a stage drained on purpose to its replacement ---------------------

MAX_STAGE_LAYERS = 4096


@dataclass(frozen=True)
class SlotEntry(Checked):
    """One cached tensor of a layer's slot state: its name, dtype and shape; its bytes follow the
    previous entry's in the message's payload."""

    TYPE: ClassVar[str] = "slot_entry"
    name: str = wire(Str(64, pattern=r"[A-Za-z0-9_.]+"))
    dtype: str = wire(Str(16, choices=frozenset(DTYPES)))
    shape: tuple[int, ...] = wire(IntList(8, Int(0, MAX_MESSAGE_BYTES)))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=DTYPES[self.dtype]).element_size()


@dataclass(frozen=True, eq=False)
class SlotStateMsg(Message):
    """One layer of one stream's state on a stage (``engine.kvcache.SlotState``: the slot's
    ``length`` and the layer's stored rows), one message per layer of the stage so each stays
    under the message limit: a stage drained on purpose hands its slots to its replacement with
    these (``slot_state_messages``, ``slot_state_of``) instead of the head replaying them."""

    TYPE: ClassVar[str] = "slot_state"
    slot: int = wire(SLOT)
    length: int = wire(POSITION)
    layer: int = wire(Int(0, MAX_STAGE_LAYERS - 1))  # of the stage's cached layers, in order
    layers: int = wire(Int(1, MAX_STAGE_LAYERS))  # the stage's cached layers: this many messages make the state
    entries: tuple[SlotEntry, ...] = wire(Records(SlotEntry, 64))
    payload: torch.Tensor = wire(Tensor(("uint8",), 1))  # the entries' bytes, in order

    def check(self) -> None:
        if self.layer >= self.layers:
            raise MalformedMessage(f"slot_state.layer={self.layer} must be below slot_state.layers={self.layers}")
        names = [e.name for e in self.entries]
        if len(set(names)) != len(names):
            raise MalformedMessage(f"slot_state.entries repeat a name: {names}")
        need = sum(e.nbytes for e in self.entries)
        if need != self.payload.numel():
            raise MalformedMessage(f"slot_state.payload has {self.payload.numel()} bytes; its entries need {need}")

    def tensors(self) -> dict[str, torch.Tensor]:
        """The layer's stored rows by name (views of the payload, which the decoded message owns)."""
        out, offset = {}, 0
        for e in self.entries:
            raw = self.payload[offset : offset + e.nbytes]
            out[e.name] = raw.view(DTYPES[e.dtype]).view(e.shape) if e.nbytes else torch.empty(e.shape)
            offset += e.nbytes
        return out


def slot_state_messages(slot: int, state: SlotState) -> list[SlotStateMsg]:
    """A slot's exported state as one message per layer (CPU tensors, as ``export_slot`` gives them)."""
    messages = []
    for index, layer in enumerate(state.layers):
        names = sorted(layer)
        entries = tuple(SlotEntry(name=n, dtype=DTYPE_NAMES[layer[n].dtype], shape=tuple(layer[n].shape))
                        for n in names)  # fmt: skip
        flat = [layer[n].contiguous().reshape(-1).view(torch.uint8) for n in names]
        payload = torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8)
        messages.append(SlotStateMsg(slot=slot, length=state.length, layer=index, layers=len(state.layers),
                                     entries=entries, payload=payload))  # fmt: skip
    return messages


def slot_state_of(messages: Sequence[SlotStateMsg]) -> SlotState:
    """The state those messages carry: every layer once, of one slot and one length."""
    if not messages:
        raise MalformedMessage("no slot_state message: a slot's state needs one per layer")
    first = messages[0]
    by_layer = {m.layer: m for m in messages}
    if sorted(by_layer) != list(range(first.layers)) or len(messages) != first.layers:
        raise MalformedMessage(f"slot_state messages cover layers {sorted(by_layer)}; the state has {first.layers}")
    if any((m.slot, m.length, m.layers) != (first.slot, first.length, first.layers) for m in messages):
        raise MalformedMessage("slot_state messages of one state must agree on slot, length and layers")
    return SlotState(first.length, tuple(by_layer[i].tensors() for i in range(first.layers)))


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls
    for cls in (
        FrameMsg, TokensMsg, ReleaseMsg, RewindMsg, ProbeMsg, ProbeAckMsg, HeartbeatMsg, ErrorMsg, SubmitMsg,
        OutputMsg, CancelMsg, SlotStateMsg,
    )
}  # fmt: skip


def _records_name_rows(where: str, records: tuple[LogprobsRecord, ...], rows: int) -> None:
    named = [r.row for r in records]
    if any(b <= a for a, b in zip(named, named[1:], strict=False)) or (named and named[-1] >= rows):
        raise MalformedMessage(f"{where}.logprobs must name distinct rows of its {rows}, in order; got {named}")


def _rows(where: str, slots: torch.Tensor, limit: int) -> int:
    rows = int(slots.shape[0])
    if not 1 <= rows <= limit:
        raise MalformedMessage(f"{where}.slots has {rows} rows, outside [1, {limit}]")
    return rows


def _same_rows(where: str, rows: int, **tensors: torch.Tensor | None) -> None:
    for name, tensor in tensors.items():
        if tensor is not None and tensor.shape[0] != rows:
            raise MalformedMessage(f"{where}.{name} has {tensor.shape[0]} rows, {where}.slots has {rows}")


def _values_in(where: str, tensor: torch.Tensor, lo: int, hi: int) -> None:
    if tensor.numel() and (int(tensor.min()) < lo or int(tensor.max()) > hi):
        raise MalformedMessage(f"{where} holds values outside [{lo}, {hi}]")


def _draft_rows(frame: FrameMsg) -> dict[int, int]:
    """Proposals (rows after a window's first) of each draft window's slot in ``frame``."""
    wanted = set(frame.draft_slots)
    counts: dict[int, int] = {}
    for slot in frame.slots.tolist():
        if slot in wanted:
            counts[slot] = counts.get(slot, -1) + 1
    return counts


def _draft_q_in_frame(frame: FrameMsg) -> None:
    if not frame.draft_slots:
        if frame.draft_ids is not None or frame.draft_probs is not None:
            raise MalformedMessage("frame.draft_ids and frame.draft_probs need frame.draft_slots")
        return
    ids, probs = frame.draft_ids, frame.draft_probs
    if ids is None or probs is None or ids.shape != probs.shape:
        raise MalformedMessage("frame.draft_slots needs frame.draft_ids and frame.draft_probs of one shape [P, N]")
    counts = _draft_rows(frame)
    if missing := [s for s in frame.draft_slots if counts.get(s, 0) < 1]:
        raise MalformedMessage(f"frame.draft_slots names slot(s) {missing} without a verify window in the frame")
    if ids.shape[0] != sum(counts.values()) or not 1 <= ids.shape[1] <= DRAFT_SUPPORT:
        raise MalformedMessage(
            f"frame.draft_ids has shape {list(ids.shape)}; the draft windows need [{sum(counts.values())}, N] "
            f"rows (one a proposal), 1 <= N <= {DRAFT_SUPPORT}"
        )
    _values_in("frame.draft_ids", ids, 0, MAX_TOKEN_ID)
    if not bool(torch.isfinite(probs).all()) or float(probs.min()) < 0.0:
        raise MalformedMessage("frame.draft_probs holds a negative or non-finite probability")
    sums = probs.double().sum(dim=1)
    if float((sums - 1.0).abs().max()) > 1e-3:
        raise MalformedMessage(f"frame.draft_probs has a row summing to {float(sums[(sums - 1).abs().argmax()]):.6f}, "
                               "not 1 (within 1e-3)")  # fmt: skip


def _new_streams_in_frame(starts: tuple[StreamStart, ...], slots: torch.Tensor) -> None:
    started = [s.slot for s in starts]
    if len(set(started)) != len(started):
        raise MalformedMessage(f"frame.new_streams repeats a slot: {started}")
    if missing := sorted(set(started) - set(slots.tolist())):
        raise MalformedMessage(f"frame.new_streams starts slot(s) {missing} that have no rows in the frame")


# ---- codec ----------------------------------------------------------------------------------


def encode(msg: Message) -> list[bytes]:
    """[msgpack header, payload bytes...]; payloads are the C-contiguous CPU bytes of each tensor."""
    header: dict[str, Any] = {"v": PROTOCOL_VERSION, "type": msg.TYPE, **_dump_fields(msg)}
    descriptors, payloads = [], []
    for f in fields(msg):  # type: ignore[arg-type]
        value = getattr(msg, f.name)
        if isinstance(_kind(f), Tensor) and value is not None:
            descriptors.append({"name": f.name, "dtype": DTYPE_NAMES[value.dtype], "shape": list(value.shape)})
            payloads.append(_tensor_bytes(value))
    header["tensors"] = descriptors
    return [msgpack.packb(header, use_bin_type=True), *payloads]


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def decode(parts: Sequence[bytes | bytearray | memoryview], max_message_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    """The message in ``parts`` (as received with recv_multipart), or MalformedMessage."""
    if not parts:
        raise MalformedMessage("empty message: no header frame")
    sizes = [memoryview(part).nbytes for part in parts]
    if sum(sizes) > max_message_bytes:
        raise MalformedMessage(f"message of {sum(sizes)} bytes exceeds the limit of {max_message_bytes}")
    if sizes[0] > MAX_HEADER_BYTES:
        raise MalformedMessage(f"header of {sizes[0]} bytes exceeds the limit of {MAX_HEADER_BYTES}")
    header = _unpack(parts[0])
    cls = _message_class(header)
    descriptors = _descriptors(cls, header["tensors"], sizes[1:])
    body = {k: v for k, v in header.items() if k not in RESERVED_KEYS}
    kwargs = _load_fields(cls, body, cls.TYPE)
    for (name, dtype, shape), part in zip(descriptors, parts[1:], strict=True):
        kwargs[name] = _tensor_from(part, dtype, shape)
    return cls(**kwargs)


def _reject_ext(code: int, data: bytes) -> object:
    raise MalformedMessage(f"header holds msgpack extension type {code}; extensions are not accepted")


def _unpack(data: bytes | bytearray | memoryview) -> dict[str, Any]:
    try:
        # str, bin, array and map lengths are bounded by the header's size (unpackb's default)
        header = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True, ext_hook=_reject_ext)
    except MalformedMessage:
        raise
    except (ValueError, msgpack.UnpackException) as exc:
        raise MalformedMessage(f"header is not valid msgpack: {exc}") from exc
    _plain(header, "header", 0)
    if type(header) is not dict:
        raise MalformedMessage(f"header must be a map, got {_type_name(header)}")
    return header


def _plain(value: object, where: str, depth: int) -> None:
    """Only None, bool, int, float, str, list and dict with str keys, nested at most MAX_NESTING deep."""
    if depth > MAX_NESTING:
        raise MalformedMessage(f"{where} is nested deeper than {MAX_NESTING} levels")
    if type(value) is dict:
        for key, item in value.items():
            if type(key) is not str:
                raise MalformedMessage(f"{where} has a key of type {_type_name(key)}; keys must be strings")
            _plain(item, f"{where}.{key}", depth + 1)
    elif type(value) is list:
        for i, item in enumerate(value):
            _plain(item, f"{where}[{i}]", depth + 1)
    elif value is not None and type(value) not in (bool, int, float, str):
        raise MalformedMessage(f"{where} has type {_type_name(value)}; the header holds only plain values")


def _message_class(header: dict[str, Any]) -> type[Message]:
    version = header.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise MalformedMessage(f"protocol version v={version!r} is not supported; this side speaks {PROTOCOL_VERSION}")
    kind = header.get("type")
    if type(kind) is not str or kind not in MESSAGE_TYPES:
        raise MalformedMessage(f"message type {kind!r} is unknown; known: {', '.join(MESSAGE_TYPES)}")
    if "tensors" not in header:
        raise MalformedMessage(f"{kind} header lacks 'tensors'")
    return MESSAGE_TYPES[kind]


Descriptor = tuple[str, torch.dtype, tuple[int, ...]]  # name, dtype, shape of one payload


def _descriptors(cls: type[Message], listed: object, sizes: list[int]) -> list[Descriptor]:
    """One descriptor per payload, each checked against the schema and the payload's size."""
    where = f"{cls.TYPE}.tensors"
    if type(listed) is not list:
        raise MalformedMessage(f"{where} must be a list, got {_type_name(listed)}")
    if len(listed) != len(sizes):
        raise MalformedMessage(f"{where} lists {len(listed)} payload(s), the message has {len(sizes)}")
    specs = _schema(cls).tensors
    out: list[Descriptor] = []
    for i, (entry, size) in enumerate(zip(listed, sizes, strict=True)):
        name, dtype, shape = _descriptor(entry, f"{where}[{i}]", specs)
        if name in (seen := [n for n, _, _ in out]):
            raise MalformedMessage(f"{where} lists {name!r} twice ({seen})")
        expected = math.prod(shape) * dtype.itemsize
        if size != expected:
            need = f"shape {list(shape)} of {DTYPE_NAMES[dtype]} needs {expected}"
            raise MalformedMessage(f"{cls.TYPE}.{name} payload has {size} bytes; {need}")
        out.append((name, dtype, shape))
    return out


def _descriptor(entry: object, where: str, specs: dict[str, Any]) -> Descriptor:
    if type(entry) is not dict or set(entry) != {"name", "dtype", "shape"}:
        raise MalformedMessage(f"{where} must be a map of exactly name, dtype and shape")
    name, dtype, shape = entry["name"], entry["dtype"], entry["shape"]
    if type(name) is not str or name not in specs:
        raise MalformedMessage(f"{where}.name={name!r} is not a tensor field; tensor fields: {sorted(specs)}")
    spec: Tensor = specs[name]
    if type(dtype) is not str or dtype not in spec.dtypes:
        raise MalformedMessage(f"{where}.dtype={dtype!r} is not allowed for {name}; allowed: {', '.join(spec.dtypes)}")
    max_ndim = spec.max_ndim or spec.ndim
    dims = IntList(max_ndim, Int(0, MAX_MESSAGE_BYTES)).check(shape, f"{where}.shape")
    if not spec.ndim <= len(dims) <= max_ndim:
        ranks = spec.ndim if max_ndim == spec.ndim else f"{spec.ndim} to {max_ndim}"
        raise MalformedMessage(f"{where}.shape={list(dims)} has rank {len(dims)}; {name} needs rank {ranks}")
    return name, DTYPES[dtype], dims


def _tensor_from(part: bytes | bytearray | memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if math.prod(shape) == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(part), dtype=dtype).reshape(shape)  # owns a copy of the frame


def send(socket: zmq.Socket[Any], msg: Message, flags: int = 0) -> None:
    socket.send_multipart(encode(msg), flags=flags)


def recv(socket: zmq.Socket[Any], flags: int = 0, max_message_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    return decode(socket.recv_multipart(flags=flags), max_message_bytes)


def limit_message_bytes(socket: zmq.Socket[Any], max_message_bytes: int = MAX_MESSAGE_BYTES) -> None:
    """Make libzmq drop a peer that sends one frame over *twice* the limit, before it is buffered
    whole. libzmq tells no one why it dropped a peer (a socket monitor sees only a disconnect, as
    when a peer exits), so the limit itself is enforced by :func:`decode`, whose refusal the
    receiver counts as malformed: a message up to twice the limit arrives, and is counted."""
    socket.setsockopt(zmq.MAXMSGSIZE, ZMQ_DROP_FACTOR * max_message_bytes)


# ---- CURVE: authentication and encryption between agents ------------------------------------

ZAP_DOMAIN = "modelfleet"
_Z85_KEY = re.compile(r"[0-9A-Za-z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}")


@dataclass(frozen=True)
class KeyPair:
    public: bytes  # z85, 40 bytes
    secret: bytes = field(repr=False)


def generate_keypair() -> KeyPair:
    public, secret = zmq.curve_keypair()
    return KeyPair(public, secret)


def parse_key(text: str | bytes, where: str = "key") -> bytes:
    key = (text.decode("ascii", "replace") if isinstance(text, bytes) else text).strip()
    if _Z85_KEY.fullmatch(key) is None:
        raise TransportConfigError(f"{where} is not a CURVE key: expected 40 z85 characters, got {len(key)}")
    return key.encode("ascii")


def save_key(path: str | Path, key: bytes, secret: bool = False) -> None:
    """Write a z85 key as one line of text; a secret key is created readable by its owner only."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    fd = os.open(path, flags, 0o600 if secret else 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(parse_key(key).decode("ascii") + "\n")


def load_key(path: str | Path) -> bytes:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise TransportConfigError(f"cannot read the CURVE key file {str(path)!r}: {exc.strerror}") from exc
    return parse_key(text, f"key file {str(path)!r}")


def save_keypair(keys: KeyPair, directory: str | Path, name: str) -> None:
    """``{name}.key`` (public) and ``{name}.key_secret``: the layout of the operator's Secret."""
    save_key(Path(directory) / f"{name}.key", keys.public)
    save_key(Path(directory) / f"{name}.key_secret", keys.secret, secret=True)


def load_keypair(directory: str | Path, name: str) -> KeyPair:
    return KeyPair(load_key(Path(directory) / f"{name}.key"), load_key(Path(directory) / f"{name}.key_secret"))


def load_public_keys(path: str | Path) -> frozenset[bytes]:
    """Allowed client keys: a folder of *.key files, or a file of one key per line.

    In a file, a line holds a key, optionally followed by whitespace and a comment, or is a
    comment starting with '#'. A z85 key may contain '#' but never starts with it (its first
    z85 digit is at most 82 = (2**32 - 1) // 85**4, and '#' is digit 84).
    """
    source = Path(path)
    if source.is_dir():
        return frozenset(load_key(p) for p in sorted(source.glob("*.key")))
    try:
        lines = source.read_text().splitlines()
    except OSError as exc:
        raise TransportConfigError(f"cannot read the client key list {str(source)!r}: {exc.strerror}") from exc
    keys = set()
    for n, line in enumerate(lines, 1):
        first = line.split(maxsplit=1)[0] if line.strip() else ""
        if first and not first.startswith("#"):
            keys.add(parse_key(first, f"{source}:{n}"))
    return frozenset(keys)


def curve_server(socket: zmq.Socket[Any], keys: KeyPair) -> None:
    """Make ``socket`` (before bind) a CURVE server whose clients the ZAP authenticator vets.

    libzmq admits every CURVE client when no ZAP handler is running; ZAP_ENFORCE_DOMAIN turns
    that into a refusal, so a server whose authenticator is missing or stopped admits no one.
    """
    socket.curve_secretkey = keys.secret
    socket.curve_publickey = keys.public
    socket.curve_server = True
    socket.zap_domain = ZAP_DOMAIN.encode()
    socket.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)


def curve_client(socket: zmq.Socket[Any], keys: KeyPair, server_public: bytes) -> None:
    """Make ``socket`` (before connect) a CURVE client of the server holding ``server_public``."""
    socket.curve_secretkey = keys.secret
    socket.curve_publickey = keys.public
    socket.curve_serverkey = parse_key(server_public, "server public key")


class _AllowList:
    def __init__(self, keys: frozenset[bytes]):
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


def start_authenticator(context: zmq.Context[Any], allowed_client_keys: Iterable[bytes]) -> ThreadAuthenticator:
    """A ZAP handler admitting only ``allowed_client_keys`` to this context's CURVE servers.

    One per context, for the context's lifetime: its endpoint (inproc://zeromq.zap.01) is freed
    asynchronously after ``stop()``, so a second one started at once on the same context may
    find it still taken. Stop it before terminating the context.
    """
    allowed = frozenset(parse_key(key, "allowed client key") for key in allowed_client_keys)
    if not allowed:
        raise TransportConfigError("no client keys are allowed; list at least one client public key")
    auth = ThreadAuthenticator(context)
    auth.configure_curve_callback(ZAP_DOMAIN, _AllowList(allowed))  # before any request can arrive
    try:
        auth.start()
    except zmq.ZMQError as exc:
        auth.stop()  # closes the ZAP socket that failed to bind, or the context could never terminate
        raise TransportConfigError(
            f"cannot start the ZAP authenticator ({exc}); this context already has one, use one per context"
        ) from exc
    return auth
