"""A local fleet of stage processes over ZeroMQ against the single-process engine: the same
greedy tokens for concurrent streams, slots freed on every stage, hostile input dropped, and
streams that live through a killed or stopped stage (replay) or fail past the replay deadline."""

from __future__ import annotations

import contextlib
import math
import os
import random
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
import zmq

from modelfleet.agent import transport as wire
from modelfleet.agent.client import FleetClient
from modelfleet.agent.launcher import LocalFleet, fetch_json, port_free
from modelfleet.commands.fleet import make_plan
from modelfleet.engine.generate import LocalModel, generate_batch
from modelfleet.engine.sampling import SamplingParams

STAGES = 3


def free_base_port(stages: int) -> int:
    for _ in range(50):
        base = random.randrange(20000, 60000, 10)
        if all(port_free("127.0.0.1", base + 10 * s + k) for s in range(stages) for k in range(3)):
            return base
    raise RuntimeError("no free ports")


class Fleet:
    def __init__(self, model_dir: Path, workdir: Path, keys: wire.KeyPair | None = None, stages: int = STAGES,
                 speculative: dict | None = None, replay_timeout_seconds: float = 120.0):  # fmt: skip
        plan = make_plan(model_dir, stages, max_streams=16, context_length=256, window_rows=4,
                         base_port=free_base_port(stages), speculative=speculative)  # fmt: skip
        serving = plan.serving.model_copy(update={"replay_timeout_seconds": replay_timeout_seconds})
        self.plan = plan.model_copy(update={"serving": serving})
        self.plan_path = workdir / "plan.json"
        self.plan_path.write_text(self.plan.to_json())
        self.keys = keys
        if keys is not None:
            wire.save_keypair(keys, workdir, "fleet")
        self.keys_dir = workdir
        self.log = (workdir / "fleet.log").open("w")
        self.local = LocalFleet(self.plan, self.plan_path, out=self.log)
        self.stages = self.plan.groups[0].stages

    def command(self, stage: int) -> list[str]:
        keys = ["--keys-dir", str(self.keys_dir)] if self.keys is not None else []
        return [*self.local.stage_command(stage), *keys]

    def start(self) -> None:
        env = {**os.environ, "PYTHONSAFEPATH": "1", "OMP_NUM_THREADS": "1"}
        for s in self.stages:
            self.local.spawn(f"stage {s.stage_index}", self.command(s.stage_index), env, self.status_url(s.stage_index))
        self.local.wait_ready(120)

    def restart(self, stage: int) -> None:
        env = {**os.environ, "PYTHONSAFEPATH": "1", "OMP_NUM_THREADS": "1"}
        self.local.children[stage] = self.local.spawn(
            f"stage {stage}", self.command(stage), env, self.status_url(stage)
        )
        self.local.children.pop()  # spawn appended it; it now sits at its stage's place

    def status_url(self, stage: int) -> str:
        s = self.stages[stage]
        return f"http://{s.host}:{s.port + 1}/status"

    def status(self, stage: int) -> dict:
        data = fetch_json(self.status_url(stage))
        assert data is not None, f"stage {stage} does not answer /status"
        return data

    def metric(self, stage: int, name: str) -> float:
        s = self.stages[stage]
        text = urllib.request.urlopen(f"http://{s.host}:{s.port + 1}/metrics", timeout=2).read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))

    def readyz(self) -> int:
        s = self.stages[0]
        try:
            return urllib.request.urlopen(f"http://{s.host}:{s.port + 1}/readyz", timeout=2).status
        except urllib.error.HTTPError as exc:
            return exc.code

    def client(self) -> FleetClient:
        return FleetClient(self.stages[0].address, keys=self.keys, timeout_seconds=60)

    def stop(self) -> None:
        self.local.stop()
        self.log.close()


def wait_until(condition, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout} s: {what}")


@pytest.fixture(scope="module")
def secure_fleet(tiny_checkpoint, tmp_path_factory):  # type: ignore[no-untyped-def]
    path, _ = tiny_checkpoint("qwen3_moe")
    fleet = Fleet(path, tmp_path_factory.mktemp("fleet"), keys=wire.generate_keypair())
    fleet.start()
    yield fleet
    fleet.stop()


def prompts_and_params(count: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 128) for _ in range(1 + (5 * i) % 19)] for i in range(count)]
    params = [SamplingParams(max_tokens=4 + (3 * i) % 13) for i in range(count)]
    return prompts, params


def run_concurrently(fleet: Fleet, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    with fleet.client() as client:
        ids = [client.submit(p, s) for p, s in zip(prompts, params, strict=True)]
        results = client.wait(ids)
    assert all(r.finish_reason in ("stop", "length") for r in results), [r.error for r in results]
    return [r.token_ids for r in results]


def reference(model_dir: Path, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    lm = LocalModel.load(model_dir, max_slots=len(prompts), max_context=256)
    return [r.token_ids for r in generate_batch(lm, prompts, params)]


def test_three_stage_fleet_with_keys_gives_the_greedy_tokens_of_the_single_process_engine(
    secure_fleet, tiny_checkpoint
) -> None:
    prompts, params = prompts_and_params(12)
    assert run_concurrently(secure_fleet, prompts, params) == reference(
        tiny_checkpoint("qwen3_moe")[0], prompts, params
    )
    # a finish reaches the client before the releases reach every stage
    wait_until(lambda: [secure_fleet.status(s)["slots_in_use"] for s in range(STAGES)] == [0, 0, 0], 5, "slots freed")
    statuses = [secure_fleet.status(s) for s in range(STAGES)]
    assert statuses[0]["head"]["chain_ready"] and statuses[0]["role"] == "head" and statuses[2]["role"] == "tail"


def test_three_stage_fleet_of_another_family_matches_too(tiny_checkpoint, tmp_path) -> None:
    path, _ = tiny_checkpoint("mixtral")
    fleet = Fleet(path, tmp_path)
    fleet.start()
    try:
        prompts, params = prompts_and_params(12)
        assert run_concurrently(fleet, prompts, params) == reference(path, prompts, params)
    finally:
        fleet.stop()


def test_streams_arriving_and_leaving_mid_flight_do_not_disturb_the_others(secure_fleet, tiny_checkpoint) -> None:
    prompts, params = prompts_and_params(8)
    expected = reference(tiny_checkpoint("qwen3_moe")[0], prompts, params)
    with secure_fleet.client() as client:
        first = [client.submit(p, s) for p, s in zip(prompts[:4], params[:4], strict=True)]
        client.poll(0.05)
        doomed = client.submit([5, 6, 7], SamplingParams(max_tokens=200, stop_token_ids=()))
        later = [client.submit(p, s) for p, s in zip(prompts[4:], params[4:], strict=True)]
        wait_until(
            lambda: (client.poll(0.01) or True) and client.results[doomed].token_ids, 10, "doomed stream started"
        )
        client.cancel(doomed)
        results = client.wait([*first, *later, doomed])
    assert [r.token_ids for r in results[:8]] == expected
    assert results[8].finish_reason == "cancelled"


def test_six_concurrent_streams_one_with_extreme_sampling_values_all_finish_and_it_samples_greedily(
    secure_fleet, tiny_checkpoint
) -> None:
    """Issue 30, item 1: top_p of 5e-324 and temperature of 1e-300 are accepted values; they once
    made the tail's distribution NaN and failed the streams sharing its frames. Now that stream
    samples the most likely token (as greedy does) and the five beside it finish untouched."""
    prompts, params = prompts_and_params(5)
    hostile = SamplingParams(temperature=1e-300, top_p=5e-324, max_tokens=8, seed=1, stop_token_ids=())
    model_dir = tiny_checkpoint("qwen3_moe")[0]
    expected = reference(model_dir, [*prompts, prompts[0]], [*params, SamplingParams(max_tokens=8, stop_token_ids=())])
    with secure_fleet.client() as client:
        ids = [client.submit(p, s) for p, s in zip(prompts[:2], params[:2], strict=True)]
        bad = client.submit(prompts[0], hostile)
        ids += [client.submit(p, s) for p, s in zip(prompts[2:], params[2:], strict=True)]
        results = client.wait([*ids, bad])
    assert [r.finish_reason for r in results] == [r.finish_reason for r in results if r.finish_reason != "error"]
    assert [r.token_ids for r in results] == expected
    # the last release travels behind the last token: give it the time a frame takes
    wait_until(lambda: all(secure_fleet.status(s)["slots_in_use"] == 0 for s in range(STAGES)), 5, "slots freed")


def test_a_cancelled_stream_frees_its_slot_on_every_stage(secure_fleet) -> None:
    with secure_fleet.client() as client:
        request = client.submit([9, 8, 7, 6], SamplingParams(max_tokens=240, stop_token_ids=()))
        wait_until(lambda: (client.poll(0.01) or True) and len(client.results[request].token_ids) >= 2, 10, "tokens")
        assert [secure_fleet.status(s)["slots_in_use"] for s in range(STAGES)] == [1, 1, 1]
        client.cancel(request)
        assert client.wait([request])[0].finish_reason == "cancelled"
    wait_until(lambda: all(secure_fleet.status(s)["slots_in_use"] == 0 for s in range(STAGES)), 5.0, "slots freed")


def test_malformed_and_unauthenticated_messages_are_dropped_while_the_fleet_serves(secure_fleet) -> None:
    # an authenticated peer sending garbage and a header whose payload size does not match
    with keyed_peer(secure_fleet, 1) as good:
        before = secure_fleet.metric(1, "modelfleet_stage_malformed_messages_total")
        good.send_multipart([b"\x93not a header"])
        frame = wire.encode(
            wire.TokensMsg(microbatch=0, step=1, slots=_ids([1]), positions=_ids([1]), token_ids=_ids([1]))
        )
        good.send_multipart([frame[0], frame[1][:-1], frame[2], frame[3]])
        drops = "modelfleet_stage_malformed_messages_total"
        wait_until(lambda: secure_fleet.metric(1, drops) >= before + 2, 30, "both malformed messages dropped")
        # a peer without the fleet's keys never gets a message through
        frames_before = secure_fleet.metric(1, "modelfleet_stage_frames_total")
        plain = good.context.socket(zmq.PUSH)
        plain.setsockopt(zmq.LINGER, 0)
        plain.connect(f"tcp://{secure_fleet.stages[1].address}")
        with contextlib.suppress(zmq.Again):
            plain.send_multipart(wire.encode(wire.ReleaseMsg(slots=(1,))), zmq.NOBLOCK)
        with secure_fleet.client() as client:
            served = client.generate([4, 5, 6], SamplingParams(max_tokens=5, stop_token_ids=()))
        assert served.finish_reason == "length", served.error
        assert secure_fleet.metric(1, drops) == before + 2
        assert secure_fleet.metric(1, "modelfleet_stage_frames_total") > frames_before


def test_forged_frames_for_a_slot_with_no_sampler_or_with_a_nan_hidden_state_hold_no_slot(
    secure_fleet, tiny_checkpoint
) -> None:
    """Issue 30, item 6: frames no head sent (a peer with the keys, or a bug) reach the tail for
    a slot no stream holds; whatever the tail makes of them (no sampler, a NaN hidden state), the
    head frees the slot on every stage, and the fleet serves on."""
    from modelfleet.engine.spec import load_spec

    width = load_spec(tiny_checkpoint("qwen3_moe")[0]).hidden_size
    with keyed_peer(secure_fleet, 1) as peer:
        nan = torch.full((2, width), math.nan)
        forged = [
            wire.FrameMsg(microbatch=0, step=10**9, slots=_ids([7, 7]), positions=_ids([0, 1]),
                          hidden=torch.zeros(2, width), output_rows=(1,)),  # no stream started in slot 7
            wire.FrameMsg(microbatch=0, step=10**9 + 1, slots=_ids([8, 8]), positions=_ids([0, 1]), hidden=nan,
                          output_rows=(1,), new_streams=(wire.StreamStart(slot=8, temperature=0.7),)),
            wire.FrameMsg(microbatch=0, step=10**9 + 2, slots=_ids([9, 9]), positions=_ids([0, 1]), hidden=nan,
                          output_rows=(1,), new_streams=(wire.StreamStart(slot=9),)),  # greedy: a token of NaN
        ]  # fmt: skip
        frames = secure_fleet.metric(2, "modelfleet_stage_frames_total")
        for msg in forged:
            peer.send_multipart(wire.encode(msg))
        wait_until(
            lambda: secure_fleet.metric(2, "modelfleet_stage_frames_total") >= frames + 2, 30, "the tail computed"
        )
        wait_until(lambda: all(secure_fleet.status(s)["slots_in_use"] == 0 for s in range(STAGES)), 10,
                   "every stage freed the forged slots")  # fmt: skip
        with secure_fleet.client() as client:
            served = client.generate([4, 5, 6], SamplingParams(max_tokens=5, stop_token_ids=()))
        assert served.finish_reason == "length", served.error


def test_a_message_over_the_size_limit_is_counted_as_malformed_not_dropped_unseen(secure_fleet) -> None:
    """Issue 30, item 6: a 65 MiB frame was dropped by libzmq's own limit (the peer disconnected,
    nothing counted); now libzmq's limit is twice the protocol's and the stage counts it."""
    with keyed_peer(secure_fleet, 1) as peer:
        drops = "modelfleet_stage_malformed_messages_total"
        before = secure_fleet.metric(1, drops)
        peer.send_multipart([b"\x00" * (wire.MAX_MESSAGE_BYTES + (1 << 20))])
        wait_until(lambda: secure_fleet.metric(1, drops) == before + 1, 30, "the oversized message counted")


@contextlib.contextmanager
def keyed_peer(fleet, stage: int):  # type: ignore[no-untyped-def]
    """A PUSH socket holding the fleet's CURVE keys, connected to ``stage``: a peer the stage lets
    in, sending whatever a test forges."""
    keys = fleet.keys
    assert keys is not None
    ctx = zmq.Context()
    try:
        peer = ctx.socket(zmq.PUSH)
        peer.setsockopt(zmq.LINGER, 0)
        wire.curve_client(peer, keys, keys.public)
        peer.connect(f"tcp://{fleet.stages[stage].address}")
        yield peer
    finally:
        ctx.destroy(linger=0)


def _ids(values: list[int]):  # type: ignore[no-untyped-def]
    import torch

    return torch.tensor(values, dtype=torch.int64)


def long_streams(count: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Greedy streams of different lengths, long enough to be mid-stream when a stage is lost,
    one with frequency, presence and repetition penalties (the tail must count the output from
    before the loss), and one seeded sampled stream."""
    prompts, _ = prompts_and_params(count)
    params = [SamplingParams(max_tokens=30 + 7 * i, stop_token_ids=()) for i in range(count - 2)]
    penalised = SamplingParams(frequency_penalty=1.0, presence_penalty=0.5, repetition_penalty=1.2, max_tokens=40,
                               stop_token_ids=())  # fmt: skip
    sampled = SamplingParams(temperature=0.9, top_k=20, seed=11, max_tokens=40, stop_token_ids=())
    return prompts, [*params, penalised, sampled]


def through_a_killed_stage(fleet: Fleet, client, prompts, params):  # type: ignore[no-untyped-def]
    """Submit the streams, SIGKILL stage 1 once they run, restart it once the head holds them for a
    replay, and return their results."""
    ids = submit_all(client, prompts, params)
    fleet.local.children[1].process.send_signal(signal.SIGKILL)
    fleet.local.children[1].process.wait()
    wait_until(lambda: fleet.status(0)["head"]["streams_waiting_for_replay"] > 0, 10, "streams wait")
    fleet.restart(1)
    return client.wait(ids)


def submit_all(client: FleetClient, prompts: list[list[int]], params: list[SamplingParams]) -> list[int]:
    ids = [client.submit(p, s) for p, s in zip(prompts, params, strict=True)]
    started = lambda: (client.poll(0.01) or True) and all(len(client.results[i].token_ids) >= 3 for i in ids)  # noqa: E731
    wait_until(started, 30, "every stream streamed a few tokens")
    return ids


def test_killing_the_middle_stage_mid_stream_loses_no_token_and_eight_streams_finish_with_the_engines_tokens(
    secure_fleet, tiny_checkpoint
) -> None:
    """Issue 34: the head pauses the pipeline, the restarted stage (a new incarnation) is replayed
    into (prompt + committed output on every stage), and each stream goes on where it stopped,
    a seeded sampled one and one with penalties too."""
    prompts, params = long_streams(8)
    expected = reference(tiny_checkpoint("qwen3_moe")[0], prompts, params)
    replays = secure_fleet.metric(0, "modelfleet_head_replays_total")
    with secure_fleet.client() as client:
        results = through_a_killed_stage(secure_fleet, client, prompts, params)
    assert [r.finish_reason for r in results] == ["length"] * 8, [r.error for r in results]
    assert [r.token_ids for r in results] == expected
    assert secure_fleet.metric(0, "modelfleet_head_replays_total") >= replays + 1
    assert secure_fleet.metric(0, "modelfleet_head_replayed_tokens_total") > 0
    wait_until(lambda: all(secure_fleet.status(s)["slots_in_use"] == 0 for s in range(STAGES)), 10, "slots freed")
    assert [secure_fleet.status(s)["phase"] for s in range(STAGES)] == ["Ready"] * 3


def test_a_stage_stopped_past_its_heartbeat_deadline_then_continued_is_replayed_into_and_no_stream_fails(
    secure_fleet, tiny_checkpoint
) -> None:
    """Issue 30, item 4 made a SIGSTOPed stage lost within seconds (heartbeats, tests/test_hardening.py
    has the deadlines' table); issue 34 keeps its streams paused until it beats again, and a
    request arriving meanwhile waits for the heal instead of being refused."""
    prompts, params = long_streams(5)
    expected = reference(tiny_checkpoint("qwen3_moe")[0], prompts, params)
    stage = secure_fleet.local.children[1].process
    with secure_fleet.client() as client:
        ids = submit_all(client, prompts[:4], params[:4])
        stage.send_signal(signal.SIGSTOP)
        try:
            wait_until(lambda: secure_fleet.status(0)["head"]["paused"], 15, "the head paused the pipeline")
            head = secure_fleet.status(0)["head"]
            assert head["stages_lost"] == [1] and head["streams_waiting_for_replay"] == 4
            assert secure_fleet.readyz() == 503
            ids.append(client.submit(prompts[4], params[4]))  # arrives while the pipeline heals
        finally:
            stage.send_signal(signal.SIGCONT)
        results = client.wait(ids)
    assert [r.token_ids for r in results] == expected, [r.error for r in results]
    wait_until(lambda: all(secure_fleet.status(s)["slots_in_use"] == 0 for s in range(STAGES)), 10, "slots freed")


def test_a_pipeline_that_does_not_heal_within_the_replay_deadline_fails_its_streams_and_frees_every_slot(
    tiny_checkpoint, tmp_path
) -> None:
    fleet = Fleet(tiny_checkpoint("qwen3_moe")[0], tmp_path, stages=2, replay_timeout_seconds=2.0)
    fleet.start()
    try:
        with fleet.client() as client:
            request = client.submit([1, 2, 3], SamplingParams(max_tokens=200, stop_token_ids=()))
            wait_until(
                lambda: (client.poll(0.01) or True) and len(client.results[request].token_ids) >= 1, 10, "tokens"
            )
            fleet.local.children[1].process.send_signal(signal.SIGKILL)
            result = client.wait([request])[0]
            assert result.finish_reason == "error" and result.code == "replay_timeout", result.error
            assert "replay_timeout_seconds" in result.error
            # the status gauges follow the head's loop: the slots are free by its next turn
            wait_until(lambda: fleet.status(0)["slots_in_use"] == 0, 10, "every slot free")
            refused = client.generate([1, 2], SamplingParams(max_tokens=2))
            assert refused.finish_reason == "error" and refused.code == "not_ready" and "not ready" in refused.error
            fleet.local.children[1].process.wait()
            fleet.restart(1)
            wait_until(lambda: fleet.readyz() == 200, 60, "the fleet is ready again")
            again = client.generate([4, 5, 6], SamplingParams(max_tokens=6, stop_token_ids=()))
            assert again.finish_reason == "length" and len(again.token_ids) == 6
        wait_until(lambda: all(fleet.status(s)["slots_in_use"] == 0 for s in range(2)), 10, "slots freed")
    finally:
        fleet.stop()


def test_a_local_fleet_of_two_replicas_starts_every_stage_of_both_groups(tiny_checkpoint, tmp_path) -> None:
    path, _ = tiny_checkpoint("qwen3_moe")
    plan = make_plan(path, 2, groups=2, base_port=free_base_port(4))
    fleet = LocalFleet(plan, tmp_path / "plan.json")
    spawned: list[tuple[str, list[str]]] = []
    fleet.spawn = lambda name, command, env, status_url=None, cpus=None: spawned.append((name, command))  # type: ignore[method-assign,assignment,misc,return-value]
    fleet.start()
    assert [name for name, _ in spawned] == ["g0 stage 0", "g0 stage 1", "g1 stage 0", "g1 stage 1"]
    assert [command[-3:] for _, command in spawned] == [["0", "--group", "0"], ["1", "--group", "0"],
                                                        ["0", "--group", "1"], ["1", "--group", "1"]]  # fmt: skip
