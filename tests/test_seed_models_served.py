"""The seeds' own architectures served as a user serves a model: ``modelfleet up`` over two stages,
the gateway in front, the official openai client asking for a completion. Tiny random Inkling and
DeepSeek-V4 checkpoints built offline get the demo model's tokenizer (their vocabulary is sized to
it), so the gateway tokenizes and detokenizes as it would for a real checkpoint."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import openai
import pytest
from test_quickstart import ROOT, free_port, start_up

DEMO = ROOT / "models" / "demo"


def checkpoint(family: str, path: Path) -> Path:
    if family == "inkling":
        from inkling_tiny import save_text_model

        save_text_model(path, vocab_size=4096)
    else:
        from dsv4_tiny import save

        save(path, vocab_size=4096)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO / name, path / name)
    return path


@pytest.mark.parametrize("family", ["inkling", "deepseek_v4"])
def test_up_serves_a_seed_architecture_to_the_openai_client(family: str, tmp_path: Path) -> None:
    model = checkpoint(family, tmp_path / family)
    port = free_port()
    command = [str(ROOT / ".venv" / "bin" / "modelfleet"), "up", "--model", str(model), "--stages", "2",
               "--context-length", "256", "--max-streams", "4"]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200", "OMP_NUM_THREADS": "1"}
    up, lines = start_up(command, port, env)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        completion = client.completions.create(model=family, prompt="def add(a, b):\n    ", max_tokens=8)
        assert completion.usage is not None and completion.usage.completion_tokens >= 1
        assert completion.choices[0].finish_reason in ("length", "stop")
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(60)
    assert up.returncode == 0, "".join(lines[-20:])
