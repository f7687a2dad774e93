"""Static decode steps (CUDA graphs on GPUs) for 1 to 256 rows: batches pad to captured buckets,
padded rows never change real rows, and every family's steps (DeepSeek's latent attention
included) give the logits of general frames. Speculative verify windows (1 + k rows of a stream)
run as static steps too, with rewinds between them, and speculative generation keeps the plain
greedy tokens while every verify step is static (a graph replay on GPUs). CPU runs the same
steps eagerly."""

from __future__ import annotations

import pytest
from gpu_cases import cuda_only
from tiny import assert_close_to

from modelfleet.engine.errors import InputError
from modelfleet.engine.formats.plan import FormatPlan
from modelfleet.engine.frame import Frame
from modelfleet.engine.generate import LocalModel, generate_batch
from modelfleet.engine.sampling import SamplingParams
from modelfleet.engine.speculative.config import SpeculativeConfig
from modelfleet.engine.speculative.speculator import Speculator
from modelfleet.engine.static_decode import (
    GRAPH_BUCKETS,
    StaticDecoder,
    bucket_pads,
    graph_bucket,
    rows_per_stream_limit,
)

FAMILIES = ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3"]
PROMPT = [5, 17, 99, 3, 64, 21, 8, 120, 45, 77, 12, 33, 90, 6, 101, 58, 27, 14, 71, 40]


def test_a_batch_pads_to_the_smallest_bucket_that_holds_it():
    assert [graph_bucket(b) for b in (1, 2, 3, 5, 8, 9, 33, 64, 65, 200, 256)] == [
        1, 2, 4, 8, 8, 16, 64, 64, 128, 256, 256
    ]  # fmt: skip
    assert GRAPH_BUCKETS[-1] == 256
    assert [bucket_pads(b) for b in GRAPH_BUCKETS] == [False, False] + [True] * 7  # 1 and 2 need no masks
    for bad in (0, 257):
        with pytest.raises(InputError, match="1 to 256"):
            graph_bucket(bad)


def seated(path, streams: int, static: bool, context: int = 24, **load) -> tuple[LocalModel, list[int]]:  # type: ignore[no-untyped-def]
    """A model with ``streams`` slots, each prefilled with a short prompt; -> the model, positions."""
    lm = LocalModel.load(path, max_slots=streams, max_context=context, static_decode=static, **load)
    prompts = [PROMPT[s % 7 : s % 7 + 1 + s % 3] for s in range(streams)]
    for _ in range(streams):
        lm.acquire()
    lm.forward(Frame.of_streams([(s, 0, p) for s, p in enumerate(prompts)]))
    return lm, [len(p) for p in prompts]


@pytest.mark.parametrize("family", FAMILIES)
def test_padded_static_steps_give_the_logits_of_general_frames(tiny_checkpoint, family):
    path, _ = tiny_checkpoint(family)
    static, positions = seated(path, 5, True)
    general, _ = seated(path, 5, False)
    assert static.static_decode
    for step, batch in enumerate((3, 5, 1, 5, 2, 3)):  # buckets 4, 8, 1, 8, 2, 4: padded but for 1 and 2
        tokens = [(7 * step + 3 * s) % 100 for s in range(batch)]
        slots = list(range(batch))[::-1] if step % 2 else list(range(batch))
        at = [positions[s] for s in slots]
        assert_close_to(static.decode(tokens, slots, at), general.decode(tokens, slots, at), 1e-5)
        for s in slots:
            positions[s] += 1
    assert static.shards[0].slots is not None and static.shards[0].slots.lengths[:5] == positions


# a padded step's rows (slot, offset past the slot's next position): bucket 4 with one padded row;
# bucket 8 with three padded rows, repeating slot 4's verify window
PADDED_STEPS = {"rows": [(4, 0), (0, 0), (2, 0)], "windows": [(4, 0), (4, 1), (4, 2), (0, 0), (2, 0)]}


@pytest.mark.parametrize("step", PADDED_STEPS)
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_a_padded_step_writes_only_the_real_rows_cache_entries(tiny_checkpoint, family, step):
    path, _ = tiny_checkpoint(family)
    lm, positions = seated(path, 5, True)
    kv = lm.shards[0].kv
    before = [{name: t.clone() for name, t in layer.tensors.items()} for layer in kv]
    slots = [slot for slot, _ in PADDED_STEPS[step]]
    at = [positions[slot] + offset for slot, offset in PADDED_STEPS[step]]
    lm.decode(list(range(1, len(slots) + 1)), slots, at)
    for layer, old in zip(kv, before, strict=True):
        for name, t in layer.tensors.items():
            changed = (t != old[name]).flatten(2).any(-1).nonzero().tolist()  # [slot, entry] pairs
            assert sorted(changed) == sorted([s, p % layer.capacity] for s, p in zip(slots, at, strict=True)), name


def test_a_static_decoder_refuses_batches_of_another_bucket(tiny_checkpoint):
    path, _ = tiny_checkpoint("qwen3_moe")
    lm, positions = seated(path, 5, True)
    decoder = StaticDecoder(lm.shards, 4)
    with pytest.raises(InputError, match="takes 3 to 4"):
        decoder.step([1, 2], [0, 1], positions[:2])


# steps of verify windows: (slot, rows) runs, real rows 8, 5 (bucket 8, three padded rows repeating
# a window's), 4, 5 and 3 (single rows only); after each, a run keeps (step + slot) % rows proposals
WINDOW_STEPS = [
    [(0, 3), (1, 1), (2, 4)],
    [(3, 2), (4, 1), (0, 2)],
    [(1, 4)],
    [(2, 1), (3, 1), (4, 3)],
    [(0, 1), (4, 1), (2, 1)],
]


def run_window_steps(  # type: ignore[no-untyped-def]
    models: list[LocalModel], positions: list[int], tolerance: float, steps=WINDOW_STEPS
) -> None:
    """Every model takes the same verify windows and rewinds; all give the first model's logits."""
    for step, runs in enumerate(steps):
        slots = [slot for slot, rows in runs for _ in range(rows)]
        at = [positions[slot] + i for slot, rows in runs for i in range(rows)]
        tokens = [(7 * step + 3 * r + 1) % 100 for r in range(len(slots))]
        logits = [lm.decode(tokens, slots, at).float().cpu() for lm in models]
        for other in logits[1:]:
            assert_close_to(other, logits[0], tolerance)
        for slot, rows in runs:  # the row's token and the kept proposals stay; the rest is rewound
            positions[slot] += 1 + (step + slot) % rows
            for lm in models:
                lm.rewind(slot, positions[slot])
    for lm in models:
        assert lm.shards[0].slots is not None and lm.shards[0].slots.lengths[: len(positions)] == positions


@pytest.mark.parametrize("family", FAMILIES)
def test_verify_windows_in_static_steps_give_the_logits_of_general_frames(tiny_checkpoint, family):
    path, _ = tiny_checkpoint(family)
    static, positions = seated(path, 5, True)
    general, _ = seated(path, 5, False)
    run_window_steps([general, static], positions, 1e-5)
    assert {4, 8} <= set(static._decoders)  # the windows ran as static steps


def test_a_window_longer_than_a_ring_keeps_runs_as_a_general_frame(tiny_checkpoint):
    """gpt_oss's sliding layers keep window (6) + 64 entries here: a static step takes at most
    65 rows of one stream, so one of 66 runs as a general frame; windows of 45 and 65 rows (the
    second wrapping the ring) run static. Every step gives the general frames' logits."""
    path, _ = tiny_checkpoint("gpt_oss")
    static, positions = seated(path, 2, True, context=192)
    general, _ = seated(path, 2, False, context=192)
    assert rows_per_stream_limit(static.shards) == 65
    for rows in (66, 45, 65):
        tokens, at = [(5 * i + rows) % 100 for i in range(rows)], list(range(positions[0], positions[0] + rows))
        assert_close_to(static.decode(tokens, [0] * rows, at), general.decode(tokens, [0] * rows, at), 1e-5)
        assert (graph_bucket(rows) in static._decoders) == (rows <= 65)
        positions[0] += rows
    with pytest.raises(InputError, match="at most 65 rows of one stream"):
        StaticDecoder(static.shards, 128).step([1] * 66, [1] * 66, list(range(positions[1], positions[1] + 66)))


def count_calls(monkeypatch, owner, name: str) -> list[tuple]:  # type: ignore[no-untyped-def]
    """The arguments of every call of ``owner.name`` from now on."""
    calls: list[tuple] = []
    method = getattr(owner, name)

    def counted(self, *args):  # type: ignore[no-untyped-def]
        calls.append(args)
        return method(self, *args)

    monkeypatch.setattr(owner, name, counted)
    return calls


REPETITIVE = [5, 9, 17, 33, 5, 9, 17, 33, 5, 9, 17, 33, 5, 9]


def speculative_generation_is_static(monkeypatch, path, **load) -> LocalModel:  # type: ignore[no-untyped-def]
    """Speculative greedy generation (ngram, fixed width 4) on static steps gives the plain
    tokens; only the prefill is a general frame, the verify windows are static steps."""
    prompts = [REPETITIVE, [3, 1, 4, 1, 5, 9, 2, 6], REPETITIVE[3:]]
    params = SamplingParams(max_tokens=24, stop_token_ids=())
    plain_model = LocalModel.load(path, max_slots=3, static_decode=True, **load)
    plain = [r.token_ids for r in generate_batch(plain_model, prompts, params)]
    lm = LocalModel.load(path, max_slots=3, static_decode=True, **load)
    frames = count_calls(monkeypatch, LocalModel, "forward")
    steps = count_calls(monkeypatch, StaticDecoder, "_run")
    speculator = Speculator(SpeculativeConfig("ngram", num_speculative_tokens=4, adaptive=False))
    assert [r.token_ids for r in generate_batch(lm, prompts, params, speculator=speculator)] == plain
    assert speculator.stats.drafted > 0 and speculator.stats.accepted > 0
    assert len(frames) == 1  # the prompts' prefill
    assert (True,) in steps  # steps with verify windows ran static
    return lm


def test_speculative_generation_verifies_in_static_steps(tiny_checkpoint, monkeypatch):
    path, _ = tiny_checkpoint("qwen3_moe")
    speculative_generation_is_static(monkeypatch, path, shards=2)


CUDA_CASES = [
    ("qwen3_moe", "float32", None),
    ("deepseek_v3", "float32", None),
    ("gpt_oss", "float32", None),
    ("gpt_oss", "bfloat16", FormatPlan(experts="mxfp4", attention="int8")),
    ("qwen3_moe", "bfloat16", FormatPlan(experts="int4", attention="int8", head="int8")),
    ("mixtral", "bfloat16", FormatPlan(experts="int8")),
    ("deepseek_v3", "bfloat16", None),
]


@cuda_only
@pytest.mark.gpu
@pytest.mark.parametrize(
    ("family", "dtype", "plan"), CUDA_CASES, ids=[f"{c[0]}-{c[1]}-{c[2] is not None}" for c in CUDA_CASES]
)
def test_graph_replays_give_the_logits_of_eager_frames_at_every_bucket(tiny_checkpoint, family, dtype, plan):
    """Graph replays equal the same static steps run eagerly, at every bucket; in float32 both equal
    general frames too. In bf16 the fused decode attention (float32 inside) and the general path's
    bf16 attention differ by rounding, which on these tiny random models flips near-tied expert
    choices (computing the general path's attention in float32 alone moves gpt_oss's logits by up
    to 33%), so bf16 steps are held to the eager static steps; the kernel itself is checked against
    the torch path layer by layer (test_decode_step_kernels)."""
    path, _ = tiny_checkpoint(family)
    load = dict(device="cuda", dtype=dtype, formats=plan)
    graphed, positions = seated(path, 256, True, **load)
    eager, _ = seated(path, 256, True, **load)
    eager._steps.use_graph = False  # the same static steps, run eagerly
    general, _ = seated(path, 256, False, **load)
    tolerance = 1e-3 if dtype == "float32" else 3e-2
    for step, batch in enumerate((1, 2, 3, 8, 9, 16, 31, 64, 65, 128, 200, 256, 256)):
        slots = [(17 * step + 5 * i) % 256 for i in range(batch)] if batch < 256 else list(range(256))
        slots = list(dict.fromkeys(slots))
        tokens = [(7 * step + 3 * s) % 100 for s in slots]
        at = [positions[s] for s in slots]
        ours, ref, frames = (
            graphed.decode(tokens, slots, at),
            eager.decode(tokens, slots, at),
            general.decode(tokens, slots, at),
        )
        assert_close_to(ours.float().cpu(), ref.float().cpu(), tolerance)
        if dtype == "float32":
            assert_close_to(ours.float().cpu(), frames.float().cpu(), tolerance)
        for s in slots:
            positions[s] += 1
    assert {graph_bucket(b) for b in (1, 2, 8, 16, 64, 128, 256)} <= set(graphed._decoders)
    assert all(d.graph is not None for d in graphed._decoders.values())
    assert all(d.graph is None for d in eager._decoders.values())


# verify windows over 64 streams: 190 rows (bucket 256), 39 (64), 16 (16), then the small steps
WIDE_WINDOW_STEPS = [
    [(s, 1 + s % 5) for s in range(64)],
    [(s, 3) for s in range(0, 39, 3)],
    [(s, 2) for s in range(8)],
    *WINDOW_STEPS,
]


@cuda_only
@pytest.mark.gpu
@pytest.mark.parametrize(
    ("family", "dtype", "plan"), CUDA_CASES, ids=[f"{c[0]}-{c[1]}-{c[2] is not None}" for c in CUDA_CASES]
)
def test_graph_replays_of_verify_windows_give_the_logits_of_eager_frames(tiny_checkpoint, family, dtype, plan):
    """Steps with verify windows (and rewinds between them) replayed from graphs equal the same
    static steps run eagerly at buckets 4 to 256; in float32 both equal general frames too (bf16:
    see the test above)."""
    path, _ = tiny_checkpoint(family)
    load = dict(device="cuda", dtype=dtype, formats=plan)
    graphed, positions = seated(path, 64, True, context=40, **load)
    eager, _ = seated(path, 64, True, context=40, **load)
    eager._steps.use_graph = False  # the same static steps, run eagerly
    models = [eager, graphed]
    if dtype == "float32":
        models.append(seated(path, 64, False, context=40, **load)[0])
    run_window_steps(models, positions, 1e-3 if dtype == "float32" else 3e-2, WIDE_WINDOW_STEPS)
    run_window_steps(models, positions, 1e-3 if dtype == "float32" else 3e-2, WIDE_WINDOW_STEPS[:1])  # replayed
    assert {4, 8, 16, 64, 256} <= set(graphed._decoders)
    assert graphed._decoders[256].replays[True] == 1 and all(True in d.graphs for d in graphed._decoders.values())
    assert all(not d.graphs for d in eager._decoders.values())


@cuda_only
@pytest.mark.gpu
def test_speculative_generation_replays_graphs_for_its_verify_steps(tiny_checkpoint, monkeypatch):
    path, _ = tiny_checkpoint("qwen3_moe")
    lm = speculative_generation_is_static(monkeypatch, path, device="cuda", dtype="float32")
    assert sum(d.replays[True] for d in lm._decoders.values()) > 0
