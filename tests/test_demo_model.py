"""The bundled demo model through the public loader: it writes Python it has not seen, and its
draft model agrees with it often enough to be worth proposing tokens."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
import torch

from modelfleet.engine.frame import Frame
from modelfleet.engine.generate import LocalModel, generate
from modelfleet.engine.sampling import SamplingParams
from modelfleet.engine.tokenizer import TextTokenizer

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo"
WINDOW = 512


def held_out_windows(tokenizer: TextTokenizer, files: int = 6) -> list[list[int]]:
    """The first WINDOW + 1 tokens of held-out standard-library files present on this machine."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    windows = []
    for relative in (DEMO / "heldout_files.txt").read_text().split():
        path = stdlib / relative
        if path.is_file():
            ids = tokenizer.encode(path.read_text(encoding="utf-8", errors="replace"))
            if len(ids) > WINDOW:
                windows.append(ids[: WINDOW + 1])
        if len(windows) == files:
            break
    assert len(windows) == files, "the held-out files must exist in this Python's standard library"
    return windows


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    return TextTokenizer(DEMO)


def next_token_predictions(model_dir: Path, windows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    lm = LocalModel.load(model_dir, max_slots=1, max_context=WINDOW + 8)
    predicted, targets = [], []
    for ids in windows:
        logits = lm.forward(Frame.of_streams([(0, 0, ids[:WINDOW])]))
        lm.release(0)
        predicted.append(logits.argmax(-1))
        targets.append(torch.tensor(ids[1:]))
    return torch.cat(predicted), torch.cat(targets)


def test_the_demo_model_predicts_over_40_percent_of_next_tokens_in_unseen_python_files(tokenizer) -> None:
    predicted, targets = next_token_predictions(DEMO, held_out_windows(tokenizer))
    accuracy = (predicted == targets).float().mean().item()
    print(f"demo model greedy next-token accuracy on held-out files: {accuracy:.1%}")
    assert accuracy >= 0.40


def test_the_draft_model_agrees_with_the_main_model_on_the_next_token_often(tokenizer) -> None:
    windows = held_out_windows(tokenizer, files=3)
    main, _ = next_token_predictions(DEMO, windows)
    draft, targets = next_token_predictions(DEMO / "draft", windows)
    agreement = (main == draft).float().mean().item()
    print(f"draft/main next-token agreement: {agreement:.1%}; draft accuracy {(draft == targets).float().mean():.1%}")
    assert agreement >= 0.35


def test_the_demo_model_generates_text_through_its_tokenizer(tokenizer) -> None:
    lm = LocalModel.load(DEMO, max_slots=1, max_context=256)
    result = generate(lm, tokenizer.encode("def read_lines(path):\n    "), SamplingParams(max_tokens=24))
    text = tokenizer.decode(result.token_ids)
    assert result.token_ids and text.strip()
    assert tokenizer.config.get("chat_template") and tokenizer.token_id("<|endoftext|>") in lm.spec.eos_token_ids


def test_the_bundled_quantized_model_cut_into_shards_gives_the_logits_of_the_whole() -> None:
    # the head is tied to the embeddings: a last shard without them must still find its head
    ids = list(range(10, 60))
    whole = LocalModel.load(DEMO).forward(Frame.of_streams([(0, 0, ids)]))
    for shards in (2, 3):
        assert torch.equal(LocalModel.load(DEMO, shards=shards).forward(Frame.of_streams([(0, 0, ids)])), whole)
    assert LocalModel.load(DEMO).bytes_by_role["experts"].keys() == {"int4"}


def test_planning_the_bundled_quantized_model_counts_its_packed_bytes() -> None:
    from modelfleet.planner import layer_bytes

    sizes = layer_bytes(DEMO, "float32")
    stored = sum(p.stat().st_size for p in DEMO.glob("*.safetensors"))
    assert all(n > 0 for n in sizes.per_layer) and sizes.embed_bytes > 0 and sizes.tied
    total = sum(sizes.per_layer) + sizes.embed_bytes + sizes.norm_bytes
    assert 0.95 * stored < total <= stored  # the packed bytes as stored, not re-counted at float32
