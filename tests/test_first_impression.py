"""A first impression that matches the model: what `up`, the README and `chat` suggest to the
bundled Python-only model is code, and under those settings it writes indented Python."""

from __future__ import annotations

import re
from pathlib import Path

from modelfleet.commands.fleet import DEMO_MODEL, DEMO_PROMPT, starter_prompt
from modelfleet.engine.generate import LocalModel, generate
from modelfleet.engine.sampling import SamplingParams
from modelfleet.engine.tokenizer import TextTokenizer

ROOT = Path(__file__).resolve().parents[1]


def test_up_and_the_readme_suggest_code_to_the_demo_model_and_prose_to_others(tmp_path) -> None:
    assert starter_prompt(DEMO_MODEL) == starter_prompt(str(ROOT / "models" / "demo")) == DEMO_PROMPT
    assert starter_prompt(tmp_path) == "Hello, my name is"
    readme = (ROOT / "README.md").read_text()
    (prompt,) = re.findall(r'"prompt": "([^"]*)"', readme)
    assert prompt == DEMO_PROMPT


def test_the_demo_model_answers_the_suggested_prompt_with_an_indented_python_body() -> None:
    tokenizer = TextTokenizer(DEMO_MODEL)
    model = LocalModel.load(DEMO_MODEL, max_slots=1, max_context=128)
    result = generate(model, tokenizer.encode(DEMO_PROMPT), SamplingParams(max_tokens=32))
    lines = tokenizer.decode(result.token_ids).split("\n")
    assert lines[0] == "" and lines[1].startswith("    ") and not lines[1].startswith("     ")
    assert not [line for line in lines if line.strip() == "#"], "no lines of bare comment marks"
