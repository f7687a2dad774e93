"""The stage backend protocol: output rows, per-slot refusals, slot state moved between backends,
and loading by the backend name a fleet plan gives."""

from __future__ import annotations

import pytest
import torch
from tiny import assert_close_to, reference_logits

from modelfleet.engine.backend import StageBackend, load_backend
from modelfleet.engine.errors import CapacityError, ErrorCode, InputError
from modelfleet.engine.frame import Frame
from modelfleet.engine.generate import LocalModel, generate
from modelfleet.engine.sampling import SamplingParams
from modelfleet.engine.shard import Shard

PROMPT = [5, 17, 99, 3, 64, 21, 8, 120, 45, 77, 12, 33]


def test_the_last_shard_computes_logits_only_for_the_output_rows(tiny_checkpoint) -> None:
    path, model = tiny_checkpoint("qwen3_moe")
    full = reference_logits(model, PROMPT)
    frame = Frame.of_streams([(0, 0, PROMPT)])
    frame.output_rows = torch.tensor([3, 11])
    logits = Shard.load(path)(frame)
    assert logits.shape == (2, full.shape[-1])
    assert_close_to(logits, full[[3, 11]])


def test_a_middle_shard_passes_every_row_on_whatever_the_output_rows(tiny_checkpoint) -> None:
    path, _ = tiny_checkpoint("qwen3_moe")
    frame = Frame.of_streams([(0, 0, PROMPT)])
    frame.output_rows = torch.tensor([11])
    assert Shard.load(path, 0, 2)(frame).shape[0] == len(PROMPT)


def test_refusals_name_only_the_slots_that_cannot_run(tiny_checkpoint) -> None:
    path, _ = tiny_checkpoint("qwen3_moe")
    shard = Shard.load(path)
    shard.allocate_cache(max_slots=3, max_context=16)
    shard(Frame.of_streams([(0, 0, PROMPT[:4])]))
    frame = Frame.of_streams([(0, 4, [1]), (1, 2, [1]), (2, 0, [1] * 17)])
    refused = shard.refusals(frame)
    assert sorted(refused) == [1, 2]  # slot 1 skips positions, slot 2 overflows the context
    assert all(isinstance(e, CapacityError) and e.code == ErrorCode.CAPACITY for e in refused.values())
    kept = frame.keep_rows([r for r, s in enumerate(frame.slots.tolist()) if s not in refused])
    assert kept.slots.tolist() == [0] and shard(kept).shape[0] == 1


def test_a_streams_state_exported_from_one_model_continues_in_another(tiny_checkpoint) -> None:
    path, _ = tiny_checkpoint("qwen3_moe")
    params = SamplingParams(max_tokens=6, stop_token_ids=())
    expected = generate(LocalModel.load(path, shards=2, max_context=64), PROMPT, params).token_ids
    source = LocalModel.load(path, shards=2, max_context=64)
    logits = source.forward(Frame.of_streams([(1, 0, PROMPT)]))
    state = source.export_slot(1)
    target = LocalModel.load(path, shards=2, max_context=64)
    target.import_slot(4, state)
    assert target.shards[1].slots is not None and target.shards[1].slots.length(4) == len(PROMPT)
    tokens, position = [], len(PROMPT)
    for _ in range(6):
        token = int(logits[-1].argmax())
        tokens.append(token)
        logits = target.forward(Frame.of_streams([(4, position, [token])]))
        position += 1
    assert tokens == expected


def test_a_slot_state_of_other_cache_sizes_is_refused(tiny_checkpoint) -> None:
    path, _ = tiny_checkpoint("qwen3_moe")
    small = Shard.load(path)
    small.allocate_cache(max_slots=2, max_context=16)
    large = Shard.load(path)
    large.allocate_cache(max_slots=2, max_context=32)
    with pytest.raises(CapacityError, match="this shard stores"):
        large.import_slot(0, small.export_slot(0))


def test_the_torch_backend_loads_by_name_and_conforms_to_the_protocol(tiny_checkpoint) -> None:
    path, _ = tiny_checkpoint("mixtral")
    backend = load_backend("torch", path, 1, 3)
    assert isinstance(backend, StageBackend) and (backend.layer_start, backend.layer_end) == (1, 3)
    assert isinstance(LocalModel.load(path), StageBackend)


@pytest.mark.parametrize(
    ("name", "device", "says"),
    [("openvino", "NPU", "device 'NPU': the OpenVINO backend's fused MoE blocks have no NPU lowering"),
     ("tpu", "cpu", "backend 'tpu' is unknown")],
)  # fmt: skip
def test_a_backend_that_cannot_run_on_the_device_is_refused_by_name(
    tiny_checkpoint, name: str, device: str, says: str
) -> None:
    path, _ = tiny_checkpoint("mixtral")
    with pytest.raises(InputError, match=says):
        load_backend(name, path, 0, 2, device=device)
