"""`modelfleet up` supervises its children: a stage or gateway that exits is restarted, with backoff.

As the operator replaces a failed stage pod alone and counts ``restartPolicy.maxStageRestarts``
per pod, a local fleet restarts a child that exited alone, at most ``max_stage_restarts`` times
per child, after ``backoff_seconds`` doubling per restart (up to ``backoff_cap_seconds``). The
head replays its streams into a restarted stage (:mod:`.head`). When a child's budget is spent the
fleet is failed, with a reason naming the child and how it exited.

The decision (:func:`on_exit`) is pure; :class:`Supervisor` does it to a :class:`LocalFleet`. A
restarted child is told its restart count (``MF_RESTARTS``), which its /status and metrics show.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import dataclass

from .launcher import LocalFleet

RESTARTS_ENV = "MF_RESTARTS"


@dataclass(frozen=True)
class RestartPolicy:
    max_stage_restarts: int = 3  # per child, as restartPolicy.maxStageRestarts counts per stage pod
    backoff_seconds: float = 1.0  # before the first restart; doubles with each further one
    backoff_cap_seconds: float = 30.0


@dataclass(frozen=True)
class Restart:
    delay_seconds: float
    message: str


@dataclass(frozen=True)
class GiveUp:
    reason: str


def exit_description(returncode: int) -> str:
    """``code 1``, or ``signal SIGKILL`` for a child a signal ended (Popen's negative code)."""
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"code {returncode}"


def on_exit(policy: RestartPolicy, child: str, returncode: int, restarts: int) -> Restart | GiveUp:
    """What to do about ``child`` that exited with ``returncode`` after ``restarts`` restarts."""
    how = exit_description(returncode)
    if restarts >= policy.max_stage_restarts:
        return GiveUp(f"{child} exited with {how} after {restarts} restart(s) "
                      f"(--max-stage-restarts={policy.max_stage_restarts})")  # fmt: skip
    delay = min(policy.backoff_cap_seconds, policy.backoff_seconds * 2**restarts)
    return Restart(delay, f"{child} exited with {how}; restarting it in {delay:g} s "
                          f"(restart {restarts + 1} of {policy.max_stage_restarts})")  # fmt: skip


class Supervisor:
    """Call :meth:`poll` every fraction of a second; ``failed`` holds the reason once a budget is spent."""

    def __init__(self, fleet: LocalFleet, policy: RestartPolicy, say: Callable[[str], None]):
        self.fleet, self.policy, self.say = fleet, policy, say
        self.restarts: dict[str, int] = {}  # child name -> restarts so far
        self.due: dict[int, float] = {}  # child index -> when its restart is due (monotonic)
        self.failed: str | None = None

    def poll(self, now: float) -> None:
        for index, child in enumerate(self.fleet.children):
            code = child.process.poll()
            if code is None or index in self.due or self.failed is not None:
                continue
            decision = on_exit(self.policy, child.name, code, self.restarts.get(child.name, 0))
            if isinstance(decision, GiveUp):
                self.failed = decision.reason
                return
            self.say(decision.message)
            self.due[index] = now + decision.delay_seconds
        for index, at in list(self.due.items()):
            if now >= at:
                del self.due[index]
                name = self.fleet.children[index].name
                self.restarts[name] = self.restarts.get(name, 0) + 1
                self.fleet.respawn(index, {RESTARTS_ENV: str(self.restarts[name])})
