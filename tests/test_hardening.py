"""Issue 30's hardening, as pure decisions and small units: sampling that is safe for every
accepted value, one row's failure kept to its stream, requests that hold text that is not text,
API keys that fail closed, and the head's liveness deadlines. The live halves of these (a fleet,
a gateway) are in test_pipeline.py and test_gateway.py."""

from __future__ import annotations

import json
import math
import multiprocessing
import socket
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_pipeline import free_base_port

from modelfleet.agent import transport as wire
from modelfleet.agent.gateway import ApiKeysError, load_api_keys
from modelfleet.agent.liveness import (
    LivenessPolicy,
    chain_ready,
    heartbeat_deadline_seconds,
    lost_stages,
    step_deadline_seconds,
)
from modelfleet.agent.tensor_group import rendezvous_namespace
from modelfleet.engine.errors import InputError
from modelfleet.engine.sampling import SamplingParams, TailSampler

# ---- sampling ---------------------------------------------------------------------------------

TINY = st.sampled_from([5e-324, 1e-320, 1e-300, 1e-45, 1e-38, 1e-30, 1e-7])


@settings(max_examples=150, deadline=None)
@given(
    temperature=st.one_of(TINY, st.floats(0.0, 100.0)),
    top_p=st.one_of(TINY, st.floats(0.0, 1.0, exclude_min=True)),
    top_k=st.integers(0, 40),
    min_p=st.one_of(TINY, st.floats(0.0, 1.0)),
    scale=st.sampled_from([1.0, 1e3, 1e30]),
    seed=st.integers(0, 2**32),
)
def test_every_accepted_sampling_value_draws_a_token_for_finite_logits(temperature, top_p, top_k, min_p, scale,
                                                                      seed) -> None:  # fmt: skip
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed)
    sampler = TailSampler()
    sampler.start(3, params)
    logits = torch.randn(1, 32, generator=torch.Generator().manual_seed(seed)) * scale
    tokens, errors = sampler.sample([3], logits)
    assert errors == {} and 0 <= tokens[3] < 32


@pytest.mark.parametrize("temperature, top_p", [(1e-300, 1.0), (5e-324, 1.0), (1.0, 1e-300), (1.0, 5e-324)])
def test_a_temperature_or_top_p_below_what_float32_holds_samples_the_most_likely_token(temperature, top_p) -> None:
    sampler = TailSampler()
    sampler.start(0, SamplingParams(temperature=temperature, top_p=top_p, seed=1))
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(2))
    assert sampler.sample([0], logits) == ({0: int(logits[0].argmax())}, {})


def test_a_row_whose_logits_are_not_finite_fails_alone_and_the_frames_other_rows_get_tokens() -> None:
    """What a NaN hidden state gives at the tail: that stream's error, the others' tokens."""
    sampler = TailSampler()
    for slot in (0, 1, 2):
        sampler.start(slot, SamplingParams(temperature=0.7, seed=slot))
    logits = torch.randn(3, 16)
    logits[1] = math.nan
    tokens, errors = sampler.sample([0, 1, 2], logits)
    assert set(tokens) == {0, 2} and set(errors) == {1} and errors[1].code == "input"


# ---- API keys ---------------------------------------------------------------------------------


def test_an_api_keys_file_takes_one_key_a_line_and_a_comment_after_a_key_is_not_part_of_it(tmp_path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# the team's keys\nsk-one  # alice\n\n   sk-two\t#bob\nsk-three\n")
    assert load_api_keys(keys, "sk-env, sk-four ,") == {"sk-one", "sk-two", "sk-three", "sk-env", "sk-four"}


@pytest.mark.parametrize(
    "text, env, no_auth, says",
    [
        ("", None, False, "holds no API key"),
        ("# only a comment\n\n   # another\n", None, False, "holds no API key"),
        (None, " , ,", False, "MF_API_KEYS holds no API key"),
        ("sk-one\n", None, True, "--no-auth serves without API keys"),
        ("sk one\n", None, False, "line 1: a key cannot hold whitespace"),
    ],
)
def test_api_keys_fail_closed_an_empty_source_is_an_error_not_an_open_gateway(tmp_path, text, env, no_auth,
                                                                               says) -> None:  # fmt: skip
    path = None
    if text is not None:
        path = tmp_path / "keys"
        path.write_text(text)
    with pytest.raises(ApiKeysError, match=says):
        load_api_keys(path, env, no_auth)


def test_without_a_key_source_the_gateway_is_open_only_when_asked_or_with_a_warning() -> None:
    assert load_api_keys(None, None, no_auth=True) == frozenset()
    assert load_api_keys(None, "", no_auth=False) == frozenset()


def test_the_gateway_command_refuses_an_empty_keys_file_at_startup(tmp_path) -> None:
    from typer.testing import CliRunner

    from modelfleet.cli import app

    keys = tmp_path / "keys"
    keys.write_text("# nothing here yet\n")
    result = CliRunner().invoke(app, ["gateway", "--plan", str(tmp_path / "unused.json"), "--api-keys-file", str(keys)])
    assert result.exit_code == 2 and "holds no API key" in result.output and "--no-auth" in result.output


# ---- liveness ---------------------------------------------------------------------------------

POLICY = LivenessPolicy(heartbeat_seconds=3.0, heartbeat_factor=3.0, heartbeat_cap_seconds=10.0, step_floor_seconds=3.0,
                        step_factor=4.0, step_cap_seconds=300.0, unmeasured_seconds=15.0)  # fmt: skip


@pytest.mark.parametrize(
    "round_trips, in_flight, deadline",
    [
        ([], 0, 15.0),  # nothing measured yet: a cold start's first steps get room
        ([0.01, 0.02], 1, 3.0),  # a quick pipeline: the floor, the bound a hung stage is held to
        ([0.4, 1.5, 0.9], 3, 18.0),  # a loaded one: 4 x the slowest x the steps in flight
        ([2.0], 0, 8.0),  # no step in flight counts as one (a chain probe alone)
        ([30.0], 8, 300.0),  # never past the cap
    ],
)
def test_a_steps_deadline_grows_with_measured_round_trips_and_the_steps_in_flight(round_trips, in_flight,
                                                                                  deadline) -> None:  # fmt: skip
    assert step_deadline_seconds(POLICY, round_trips, in_flight) == pytest.approx(deadline)


@pytest.mark.parametrize(
    "now, heartbeats, lost",
    [
        (100.0, {1: 99.5, 2: 99.9}, []),  # both beat within the last half second
        (100.0, {1: 96.5, 2: 99.9}, [1]),  # stage 1 silent 3.5 s: lost (stopped, killed, gone)
        (100.0, {1: 97.0}, [2]),  # stage 2 never heard since the head started at 90
        (92.0, {}, []),  # two seconds after the head started: no one is late yet
    ],
)
def test_a_stage_is_lost_when_its_heartbeats_stop_whatever_its_frames_do(now, heartbeats, lost) -> None:
    assert lost_stages(POLICY, now, heartbeats, [1, 2], since=90.0) == lost


@pytest.mark.parametrize(
    "gaps, deadline",
    [
        ([], 3.0),  # nothing measured: the floor
        ([0.5, 0.51, 0.6], 3.0),  # a healthy stage beats every half second: stopped, it is lost in 3 s
        ([0.5, 2.3, 0.5], 6.9),  # one starved of CPU beats late but beats: 3 x its longest gap
        ([4.0, 9.0], 10.0),  # never past the cap
    ],
)
def test_a_stages_heartbeat_deadline_grows_with_the_gaps_it_was_measured_to_beat_at(gaps, deadline) -> None:
    assert heartbeat_deadline_seconds(POLICY, gaps) == pytest.approx(deadline)


def test_a_starved_stage_that_beats_late_is_not_lost_but_a_healthy_one_as_late_is() -> None:
    gaps = {1: [0.5, 0.5], 2: [2.3, 2.2]}
    assert lost_stages(POLICY, 100.0, {1: 96.0, 2: 96.0}, [1, 2], since=0.0, gaps=gaps) == [1]


@pytest.mark.parametrize(
    "lost, answered, outstanding_since, deadline, ready",
    [
        ([], 99.0, None, 3.0, True),
        ([], 99.0, 95.0, 18.0, True),  # a probe queued 5 s behind frames of a busy pipeline: not dead
        ([], 99.0, 95.0, 3.0, False),  # the same 5 s on an idle pipeline: the chain broke somewhere
        ([1], 99.0, None, 3.0, False),  # a stage stopped beating
        ([], None, 99.0, 3.0, False),  # no probe has come back yet
    ],
)
def test_the_chain_is_ready_while_stages_beat_and_probes_return_within_a_steps_deadline(lost, answered,
                                                                                       outstanding_since, deadline,
                                                                                       ready) -> None:  # fmt: skip
    assert chain_ready(POLICY, 100.0, lost, answered, outstanding_since, deadline) is ready


# ---- the tensor group's rendezvous -----------------------------------------------------------


def listening_hosts(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp writes them) of sockets listening on ``port``."""
    hosts = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                host, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:
                    hosts.add(host)
    return hosts


def rendezvous_rank(rank: int, port: int, namespace: str, out: Path) -> None:
    from modelfleet.engine.tensor_parallel import close_tensor_group, init_tensor_group

    try:
        group = init_tensor_group(rank, 2, "127.0.0.1", port, "cpu", timeout_seconds=8, namespace=namespace)
    except InputError as exc:
        out.write_text(json.dumps({"joined": False, "error": str(exc)}))
        return
    total = group.all_reduce(torch.tensor([rank + 1.0]))
    hosts = sorted(listening_hosts(port)) if rank == 0 else []
    torch.distributed.barrier()
    close_tensor_group()
    out.write_text(json.dumps({"joined": True, "sum": float(total), "hosts": hosts}))


def test_the_tensor_rendezvous_listens_on_the_stages_address_and_admits_only_ranks_with_the_fleets_secret(
    tmp_path,
) -> None:
    """Issue 30, item 7: the rendezvous listened on every interface (*:port+3) outside CURVE.
    Now rank 0's store is bound to the stage's address, and every key of the group lives under a
    namespace derived from the fleet's secret key: a rank without it never meets the group."""
    keys, other = wire.generate_keypair(), wire.generate_keypair()
    ours = rendezvous_namespace(keys.secret, "ab" * 32, 0, 1)
    assert (
        ours == rendezvous_namespace(keys.secret, "ab" * 32, 0, 1) != rendezvous_namespace(keys.secret, "ab" * 32, 0, 2)
    )
    theirs = rendezvous_namespace(other.secret, "ab" * 32, 0, 1)
    assert theirs != ours and rendezvous_namespace(None, "ab" * 32, 0, 1) == ""
    context = multiprocessing.get_context("spawn")
    good, bad = free_port(), free_port()
    runs = {"rank0": (0, good, ours), "rank1": (1, good, ours), "alone0": (0, bad, ours), "stranger": (1, bad, theirs)}
    processes = [context.Process(target=rendezvous_rank, args=(*args, tmp_path / name)) for name, args in runs.items()]
    for p in processes:
        p.start()
    for p in processes:
        p.join(60)
    results = {name: json.loads((tmp_path / name).read_text()) for name in runs}
    assert results["rank0"] == {"joined": True, "sum": 3.0, "hosts": ["0100007F"]}  # 127.0.0.1, not 0.0.0.0
    assert results["rank1"]["joined"] and results["rank1"]["sum"] == 3.0
    assert not results["stranger"]["joined"] and not results["alone0"]["joined"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_up_refuses_wire_keys_it_cannot_use_before_starting_anything(tmp_path) -> None:
    """Issue 30, item 6: ``up`` makes a CURVE pair per run; --keys-dir must hold a usable pair,
    and --insecure-wire (plain TCP, said loudly) cannot be combined with it."""
    from typer.testing import CliRunner

    from modelfleet.cli import app

    ports = ["--base-port", str(free_base_port(2)), "--port", str(free_port())]
    missing = CliRunner().invoke(app, ["up", "--keys-dir", str(tmp_path), *ports])
    assert missing.exit_code == 2 and f"modelfleet keys --out {tmp_path}" in missing.output
    wire.save_keypair(wire.generate_keypair(), tmp_path, "fleet")
    both = CliRunner().invoke(app, ["up", "--keys-dir", str(tmp_path), "--insecure-wire", *ports])
    assert both.exit_code == 2 and "--keys-dir and --insecure-wire disagree" in both.output
