"""How many tokens to propose, per stream and step, and when to stop proposing: pure decisions.

The width model (seed 001): with S_i the probability that proposals 1..i all survive
verification, a window of width k emits E(k) = 1 + S_1 + ... + S_k tokens in expectation and costs
D + V(k): D the proposal cost, V(k) the verify step's cost at k proposals. The best width is
k* = argmax E(k) / (D + V(k)) over 0 <= k <= gamma; width 0 is a plain decode row; ties keep the
smaller width.

With several streams in one step the widths are chosen together (:func:`joint_widths`): the
step's cost depends on its total rows, so each extra row goes to the stream whose next proposal
is likeliest to survive (S_i falls with i, so this greedy order gives the most expected tokens for
every total), and the total is the one that maximises expected tokens per second of the step.

V is measured online from the caller's own step times (:class:`StepCosts`: the head's times
include the pipeline's latency; the fastest recent step of each size), forced monotonic in the
row count; only steps of decode rows and verify windows are timed (a prefill window's rows would
price a decode row at a prefill's cost), and a draft model's own time is D, measured apart from
the step's (:class:`~engine.speculative.draft.DraftModelProposer` times its frames). S_i comes from each stream's
measured acceptance per proposal position (:class:`Acceptance`). The :class:`Fallback` controller
stops proposing for a stream whose acceptance falls under tau, and probes again later.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field


def survival(confidences: Sequence[float]) -> list[float]:
    """S_1..S_k: running products of per-position survival confidences."""
    out, running = [], 1.0
    for c in confidences:
        running *= c
        out.append(running)
    return out


def best_width(confidences: Sequence[float], draft_cost: float, verify_cost: Sequence[float]) -> int:
    """k* = argmax over k of E(k) / (D + V(k)); ``verify_cost[k]`` is V(k) for k = 0..gamma
    (forced monotonic here), ``confidences`` the per-position survival confidences (>= gamma of
    them); D applies only when something is proposed."""
    costs = monotonic(verify_cost)
    s = survival(confidences[: len(costs) - 1])
    best, best_rate, expected = 0, 1.0 / costs[0], 1.0
    for k in range(1, len(costs)):
        expected += s[k - 1]
        rate = expected / (draft_cost + costs[k])
        if rate > best_rate:
            best, best_rate = k, rate
    return best


def joint_widths(
    streams: Sequence[Sequence[float]], draft_cost: float, step_cost: StepCosts, row_budget: int
) -> list[int]:
    """Widths for several streams sharing one step: ``streams[j]`` are stream j's per-position
    confidences (its length is the stream's largest width); the step already has one row per
    stream and at most ``row_budget`` rows in all. ``draft_cost`` is D per proposal depth: a
    draft model proposes every stream's i-th token in one frame, so a step whose widest window
    is w pays w * ``draft_cost`` before it is sent (0 for proposers that cost nothing)."""
    widths = [0] * len(streams)
    base = len(streams)
    gains = sorted(
        ((-s, j) for j, confidences in enumerate(streams) for s in survival(confidences)), key=lambda g: g[0]
    )  # each stream's gains fall with the position, so a stream's rows stay in order
    best, best_rate, expected = 0, len(streams) / step_cost.cost(base), float(len(streams))
    trial, depth = [0] * len(streams), 0
    for extra, (neg_gain, j) in enumerate(gains[: max(0, row_budget - base)], start=1):
        expected -= neg_gain
        trial[j] += 1
        depth = max(depth, trial[j])
        rate = expected / (draft_cost * depth + step_cost.cost(base + extra))
        if rate > best_rate:
            best, best_rate = extra, rate
    for _, j in gains[:best]:
        widths[j] += 1
    return widths


def monotonic(costs: Sequence[float]) -> list[float]:
    """The running maximum: a wider window never costs less than a narrower one."""
    out, running = [], 0.0
    for c in costs:
        running = max(running, c)
        out.append(running)
    return out


@dataclass
class StepCosts:
    """Step time by rows, measured: the fastest of the last ``window`` steps of each row count
    (contention only ever slows a step down, so the minimum is the cost and one slow step does
    not price a width out for good), read as a monotonic piecewise-linear function. Row counts
    outside the measured range cost what the nearest measured one does: optimistic (decode steps
    are bound by weight reads, so a few more rows cost little), which makes an unmeasured width
    worth trying once, and the measurement then decides."""

    window: int = 16
    seconds: dict[int, deque[float]] = field(default_factory=dict)

    def record(self, rows: int, seconds: float) -> None:
        self.seconds.setdefault(rows, deque(maxlen=self.window)).append(seconds)

    def cost(self, rows: int) -> float:
        if not self.seconds:
            return 1.0
        known = sorted(self.seconds)
        values = monotonic([min(self.seconds[r]) for r in known])
        i = bisect.bisect_left(known, rows)
        if i == len(known):
            return values[-1]
        if known[i] == rows or i == 0:
            return values[i]
        lo, hi = known[i - 1], known[i]
        return values[i - 1] + (values[i] - values[i - 1]) * (rows - lo) / (hi - lo)


@dataclass
class Acceptance:
    """One stream's survival confidence per proposal position: at position i, the share of
    proposals that survived among those whose earlier proposals all survived (so the verifier
    reached them), from a prior of ``prior`` worth ``prior_weight`` proposals."""

    prior: float = 0.5
    prior_weight: float = 2.0
    reached: list[int] = field(default_factory=list)
    survived: list[int] = field(default_factory=list)

    def record(self, proposed: int, accepted: int) -> None:
        while len(self.reached) < proposed:
            self.reached.append(0)
            self.survived.append(0)
        for i in range(min(proposed, accepted + 1)):  # positions the verifier looked at
            self.reached[i] += 1
            self.survived[i] += i < accepted

    def confidences(self, k: int) -> list[float]:
        """Conditional survival at positions 1..k."""
        w = self.prior_weight
        return [(self._count(self.survived, i) + self.prior * w) / (self._count(self.reached, i) + w) for i in range(k)]

    @staticmethod
    def _count(counts: list[int], i: int) -> int:
        return counts[i] if i < len(counts) else 0


@dataclass
class Fallback:
    """Per request: with A of G verified proposals accepted in the current window, once G >= m
    and A / G < tau, proposing stops for ``cooldown`` target-only steps, then a probe re-enters
    with a fresh window."""

    min_verified: int = 32
    tau: float = 0.6
    cooldown: int = 64
    verified: int = 0
    accepted: int = 0
    paused: int = 0  # target-only steps left
    trips: int = 0

    @property
    def drafting(self) -> bool:
        return self.paused == 0

    def record(self, proposed: int, accepted: int) -> None:
        self.verified += proposed
        self.accepted += accepted
        if self.verified >= self.min_verified and self.accepted < self.tau * self.verified:
            self.paused, self.trips = self.cooldown, self.trips + 1
            self.verified = self.accepted = 0

    def plain_step(self) -> None:
        """A step of this stream without proposals while paused."""
        if self.paused:
            self.paused -= 1
