"""Text <-> token ids for checkpoints that ship ``tokenizer.json``, and incremental decoding.

Incremental decoding re-decodes the generated ids and emits only the new suffix, holding back
text while it ends in an incomplete UTF-8 sequence (shown as U+FFFD), so a multi-byte
character is never split and the concatenated pieces equal the full decode.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import CheckpointError


class TextTokenizer:
    def __init__(self, model_dir: str | Path):
        from tokenizers import Tokenizer

        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{path} is missing: this checkpoint has no tokenizer; use --prompt-ids")
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # the tokenizers library raises plain Exception subclasses
            raise CheckpointError(f"{path}: cannot be read as a tokenizer ({exc})") from exc
        config_path = Path(model_dir) / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(config_path.read_text()) if config_path.is_file() else {}

    @staticmethod
    def exists(model_dir: str | Path) -> bool:
        return (Path(model_dir) / "tokenizer.json").is_file()

    def encode(self, text: str) -> list[int]:
        # encode_batch, unlike encode, lets go of the GIL while it runs (a 3 MiB prompt takes seconds)
        return list(self._tok.encode_batch([text], add_special_tokens=False)[0].ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=skip_special_tokens))

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


class IncrementalDecoder:
    def __init__(self, tokenizer: TextTokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, token_id: int) -> str:
        """Add one token; return the newly complete text (possibly empty)."""
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        piece = text[len(self.emitted) :] if text.startswith(self.emitted) else text
        self.emitted = text
        return piece

    def flush(self) -> str:
        text = self.tokenizer.decode(self.ids)
        piece = text[len(self.emitted) :] if text.startswith(self.emitted) else ""
        self.emitted = text
        return piece
