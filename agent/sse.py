"""Server-sent events of OpenAI's streamed chunks, as bytes.

A stream's token chunks differ only in their text and token ids, so :class:`TokenChunks` cuts
the ``json.dumps`` of one such chunk (built with marker values) into constant pieces once per
stream, and a token costs one JSON string escape and a join instead of a dict and a whole
``json.dumps``.

Invariant: ``TokenChunks.of(chunk).frame(text, ids)`` is byte for byte ``data_frame`` of the same
chunk with ``text`` and ``ids`` put in place of the markers (the same key order, separators and
escapes: ``json.dumps(..., ensure_ascii=False)`` escapes a string with
``json.encoder.encode_basestring``, which is what the template splices in).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from json.encoder import encode_basestring  # type: ignore[attr-defined]
from typing import Any

DONE = b"data: [DONE]\n\n"
# Markers no generated text or id list can produce: a string with a NUL that json.dumps escapes to
# "\u0000...", so its escaped form appears in the dump exactly where the value goes.
TEXT_MARK = "\x00modelfleet-text"
IDS_MARK = "\x00modelfleet-token-ids"


def data_frame(payload: dict[str, Any]) -> bytes:
    """One event: ``data: <compact JSON, UTF-8 unescaped>`` and a blank line."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()


@dataclass(frozen=True)
class TokenChunks:
    """One stream's token chunks: the event's bytes before the text, between the text and the
    token ids (when the chunk carries them), and after."""

    before_text: str
    after_text: str
    after_ids: str | None  # None: the chunk has no token_ids

    @classmethod
    def of(cls, chunk: dict[str, Any]) -> TokenChunks:
        """From a chunk whose text is TEXT_MARK and whose token_ids, if any, are IDS_MARK."""
        dumped = data_frame(chunk).decode()
        before_text, after_text = _split_once(dumped, encode_basestring(TEXT_MARK))
        if encode_basestring(IDS_MARK) not in after_text:
            return cls(before_text, after_text, None)
        between, after_ids = _split_once(after_text, encode_basestring(IDS_MARK))
        return cls(before_text, between, after_ids)

    def frame(self, text: str, token_ids: Sequence[int]) -> bytes:
        escaped = encode_basestring(text)
        if self.after_ids is None:
            return f"{self.before_text}{escaped}{self.after_text}".encode()
        ids = ",".join(map(str, token_ids))
        return f"{self.before_text}{escaped}{self.after_text}[{ids}]{self.after_ids}".encode()


def _split_once(text: str, marker: str) -> tuple[str, str]:
    before, found, after = text.partition(marker)
    if not found or marker in after:
        raise ValueError(f"the chunk template must hold {marker} exactly once: {text!r}")
    return before, after
