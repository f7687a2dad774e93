"""Inkling against transformers on tiny random checkpoints (tests/inkling_tiny.py): attention
without RoPE over normed q/k with the hidden-state-conditioned relative bias, sliding layers with
their own shapes, log scaling on full layers, four float32 convolutions per layer with
per-stream histories, sink routing with shared experts, dense first layers, the normed embedding,
the muP multiplier and the unpadded vocabulary; through shards, mixed frames, rewind and slots."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from inkling_tiny import save_multimodal_model, save_text_model
from tiny import assert_close_to

from modelfleet.engine.checkpoint import Checkpoint
from modelfleet.engine.frame import Frame
from modelfleet.engine.generate import LocalModel
from modelfleet.engine.shard import Shard

PROMPT = [5, 17, 99, 3, 64, 21, 8, 120, 45, 77, 12, 33, 90, 6, 101, 58, 27, 14, 71, 40, 9, 88, 52, 30]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("inkling")
    return path, save_text_model(path)


class RecordingCheckpoint(Checkpoint):
    """A checkpoint that lists every tensor name read."""

    def __init__(self, model_dir: Path, read: list[str]):
        super().__init__(model_dir)
        self.read_names = read

    def read(self, name: str) -> torch.Tensor:
        self.read_names.append(name)
        return super().read(name)


def reference_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def test_logits_at_every_prompt_position_match_transformers(tiny) -> None:
    path, model = tiny
    ours = Shard.load(path)(Frame.of_streams([(0, 0, PROMPT)]))
    ref = reference_logits(model, PROMPT)
    assert ours.shape == ref.shape == (len(PROMPT), 120)
    assert_close_to(ours, ref)


def decode_greedy(shard: Shard, prompt: list[int], steps: int, slot: int = 0) -> tuple[list[int], torch.Tensor]:
    """Prefill then decode row by row: the greedy tokens and the logits of every step."""
    logits = [shard(Frame.of_streams([(slot, 0, prompt)]))[-1]]
    tokens = [int(logits[-1].argmax())]
    for position in range(len(prompt), len(prompt) + steps - 1):
        logits.append(shard(Frame.of_streams([(slot, position, tokens[-1:])]))[0])
        tokens.append(int(logits[-1].argmax()))
    return tokens, torch.stack(logits)


def test_greedy_continuation_of_32_tokens_is_identical_to_transformers_generate(tiny) -> None:
    path, model = tiny
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        ref = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, min_new_tokens=32, do_sample=False
        )
    ours, logits = decode_greedy(Shard.load(path), PROMPT, 32)
    assert ours == ref[0, len(PROMPT) :].tolist()
    assert len(set(ours)) > 2
    assert_close_to(logits, reference_logits(model, PROMPT + ours[:-1])[len(PROMPT) - 1 :])


@pytest.mark.parametrize("shards", [1, 2, 3])
def test_a_model_cut_into_shards_gives_the_logits_of_the_whole(tiny, shards: int) -> None:
    path, model = tiny
    local = LocalModel.load(path, shards=shards)
    assert len(local.shards) == shards
    assert_close_to(local.forward(Frame.of_streams([(0, 0, PROMPT)])), reference_logits(model, PROMPT))


def test_multimodal_checkpoint_serves_its_text_decoder_without_reading_the_towers(tmp_path: Path) -> None:
    model = save_multimodal_model(tmp_path)
    read: list[str] = []
    shard = Shard.load(tmp_path, checkpoint=RecordingCheckpoint(tmp_path, read))
    ours = shard(Frame.of_streams([(0, 0, PROMPT)]))
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([PROMPT])).logits[0]
    assert_close_to(ours, ref)
    assert read and all(name.startswith("model.llm.") for name in read)  # no tower, no MTP
