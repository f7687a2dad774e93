"""When the head calls a pipeline stage lost, and how long a step may take: pure decisions.

Two signals, each with its own deadline, so that a busy stage is not taken for a dead one:

- **Heartbeats.** Every stage after the head sends one every ``HEARTBEAT_INTERVAL_SECONDS`` from a
  thread and a socket of its own, straight to the head, whatever its frames are doing: a stage
  deep in a long frame still beats; a process that is stopped (SIGSTOP), killed or gone does not.
  A stage whose last heartbeat (ready, of the head's plan) is older than its heartbeat deadline
  is lost: every step in flight fails at once, and the head is not ready until it beats again.
  The deadline is ``heartbeat_seconds``, or ``heartbeat_factor`` times the longest of the
  stage's recent gaps between heartbeats when that is longer (a stage starved of CPU beats late,
  but beats), never over ``heartbeat_cap_seconds``: a healthy stage that stops is lost in 3 s.
- **Steps.** A step in flight (a frame on its way through the stages and back as tokens) may
  take ``step_factor`` times the slowest recent round trip for every step in flight (each waits
  behind the others at every stage), never less than ``step_floor_seconds`` and never more than
  ``step_cap_seconds``; with no round trip measured yet, ``unmeasured_seconds``. A step over
  its deadline was lost on the way (a frame dropped toward a restarting stage, a wedged loop):
  its streams fail. The chain probe (through every stage, behind the frames) has the same
  deadline; an answered probe also proves the path the frames take.

Figures that made these defaults (issue 30): on a loaded 2-core machine, 16 streams over three
stages, the head's fixed 3 s deadline on probes that queue behind frames declared healthy
stages dead 25 times in 60 s; a SIGSTOPed stage must still fail its streams within a few seconds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

HEARTBEAT_INTERVAL_SECONDS = 0.5


@dataclass(frozen=True)
class LivenessPolicy:
    heartbeat_seconds: float = 3.0  # a stage whose heartbeats stop this long is lost (a healthy one's deadline)
    heartbeat_factor: float = 3.0  # x the longest recent gap between a stage's heartbeats
    heartbeat_cap_seconds: float = 10.0
    step_floor_seconds: float = 3.0
    step_factor: float = 4.0
    step_cap_seconds: float = 300.0
    unmeasured_seconds: float = 15.0  # before any round trip is measured (a cold start's first steps)


def step_deadline_seconds(policy: LivenessPolicy, round_trips: Sequence[float], steps_in_flight: int) -> float:
    """How long a step (or a chain probe) may be in flight, from the recent round trips of steps
    (seconds) and how many steps are in flight now."""
    if not round_trips:
        return policy.unmeasured_seconds
    derived = policy.step_factor * max(round_trips) * max(1, steps_in_flight)
    return min(policy.step_cap_seconds, max(policy.step_floor_seconds, derived))


def heartbeat_deadline_seconds(policy: LivenessPolicy, gaps: Sequence[float]) -> float:
    """How long a stage may be silent, from its recent gaps between heartbeats (seconds)."""
    longest = max(gaps, default=0.0)
    return min(policy.heartbeat_cap_seconds, max(policy.heartbeat_seconds, policy.heartbeat_factor * longest))


def lost_stages(
    policy: LivenessPolicy, now: float, heartbeats: Mapping[int, float], stages: Sequence[int], since: float,
    gaps: Mapping[int, Sequence[float]] | None = None,
) -> list[int]:  # fmt: skip
    """The stages (of ``stages``) whose last heartbeat, or ``since`` (when the head started
    listening) for one never heard, is older than its deadline (``gaps``: each stage's recent
    gaps between heartbeats)."""
    gaps = gaps or {}
    return [s for s in stages if now - heartbeats.get(s, since) > heartbeat_deadline_seconds(policy, gaps.get(s, ()))]


def chain_ready(
    policy: LivenessPolicy, now: float, lost: Sequence[int], last_probe_answered: float | None,
    probe_outstanding_since: float | None, step_deadline: float,
) -> bool:  # fmt: skip
    """Every stage beats, a chain probe has come back, and none is overdue past a step's deadline."""
    if lost or last_probe_answered is None:
        return False
    return probe_outstanding_since is None or now - probe_outstanding_since <= step_deadline
