"""Token ids -> streamed text, with stop strings found across token boundaries.

Invariants:
- the pieces a :class:`TextStream` emits, concatenated, equal the full decode of the ids it was
  given (cut just before the first stop string, when one matches); a multi-byte character is
  never split, because :class:`WindowDecoder` holds back an incomplete UTF-8 sequence. One
  exception: when byte tokens are not valid UTF-8, a byte-fallback decoder replaces every byte of
  the run, so a stray byte after a complete character turns that character into U+FFFD in the
  full decode; the stream has sent the character already and keeps it (the stray byte still
  becomes U+FFFD);
- a token costs the decode of a short window of ids, not of the whole generation so far (a
  long stream would otherwise cost the gateway time quadratic in its length);
- text that could still become the start of a stop string is held back until it cannot, so a
  stop string (which may span several tokens) never reaches the client, not even in part.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..engine.tokenizer import TextTokenizer


class WindowDecoder:
    """Token ids -> the text each adds, decoding only a window: the new text is the difference of
    two decodes that start at the same id (``prefix_offset``), one ending where the emitted text
    ends (``read_offset``), one at the newest id. Starting both at the same id cancels what a
    tokenizer does to a sequence's first token (a leading space stripped, say), and both offsets
    only ever sit where the text was complete, so a window never starts inside a character."""

    def __init__(self, tokenizer: TextTokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = self.read_offset = 0

    def push(self, token_id: int) -> str:
        """Add one token; return the newly complete text (empty while it ends mid-character)."""
        self.ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """What is left, complete or not."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        text = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if len(text) <= len(prefix) or (text.endswith("\ufffd") and not final):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(prefix) :]


class StopMatcher:
    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""  # text not yet emitted: the tail that may start a stop string

    def push(self, text: str) -> tuple[str, bool]:
        """Add decoded text; return (text safe to emit, whether a stop string matched)."""
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            cut = min(hits)
            emit, self.pending = self.pending[:cut], ""
            return emit, True
        keep = self._held_back()
        emit = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep :]
        return emit, False

    def _held_back(self) -> int:
        """Length of the longest suffix of pending that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self.pending)), longest, -1):
                if self.pending.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def flush(self) -> str:
        emit, self.pending = self.pending, ""
        return emit


@dataclass
class Piece:
    text: str
    token_ids: list[int]
    stopped: bool = False


class TextStream:
    """One request's generated ids as text pieces; ``stopped`` once a stop string matched."""

    def __init__(self, tokenizer: TextTokenizer | None, stops: Sequence[str]):
        self.decoder = WindowDecoder(tokenizer) if tokenizer is not None else None
        self.matcher = StopMatcher(stops)
        self.token_ids: list[int] = []
        self.stopped = False

    def push(self, token_ids: Sequence[int]) -> Piece:
        """Tokens as they arrive; after a stop string matched, further tokens are ignored."""
        if self.stopped:
            return Piece("", [])
        text: list[str] = []
        taken: list[int] = []
        for token in token_ids:
            taken.append(token)
            self.token_ids.append(token)
            emit, self.stopped = self.matcher.push(self.decoder.push(token) if self.decoder else "")
            text.append(emit)
            if self.stopped:
                break
        return Piece("".join(text), taken, self.stopped)

    def finish(self) -> str:
        """The held-back tail once generation ended (stops are checked on it one last time)."""
        if self.stopped or self.decoder is None:
            return ""
        emit, self.stopped = self.matcher.push(self.decoder.flush())
        return emit if self.stopped else emit + self.matcher.flush()
