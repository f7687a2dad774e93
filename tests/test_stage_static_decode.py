"""A pipeline stage runs decode-only frames (every row sampled, no stream starting) as static
steps, CUDA-graph replays on GPUs, as single-process generation does: the first stage from token
ids, a later one from the previous stage's residual rows; the last gives logits, an earlier one
residual rows to send on. Split in 2 and 3 stages, with the static path forced on CPU (where it
runs eagerly), every stage's output equals the general path's over decode rows, verify windows,
padded buckets, streams joining and leaving between steps and rewinds. A stage agent flags its
frames from the wire (every row an output row, no stream starting); frames it does not flag, and a
stage that keeps its final hidden rows for a proposer, stay general."""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest
import torch
from gpu_cases import cuda_only
from tiny import assert_close_to

from modelfleet.agent import transport as wire
from modelfleet.agent.stage import AgentConfig, StageAgent
from modelfleet.commands.fleet import make_plan
from modelfleet.engine.backend import load_backend
from modelfleet.engine.errors import InputError
from modelfleet.engine.frame import Frame
from modelfleet.engine.generate import LocalModel, generate_batch
from modelfleet.engine.sampling import SamplingParams
from modelfleet.engine.scheduler import Step
from modelfleet.engine.shard import Shard
from modelfleet.engine.speculative.config import SpeculativeConfig
from modelfleet.engine.speculative.speculator import Speculator
from modelfleet.engine.static_decode import StaticDecoder, StaticSteps

SPLITS = {2: [(0, 2), (2, 4)], 3: [(0, 2), (2, 3), (3, 4)]}  # the tiny models have 4 layers
PROMPTS = {0: [5, 17, 99, 3], 1: [64, 21], 2: [8, 120, 45, 77, 12], 3: [33], 4: [90, 6, 101], 5: [58, 27]}

# (slots leaving before the step, slots joining with their prompt before it, the step's (slot, rows)
# runs); after a step each run keeps 1 + (step + slot) % rows of its rows (a window's rejected
# proposals are rewound). Real rows 3 (bucket 4), 9 (16), 5 (8), 7 (8), 1 (1), 3 (4), 6 (8)
SCRIPT: list[tuple[tuple[int, ...], tuple[int, ...], list[tuple[int, int]]]] = [
    ((), (), [(0, 1), (1, 1), (2, 1)]),
    ((), (), [(0, 3), (1, 1), (2, 4), (3, 1)]),
    ((1,), (4,), [(4, 1), (0, 1), (2, 2), (3, 1)]),
    ((), (1,), [(1, 1), (3, 5), (4, 1)]),
    ((), (), [(2, 1)]),
    ((0,), (), [(1, 2), (4, 1)]),
    ((), (0, 5), [(5, 1), (0, 1), (3, 2), (2, 2)]),
]


def pipeline(path, static: bool | None, stages: int, slots: int = 6, context: int = 40, **load) -> list[Shard]:  # type: ignore[no-untyped-def]
    """The stages' backends as a fleet loads them (engine.backend.load_backend), caches allocated."""
    backends = []
    for start, end in SPLITS[stages]:
        backend = load_backend("torch", path, start, end, static_decode=static, **load)
        backend.allocate_cache(slots, context)
        assert isinstance(backend, Shard)
        backends.append(backend)
    return backends


def through(stages: Sequence[Shard], frame: Frame) -> list[torch.Tensor]:
    """Every stage's output: residual rows travel on in float32 with the rows' token ids, as on the wire."""
    outs = [stages[0].forward(frame)]
    for stage in stages[1:]:
        hidden = outs[-1].cpu()
        outs.append(stage.forward(Frame(frame.slots, frame.positions, frame.token_ids, hidden, frame.output_rows,
                                        frame.decode_only)))  # fmt: skip
    return outs


def ids(values: Sequence[int]) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64)


def prefill(slot: int) -> Frame:
    """A stream's prompt: a general frame (its last row sampled, the stream starts here)."""
    frame = Frame.of_streams([(slot, 0, PROMPTS[slot])])
    return Frame(frame.slots, frame.positions, frame.token_ids, output_rows=ids([frame.rows - 1]))


def run_script(pipelines: list[list[Shard]], tolerance: float) -> None:
    """Every pipeline takes the script's frames; every stage's outputs equal the first pipeline's.
    Slot lengths agree with the steps; at the end every stream leaves."""
    lengths: dict[int, int] = {}
    for step, (leaving, joining, runs) in enumerate([((), (0, 1, 2, 3), []), *SCRIPT]):
        for slot in leaving:
            for stages in pipelines:
                for stage in stages:
                    stage.release(slot)
            del lengths[slot]
        for slot in joining:
            for stages in pipelines:
                through(stages, prefill(slot))
            lengths[slot] = len(PROMPTS[slot])
        if not runs:
            continue
        slots = [slot for slot, rows in runs for _ in range(rows)]
        positions = [lengths[slot] + i for slot, rows in runs for i in range(rows)]
        tokens = [(7 * step + 3 * r + 1) % 100 for r in range(len(slots))]
        frame = Frame(ids(slots), ids(positions), ids(tokens), output_rows=ids(range(len(slots))), decode_only=True)
        outs = [through(stages, frame) for stages in pipelines]
        for other in outs[1:]:
            for ours, ref in zip(other, outs[0], strict=True):
                assert_close_to(ours.float().cpu(), ref.float().cpu(), tolerance)
        for slot, rows in runs:
            lengths[slot] += 1 + (step + slot) % rows
            for stages in pipelines:
                for stage in stages:
                    stage.rewind(slot, lengths[slot])
    for stages in pipelines:
        assert all(stage.slots is not None and [stage.slots.length(s) for s in lengths] == list(lengths.values())
                   for stage in stages)  # fmt: skip
        for slot in lengths:
            for stage in stages:
                stage.release(slot)


def steps_of(stage: Shard) -> StaticSteps:
    assert isinstance(stage.static_steps, StaticSteps)
    return stage.static_steps


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_stages_run_decode_frames_as_static_steps_with_the_general_paths_outputs(tiny_checkpoint, family, stages):
    path, _ = tiny_checkpoint(family)
    general, static = pipeline(path, False, stages), pipeline(path, True, stages)
    run_script([general, static], 1e-5)
    for stage in static:  # every stage ran its decode frames as static steps, at every bucket
        assert set(steps_of(stage).decoders) == {1, 4, 8, 16}
    assert all(not steps_of(stage).decoders for stage in general)


def test_frames_not_flagged_and_stages_keeping_hidden_rows_run_general_frames(tiny_checkpoint, monkeypatch):
    path, _ = tiny_checkpoint("qwen3_moe")
    static = pipeline(path, True, 2)
    steps = count_steps(monkeypatch)
    for slot in (0, 1):
        through(static, prefill(slot))
    decode = Frame(ids([0, 1]), ids([4, 2]), ids([7, 9]), output_rows=ids([0, 1]))
    through(static, decode)  # not flagged decode-only: a general frame
    assert not steps
    static[-1].keep_hidden = "normed"  # an MTP proposer reads the final hidden rows of general frames
    logits = through(static, Frame(ids([0, 1]), ids([5, 3]), ids([2, 4]), output_rows=ids([0, 1]), decode_only=True))
    assert len(steps) == 1 and static[-1].last_hidden is not None and static[-1].last_hidden.shape[0] == 2
    assert logits[-1].shape == (2, static[-1].spec.vocab_size)


def test_a_later_stage_refuses_hidden_rows_of_another_shape(tiny_checkpoint):
    path, _ = tiny_checkpoint("qwen3_moe")
    first, second = pipeline(path, True, 2)
    through([first, second], prefill(0))
    hidden = torch.zeros((1, second.spec.hidden_size + 1))
    frame = Frame(ids([0]), ids([4]), ids([7]), hidden, output_rows=ids([0]), decode_only=True)
    with pytest.raises(InputError, match=r"hidden rows of shape \[1, 64\]"):
        second.forward(frame)


def count_steps(monkeypatch) -> list[int]:  # type: ignore[no-untyped-def]
    """The row count of every static step from now on."""
    calls: list[int] = []
    step = StaticDecoder.step

    def counted(self, tokens, slots, positions, hidden=None):  # type: ignore[no-untyped-def]
        calls.append(len(tokens))
        return step(self, tokens, slots, positions, hidden)

    monkeypatch.setattr(StaticDecoder, "step", counted)
    return calls


def test_a_stage_agent_runs_frames_from_the_wire_as_static_steps_when_every_row_is_sampled(
    tiny_checkpoint, monkeypatch
):
    """The middle stage of three: a frame whose rows are all output rows and start no stream runs
    as a static step; one that starts a stream (its one-token prompt) or samples only some rows
    runs general. Its sent residual rows equal the general path's."""
    path, _ = tiny_checkpoint("qwen3_moe")
    plan = make_plan(path, 3, max_streams=4, context_length=40)
    agent = StageAgent(AgentConfig(plan, stage_index=1))
    first, ref = pipeline(path, False, 3, slots=4)[:2]
    try:
        stage = agent.stage
        assert (stage.layer_start, stage.layer_end) == (ref.layer_start, ref.layer_end)
        backend = load_backend("torch", path, stage.layer_start, stage.layer_end, static_decode=True)
        backend.allocate_cache(4, 40)
        agent.backend = backend
        sent: list[wire.Message] = []
        monkeypatch.setattr(agent, "send", sent.append)
        steps = count_steps(monkeypatch)
        params = SamplingParams(max_tokens=4)
        start = wire.StreamStart.of(2, params, prompt_tokens=1)
        opening = (wire.StreamStart.of(0, params), wire.StreamStart.of(1, params))
        frames = [  # (slots, positions, token ids, output rows, new streams), and whether it is static
            (([0, 0, 1], [0, 1, 0], [5, 17, 64], (1, 2), opening), False),  # two prompts
            (([0, 1], [2, 1], [99, 21], (0, 1), ()), True),
            (([1, 0, 0, 2], [2, 3, 4, 0], [7, 3, 8, 33], (0, 1, 2, 3), (start,)), False),  # slot 2 starts
            (([2, 1, 0], [1, 3, 5], [4, 5, 6], (0, 1, 2), ()), True),
            (([2, 1], [2, 4], [1, 2], (1,), ()), False),  # a row not sampled (a prompt's)
        ]
        for (slots, positions, tokens, rows, starts), static in frames:
            frame = Frame(ids(slots), ids(positions), ids(tokens), output_rows=ids(rows))
            hidden = first.forward(frame).cpu()
            msg = wire.FrameMsg(microbatch=0, step=len(sent), slots=frame.slots, positions=frame.positions,
                                token_ids=frame.token_ids, hidden=hidden, output_rows=rows, new_streams=starts)  # fmt: skip
            before = len(steps)
            agent.on_frame(msg, time.perf_counter())
            out = sent[-1]
            assert isinstance(out, wire.FrameMsg) and out.hidden is not None
            assert_close_to(out.hidden, ref.forward(Frame(frame.slots, frame.positions, frame.token_ids, hidden)), 1e-5)
            assert len(steps) - before == int(static)
    finally:
        agent.close()


class StagedModel(LocalModel):
    """generate_batch's model run as a fleet runs it: each step's frame (Step.frame, flagged
    decode-only by the scheduler) through the stages in turn."""

    decode_steps = 0

    def run_step(self, step: Step) -> torch.Tensor:
        self.decode_steps += step.decode_only
        return through(self.shards, step.frame())[-1]


REPETITIVE = [5, 9, 17, 33, 5, 9, 17, 33, 5, 9, 17, 33, 5, 9]


def speculative_generation_through_stages(path, monkeypatch, **load) -> list[Shard]:  # type: ignore[no-untyped-def]
    """Speculative greedy generation (ngram, width 4) through two static stages gives the tokens of
    plain generation in one process on general frames; verify windows ran as static steps."""
    prompts = [REPETITIVE, [3, 1, 4, 1, 5, 9, 2, 6], REPETITIVE[3:]]
    params = SamplingParams(max_tokens=24, stop_token_ids=())
    plain = LocalModel.load(path, max_slots=3, max_context=64, static_decode=False, **load)
    expected = [r.token_ids for r in generate_batch(plain, prompts, params)]
    stages = pipeline(path, True, 2, slots=3, context=64, **load)
    steps = count_steps(monkeypatch)
    speculator = Speculator(SpeculativeConfig("ngram", num_speculative_tokens=4, adaptive=False))
    model = StagedModel(stages, static_decode=False)
    results = generate_batch(model, prompts, params, speculator=speculator)
    assert [r.token_ids for r in results] == expected
    assert speculator.stats.drafted > 0 and speculator.stats.accepted > 0
    assert model.decode_steps > 10 and len(steps) == 2 * model.decode_steps  # every decode step, on both stages
    assert max(steps) > len(prompts)  # verify windows among them
    return stages


def test_speculative_generation_through_static_stages_gives_the_plain_tokens(tiny_checkpoint, monkeypatch):
    path, _ = tiny_checkpoint("qwen3_moe")
    speculative_generation_through_stages(path, monkeypatch)


@cuda_only
@pytest.mark.gpu
def test_speculative_generation_through_cuda_stages_replays_graphs(tiny_checkpoint, monkeypatch):
    path, _ = tiny_checkpoint("qwen3_moe")
    stages = speculative_generation_through_stages(path, monkeypatch, device="cuda")
    for stage in stages:
        assert sum(d.replays[True] for d in steps_of(stage).decoders.values()) > 0


@cuda_only
@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_cuda_stages_replay_graphs_with_the_logits_of_eager_frames(tiny_checkpoint, family):
    """Two stages on CUDA (static steps by default there): every decode frame of the script is a
    graph replay or capture, with the general path's outputs (float32)."""
    path, _ = tiny_checkpoint(family)
    eager = pipeline(path, False, 2, device="cuda")
    graphed = pipeline(path, None, 2, device="cuda")
    run_script([eager, graphed], 1e-3)
    run_script([eager, graphed], 1e-3)  # again: every bucket now replays
    for stage in graphed:
        decoders = steps_of(stage).decoders
        assert set(decoders) == {1, 4, 8, 16} and all(d.use_graph and d.graphs for d in decoders.values())
        assert sum(d.replays[False] + d.replays[True] for d in decoders.values()) >= len(SCRIPT)
    assert all(not steps_of(stage).decoders for stage in eager)
