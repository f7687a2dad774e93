"""The ``draft_model`` proposer: a small model of the same tokenizer runs ahead of the target.

Each stream gets a slot in the draft's own KV cache. To propose, the draft first catches up on
what the target committed (the stream's tokens beyond the longest prefix the draft holds: its
own proposals that were rejected are rewound, never kept), then decodes k tokens, all streams of
the step in one frame per token. For a greedy stream (or where the verifier cannot be given q)
the proposals are the draft's argmax, verified with a one-hot q (engine.speculative.verify),
exact at any temperature; for a sampled stream whose verifier receives them
(:meth:`DraftModelProposer.propose_sampled`), they are draws from the draft's own distribution q
(after the request's temperature, top-k, top-p and min-p, kept to its DRAFT_SUPPORT most likely
tokens, from a generator of the stream's own), and q goes with them (to a fleet's tail too): the verifier accepts with min(1, p / q) and corrects from the residual.

A draft with another tokenizer is bridged through text (seed 000): :class:`BridgedDraftProposer`
decodes the stream with the target's tokenizer and encodes the text with the draft's (the draft's
slot then catches up as usual, rewinding where the new text tokenized differently), and the
draft's proposed tokens go back the same way, its text encoded with the target's tokenizer.
Verification makes any proposal exact; the bridge only decides how often they survive. A draft
whose vocabulary differs and that (or whose target) has no ``tokenizer.json`` cannot be bridged
and is refused at load.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from pathlib import Path

import torch

from ..errors import InputError
from ..frame import Frame
from ..generate import LocalModel
from ..sampling import SamplingParams, filter_logits
from ..tokenizer import TextTokenizer
from .verify import cap_support


class DraftModelProposer:
    method = "draft_model"

    def __init__(self, model: LocalModel, target_vocab_size: int | None = None):
        self.model = model
        # q is the target's vocabulary's only when the draft's is the same size
        self.samples = target_vocab_size in (None, model.spec.vocab_size)
        self.slots: dict[Hashable, int] = {}
        self.held: dict[Hashable, list[int]] = {}  # the tokens each stream's draft slot holds, in order
        # the draft's own probability of each token it proposed in the latest call, by stream: the
        # width model's survival confidences for them (engine.speculative.adaptive)
        self.confidences: dict[Hashable, list[float]] = {}

    @classmethod
    def load(
        cls, path: str | Path, target: str | Path | None, max_streams: int, device: str = "cpu", dtype: str = "float32"
    ) -> DraftModelProposer | BridgedDraftProposer:
        """The draft at ``path`` with a slot for each of ``max_streams`` streams; a draft whose
        tokenizer is not ``target``'s is bridged through text (:class:`BridgedDraftProposer`)."""
        from ..spec import load_spec

        bridge = target is not None and needs_bridge(Path(path), Path(target))
        vocab = None if target is None else load_spec(target).vocab_size
        draft = cls(LocalModel.load(path, device=device, dtype=dtype, max_slots=max_streams), vocab)
        return BridgedDraftProposer(draft, TextTokenizer(target), TextTokenizer(path)) if target and bridge else draft

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """One stream alone (the speculator asks :meth:`propose_many` for a step's streams)."""
        return self.propose_many([(None, tokens)], k)[0]

    def propose_many(self, streams: Sequence[tuple[Hashable, Sequence[int]]], k: int) -> list[list[int]]:
        """Up to ``k`` greedy draft tokens for each (stream key, tokens so far)."""
        return self.propose_sampled(streams, k, [None] * len(streams))[0]

    @torch.inference_mode()
    def propose_sampled(
        self,
        streams: Sequence[tuple[Hashable, Sequence[int]]],
        k: int,
        sampling: Sequence[tuple[SamplingParams, torch.Generator] | None],
    ) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Up to ``k`` draft tokens for each (stream key, tokens so far): drawn from q with the
        stream's (parameters, generator) in ``sampling``, or the argmax where it is None (or the
        draft's vocabulary is not the target's); and each stream's q [k, V] (None: one-hot)."""
        if k < 1 or not streams:
            return [[] for _ in streams], [None for _ in streams]
        rows = [self._catch_up(key, list(tokens)) for key, tokens in streams]
        logits = self._run(rows)
        out: list[list[int]] = [[] for _ in streams]
        drawn = [s if self.samples and s is not None and not s[0].greedy else None for s in sampling]
        probs: list[list[torch.Tensor]] = [[] for _ in streams]
        self.confidences = {key: [] for key, _ in streams}
        for step in range(k):
            top = torch.softmax(logits.float(), dim=-1).max(dim=-1)
            picked, sure = top.indices.tolist(), top.values.tolist()
            for i, how in enumerate(drawn):
                if how is not None:
                    q = cap_support(filter_logits(logits[i].to("cpu", torch.float32), how[0]))
                    picked[i] = int(torch.multinomial(q, 1, generator=how[1]))
                    probs[i].append(q)
                    sure[i] = float(q[picked[i]])
                out[i].append(picked[i])
                self.confidences[streams[i][0]].append(sure[i])
            if step + 1 < k:
                logits = self._run([(key, [token]) for (key, _), token in zip(streams, picked, strict=True)])
        return out, [torch.stack(p) if p else None for p in probs]

    def forget(self, key: Hashable) -> None:
        """The stream ended: its draft slot is free."""
        slot = self.slots.pop(key, None)
        self.held.pop(key, None)
        if slot is not None:
            self.model.release(slot)

    def _catch_up(self, key: Hashable, tokens: list[int]) -> tuple[Hashable, list[int]]:
        """Rewind the stream's draft slot to the longest prefix it shares with ``tokens`` (less
        one, so a row remains to predict from) and return the rows it still needs."""
        if key not in self.slots:
            self.slots[key] = self.model.acquire()
            self.held[key] = []
        held = self.held[key]
        keep = 0
        limit = min(len(held), len(tokens) - 1)
        while keep < limit and held[keep] == tokens[keep]:
            keep += 1
        self.model.rewind(self.slots[key], keep)
        del held[keep:]
        return key, tokens[keep:]

    def _run(self, rows: list[tuple[Hashable, list[int]]]) -> torch.Tensor:
        """Feed each stream's rows at its held length; logits [streams, V] at each last row."""
        streams, last, count = [], [], 0
        for key, ids in rows:
            streams.append((self.slots[key], len(self.held[key]), ids))
            self.held[key] += ids
            count += len(ids)
            last.append(count - 1)
        frame = Frame.of_streams(streams)
        frame = Frame(frame.slots, frame.positions, token_ids=frame.token_ids,
                      output_rows=torch.tensor(last, dtype=torch.int64))  # fmt: skip
        return self.model.forward(frame)


class BridgedDraftProposer:
    """A draft model of another tokenizer, its input and its proposals carried through text."""

    method = "draft_model"

    def __init__(self, draft: DraftModelProposer, target: TextTokenizer, own: TextTokenizer):
        self.draft, self.target, self.own = draft, target, own

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        return self.propose_many([(None, tokens)], k)[0]

    def propose_many(self, streams: Sequence[tuple[Hashable, Sequence[int]]], k: int) -> list[list[int]]:
        """Up to ``k`` target tokens for each (stream key, target tokens so far): the draft's ``k``
        greedy tokens after the stream's text, as text, encoded with the target's tokenizer."""
        out: list[list[int]] = [[] for _ in streams]
        if k < 1:
            return out
        mapped = [(i, key, self.own.encode(self.target.decode(list(tokens), skip_special_tokens=False)))
                  for i, (key, tokens) in enumerate(streams)]  # fmt: skip
        ready = [(i, key, ids) for i, key, ids in mapped if ids]  # a stream with no text yet: nothing to continue
        proposed = self.draft.propose_many([(key, ids) for _, key, ids in ready], k) if ready else []
        for (i, _, _), ids in zip(ready, proposed, strict=True):
            out[i] = self.target.encode(self.own.decode(ids, skip_special_tokens=False))[:k]
        return out

    def forget(self, key: Hashable) -> None:
        self.draft.forget(key)


def needs_bridge(draft: Path, target: Path) -> bool:
    """Whether the draft's tokenizer differs from the target's (so proposals go through text);
    a draft whose vocabulary differs and that cannot be bridged is refused."""
    from ..spec import load_spec

    draft_vocab, target_vocab = load_spec(draft).vocab_size, load_spec(target).vocab_size
    tokenizers = [p / "tokenizer.json" for p in (draft, target)]
    if all(t.is_file() for t in tokenizers):
        return tokenizers[0].read_bytes() != tokenizers[1].read_bytes()
    if draft_vocab != target_vocab:
        missing = " and ".join(str(t) for t in tokenizers if not t.is_file())
        raise InputError(
            f"draft model {draft} has a vocabulary of {draft_vocab} tokens, the target {target_vocab}, and {missing} "
            "is missing: a draft with another vocabulary is bridged through text, which needs both tokenizer.json "
            "files; give the checkpoint its tokenizer.json or use a draft that shares the target's tokenizer"
        )
    return False
