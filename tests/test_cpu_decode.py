"""CPU decode frames: the decode rows of several streams attend as one batch (engine/layers.py
``attend_decode_rows``) and give each stream the logits of attending alone, in pure decode frames
and beside a prefill window, for full attention, sliding windows and sinks (GPT-OSS)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny import save_model

from modelfleet.engine import layers
from modelfleet.engine.frame import Frame
from modelfleet.engine.shard import Shard

PROMPTS = [[5, 17, 3], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11], [42], [64, 21, 8, 120, 45, 77]]


def prefilled(path: Path) -> Shard:
    shard = Shard.load(path)
    shard.allocate_cache(max_slots=len(PROMPTS) + 1, max_context=64)
    shard(Frame.of_streams([(slot, 0, ids) for slot, ids in enumerate(PROMPTS)]))
    return shard


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_decode_rows_of_several_streams_attended_together_equal_each_stream_alone(
    tmp_path: Path, family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []
    batched_attention = layers.attend_decode_rows
    monkeypatch.setattr(layers, "attend_decode_rows", lambda *a: calls.append(1) or batched_attention(*a))
    save_model(family, tmp_path)
    together, alone = prefilled(tmp_path), prefilled(tmp_path)
    for step in range(3):  # each step's rows join the caches the next step attends over
        rows = [(slot, len(ids) + step, [(7 * slot + step) % 100]) for slot, ids in enumerate(PROMPTS)]
        batched = together(Frame.of_streams(rows))
        single = torch.cat([alone(Frame.of_streams([row])) for row in rows])
        assert torch.allclose(batched, single, atol=1e-5), (batched - single).abs().max()
    assert calls  # the batched path ran (GPT-OSS: its full-attention layers; windowed ones keep a ring)


def test_a_frame_of_decode_rows_and_a_prefill_window_gives_each_its_own_logits(tmp_path: Path) -> None:
    save_model("qwen3_moe", tmp_path)
    together, alone = prefilled(tmp_path), prefilled(tmp_path)
    window = (len(PROMPTS), 0, [3, 1, 4, 1, 5])  # a new stream's prefill between decode rows
    rows = [(0, len(PROMPTS[0]), [12]), window, (1, len(PROMPTS[1]), [13]), (3, len(PROMPTS[3]), [14])]
    batched = together(Frame.of_streams(rows))
    single = torch.cat([alone(Frame.of_streams([row])) for row in rows])
    assert torch.allclose(batched, single, atol=1e-5)
