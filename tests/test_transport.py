"""The wire: every message type over real ZeroMQ sockets, refusal of every malformed message,
and CURVE authentication that admits only configured client keys."""

from __future__ import annotations

import contextlib
import dataclasses
import re
import stat
import threading
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
import torch
import zmq

from modelfleet.agent import transport
from modelfleet.agent.transport import (
    ErrorMsg,
    FrameMsg,
    MalformedMessage,
    Message,
    ProbeAckMsg,
    ProbeMsg,
    ReleaseMsg,
    RewindMsg,
    StreamStart,
    TokensMsg,
)
from modelfleet.engine.frame import Frame
from modelfleet.engine.generate import LocalModel, generate
from modelfleet.engine.kvcache import SlotState
from modelfleet.engine.sampling import SamplingParams

RECEIVE_TIMEOUT_MS = 5000
REFUSED_TIMEOUT_MS = 300


def _ids(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _prefill_frame() -> FrameMsg:
    starts = (StreamStart(0, temperature=0.7, top_p=0.9, top_k=40, seed=2**64 - 1, stop_token_ids=(2, 7)),)
    return FrameMsg(
        microbatch=1, step=7, slots=_ids(0, 0, 0, 3), positions=_ids(0, 1, 2, 41), token_ids=_ids(5, 9, 11, 4),
        output_rows=(2, 3), new_streams=starts,
    )  # fmt: skip


def _hidden_frame() -> FrameMsg:
    hidden = torch.randn(3, 64, dtype=torch.float32)
    return FrameMsg(microbatch=0, step=2**40, slots=_ids(4, 5, 5), positions=_ids(9, 100, 101), hidden=hidden)


MESSAGES: dict[str, Callable[[], Message]] = {
    "frame_of_token_ids": _prefill_frame,
    "frame_of_hidden_states": _hidden_frame,
    "frame_of_hyper_connection_streams_with_token_ids": lambda: FrameMsg(
        microbatch=0,
        step=3,
        slots=_ids(1, 1),
        positions=_ids(7, 8),
        hidden=torch.randn(2, 4, 16),
        token_ids=_ids(5, 6),
    ),  # fmt: skip
    "tokens": lambda: TokensMsg(microbatch=1, step=8, slots=_ids(0, 3), positions=_ids(3, 42), token_ids=_ids(17, 2)),
    "release": lambda: ReleaseMsg(slots=(0, 3)),
    "rewind": lambda: RewindMsg(slot=3, position=40),
    "probe": lambda: ProbeMsg(nonce=2**64 - 1, sent_ns=123, plan_hash="ab" * 32),
    "bandwidth_probe": lambda: ProbeMsg(nonce=1, sent_ns=5, padding=torch.zeros(1 << 16, dtype=torch.uint8)),
    "probe_ack": lambda: ProbeAckMsg(nonce=1, sent_ns=5, group_index=0, stage_index=2, ready=True),
    "heartbeat": lambda: transport.HeartbeatMsg(
        sent_ns=7, group_index=1, stage_index=2, ready=True, plan_hash="cd" * 32
    ),
    "error": lambda: ErrorMsg(code="capacity", message="no free KV slot (16 in use)", slot=None),
    "slot_state": lambda: transport.slot_state_messages(
        3, SlotState(5, ({"k": torch.randn(8, 2, 4), "v": torch.randn(8, 2, 4).to(torch.bfloat16)},))
    )[0],
}


def _assert_same(got: Message, sent: Message) -> None:
    assert type(got) is type(sent)
    for f in dataclasses.fields(sent):  # type: ignore[arg-type]
        a, b = getattr(got, f.name), getattr(sent, f.name)
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f.name
        else:
            assert a == b, f.name


@pytest.fixture(scope="module")
def context() -> Iterator[zmq.Context[Any]]:
    ctx: zmq.Context[Any] = zmq.Context()
    yield ctx
    ctx.term()


def _pair(ctx: zmq.Context[Any], server_type: int, client_type: int) -> tuple[zmq.Socket[Any], zmq.Socket[Any]]:
    server, client = ctx.socket(server_type), ctx.socket(client_type)
    for sock in (server, client):
        sock.linger = 0
    server.bind("tcp://127.0.0.1:*")
    client.connect(server.last_endpoint.decode())
    return server, client


@pytest.fixture(scope="module")
def push_pull(context) -> Iterator[tuple[zmq.Socket[Any], zmq.Socket[Any]]]:
    pull, push = _pair(context, zmq.PULL, zmq.PUSH)
    yield push, pull
    push.close()
    pull.close()


@pytest.mark.parametrize("name", list(MESSAGES))
def test_every_message_type_survives_a_round_trip_over_tcp(push_pull, name):
    push, pull = push_pull
    sent = MESSAGES[name]()
    transport.send(push, sent)
    assert pull.poll(RECEIVE_TIMEOUT_MS), "nothing arrived"
    _assert_same(transport.recv(pull), sent)


def test_a_pair_socket_carries_messages_both_ways(context):
    a, b = _pair(context, zmq.PAIR, zmq.PAIR)
    try:
        transport.send(a, MESSAGES["probe"]())
        assert b.poll(RECEIVE_TIMEOUT_MS)
        probe = transport.recv(b)
        assert isinstance(probe, ProbeMsg)
        transport.send(b, ProbeAckMsg(probe.nonce, probe.sent_ns, 0, 1, False, probe.plan_hash))
        assert a.poll(RECEIVE_TIMEOUT_MS)
        ack = transport.recv(a)
        assert isinstance(ack, ProbeAckMsg) and ack.nonce == probe.nonce and ack.plan_hash == "ab" * 32
    finally:
        a.close()
        b.close()


def test_decoded_tensors_own_writable_storage_apart_from_the_received_frames():
    parts = transport.encode(_hidden_frame())
    before = bytes(parts[3])
    frame = transport.decode(parts)
    assert isinstance(frame, FrameMsg) and frame.hidden is not None
    frame.hidden.add_(1.0)
    assert bytes(parts[3]) == before


def test_a_non_contiguous_tensor_is_sent_as_its_contiguous_bytes():
    hidden = torch.arange(12, dtype=torch.float32).reshape(4, 3).t()  # [3, 4], strided
    sent = FrameMsg(microbatch=0, step=0, slots=_ids(0, 1, 2), positions=_ids(0, 0, 0), hidden=hidden)
    got = transport.decode(transport.encode(sent))
    assert isinstance(got, FrameMsg) and got.hidden is not None
    assert torch.equal(got.hidden, hidden)


def test_stream_start_carries_sampling_params_both_ways():
    params = SamplingParams(temperature=0.8, top_p=0.95, top_k=50, min_p=0.05, seed=7, max_tokens=99,
                            stop_token_ids=(3, 4))  # fmt: skip
    assert StreamStart.of(5, params).sampling_params() == params


# ---- malformed messages ---------------------------------------------------------------------


def _header(parts: list[bytes]) -> dict[str, Any]:
    return msgpack.unpackb(parts[0])  # type: ignore[no-any-return]


def _tampered(message: Message, change: Callable[[dict[str, Any]], object]) -> list[bytes]:
    """The encoded message with its header edited by ``change`` (which mutates the dict)."""
    parts = transport.encode(message)
    header = _header(parts)
    change(header)
    return [msgpack.packb(header, use_bin_type=True), *parts[1:]]


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda header: header.__setitem__(key, value)


def _set_tensor(index: int, key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda header: header["tensors"][index].__setitem__(key, value)


def _set_stream(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda header: header["new_streams"][0].__setitem__(key, value)


FRAME_PARTS = transport.encode(_prefill_frame())
MALFORMED: dict[str, tuple[Callable[[], list[Any]], str]] = {
    "no frames at all": (lambda: [], "empty message"),
    "a header that is not msgpack": (lambda: [b"\xc1"], "not valid msgpack"),
    "a truncated header": (lambda: [FRAME_PARTS[0][:-3], *FRAME_PARTS[1:]], "not valid msgpack"),
    "trailing bytes after the header": (lambda: [FRAME_PARTS[0] + b"\x00", *FRAME_PARTS[1:]], "not valid msgpack"),
    "a header that is a list": (lambda: [msgpack.packb([1, "frame"])], "header must be a map"),
    "a wrong protocol version": (lambda: _tampered(_prefill_frame(), _set("v", 1)), "protocol version v=1"),
    "a version given as text": (lambda: _tampered(_prefill_frame(), _set("v", "1")), "protocol version"),
    "no version": (lambda: _tampered(_prefill_frame(), lambda h: h.pop("v")), "protocol version v=None"),
    "an unknown type": (lambda: _tampered(_prefill_frame(), _set("type", "shutdown")), "type 'shutdown' is unknown"),
    "an unknown field": (lambda: _tampered(_prefill_frame(), _set("exec", "rm -rf /")), "unknown field(s) ['exec']"),
    "a missing field": (lambda: _tampered(_prefill_frame(), lambda h: h.pop("step")), "lacks field(s) ['step']"),
    "a boolean for an integer": (
        lambda: _tampered(_prefill_frame(), _set("step", True)),
        "frame.step must be an integer",
    ),
    "a negative step": (lambda: _tampered(_prefill_frame(), _set("step", -1)), "frame.step=-1 is outside"),
    "a float for an integer": (
        lambda: _tampered(_prefill_frame(), _set("microbatch", 1.0)),
        "frame.microbatch must be an integer",
    ),
    "top_p of zero": (lambda: _tampered(_prefill_frame(), _set_stream("top_p", 0.0)), "new_streams[0].top_p=0.0"),
    "a NaN temperature": (
        lambda: _tampered(_prefill_frame(), _set_stream("temperature", float("nan"))),
        "must be a finite number",
    ),
    "a record with an extra key": (
        lambda: _tampered(_prefill_frame(), _set_stream("hook", 1)),
        "new_streams[0] has unknown field(s)",
    ),
    "an error code outside the set": (
        lambda: _tampered(ErrorMsg("input", "x"), _set("code", "reboot")),
        "error.code='reboot' is not one of",
    ),
    "a plan hash that is not hex": (lambda: _tampered(ProbeMsg(1, 2), _set("plan_hash", "z" * 64)), "probe.plan_hash"),
    "a release of no slots": (lambda: _tampered(ReleaseMsg((1,)), _set("slots", [])), "at least one slot"),
    "a release naming a slot twice": (lambda: _tampered(ReleaseMsg((1,)), _set("slots", [1, 1])), "repeats"),
    "a payload one byte short": (lambda: [*FRAME_PARTS[:3], FRAME_PARTS[3][:-1]], "token_ids payload has 31 bytes"),
    "a payload one byte long": (lambda: [*FRAME_PARTS[:3], FRAME_PARTS[3] + b"\x00"], "payload has 33 bytes"),
    "a payload not listed in the header": (
        lambda: [*FRAME_PARTS, b"\x00" * 8],
        "lists 3 payload(s), the message has 4",
    ),
    "a listed payload that is missing": (lambda: FRAME_PARTS[:3], "lists 3 payload(s), the message has 2"),
    "a dtype off the allow-list": (
        lambda: _tampered(_prefill_frame(), _set_tensor(2, "dtype", "object")),
        "dtype='object' is not allowed",
    ),
    "an allowed dtype on the wrong field": (
        lambda: _tampered(_hidden_frame(), _set_tensor(2, "dtype", "float16")),
        "not allowed for hidden",
    ),
    "a shape of the wrong rank": (
        lambda: _tampered(_prefill_frame(), _set_tensor(2, "shape", [2, 2])),
        "has 2 items, over the limit of 1",
    ),
    "a negative dimension": (lambda: _tampered(_prefill_frame(), _set_tensor(2, "shape", [-4])), "shape[0]=-4"),
    "a tensor name that is no field": (
        lambda: _tampered(_prefill_frame(), _set_tensor(2, "name", "__class__")),
        "is not a tensor field",
    ),
    "a tensor listed twice": (
        lambda: _tampered(_prefill_frame(), _set_tensor(2, "name", "positions")),
        "lists 'positions' twice",
    ),
    "rows that disagree": (
        lambda: transport.encode(dataclasses.replace(_prefill_frame(), positions=_ids(0, 1, 2))),
        "frame.positions has 3 rows",
    ),
    "neither token ids nor hidden states": (lambda: _no_inputs(), "token_ids, hidden, or both"),
    "hidden states of rank 4": (lambda: _hidden_of_rank_4(), "shape has 4 items, over the limit of 3"),
    "a sample row past the frame": (lambda: _tampered(_prefill_frame(), _set("output_rows", [4])), "row 4 of a 4-row"),
    "a new stream with no rows": (lambda: _tampered(_prefill_frame(), _set_stream("slot", 9)), "starts slot(s) [9]"),
    "an extension type": (lambda: [msgpack.packb({"v": 1, "x": msgpack.ExtType(1, b"\x80\x04")})], "extension type 1"),
    "a timestamp": (lambda: [msgpack.packb({"v": 1, "t": msgpack.Timestamp(0)})], "header.t has type Timestamp"),
    "binary where text is due": (lambda: _tampered(ErrorMsg("input", "x"), _set("message", b"x")), "has type bytes"),
    "a binary map key": (lambda: [msgpack.packb({b"v": 1}, use_bin_type=True)], "keys must be strings"),
    "an integer map key": (lambda: [msgpack.packb({1: 1})], "not valid msgpack"),
    "deep nesting": (lambda: [msgpack.packb({"v": _nested(20)})], "nested deeper than"),
}


def _no_inputs() -> list[bytes]:
    parts = transport.encode(_hidden_frame())
    header = _header(parts)
    header["tensors"] = [t for t in header["tensors"] if t["name"] != "hidden"]
    return [msgpack.packb(header), *parts[1:3]]


def _hidden_of_rank_4() -> list[bytes]:
    parts = transport.encode(_hidden_frame())
    header = _header(parts)
    next(t for t in header["tensors"] if t["name"] == "hidden")["shape"] = [3, 2, 2, 16]
    return [msgpack.packb(header), *parts[1:]]


def _nested(depth: int) -> Any:
    return [] if depth == 0 else [_nested(depth - 1)]


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_message_is_refused_with_its_reason(case):
    build, reason = MALFORMED[case]
    with pytest.raises(MalformedMessage) as caught:
        transport.decode(build())
    assert reason in caught.value.reason


def test_a_message_over_the_size_limit_is_refused_before_its_header_is_read():
    parts = transport.encode(_hidden_frame())
    size = sum(len(p) for p in parts)
    with pytest.raises(MalformedMessage, match=f"message of {size} bytes exceeds the limit of {size - 1}"):
        transport.decode(parts, max_message_bytes=size - 1)
    with pytest.raises(MalformedMessage, match="header of"):
        transport.decode([b"\x00" * (transport.MAX_HEADER_BYTES + 1)])


@pytest.mark.parametrize(
    "build, reason",
    [
        (lambda: RewindMsg(slot=-1, position=0), "rewind.slot=-1"),
        (lambda: ReleaseMsg(slots=[1, "2"]), "release.slots[1] must be an integer"),  # type: ignore[list-item]
        (lambda: FrameMsg(0, 0, _ids(0), _ids(0), hidden=torch.zeros(1, 4, dtype=torch.float64)), "dtype"),
        (lambda: FrameMsg(0, 0, _ids(0), _ids(-1), token_ids=_ids(1)), "frame.positions holds values outside"),
        (lambda: StreamStart(0, top_k=-1), "stream_start.top_k=-1"),
        (lambda: ErrorMsg("internal", "x" * 5000), "over the limit of 4096"),
    ],
)
def test_an_invalid_message_cannot_be_built_so_it_never_reaches_the_wire(build, reason):
    with pytest.raises(MalformedMessage, match=re.escape(reason)):
        build()


# ---- CURVE ----------------------------------------------------------------------------------


def _terminates(ctx: zmq.Context[Any]) -> bool:
    """Whether ``ctx.term()`` returns (it blocks forever while any socket is left open)."""
    done = threading.Event()
    threading.Thread(target=lambda: (ctx.term(), done.set()), daemon=True).start()
    return done.wait(RECEIVE_TIMEOUT_MS / 1000)


@pytest.fixture
def curve_server():
    """A PULL socket that is a CURVE server admitting only one client key, and that key pair.

    Each test has a context of its own: a context holds one ZAP authenticator for its lifetime.
    """
    context: zmq.Context[Any] = zmq.Context()
    server_keys, client_keys = transport.generate_keypair(), transport.generate_keypair()
    auth = transport.start_authenticator(context, [client_keys.public])
    server = context.socket(zmq.PULL)
    server.linger = 0
    transport.curve_server(server, server_keys)
    server.bind("tcp://127.0.0.1:*")
    clients: list[zmq.Socket[Any]] = []

    def connect(keys: transport.KeyPair | None) -> zmq.Socket[Any]:
        client = context.socket(zmq.PUSH)
        client.linger = 0
        if keys is not None:
            transport.curve_client(client, keys, server_keys.public)
        client.connect(server.last_endpoint.decode())
        clients.append(client)
        return client

    yield server, client_keys, connect
    for sock in [*clients, server]:
        sock.close()
    auth.stop()
    assert _terminates(context)


def test_an_authorized_curve_client_gets_through(curve_server):
    server, client_keys, connect = curve_server
    transport.send(connect(client_keys), RewindMsg(1, 2))
    assert server.poll(RECEIVE_TIMEOUT_MS)
    assert transport.recv(server) == RewindMsg(1, 2)


@pytest.mark.parametrize("who", ["a client with the wrong key", "a client without keys"])
def test_an_unauthorized_client_is_not_delivered(curve_server, who):
    server, client_keys, connect = curve_server
    intruder = connect(transport.generate_keypair() if who == "a client with the wrong key" else None)
    with contextlib.suppress(zmq.Again):  # a refused handshake may already have dropped the client's pipe
        transport.send(intruder, RewindMsg(6, 6), flags=zmq.NOBLOCK)
    assert server.poll(REFUSED_TIMEOUT_MS) == 0
    transport.send(connect(client_keys), RewindMsg(1, 2))  # the server still serves its own client
    assert server.poll(RECEIVE_TIMEOUT_MS)
    assert transport.recv(server) == RewindMsg(1, 2)
    assert server.poll(REFUSED_TIMEOUT_MS) == 0


def test_a_curve_server_without_a_running_authenticator_admits_no_one():
    context: zmq.Context[Any] = zmq.Context()
    server_keys, client_keys = transport.generate_keypair(), transport.generate_keypair()
    server, client = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    try:
        transport.curve_server(server, server_keys)
        server.bind("tcp://127.0.0.1:*")
        transport.curve_client(client, client_keys, server_keys.public)
        client.connect(server.last_endpoint.decode())
        with contextlib.suppress(zmq.Again):
            transport.send(client, RewindMsg(1, 2), flags=zmq.NOBLOCK)
        assert server.poll(REFUSED_TIMEOUT_MS) == 0
    finally:
        server.close(linger=0)
        client.close(linger=0)
    assert _terminates(context)


def test_a_second_authenticator_on_one_context_is_refused_and_leaks_no_socket():
    context: zmq.Context[Any] = zmq.Context()
    key = transport.generate_keypair().public
    first = transport.start_authenticator(context, [key])
    with pytest.raises(transport.TransportConfigError, match="use one per context"):
        transport.start_authenticator(context, [key])
    first.stop()
    assert _terminates(context)


def test_key_files_round_trip_and_secret_keys_are_private(tmp_path):
    keys = transport.generate_keypair()
    transport.save_keypair(keys, tmp_path, "stage-0")
    assert transport.load_keypair(tmp_path, "stage-0") == keys
    assert stat.S_IMODE((tmp_path / "stage-0.key_secret").stat().st_mode) == 0o600
    assert keys.secret.decode() not in repr(keys)


def test_the_allowed_client_list_reads_a_file_with_comments_or_a_folder(tmp_path):
    a, b = transport.generate_keypair(), transport.generate_keypair()
    listing = tmp_path / "clients"
    listing.write_text(f"# gateway\n{a.public.decode()}\n\n{b.public.decode()}  # head\n")
    assert transport.load_public_keys(listing) == {a.public, b.public}
    folder = tmp_path / "keys"
    folder.mkdir()
    transport.save_key(folder / "a.key", a.public)
    assert transport.load_public_keys(folder) == {a.public}


def test_a_malformed_key_file_or_an_empty_allow_list_is_refused(tmp_path, context):
    bad = tmp_path / "bad.key"
    bad.write_text("not-a-key\n")
    with pytest.raises(transport.TransportConfigError, match="bad.key.*40 z85 characters"):
        transport.load_key(bad)
    with pytest.raises(transport.TransportConfigError, match="cannot read"):
        transport.load_key(tmp_path / "absent.key")
    with pytest.raises(transport.TransportConfigError, match="at least one client public key"):
        transport.start_authenticator(context, [])


def test_a_streams_state_sent_as_slot_state_messages_continues_identically_in_another_model(tiny_checkpoint):
    """Issue 34, item 4: a drained stage's slot travels to its replacement, one message per layer
    through the wire's checks, and the stream goes on there as it would have at home."""
    path, _ = tiny_checkpoint("qwen3_moe")
    prompt = [5, 17, 99, 3, 64, 21, 8, 120, 45, 77, 12, 33]
    expected = generate(
        LocalModel.load(path, max_context=64), prompt, SamplingParams(max_tokens=6, stop_token_ids=())
    ).token_ids
    source, target = LocalModel.load(path, max_context=64), LocalModel.load(path, max_context=64)
    logits = source.forward(Frame.of_streams([(1, 0, prompt)]))
    messages = transport.slot_state_messages(1, source.export_slot(1))
    assert len(messages) == source.spec.num_layers
    received = [transport.decode(transport.encode(m)) for m in reversed(messages)]  # in any order
    target.import_slot(2, transport.slot_state_of(received))  # type: ignore[arg-type]
    tokens, position = [], len(prompt)
    for _ in range(6):
        tokens.append(int(logits[-1].argmax()))
        logits = target.forward(Frame.of_streams([(2, position, [tokens[-1]])]))
        position += 1
    assert tokens == expected
    with pytest.raises(MalformedMessage, match="cover layers"):
        transport.slot_state_of(received[1:])  # type: ignore[arg-type]
    one = messages[0]
    with pytest.raises(MalformedMessage, match="payload has .* bytes; its entries need"):
        transport.SlotStateMsg(slot=1, length=one.length, layer=0, layers=one.layers, entries=one.entries,
                               payload=one.payload[:-1])  # fmt: skip
