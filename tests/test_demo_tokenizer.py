"""The bundled models tokenize the same in transformers' AutoTokenizer (what lm-eval, guidellm and
users' own scripts load) as in the server: a client that counts or scores tokens itself must see the
ids the fleet sees."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from modelfleet.engine.tokenizer import TextTokenizer

MODELS = Path(__file__).resolve().parents[1] / "models"
SAMPLE = (
    "def greet(name: str) -> str:\n"
    "    if not name:\n"
    "        raise ValueError('empty')\n"
    "\n"
    '\treturn f"héllo {name} ✓ 世界 🐍"  # tabs, unicode, emoji\n'
    "\n\n\nclass  A :  pass\r\n"
)


@pytest.mark.parametrize("model", ["demo", "demo/draft"])
def test_auto_tokenizer_and_the_server_tokenize_code_with_indentation_and_unicode_identically(model: str) -> None:
    server = TextTokenizer(MODELS / model)
    client = AutoTokenizer.from_pretrained(MODELS / model)
    ids = server.encode(SAMPLE)
    assert client(SAMPLE, add_special_tokens=False)["input_ids"] == ids
    assert client.decode(ids) == server.decode(ids) == SAMPLE


def test_the_demo_models_indentation_after_a_newline_is_one_token_on_both_sides() -> None:
    # the case that split on a client without tokenizer_class ("\n    " as two ids, one on the server)
    server = TextTokenizer(MODELS / "demo")
    client = AutoTokenizer.from_pretrained(MODELS / "demo")
    assert client("\n    ", add_special_tokens=False)["input_ids"] == server.encode("\n    ")
    assert len(server.encode("\n    ")) == 1
