"""Per-stream sampling: greedy, temperature, top-k, top-p, min-p, seeded generators, stops;
penalties, logit bias and min_tokens applied to the logits first, then a grammar's mask
(:mod:`.structured`); log-probabilities of the distribution actually sampled from.

Log-probabilities are vLLM's "processed" ones: the log of the distribution the token was drawn
from, after penalties, bias, temperature, top-k, top-p and min-p (a token those filters removed
has ``LOGPROB_FLOOR``); a greedy stream (temperature 0) reports the log-softmax of its processed
logits, since its one-hot draw would say nothing. Only the sampled token's and the top
``logprobs`` alternatives leave the tail, never a vocabulary-sized row."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import InputError, ModelfleetError
from .structured import MAX_SPEC_CHARS, Grammars, GrammarState, StructuredOutputError

# Temperatures below this sample as it does: float32 holds it (a smaller one would be 0 there),
# and it already leaves only the largest logits (those within ~1e-30 of the top) any mass.
MIN_TEMPERATURE = 1e-30
MAX_LOGPROBS = 20  # alternatives per token: OpenAI's top_logprobs limit (vLLM's default max_logprobs)
MAX_LOGIT_BIAS = 300  # entries, OpenAI's limit
LOGPROB_FLOOR = -9999.0  # a token of zero probability: JSON has no -inf (vLLM's value)


@dataclass(frozen=True)
class TokenLogprobs:
    """One emitted token's log-probability and the ``top`` most likely alternatives', most likely first."""

    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no limit
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] | None = None  # None: the model's EOS tokens
    logprobs: int | None = None  # report the sampled token's log-probability and this many alternatives'
    prompt_logprobs: int | None = None  # report each prompt token's (after the first), with this many alternatives
    frequency_penalty: float = 0.0  # subtracted per earlier occurrence in the output
    presence_penalty: float = 0.0  # subtracted once if the token occurred in the output
    repetition_penalty: float = 1.0  # divides (positive) or multiplies (negative) logits of prompt and output tokens
    min_tokens: int = 0  # stop tokens cannot be sampled before this many tokens
    logit_bias_ids: tuple[int, ...] = ()  # added to these tokens' logits ...
    logit_bias_values: tuple[float, ...] = ()  # ... these values, in [-100, 100]
    grammar: str | None = None  # a structured-output spec (JSON text, see .structured): tokens outside it are masked

    def __post_init__(self) -> None:
        checks = [
            (
                "logprobs",
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                f"null or in [0, {MAX_LOGPROBS}]",
            ),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "in [-2, 2]"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "in [-2, 2]"),
            ("repetition_penalty", 0 < self.repetition_penalty <= 100, "in (0, 100]"),
            ("min_tokens", self.min_tokens >= 0, ">= 0"),
            (
                "logit_bias_ids",
                len(self.logit_bias_ids) == len(self.logit_bias_values) <= MAX_LOGIT_BIAS,
                f"as many as logit_bias_values, at most {MAX_LOGIT_BIAS}",
            ),
            ("logit_bias_values", all(-100 <= v <= 100 for v in self.logit_bias_values), "in [-100, 100]"),
            ("temperature", self.temperature >= 0, ">= 0"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", self.top_k >= 0, ">= 0"),
            ("min_p", 0 <= self.min_p <= 1, "in [0, 1]"),
            ("max_tokens", self.max_tokens >= 1, ">= 1"),
            ("grammar", self.grammar is None or len(self.grammar) <= MAX_SPEC_CHARS, f"at most {MAX_SPEC_CHARS} chars"),
        ]
        for name, ok, limit in checks:
            if not ok:
                raise InputError(f"{name}={getattr(self, name)!r} is invalid; it must be {limit}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def processes_logits(self) -> bool:
        """Logits change before sampling (penalties, bias, min_tokens): the tail must see this stream's history."""
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0
                    or self.min_tokens or self.logit_bias_ids)  # fmt: skip

    @property
    def plain(self) -> bool:
        """Greedy on raw logits with nothing to report: an argmax shared with other rows does."""
        return self.greedy and not self.processes_logits and self.logprobs is None and self.grammar is None

    @property
    def speculates(self) -> bool:
        """Speculation verifies on raw logits and emits no log-probabilities, so streams that
        process their logits (a grammar masks them) or ask for log-probabilities are decoded one
        token a step."""
        return not self.processes_logits and self.logprobs is None and self.grammar is None


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [V] float32 -> probabilities [V] after temperature, top-k, top-p and min-p.

    Safe for every accepted value: the largest logit is moved to 0 before the temperature divides
    (so a tiny temperature sends the others to -inf, never the top one to +inf; below
    ``MIN_TEMPERATURE``, which float32 still holds, every temperature draws alike), and the most
    likely token always survives top-p (a top_p below float32's smallest value is 0 there). Only
    logits that are not finite (a NaN hidden state) give a distribution that cannot be sampled."""
    logits = (logits - logits.max()) / max(params.temperature, MIN_TEMPERATURE)
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop = before >= params.top_p  # keep the smallest prefix whose mass reaches top_p
        drop[0] = False  # and never less than the most likely token
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def top_logprobs(logprobs: torch.Tensor, token: int, top: int) -> TokenLogprobs:
    """logprobs: [V] -> ``token``'s and the ``top`` largest, -inf floored at LOGPROB_FLOOR."""
    floored = logprobs.clamp(min=LOGPROB_FLOOR)
    best = torch.topk(floored, top) if top else None
    return TokenLogprobs(
        float(floored[token]),
        tuple(best.indices.tolist()) if best is not None else (),
        tuple(best.values.tolist()) if best is not None else (),
    )


class StreamSampler:
    """Samples one stream's tokens; the same seed gives the same tokens.

    ``drawn``: tokens the stream sampled before this sampler (a stream prefilled again after a
    lost stage, or continued on another pipeline): the generator first skips that many draws, so
    a seeded stream goes on with the tokens an undisturbed run would draw. A draw consumes the
    generator alike whatever the probabilities (``torch.multinomial`` of one sample draws one
    exponential per vocabulary entry), so skipping is drawing from a uniform distribution of the
    same size. Those ``drawn`` tokens are the input rows at positions [output_position,
    output_position + drawn), which the stream's prefill carries before its first sample:
    :meth:`observe` takes them back into the output history that penalties, min_tokens and the
    grammar read.

    ``grammar``: the stream's grammar state (:mod:`.structured`), which masks its logits last
    (after penalties and bias, before temperature and the filters) and advances with each token;
    a stream prefilled again catches it up on that earlier output before its first sample.
    min_tokens does not hold stop tokens back in a grammar stream: where the grammar may end is
    the grammar's to say."""

    def __init__(self, params: SamplingParams, eos_token_ids: tuple[int, ...] = (), drawn: int = 0,
                 output_position: int = 0, grammar: GrammarState | None = None):  # fmt: skip
        self.params = params
        self.stop_ids = set(params.stop_token_ids if params.stop_token_ids is not None else eos_token_ids)
        self.generated: list[int] = []  # the stream's output (kept only when penalties or a grammar read it)
        self.drawn, self.output_position = drawn, output_position
        self.grammar = grammar
        if grammar is not None:
            grammar.pending = drawn
        self.seen: set[int] = set()  # prompt and fed-back tokens (kept only for repetition_penalty)
        self.generator: torch.Generator | None = None
        self.skip = 0 if params.greedy else drawn  # draws still to skip, once the vocabulary's size is known
        if not params.greedy:
            self.generator = torch.Generator(device="cpu")
            self.generator.manual_seed(params.seed if params.seed is not None else torch.seed())

    def catch_up(self, vocab_size: int) -> None:
        """Skip the draws made before this sampler started (see the class)."""
        uniform = torch.ones(vocab_size)
        for _ in range(self.skip):
            torch.multinomial(uniform, 1, generator=self.generator)
        self.skip = 0

    def observe(self, positions: list[int], token_ids: list[int]) -> None:
        """Input tokens of this stream's rows (its prompt, then its fed-back output), by position."""
        if self.params.repetition_penalty != 1.0:
            self.seen.update(token_ids)
        if (self.params.processes_logits or self.grammar is not None) and len(self.generated) < self.drawn:
            for position, token in zip(positions, token_ids, strict=True):
                if position == self.output_position + len(self.generated) < self.output_position + self.drawn:
                    self.generated.append(token)  # the output drawn before: rows in order, each once

    def sample(self, logits: torch.Tensor) -> int:
        """logits: [V] for this stream's last position."""
        return self.sample_with_logprobs(logits)[0]

    def sample_with_logprobs(self, logits: torch.Tensor) -> tuple[int, TokenLogprobs | None]:
        params = self.params
        logits = self.process(logits.to("cpu", torch.float32)) if params.processes_logits else logits
        if self.grammar is not None:
            if self.grammar.pending:
                if len(self.generated) < self.grammar.pending:
                    raise StructuredOutputError("the stream's committed tokens did not all reach the tail")
                self.grammar.catch_up(self.generated[: self.grammar.pending])
            logits = self.grammar.mask(logits.to("cpu", torch.float32))
        if params.greedy:
            token = int(torch.argmax(logits))
            logprobs = torch.log_softmax(logits.to("cpu", torch.float32), -1) if params.logprobs is not None else None
        else:
            if self.skip:
                self.catch_up(logits.shape[-1])
            probs = filter_logits(logits.to("cpu", torch.float32), params)
            token = int(torch.multinomial(probs, 1, generator=self.generator))
            logprobs = torch.log(probs) if params.logprobs is not None else None
        if params.processes_logits:
            self.generated.append(token)
        if self.grammar is not None:
            self.grammar.accept(token)
        if logprobs is None or params.logprobs is None:
            return token, None
        return token, top_logprobs(logprobs, token, params.logprobs)

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] float32 -> after repetition, frequency and presence penalties, logit bias and min_tokens."""
        params, logits = self.params, logits.clone()
        vocab = logits.shape[-1]
        if params.repetition_penalty != 1.0 and (self.seen or self.generated):
            ids = torch.tensor(sorted(self.seen.union(self.generated)), dtype=torch.int64)
            ids = ids[ids < vocab]
            picked = logits[ids]
            rp = params.repetition_penalty
            logits[ids] = torch.where(picked > 0, picked / rp, picked * rp)
        if (params.frequency_penalty or params.presence_penalty) and self.generated:
            ids, counts = torch.unique(torch.tensor(self.generated, dtype=torch.int64), return_counts=True)
            logits[ids] -= params.frequency_penalty * counts.to(torch.float32) + params.presence_penalty
        if params.logit_bias_ids:
            ids = torch.tensor(params.logit_bias_ids, dtype=torch.int64)
            logits.index_add_(0, ids, torch.tensor(params.logit_bias_values, dtype=torch.float32))
        if len(self.generated) < params.min_tokens and self.stop_ids and self.grammar is None:
            stops = torch.tensor(sorted(t for t in self.stop_ids if t < vocab), dtype=torch.int64)
            logits[stops] = float("-inf")
        return logits


class PromptScorer:
    """Log-probabilities of a stream's prompt tokens, from the logits of its prompt rows: row p's
    log-softmax (of the raw logits: no sampling parameters apply to a prompt) scores the token at
    p + 1, which is the next row of the same frame or, at a window's end, the first row of the
    stream's next frame (this row's log-softmax waits for it, one [V] row per stream)."""

    def __init__(self, top: int, prompt_tokens: int):
        self.top, self.prompt_tokens = top, prompt_tokens
        self.waiting: tuple[int, torch.Tensor] | None = None  # (position, log-softmax [V]) of a window's last row

    def is_prompt_row(self, position: int) -> bool:
        """Rows before the prompt's last are scored, not sampled (the last row's output is the first token)."""
        return position < self.prompt_tokens - 1

    def score(
        self, positions: list[int], logits: torch.Tensor, next_token: dict[int, int]
    ) -> list[tuple[int, TokenLogprobs]]:
        """positions of this stream's prompt rows, their logits [R, V], and the input token of each
        position this frame carries -> (position scored, its log-probabilities), in order."""
        scored = []
        if self.waiting is not None and (token := next_token.get(self.waiting[0] + 1)) is not None:
            scored.append((self.waiting[0] + 1, top_logprobs(self.waiting[1], token, self.top)))
            self.waiting = None
        for position, row in zip(positions, torch.log_softmax(logits.to("cpu", torch.float32), -1), strict=True):
            token = next_token.get(position + 1)
            if token is None:
                self.waiting = (position, row)
            else:
                scored.append((position + 1, top_logprobs(row, token, self.top)))
        return scored


class TailSampler:
    """The samplers of the last stage, one per slot: the one implementation of tail sampling.

    A stream's sampler starts when its first rows pass (``start``) and ends with its slot
    (``release``). ``sample`` draws one token per output row; a row that cannot be sampled fails
    alone, so one stream's values never fail another stream of the same frame.

    ``grammars``: the checkpoint's grammar compiler, for streams with a grammar (None: such a
    stream fails, saying why).
    """

    def __init__(self, eos_token_ids: tuple[int, ...] = (), grammars: Grammars | None = None):
        self.eos_token_ids = eos_token_ids
        self.grammars = grammars
        self.samplers: dict[int, StreamSampler] = {}
        self.scorers: dict[int, PromptScorer] = {}
        self.broken: dict[int, ModelfleetError] = {}  # slot -> why its stream cannot be sampled (its grammar)

    def start(self, slot: int, params: SamplingParams, prompt_tokens: int = 0, drawn: int = 0,
              output_position: int = 0) -> None:  # fmt: skip
        """``drawn``: tokens the stream sampled before, from ``output_position`` on (a replay or a
        continuation; see :class:`StreamSampler`)."""
        self.broken.pop(slot, None)
        grammar = None
        if params.grammar is not None:
            try:
                grammar = self._grammar(params)
            except ModelfleetError as exc:
                self.broken[slot] = exc
        self.samplers[slot] = StreamSampler(params, self.eos_token_ids, drawn, output_position, grammar)
        if params.prompt_logprobs is not None:
            self.scorers[slot] = PromptScorer(params.prompt_logprobs, prompt_tokens)
        else:
            self.scorers.pop(slot, None)

    def _grammar(self, params: SamplingParams) -> GrammarState:
        assert params.grammar is not None
        if self.grammars is None:
            raise StructuredOutputError("this stage has no grammar compiler, so it cannot serve structured output")
        stops = params.stop_token_ids if params.stop_token_ids is not None else self.eos_token_ids
        return self.grammars.state(params.grammar, stops)

    def release(self, slot: int) -> None:
        self.samplers.pop(slot, None)
        self.scorers.pop(slot, None)
        self.broken.pop(slot, None)

    def prompt_rows(self, slots: list[int], positions: list[int]) -> list[bool]:
        """Which output rows are scored prompt rows (of a stream that asked for prompt log-probabilities)."""
        if not self.scorers:
            return [False] * len(slots)
        return [
            (s := self.scorers.get(slot)) is not None and s.is_prompt_row(p)
            for slot, p in zip(slots, positions, strict=True)
        ]

    def score_prompts(
        self, rows: list[tuple[int, int]], logits: torch.Tensor, frame_rows: list[tuple[int, int, int]]
    ) -> dict[int, list[tuple[int, TokenLogprobs]]]:
        """rows: (slot, position) of the prompt rows, logits [R, V] theirs; frame_rows: (slot,
        position, input token) of every row of the frame -> {slot: [(position, log-probabilities)]}."""
        out: dict[int, list[tuple[int, TokenLogprobs]]] = {}
        waiting = [slot for slot, scorer in self.scorers.items() if scorer.waiting is not None]
        for slot in dict.fromkeys(
            [*(slot for slot, _ in rows), *(s for s in waiting if any(r[0] == s for r in frame_rows))]
        ):
            mine = [i for i, (s, _) in enumerate(rows) if s == slot]
            following = {p: t for s, p, t in frame_rows if s == slot}
            scorer = self.scorers[slot]
            out[slot] = scorer.score([rows[i][1] for i in mine], logits[mine], following)
            if out[slot] and out[slot][-1][0] >= scorer.prompt_tokens - 1:
                del self.scorers[slot]  # every prompt token is scored: the stream's rows are sampled from now on
        return out

    def observe(self, slots: list[int], positions: list[int], token_ids: list[int]) -> None:
        """A frame's input rows: streams with penalties or a grammar remember their tokens (a
        replayed stream's earlier output among them)."""
        for slot, position, token in zip(slots, positions, token_ids, strict=True):
            sampler = self.samplers.get(slot)
            if sampler is not None and (sampler.params.processes_logits or sampler.grammar is not None):
                sampler.observe([position], [token])

    def sample(self, slots: list[int], logits: torch.Tensor) -> tuple[dict[int, int], dict[int, ModelfleetError]]:
        """logits [N, V] of the output rows, whose streams are in ``slots`` -> ({slot: token}, {slot: error})."""
        tokens, errors, _ = self.sample_with_logprobs(slots, logits)
        return tokens, errors

    def sample_with_logprobs(
        self, slots: list[int], logits: torch.Tensor
    ) -> tuple[dict[int, int], dict[int, ModelfleetError], dict[int, TokenLogprobs]]:
        """:meth:`sample`, and the log-probabilities of the streams that asked for them."""
        tokens: dict[int, int] = {}
        errors: dict[int, ModelfleetError] = {}
        logprobs: dict[int, TokenLogprobs] = {}
        samplers = [self.samplers.get(slot) for slot in slots]
        if all(s is not None and s.params.plain for s in samplers):  # the common case: one argmax, one read
            return dict(zip(slots, logits.argmax(dim=-1).tolist(), strict=True)), errors, logprobs
        known = [(row, slot) for row, slot in enumerate(slots) if samplers[row] is not None]
        for slot, sampler in zip(slots, samplers, strict=True):
            if sampler is None:
                errors[slot] = InputError(f"slot {slot} has no sampler: its stream's first rows never reached the tail")
        plain = [row for row, slot in known if self.samplers[slot].params.plain]
        if plain:
            picked = logits[plain].argmax(dim=-1).tolist()
            tokens.update((slots[row], token) for row, token in zip(plain, picked, strict=True))
        for row, slot in known:
            if slot in self.broken:
                errors[slot] = self.broken[slot]
            elif not self.samplers[slot].params.plain:
                try:
                    tokens[slot], reported = self.samplers[slot].sample_with_logprobs(logits[row])
                except RuntimeError as exc:  # torch.multinomial on a distribution that is not one
                    errors[slot] = InputError(f"sampling failed for these sampling parameters: {exc}")
                    continue
                except ModelfleetError as exc:  # a grammar that refuses (never for a token its mask allowed)
                    errors[slot] = exc
                    continue
                if reported is not None:
                    logprobs[slot] = reported
        return tokens, errors, logprobs
