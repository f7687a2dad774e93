"""Stages split over tensor ranks: a local fleet of two stages of two ranks each (four processes,
gloo) gives the greedy tokens of the single-process engine, each follower rank holds its share
of the experts and answers /status, and a killed follower fails its stage's streams with a
clear error. The commands rank 0 broadcasts to its followers round-trip as int64 tensors, a
lost group refuses frames by name, and plans leave each stage room for its ranks' ports."""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

import pytest
import torch
from test_pipeline import prompts_and_params, reference, wait_until

from modelfleet.agent.client import FleetClient
from modelfleet.agent.launcher import LocalFleet, fetch_json, port_free, rank_http_port, stage_ports
from modelfleet.agent.tensor_group import (
    HEADER_WORDS,
    Command,
    CommandError,
    Op,
    TensorGroupLost,
    TensorStage,
    receive_command,
    send_command,
)
from modelfleet.commands.fleet import make_plan
from modelfleet.engine.frame import Frame
from modelfleet.engine.sampling import SamplingParams
from modelfleet.engine.shard import Shard

STAGES, TENSOR = 2, 2


class Recorder:
    """A channel whose leader side records each broadcast tensor and whose follower side
    receives them in order (into the tensor the protocol allocated: same dtype and shape)."""

    def __init__(self) -> None:
        self.sent: list[torch.Tensor] = []

    def broadcast(self, t: torch.Tensor) -> None:
        self.sent.append(t.clone())

    def replay(self) -> Replay:
        return Replay(list(self.sent))


class Replay:
    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors

    def broadcast(self, t: torch.Tensor) -> None:
        sent = self.tensors.pop(0)
        assert (sent.dtype, sent.shape) == (t.dtype, t.shape)
        t.copy_(sent)


def round_trip(command: Command) -> tuple[Command, list[torch.Tensor]]:
    recorder = Recorder()
    send_command(recorder, command)
    replay = recorder.replay()
    received = receive_command(replay)
    assert replay.tensors == []  # the follower read exactly what the leader sent
    return received, recorder.sent


def test_commands_round_trip_as_int64_headers_and_the_frames_tensors() -> None:
    tokens = Frame(torch.tensor([3, 3, 5]), torch.tensor([0, 1, 7]), token_ids=torch.tensor([11, 12, 13]))
    received, sent = round_trip(Command(Op.FORWARD, tokens))
    assert sent[0].dtype == torch.int64 and sent[0].shape == (HEADER_WORDS,)
    assert received.op == Op.FORWARD and received.frame is not None
    assert received.frame.slots.tolist() == [3, 3, 5] and received.frame.positions.tolist() == [0, 1, 7]
    assert received.frame.token_ids is not None and received.frame.token_ids.tolist() == [11, 12, 13]
    assert received.frame.hidden is None

    hidden = torch.randn(2, 24)
    received, sent = round_trip(Command(Op.FORWARD, Frame(torch.tensor([1, 2]), torch.tensor([4, 9]), hidden=hidden)))
    assert received.frame is not None and received.frame.token_ids is None
    assert received.frame.hidden is not None and torch.equal(received.frame.hidden, hidden)
    assert [t.dtype for t in sent] == [torch.int64, torch.int64, torch.int64, torch.float32]

    streams, ids = torch.randn(2, 3, 8), torch.tensor([5, 6])
    frame = Frame(torch.tensor([1, 1]), torch.tensor([4, 5]), token_ids=ids, hidden=streams)
    received, sent = round_trip(Command(Op.FORWARD, frame))  # DeepSeek-V4: hc_mult streams, and ids to route by
    assert received.frame is not None and received.frame.hidden is not None and received.frame.token_ids is not None
    assert torch.equal(received.frame.hidden, streams) and received.frame.token_ids.tolist() == [5, 6]

    for command in (Command(Op.RELEASE, args=(6, 0, 0)), Command(Op.REWIND, args=(2, 17, 0)),
                    Command(Op.ALLOCATE, args=(16, 256, 1 << 40)), Command(Op.HEARTBEAT), Command(Op.STOP)):  # fmt: skip
        received, sent = round_trip(command)
        assert (received.op, received.args, received.frame) == (command.op, command.args, None)
        assert len(sent) == 1  # the header alone


@pytest.mark.parametrize(
    ("header", "says"),
    [
        ([9, 0, 0, 0, 0, 0, 0, 0], "op 9 is unknown"),
        ([1, 0, 1, 0, 0, 0, 0, 0], "0 rows"),
        ([1, 1 << 30, 1, 0, 0, 0, 0, 0], "rows, outside"),
        ([1, 4, 2, 8, 7, 0, 0, 0], "dtype code 7"),
        ([1, 4, 3, 0, 0, 0, 0, 0], "payload 3"),
        ([1, 4, 2, 8, 1, 0, 2, 0], "token-id flag 2"),
        ([1, 4, 2, 8, 1, 0, 0, 65], "stream count 65"),
    ],
)
def test_a_header_no_leader_sends_is_refused_before_anything_is_allocated(header: list[int], says: str) -> None:
    with pytest.raises(CommandError, match=says):
        receive_command(Replay([torch.tensor(header, dtype=torch.int64)]))


# ---- a fleet of two stages of two tensor ranks -------------------------------------------------


def free_base_port() -> int:
    for _ in range(50):
        base = random.randrange(20000, 60000, 10)
        ports = [base + 10 * s + k for s in range(STAGES) for k in range(3 + TENSOR)]
        if all(port_free("127.0.0.1", p) for p in ports):
            return base
    raise RuntimeError("no free ports")


class TensorFleet:
    def __init__(self, model_dir: Path, workdir: Path):
        self.plan = make_plan(model_dir, STAGES, max_streams=8, context_length=256, window_rows=4,
                              base_port=free_base_port(), tensor=TENSOR)  # fmt: skip
        plan_path = workdir / "plan.json"
        plan_path.write_text(self.plan.to_json())
        self.log_path = workdir / "fleet.log"
        self.log = self.log_path.open("w")
        self.local = LocalFleet(self.plan, plan_path, out=self.log)
        self.stages = self.plan.groups[0].stages

    def start(self) -> None:
        self.local.start()
        self.local.wait_ready(120)

    def child(self, name: str):  # type: ignore[no-untyped-def]
        return next(c for c in self.local.children if c.name == name)

    def status(self, stage: int, rank: int) -> dict | None:
        s = self.stages[stage]
        return fetch_json(f"http://{s.host}:{rank_http_port(s, rank)}/status")

    def client(self) -> FleetClient:
        return FleetClient(self.stages[0].address, timeout_seconds=60)

    def stop(self) -> None:
        self.local.stop()
        self.log.close()


@pytest.fixture(scope="module")
def tensor_fleet(tiny_checkpoint, tmp_path_factory):  # type: ignore[no-untyped-def]
    path, _ = tiny_checkpoint("qwen3_moe")
    fleet = TensorFleet(path, tmp_path_factory.mktemp("tensor-fleet"))
    fleet.start()
    yield fleet
    fleet.stop()


def test_local_fleet_starts_every_rank_of_every_stage_on_its_own_ports(tensor_fleet) -> None:
    assert [c.name for c in tensor_fleet.local.children] == ["stage 0", "stage 0 rank 1", "stage 1", "stage 1 rank 1"]
    assert [s.tp_size for s in tensor_fleet.stages] == [TENSOR, TENSOR]
    s = tensor_fleet.stages[0]
    assert stage_ports(s) == [s.port, s.port + 1, s.port + 2, s.port + 3, s.port + 4]


def test_two_stages_of_two_tensor_ranks_give_the_greedy_tokens_of_the_single_process_engine(
    tensor_fleet, tiny_checkpoint
) -> None:
    prompts, params = prompts_and_params(6)
    with tensor_fleet.client() as client:
        ids = [client.submit(p, s) for p, s in zip(prompts, params, strict=True)]
        results = client.wait(ids)
    assert [r.finish_reason in ("stop", "length") for r in results] == [True] * 6, [r.error for r in results]
    assert [r.token_ids for r in results] == reference(tiny_checkpoint("qwen3_moe")[0], prompts, params)


def test_a_follower_rank_reports_its_layers_and_holds_half_of_its_stages_experts(tensor_fleet, tiny_checkpoint) -> None:
    stage = tensor_fleet.stages[1]
    leader, follower = tensor_fleet.status(1, 0), tensor_fleet.status(1, 1)
    assert leader is not None and follower is not None
    assert (follower["phase"], follower["tensor_rank"], follower["tensor_size"]) == ("Ready", 1, TENSOR)
    assert follower["layers_loaded"] == follower["layers_total"] == stage.num_layers
    whole = Shard.load(tiny_checkpoint("qwen3_moe")[0], stage.layer_start, stage.layer_end).bytes_by_role
    experts = sum(whole["experts"].values())
    assert sum(follower["bytes_by_role"]["experts"].values()) == experts // 2
    assert sum(leader["bytes_by_role"]["experts"].values()) == experts // 2
    assert follower["kv_bytes"] == leader["kv_bytes"] > 0


def test_killing_a_follower_fails_its_stages_streams_clearly_and_killing_a_leader_stops_its_followers(
    tensor_fleet,
) -> None:
    # last: the stage's tensor group is gone for good once a rank dies (Kubernetes restarts them all)
    with tensor_fleet.client() as client:
        request = client.submit([1, 2, 3], SamplingParams(max_tokens=240, stop_token_ids=()))
        wait_until(lambda: (client.poll(0.01) or True) and len(client.results[request].token_ids) >= 1, 10, "tokens")
        tensor_fleet.child("stage 1 rank 1").process.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        result = client.wait([request])[0]
        assert result.finish_reason == "error" and "tensor rank of stage 1 stopped answering" in result.error
        assert time.monotonic() - killed_at < 5.0
    status = tensor_fleet.status(1, 0)
    assert status is None or (status["phase"] == "Failed" and "stopped answering" in status["reason"])
    wait_until(lambda: not (tensor_fleet.status(0, 0) or {}).get("ready", True), 5, "the head reports unready")
    # a follower whose rank 0 is gone exits with an error, to be restarted with it
    tensor_fleet.child("stage 0").process.send_signal(signal.SIGKILL)
    follower = tensor_fleet.child("stage 0 rank 1").process
    wait_until(lambda: follower.poll() is not None, 5, "the follower of the killed rank 0 exits")
    assert follower.returncode != 0


class Broken:
    """A channel whose peer is gone: every broadcast fails as gloo's do."""

    def broadcast(self, t: torch.Tensor) -> None:
        raise RuntimeError("Connection reset by peer")


def test_a_lost_group_refuses_frames_by_name_and_still_releases_slots_locally(tiny_checkpoint) -> None:
    shard = Shard.load(tiny_checkpoint("qwen3_moe")[0], 0, 2)
    stage = TensorStage(shard, Recorder(), "stage 0")
    stage.allocate_cache(2, 32)
    stage(Frame(torch.tensor([1, 1]), torch.tensor([0, 1]), token_ids=torch.tensor([5, 6])))
    assert shard.slots is not None and shard.slots.in_use() == 1
    stage.channel = Broken()
    stage.release(1)  # the head's bookkeeping stays whole though the followers cannot hear it
    assert shard.slots.in_use() == 0 and stage.lost is not None and "stage 0 stopped answering" in stage.lost
    with pytest.raises(TensorGroupLost, match="a tensor rank of stage 0 stopped answering"):
        stage(Frame(torch.tensor([0]), torch.tensor([0]), token_ids=torch.tensor([5])))


def test_plan_with_tensor_ranks_sets_tp_size_and_leaves_each_stage_room_for_its_rank_ports(
    tiny_checkpoint, monkeypatch
) -> None:
    path, _ = tiny_checkpoint("qwen3_moe")
    # the ports only: the tiny model's 4 heads split over 2 ranks, not 7 or 8 (test_plan_refusals)
    monkeypatch.setattr("modelfleet.planner.tensor_refusal", lambda split, tensor, option="--tensor": None)
    for tensor, stride in ((2, 10), (7, 10), (8, 20)):
        plan = make_plan(path, 2, base_port=30000, tensor=tensor)
        first, second = plan.groups[0].stages
        assert (first.tp_size, second.tp_size, second.port - first.port) == (tensor, tensor, stride)
        assert max(stage_ports(first)) < second.port
